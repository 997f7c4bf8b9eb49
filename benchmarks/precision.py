"""Training and generation speed in float32 and in bf16 autocast on this machine, and what
``bf16: auto`` chooses here.

Usage: .venv/bin/python benchmarks/precision.py [--preset cpu-demo] [--batch 8] [--tokens 384]
       [--repeats 3] [--threads 2] [--out benchmarks/results/precision.json]

The base model of the preset (SmolLM2-135M-Instruct for cpu-demo, imported as the pipeline
does) runs a forward and backward pass of the causal-LM loss over ``batch x tokens`` real
TL;DR tokens (SFT rows, truncated to ``tokens``), and samples 32 tokens for 8 queries with
the KV cache; float32 and bf16 autocast alternate, ``repeats`` times each after one warm-up
of each. Prints tokens/s per precision, their ratio, the CPU's bf16 features, and the
precision ``bf16: auto`` resolves to (:func:`rlhf_core.train.training.resolve_bf16`); writes the
same as JSON. Run it alone: two heavy jobs on two cores slow each other several times over.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/precision.json")
    args = parser.parse_args()

    import tempfile

    import torch

    from rlhf_core.config.presets import load_config
    from rlhf_core.data.prepare import truncate_query
    from rlhf_core.data.rows import load_split
    from rlhf_core.models.base import import_base_model
    from rlhf_core.models.saved import load_causal_lm
    from rlhf_core.models.tokenizers import load_tokenizer
    from rlhf_core.train.generation import generate
    from rlhf_core.train.training import NATIVE_BF16_CPU_FEATURES, autocast, cpu_features, precision_name

    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset)
    device = torch.device("cpu")
    tokenizer = load_tokenizer(cfg.model)
    split = load_split(cfg.data, "sft", cfg.data.sft_splits["train"], cfg.data.tldr_format)
    rows = split.rows[: args.batch]
    ids = [truncate_query(r, tokenizer, cfg.data.tldr_format)[1] for r in rows]
    ids = [(i * (args.tokens // len(i) + 1))[: args.tokens] for i in ids]  # real text, every row `tokens` long
    input_ids = torch.tensor(ids)
    queries = torch.tensor([i[:128] for i in ids])
    with tempfile.TemporaryDirectory() as tmp:
        import_base_model(cfg.model, Path(tmp) / "base")
        model = load_causal_lm(Path(tmp) / "base").to(device)

    def train_step(bf16: bool) -> float:
        model.train()
        t0 = time.perf_counter()
        with autocast(device, bf16):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return input_ids.numel() / (time.perf_counter() - t0)

    def generate_step(bf16: bool) -> float:
        model.eval()
        t0 = time.perf_counter()
        with autocast(device, bf16):
            out = generate(model, queries, tokenizer.pad_token_id, 32, 0.7)
        return out.numel() / (time.perf_counter() - t0)

    results: dict[str, dict[str, list[float]]] = {
        "train": {"float32": [], "bf16": []},
        "generate": {"float32": [], "bf16": []},
    }
    for job, fn in (("train", train_step), ("generate", generate_step)):
        fn(False), fn(True)  # warm-up
        for _ in range(args.repeats):
            for name, bf16 in (("float32", False), ("bf16", True)):
                results[job][name].append(fn(bf16))
    flags = sorted(f for f in cpu_features() if f.startswith(("avx512", "amx")))
    summary = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": args.threads,
            "native_bf16_features": [f for f in NATIVE_BF16_CPU_FEATURES if f in cpu_features()],
            "avx512_amx_flags": flags,
            "torch": torch.__version__,
        },
        "auto_resolves_to": precision_name("auto", device),
        "setting": {
            "preset": args.preset,
            "model": cfg.model.base,
            "batch": args.batch,
            "tokens": args.tokens,
            "repeats": args.repeats,
        },
    }
    for job in results:
        f32, b16 = statistics.median(results[job]["float32"]), statistics.median(results[job]["bf16"])
        summary[job] = {
            "float32_tokens_per_s": f32,
            "bf16_tokens_per_s": b16,
            "bf16_over_float32": b16 / f32,
            "runs": results[job],
        }
        print(f"{job:9s} float32 {f32:8.1f} tok/s   bf16 autocast {b16:8.1f} tok/s   bf16/float32 {b16 / f32:.2f}")
    print(
        f"CPU bf16 features: {summary['machine']['native_bf16_features'] or 'none'} "
        f"(avx512/amx flags: {' '.join(flags) or 'none'}); bf16: auto -> {summary['auto_resolves_to']}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
