# Sourced on an offline GPU machine from the checkout's root: `source .gpu/env.sh`.
# Installs the bundled wheels once per machine into /tmp/site, points Python at them and at the
# project, sets the offline data, tokenizer and cache paths and the offline switches, checks the
# installed versions against pyproject.toml's ranges and prints the versions that will run.
bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$bundle"/whl/*.whl \
    && touch /tmp/site/.done || echo "env.sh: installing the wheels failed"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export RLHF_TLDR_DIR=$bundle/data/tldr
export RLHF_TOKENIZER_DIR=$bundle/tok
export RLHF_CACHE_DIR=${RLHF_CACHE_DIR:-/tmp/rlhf-cache}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 infra/offline-gpu/check_versions.py || echo "env.sh: a package above is outside the project's range: bundle it (GPU_PACKAGES=... make gpu-bundle)"
python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
