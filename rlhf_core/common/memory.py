"""Memory a finished stage freed, given back to the operating system before the next stage.

PyTorch's CPU tensors come from the C allocator. glibc serves an allocation below its mmap
threshold from its heaps and keeps the memory when the tensor is freed, for reuse; the threshold
starts at 128 KiB and rises to the size of each larger block freed, up to 32 MiB, so after the
first few steps a stage's activations, gradients and logits chunks all come from the heaps. One
process that runs the stages one after another (``rlhf run``, ``rlhf stages``, a Prefect worker)
then keeps a finished stage's peak resident while the next stage runs, and whatever a later
stage cannot fit into those freed blocks comes on top. ``malloc_trim(0)`` returns the heaps'
free pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)


def resident_bytes() -> int | None:
    """The process's resident set now, in bytes (Linux ``/proc/self/statm``); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_free_memory(after: str = "") -> int | None:
    """Give the C allocator's free memory back to the operating system (glibc's
    ``malloc_trim(0)``); live tensors are untouched, so no result changes.

    Args:
        after: the stage just finished, named in the log line.

    Returns:
        The resident bytes released (resident set before less after; Linux), or None where
        the C library has no ``malloc_trim`` or the resident set cannot be read.
    """
    trim = _malloc_trim()
    if trim is None:
        return None
    before = resident_bytes()
    trim(0)
    now = resident_bytes()
    if before is None or now is None:
        return None
    released = max(before - now, 0)
    log.info(
        "%sfreed memory given back to the system: %.2f GiB (resident %.2f GiB)",
        f"after stage {after}: " if after else "",
        released / 2**30,
        now / 2**30,
    )
    return released
