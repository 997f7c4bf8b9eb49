"""The installed ``rlhf`` command: the stage commands of :mod:`rlhf_core.run.cli` plus ``rlhf run``,
``rlhf sweep`` and ``rlhf check``.

``rlhf run --preset NAME [key=value ...]`` runs the ``rlhf`` flow in this process (Prefect's
ephemeral mode when no ``PREFECT_API_URL`` is set), every stage cached, tracking to MLflow:
``MLFLOW_TRACKING_URI`` when set, else a SQLite store in the run directory. Artifacts and
stage work directories go to the run directory (``--out``, default ``runs/<preset>``)::

    runs/cpu-demo/artifacts/<stage>/<cache key>/   stage artifacts (RLHF_ARTIFACT_ROOT)
    runs/cpu-demo/work/<stage>/<cache key>/        stage work directories and checkpoints
    runs/cpu-demo/mlflow.db, runs/cpu-demo/mlartifacts/   the local MLflow store

``rlhf sweep SPEC`` runs a sweep spec's cells (``configs/sweeps/``) the same way, in
``runs/sweep-<spec>`` (:func:`sweep_main`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rlhf_core.config.settings import PipelineConfig
from rlhf_core.run import cli as core


def run_directory(args: argparse.Namespace, cfg: PipelineConfig) -> Path:
    """The run directory: ``--out``, else ``runs/<preset name>``."""
    return (args.out or Path("runs") / (Path(args.preset).stem if args.preset else cfg.name)).resolve()


def run_locations(args: argparse.Namespace, root: Path) -> dict[str, str]:
    """Where ``rlhf run`` keeps artifacts and work directories: ``{variable: path}`` for
    ``RLHF_ARTIFACT_ROOT`` and ``RLHF_WORK_DIR``, under the run directory ``root`` when ``--out``
    is given or the variable is unset, else the variable's value."""
    return {
        name: str(root / sub) if args.out is not None or not os.environ.get(name) else os.environ[name]
        for name, sub in (("RLHF_ARTIFACT_ROOT", "artifacts"), ("RLHF_WORK_DIR", "work"))
    }


def cmd_run(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    root = run_directory(args, cfg)
    root.mkdir(parents=True, exist_ok=True)
    os.environ.update(run_locations(args, root))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    from rlhf_core.run.pipeline import stages_until
    from tasks.stages import preflight

    # as the flow does first, but before its Prefect server starts: errors at once
    preflight(cfg, stages_until(args.until))
    from flows.pipeline import rlhf

    result = rlhf(preset=args.preset, overrides=args.overrides, until=args.until)
    uri = cfg.tracking.tracking_uri or os.environ["MLFLOW_TRACKING_URI"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from mlflow import MlflowClient

        experiment = MlflowClient(uri).get_run(result["mlflow_run_id"]).info.experiment_id
        print(summary(result, uri, experiment))
    return 0


def cmd_evaluate(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    """``rlhf evaluate``: the flow ``evaluate`` (:mod:`flows.evaluate`) in this process, in the run
    directory as ``rlhf run`` uses it (its stores, so a run's data stage is taken from the cache)."""
    root = run_directory(args, cfg)
    root.mkdir(parents=True, exist_ok=True)
    os.environ.update(run_locations(args, root))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    from flows.evaluate import EVALUATE_STAGES, evaluate, with_policies
    from tasks.mlflow_tracking import tracking_client
    from tasks.stages import preflight

    # as the flow does first, but before its Prefect server starts: errors at once, in one line
    client = tracking_client(cfg.tracking.tracking_uri)
    preflight(with_policies(cfg, args.policy or [], args.reward, client)[0], EVALUATE_STAGES)
    result = evaluate(preset=args.preset, policies=args.policy or [], reward=args.reward, overrides=args.overrides)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    metrics = result["stages"]["policy_eval"]["metrics"]
    print(f"rlhf evaluate: finished; MLflow run {result['mlflow_run_id']}")
    for name, key in result["policies"].items():
        low, high = metrics[f"eval/{key}/win_rate_ci_low"], metrics[f"eval/{key}/win_rate_ci_high"]
        print(
            f"  {name}: win rate {metrics[f'eval/{key}/win_rate']:.1%} [{low:.1%}, {high:.1%}], "
            f"ROUGE-L {metrics[f'eval/{key}/rougeL']:.3f}, {metrics[f'eval/{key}/response_tokens']:.1f} tokens"
        )
    print(f"report: {result['report']} (also under report/ in the MLflow run)")
    return 0


def cmd_check(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    """``rlhf check``: what a run of ``cfg`` up to ``--until`` checks before its first stage
    (:func:`rlhf_core.run.preflight.check_before_stages`: the data rows, fetched from the hub for the
    offline presets when no folder holds them; model sources; ``ppo.reward``; the splits; the
    judge's key; the OpenAI judge's server), with no run directory or store. An API judge's
    Prefect Secret block is looked up on the server ``PREFECT_API_URL`` names; with none named, a
    run's own check looks it up when the run starts."""
    from rlhf_core.config.settings import check_world_size
    from rlhf_core.run.launch import nproc_per_node
    from rlhf_core.run.pipeline import stages_until
    from rlhf_core.run.preflight import check_before_stages

    stages = stages_until(args.until)
    check_world_size(cfg, nproc_per_node())
    lookup = None
    variable, secret = cfg.eval.judge_key_variable, cfg.eval.judge_key_secret
    if cfg.eval.judge_needs_key and "evaluation" in stages and not os.environ.get(variable or ""):
        if os.environ.get("PREFECT_API_URL"):
            from tasks.stages import secret_block_exists as lookup
        elif secret is not None:
            unset = f"{variable} is unset" if variable else "the judge's key is in no environment variable"
            print(
                f"rlhf check: {unset}; the Prefect Secret block {secret!r} "
                "(eval.api_key_secret) is looked up on the Prefect server when the run starts",
                file=sys.stderr,
            )
            lookup = lambda name: True  # noqa: E731  (left to the run's own check)
    check_before_stages(cfg, stages, secret_exists=lookup)
    print(f"rlhf check: preset {cfg.name}: {len(stages)} stages ({stages[0]} to {stages[-1]}) can start")
    return 0


def cmd_plan(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    """``rlhf plan``: one line per stage up to ``--until``: its name, its key and whether it will
    run or be taken from the cache. A run directory of the stage commands (``rlhf stages``) is
    planned from its finished stages (:func:`rlhf_core.run.cli.plan_stages`); any other, as ``rlhf
    run`` would use it (default ``runs/<preset>``), from the artifact store and the Prefect cache
    entries beside it (:func:`tasks.stages.plan_run`). Runs nothing, writes nothing, loads no
    torch."""
    from rlhf_core.run.pipeline import stages_until

    root = run_directory(args, cfg)
    if (root / core.RUN_MARKER).is_file():
        return core.cmd_plan(cfg, argparse.Namespace(**{**vars(args), "out": root}))
    from tasks.stages import plan_run
    from tasks.storage import ArtifactStore

    where = run_locations(args, root)
    planned = plan_run(
        cfg, stages_until(args.until), ArtifactStore(where["RLHF_ARTIFACT_ROOT"]), Path(where["RLHF_WORK_DIR"])
    )
    core.print_plan(cfg, planned)
    return 0


def summary(result: dict, tracking_uri: str, experiment_id: str) -> str:
    """What a finished ``rlhf run`` prints: each stage's artifact, the registered versions, where
    the report is, and how to open the runs in the MLflow UI: a link to experiment
    ``experiment_id``'s training runs (:func:`tasks.mlflow_tracking.ui_link`), on the tracking
    server or on ``mlflow ui`` over the local store (its default address)."""
    from tasks.mlflow_tracking import ui_address, ui_link

    stages = result["stages"]
    width = max(len(name) for name in stages)
    lines = [f"rlhf run: finished; MLflow run {result['mlflow_run_id']}"]
    lines += [f"  {name:<{width}}  {record['uri']}" for name, record in stages.items()]
    if result["registered"]:
        lines.append("registered: " + ", ".join(f"{m} version {v}" for m, v in result["registered"].items()))
    if result.get("report"):
        lines.append(f"report: {result['report']} (also under report/ in the MLflow run)")
    address, first = ui_address(tracking_uri)
    link = ui_link(address, experiment_id)
    lines.append(f"MLflow UI: {first}, then {link}" if first else f"MLflow UI: {link}")
    return "\n".join(lines)


#: ``rlhf sweep``'s line in ``rlhf --help``.
SWEEP_HELP = "run a sweep spec's cells (presets x seeds x grid) and summarise them"


def sweep_parser() -> core.ArgumentParser:
    """``rlhf sweep``'s parser (its options and overrides in any order, errors redacted)."""
    parser = core.ArgumentParser(prog="rlhf sweep", description=SWEEP_HELP)
    parser.add_argument("spec", help="a spec in configs/sweeps/ (e.g. cpu-seeds) or a YAML path")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every cell")
    parser.add_argument("--out", type=Path, default=None, help="run directory (default runs/sweep-<spec>)")
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        metavar="N",
        help="cells at once (default: the spec's max_concurrent)",
    )
    parser.add_argument("--check", action="store_true", help="validate the spec and its cells; run nothing")
    parser.add_argument("--json", action="store_true", help="print the sweep's record as JSON")
    return parser


def sweep_main(argv: list[str]) -> int:
    """``rlhf sweep SPEC [key=value ...] [--out DIR] [--max-concurrent N] [--check] [--json]``: the sweep flow
    (:func:`flows.sweep.sweep`) in this process, stores under ``--out`` as ``rlhf run``'s (default
    ``runs/sweep-<spec>``); ``--check`` loads and validates the spec and every cell's
    configuration, prints the cells and runs nothing. The arguments are parsed before Prefect is
    imported (:func:`prefect_settings`), so that ``--help`` and argument errors answer at once."""
    args = sweep_parser().parse_intermixed_args(argv)
    prefect_settings()
    from pydantic import ValidationError

    from rlhf_core.common.errors import DataError, ModelSourceError
    from rlhf_core.config.settings import ConfigError
    from rlhf_core.run.pipeline import stages_until
    from rlhf_core.run.sweep import SweepSpec, cell_configs, expand, load_sweep
    from tasks.storage import ArtifactError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = load_sweep(args.spec)
        spec = spec.model_copy(update={"overrides": [*spec.overrides, *args.overrides]})
        if args.max_concurrent is not None:
            spec = SweepSpec.model_validate(spec.model_dump() | {"max_concurrent": args.max_concurrent})
        cells = expand(spec)
        configs = cell_configs(spec, cells)
        if args.check:
            print(
                f"sweep {spec.name}: {len(cells)} cells, {spec.max_concurrent} at a time, "
                f"until {spec.until or 'the last stage'}"
            )
            for cell in cells:
                print(f"  {cell.name}  (preset {configs[cell.name].name})")
            return 0
        root = (args.out or Path("runs") / f"sweep-{spec.name}").resolve()
        root.mkdir(parents=True, exist_ok=True)
        for key, path in (("RLHF_ARTIFACT_ROOT", root / "artifacts"), ("RLHF_WORK_DIR", root / "work")):
            if args.out is not None or not os.environ.get(key):  # as `rlhf run`
                os.environ[key] = str(path)
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        from flows.sweep import SweepError, check_pipeline_deployment, sweep
        from tasks.stages import preflight

        for cfg in configs.values():  # as the flow does first, but before a Prefect server starts
            preflight(cfg, stages_until(spec.until))
        if spec.max_concurrent > 1:
            check_pipeline_deployment(spec)
        try:
            result = sweep(spec=args.spec, overrides=args.overrides, max_concurrent=args.max_concurrent)
        except SweepError as exc:
            print(f"rlhf sweep: {exc}", file=sys.stderr)
            return 1
    except (ConfigError, DataError, ModelSourceError, ArtifactError, ValidationError) as exc:
        print(f"rlhf sweep: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(Path(result["summary"]).read_text() + f"\nMLflow UI, the cells side by side: {result['compare']}")
    return 0


COMMANDS: dict[str, core.Command] = {
    **core.COMMANDS,
    "check": core.Command(
        cmd_check,
        "check, in seconds, what a run of the preset would read before its first stage (data rows, "
        "models, reward function, splits, the judge's key) and exit; no stage runs",
        out="none",
        until=True,
    ),
    "plan": core.Command(
        cmd_plan,
        "print each stage up to --until with its cache key and whether it will run or be taken from "
        "the cache: rlhf run's artifact store under --out (default runs/<preset>), or the finished "
        "stages of an rlhf stages run directory; runs nothing",
        out="optional",
        until=True,
    ),
    "evaluate": core.Command(
        cmd_evaluate,
        "judge any policies (local directories, hub ids[@REVISION], registered models:/NAME@ALIAS) against "
        "the preset's references as the Prefect flow rlhf/evaluate: ROUGE-L, win rates, length, one MLflow "
        "run and a report (stores under --out, default runs/<preset>)",
        out="optional",
        flags=(("--json", "print the evaluation's record as JSON"),),
        options=(
            ("--policy", "a policy to evaluate; repeat for several", True),
            (
                "--reward",
                "a reward model to score the summaries: a directory, model:SOURCE or models:/NAME@ALIAS",
                False,
            ),
        ),
    ),
    "run": core.Command(
        cmd_run,
        "run the whole pipeline as the Prefect flow `rlhf` in this process, every stage "
        "cached and tracked in MLflow (artifacts under --out, default runs/<preset>)",
        out="optional",
        until=True,
        flags=(("--json", "print the run's record as JSON (every stage's record, registered versions)"),),
    ),
}


def prefect_settings() -> None:
    """Settings Prefect reads on import, then Prefect imported (with the flows): nothing phones
    home, and the ephemeral server, which migrates its database on a first start, gets time to
    start on a small, busy machine. Prefect sets up its log handlers on import, so this comes
    before the command's own logging is set up."""
    for key, value in (
        ("DO_NOT_TRACK", "1"),
        ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
        ("MLFLOW_DISABLE_TELEMETRY", "true"),
        ("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"),
    ):
        os.environ.setdefault(key, value)
    import flows.pipeline  # noqa: F401  (imports Prefect)

    logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlhf`` console script; returns the process exit code."""
    from tasks.storage import ArtifactError

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["sweep"]:
        return sweep_main(args[1:])
    if args[:1] in (["run"], ["evaluate"]) and not {"-h", "--help"} & set(args):
        prefect_settings()
    return core.main(argv, COMMANDS, user_errors=(ArtifactError,), listed={"sweep": SWEEP_HELP})


if __name__ == "__main__":
    sys.exit(main())
