"""Run one training stage on this rank: the entry point ``torchrun`` starts on each process.

    torchrun --nproc_per_node=2 -m rlhf_core.launch sft --preset smoke \\
        --inputs runs/x/data runs/x/base_model --out runs/x/sft [key=value ...]

``--preset`` also takes a YAML or JSON file (a whole dumped config); ``--result FILE`` makes
rank 0 write the stage's returned metrics there as JSON.

Each rank joins the process group (:func:`rlhf_core.distributed.init_from_env`), runs the
stage from :data:`rlhf_core.pipeline.STAGES` with the same config and inputs, and trains on
its share of every global batch; rank 0 alone writes metrics (``metrics.jsonl``),
checkpoints and the stage's output. Data-parallel stages: ``sft``, ``reward`` and ``ppo``; the others
run on one process only.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .config import load_config
from .distributed import init_from_env
from .io import write_json_atomic
from .pipeline import STAGES
from .tracking import JsonlTracker, NullTracker

#: Stages whose training splits each global batch over the ranks.
DATA_PARALLEL = ("sft", "reward", "ppo")


def main(argv: list[str] | None = None) -> int:
    """Run the stage named in ``argv`` on this rank; returns the exit code.

    Raises:
        ValueError: a stage other than :data:`DATA_PARALLEL` started on more than one rank,
        or the wrong number of ``--inputs``.
    """
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.launch", description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--preset", default=None)
    parser.add_argument("--inputs", nargs="*", type=Path, default=[], help="the stage's input directories, in order")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--result", type=Path, default=None, help="rank 0 writes the returned metrics here (JSON)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    w = init_from_env()
    stage = STAGES[args.stage]
    if w.size > 1 and args.stage not in DATA_PARALLEL:
        raise ValueError(f"stage {args.stage} runs on one process; data-parallel stages: {', '.join(DATA_PARALLEL)}")
    if len(args.inputs) != len(stage.inputs):
        raise ValueError(f"stage {args.stage} reads {len(stage.inputs)} input directories "
                         f"({', '.join(stage.inputs)}), got {len(args.inputs)}")
    cfg = load_config(args.preset, args.overrides)
    tracker = JsonlTracker(args.out / "metrics.jsonl") if w.is_main else NullTracker()
    result = stage.run(cfg, args.inputs, args.out, tracker) or {}
    if w.is_main and args.result is not None:
        write_json_atomic(args.result, {k: v for k, v in result.items() if isinstance(v, (int, float, str))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
