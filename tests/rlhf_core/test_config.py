import math

import pytest

from rlhf_core.config import ConfigError, available_presets, flatten, load_config, parse_override

PRESETS = ["smoke", "cpu-demo", "pythia-1b", "pythia-2.8b", "pythia-6.9b", "llama-3.2-1b-h200"]


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
    from rlhf_core.config import check_world_size

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
