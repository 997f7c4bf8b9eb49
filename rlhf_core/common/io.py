"""Crash-safe file-system work: atomic writes, content digests, the exclusive run lock, and the
names and places of the files every stage shares (its metrics, the cache folder).

A file or directory appears complete under its final name, or not at all; the lock keeps two
runs from writing one place."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The preset files' folder, ``configs/`` beside the package.
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs"


def cache_root() -> Path:
    """Where converted checkpoints and fetched rows are cached: ``$RLHF_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/rlhf``, else ``~/.cache/rlhf``."""
    if os.environ.get("RLHF_CACHE_DIR"):
        return Path(os.environ["RLHF_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlhf"


def json_digest(payload: Any, length: int = 16) -> str:
    """The first ``length`` hex characters of the SHA-256 of ``payload`` as canonical JSON (keys
    sorted; paths and tensors' scalars as :func:`write_json_atomic` writes them). The one digest
    of settings: stage cache keys (:func:`rlhf_core.run.pipeline.stage_key`) and checkpoint
    compatibility (:class:`rlhf_core.train.training.CheckpointManager`).

    Raises:
        TypeError: ``payload`` is not JSON-serialisable.
    """
    text = json.dumps(payload, sort_keys=True, default=_json_default)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: ``file_sha256`` results by (path, size, mtime in ns, inode): an unchanged file is hashed once
#: per process; any change to its size, time or inode makes it hashed again.
_SHA256_MEMO: dict[tuple[str, int, int, int], str] = {}


def content_digest(paths: Iterable[str | os.PathLike], root: str | os.PathLike | None = None) -> str:
    """SHA-256 (16 hex) of the contents of ``paths`` (files, or directories read recursively),
    each file named by its path relative to ``root`` (default: its own name or, inside a
    directory, its path relative to that directory). Where the files live does not count,
    so a moved copy has the same digest; a changed byte, file name or file set changes it.

    Part of the cache keys of stages that read files that are not settings (the TL;DR data,
    a local or packaged model): :func:`rlhf_core.run.pipeline.stage_key`.

    Raises:
        FileNotFoundError: a path does not exist.
    """
    entries: dict[str, str] = {}
    for given in map(Path, paths):
        if not given.exists():
            raise FileNotFoundError(f"{given}: no such file or directory")
        base = Path(root) if root is not None else (given if given.is_dir() else given.parent)
        files = sorted(p for p in given.rglob("*") if p.is_file()) if given.is_dir() else [given]
        for path in files:
            st = path.stat()
            memo_key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
            if memo_key not in _SHA256_MEMO:
                _SHA256_MEMO[memo_key] = file_sha256(path)
            entries[path.relative_to(base).as_posix()] = _SHA256_MEMO[memo_key]
    return json_digest(entries)


#: A stage's metrics, in its output: the end-of-stage ones (``metrics.json``) and the tracker's
#: log of every step (``metrics.jsonl``, :class:`rlhf_core.common.tracking.JsonlTracker`).
METRICS_FILE = "metrics.json"
METRICS_LOG = "metrics.jsonl"
#: A trainer stage's evaluation summaries, one JSON object per row, in its output.
SAMPLES_FILE = "samples.jsonl"

#: Top-level files that record how a stage's work went (timings included): listed in its
#: manifest with their SHA-256 and checked like every file, but not part of its digest, which
#: names the product alone, so that identical work gives an identical digest.
RECORD_FILES = (METRICS_FILE, METRICS_LOG)

#: How old (ns) a file must be, once read, for a manifest to record its modification time: a
#: rewrite soon after, within the file system's timestamp granularity, could keep the same
#: time, so a file younger than this is read at every check until one finds it older and
#: records its time (:attr:`ManifestCheck.restamped`).
RECENT_NS = 1_000_000_000


def manifest_digest(files: dict[str, dict[str, Any]]) -> str:
    """SHA-256 (64 hex) of a manifest's entries: each file's relative path, size and SHA-256,
    :data:`RECORD_FILES` and any other key of an entry (``mtime_ns``: bookkeeping, not content)
    left out. Equal for equal contents wherever and whenever the files were written: a copied
    or restored tree has the digest of its original, the one digest that names an artifact
    (``tasks.stages``' cache keys are built on it)."""
    product = {
        rel: {"sha256": meta["sha256"], "size": meta["size"]} for rel, meta in files.items() if rel not in RECORD_FILES
    }
    return hashlib.sha256(json.dumps(product, sort_keys=True).encode()).hexdigest()


def coarse_time(mtime_ns: int) -> bool:
    """Whether a modification time may come from a file system whose timestamps are coarser than
    :data:`RECENT_NS` (FAT's 2 s, some network file systems): a whole second, no sub-second part.
    Such a time is never recorded, so the file is read at every check. (One written on a
    fine-grained file system at a whole second, one time in a billion, is only read again.)"""
    return mtime_ns % 1_000_000_000 == 0


def _read_steady(path: Path) -> tuple[os.stat_result, str, int | None]:
    """``(stat before reading, SHA-256, modification time to record or None)``: the time is
    recorded only when size and time did not change while the file was read, it was older
    than :data:`RECENT_NS` when the read began (the clock is read before the hash, so a slow
    read does not age the file), and it is not a :func:`coarse_time`."""
    now = time.time_ns()
    before = path.stat()
    sha256 = file_sha256(path)
    after = path.stat()
    steady = (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    settled = steady and before.st_mtime_ns < now - RECENT_NS and not coarse_time(before.st_mtime_ns)
    return before, sha256, before.st_mtime_ns if settled else None


def tree_manifest(root: str | os.PathLike, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{"files": {relpath: {"size", "sha256", "mtime_ns"}}, "digest": manifest_digest(files)}``
    for every file under ``root``, top-level entries named in ``exclude`` left out: what a
    stage's output is checked against before it is reused (:func:`check_manifest`). Sizes in
    bytes; ``mtime_ns`` is the file's ``st_mtime_ns``, left out for a file modified within
    :data:`RECENT_NS` of being read or while it was read. The digest
    (:func:`manifest_digest`) covers paths, sizes and SHA-256 only, not times."""
    base = Path(root)
    files = {}
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        rel = path.relative_to(base).as_posix()
        if rel.split("/", 1)[0] in exclude:
            continue
        st, sha256, mtime_ns = _read_steady(path)
        files[rel] = {"size": st.st_size, "sha256": sha256}
        if mtime_ns is not None:
            files[rel]["mtime_ns"] = mtime_ns
    return {"files": files, "digest": manifest_digest(files)}


@dataclass
class ManifestCheck:
    """What :func:`check_manifest` found: ``problems`` (one line per difference, naming the
    file), ``read`` (the files it hashed) and ``restamped`` (``{relpath: st_mtime_ns}`` for
    files it hashed and found unchanged whose time the manifest lacks or records otherwise,
    e.g. after a copy: :meth:`restamp` gives the manifest with those times, so that the next
    check need not read them)."""

    problems: list[str] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    restamped: dict[str, int] = field(default_factory=dict)

    def restamp(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """``manifest`` with the times of :attr:`restamped` recorded (its digest unchanged)."""
        files = {
            rel: {**meta, "mtime_ns": self.restamped[rel]} if rel in self.restamped else meta
            for rel, meta in manifest["files"].items()
        }
        return {**manifest, "files": files}


def check_manifest(
    root: str | os.PathLike, manifest: dict[str, Any], rehash: bool = False, first: bool = False
) -> ManifestCheck:
    """Compare the files under ``root`` with ``manifest`` (:func:`tree_manifest`).

    A missing file or one of another size is a problem without being read. A file whose size
    and ``st_mtime_ns`` equal the manifest's is taken as unchanged without being read; any
    other (one rewritten in place, even at the same size, has a new time; every file of a
    manifest without times; every file when ``rehash``) is hashed, and a SHA-256 other than
    the manifest's is a problem. ``first`` stops at the first problem.

    The trade-off: a same-size change whose modification time is then set back to the
    recorded one (``os.utime``, ``touch -d``) is not seen without ``rehash`` (``rlhf
    verify``). Reading every file of a 1B stage costs seconds; checking its sizes and times,
    milliseconds.

    Raises:
        KeyError: ``manifest`` has no ``files``.
    """
    base = Path(root)
    check = ManifestCheck()
    for rel, meta in manifest["files"].items():
        path = base / rel
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            check.problems.append(f"{rel}: missing")
        elif st.st_size != meta["size"]:
            check.problems.append(f"{rel}: {st.st_size} bytes, its manifest says {meta['size']}")
        elif rehash or st.st_mtime_ns != meta.get("mtime_ns"):
            check.read.append(rel)
            _, sha256, mtime_ns = _read_steady(path)
            if sha256 != meta["sha256"]:
                check.problems.append(f"{rel}: SHA-256 differs from its manifest (changed in place)")
            elif mtime_ns is not None and mtime_ns != meta.get("mtime_ns"):
                check.restamped[rel] = mtime_ns
        if first and check.problems:
            break
    return check


def manifest_mismatch(root: str | os.PathLike, manifest: dict[str, Any], rehash: bool = False) -> str | None:
    """``None`` when every file ``manifest`` lists (:func:`tree_manifest`) is under ``root`` with
    its size and SHA-256; else the first difference, naming the file
    (``"model/model.safetensors: SHA-256 differs from its manifest (changed in place)"``). Only
    files whose size or time differ from the manifest's are read, unless ``rehash``
    (:func:`check_manifest`, its trade-off included)."""
    problems = check_manifest(root, manifest, rehash=rehash, first=True).problems
    return problems[0] if problems else None


def verify_manifest(root: str | os.PathLike, manifest: dict[str, Any]) -> list[str]:
    """Every difference between the files under ``root`` and ``manifest``, every file read
    (:func:`check_manifest` with ``rehash``), and whether the manifest's digest is that of its
    entries (an edited manifest); ``[]`` when all match. Files the manifest does not list are
    not checked."""
    problems = check_manifest(root, manifest, rehash=True).problems
    if "digest" in manifest and manifest_digest(manifest["files"]) != manifest["digest"]:
        problems.append("the manifest's digest is not that of its entries (the manifest was edited)")
    return problems


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Open a temporary sibling of ``path`` for writing (``mode`` ``"w"`` or ``"wb"``); on a clean
    exit it is flushed, fsynced and renamed to ``path``; on an exception it is removed and
    ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path`` through a temporary file and a rename.

    Raises:
        TypeError: when ``data`` is not JSON-serialisable (nothing is written).
    """
    text = json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n"
    with atomic_file(path) as fh:
        fh.write(text)
    return Path(path)


def write_jsonl_atomic(path: str | os.PathLike, rows: Iterable[Any]) -> Path:
    """Write one JSON object per line to ``path`` through a temporary file and a rename."""
    with atomic_file(path) as fh:
        fh.writelines(json.dumps(row, default=_json_default) + "\n" for row in rows)
    return Path(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary sibling name and rename it to ``path`` on success.

    On an exception the partial directory is removed and ``path`` is left as it was.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false, also where another process
            made it while this one built its own (which is then removed, the other's kept).
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists (pass overwrite to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the usual permissions
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists() and not overwrite:  # another process's directory took the name meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileExistsError(f"{path} already exists (made by another process meanwhile)")
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


class LockHeldError(RuntimeError):
    """An :func:`exclusive_lock` taken with ``wait=False`` is held by another process."""


def _lock_holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        info = json.loads(os.read(fd, 4096) or b"{}")
    except ValueError:
        info = {}
    if not info:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info.get('pid')} on {info.get('host')} since {since}"


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, what: str, wait: bool = True) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created, with its parents) for the ``with`` block.

    The lock is ``flock(2)`` on the file, so the kernel releases it when the holder exits,
    however it exits (no stale locks after a kill); it excludes processes on one machine, or
    on machines sharing a file system whose ``flock`` is coherent across them. The holder's
    PID, host and start time are written into the file; a second process logs them (naming
    ``what``) and waits, or with ``wait=False`` raises.

    Raises:
        LockHeldError: ``wait`` is false and another process holds the lock.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            if not wait:
                raise LockHeldError(f"{what} is in use by {holder} (lock {path})") from None
            log.warning("waiting for %s: in use by %s (lock %s)", what, holder, path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock
