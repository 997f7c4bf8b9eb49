"""What the offline demo costs: time, memory and disk per stage, against the machine's own limits.

Usage::

    python benchmarks/demo_cost.py                      # the cpu-demo preset, as `make demo-local` runs it
    python benchmarks/demo_cost.py --preset smoke       # the same measurement in about two minutes
    python benchmarks/demo_cost.py --set ppo.total_episodes=64 --keep

Run it alone: a second heavy job on a 2-core machine slows every stage several times over.

What runs
---------
``rlhf run --preset PRESET --out RUN_DIR --json`` in this process (``flows.cli.main``, the
command `make demo-local` runs): the whole pipeline under a temporary Prefect server, with the
local MLflow store and the stage store in ``RUN_DIR`` (a fresh temporary folder unless
``--out``; removed at the end unless ``--keep``).

How it measures
---------------
1. A sampler thread reads, every ``--interval`` seconds, the resident set of this process and
   of every live descendant (summed: the process tree), the CPU seconds of the tree (this
   process's own, those of the children it has reaped, and the live descendants'), and every
   ``--disk-interval`` seconds the bytes allocated on disk under ``RUN_DIR`` per top-level
   folder (``st_blocks``; a file with several hard links counted once).
2. Each stage's wall time is its MLflow run's (start to end, in the run's ``mlflow.db``); its
   CPU time and peak RSS are the samples' over that window (CPU seconds interpolated at both
   ends). What runs before the first stage (the Prefect server, preflight) is ``startup``,
   what runs after the last (the report and the model registry) is ``finish``.
3. The run's peak RSS is also this process's ``ru_maxrss`` and its reaped children's, which no
   sampling interval can miss; ``peak_rss_bytes`` is the larger of the two readings.
4. After the run, with nothing else running, the machine's limits: the matrix-multiply rate of
   the dtype the stages trained in (``bf16-autocast``: bfloat16 operands, else float32) on the
   base model's MLP shape (``--limit-tokens`` rows), best of several; and the memory bandwidth
   of copying a 1 GiB float32 tensor (bytes read plus bytes written per second), best of five.
5. Each training stage's achieved FLOP/s over its optimiser steps (its ``tokens`` and
   ``tokens_per_s`` per step, non-PAD tokens): ``6 N`` per token run, N the parameters every
   token multiplies, plus the language-model head where logits are computed, plus attention
   ``12 L d S`` as PaLM counts it (S the tokens attended to), with ``8 N`` and ``16 L d S`` for
   DPO (the reference's forward pass added); the reward model and DPO run a pair's query once
   (:func:`flops_per_token`), and the median lengths of the stage's training rows stand for
   every row. Its ratio to the measured matmul rate is ``mfu``.
6. PPO's decoding: the rollout's sampled tokens per second (``time/generate_tokens_per_s``)
   over its bound: each decoding step reads every weight once (float32 master weights, 4
   bytes a parameter) and samples one token for each of ``ppo.micro_batch_size`` rows, so the
   bound is ``rows x bandwidth / weight bytes`` tokens per second.

Writes ``benchmarks/results/demo_cost-<preset>-<cpu>-<commit>.json`` (``--result``)::

    {"machine": {...}, "commit": ..., "preset": ..., "wall_s": ..., "cpu_s": ...,
     "peak_rss_bytes": ..., "disk_peak_bytes": ..., "disk_end_bytes": ...,
     "disk_peak_by_folder": {...}, "disk_end_by_folder": {...}, "cache_bytes": ...,
     "limits": {"matmul_flops": ..., "matmul_dtype": ..., "bandwidth_bytes_per_s": ...},
     "segments": {"startup": {...}, "data": {"wall_s", "cpu_s", "peak_rss_bytes"}, ..., "finish": {...}},
     "training": {"sft": {"tokens", "seconds", "flops_per_s", "mfu"}, ...},
     "decoding": {"ppo": {"tokens_per_s", "bound_tokens_per_s", "fraction"}}}
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime as _dt
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_stages beside this file

from gpu_stages import card_slug, cpu_info  # noqa: E402  (the same machine description)

REPO = Path(__file__).resolve().parent.parent
#: the stages that train, with their FLOPs per parameter and token and per attended token and
#: layer and width (forward and backward; DPO adds the reference's forward pass)
TRAINING = {"sft": (6, 12), "reward": (6, 12), "dpo": (8, 16)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="cpu-demo")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=None, help="the run directory (default: a new temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    p.add_argument("--result", type=Path, default=None, help="the JSON to write")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between memory and CPU samples")
    p.add_argument("--disk-interval", type=float, default=1.0, help="seconds between disk samples")
    p.add_argument("--limit-tokens", type=int, default=2048, help="rows of the matmul that measures the rate")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ sampling


def disk_usage(root: Path) -> dict[str, int]:
    """Bytes allocated under ``root`` per top-level entry (files directly in ``root`` under
    ``"."``), from ``st_blocks``; a file with several hard links is counted once, in the first
    folder met. Entries that vanish while it walks are skipped."""
    seen: set[tuple[int, int]] = set()
    usage: dict[str, int] = {}

    def add(top: str, st: os.stat_result) -> None:
        if st.st_nlink > 1:
            if (st.st_dev, st.st_ino) in seen:
                return
            seen.add((st.st_dev, st.st_ino))
        usage[top] = usage.get(top, 0) + st.st_blocks * 512

    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return usage
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                usage.setdefault(entry.name, 0)
                for dirpath, _dirs, files in os.walk(entry.path):
                    for name in files:
                        with contextlib.suppress(FileNotFoundError):
                            add(entry.name, os.lstat(os.path.join(dirpath, name)))
            else:
                add(".", entry.stat(follow_symlinks=False))
        except FileNotFoundError:
            continue
    return usage


def tree_reading(proc: psutil.Process) -> tuple[int, float]:
    """(resident bytes, CPU seconds) of ``proc`` and its live descendants; the CPU seconds
    include those of the children it has reaped."""
    t = proc.cpu_times()
    rss, cpu = proc.memory_info().rss, t.user + t.system + t.children_user + t.children_system
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            c = child.cpu_times()
            rss += child.memory_info().rss
            cpu += c.user + c.system
    return rss, cpu


class Sampler:
    """Samples the process tree's RSS and CPU seconds every ``interval`` s and ``root``'s disk
    use every ``disk_interval`` s, each stamped with ``time.time()``, until :meth:`stop`."""

    def __init__(self, root: Path, interval: float, disk_interval: float) -> None:
        self.root, self.interval, self.disk_interval = root, interval, disk_interval
        self.proc = psutil.Process()
        self.samples: list[tuple[float, int, float]] = []  # (time, rss, cpu seconds)
        self.disk: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        next_disk = 0.0
        while not self._stop.is_set():
            now = time.time()
            with contextlib.suppress(psutil.Error):
                self.samples.append((now, *tree_reading(self.proc)))
            if now >= next_disk:
                self.disk.append((now, disk_usage(self.root)))
                next_disk = now + self.disk_interval
            self._stop.wait(self.interval)

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self.thread.join()
            now = time.time()
            self.samples.append((now, *tree_reading(self.proc)))
            self.disk.append((now, disk_usage(self.root)))


def cpu_at(samples: list[tuple[float, int, float]], t: float) -> float:
    """The tree's CPU seconds at time ``t``, interpolated linearly between the samples around it
    (the first or last sample's outside them)."""
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return samples[0][2]
    if i == len(samples):
        return samples[-1][2]
    (t0, _, c0), (t1, _, c1) = samples[i - 1], samples[i]
    return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def segment(samples: list[tuple[float, int, float]], start: float, end: float) -> dict:
    """Wall seconds, CPU seconds and the peak sampled RSS of the window ``[start, end]`` (the
    sample just before it included: an allocation made at its start shows there)."""
    times = [s[0] for s in samples]
    lo, hi = max(bisect.bisect_left(times, start) - 1, 0), bisect.bisect_right(times, end)
    inside = samples[lo : max(hi, lo + 1)]
    return {
        "wall_s": round(end - start, 3),
        "cpu_s": round(cpu_at(samples, end) - cpu_at(samples, start), 3),
        "peak_rss_bytes": max(s[1] for s in inside),
    }


def segments(
    samples: list[tuple[float, int, float]], windows: dict[str, tuple[float, float]], start: float, end: float
) -> dict:
    """:func:`segment` of every stage window, in time order, with ``startup`` before the first and
    ``finish`` after the last."""
    ordered = sorted(windows.items(), key=lambda kv: kv[1][0])
    out = {"startup": segment(samples, start, ordered[0][1][0])} if ordered else {}
    out |= {name: segment(samples, a, b) for name, (a, b) in ordered}
    if ordered:
        out["finish"] = segment(samples, ordered[-1][1][1], end)
    return out


# ------------------------------------------------------------------------------ limits


def matmul_rate(shape: tuple[int, int, int], dtype: str, repeats: int = 5) -> float:
    """Best FLOP/s of ``(m, k) @ (k, n)`` in ``dtype`` (``"bfloat16"`` or ``"float32"``) over
    ``repeats`` timed runs of enough products to last about half a second each."""
    import torch

    m, k, n = shape
    a = torch.randn(m, k, dtype=getattr(torch, dtype))
    b = torch.randn(k, n, dtype=getattr(torch, dtype))
    torch.matmul(a, b)  # kernel selection, first-touch of the output
    t0 = time.perf_counter()
    torch.matmul(a, b)
    per = max(time.perf_counter() - t0, 1e-6)
    count = max(int(0.5 / per), 1)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(count):
            torch.matmul(a, b)
        best = max(best, 2 * m * k * n * count / (time.perf_counter() - t0))
    return best


def copy_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> float:
    """Best bytes per second of copying a float32 tensor of ``nbytes`` into another (read plus
    write, so ``2 x nbytes`` a copy) over ``repeats`` copies."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the destination's pages
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * nbytes / (time.perf_counter() - t0))
    return best


# ------------------------------------------------------------------------------ figures


def read_metrics(path: Path) -> list[dict]:
    """The ``metrics`` records of a stage's ``metrics.jsonl``."""
    if not path.is_file():
        return []
    return [r["metrics"] for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "metrics"]


def model_shape(config: dict, weights_bytes: int) -> dict:
    """Parameters, layers, width and vocabulary of a causal LM from its ``config.json`` and the
    bytes of its float32 ``model.safetensors`` (parameters = bytes / 4), with ``body``, the
    parameters that every token's forward pass multiplies (all but the token embedding and the
    language-model head)."""
    params, head = weights_bytes // 4, config["vocab_size"] * config["hidden_size"]
    return {
        "params": params,
        "body": params - head * (1 if config.get("tie_word_embeddings", False) else 2),
        "layers": config["num_hidden_layers"],
        "hidden": config["hidden_size"],
        "vocab": config["vocab_size"],
    }


def flops_per_token(stage: str, shape: dict, lengths: dict, loss_on: str = "response") -> float:
    """Training FLOPs per token that ``stage`` counts in its ``tokens`` metric (:data:`TRAINING`).

    ``lengths`` holds median token counts: ``query`` and ``response`` for SFT, ``query``,
    ``chosen`` and ``rejected`` for a pair. SFT counts and runs a row's ``q + r`` tokens; the
    reward model and DPO count a pair's ``2q + c + r`` tokens but run its query once
    (``q + c + r``). The head (``d x vocabulary``) runs where logits are needed: SFT's response
    (every token with ``loss_on: sequence``), DPO's two responses, never for the reward model.
    FLOPs: ``p x (body x run + head x headed) + a x L x d x S x run``, ``p, a`` = 6, 12 (8, 16
    for DPO: the reference's forward pass), ``S`` the query plus a response attended to."""
    param_factor, attention_factor = TRAINING[stage]
    q = lengths["query"]
    if stage == "sft":
        r = lengths["response"]
        counted, run, headed, context = q + r, q + r, (r if loss_on == "response" else q + r), q + r
    else:
        c, r = lengths["chosen"], lengths["rejected"]
        counted, run, context = 2 * q + c + r, q + c + r, q + (c + r) / 2
        headed = c + r if stage == "dpo" else 0
    head = shape["vocab"] * shape["hidden"]
    work = param_factor * (shape["body"] * run + head * headed)
    work += attention_factor * shape["layers"] * shape["hidden"] * context * run
    return work / counted


def training_figures(metrics: list[dict], per_token: float, matmul_flops: float) -> dict | None:
    """Tokens, seconds (the optimiser steps' own: tokens / tokens_per_s per step), achieved
    FLOP/s and its fraction of ``matmul_flops`` from a training stage's step records."""
    steps = [m for m in metrics if m.get("tokens") and m.get("tokens_per_s")]
    if not steps:
        return None
    tokens = sum(m["tokens"] for m in steps)
    seconds = sum(m["tokens"] / m["tokens_per_s"] for m in steps)
    rate = per_token * tokens / seconds
    return {
        "steps": len(steps),
        "tokens": int(tokens),
        "seconds": round(seconds, 3),
        "flops_per_token": per_token,
        "flops_per_s": rate,
        "mfu": rate / matmul_flops,
    }


def decoding_figures(metrics: list[dict], rows: int, weight_bytes: int, bandwidth: float) -> dict | None:
    """PPO's rollout decoding (``time/generate_tokens_per_s`` over the updates, weighted by
    their generation seconds) against ``rows x bandwidth / weight_bytes``."""
    updates = [m for m in metrics if m.get("time/generate") and m.get("time/generate_tokens_per_s")]
    if not updates:
        return None
    seconds = sum(m["time/generate"] for m in updates)
    tokens = sum(m["time/generate"] * m["time/generate_tokens_per_s"] for m in updates)
    bound = rows * bandwidth / weight_bytes
    return {
        "updates": len(updates),
        "tokens": int(round(tokens)),
        "seconds": round(seconds, 3),
        "tokens_per_s": tokens / seconds,
        "rows_per_step": rows,
        "bound_tokens_per_s": bound,
        "fraction": tokens / seconds / bound,
    }


def median_lengths(stats: dict, stage: str) -> dict:
    """The median token counts of the rows ``stage`` trains on, from the data stage's
    ``stats.json``: SFT's train split's query and reference response, else the preference train
    split's query, chosen and rejected."""
    if stage == "sft":
        lengths = stats["splits"]["sft/train"]["lengths"]
        return {"query": lengths["query"]["median"], "response": lengths["reference_response"]["median"]}
    lengths = stats["splits"]["preference/train"]["lengths"]
    return {k: lengths[k]["median"] for k in ("query", "chosen", "rejected")}


def machine() -> dict:
    """The CPU (:func:`gpu_stages.cpu_info`: name, cores, speed flags), its memory in bytes,
    torch's version and its thread count."""
    import torch

    return cpu_info() | {
        "memory_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def commit() -> str:
    """This checkout's commit (12 hex digits), ``-dirty`` when tracked files differ from it."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def stage_windows(result: dict, tracking_uri: str) -> dict[str, tuple[float, float]]:
    """Each stage's (start, end) in seconds since the epoch, from its MLflow run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    windows = {}
    for name, record in result["stages"].items():
        info = client.get_run(record["mlflow_run_id"]).info
        windows[name] = (info.start_time / 1000, (info.end_time or info.start_time) / 1000)
    return windows


def stage_dirs(artifacts: Path) -> dict[str, Path]:
    """Each stage's artifact folder under the store root ``artifacts`` (``<stage>/<key>``)."""
    return {p.parent.name: p for p in sorted(artifacts.glob("*/*")) if p.is_dir() and "." not in p.name}


def stage_params(path: Path) -> dict:
    """The parameters a stage logged in its ``metrics.jsonl`` (its ``params`` records merged)."""
    params: dict = {}
    if path.is_file():
        for record in map(json.loads, path.read_text().splitlines()):
            if record.get("kind") == "params":
                params |= record["params"]
    return params


def figures(run_dir: Path, limits: dict) -> tuple[dict, dict]:
    """(training, decoding) figures of the run in ``run_dir`` against ``limits``."""
    dirs = stage_dirs(run_dir / "artifacts")
    config = json.loads((dirs["base_model"] / "config.json").read_text())
    weight_bytes = (dirs["base_model"] / "model.safetensors").stat().st_size
    shape = model_shape(config, weight_bytes)
    stats = json.loads((dirs["data"] / "stats.json").read_text())
    training = {}
    for stage in TRAINING:
        if stage in dirs:
            loss_on = stage_params(dirs[stage] / "metrics.jsonl").get("sft.loss_on", "response")
            per_token = flops_per_token(stage, shape, median_lengths(stats, stage), loss_on)
            got = training_figures(read_metrics(dirs[stage] / "metrics.jsonl"), per_token, limits["matmul_flops"])
            if got is not None:
                training[stage] = got
    decoding = {}
    if "ppo" in dirs:
        rows = stage_params(dirs["ppo"] / "metrics.jsonl")["ppo.micro_batch_size"]
        records = read_metrics(dirs["ppo"] / "metrics.jsonl")
        got = decoding_figures(records, rows, weight_bytes, limits["bandwidth_bytes_per_s"])
        if got is not None:
            decoding["ppo"] = got
    return training, decoding


def trained_dtype(run_dir: Path) -> str:
    """``bfloat16`` when the SFT stage trained under bf16 autocast (its ``sft.precision``
    parameter), else ``float32``."""
    sft = stage_dirs(run_dir / "artifacts").get("sft")
    precision = stage_params(sft / "metrics.jsonl").get("sft.precision") if sft else None
    return "bfloat16" if precision == "bf16-autocast" else "float32"


def table(report: dict) -> str:
    """The per-stage table, for the terminal and the docs."""
    gib = 2**30
    lines = ["| segment | wall s | CPU s | peak RSS GiB | against the limit |", "|---|---|---|---|---|"]
    for name, seg in report["segments"].items():
        limit = ""
        if name in report["training"]:
            limit = f"{report['training'][name]['mfu']:.1%} of the matmul rate"
        elif name in report["decoding"]:
            limit = f"decoding {report['decoding'][name]['fraction']:.1%} of the bandwidth bound"
        lines.append(
            f"| {name} | {seg['wall_s']:.1f} | {seg['cpu_s']:.1f} | {seg['peak_rss_bytes'] / gib:.2f} | {limit} |"
        )
    lines.append(
        f"| whole run | {report['wall_s']:.1f} | {report['cpu_s']:.1f} | {report['peak_rss_bytes'] / gib:.2f} | "
        f"disk peak {report['disk_peak_bytes'] / gib:.2f} GiB, end {report['disk_end_bytes'] / gib:.2f} GiB |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(REPO)
    run_dir = (args.out or Path(tempfile.mkdtemp(prefix="demo_cost-"))).resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SystemExit(f"demo_cost: {run_dir} is not empty: a run directory starts empty here")
    run_dir.mkdir(parents=True, exist_ok=True)
    from flows.cli import main as rlhf_main
    from rlhf_core.common.io import cache_root

    cmd = ["run", "--preset", args.preset, "--out", str(run_dir), "--json", *args.overrides]
    printed = io.StringIO()
    start = time.time()
    with Sampler(run_dir, args.interval, args.disk_interval) as sampler, contextlib.redirect_stdout(printed):
        code = rlhf_main(cmd)
    end = time.time()
    if code != 0:
        raise SystemExit(f"demo_cost: rlhf {' '.join(cmd)} exited with {code}")
    text = printed.getvalue()
    lines = text.splitlines()
    result = json.loads("\n".join(lines[lines.index("{") :]))  # the result, printed last, as json.dumps(indent=2)
    windows = stage_windows(result, f"sqlite:///{run_dir / 'mlflow.db'}")

    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_rss = max(max(s[1] for s in sampler.samples), max(own.ru_maxrss, reaped.ru_maxrss) * 1024)
    disk_peak_at = max(sampler.disk, key=lambda d: sum(d[1].values()))[1]
    disk_end = disk_usage(run_dir)

    cache = cache_root()
    report = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "commit": commit(),
        "preset": args.preset,
        "overrides": args.overrides,
        "run_dir": str(run_dir),
        "wall_s": round(end - start, 3),
        "cpu_s": round(sampler.samples[-1][2] - sampler.samples[0][2], 3),
        "peak_rss_bytes": peak_rss,
        "disk_peak_bytes": sum(disk_peak_at.values()),
        "disk_end_bytes": sum(disk_end.values()),
        "disk_peak_by_folder": disk_peak_at,
        "disk_end_by_folder": disk_end,
        "cache_dir": str(cache),
        "cache_bytes": sum(disk_usage(cache).values()) if cache.is_dir() else 0,
        "segments": segments(sampler.samples, windows, start, end),
        "stage_metrics": {k: v.get("metrics", {}) for k, v in result["stages"].items()},
    }
    slug = card_slug({"type": "cpu", "name": report["machine"]["name"]})
    out = args.result or REPO / "benchmarks" / "results" / f"demo_cost-{args.preset}-{slug}-{report['commit']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")  # what the run cost, before the limits are measured

    dtype = trained_dtype(run_dir)
    base = json.loads((stage_dirs(run_dir / "artifacts")["base_model"] / "config.json").read_text())
    shape = (args.limit_tokens, base["hidden_size"], base["intermediate_size"])
    report["limits"] = {
        "matmul_dtype": dtype,
        "matmul_shape": list(shape),
        "matmul_flops": matmul_rate(shape, dtype),
        "bandwidth_bytes_per_s": copy_bandwidth(),
    }
    report["training"], report["decoding"] = figures(run_dir, report["limits"])
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"demo_cost: wrote {out}")
    if not args.keep and args.out is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
