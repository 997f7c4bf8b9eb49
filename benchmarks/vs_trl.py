"""Training speed of this project's SFT, reward-model, DPO and PPO stages against TRL, at identical settings.

Benchmark against TRL
---------------------
TRL runs from its own virtual environment, ``.venv-trl`` (never installed into ``.venv``)::

    make bench-venv-trl                    # once: torch==2.13.0 (CPU wheel) first, then trl==1.12.0
    make bench-trl                         # = .venv/bin/python benchmarks/vs_trl.py --setting smoke
    make bench-trl BENCH_ARGS="--setting smollm2 --stages sft,reward --steps 3 --repeats 3"
    .venv/bin/python benchmarks/vs_trl.py --setting smollm2 --stages ppo --steps 2 --repeats 1
    .venv/bin/python benchmarks/vs_trl.py --setting smollm2 --stages dpo --steps 3 --repeats 2 --fp32 \
        --out benchmarks/results/vs_trl-smollm2-dpo-fp32.json
    .venv/bin/python benchmarks/vs_trl.py --setting smollm2 --device cuda --peak-tflops 989

Prints a table (stage | ours | TRL | ratio | our peak MB | TRL peak MB | ratio) and writes a JSON
file (default ``benchmarks/results/vs_trl-<setting>.json``) with every raw run, the settings, the
versions (torch, transformers, trl), threads and date.

Settings: ``smoke`` is the ``smoke`` preset (a tiny random 2-layer Llama around the real SmolLM2
tokenizer, queries up to 256 tokens; batches as in the preset: SFT 8/4, reward 8/4, DPO 8/4 pairs,
PPO 8/4). ``smollm2`` is the ``cpu-demo`` preset's model and data (SmolLM2-135M-Instruct, queries
up to 512 tokens), with SFT batch 8 (micro-batch 8), reward 8 pairs (micro-batch 8 pairs), DPO 8
pairs (micro-batch 8 pairs), PPO 16 episodes per update (micro-batch 8), 4 PPO epochs, responses
of 53 tokens. ``--batch-size`` and ``--micro-batch-size`` override every stage's batch sizes.
``--stages`` defaults to ``sft,reward,ppo``; DPO runs when named (``--stages dpo``).

How it measures
---------------
1. Preparation, once, in ``.venv`` with our own code (``benchmarks/_ours_worker.py prep``): the
   pipeline's ``data`` and ``base_model`` stages into ``benchmarks/.work/<setting>/`` (reused when
   unchanged), an untrained reward model for our PPO, and the exact rows each stage trains on,
   in our batch order, as unpadded token-id lists (``rows-<stage>.json``). DPO's are the
   preference train split in DPO's batch order (the reward model's, for equal batch size and
   seed), each pair split into its shared query (``prompt_ids``) and its two responses
   (``chosen_ids``, ``rejected_ids``, each ending with the data's EOS).
2. For each repeat, for each stage: our run, then TRL's, each a fresh subprocess (ours with
   ``.venv/bin/python benchmarks/_ours_worker.py run``, TRL's with ``.venv-trl/bin/python
   benchmarks/_trl_worker.py``, which imports only torch/transformers/datasets/trl). Alternating
   spreads drift on a shared machine over both sides.
3. Each subprocess times its own training and prints a JSON line; model loading is not timed,
   and with two or more steps the first optimiser step (PPO: update) is the warm-up and is not
   timed either (with one step it is timed and flagged ``warmup_included``). SFT, reward and DPO
   throughput is non-PAD tokens per second, counted from the rows themselves for both sides
   (query+response tokens; for the reward model and DPO chosen and rejected, the query counted in
   both). PPO throughput is episodes
   (prompts) per second over whole updates: rollout (generation, reference, value and reward
   forward passes, advantages) plus the 4 PPO epochs.
4. Peak resident memory of each subprocess is its ``ru_maxrss`` from ``os.wait4`` (this process
   stays small and imports nothing heavy, so the child's figure is its own). The table shows the
   median throughput and the largest peak over the repeats of each side; ratios are ours/TRL
   (throughput above 1: we are faster; memory above 1: we use more).
5. With ``--device cuda`` the table adds model FLOPs utilisation for SFT, reward and DPO:
   ``6 * parameters * tokens/s / (--peak-tflops * 1e12)`` (default 989, H100 bf16 dense), for DPO
   ``8 *`` (the frozen reference's forward pass on top of the policy's forward and backward);
   not for PPO, whose FLOPs are not one formula of tokens. Both sides are credited the same
   nominal FLOPs per token, whatever work each skips.

Identical on both sides: the model directory (HF format, from our ``base_model`` stage), the
tokenizer (with our PAD), the rows and their order (TRL gets ``train_sampling_strategy=
"sequential"`` and, for PPO, a non-shuffling prompt loader), global batch, micro-batch and
gradient accumulation, the maximum lengths (TRL ``max_length`` = our padded lengths, so nothing
is truncated or dropped), bf16 autocast, ``torch.set_num_threads`` (default 2), dropout off, no
evaluation, no saving or checkpoints, no logging services (``report_to="none"``), no full
gradient checkpointing (TRL's configs default to it: turned off; ours runs each stage's default,
selective recomputation of elementwise ops for SFT and PPO, none for the reward model and DPO;
``--our-checkpointing false`` turns it off), ``torch.optim.AdamW`` with eps 1e-5,
weight decay 0.01 (torch's default, which ours uses; TRL applies it to non-bias, non-norm
weights only) and our learning rate and schedule (cosine for SFT, reward and DPO, linear for
PPO), PPO's response length, temperature, KL coefficient, clip ranges, value coefficient, gamma,
lambda, 4 epochs and one mini-batch per update. DPO: policy and reference both start from the
base model (standing in for the SFT policy, as the reward stage starts from it); TRL gets a
second copy as ``ref_model``, frozen; both compute the reference's log-probabilities per
micro-batch without gradients (TRL ``precompute_ref_log_probs=False``); the loss is the sigmoid
DPO loss with our ``beta`` (``loss_type="sigmoid"``; no label smoothing, weighting or reference
syncing), on log-probabilities summed over the response tokens, EOS included, the query
excluded (``benchmarks/dpo_loss_vs_trl.py`` and ``tests/benchmarks/test_dpo_loss_vs_trl.py``
check that the two losses agree on given log-probabilities).

bf16: ours runs its forward passes (generation included) under ``torch.autocast(bfloat16)``
with float32 weights. TRL's SFT, reward and DPO trainers honour ``bf16=True`` (accelerate wraps
the model's forward in autocast, CPU included; DPO's reference model is prepared the same way,
and its run reports and checks that model's linear-layer dtype too, ``ref_autocast_linear_dtype``). TRL's PPOTrainer builds its Accelerator without mixed
precision and ignores ``bf16=True``, so the worker wraps the ``forward`` of the policy, the
reference policy, and the backbones and score heads of the reward and value models in
``torch.autocast(device, dtype=torch.bfloat16)`` (forward passes only, like accelerate and like
ours; TRL calls those backbones and heads separately). Each TRL run reports the dtype a linear
layer produced during training (``autocast_linear_dtype``) and fails if it is not bf16.

Not identical, by design of each library (see the JSON's ``differences``):
- Padding: our SFT and reward stages load every row padded to the data set's padded length (the
  reference implementation's layout) and their forward passes drop the PAD columns past each
  micro-batch's longest row (``rlhf_core.train.forward.causal_forward``); TRL's collator pads each
  micro-batch to its longest row. The two compute on the same shapes; ``--trl-pad-to-max`` makes
  TRL pad to the data set's padded length instead, which only costs TRL time.
- TRL's default optimiser in transformers 5 is the fused AdamW; we set ``optim="adamw_torch"``
  to match ours (plain ``torch.optim.AdamW``).
- PPO: the reward and value models on the TRL side are ``AutoModelForSequenceClassification``
  (``num_labels=1``) from the base model, ours :class:`rlhf_core.train.reward.ScalarModel`; both have
  an untrained head, which does not change the work done. TRL subtracts ``missing_eos_penalty``
  from a score where ours replaces it by ``non_eos_penalty`` (same cost). TRL's generation stops
  early when every row of a micro-batch has produced EOS (``stop_token="eos"``); ours always
  samples the full response length, as the paper does.
- DPO rows: TRL 1.12's ``DPOTrainer`` has no pre-tokenised input; its ``_prepare_dataset``
  always extracts a text prompt, appends the EOS text and tokenises. The worker subclasses it
  with a ``_prepare_dataset`` that returns our ``prompt_ids``/``chosen_ids``/``rejected_ids``
  as they are, the columns TRL's own preparation would produce and its collator reads (prompt +
  response per row, right-padded, loss mask on the response): no re-tokenisation, no added BOS or
  EOS, and ``max_length`` our padded length (no truncation; the worker checks).
- DPO log-probabilities: ours runs each pair's shared query once and both responses against its
  key/value cache (``rlhf_core.train.dpo.pair_logprobs``), then the LM head only at response positions,
  in chunks of rows; with activation checkpointing (``--our-checkpointing selective`` or
  ``true``; off by default) it runs chosen and rejected concatenated instead, still without the
  full logits. TRL runs the chosen and
  rejected rows in full, materialises full-vocabulary logits at every position for the policy
  and the reference, and computes its logged statistics (entropy, mean logits, token accuracy)
  from them at every micro-batch, logging or not.
- The models' heads start from different random draws; losses differ, work does not.

The machine may be shared; the figures of a run are only as steady as the machine was (the
JSON records the load average before and after).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OURS_PY = REPO / ".venv" / "bin" / "python"
TRL_PY = REPO / ".venv-trl" / "bin" / "python"
OURS_WORKER = REPO / "benchmarks" / "_ours_worker.py"
TRL_WORKER = REPO / "benchmarks" / "_trl_worker.py"
STAGE_NAMES = ("sft", "reward", "dpo", "ppo")
UNITS = {"sft": "tok/s", "reward": "tok/s", "dpo": "tok/s", "ppo": "episodes/s"}
#: model FLOPs per token for MFU: forward and backward (6 N); DPO adds the reference's forward (2 N)
FLOPS_PER_PARAM_TOKEN = {"sft": 6, "reward": 6, "dpo": 8}

#: preset, and (batch size, micro-batch size) per stage; PPO response length (None: from the data).
SETTINGS = {
    "smoke": {
        "preset": "smoke",
        "sft": (8, 4),
        "reward": (8, 4),
        "dpo": (8, 4),
        "ppo": (8, 4),
        "response_length": None,
    },
    "smollm2": {
        "preset": "cpu-demo",
        "sft": (8, 8),
        "reward": (8, 8),
        "dpo": (8, 8),
        "ppo": (16, 8),
        "response_length": 53,
    },
}
SECTION = {"sft": "sft", "reward": "reward", "dpo": "dpo", "ppo": "ppo"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--setting", choices=sorted(SETTINGS), default="smoke")
    p.add_argument("--stages", default="sft,reward,ppo", help="comma-separated, from sft,reward,dpo,ppo")
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="optimiser steps (PPO: updates) per run; the first is the untimed warm-up when >= 2",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per side and stage, alternating ours/TRL")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on both sides")
    p.add_argument("--batch-size", type=int, default=None, help="global batch of every stage (default: per setting)")
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="micro-batch of every stage (default: per setting, at most --batch-size)",
    )
    p.add_argument("--response-length", type=int, default=None, help="PPO response length (default: per setting)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak bf16 TFLOP/s for MFU with --device cuda")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast on either side")
    p.add_argument(
        "--our-checkpointing",
        choices=("default", "false", "selective", "true"),
        default="default",
        help="our stages' gradient_checkpointing (default: each stage's config default); TRL's is off",
    )
    p.add_argument(
        "--trl-pad-to-max",
        action="store_true",
        help="TRL pads SFT/reward micro-batches to our padded length (same shapes as ours)",
    )
    p.add_argument("--ours-python", type=Path, default=OURS_PY, help="interpreter with this project installed")
    p.add_argument("--trl-python", type=Path, default=TRL_PY, help="interpreter with trl installed")
    p.add_argument("--timeout", type=float, default=None, help="seconds per subprocess")
    p.add_argument("--work", type=Path, default=None, help="work directory (default benchmarks/.work/<setting>)")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON output (default benchmarks/results/vs_trl-<setting>.json)"
    )
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in args.stages if s not in STAGE_NAMES]
    if bad or not args.stages:
        p.error(f"--stages: unknown {bad}; choose from {','.join(STAGE_NAMES)}")
    if args.steps < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--steps, --repeats and --threads must be >= 1")
    args.work = args.work or REPO / "benchmarks" / ".work" / args.setting
    args.out = args.out or REPO / "benchmarks" / "results" / f"vs_trl-{args.setting}.json"
    return args


def child_env(threads: int, device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "WANDB_DISABLED": "true",
            "WANDB_MODE": "disabled",
            "ACCELERATE_MIXED_PRECISION": "no",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.setdefault("RLHF_TLDR_DIR", str((REPO.parent / "shared" / "data" / "tldr").resolve()))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_child(cmd: list[str], env: dict, log_path: Path, timeout: float | None) -> dict:
    """Run ``cmd``; return its ``BENCH_RESULT`` JSON, wall time and peak RSS (MB, from ``wait4``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO, text=True)
        timer = threading.Timer(timeout, proc.kill) if timeout else None
        if timer:
            timer.start()
        assert proc.stdout is not None
        # no communicate()/wait(): they would reap the child before wait4 could read its resource usage
        lines = proc.stdout.readlines()
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if timer:
            timer.cancel()
    wall = time.perf_counter() - t0
    log_path.with_suffix(".stdout").write_text("".join(lines))
    found = [ln for ln in lines if ln.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not found:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {proc.returncode}; log {log_path}:\n{tail}")
    result = json.loads(found[-1][len("BENCH_RESULT ") :])
    result["wall_seconds"] = wall
    result["peak_rss_mb"] = usage.ru_maxrss / 1024  # KiB on Linux
    return result


def venv_versions(python: Path, modules: list[str], env: dict) -> dict:
    code = f"import importlib.metadata as m, json; print(json.dumps({{n: m.version(n) for n in {modules!r}}}))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def stage_sizes(args: argparse.Namespace, stage: str) -> tuple[int, int]:
    batch, micro = SETTINGS[args.setting][stage]
    if args.batch_size is not None:
        batch = args.batch_size
        micro = min(micro, batch)
    if args.micro_batch_size is not None:
        micro = args.micro_batch_size
    if batch % micro:
        raise SystemExit(f"{stage}: batch size {batch} is not a multiple of micro-batch size {micro}")
    return batch, micro


def our_overrides(args: argparse.Namespace, stage: str, num_epochs: int = 1) -> list[str]:
    """Config overrides for our stage: sizes, steps, bf16, no checkpoints, activation checkpointing
    as ``--our-checkpointing``."""
    batch, micro = stage_sizes(args, stage)
    bf16 = "false" if args.fp32 else "true"
    s = SECTION[stage]
    common = [
        f"{s}.batch_size={batch}",
        f"{s}.micro_batch_size={micro}",
        f"{s}.bf16={bf16}",
        f"{s}.checkpoint_every=1000000000",
    ]
    if args.our_checkpointing != "default":
        common.append(f"{s}.gradient_checkpointing={args.our_checkpointing}")
    if stage in ("sft", "reward", "dpo"):
        return common + [f"{s}.max_steps={args.steps}", f"{s}.num_epochs={num_epochs}", f"{s}.eval_max_samples=1"]
    rl = args.response_length or SETTINGS[args.setting]["response_length"]
    extra = [f"ppo.response_length={rl}"] if rl else []
    return (
        common
        + [
            f"ppo.total_episodes={args.steps * batch}",
            "ppo.ppo_epochs=4",
            "ppo.num_minibatches=1",
            "ppo.eval_every=1000000000",
        ]
        + extra
    )


def throughput(stage: str, run: dict, info: dict, batch: int, steps: int) -> float:
    start = run["timed_from_step"]
    if stage == "ppo":
        work = batch * (steps - start)
    else:
        work = sum(info["tokens_per_step"][start:])
    return work / run["timed_seconds"]


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    if abs(x) < 10:
        digits = max(digits, 2 if abs(x) >= 1 else 3)
    return f"{x:,.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for python, what in ((args.ours_python, "make install"), (args.trl_python, "make bench-venv-trl")):
        if not python.is_file():
            print(f"vs_trl: {python} is missing; run `{what}` first", file=sys.stderr)
            return 2
    env = child_env(args.threads, args.device)
    setting = SETTINGS[args.setting]
    args.work.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    started = _dt.datetime.now(_dt.UTC)
    load_before = os.getloadavg()
    t_all = time.perf_counter()

    # ---- preparation: our data and base-model stages, rows in our order
    prep_spec = {
        "preset": setting["preset"],
        "work": str(args.work),
        "device": args.device,
        "overrides": [o for st in args.stages for o in our_overrides(args, st)],
        "stages": {st: {"steps": args.steps, "batch_size": stage_sizes(args, st)[0]} for st in args.stages},
    }
    spec_path = args.work / "prep-spec.json"
    spec_path.write_text(json.dumps(prep_spec, indent=1))
    print(f"preparing {args.setting} inputs in {args.work} ...", file=sys.stderr, flush=True)
    prep = run_child([str(args.ours_python), str(OURS_WORKER), "prep", str(spec_path)], env, logs / "prep.log", None)
    print(f"  prepared in {prep['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
    versions = {
        "ours": venv_versions(args.ours_python, ["torch", "transformers", "accelerate"], env),
        "trl": venv_versions(args.trl_python, ["torch", "transformers", "accelerate", "trl", "datasets"], env),
    }

    # ---- the runs: for each repeat, for each stage, ours then TRL
    runs: list[dict] = []
    failures: list[str] = []
    for rep in range(args.repeats):
        for stage in args.stages:
            info = prep["stages"][stage]
            batch, micro = stage_sizes(args, stage)
            base = {
                "stage": stage,
                "steps": args.steps,
                "threads": args.threads,
                "device": args.device,
                "bf16": not args.fp32,
                "batch_size": batch,
                "micro_batch_size": micro,
            }
            ours_spec = dict(
                base,
                preset=setting["preset"],
                overrides=our_overrides(args, stage, info.get("num_epochs", 1)),
                data_dir=prep["data_dir"],
                base_model_dir=prep["base_model_dir"],
                reward_model_dir=info.get("reward_model_dir"),
                tokens_per_step=info.get("tokens_per_step"),
                out_dir=str(args.work / "ours-out" / stage),
            )
            trl_spec = dict(
                base,
                model_dir=prep["base_model_dir"],
                tokenizer_dir=prep["tokenizer_dir"],
                rows=info["rows"],
                learning_rate=info["learning_rate"],
                adam_eps=info["adam_eps"],
                weight_decay=0.01,
                scheduler=info["scheduler"],
                seed=info["seed"],
                trl_pad_to_max=args.trl_pad_to_max,
                dpo=info.get("dpo"),
                ppo=info.get("ppo"),
            )
            for side, python, worker, spec in (
                ("ours", args.ours_python, OURS_WORKER, ours_spec),
                ("trl", args.trl_python, TRL_WORKER, trl_spec),
            ):
                path = args.work / f"spec-{stage}-{side}.json"
                path.write_text(json.dumps(spec, indent=1))
                cmd = [str(python), str(worker)] + (["run"] if side == "ours" else []) + [str(path)]
                label = f"[{rep + 1}/{args.repeats}] {stage:6s} {side:4s}"
                print(f"{label} ...", file=sys.stderr, flush=True)
                try:
                    result = run_child(cmd, env, logs / f"{stage}-{side}-{rep}.log", args.timeout)
                except RuntimeError as exc:
                    failures.append(f"{label}: {exc}")
                    print(f"{label} FAILED: {exc}", file=sys.stderr, flush=True)
                    continue
                result["throughput"] = throughput(stage, result, info, batch, args.steps)
                result["repeat"] = rep
                runs.append(result)
                print(
                    f"{label} {fmt(result['throughput'])} {UNITS[stage]}, peak {result['peak_rss_mb']:,.0f} MB, "
                    f"wall {result['wall_seconds']:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

    # ---- summary
    summary = {}
    for stage in args.stages:
        row: dict = {"unit": UNITS[stage]}
        for side in ("ours", "trl"):
            mine = [r for r in runs if r["stage"] == stage and r["side"] == side]
            row[side] = {
                "runs": len(mine),
                "median_throughput": statistics.median(r["throughput"] for r in mine) if mine else None,
                "max_peak_rss_mb": max(r["peak_rss_mb"] for r in mine) if mine else None,
            }
            if mine and args.device == "cuda":
                row[side]["max_gpu_peak_mb"] = max(r.get("gpu_peak_mb", 0.0) for r in mine)
                if stage != "ppo":
                    flops = FLOPS_PER_PARAM_TOKEN[stage] * prep["n_params"] * row[side]["median_throughput"]
                    row[side]["mfu"] = flops / (args.peak_tflops * 1e12)
        o, t = row["ours"], row["trl"]
        row["throughput_ratio"] = (
            o["median_throughput"] / t["median_throughput"]
            if o["median_throughput"] and t["median_throughput"]
            else None
        )
        row["peak_rss_ratio"] = (
            o["max_peak_rss_mb"] / t["max_peak_rss_mb"] if o["max_peak_rss_mb"] and t["max_peak_rss_mb"] else None
        )
        summary[stage] = row

    header = ["stage", "ours", "TRL", "ratio", "our peak MB", "TRL peak MB", "ratio"]
    if args.device == "cuda":
        header += ["our MFU", "TRL MFU"]
    table = [header]
    for stage, row in summary.items():
        o, t = row["ours"], row["trl"]
        line = [
            stage,
            f"{fmt(o['median_throughput'])} {row['unit']}",
            fmt(t["median_throughput"]),
            fmt(row["throughput_ratio"], 2),
            fmt(o["max_peak_rss_mb"], 0),
            fmt(t["max_peak_rss_mb"], 0),
            fmt(row["peak_rss_ratio"], 2),
        ]
        if args.device == "cuda":
            line += [f"{o['mfu']:.1%}" if o.get("mfu") else "-", f"{t['mfu']:.1%}" if t.get("mfu") else "-"]
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    text = "\n".join(
        " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in table
    )
    rule = "-" * len(text.splitlines()[0])
    timed = "steps 2.." if args.steps >= 2 else "the single step (warm-up included)"
    print(
        f"\nvs TRL: setting {args.setting}, {args.steps} step(s) per run (timed: {timed}), {args.repeats} "
        f"repeat(s), {args.threads} thread(s), {args.device}, {'fp32' if args.fp32 else 'bf16 autocast'}; "
        f"ratio = ours/TRL"
    )
    print(rule + "\n" + text.replace("\n", "\n" + rule + "\n", 1) + "\n" + rule)

    record = {
        "setting": args.setting,
        "preset": setting["preset"],
        "date": started.isoformat(timespec="seconds"),
        "wall_seconds": time.perf_counter() - t_all,
        "prep_seconds": prep["wall_seconds"],
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "threads": args.threads,
        "device": args.device,
        "versions": versions,
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "settings": {
            st: {
                "batch_size": stage_sizes(args, st)[0],
                "micro_batch_size": stage_sizes(args, st)[1],
                "our_overrides": our_overrides(args, st, prep["stages"][st].get("num_epochs", 1)),
                **{k: v for k, v in prep["stages"][st].items() if k not in ("rows",)},
            }
            for st in args.stages
        },
        "model": {
            "base_model_dir": prep["base_model_dir"],
            "parameters": prep["n_params"],
            "padded_lengths": prep["padded_lengths"],
        },
        "summary": summary,
        "table": text,
        "runs": runs,
        "failures": failures,
        "differences": [
            "padding: ours stores SFT/reward rows padded to the data set's padded length and drops the PAD "
            "columns past each micro-batch's longest row in the forward pass; TRL pads each micro-batch to "
            "its longest row" + (" (here --trl-pad-to-max: TRL pads to our length too)" if args.trl_pad_to_max else ""),
            "PPO reward/value models: TRL AutoModelForSequenceClassification(num_labels=1) vs our ScalarModel, both "
            "with untrained heads",
            "PPO missing EOS: TRL subtracts missing_eos_penalty, ours replaces the score by non_eos_penalty",
            "PPO generation: TRL stops a micro-batch early when every row has produced EOS; ours samples the full "
            "response length",
            "TRL PPO: forward passes wrapped in torch.autocast(bf16) by the benchmark (its PPOTrainer ignores "
            "bf16=True); TRL SFT/reward/DPO: bf16=True (accelerate autocast, DPO's reference model included)",
            "weight decay 0.01 on both; TRL exempts biases and norm weights",
        ]
        + (
            [
                "DPO rows: TRL's DPOTrainer gets our prompt_ids/chosen_ids/rejected_ids as they are (its "
                "_prepare_dataset, which would re-tokenise text and append EOS, is bypassed by a subclass)",
                "DPO log-probs: ours runs each pair's shared query once and the two responses against its "
                "key/value cache (rlhf_core.train.dpo.pair_logprobs; with activation checkpointing, off by default, "
                "it concatenates chosen and rejected instead), then the LM head only at response "
                "positions, in chunks; TRL runs chosen and rejected rows in full and computes full-vocabulary "
                "logits at every position (plus its logged statistics: entropy, mean logits, token accuracy)",
                "DPO loss: the sigmoid loss -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))) on both (ours "
                "takes beta into each log-ratio first: equal up to float32 rounding), beta "
                f"{prep['stages']['dpo']['dpo']['beta']}; reference forward per micro-batch on both "
                "(precompute_ref_log_probs=False); benchmarks/dpo_loss_vs_trl.py and "
                "tests/benchmarks/test_dpo_loss_vs_trl.py check the loss values",
            ]
            if "dpo" in args.stages
            else []
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out} ({record['wall_seconds']:.0f} s in all)")
    if failures:
        print(f"{len(failures)} run(s) failed; see the logs in {logs}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
