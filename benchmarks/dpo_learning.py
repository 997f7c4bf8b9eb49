"""Does DPO learn? SmolLM2-135M trained with DPO (``rlhf_core.train.dpo.run_dpo``) on real TL;DR
preference pairs from an SFT policy, then its implicit reward model evaluated on the
validation pairs exactly as the reward model is (Detail 19, Figure 6).

Usage::

    .venv/bin/python benchmarks/dpo_learning.py --data DATA_DIR --sft-model SFT_MODEL_DIR \\
        [--steps 8] [--batch-size 32] [--eval-samples 400] [--out benchmarks/results/dpo_learning.json]

``DATA_DIR`` is a prepared cpu-demo data stage (``rlhf stages`` or a run's
``artifacts/data/<key>``; ``benchmarks/ppo_learning.py`` leaves one under ``benchmarks/.work``),
``SFT_MODEL_DIR`` an SFT policy. Settings are the ``cpu-demo`` preset's ``dpo`` section with
the reward model's batch size, so the pairs are the reward model's, in its order. Prints the
CPU features that decide the precision, each step's Figure 6 metrics, and the implicit reward
model's validation accuracy with its 95% Wilson interval; writes them all to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--sft-model", required=True)
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eval-samples", type=int, default=400)
    parser.add_argument("--out", default="benchmarks/results/dpo_learning.json")
    args = parser.parse_args()

    import torch

    from rlhf_core.common.tracking import JsonlTracker, read_metrics
    from rlhf_core.config.presets import load_config
    from rlhf_core.evaluation.dpo_eval import evaluate_dpo_reward
    from rlhf_core.train.dpo import run_dpo
    from rlhf_core.train.training import resolve_bf16

    cfg = load_config(
        args.preset,
        [
            f"dpo.batch_size={args.batch_size}",
            f"dpo.max_steps={args.steps}",
            f"reward.eval_max_samples={args.eval_samples}",
        ],
    )
    features = {k: v for k, v in torch.cpu.get_capabilities().items() if k in ("avx512_bf16", "amx_bf16")}
    precision = "bf16-autocast" if resolve_bf16(cfg.dpo.bf16, torch.device("cpu")) else "float32"
    print(f"CPU features {features}; precision {precision}", flush=True)
    with tempfile.TemporaryDirectory(dir=Path(args.out).parent) as tmp:
        out = Path(tmp) / "dpo"
        t0 = time.perf_counter()
        run_dpo(cfg.dpo, args.data, args.sft_model, out, JsonlTracker(out / "metrics.jsonl"))
        train_seconds = time.perf_counter() - t0
        steps = [m for _, m in read_metrics(out / "metrics.jsonl") if "dpo/loss" in m]
        for m in steps:
            print(
                f"step {int(m['step']):3d}  loss {m['dpo/loss']:.4f}  accuracy {m['dpo/accuracy']:.3f}  "
                f"chosen {m['dpo/rewards/chosen']:+.4f}  rejected {m['dpo/rewards/rejected']:+.4f}  "
                f"margin {m['dpo/rewards/margin']:+.4f}",
                flush=True,
            )
        t0 = time.perf_counter()
        metrics = evaluate_dpo_reward(cfg.dpo, cfg.reward, args.data, out / "model", args.sft_model, Path(tmp) / "eval")
        eval_seconds = time.perf_counter() - t0
    headline = {k: v for k, v in metrics.items() if k.split("/")[-1].startswith("accuracy") and "/accuracy/" not in k}
    print(json.dumps(headline, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "args": vars(args),
                "cpu_features": features,
                "precision": precision,
                "steps": steps,
                "eval": metrics,
                "train_seconds": train_seconds,
                "eval_seconds": eval_seconds,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
