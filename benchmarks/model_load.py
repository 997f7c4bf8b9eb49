"""Time loading the base model: dequantising the GGUF file vs the cached safetensors checkpoint.

Usage: .venv/bin/python benchmarks/model_load.py [--preset cpu-demo] [--repeats 5]

Prints a JSON line: first import (GGUF dequantisation, cold cache), cached import, and
the median time of ``load_causal_lm`` on the imported checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RLHF_CACHE_DIR"] = str(Path(tmp) / "cache")  # cold cache
        from rlhf_core.config.presets import load_config
        from rlhf_core.models.base import import_base_model
        from rlhf_core.models.saved import load_causal_lm

        cfg = load_config(args.preset)
        t0 = time.perf_counter()
        import_base_model(cfg.model, Path(tmp) / "first")
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        import_base_model(cfg.model, Path(tmp) / "second")
        warm = time.perf_counter() - t0
        loads = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model = load_causal_lm(Path(tmp) / "second")
            loads.append(time.perf_counter() - t0)
            del model
        print(
            json.dumps(
                {
                    "preset": args.preset,
                    "import_cold_cache_s": round(cold, 2),
                    "import_warm_cache_s": round(warm, 2),
                    "load_causal_lm_median_s": round(statistics.median(loads), 3),
                    "load_causal_lm_all_s": [round(x, 3) for x in loads],
                }
            )
        )


if __name__ == "__main__":
    main()
