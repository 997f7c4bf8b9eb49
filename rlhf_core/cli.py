"""The ``rlhf`` command: one sub-command per pipeline stage, plus ``stages`` for all of them.

Every sub-command takes ``--preset NAME`` (a file in ``configs/``; default ``cpu-demo``, the
deployment's) and ``key=value`` overrides, e.g. ``rlhf data --preset smoke data.on_bad_row=skip --out runs/x/data``. These
sub-commands write plain directories and need neither Prefect nor MLflow; the installed
``rlhf`` script (``flows/cli.py``) adds ``rlhf run``, the orchestrated, tracked pipeline.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from .config import ConfigError, PipelineConfig, available_presets, load_config
from .errors import DataError, ModelSourceError, TrainingError
from .pipeline import STAGES, stage_keys

log = logging.getLogger("rlhf")

#: The preset of a command given none: the deployment's (infra/prefect.yaml), which runs on a
#: CPU. The paper's settings are a preset too (``pythia-1b``), never a silent default.
DEFAULT_PRESET = "cpu-demo"


def _stage_marker(out: Path) -> dict:
    marker = out / "stage.json"
    return json.loads(marker.read_text()) if marker.is_file() else {}


def run_stages(cfg: PipelineConfig, root: Path, until: str, overwrite: bool = False) -> dict:
    """Run the stages up to ``until`` into ``root/<stage>``.

    A stage finished earlier with the same key (its settings, its inputs' keys and the code
    version: :func:`rlhf_core.pipeline.stage_key`) is reused; one interrupted with the same
    key resumes from its checkpoints; one made with another key, or whose files no longer match
    the sizes and SHA-256 its ``stage.json`` recorded when it finished (a warning names the
    file), is removed and run again. With
    ``RLHF_NPROC_PER_NODE`` above 1, SFT, the reward model and PPO run as a ``torchrun`` job of
    that many processes (:func:`rlhf_core.launch.launch_torchrun`). A second ``rlhf stages`` on
    the same directory waits for the first (a lock naming the holder), then reuses its stages.

    Raises:
        LaunchError: a ``torchrun`` job failed; ValueError: a bad ``RLHF_NPROC_PER_NODE``.
    """
    from .config import check_world_size
    from .io import exclusive_lock
    from .launch import nproc_per_node

    nproc = nproc_per_node()
    check_world_size(cfg, nproc)  # before any stage, not when the first data-parallel one starts
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / ".rlhf-stages.lock", what=f"the run directory {root}"):  # one writer
        return _run_stages_locked(cfg, root, until, overwrite, nproc)


def _run_stages_locked(cfg: PipelineConfig, root: Path, until: str, overwrite: bool, nproc: int) -> dict:
    import shutil

    from .io import manifest_mismatch, tree_manifest, write_json_atomic
    from .launch import DATA_PARALLEL, launch_torchrun
    from .tracking import JsonlTracker, NullTracker

    (root / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    summary = {}
    for name, key in stage_keys(cfg, until).items():
        stage = STAGES[name]
        out = root / name
        marker = _stage_marker(out)
        if marker.get("key") == key and marker.get("status") == "done" and not overwrite:
            damage = (
                manifest_mismatch(out, marker["manifest"]) if "manifest" in marker else "stage.json has no manifest"
            )
            if damage is None:
                log.info("stage %s: finished earlier with the same config and code, reused (%s)", name, out)
                summary[name] = {"reused": True}
                continue
            log.warning("stage %s: its finished output in %s is damaged (%s); running it again", name, out, damage)
            overwrite_this = True
        else:
            overwrite_this = overwrite
        if out.exists() and (marker.get("key") != key or overwrite_this):
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "stage.json", {"key": key, "status": "running"})
        log.info("stage %s: running into %s", name, out)
        start = time.perf_counter()
        inputs = [root / dep for dep in stage.inputs]
        if nproc > 1 and name in DATA_PARALLEL:  # rank 0 of the job writes out/metrics.jsonl itself
            result = launch_torchrun(name, cfg, inputs, out, nproc, NullTracker())
        else:
            result = stage.run(cfg, inputs, out, JsonlTracker(out / "metrics.jsonl"))
        seconds = time.perf_counter() - start
        # what a later run checks before reusing the output: every file's size and SHA-256
        manifest = tree_manifest(out, exclude=("checkpoints", "stage.json"))
        write_json_atomic(
            out / "stage.json", {"key": key, "status": "done", "seconds": round(seconds, 3), "manifest": manifest}
        )
        summary[name] = {"reused": False, "seconds": round(seconds, 1)}
        if isinstance(result, dict) and name not in ("data", "base_model"):
            summary[name]["metrics"] = {k: v for k, v in result.items() if isinstance(v, (int, float))}
        log.info("stage %s: done in %.1f s", name, seconds)
    write_json_atomic(root / "summary.json", summary)
    return summary


def cmd_config(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    print(yaml.safe_dump(cfg.model_dump(), sort_keys=False), end="")
    return 0


def cmd_data(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    from .data import prepare_data

    stats = prepare_data(cfg, args.out, overwrite=args.overwrite)
    print(
        json.dumps(
            {
                "out": str(args.out),
                "rows": {k: v["rows"] for k, v in stats["splits"].items()},
                "padded_lengths": stats["padded_lengths"],
                "dropped": stats["dropped"],
            },
            indent=2,
        )
    )
    return 0


def cmd_model(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    from .models import import_base_model

    info = import_base_model(cfg.model, args.out, overwrite=args.overwrite)
    print(json.dumps({"out": str(args.out), **info}, indent=2))
    return 0


def _until(stage: str):
    def cmd(cfg: PipelineConfig, args: argparse.Namespace) -> int:
        summary = run_stages(cfg, Path(args.out), getattr(args, "until", None) or stage, overwrite=args.overwrite)
        print(json.dumps(summary, indent=2))
        return 0

    return cmd


@dataclass(frozen=True)
class Command:
    """A sub-command: its function, help line, whether it takes ``--out`` and ``--until``, other
    names it answers to (older names kept working), and on/off options of its own
    (``(flag, help)`` pairs)."""

    run: Callable[[PipelineConfig, argparse.Namespace], int]
    help: str
    out: str = "required"  # "required", "optional" or "none"
    until: bool = False
    aliases: tuple[str, ...] = ()
    flags: tuple[tuple[str, str], ...] = ()


COMMANDS: dict[str, Command] = {
    "config": Command(cmd_config, "print the resolved configuration as YAML", out="none"),
    "data": Command(cmd_data, "prepare the TL;DR SFT and preference datasets into --out (Details 1-6)"),
    "model": Command(cmd_model, "import the base model into --out as safetensors with its tokenizer"),
    "sft": Command(
        _until("sft"), "run (or reuse) data and base model, then SFT, in the run directory --out (Detail 9)"
    ),
    "reward": Command(
        _until("reward_eval"),
        "run up to the reward model: train, normalise, evaluate, in the run directory --out",
        aliases=("rm",),
    ),
    "ppo": Command(_until("ppo"), "run up to PPO against the normalised reward model, in the run directory --out"),
    "dpo": Command(
        _until("dpo_eval"),
        "run up to DPO from the SFT policy and the evaluation of its implicit reward model, "
        "in the run directory --out (no reward model is trained)",
    ),
    "stages": Command(
        _until(list(STAGES)[-1]),
        "run every stage in order in the run directory --out, "
        "without Prefect or MLflow (stage.json marks finished stages)",
        until=True,
    ),
}


def build_parser(commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    """The argument parser for ``commands`` (default :data:`COMMANDS`)."""
    parser = argparse.ArgumentParser(
        prog="rlhf", description="RLHF with PPO for Reddit TL;DR: one sub-command per stage."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in (commands or COMMANDS).items():
        p = sub.add_parser(name, help=command.help, description=command.help, aliases=list(command.aliases))
        p.add_argument(
            "--preset",
            default=DEFAULT_PRESET,
            help=f"preset name ({', '.join(available_presets())}) or YAML path; "
            f"default {DEFAULT_PRESET}, as the deployment rlhf/full-pipeline",
        )
        p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. ppo.kl_coef=0.1")
        if command.out != "none":
            p.add_argument(
                "--out",
                required=command.out == "required",
                type=Path,
                default=None,
                help="output directory" + ("" if command.out == "required" else " (default runs/<preset>)"),
            )
            if command.out == "required":
                p.add_argument("--overwrite", action="store_true", help="replace existing output")
        if command.until:
            p.add_argument("--until", choices=list(STAGES), default=None, help="last stage to run")
        for flag, text in command.flags:
            p.add_argument(flag, action="store_true", help=text)
    return parser


#: Errors reported as one line (exit code 2) instead of a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    DataError,
    ModelSourceError,
    TrainingError,
    FileExistsError,
)


def main(
    argv: list[str] | None = None,
    commands: dict[str, Command] | None = None,
    user_errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Entry point of the ``rlhf`` commands; returns the process exit code."""
    commands = commands or COMMANDS
    args = build_parser(commands).parse_args(argv)
    args.command = next((name for name, c in commands.items() if args.command in c.aliases), args.command)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not sys.stderr.isatty():  # progress bars in a terminal, plain log lines otherwise
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    try:
        cfg = load_config(args.preset, args.overrides)
        return commands[args.command].run(cfg, args)
    except USER_ERRORS + user_errors as exc:
        print(f"rlhf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
