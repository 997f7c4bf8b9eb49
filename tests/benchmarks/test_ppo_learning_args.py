"""benchmarks/ppo_learning.py: the preset overrides it builds from its arguments."""

from pathlib import Path

from benchmarks.ppo_learning import overrides, parse_args


def test_the_rows_folder_is_passed_only_when_there_is_one():
    """With no rows folder (no ``--tldr-dir``, no ``$RLHF_TLDR_DIR``, nothing beside the
    repository) the preset's own data source stands; with one, it is the data's local folder."""
    args = parse_args(["--updates", "3", "--batch-size", "4"])
    args.tldr_dir = None
    built = overrides(args)
    assert not any(o.startswith("data.local_dir=") for o in built)
    assert "ppo.total_episodes=12" in built
    args.tldr_dir = Path("rows")
    assert overrides(args)[0] == f"data.local_dir={Path('rows').resolve()}"


def test_the_advantage_estimator_is_passed_and_its_settings_validate():
    from rlhf_core.config.presets import load_config

    built = overrides(parse_args(["--advantage-estimator", "rloo"]))
    assert "ppo.advantage_estimator=rloo" in built
    ppo = load_config("cpu-demo", built).ppo
    assert (ppo.advantage_estimator, ppo.samples_per_prompt, ppo.batch_size) == ("rloo", 4, 16)
    assert "ppo.advantage_estimator=gae" in overrides(parse_args([]))
