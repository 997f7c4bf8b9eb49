"""Run one training stage on this rank: the entry point ``torchrun`` starts on each process.

    torchrun --nproc_per_node=2 -m rlhf_core.run.launch sft --preset smoke \\
        --inputs runs/x/data runs/x/base_model --out runs/x/sft [key=value ...]

``--preset`` also takes a YAML or JSON file (a whole dumped config); ``--result FILE`` makes
rank 0 write the stage's returned metrics there as JSON.

Each rank joins the process group (:func:`rlhf_core.train.distributed.init_from_env`), runs the
stage from :data:`rlhf_core.run.pipeline.STAGES` with the same config and inputs, and trains on
its share of every global batch; rank 0 alone writes metrics (``metrics.jsonl``),
checkpoints and the stage's output. Data-parallel stages: ``sft``, ``reward``, ``ppo`` and ``dpo``; the others
run on one process only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.io import write_json_atomic
from ..common.tracking import JsonlTracker, NullTracker, Tracker, replay
from ..config.presets import load_config
from ..config.settings import PipelineConfig
from .pipeline import STAGES

if TYPE_CHECKING:
    from ..train.distributed import World

log = logging.getLogger(__name__)

#: Stages whose training splits each global batch over the ranks.
DATA_PARALLEL = ("sft", "reward", "ppo", "dpo")


def nproc_per_node() -> int:
    """Training processes per machine: ``$RLHF_NPROC_PER_NODE``, which the GPU work pools set from
    their ``gpus`` job variable (infra/gpu-pool/); 1 (a single process) when unset.

    Raises:
        ValueError: not a positive integer.
    """
    text = os.environ.get("RLHF_NPROC_PER_NODE", "1").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"RLHF_NPROC_PER_NODE must be a positive integer, not {text!r}")
    return int(text)


class LaunchError(RuntimeError):
    """A ``torchrun`` job of a stage failed; the message carries its exit code and last output lines."""


def launch_torchrun(
    stage: str, cfg: PipelineConfig, inputs: list[Path], out: Path, nproc: int, tracker: Tracker
) -> dict:
    """Run ``stage`` as a ``torchrun`` job of ``nproc`` processes on this machine
    (:mod:`rlhf_core.run.launch`) and relay what its rank 0 records to ``tracker``.

    The whole config travels as JSON (``out/launch_config.json``). ``$RLHF_TORCHRUN_ARGS``
    replaces the default rendezvous ``--standalone`` (e.g. ``--nnodes=2 --node_rank=0
    --rdzv_backend=c10d --rdzv_endpoint=host:29400`` for several machines). The job's output is
    logged line by line.

    Returns:
        The stage's metrics, as rank 0 returned them.

    Raises:
        LaunchError: the job exited non-zero.
    """
    config_path, result_path = out / "launch_config.json", out / "launch_result.json"
    config_path.write_text(cfg.model_dump_json(indent=1))
    result_path.unlink(missing_ok=True)
    rendezvous = shlex.split(os.environ.get("RLHF_TORCHRUN_ARGS", "")) or ["--standalone"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        f"--nproc_per_node={nproc}",
        "-m",
        "rlhf_core.run.launch",
        stage,
        "--preset",
        str(config_path),
        "--inputs",
        *map(str, inputs),
        "--out",
        str(out),
        "--result",
        str(result_path),
    ]
    metrics_file = out / "metrics.jsonl"
    offset = metrics_file.stat().st_size if metrics_file.exists() else 0
    log.info("%s: %d processes: %s", stage, nproc, shlex.join(cmd))
    tail: deque[str] = deque(maxlen=20)  # the ranks' own last lines, not torchrun's
    errors: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            log.info("%s", line)
            if line.startswith("[rank"):
                tail.append(line)
                if re.match(r"\[rank\d+\]: [\w.]*(Error|Exception)\b", line):
                    errors.append(line)
    if metrics_file.exists():
        replay(metrics_file, tracker, offset)
    if proc.returncode != 0:
        cause = errors[0] if errors else "(no error line from the ranks)"
        raise LaunchError(
            f"stage {stage}: torchrun with {nproc} processes exited with code {proc.returncode}: "
            f"{cause}\nlast lines of the ranks:\n" + "\n".join(tail)
        )
    return json.loads(result_path.read_text())


def main(argv: list[str] | None = None) -> int:
    """Run the stage named in ``argv`` on this rank; returns the exit code.

    Raises:
        ValueError: a stage other than :data:`DATA_PARALLEL` started on more than one rank,
        or the wrong number of ``--inputs``.
    """
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.run.launch", description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--preset", default=None)
    parser.add_argument("--inputs", nargs="*", type=Path, default=[], help="the stage's input directories, in order")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--result", type=Path, default=None, help="rank 0 writes the returned metrics here (JSON)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ..train.distributed import init_from_env, leave  # torch: on the ranks, not in the process that launches them

    w = init_from_env()
    finished = False
    try:
        _run_rank(args, w)
        finished = True
    finally:
        leave(finished)
    return 0


def _run_rank(args: argparse.Namespace, w: World) -> None:
    """This rank's share of :func:`main`: check the arguments, run the stage, write the result."""
    stage = STAGES[args.stage]
    if w.size > 1 and args.stage not in DATA_PARALLEL:
        raise ValueError(f"stage {args.stage} runs on one process; data-parallel stages: {', '.join(DATA_PARALLEL)}")
    if len(args.inputs) != len(stage.inputs):
        raise ValueError(
            f"stage {args.stage} reads {len(stage.inputs)} input directories "
            f"({', '.join(stage.inputs)}), got {len(args.inputs)}"
        )
    cfg = load_config(args.preset, args.overrides)
    tracker = JsonlTracker(args.out / "metrics.jsonl") if w.is_main else NullTracker()
    result = stage.run(cfg, args.inputs, args.out, tracker) or {}
    if w.is_main and args.result is not None:
        write_json_atomic(args.result, {k: v for k, v in result.items() if isinstance(v, (int, float, str))})


if __name__ == "__main__":
    sys.exit(main())
