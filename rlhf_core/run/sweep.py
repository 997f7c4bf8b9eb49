"""Sweeps: the paper's experiments as a grid of pipeline runs, and their summary.

Huang et al. (2024, arXiv:2403.17031) report no single run: Figure 1 and Table 5 are four
seeds x three Pythia sizes, given as mean and spread (two of the four 1B seeds collapse),
and Figure 7 is an ablation. A sweep spec (YAML in ``configs/sweeps/``) names base presets
(one per model size), seeds and a grid of overrides; each cell of their product is one
pipeline run. This module is pure: it loads and expands specs, reads each cell's metrics
from its stage records and summarises them. Running the cells is the ``sweep`` flow's job
(``flows/sweep.py``), where stages equal across cells are shared through the cache.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..common.io import PRESET_DIR
from ..config.credentials import check_no_credentials, format_validation_error, holds_credential
from ..config.data_settings import IN_DISTRIBUTION_SPLIT
from ..config.presets import load_config, parse_override, read_yaml_mapping
from ..config.settings import ConfigError, PipelineConfig

SWEEP_DIR = PRESET_DIR / "sweeps"

#: What a cell's seed sets: every seeded section (SFT, reward model, DPO, PPO and the
#: evaluation's sampling) and the top-level ``seed``. The data and the base model carry no
#: seed, so cells that differ only in seed share them.
SEED_KEYS = ("seed", "sft.seed", "reward.seed", "dpo.seed", "ppo.seed", "eval.seed")


class HealthRule(BaseModel):
    """When a cell is flagged as diverging from its siblings (the cells that differ from it
    only in seed; the paper's collapsed 1B seeds, Figure 1): its final PPO KL, or its final PPO
    response length, is more than ``kl_ratio`` (``length_ratio``) times, or less than
    1/ratio times, the median of its siblings' values. A KL is only compared when it or the
    median is at least ``kl_floor`` nats (ratios of KLs near zero are noise). Needs at least
    ``min_siblings`` siblings with the value."""

    model_config = ConfigDict(extra="forbid")

    kl_ratio: float = Field(2.0, gt=1)
    length_ratio: float = Field(1.5, gt=1)
    kl_floor: float = Field(1.0, ge=0)
    min_siblings: int = Field(2, gt=0)


class SweepSpec(BaseModel):
    """A sweep: ``presets`` x ``seeds`` x the product of ``grid``'s values, every cell with
    ``overrides`` too, run up to stage ``until`` (every stage when None).

    ``max_concurrent`` cells run at once. ``concurrency_limits`` maps task tags to how many
    stage tasks with the tag may run at once on the orchestrator (its tag concurrency limits,
    which hold across every flow and worker using it; the stage tasks' tags are ``gpu`` and
    ``judge-api``, ``tasks.stages.stage_tags``); a limit is set where the orchestrator has none
    for the tag, and an existing one is kept."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    presets: list[str] = Field(min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [1], min_length=1)
    overrides: list[str] = []
    grid: dict[str, list[Any]] = {}
    until: str | None = None
    health: HealthRule = Field(default_factory=HealthRule)
    max_concurrent: int = Field(1, gt=0)
    concurrency_limits: dict[str, Annotated[int, Field(gt=0)]] = {}

    @field_validator("grid")
    @classmethod
    def _grid_values(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            if not values:
                raise ValueError(f"grid.{key}: needs at least one value")
            if key in SEED_KEYS:
                raise ValueError(f"grid.{key}: seeds are set by `seeds`, not by the grid")
        return grid

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds {seeds} repeat a seed")
        return seeds


@dataclass(frozen=True)
class Cell:
    """One pipeline run of a sweep: ``preset`` with ``overrides`` (the spec's, then the grid
    values ``settings``, then the seed's)."""

    preset: str
    seed: int
    settings: tuple[tuple[str, Any], ...]
    overrides: tuple[str, ...] = field(repr=False)

    @property
    def name(self) -> str:
        """``preset/seed=S`` then ``key=value`` per grid setting, e.g. ``smoke/seed=2/ppo.whiten_rewards=true``;
        a value that may be a credential is ``<not shown>`` (:func:`expand` refuses such a spec)."""
        return "/".join([self.preset, f"seed={self.seed}", *(_shown(k, v) for k, v in self.settings)])

    @property
    def group(self) -> str:
        """The cell's name without its seed: cells of one group are siblings (seeds of one setting)."""
        return "/".join([self.preset, *(_shown(k, v) for k, v in self.settings)])


def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def _shown(key: str, value: Any) -> str:
    return f"{key}=<not shown>" if holds_credential(value, key.rsplit(".", 1)[-1]) else f"{key}={_yaml_scalar(value)}"


def load_sweep(spec: str | os.PathLike, sweep_dir: Path = SWEEP_DIR) -> SweepSpec:
    """Load a sweep spec: a name in ``configs/sweeps/`` or a path to a YAML file.

    Raises:
        ConfigError: unknown spec, unreadable YAML, or a bad field (naming it and the file).
    """
    path, tree = read_yaml_mapping(spec, sweep_dir, "sweep")
    try:
        return SweepSpec.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"sweep {path.name}", SweepSpec)) from None


def expand(spec: SweepSpec) -> list[Cell]:
    """The spec's cells, presets outermost, then grid settings, then seeds.

    Raises:
        ConfigError: a grid value or an override looks like a credential (naming its key, before
            any cell is named: cell names are flow-run names, MLflow tags and log lines), or two
            cells would have the same name.
    """
    origin = f"sweep {spec.name}"
    check_no_credentials({f"grid.{key}": values for key, values in spec.grid.items()}, origin)
    for text in spec.overrides:
        path, value = parse_override(text)
        check_no_credentials({".".join(path): value}, origin)
    keys = list(spec.grid)
    cells = []
    for preset in spec.presets:
        for values in itertools.product(*(spec.grid[k] for k in keys)):
            settings = tuple(zip(keys, values, strict=True))
            grid_overrides = [f"{k}={_yaml_scalar(v)}" for k, v in settings]
            for seed in spec.seeds:
                seeds = [f"{k}={seed}" for k in SEED_KEYS]
                cells.append(Cell(preset, seed, settings, (*spec.overrides, *grid_overrides, *seeds)))
    names = [c.name for c in cells]
    if len(set(names)) != len(names):
        raise ConfigError(f"sweep {spec.name}: presets or grid values repeat, giving cells of one name")
    return cells


def cell_configs(spec: SweepSpec, cells: Iterable[Cell]) -> dict[str, PipelineConfig]:
    """Every cell's validated configuration, before any cell runs.

    Raises:
        ConfigError: naming the cell and the key, for the first cell that does not load.
    """
    from .pipeline import STAGES

    if spec.until is not None and spec.until not in STAGES:
        raise ConfigError(f"sweep {spec.name}: until={spec.until!r} is not a stage ({', '.join(STAGES)})")
    configs = {}
    for cell in cells:
        try:
            configs[cell.name] = load_config(cell.preset, list(cell.overrides))
        except ConfigError as exc:
            raise ConfigError(f"sweep {spec.name}, cell {cell.name}: {exc}") from None
    return configs


# ------------------------------------------------------------------------------ summary

_IN_DIST = f"eval/{IN_DISTRIBUTION_SPLIT}"
#: The summary's columns: ``(column, stage, metric, interval metrics or None)``. The metric is
#: read from the stage's record (``StageRecord.metrics``); PPO's are its final update's. "RM
#: accuracy" and "DPO accuracy" are on the TL;DR validation comparisons (out of distribution:
#: other policies, Detail 6); the "in-distribution" ones on the comparisons held out of the
#: reward model's training split (``data.preference_splits.train.holdout``), where a cell has them.
COLUMNS: tuple[tuple[str, str, str, tuple[str, str] | None], ...] = (
    ("SFT ROUGE-L", "sft", "eval/rougeL", None),
    (
        "RM in-distribution accuracy",
        "reward_eval",
        f"{_IN_DIST}/accuracy",
        (f"{_IN_DIST}/accuracy_ci_low", f"{_IN_DIST}/accuracy_ci_high"),
    ),
    # the baselines on the same pairs (rlhf_core.evaluation.reward_eval.baseline_accuracies)
    ("RM in-distribution baseline: longer wins", "reward_eval", f"{_IN_DIST}/baseline/longer_wins/accuracy", None),
    (
        "RM in-distribution baseline: preferred policy wins",
        "reward_eval",
        f"{_IN_DIST}/baseline/policy_prior/accuracy",
        None,
    ),
    ("RM accuracy", "reward_eval", "eval/accuracy", ("eval/accuracy_ci_low", "eval/accuracy_ci_high")),
    (
        "DPO in-distribution accuracy",
        "dpo_eval",
        f"{_IN_DIST}/accuracy",
        (f"{_IN_DIST}/accuracy_ci_low", f"{_IN_DIST}/accuracy_ci_high"),
    ),
    ("DPO accuracy", "dpo_eval", "eval/accuracy", ("eval/accuracy_ci_low", "eval/accuracy_ci_high")),
    ("PPO win rate", "evaluation", "eval/ppo/win_rate", ("eval/ppo/win_rate_ci_low", "eval/ppo/win_rate_ci_high")),
    ("DPO win rate", "evaluation", "eval/dpo/win_rate", ("eval/dpo/win_rate_ci_low", "eval/dpo/win_rate_ci_high")),
    ("PPO KL", "ppo", "objective/kl", None),
    ("PPO response length", "ppo", "response/length_mean", None),
    # PPO's learning check, measured by the PPO stage itself against the SFT policy on the same
    # evaluation prompts (rlhf_core.ppo.eval.learning_check_metrics), so that `until: ppo` has it
    (
        "PPO objective gain vs SFT",
        "ppo",
        "eval/objective_gain_vs_sft",
        ("eval/objective_gain_vs_sft_ci_low", "eval/objective_gain_vs_sft_ci_high"),
    ),
    ("PPO KL vs SFT", "ppo", "eval/kl_vs_sft", None),
    (
        "PPO score gain vs SFT",
        "ppo",
        "eval/score_gain_vs_sft",
        ("eval/score_gain_vs_sft_ci_low", "eval/score_gain_vs_sft_ci_high"),
    ),
    ("PPO EOS rate", "ppo", "eval/eos_rate_policy", ("eval/eos_rate_policy_ci_low", "eval/eos_rate_policy_ci_high")),
    ("PPO repetition rate", "ppo", "eval/repetition_rate_policy", None),
    ("SFT repetition rate", "ppo", "eval/repetition_rate_sft", None),
)
KL_COLUMN, LENGTH_COLUMN = "PPO KL", "PPO response length"
#: What the summary says of its accuracy columns: out of distribution, and in distribution where shown.
ACCURACY_NOTES = (
    "RM and DPO accuracy: the reward model's and DPO's implicit reward model's, on the TL;DR validation "
    "comparisons: out of distribution (other policies than the training pairs', Detail 6); per cell with "
    "its 95% Wilson interval.",
    f"RM and DPO in-distribution accuracy: on the comparisons held out of the training split "
    f"({IN_DISTRIBUTION_SPLIT}).",
)


@dataclass
class CellResult:
    """A finished or failed cell: its stages' metrics (``{stage: {metric: value}}``), the
    base model's parameter count (the model size), its MLflow run, and the error if it failed."""

    cell: Cell
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    error: str | None = None

    @property
    def parameters(self) -> float:
        """The base model's parameter count (nan when its stage did not run)."""
        return float(self.stages.get("base_model", {}).get("parameters", math.nan))

    def value(self, column: str) -> tuple[float, float, float]:
        """``(value, ci_low, ci_high)`` of a :data:`COLUMNS` column; nan where absent."""
        _, stage, metric, interval = next(c for c in COLUMNS if c[0] == column)
        m = self.stages.get(stage, {})
        low, high = (m.get(interval[0], math.nan), m.get(interval[1], math.nan)) if interval else (math.nan, math.nan)
        return float(m.get(metric, math.nan)), float(low), float(high)


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def group_stats(results: list[CellResult], column: str) -> dict[str, float | int]:
    """Mean, sample standard deviation (nan for fewer than 2) and count of a column's finite
    values over ``results``."""
    values = _finite(r.value(column)[0] for r in results)
    return {
        "mean": statistics.fmean(values) if values else math.nan,
        "std": statistics.stdev(values) if len(values) > 1 else math.nan,
        "n": len(values),
    }


def health_flags(results: list[CellResult], rule: HealthRule) -> dict[str, list[str]]:
    """Cells that diverge from their siblings (:class:`HealthRule`): ``{cell name: reasons}``,
    each reason naming the value, the siblings' median and the rule."""
    flags: dict[str, list[str]] = {}
    groups: dict[str, list[CellResult]] = {}
    for r in results:
        groups.setdefault(r.cell.group, []).append(r)
    for members in groups.values():
        for r in members:
            for column, ratio, floor in (
                (KL_COLUMN, rule.kl_ratio, rule.kl_floor),
                (LENGTH_COLUMN, rule.length_ratio, 0.0),
            ):
                value = r.value(column)[0]
                others = _finite(s.value(column)[0] for s in members if s is not r)
                if math.isnan(value) or len(others) < rule.min_siblings:
                    continue
                median = statistics.median(others)
                if max(value, median) < floor or median <= 0:
                    continue
                if value > ratio * median or value < median / ratio:
                    flags.setdefault(r.cell.name, []).append(
                        f"{column} {value:.3g} vs its siblings' median {median:.3g} (outside x{ratio:g} either way)"
                    )
    return flags


def _fmt(value: float, ci: tuple[float, float] = (math.nan, math.nan)) -> str:
    if math.isnan(value):
        return "-"
    text = f"{value:.3f}"
    if not any(math.isnan(c) for c in ci):
        text += f" [{ci[0]:.3f}, {ci[1]:.3f}]"
    return text


def summary_markdown(spec: SweepSpec, results: list[CellResult], flags: Mapping[str, list[str]]) -> str:
    """The sweep's summary: per preset (model size), one row per grid setting with each
    column's mean +- standard deviation over seeds, then every cell's own values (intervals
    where the metric has one), failed cells with their error, and flagged cells."""
    columns = [c for c, *_ in COLUMNS if any(not math.isnan(r.value(c)[0]) for r in results)]
    lines = [f"# Sweep {spec.name}", ""]
    if spec.description:
        lines += [spec.description.strip(), ""]
    done = [r for r in results if r.error is None]
    lines.append(f"{len(done)} of {len(results)} cells finished; seeds {spec.seeds}.")
    if any(c.endswith("accuracy") for c in columns):
        in_dist = any("in-distribution" in c for c in columns)
        lines += ["", " ".join(ACCURACY_NOTES if in_dist else ACCURACY_NOTES[:1])]
    for preset in spec.presets:
        cells = [r for r in done if r.cell.preset == preset]
        if not cells:
            continue
        size = next((r.parameters for r in cells if not math.isnan(r.parameters)), math.nan)
        size_text = "" if math.isnan(size) else f" ({size / 1e6:,.1f}M parameters)"
        lines += ["", f"## {preset}{size_text}", "", "Mean +- standard deviation over seeds (n cells):", ""]
        lines += ["| setting | n | " + " | ".join(columns) + " |", "|---|---:|" + "---:|" * len(columns)]
        groups: dict[str, list[CellResult]] = {}
        for r in cells:
            groups.setdefault(r.cell.group, []).append(r)
        for group, members in groups.items():
            setting = group.removeprefix(preset).lstrip("/") or "(preset)"
            stats = [group_stats(members, c) for c in columns]
            row = [f"{s['mean']:.3f} +- {s['std']:.3f}" if s["n"] > 1 else _fmt(float(s["mean"])) for s in stats]
            lines.append(f"| {setting} | {len(members)} | " + " | ".join(row) + " |")
        lines += ["", "Per cell:", "", "| cell | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
        for r in cells:
            row = [_fmt(v, (lo, hi)) for v, lo, hi in (r.value(c) for c in columns)]
            lines.append(f"| {r.cell.name}{' (flagged)' if r.cell.name in flags else ''} | " + " | ".join(row) + " |")
    failed = [r for r in results if r.error is not None]
    if failed:
        lines += ["", "## Failed cells", ""] + [f"- {r.cell.name}: {r.error}" for r in failed]
    if flags:
        lines += ["", "## Seeds flagged as diverging from their siblings", ""]
        lines += [f"- {name}: {'; '.join(reasons)}" for name, reasons in flags.items()]
    return "\n".join(lines) + "\n"


def summary_rows(results: list[CellResult], flags: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    """One flat row per cell (for an MLflow table or JSON): cell, preset, seed, grid settings,
    parameters, each column's value and interval, flagged, error."""
    rows = []
    for r in results:
        row: dict[str, Any] = {
            "cell": r.cell.name,
            "preset": r.cell.preset,
            "seed": r.cell.seed,
            **{k: v for k, v in r.cell.settings},
            "parameters": r.parameters,
            "mlflow_run_id": r.mlflow_run_id,
            "flagged": r.cell.name in flags,
            "error": r.error,
        }
        for column, *_ in COLUMNS:
            value, low, high = r.value(column)
            row[column] = value
            if not math.isnan(low):
                row[f"{column} ci_low"], row[f"{column} ci_high"] = low, high
        rows.append(row)
    return rows


def sweep_axis(results: list[CellResult]) -> str:
    """What a sweep's plots put on the x axis: ``"parameters"`` (model size, Figure 1) when its
    cells have more than one base-model size, else ``"setting"`` (the grid setting: an ablation)."""
    sizes = {r.parameters for r in results if not math.isnan(r.parameters)}
    return "parameters" if len(sizes) > 1 else "setting"


def plot_sweep(results: list[CellResult], column: str, path: str | os.PathLike) -> Path:
    """``column`` per cell, seeds as points and group means as lines: against model size
    (parameters, log scale) when the sweep has several sizes (Figure 1), else against the grid
    setting (an ablation, Figure 7).

    Returns:
        ``path``, a PNG.
    """
    from ..views.plots import pyplot, savefig_atomic

    done = [r for r in results if r.error is None and not math.isnan(r.value(column)[0])]
    by_size = sweep_axis(done) == "parameters"
    fig, ax = pyplot().subplots(figsize=(6, 4))
    series: dict[str, list[CellResult]] = {}
    for r in done:
        label = "/".join(f"{k}={_yaml_scalar(v)}" for k, v in r.cell.settings) or "preset settings"
        series.setdefault(label if by_size else r.cell.preset, []).append(r)

    def setting(r: CellResult) -> str:
        return r.cell.group.partition("/")[2] or "(preset)"

    settings = sorted({setting(r) for r in done})
    for i, (label, members) in enumerate(series.items()):
        if by_size:
            xs = [r.parameters for r in members]
        else:  # settings side by side, one preset's points a little apart from another's
            xs = [settings.index(setting(r)) + 0.1 * (i - (len(series) - 1) / 2) for r in members]
        ys = [r.value(column)[0] for r in members]
        means = {x: statistics.fmean(y for xi, y in zip(xs, ys, strict=True) if xi == x) for x in sorted(set(xs))}
        ax.plot(list(means), list(means.values()), marker="_", markersize=16, label=f"{label} (mean)")
        ax.scatter(xs, ys, alpha=0.7, s=18)
    if by_size:
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
    else:
        ax.set_xticks(range(len(settings)), settings, rotation=20, ha="right", fontsize=7)
    if "win rate" in column:
        ax.axhline(0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_ylabel(column)
    ax.set_title(f"{column}: seeds as points", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return savefig_atomic(fig, path)


#: The grid setting that Figure 7 compares: PPO with and without reward whitening (Detail 24).
WHITENING = "ppo.whiten_rewards"


def length_points(
    results: list[CellResult],
) -> tuple[dict[str, tuple[float, dict[str, float]]], dict[str, str], float | None]:
    """Every policy of every finished cell (base, SFT, PPO, DPO) as a point of the win rate by mean
    summary length (:func:`plot_win_rate_by_length_sweep`): its mean length in tokens and win rate
    with interval, named ``"{cell} {policy}"``; its group, the policy and preset (model size) and,
    for PPO when the sweep's grid holds both reward whitening settings (Figure 7, Detail 24),
    ``reward whitening on``/``off``; and the references' mean length.

    Returns:
        ``(points, groups, reference mean length or None)``.
    """
    done = [r for r in results if r.error is None and r.stages.get("evaluation")]
    both = len({dict(r.cell.settings).get(WHITENING) for r in done} - {None}) > 1
    points: dict[str, tuple[float, dict[str, float]]] = {}
    groups: dict[str, str] = {}
    for r in done:
        m = r.stages["evaluation"]
        for key, label in (("base", "base"), ("sft", "SFT"), ("ppo", "PPO"), ("dpo", "DPO")):
            if f"eval/{key}/response_tokens" not in m:
                continue
            name = f"{r.cell.name} {label}"
            groups[name] = f"{label} {r.cell.preset}"
            if both and key == "ppo":
                groups[name] += f", reward whitening {'on' if dict(r.cell.settings)[WHITENING] else 'off'}"
            points[name] = (
                m[f"eval/{key}/response_tokens"],
                {
                    "win_rate": m.get(f"eval/{key}/win_rate", math.nan),
                    "ci_low": m.get(f"eval/{key}/win_rate_ci_low", math.nan),
                    "ci_high": m.get(f"eval/{key}/win_rate_ci_high", math.nan),
                },
            )
    references = _finite(r.stages["evaluation"].get("eval/reference/response_tokens", math.nan) for r in done)
    return points, groups, statistics.fmean(references) if references else None


def plot_win_rate_by_length_sweep(results: list[CellResult], path: str | os.PathLike) -> Path | None:
    """Every policy of every finished cell on one plot: its win rate against the references by its
    mean summary length in tokens (Huang et al. 2024, Figure 7 right and Figure 8 left), one
    colour per group of :func:`length_points` (policy and size, and reward whitening when the
    sweep holds both), the seeds its points (:func:`rlhf_core.views.plots.plot_win_rate_by_length`).

    Returns:
        ``path``, or ``None`` when no cell has an evaluation to plot.
    """
    from ..views.plots import plot_win_rate_by_length

    points, groups, reference = length_points(results)
    if not points:
        return None
    return plot_win_rate_by_length(points, path, reference_tokens=reference, groups=groups)
