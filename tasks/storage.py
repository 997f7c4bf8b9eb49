"""Stage artifacts under ``RLHF_ARTIFACT_ROOT``: a local directory or an ``s3://bucket/prefix`` URI.

A stage's artifact is a directory tree stored under a key such as ``sft/3f2a...``. It counts
as present only when its ``MANIFEST.json`` (every file's relative path, size and SHA-256,
plus a digest of them all) is there, and the manifest is written last: on a local disk the
tree is built under a temporary name and renamed into place; on S3, where there is no
rename, the files are uploaded first and the manifest after them. A crash part way through
an upload therefore never leaves something that looks complete.

S3 endpoint and credentials come from the usual AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``) through ``s3fs``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.common.io import check_manifest, file_sha256, tree_manifest

MANIFEST = "MANIFEST.json"
#: the smallest file that :meth:`ArtifactStore.put_dir` and :meth:`ArtifactStore.move_dir` hard-link
#: to an identical stored file instead of keeping a second copy (model weights, not metadata)
LINK_MIN_BYTES = 1 << 20


class ArtifactError(RuntimeError):
    """An artifact that is missing, incomplete, or whose files do not match its manifest."""


def build_manifest(local_dir: str | os.PathLike, exclude: tuple[str, ...] = ()) -> dict:
    """``{"files": {relpath: {"size", "sha256"}}, "digest": sha256 of the sorted entries}`` for a
    tree (:func:`rlhf_core.common.io.tree_manifest`), its ``MANIFEST.json`` and the top-level entries
    named in ``exclude`` left out."""
    return tree_manifest(local_dir, exclude=(*exclude, MANIFEST))


def _remove(root: Path, names: tuple[str, ...]) -> None:
    """Delete the top-level entries ``names`` of ``root`` (folders whole), where present."""
    for name in names:
        entry = root / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.exists() or entry.is_symlink():
            entry.unlink()


class ArtifactStore:
    """Put and get stage directories under one root (local path or ``s3://``).

    Args:
        root: the store's root; default ``$RLHF_ARTIFACT_ROOT``, else ``./artifacts``.
    """

    def __init__(self, root: str | None = None):
        self.root = (root or os.environ.get("RLHF_ARTIFACT_ROOT") or "artifacts").rstrip("/")
        self.fs, self.base = fsspec.core.url_to_fs(self.root)
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def uri(self, key: str) -> str:
        """The full URI of ``key`` (``s3://bucket/prefix/key`` or an absolute local path)."""
        if self.is_local:
            return str(Path(self.base, key).resolve())
        return f"{self.root}/{key}"

    def _path(self, key: str) -> str:
        return f"{self.base}/{key}"

    def manifest(self, key: str) -> dict | None:
        """The manifest of a complete artifact, or ``None`` when absent or incomplete."""
        path = f"{self._path(key)}/{MANIFEST}"
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "r") as fh:
            return json.load(fh)

    def exists(self, key: str) -> bool:
        """True when the artifact is complete (its manifest is present)."""
        return self.manifest(key) is not None

    def damage(self, key: str, digest: str) -> str | None:
        """``None`` when artifact ``key`` is complete, has manifest digest ``digest`` and every
        file its manifest lists has the listed size and SHA-256; else what is wrong, naming the
        file. On S3 each file is read (streamed); in a local store only the files whose size or
        modification time differ from the manifest's (:func:`rlhf_core.common.io.check_manifest`, whose
        trade-off holds here: ``rlhf verify`` reads them all).
        """
        manifest = self.manifest(key)
        if manifest is None:
            return f"{self.uri(key)} is missing or incomplete (no {MANIFEST})"
        if manifest["digest"] != digest:
            return f"{self.uri(key)} holds another artifact (manifest digest {manifest['digest'][:12]})"
        if self.is_local:
            problems = check_manifest(self._path(key), manifest, first=True).problems
            return f"{self.uri(key)}/{problems[0]}" if problems else None
        prefix = self._path(key).rstrip("/") + "/"
        sizes = {
            path.split(prefix, 1)[-1]: info.get("size")
            for path, info in self.fs.find(self._path(key), detail=True).items()
        }
        for rel, meta in manifest["files"].items():
            if sizes.get(rel) != meta["size"]:
                return f"{self.uri(key)}/{rel}: missing or not {meta['size']} bytes as its manifest says"
            h = hashlib.sha256()
            with self.fs.open(f"{prefix}{rel}", "rb") as fh:
                for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() != meta["sha256"]:
                return f"{self.uri(key)}/{rel}: SHA-256 differs from its manifest (changed in place)"
        return None

    def is_intact(self, key: str, digest: str) -> bool:
        """True when :meth:`damage` finds nothing wrong with artifact ``key``."""
        return self.damage(key, digest) is None

    def check_writable(self) -> None:
        """Write and remove a small file under the root (created if missing): a read-only or
        unreachable store fails here, before any stage has run, not after a stage's work.

        Raises:
            ArtifactError: naming the root and the cause.
        """
        probe = f"{self.base}/.rlhf-write-test-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.makedirs(self.base, exist_ok=True)
            with self.fs.open(probe, "wb") as fh:
                fh.write(b"ok")
            self.fs.rm(probe)
        except Exception as exc:  # OSError locally; botocore/aiohttp errors on S3
            raise ArtifactError(
                f"the artifact root {self.root} (RLHF_ARTIFACT_ROOT) is not writable: {type(exc).__name__}: {exc}"
            ) from None

    def put_text(self, name: str, text: str) -> None:
        """Write the small file ``name`` under the root, whole (a stage's record beside its
        artifact on S3, :func:`tasks.stages.finished_record`)."""
        with self.fs.open(self._path(name), "w") as fh:
            fh.write(text)

    def get_text(self, name: str) -> str | None:
        """The small file ``name`` under the root (:meth:`put_text`), or None when absent."""
        try:
            with self.fs.open(self._path(name), "r") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def put_dir(self, local_dir: str | os.PathLike, key: str, exclude: tuple[str, ...] = ()) -> dict:
        """Store a local directory as artifact ``key``, replacing an incomplete one.

        ``exclude`` names top-level entries left out (e.g. ``checkpoints``). In a local store, a
        file identical to one stored already becomes a hard link to it (:meth:`link_stored`).

        Returns:
            ``{"uri": ..., "digest": ...}``.

        Raises:
            ArtifactError: ``local_dir`` is not a directory.
        """
        local = Path(local_dir)
        if not local.is_dir():
            raise ArtifactError(f"{local} is not a directory")
        manifest = build_manifest(local, exclude)
        target = self._path(key)
        if self.is_local:
            tmp = Path(f"{target}.partial-{uuid.uuid4().hex[:8]}")
            top_level = set(exclude) | {MANIFEST}
            try:
                shutil.copytree(
                    local, tmp, ignore=lambda d, names: [n for n in names if Path(d) == local and n in top_level]
                )
                self.link_stored(tmp, manifest)
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            except BaseException:  # a full disk, say: no partial copy is left behind
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if Path(target).exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        else:
            if self.fs.exists(target):
                self.fs.rm(target, recursive=True)
            for rel in manifest["files"]:
                self.fs.put_file(str(local / rel), f"{target}/{rel}")
            with self.fs.open(f"{target}/{MANIFEST}", "w") as fh:  # last: marks the artifact complete
                fh.write(json.dumps(manifest, indent=1, sort_keys=True))
        return {"uri": self.uri(key), "digest": manifest["digest"]}

    def stored_files(self) -> dict[tuple[int, str], tuple[Path, dict]]:
        """``{(size, sha256): (path, manifest entry)}`` of every file of every complete artifact
        in a local store (the first met of identical files); ``{}`` for an S3 store."""
        index: dict[tuple[int, str], tuple[Path, dict]] = {}
        if not self.is_local:
            return index
        for marker in sorted(Path(self.base).glob(f"**/{MANIFEST}")):
            if ".partial-" in marker.parent.name:
                continue
            try:
                files = json.loads(marker.read_text())["files"]
            except (OSError, ValueError, KeyError):
                continue
            for rel, meta in files.items():
                index.setdefault((meta["size"], meta["sha256"]), (marker.parent / rel, meta))
        return index

    def link_stored(self, tree: str | os.PathLike, manifest: dict | None = None) -> int:
        """Replace each file under ``tree`` that is identical to a file already in this local
        store by a hard link to that file, so that a model two places share (the reward model's
        weights, unchanged by normalisation; a registered MLflow model) is on disk once.

        Only files of at least :data:`LINK_MIN_BYTES` whose stored copy still has the size and
        time its manifest recorded, or, untimed, its SHA-256; none in an S3 store or where the
        file system has no hard links. ``manifest`` (:func:`build_manifest` of ``tree``) saves
        hashing the tree's files and is updated in place: a linked file takes the stored file's
        time. Returns the bytes saved.
        """
        root = Path(tree)
        if not self.is_local:
            return 0
        if manifest is not None:
            entries = manifest["files"]
        else:
            entries = {p.relative_to(root).as_posix(): None for p in sorted(root.rglob("*")) if p.is_file()}
        index: dict[tuple[int, str], tuple[Path, dict]] | None = None
        saved = 0
        for rel, meta in entries.items():
            path = root / rel
            size = meta["size"] if meta else path.stat().st_size
            if size < LINK_MIN_BYTES:
                continue
            index = self.stored_files() if index is None else index
            if not any(k[0] == size for k in index):
                continue
            sha256 = meta["sha256"] if meta else file_sha256(path)
            found = index.get((size, sha256))
            if found is None:
                continue
            source, recorded = found
            try:
                st = source.stat()
            except OSError:
                continue
            if st.st_size != size or source.samefile(path):
                continue
            if recorded.get("mtime_ns") != st.st_mtime_ns and file_sha256(source) != sha256:
                continue  # changed since it was stored (a file it could not time is read)
            link = path.with_name(f"{path.name}.link-{uuid.uuid4().hex[:8]}")
            try:
                os.link(source, link)
            except OSError:  # another file system, or none with hard links
                continue
            os.replace(link, path)
            if meta is not None:
                if recorded.get("mtime_ns") == st.st_mtime_ns:  # the stored file's time, which the link shares
                    meta["mtime_ns"] = st.st_mtime_ns
                else:
                    meta.pop("mtime_ns", None)
            saved += size
        return saved

    def move_dir(
        self,
        local_dir: str | os.PathLike,
        key: str,
        exclude: tuple[str, ...] = (),
        cache_dir: str | os.PathLike | None = None,
    ) -> dict:
        """Store a local directory as artifact ``key`` and keep no second copy of it here.

        A local store on the same file system takes the directory by a rename (no byte copied,
        no second copy on disk at any moment); a local store on another file system copies it
        (:meth:`put_dir`) and ``local_dir`` is deleted. In a local store, a file identical to
        one stored already becomes a hard link to it (:meth:`link_stored`). An S3 store uploads
        it, then the directory becomes the verified download that :meth:`local_path` finds in
        ``cache_dir`` (deleted without a ``cache_dir``). The top-level entries ``exclude``
        names (e.g. ``checkpoints``) are not stored, and deleted once the rest is.

        Returns:
            ``{"uri": ..., "digest": ...}``, as :meth:`put_dir`.

        Raises:
            ArtifactError: ``local_dir`` is not a directory.
        """
        local = Path(local_dir)
        if not local.is_dir():
            raise ArtifactError(f"{local} is not a directory")
        if not self.is_local:
            stored = self.put_dir(local, key, exclude)
            _remove(local, exclude)
            if cache_dir is None:
                shutil.rmtree(local)
                return stored
            cached = Path(cache_dir) / key
            if cached.exists():
                shutil.rmtree(cached)
            cached.parent.mkdir(parents=True, exist_ok=True)
            os.replace(local, cached)
            (cached / MANIFEST).write_text(json.dumps(self.manifest(key)))
            return stored
        target = self._path(key)
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{target}.partial-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(local, tmp)
        except OSError:  # another file system (EXDEV), say: copied, then deleted here
            stored = self.put_dir(local, key, exclude)
            shutil.rmtree(local)
            return stored
        try:
            manifest = build_manifest(tmp, exclude)
            self.link_stored(tmp, manifest)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        except BaseException:  # the directory goes back where it was, as it was
            (tmp / MANIFEST).unlink(missing_ok=True)
            os.rename(tmp, local)
            raise
        _remove(tmp, exclude)
        if Path(target).exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        return {"uri": self.uri(key), "digest": manifest["digest"]}

    def get_dir(self, key: str, local_dir: str | os.PathLike, verify: bool = True) -> Path:
        """Copy artifact ``key`` into ``local_dir`` (created) and check every file's SHA-256.

        Raises:
            ArtifactError: the artifact is incomplete, or a file does not match its manifest.
        """
        manifest = self.manifest(key)
        if manifest is None:
            raise ArtifactError(f"artifact {self.uri(key)} is missing or incomplete (no {MANIFEST})")
        local = Path(local_dir)
        local.mkdir(parents=True, exist_ok=True)
        for rel, meta in manifest["files"].items():
            dest = local / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(f"{self._path(key)}/{rel}", str(dest))
            if verify and file_sha256(dest) != meta["sha256"]:
                raise ArtifactError(f"artifact {self.uri(key)}: {rel} does not match its manifest")
        return local

    def local_path(self, key: str, cache_dir: str | os.PathLike) -> Path:
        """A local directory holding artifact ``key``: the store itself when local, else a verified download."""
        if self.is_local:
            if not self.exists(key):
                raise ArtifactError(f"artifact {self.uri(key)} is missing or incomplete (no {MANIFEST})")
            return Path(self._path(key))
        manifest = self.manifest(key)
        if manifest is None:
            raise ArtifactError(f"artifact {self.uri(key)} is missing or incomplete (no {MANIFEST})")
        target = Path(cache_dir) / key
        marker = target / MANIFEST
        if marker.is_file() and json.loads(marker.read_text())["digest"] == manifest["digest"]:
            return target
        if target.exists():
            shutil.rmtree(target)
        self.get_dir(key, target)
        marker.write_text(json.dumps(manifest))
        return target
