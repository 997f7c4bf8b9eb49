"""Where a training stage spends its time and memory: a few steps under the torch profiler.

Usage::

    python benchmarks/stage_profile.py RUN_DIR --stage reward --steps 2
    python benchmarks/stage_profile.py RUN_DIR --stage ppo --steps 1 --set ppo.micro_batch_size=4

``RUN_DIR`` is the folder of a finished ``rlhf run --out RUN_DIR`` (or ``benchmarks/demo_cost.py
--keep``): the stage reads the artifacts of its inputs there (``RUN_DIR/artifacts/<stage>/<key>``),
with the run's preset (``--preset``, default cpu-demo) and ``--set`` overrides.

The stage runs through its pipeline entry (:data:`rlhf_core.run.pipeline.STAGES`) in this process,
stopped after ``--steps`` optimiser steps (PPO: updates) by a tracker (the one
``benchmarks/vs_trl.py`` times with), under ``torch.profiler`` with memory profiling. Printed
and written to ``--out`` (JSON): the operators with the most self CPU time and with the most
memory allocated by themselves (with their input shapes, so that a ``[rows, length,
vocabulary]`` tensor shows as such), what autograd keeps for the backward pass per forward
(:class:`SavedForBackward`: the activations, by shape), and the process's peak resident set.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the workers beside this file

from _ours_worker import _Done, _StepClock, _UpdateClock  # noqa: E402  (the same step trackers)

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--stage", choices=("sft", "reward", "dpo", "ppo"), required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--preset", default="cpu-demo")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--rows", type=int, default=15, help="operators listed per table")
    p.add_argument("--out", type=Path, default=None, help="the JSON to write")
    return p.parse_args(argv)


def artifact(run_dir: Path, stage: str) -> Path:
    """The one artifact folder of ``stage`` in the run directory ``run_dir``."""
    found = [p for p in sorted((run_dir / "artifacts" / stage).glob("*")) if (p / "MANIFEST.json").is_file()]
    if len(found) != 1:
        raise SystemExit(f"stage_profile: {len(found)} artifacts of {stage} in {run_dir / 'artifacts'}; expected one")
    return found[0]


def operators(events, key: str, rows: int) -> list[dict]:
    """The ``rows`` operators with the largest ``key`` (``self_cpu_time_total`` in us or
    ``self_cpu_memory_usage`` in bytes) of a profiler's ``key_averages(group_by_input_shape=True)``."""
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]
    return [
        {
            "name": e.key,
            "shapes": str(e.input_shapes)[:160],
            "calls": e.count,
            "self_cpu_s": e.self_cpu_time_total / 1e6,
            "self_cpu_memory_bytes": e.self_cpu_memory_usage,
        }
        for e in top
    ]


class SavedForBackward:
    """Counts what autograd keeps for the backward pass (activations): each tensor a forward
    saves, its storage once per forward (the storages of one forward are told apart by address,
    reset when a backward starts), parameters, their views and other leaves left out; by shape
    and dtype."""

    def __init__(self) -> None:
        self.by_shape: dict[str, int] = {}
        self.forwards = 0
        self._seen: set[int] = set()
        self._in_backward = True

    def pack(self, t):
        if self._in_backward:  # the first save of a new forward
            self._seen, self._in_backward = set(), False
            self.forwards += 1
        base = t._base if t._base is not None else t  # a view of a parameter is the parameter
        if not (base.is_leaf and base.requires_grad):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._seen:
                self._seen.add(ptr)
                key = f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                self.by_shape[key] = self.by_shape.get(key, 0) + t.untyped_storage().nbytes()
        return t

    def unpack(self, t):
        self._in_backward = True
        return t

    def top(self, rows: int) -> list[dict]:
        """The ``rows`` shapes with the most bytes kept, per forward pass on average."""
        top = sorted(self.by_shape.items(), key=lambda kv: kv[1], reverse=True)[:rows]
        return [{"tensor": k, "bytes_per_forward": v / max(self.forwards, 1)} for k, v in top]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rlhf_core.config.presets import load_config
    from rlhf_core.run.pipeline import STAGES

    cfg = load_config(args.preset, args.overrides)
    if args.stage == "ppo":
        ppo = cfg.ppo.model_copy(
            update={  # no evaluation or checkpoint inside the profiled updates
                "eval_every": args.steps + 1,
                "checkpoint_every": args.steps + 1,
                "total_episodes": max(cfg.ppo.total_episodes, (args.steps + 1) * cfg.ppo.batch_size),
            }
        )
        cfg = cfg.model_copy(update={"ppo": ppo})
        clock = _UpdateClock(args.steps)
    else:
        clock = _StepClock(args.steps)
    inputs = [artifact(args.run_dir, name) for name in STAGES[args.stage].inputs]
    saved = SavedForBackward()
    start = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as out,
        torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof,
    ):
        try:
            STAGES[args.stage].run(cfg, inputs, Path(out), clock)
        except _Done:
            pass
    wall = time.perf_counter() - start
    events = prof.key_averages(group_by_input_shape=True)
    result = {
        "stage": args.stage,
        "steps": len(clock.ends),
        "overrides": args.overrides,
        "wall_s": wall,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(),
        "by_time": operators(events, "self_cpu_time_total", args.rows),
        "by_memory": operators(events, "self_cpu_memory_usage", args.rows),
        "forwards_with_grad": saved.forwards,
        "saved_for_backward_bytes_per_forward": sum(saved.by_shape.values()) / max(saved.forwards, 1),
        "saved_for_backward": saved.top(args.rows),
    }
    for title, key in (("self CPU time", "by_time"), ("memory allocated", "by_memory")):
        print(f"\n{args.stage}: top operators by {title}")
        for op in result[key]:
            print(
                f"  {op['name'][:40]:40s} {op['calls']:6d} calls {op['self_cpu_s']:8.2f} s "
                f"{op['self_cpu_memory_bytes'] / 2**30:8.2f} GiB  {op['shapes'][:90]}"
            )
    print(f"\n{args.stage}: kept for the backward pass, per forward ({saved.forwards} forwards with autograd)")
    for row in result["saved_for_backward"]:
        print(f"  {row['tensor'][:60]:60s} {row['bytes_per_forward'] / 2**20:10.1f} MiB")
    print(
        f"\n{args.stage}: {len(clock.ends)} steps in {wall:.1f} s (profiled), peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
