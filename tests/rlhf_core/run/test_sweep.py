"""Sweep specs, their cells and the summary (rlhf_core.run.sweep); the flow is tested in tests/flows/test_sweep.py."""

import math
import statistics

import pytest

from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError
from rlhf_core.run.sweep import (
    SEED_KEYS,
    SWEEP_DIR,
    Cell,
    CellResult,
    HealthRule,
    SweepSpec,
    cell_configs,
    expand,
    group_stats,
    health_flags,
    length_points,
    load_sweep,
    plot_sweep,
    plot_win_rate_by_length_sweep,
    summary_markdown,
    summary_rows,
    sweep_axis,
)

SHIPPED = sorted(p.stem for p in SWEEP_DIR.glob("*.yaml"))


def test_the_shipped_specs_are_the_papers_experiments_and_the_test_specs():
    assert SHIPPED == [
        "cpu-seeds",
        "estimators",
        "paper-figure1",
        "score-position",
        "smoke-seeds",
        "whitening-ablation",
    ]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_spec_and_each_of_its_cells_loads_and_validates(name):
    spec = load_sweep(name)
    cells = expand(spec)
    configs = cell_configs(spec, cells)
    assert len(cells) == len(spec.presets) * len(spec.seeds) * math.prod(len(v) for v in spec.grid.values())
    for cell in cells:
        cfg = configs[cell.name]
        assert cfg.name == cell.preset
        assert {cfg.seed, cfg.sft.seed, cfg.reward.seed, cfg.dpo.seed, cfg.ppo.seed, cfg.eval.seed} == {cell.seed}
        for key, value in cell.settings:
            section, field = key.split(".")
            assert getattr(getattr(cfg, section), field) == value


def test_figure1_spans_the_papers_three_sizes_and_four_seeds():
    spec = load_sweep("paper-figure1")
    bases = [load_config(p).model.base for p in spec.presets]
    assert bases == ["EleutherAI/pythia-1b-deduped", "EleutherAI/pythia-2.8b-deduped", "EleutherAI/pythia-6.9b-deduped"]
    assert spec.seeds == [1, 2, 3, 4]
    for preset in spec.presets:  # one learning rate at every size (Figure 1's caption), the paper's batches
        cfg = load_config(preset)
        assert {cfg.sft.learning_rate, cfg.reward.learning_rate, cfg.ppo.learning_rate} == {3e-6}
        assert (cfg.sft.batch_size, cfg.reward.batch_size, cfg.ppo.batch_size) == (128, 64, 512)
        assert not cfg.batch_errors(8)  # 8 GPUs
    assert load_sweep("whitening-ablation").grid == {"ppo.whiten_rewards": [False, True]}
    assert load_sweep("score-position").grid == {"ppo.score_position": ["eos", "after_eos"]}


def test_cells_are_presets_by_grid_by_seeds_with_the_seed_last():
    spec = SweepSpec(
        name="t", presets=["smoke"], seeds=[3, 4], overrides=["sft.max_steps=2"], grid={"ppo.kl_coef": [0.1, 0.2]}
    )
    cells = expand(spec)
    assert [c.name for c in cells] == [
        "smoke/seed=3/ppo.kl_coef=0.1",
        "smoke/seed=4/ppo.kl_coef=0.1",
        "smoke/seed=3/ppo.kl_coef=0.2",
        "smoke/seed=4/ppo.kl_coef=0.2",
    ]
    assert cells[0].group == cells[1].group == "smoke/ppo.kl_coef=0.1" != cells[2].group
    assert cells[3].overrides == ("sft.max_steps=2", "ppo.kl_coef=0.2", *(f"{k}=4" for k in SEED_KEYS))
    cfg = cell_configs(spec, cells)[cells[3].name]
    assert (cfg.sft.max_steps, cfg.ppo.kl_coef, cfg.ppo.seed) == (2, 0.2, 4)


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"name": "t", "presets": ["smoke"], "seeds": [1, 1]}, "repeat a seed"),
        ({"name": "t", "presets": ["smoke"], "grid": {"ppo.seed": [1, 2]}}, "grid.ppo.seed"),
        ({"name": "t", "presets": ["smoke"], "grid": {"ppo.kl_coef": []}}, "grid.ppo.kl_coef"),
        ({"name": "t", "presets": []}, "presets"),
        ({"name": "t", "presets": ["smoke"], "sedes": [1]}, "sedes"),
        ({"name": "t", "presets": ["smoke"], "max_concurrent": 0}, "max_concurrent"),
        ({"name": "t", "presets": ["smoke"], "concurrency_limits": {"gpu": 0}}, "concurrency_limits.gpu"),
    ],
)
def test_a_bad_spec_fails_naming_its_file_and_field(tmp_path, tree, message):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match="bad.yaml") as info:
        load_sweep(path)
    assert message in str(info.value)


def test_an_unknown_spec_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="cpu-seeds"):
        load_sweep("no-such-sweep")


def test_a_cell_that_does_not_load_fails_before_any_runs_naming_the_cell_and_key():
    spec = SweepSpec(name="t", presets=["smoke"], seeds=[1], grid={"ppo.kl_coeff": [0.1]})
    with pytest.raises(ConfigError, match=r"cell smoke/seed=1/ppo.kl_coeff=0.1: .*ppo.kl_coeff"):
        cell_configs(spec, expand(spec))
    with pytest.raises(ConfigError, match="until='nope' is not a stage"):
        cell_configs(SweepSpec(name="t", presets=["smoke"], until="nope"), [])


# ---------------------------------------------------------------------------- summary


def result(seed: int, kl: float, length: float, win: float = 0.5, group: str = "a", preset: str = "p") -> CellResult:
    cell = Cell(preset, seed, (("ppo.kl_coef", group),), ())
    stages = {
        "ppo": {"objective/kl": kl, "response/length_mean": length},
        "evaluation": {
            "eval/ppo/win_rate": win,
            "eval/ppo/win_rate_ci_low": win - 0.1,
            "eval/ppo/win_rate_ci_high": win + 0.1,
        },
        "base_model": {"parameters": 1e9 if preset == "p" else 3e9},
    }
    return CellResult(cell, stages, f"run{seed}")


def test_group_stats_are_the_mean_and_sample_std_over_seeds():
    results = [result(s, kl, 20.0, win) for s, kl, win in [(1, 2.0, 0.4), (2, 3.0, 0.5), (3, 4.0, 0.9)]]
    stats = group_stats(results, "PPO win rate")
    assert stats == {"mean": pytest.approx(0.6), "std": pytest.approx(statistics.stdev([0.4, 0.5, 0.9])), "n": 3}
    assert group_stats(results[:1], "PPO KL")["std"] != group_stats(results[:1], "PPO KL")["std"]  # nan for one seed
    assert group_stats(results, "RM accuracy")["n"] == 0


def test_a_seed_whose_kl_or_length_diverges_from_its_siblings_is_flagged():
    rule = HealthRule(kl_ratio=2.0, length_ratio=1.5, kl_floor=1.0, min_siblings=2)
    healthy = [result(1, 2.0, 24.0), result(2, 2.5, 26.0), result(3, 3.0, 25.0)]
    assert health_flags(healthy, rule) == {}
    collapsed = healthy + [result(4, 9.0, 25.0), result(5, 2.6, 12.0)]  # KL x3.5, length /2
    flags = health_flags(collapsed, rule)
    assert set(flags) == {"p/seed=4/ppo.kl_coef=a", "p/seed=5/ppo.kl_coef=a"}
    assert (
        "PPO KL 9" in flags["p/seed=4/ppo.kl_coef=a"][0]
        and "PPO response length 12" in flags["p/seed=5/ppo.kl_coef=a"][0]
    )
    # KLs all under the floor are noise; a cell in another group is no sibling; too few siblings: nothing
    assert health_flags([result(1, 0.01, 24.0), result(2, 0.01, 24.0), result(3, 0.5, 24.0)], rule) == {}
    assert health_flags([result(1, 2.0, 24.0), result(2, 2.0, 24.0), result(3, 9.0, 24.0, group="b")], rule) == {}
    assert health_flags([result(1, 2.0, 24.0), result(2, 9.0, 24.0)], rule) == {}


def test_the_summary_gives_means_spreads_each_cell_with_its_interval_failures_and_flags(tmp_path):
    spec = SweepSpec(name="t", presets=["p"], seeds=[1, 2, 3])
    results = [
        result(1, 2.0, 24.0, 0.4),
        result(2, 3.0, 26.0, 0.6),
        CellResult(Cell("p", 3, (("ppo.kl_coef", "a"),), ()), error="X: y"),
    ]
    md = summary_markdown(spec, results, {"p/seed=2/ppo.kl_coef=a": ["PPO KL 3 vs ..."]})
    assert "2 of 3 cells finished" in md and "## p (1,000.0M parameters)" in md
    header = next(line for line in md.splitlines() if line.startswith("| setting"))
    assert header == "| setting | n | PPO win rate | PPO KL | PPO response length |"
    assert "| ppo.kl_coef=a | 2 | 0.500 +- 0.141 | 2.500 +- 0.707 | 25.000 +- 1.414 |" in md
    assert "| p/seed=1/ppo.kl_coef=a | 0.400 [0.300, 0.500] | 2.000 | 24.000 |" in md
    assert "| p/seed=2/ppo.kl_coef=a (flagged) |" in md
    assert "- p/seed=3/ppo.kl_coef=a: X: y" in md and "- p/seed=2/ppo.kl_coef=a: PPO KL 3 vs ..." in md
    rows = summary_rows(results, {})
    assert rows[0]["PPO win rate"] == 0.4 and rows[0]["PPO win rate ci_high"] == 0.5 and rows[0]["ppo.kl_coef"] == "a"
    assert rows[2]["error"] == "X: y" and math.isnan(rows[2]["PPO KL"])


def test_the_plots_are_against_size_across_presets_and_against_the_setting_within_one(tmp_path):
    across = [result(s, 2.0, 24.0, 0.4 + 0.1 * s, preset=p) for p in ("p", "q") for s in (1, 2)]
    within = [result(s, 2.0, 24.0, 0.5, group=g) for g in ("a", "b") for s in (1, 2)]
    assert sweep_axis(across) == "parameters" and sweep_axis(within) == "setting"
    for name, results in (("size", across), ("setting", within)):
        path = plot_sweep(results, "PPO win rate", tmp_path / f"{name}.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_the_summary_gives_reward_model_and_dpo_accuracy_in_and_out_of_distribution(tmp_path):
    results = []
    for seed, (rm_in, rm_out, dpo_in) in enumerate([(0.70, 0.53, 0.66), (0.68, 0.55, 0.64)], 1):
        r = result(seed, 2.0, 24.0)
        for stage, in_dist, ood in (("reward_eval", rm_in, rm_out), ("dpo_eval", dpo_in, None)):
            m = r.stages.setdefault(stage, {})
            m |= {"eval/validation_in_dist/accuracy": in_dist}
            m |= {"eval/validation_in_dist/accuracy_ci_low": in_dist - 0.06}
            m |= {"eval/validation_in_dist/accuracy_ci_high": in_dist + 0.06}
            if ood is not None:
                m |= {"eval/accuracy": ood, "eval/accuracy_ci_low": ood - 0.07, "eval/accuracy_ci_high": ood + 0.07}
        results.append(r)
    assert results[0].value("RM in-distribution accuracy") == pytest.approx((0.70, 0.64, 0.76))
    assert results[0].value("RM accuracy") == pytest.approx((0.53, 0.46, 0.60))
    assert results[1].value("DPO in-distribution accuracy") == pytest.approx((0.64, 0.58, 0.70))
    md = summary_markdown(SweepSpec(name="t", presets=["p"], seeds=[1, 2]), results, {})
    header = next(line for line in md.splitlines() if line.startswith("| setting"))
    assert header == (
        "| setting | n | RM in-distribution accuracy | RM accuracy | DPO in-distribution accuracy "
        "| PPO win rate | PPO KL | PPO response length |"
    )
    assert "| p/seed=1/ppo.kl_coef=a | 0.700 [0.640, 0.760] | 0.530 [0.460, 0.600] | 0.660 [0.600, 0.720] |" in md
    assert "out of distribution" in md and "held out of the training split (validation_in_dist)" in md
    rows = summary_rows(results, {})
    assert rows[1]["RM in-distribution accuracy"] == 0.68
    assert rows[1]["RM in-distribution accuracy ci_low"] == pytest.approx(0.62)
    assert rows[0]["DPO in-distribution accuracy ci_high"] == pytest.approx(0.72)
    assert math.isnan(rows[0]["DPO accuracy"])  # DPO was not evaluated out of distribution here
    # without in-distribution comparisons, no such column and no word of them
    ood_only = result(1, 2.0, 24.0)
    ood_only.stages["reward_eval"] = {"eval/accuracy": 0.55}
    md = summary_markdown(SweepSpec(name="t", presets=["p"]), [ood_only], {})
    assert "| RM accuracy |" in md and "out of distribution" in md and "in-distribution" not in md


def test_the_estimators_cells_of_a_seed_share_every_stage_before_ppo():
    """gae and rloo on cpu-demo: the same 16 episodes per update (16 prompts x 1, 4 x 4), and the
    same data, SFT and reward-model stages for a seed, so the sweep trains those once a seed."""
    from rlhf_core.run.pipeline import STAGES, stage_key

    spec = load_sweep("estimators")
    cells = expand(spec)
    configs = cell_configs(spec, cells)
    assert len(cells) == 6
    for seed in spec.seeds:
        gae, rloo = (configs[c.name] for c in cells if c.seed == seed)
        assert (gae.ppo.advantage_estimator, gae.ppo.samples_per_prompt) == ("gae", 1)
        assert (rloo.ppo.advantage_estimator, rloo.ppo.samples_per_prompt) == ("rloo", 4)
        assert gae.ppo.batch_size == rloo.ppo.batch_size == 16
        for stage in STAGES:  # by their own settings; the stages after PPO differ through its output
            same = stage_key(stage, gae, [], store="s") == stage_key(stage, rloo, [], store="s")
            assert same == (stage != "ppo"), stage


def _whitening_cell(seed: int, whiten: bool, preset: str = "p", tokens: float = 30.0) -> CellResult:
    cell = Cell(preset, seed, (("ppo.whiten_rewards", whiten),), ())
    evaluation = {"eval/reference/response_tokens": 40.0 + seed}
    for key, win in (("sft", 0.3), ("ppo", 0.6 if whiten else 0.7)):
        evaluation |= {
            f"eval/{key}/win_rate": win,
            f"eval/{key}/win_rate_ci_low": win - 0.1,
            f"eval/{key}/win_rate_ci_high": win + 0.1,
            f"eval/{key}/response_tokens": tokens - (5 if whiten else 0),
        }
    return CellResult(cell, {"evaluation": evaluation}, f"run{seed}")


def test_every_policy_of_every_cell_by_length_with_and_without_reward_whitening(tmp_path):
    """Figure 7 (right) and Figure 8 (left) of a sweep: each cell's policies by mean length, PPO's
    split by reward whitening when the grid holds both settings; failed cells left out."""
    results = [_whitening_cell(s, w) for s in (1, 2) for w in (True, False)]
    results.append(CellResult(Cell("p", 3, (("ppo.whiten_rewards", True),), ()), error="X: y"))
    points, groups, reference = length_points(results)
    assert len(points) == 8 and reference == pytest.approx(41.5)
    assert points["p/seed=1/ppo.whiten_rewards=true PPO"] == (25.0, {"win_rate": 0.6, "ci_low": 0.5, "ci_high": 0.7})
    assert groups["p/seed=1/ppo.whiten_rewards=true PPO"] == "PPO p, reward whitening on"
    assert groups["p/seed=2/ppo.whiten_rewards=false PPO"] == "PPO p, reward whitening off"
    assert groups["p/seed=2/ppo.whiten_rewards=false SFT"] == "SFT p"  # SFT does not whiten
    assert len(set(groups.values())) == 3
    one_setting = [_whitening_cell(s, True, preset) for s in (1, 2) for preset in ("p", "q")]
    assert set(length_points(one_setting)[1].values()) == {"PPO p", "PPO q", "SFT p", "SFT q"}
    path = plot_win_rate_by_length_sweep(results, tmp_path / "win_rate_by_length.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert plot_win_rate_by_length_sweep(results[-1:], tmp_path / "none.png") is None
