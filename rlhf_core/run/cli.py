"""The ``rlhf`` command: one sub-command per pipeline stage, plus ``stages`` for all of them.

Every sub-command takes ``--preset NAME`` (a file in ``configs/``; default ``cpu-demo``, the
deployment's) and ``key=value`` overrides, e.g. ``rlhf data --preset smoke data.on_bad_row=skip --out runs/x/data``. These
sub-commands write plain directories and need neither Prefect nor MLflow; the installed
``rlhf`` script (``flows/cli.py``) adds ``rlhf run``, the orchestrated, tracked pipeline.
``rlhf verify DIR`` reads every file of finished stage outputs or stored artifacts and
reports each one that differs from its manifest.

Nothing of the user's is removed or overwritten: a stage command writes only into a run
directory it created or adopted (:func:`claim_run_directory`) and into stage folders the
pipeline wrote (:func:`_check_stage_folders`); ``rlhf data|model --overwrite`` replaces only an
empty directory or an earlier output of the same command (:func:`check_replaceable`).

Importing this module loads neither torch, transformers nor datasets: a command imports
what it runs, so that ``rlhf --help``, ``rlhf config`` and ``rlhf verify`` start at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import yaml

from .. import __version__
from ..common.errors import DataError, ForeignFilesError, ModelSourceError, TrainingError
from ..config.credentials import redact
from ..config.presets import available_presets, load_config
from ..config.settings import ConfigError, PipelineConfig
from ..models.sources import RewardSpecError
from .pipeline import STAGES, key_of, key_parts
from .runner import PlannedStage

log = logging.getLogger("rlhf")

#: The preset of a command given none: the deployment's (infra/prefect.yaml), which runs on a
#: CPU. The paper's settings are a preset too (``pythia-1b``), never a silent default.
DEFAULT_PRESET = "cpu-demo"


#: The file that marks a run directory as the stage commands': written when a command creates
#: the directory, or adopts an empty one or one written before the marker existed.
RUN_MARKER = ".rlhf-run.json"
#: What the stage commands write at the top of a run directory besides the stage folders:
#: ``config.yaml``, ``summary.json``, the evaluation's ``judge_cache.jsonl`` (these three count
#: as theirs only beside a stage folder holding a ``stage.json``), the lock, the marker and the
#: leftovers of an interrupted crash-safe write (:mod:`rlhf_core.common.io`).
RUN_RECORDS = ("config.yaml", "summary.json", "judge_cache.jsonl")
RUN_FILES = (".rlhf-stages.lock", RUN_MARKER, ".*.tmp", ".*.partial", ".*.old-*")
#: The last words of every refusal to write into a directory: what to do instead.
WHAT_TO_DO = "nothing was changed: give --out a new or empty directory, or move those files away"


def _names(entries: list[Path]) -> str:
    """``entries`` by name, folders with a slash, the first few only."""
    names = [p.name + "/" * p.is_dir() for p in entries]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _writable_stage_folder(out: Path) -> bool:
    """Whether a stage may write to ``out``: absent, an empty folder, or one holding a
    ``stage.json`` (the pipeline's). Anything else may be the user's."""
    if not out.exists():
        return True
    return out.is_dir() and ((out / "stage.json").is_file() or not any(out.iterdir()))


def claim_run_directory(root: Path, command: str) -> None:
    """Make ``root`` a run directory of the stage commands, marked by :data:`RUN_MARKER`, or
    refuse it before anything is written there.

    A stage command writes ``config.yaml``, ``summary.json`` and stage folders into ``root``, so
    it takes only a directory that is new or empty, holds the marker, or holds nothing but what
    a stage command writes (a run directory from before the marker: stage folders holding a
    ``stage.json`` or empty, :data:`RUN_RECORDS` beside at least one ``stage.json``,
    :data:`RUN_FILES`). Anything else may be the user's: a ``config.yaml`` or ``data/`` of theirs
    would be overwritten or removed.

    Raises:
        ForeignFilesError: ``root`` is not a directory, or holds entries no stage command wrote
            (the message names ``root`` and those entries).
    """
    if (root / RUN_MARKER).is_file():
        return
    if root.exists() and not root.is_dir():
        raise ForeignFilesError(f"{root} is not a directory; {WHAT_TO_DO}")
    entries = sorted(root.iterdir()) if root.exists() else []
    started = any((p / "stage.json").is_file() for p in entries if p.name in STAGES)
    files = RUN_FILES + (RUN_RECORDS if started else ())
    foreign = [
        p
        for p in entries
        if not (_writable_stage_folder(p) if p.name in STAGES else any(fnmatch(p.name, f) for f in files))
    ]
    if foreign:
        raise ForeignFilesError(
            f"{root} is not a run directory of the rlhf stage commands (it has no {RUN_MARKER}) "
            f"and holds what they did not write: {_names(foreign)}; {WHAT_TO_DO}"
        )
    from ..common.io import write_json_atomic

    root.mkdir(parents=True, exist_ok=True)
    record = {"written_by": f"rlhf {command}", "adopted": bool(entries), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(root / RUN_MARKER, record)
    if entries:
        log.info("%s: a run directory of the stage commands without %s: adopted", root, RUN_MARKER)


def _check_stage_folders(root: Path, names: Iterable[str]) -> None:
    """Refuse stage folders the pipeline did not write: a stage replaces or resumes a folder
    holding its ``stage.json`` and reuses an empty one, but never removes or writes into one
    holding anything else (``--overwrite`` included), which may be the user's. Checked for
    every stage before any runs, so that a refusal comes before hours of work, not after.

    Raises:
        ForeignFilesError: a stage folder is not a directory, or holds entries and no
            ``stage.json`` (the message names the folder and those entries).
    """
    for out in (root / name for name in names):
        if not _writable_stage_folder(out):
            what = f"holds {_names(sorted(out.iterdir()))} and no stage.json" if out.is_dir() else "is a file"
            raise ForeignFilesError(f"{out} {what}: not a stage folder the pipeline wrote; {WHAT_TO_DO}")


def run_stages(cfg: PipelineConfig, root: Path, until: str, overwrite: bool = False) -> dict:
    """Run the stages up to ``until`` into ``root/<stage>``.

    A stage finished earlier with the same key (its settings, its inputs' keys and the code
    version: :func:`rlhf_core.run.pipeline.stage_key`) is reused; one interrupted with the same
    key resumes from its checkpoints; one made with another key, or whose files no longer match
    the sizes and SHA-256 its ``stage.json`` recorded when it finished (a warning names the
    file), is removed and run again. Only files whose size or modification time differ from
    the record are read (:func:`rlhf_core.common.io.check_manifest`; ``rlhf verify`` reads them all);
    the times of those found unchanged are recorded, so a copied run directory is read once.
    With ``RLHF_NPROC_PER_NODE`` above 1, SFT, the reward model and PPO run as a ``torchrun`` job of
    that many processes (:func:`rlhf_core.run.launch.launch_torchrun`). A second ``rlhf stages`` on
    the same directory waits for the first (a lock naming the holder), then reuses its stages.
    A stage folder holding entries but no ``stage.json`` is not the pipeline's: it is refused,
    never removed (:func:`_check_stage_folders`). ``root`` itself is the caller's to choose; the
    stage commands take it through :func:`claim_run_directory` first.

    Raises:
        LaunchError: a ``torchrun`` job failed; ValueError: a bad ``RLHF_NPROC_PER_NODE``;
        ForeignFilesError: a stage folder the pipeline did not write.
    """
    from ..common.io import exclusive_lock
    from ..config.settings import check_world_size
    from .launch import nproc_per_node

    nproc = nproc_per_node()
    check_world_size(cfg, nproc)  # before any stage, not when the first data-parallel one starts
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / ".rlhf-stages.lock", what=f"the run directory {root}"):  # one writer
        return _run_stages_locked(cfg, root, until, overwrite, nproc)


def plan_stages(cfg: PipelineConfig, root: Path | None, until: str | None = None) -> list[PlannedStage]:
    """What ``rlhf stages --out root --until until`` would do with ``cfg``, stage by stage, in
    order (:func:`rlhf_core.run.pipeline.key_parts`): reuse the finished output in ``root/<stage>``
    (:func:`rlhf_core.run.runner.finished_output`, as :func:`run_stages` decides) or run the stage,
    and why (:func:`rlhf_core.run.runner.why_it_runs`: which settings, which modules of its code,
    which inputs or files changed since its output was made). Reads the stage markers and the
    files whose size or time differ from them; writes nothing, and loads no torch, transformers
    or datasets. ``root=None``: no run directory, every stage runs.

    Raises:
        KeyError: ``until`` is not a stage.
        DataError, ModelSourceError: what a stage reads cannot be found (its key needs it).
    """
    from .runner import finished_output, why_it_runs

    planned = []
    for name, parts in key_parts(cfg, until).items():
        key, out = key_of(parts), None if root is None else root / name
        found = None if out is None else finished_output(out, key)
        if found is not None and found.damage is None:
            planned.append(PlannedStage(name, key, True, f"finished in {out}"))
        else:
            planned.append(PlannedStage(name, key, False, why_it_runs(out, key, parts)))
    return planned


def cmd_plan(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    """``rlhf plan``: one line per stage up to ``--until``: its name, its key and whether it will
    run or be taken from the finished output in the run directory ``--out`` (default
    ``runs/<preset>``) (:func:`plan_stages`)."""
    root = args.out or Path("runs") / (Path(args.preset).stem if args.preset else cfg.name)
    print_plan(cfg, plan_stages(cfg, root, args.until))
    return 0


def print_plan(cfg: PipelineConfig, planned: list[PlannedStage]) -> None:
    """Print ``rlhf plan``'s lines: ``<stage> <key> cached|runs <reason>``, then a count."""
    width = max(len(p.name) for p in planned)
    for p in planned:
        print(f"{p.name:<{width}}  {p.key}  {'cached' if p.cached else 'runs  '}  {p.reason}")
    runs = sum(not p.cached for p in planned)
    print(f"rlhf plan: preset {cfg.name}: {runs} of {len(planned)} stages run, {len(planned) - runs} from cache")


def _run_stages_locked(cfg: PipelineConfig, root: Path, until: str, overwrite: bool, nproc: int) -> dict:
    from ..common.io import write_json_atomic
    from ..common.tracking import JsonlTracker
    from .pipeline import key_record
    from .runner import run_stage

    parts = key_parts(cfg, until)
    _check_stage_folders(root, parts)
    (root / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    summary = {}
    for name, stage_parts in parts.items():
        key, out = key_of(stage_parts), root / name
        inputs = [root / dep for dep in STAGES[name].inputs]
        tracker = JsonlTracker(out / "metrics.jsonl")
        run = run_stage(name, cfg, inputs, out, key, key_record(stage_parts), tracker, nproc=nproc, overwrite=overwrite)
        summary[name] = {"reused": run.reused} if run.reused else {"reused": False, "seconds": round(run.seconds, 1)}
        if not run.reused and name not in ("data", "base_model"):
            summary[name]["metrics"] = run.metrics
    write_json_atomic(root / "summary.json", summary)
    return summary


def cmd_config(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    print(yaml.safe_dump(cfg.model_dump(), sort_keys=False), end="")
    return 0


#: What ``rlhf data`` writes (:func:`rlhf_core.data.prepare.prepare_data`), its record first.
DATA_OUTPUT = ("stats.json", "sft", "preference", "tokenizer", "token_lengths.png")
#: What ``rlhf model`` writes (:func:`rlhf_core.models.base.import_base_model`), its record first:
#: the model's and the tokenizer's files as ``save_pretrained`` names them.
MODEL_OUTPUT = (
    "import.json",
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.*",
    "vocab.*",
    "merges.txt",
)


def check_replaceable(out: Path, output: tuple[str, ...], command: str) -> None:
    """Refuse to replace ``out`` (``rlhf <command> --overwrite``) unless it is new, empty, or an
    earlier output of that command: it holds the record ``output[0]`` and nothing whose name
    matches no pattern of ``output``. Anything else in it may be the user's, and replacing the
    directory would remove it.

    Raises:
        ForeignFilesError: naming ``out`` and the entries that are not the command's own.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise ForeignFilesError(f"{out} is not a directory; {WHAT_TO_DO}")
    entries = sorted(out.iterdir())
    foreign = [p for p in entries if not any(fnmatch(p.name, pattern) for pattern in output)]
    if foreign or (entries and not (out / output[0]).exists()):
        why = f"it holds {_names(foreign)}, which that command does not write" if foreign else f"no {output[0]}"
        raise ForeignFilesError(
            f"{out} is not an output of rlhf {command} ({why}), so --overwrite does not replace it; {WHAT_TO_DO}"
        )


def cmd_data(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    from ..data.prepare import prepare_data

    if args.overwrite:
        check_replaceable(args.out, DATA_OUTPUT, "data")
    stats = prepare_data(cfg, args.out, overwrite=args.overwrite)
    from ..data.prepared import token_lengths
    from ..views.plots import plot_token_lengths

    plot_token_lengths(token_lengths(args.out), args.out / "token_lengths.png")  # Figures 9-10, beside the data
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
    from ..models.base import import_base_model

    if args.overwrite:
        check_replaceable(args.out, MODEL_OUTPUT, "model")
    info = import_base_model(cfg.model, args.out, overwrite=args.overwrite)
    print(json.dumps({"out": str(args.out), **info}, indent=2))
    return 0


#: The manifest of a stored artifact (``tasks.storage.MANIFEST``), checked by ``rlhf verify``
#: as a finished stage's ``stage.json``.
ARTIFACT_MANIFEST = "MANIFEST.json"


def verify_targets(path: Path) -> dict[Path, dict | str]:
    """What ``rlhf verify`` checks: ``{directory: its manifest, or why it has none to check}``
    for ``path`` when it holds a ``stage.json`` (a stage output) or a ``MANIFEST.json`` (a
    stored artifact), else for every such directory below it (a run directory, an artifact
    store), not looking below those nor into hidden directories.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or holds no manifest.
    """
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory")
    found: dict[Path, dict | str] = {}

    def visit(directory: Path) -> None:
        for name in ("stage.json", ARTIFACT_MANIFEST):
            if (directory / name).is_file():
                try:
                    record = json.loads((directory / name).read_text())
                except (OSError, ValueError) as exc:
                    found[directory] = f"{name}: unreadable ({exc})"
                    return
                if name == ARTIFACT_MANIFEST:
                    found[directory] = record
                elif record.get("status") == "done" and "manifest" in record:
                    found[directory] = record["manifest"]
                else:
                    found[directory] = f"{name}: no manifest (status {record.get('status')}: not finished)"
                return
        for sub in sorted(directory.iterdir()):
            if sub.is_dir() and not sub.is_symlink() and not sub.name.startswith("."):
                visit(sub)

    visit(path)
    if not found:
        raise FileNotFoundError(f"{path}: no stage.json or {ARTIFACT_MANIFEST} in it or below it")
    return found


def cmd_verify(cfg: PipelineConfig | None, args: argparse.Namespace) -> int:
    """Read every file of each output under ``args.dir`` (:func:`verify_targets`) and print
    each difference from its manifest: exit code 0 when all match, 1 when any differs, 2 when
    there is nothing to check."""
    from ..common.io import verify_manifest

    try:
        targets = verify_targets(args.dir)
    except FileNotFoundError as exc:
        print(f"rlhf verify: error: {exc}", file=sys.stderr)
        return 2
    differing, files = 0, 0
    for directory, manifest in targets.items():
        problems = [manifest] if isinstance(manifest, str) else verify_manifest(directory, manifest)
        differing += bool(problems)
        files += 0 if isinstance(manifest, str) else len(manifest["files"])
        for problem in problems:
            print(f"{directory}: {problem}")
        if not problems:
            print(f"{directory}: {len(manifest['files'])} files match")  # type: ignore[index]
    if differing:
        print(f"rlhf verify: {differing} of {len(targets)} outputs differ from their manifests", file=sys.stderr)
        return 1
    print(f"rlhf verify: all {len(targets)} outputs match their manifests ({files} files read)")
    return 0


def _until(stage: str):
    def cmd(cfg: PipelineConfig, args: argparse.Namespace) -> int:
        from .pipeline import stages_until
        from .preflight import check_before_stages

        until = getattr(args, "until", None) or stage
        check_before_stages(cfg, stages_until(until))  # what the stages read, before any of them starts
        claim_run_directory(Path(args.out), args.command)
        summary = run_stages(cfg, Path(args.out), until, overwrite=args.overwrite)
        print(json.dumps(summary, indent=2))
        return 0

    return cmd


@dataclass(frozen=True)
class Command:
    """A sub-command: its function, help line, whether it takes ``--out`` and ``--until``, other
    names it answers to (older names kept working), on/off options of its own (``(flag,
    help)`` pairs), whether it takes ``--preset`` and ``key=value`` overrides (``config``;
    without, ``run`` gets ``None`` for the config), directory arguments of its own
    (``(name, help)`` pairs, given to ``run`` as :class:`~pathlib.Path`) and options taking a
    ``SOURCE`` value (``(flag, help, repeated)``: a repeated one gives ``run`` a list)."""

    run: Callable[[PipelineConfig | None, argparse.Namespace], int]
    help: str
    out: str = "required"  # "required", "optional" or "none"
    until: bool = False
    aliases: tuple[str, ...] = ()
    flags: tuple[tuple[str, str], ...] = ()
    config: bool = True
    paths: tuple[tuple[str, str], ...] = ()
    options: tuple[tuple[str, str, bool], ...] = ()


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
    "plan": Command(
        cmd_plan,
        "print each stage up to --until with its cache key and whether it will run or be taken "
        "from the finished output in the run directory --out (rlhf stages); runs nothing",
        out="optional",
        until=True,
    ),
    "verify": Command(
        cmd_verify,
        "read every file of the finished stages (stage.json) or stored artifacts (MANIFEST.json) "
        "in or below DIR and report each that differs from its manifest (exit code 1)",
        out="none",
        config=False,
        paths=(("dir", "a stage output, a run directory or an artifact store"),),
    ),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose error messages never show a credential that was typed
    (:func:`rlhf_core.config.credentials.redact`: ``rlhf config --preset smoke eval.api_key=sk-...``
    reaching "unrecognized arguments"), and which keeps its sub-commands' parsers by name
    (aliases included) in ``subcommands``, for :func:`parse_arguments`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.subcommands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str):  # noqa: D102  (argparse's, with the message redacted)
        super().error(redact(message))


def build_parser(commands: dict[str, Command] | None = None, listed: dict[str, str] | None = None) -> ArgumentParser:
    """The argument parser for ``commands`` (default :data:`COMMANDS`), with ``--version``;
    ``listed`` names further sub-commands (``{name: help}``) that another parser reads, shown in
    ``--help`` only (``rlhf sweep``)."""
    parser = ArgumentParser(prog="rlhf", description="RLHF with PPO for Reddit TL;DR: one sub-command per stage.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in (commands or COMMANDS).items():
        p = sub.add_parser(name, help=command.help, description=command.help, aliases=list(command.aliases))
        parser.subcommands |= {n: p for n in (name, *command.aliases)}
        for path, text in command.paths:
            p.add_argument(path, type=Path, help=text)
        if command.config:
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
                p.add_argument(
                    "--overwrite",
                    action="store_true",
                    help="replace existing output (the command's own, never other files)",
                )
        if command.until:
            p.add_argument("--until", choices=list(STAGES), default=None, help="last stage to run")
        for flag, text in command.flags:
            p.add_argument(flag, action="store_true", help=text)
        for flag, text, repeated in command.options:
            p.add_argument(flag, action="append" if repeated else "store", metavar="SOURCE", help=text)
    for name, text in (listed or {}).items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def parse_arguments(parser: ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``argv`` (default ``sys.argv[1:]``) parsed by ``parser`` (:func:`build_parser`), each
    sub-command's options and ``key=value`` overrides in any order
    (``rlhf config ppo.kl_coef=0.1 --preset smoke sft.max_steps=2``:
    :meth:`argparse.ArgumentParser.parse_intermixed_args`). ``args.command`` is the name as
    typed (an alias stays an alias). Errors exit with code 2, as argparse's."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in parser.subcommands:
        args = parser.subcommands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


#: Errors reported as one line (exit code 2) instead of a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    DataError,
    ModelSourceError,
    TrainingError,
    FileExistsError,
    ForeignFilesError,
    RewardSpecError,
)


#: Set, unless set already, before a command imports anything: ``datasets`` looks for
#: TensorFlow and JAX when it is imported (an installed JAX costs seconds); the project runs
#: on PyTorch alone.
FRAMEWORK_ENV = {"USE_TF": "0", "USE_JAX": "0"}
#: Set likewise when stderr is not a terminal: plain log lines, no progress bars, without
#: importing ``datasets`` or ``transformers`` to say so (they read these when imported).
NO_PROGRESS_ENV = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _library_settings() -> None:
    for key, value in FRAMEWORK_ENV.items():
        os.environ.setdefault(key, value)
    if sys.stderr.isatty():  # progress bars in a terminal, plain log lines otherwise
        return
    for key, value in NO_PROGRESS_ENV.items():
        os.environ.setdefault(key, value)
    if "datasets" in sys.modules:  # imported before this (a test, ``rlhf run``): told directly
        sys.modules["datasets"].disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def main(
    argv: list[str] | None = None,
    commands: dict[str, Command] | None = None,
    user_errors: tuple[type[BaseException], ...] = (),
    listed: dict[str, str] | None = None,
) -> int:
    """Entry point of the ``rlhf`` commands; returns the process exit code. ``listed``: sub-commands
    read elsewhere, named in ``--help`` (:func:`build_parser`)."""
    commands = commands or COMMANDS
    args = parse_arguments(build_parser(commands, listed), argv)
    args.command = next((name for name, c in commands.items() if args.command in c.aliases), args.command)
    command = commands[args.command]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _library_settings()
    try:
        cfg = load_config(args.preset, args.overrides) if command.config else None
        return command.run(cfg, args)
    except USER_ERRORS + user_errors as exc:
        print(f"rlhf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
