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


def test_the_gate_across_seeds_holds_for_the_committed_runs_and_fails_a_seed_under_the_margin(tmp_path, capsys):
    """The nine committed runs (three estimators, seeds 1-3): each estimator's mean rise has a 95%
    t interval (2 df) above 0 and every seed clears 0.1, though two runs' own intervals reach
    below 0; a seed whose rise is under the margin fails its estimator."""
    import json

    from benchmarks.ppo_learning import across_seeds, main

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    files = sorted(results.glob("ppo_learning-*-seed[123]-amd-epyc-avx512bf16.json"))
    runs = [json.loads(f.read_text()) for f in files]
    gate = across_seeds(runs)
    assert sorted(gate) == ["gae", "grpo", "rloo"] and all(g["seeds"] == [1, 2, 3] for g in gate.values())
    expected = {"gae": (0.231, 0.098, 0.363), "rloo": (0.239, 0.140, 0.337), "grpo": (0.241, 0.211, 0.271)}
    for estimator, (mean, low, high) in expected.items():
        g = gate[estimator]
        assert (round(g["mean_rise"], 3), round(g["ci_low"], 3), round(g["ci_high"], 3)) == (mean, low, high)
        assert g["passed"] is True
    assert sum(run["verdict"]["passed"] is False for run in runs) == 2  # each run's own interval: information
    assert main(["--across-seeds", *map(str, files)]) == 0
    assert "gae: seeds [1, 2, 3], rises +0.234, +0.282, +0.176; mean +0.231 [+0.098, +0.363]" in capsys.readouterr().out
    low = json.loads(files[0].read_text())
    low["verdict"]["rise"] = 0.09
    (tmp_path / "low.json").write_text(json.dumps(low))
    others = [f for f in files if low["args"]["advantage_estimator"] in f.name and f != files[0]]
    assert main(["--across-seeds", str(tmp_path / "low.json"), *map(str, others)]) == 1
    assert main(["--across-seeds", str(files[0])]) == 2  # one seed: no interval
