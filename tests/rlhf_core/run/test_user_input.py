"""What the ``rlhf`` command says about bad input: every bad setting named in one line, the
nearest known key suggested, options and overrides in any order, and no credential echoed by
argparse or in a sweep cell's name."""

import pytest
import yaml

from rlhf_core import __version__
from rlhf_core.config.credentials import holds_key, redact
from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError
from rlhf_core.run.cli import main
from rlhf_core.run.sweep import SweepSpec, expand
from tests.rlhf_core.config.test_config import KEYS


@pytest.mark.parametrize(
    "overrides, message",
    [
        # the cases of `rlhf config --preset smoke ...` whose message named no key, or not the whole key
        (["ppo.kl_coef.x=1"], "ppo.kl_coef: Input should be a valid number, not a section (ppo.kl_coef.x given)"),
        (
            ["eval.judge.api_key=hello"],
            "eval.judge: Input should be 'offline', 'anthropic' or 'openai', not a section (eval.judge.api_key given)",
        ),
        (["sft.bf16=maybe"], "sft.bf16: Input should be a valid boolean, unable to interpret input, or 'auto'"),
        (["ppo.kl_coef=[1,2"], "override ppo.kl_coef: value '[1,2' is not valid YAML: "),
        (["sft.lora.r=8", "sft.strategy=fsdp"], "sft.lora.r 8 needs sft.strategy ddp"),
        (["ppo.kl_coeff=0.1"], "ppo.kl_coeff: unknown key; did you mean ppo.kl_coef"),
        (["sft.kl_coef=0.1"], "sft.kl_coef: unknown key; did you mean ppo.kl_coef?"),
        (["ppoo.kl_coef=0.1"], "ppoo: unknown key; did you mean ppo?"),
        (["ppo.lora.rr=8"], "ppo.lora.rr: unknown key; did you mean ppo.lora.r?"),
    ],
)
def test_every_bad_setting_is_named_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("smoke", overrides)
    lines = str(err.value).splitlines()
    assert any(message in line for line in lines), str(err.value)
    assert len(lines) <= 2, str(err.value)  # the heading and the one bad key
    assert "bool" not in str(err.value).replace("boolean", "")  # pydantic's union member tags


def test_a_key_under_a_mapping_of_optional_sections_is_named_whole():
    """``data.preference_splits`` maps split names to sections whose ``holdout`` may be null."""
    with pytest.raises(ConfigError) as err:
        load_config("cpu-demo", ["data.preference_splits.train.holdout.rowz=3"])
    assert str(err.value).splitlines()[1:] == [
        "  data.preference_splits.train.holdout.rowz: unknown key; did you mean data.preference_splits.train.holdout.rows?"
    ]


def test_yaml_errors_give_the_file_or_override_and_the_line_and_column(tmp_path):
    with pytest.raises(ConfigError, match=r"^override ppo\.kl_coef: .*'<stream end>' at line 1, column 5$"):
        load_config("smoke", ["ppo.kl_coef=[1,2"])
    preset = tmp_path / "mine.yaml"
    preset.write_text("name: mine\nsft:\n  batch_size: 8\n   lr: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(preset)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"preset {preset}: not valid YAML: ") and "at line 4, column 6" in str(err.value)


def test_options_and_overrides_mix_in_any_order(capsys):
    assert main(["config", "ppo.kl_coef=0.125", "--preset", "smoke", "sft.max_steps=3"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["name"] == "smoke" and cfg["ppo"]["kl_coef"] == 0.125 and cfg["sft"]["max_steps"] == 3


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"rlhf {__version__}"


@pytest.mark.parametrize("key, value", KEYS, ids=[k for k, _ in KEYS])
def test_no_credential_is_echoed_by_argparse_or_named_in_a_sweep_cell(key, value, capsys):
    """Each key shape the settings refuse: in an argparse error ("unrecognized arguments", an
    invalid choice), and as a sweep grid value or override, which is refused naming its key before
    any cell is named."""
    argvs = [["verify", "some-dir", f"{key}={value}"]]  # verify takes no overrides: "unrecognized arguments"
    if holds_key(value):  # a key shape anywhere: here an invalid choice of --until
        argvs.append(["stages", "--out", "x", "--until", value])
    for argv in argvs:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        captured = capsys.readouterr()
        assert exit_.value.code == 2 and "error:" in captured.err
        assert value not in captured.out + captured.err, argv
    assert value not in redact(f"unrecognized arguments: {key}={value}" + (f" {value}" if holds_key(value) else ""))
    grid = SweepSpec(name="leak", presets=["smoke"], grid={key: ["a", value]})
    overrides = SweepSpec(name="leak", presets=["smoke"], overrides=[f"{key}={value}"])
    for spec, named in ((grid, f"grid.{key}"), (overrides, key)):
        with pytest.raises(ConfigError, match=f"^{named} \\(sweep leak\\): the value looks like a credential") as err:
            expand(spec)
        assert value not in str(err.value)


def test_an_option_given_with_a_space_has_its_credential_redacted():
    """``--api-key VALUE`` and ``--token VALUE``, as argparse echoes unrecognized arguments, hide
    a random value as ``--api-key=VALUE`` does; an option that names no credential, or a value
    that is no credential (a Secret block's name), is shown."""
    random_value = "Zk3lQ9xR2mT7vB4nC8pD1sF6gH0jK5"
    for option in ("--api-key", "--token", "--hf_token", "-apikey", "--eval.api_key"):
        said = redact(f"rlhf: error: unrecognized arguments: {option} {random_value} --until sft")
        assert said == f"rlhf: error: unrecognized arguments: {option} <not shown> --until sft", option
    for key, value in KEYS:  # a key shape after any option
        if holds_key(value):
            assert value not in redact(f"unrecognized arguments: --model {value}"), key
    shown = "unrecognized arguments: --tokenizer gpt2 --token-budget 12 --api-key-secret anthropic-key --max-tokens 64"
    assert redact(shown) == shown
