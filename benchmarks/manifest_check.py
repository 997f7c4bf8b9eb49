"""Time checking a finished stage's output against its manifest before it is reused.

Usage: .venv/bin/python benchmarks/manifest_check.py [--gib 4.0] [--repeats 3] [--out FILE]

Builds a stage-like directory (one ``model/model.safetensors`` of ``--gib`` GiB, the size of a
1B float32 model at 4.0, and a few small files) last written an hour ago, records its
manifest (:func:`rlhf_core.common.io.tree_manifest`), then times, best of ``--repeats``:

- the check before reuse (:func:`rlhf_core.common.io.check_manifest`): sizes and times only;
- the same check against a manifest without times (written before times were recorded):
  every file read, as every check did before;
- ``rlhf verify``'s full check (:func:`rlhf_core.common.io.verify_manifest`).

The file was just written, so it is read from the page cache: the full checks measure
SHA-256 on the CPU, not the disk. Prints a JSON record (CPU model and flags included) and
writes it to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def cpu_info() -> dict:
    """The CPU model, core count and whether SHA and AVX-512 BF16 instructions are present."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {
        "model": model or platform.processor(),
        "cores": os.cpu_count(),
        "sha_ni": "sha_ni" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
    }


def best(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="size of the model file (GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from rlhf_core.common.io import check_manifest, tree_manifest, verify_manifest

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        root = Path(tmp) / "ppo"
        (root / "model").mkdir(parents=True)
        block = os.urandom(1 << 20)
        with open(root / "model" / "model.safetensors", "wb") as fh:
            for _ in range(round(args.gib * 1024)):
                fh.write(block)
        for name in ("model/config.json", "model/generation_config.json", "metrics.jsonl", "stats.json"):
            (root / name).write_text(json.dumps({"name": name}))
        then = time.time_ns() - 3600 * 10**9
        for path in root.rglob("*"):
            if path.is_file():
                os.utime(path, ns=(then, then))
        t0 = time.perf_counter()
        manifest = tree_manifest(root)
        record_s = time.perf_counter() - t0
        without_times = {
            **manifest,
            "files": {rel: {"size": m["size"], "sha256": m["sha256"]} for rel, m in manifest["files"].items()},
        }
        quick_s, quick = best(lambda: check_manifest(root, manifest, first=True), args.repeats)
        full_s, full = best(lambda: check_manifest(root, without_times, first=True), args.repeats)
        verify_s, problems = best(lambda: verify_manifest(root, manifest), args.repeats)
        assert not quick.problems and not quick.read and not full.problems and not problems
        assert len(full.read) == len(manifest["files"])
    record = {
        "model_file_gib": args.gib,
        "files": len(manifest["files"]),
        "seconds": {
            "tree_manifest": round(record_s, 4),
            "check_before_reuse": round(quick_s, 6),
            "check_without_times": round(full_s, 4),
            "verify": round(verify_s, 4),
        },
        "repeats": args.repeats,
        "cpu": cpu_info(),
        "note": "best of repeats; the file in the page cache; other jobs may share the machine",
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
