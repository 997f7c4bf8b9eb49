"""Manifests of stage outputs: which files a check reads, what it finds, and what it cannot."""

import hashlib
import json
import os
import shutil
import time

import pytest

from rlhf_core.common import io
from rlhf_core.common.io import check_manifest, manifest_mismatch, tree_manifest, verify_manifest

HOUR_NS = 3600 * 10**9


def make_tree(root, age_ns: int = HOUR_NS):
    """A small stage output whose files were last written ``age_ns`` ago."""
    (root / "model").mkdir(parents=True)
    (root / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 256)
    (root / "stats.json").write_text(json.dumps({"rows": 3}))
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    backdate(root, age_ns)
    return root


def backdate(root, age_ns: int) -> None:
    then = time.time_ns() - age_ns
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, ns=(then, then))


def count_reads(monkeypatch) -> list[str]:
    """The files ``rlhf_core.common.io`` hashes from now on, in order."""
    read, real = [], io.file_sha256
    monkeypatch.setattr(io, "file_sha256", lambda path: read.append(os.fspath(path)) or real(path))
    return read


def rewrite_in_place(path, keep_time: bool = False) -> None:
    """Zero up to 4 KiB from the middle of ``path`` on (same size); with ``keep_time``, set its
    modification time back to what it was."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    n = min(4096, len(data) - len(data) // 2)
    data[len(data) // 2 : len(data) // 2 + n] = bytes(n)
    path.write_bytes(bytes(data))
    assert path.stat().st_size == before.st_size
    if keep_time:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert path.stat().st_mtime_ns == before.st_mtime_ns


def test_an_unchanged_output_is_accepted_without_reading_a_file(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "out")
    manifest = tree_manifest(root)
    assert all("mtime_ns" in meta for meta in manifest["files"].values())

    def no_reading(path):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(io, "file_sha256", no_reading)
    check = check_manifest(root, manifest)
    assert check.problems == [] and check.read == [] and check.restamped == {}
    assert manifest_mismatch(root, manifest) is None


def test_a_same_size_change_in_place_is_found_reading_that_file_alone(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "out")
    manifest = tree_manifest(root)
    rewrite_in_place(root / "model" / "model.safetensors")  # a new modification time
    read = count_reads(monkeypatch)
    assert manifest_mismatch(root, manifest) == (
        "model/model.safetensors: SHA-256 differs from its manifest (changed in place)"
    )
    assert read == [str(root / "model" / "model.safetensors")]


def test_a_change_whose_time_is_set_back_is_missed_by_the_quick_check_not_by_verify(tmp_path):
    """The documented trade-off: size and time are what the quick check sees."""
    root = make_tree(tmp_path / "out")
    manifest = tree_manifest(root)
    rewrite_in_place(root / "model" / "model.safetensors", keep_time=True)
    assert manifest_mismatch(root, manifest) is None
    assert manifest_mismatch(root, manifest, rehash=True) is not None
    assert verify_manifest(root, manifest) == [
        "model/model.safetensors: SHA-256 differs from its manifest (changed in place)"
    ]


def test_a_time_in_whole_seconds_is_never_recorded_so_a_rewrite_within_it_is_found(tmp_path):
    """A file system with coarse timestamps (FAT's 2 s) can give a same-size rewrite the time the
    manifest recorded: a whole-second time is therefore not recorded, and the file is read."""
    root = make_tree(tmp_path / "out")
    whole = (time.time_ns() - HOUR_NS) // 10**9 * 10**9
    model = root / "model" / "model.safetensors"
    os.utime(model, ns=(whole, whole))
    manifest = tree_manifest(root)
    assert "mtime_ns" not in manifest["files"]["model/model.safetensors"]
    assert all("mtime_ns" in meta for rel, meta in manifest["files"].items() if rel != "model/model.safetensors")
    rewrite_in_place(model, keep_time=True)  # what a 2 s granularity does to a quick rewrite
    assert manifest_mismatch(root, manifest) == (
        "model/model.safetensors: SHA-256 differs from its manifest (changed in place)"
    )


def test_a_files_age_is_judged_by_the_clock_before_it_is_read(tmp_path, monkeypatch):
    """A file written half a second before a read that takes two seconds is young when its
    reading begins: its time is not recorded, however long the hash took."""
    root = tmp_path / "out"
    root.mkdir()
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 256)
    now = [time.time_ns()]
    os.utime(root / "model.safetensors", ns=(now[0] - 5 * 10**8 + 1, now[0] - 5 * 10**8 + 1))
    real = io.file_sha256

    def slow_hash(path):
        now[0] += 2 * 10**9
        return real(path)

    monkeypatch.setattr(io, "file_sha256", slow_hash)
    monkeypatch.setattr(io.time, "time_ns", lambda: now[0])
    assert "mtime_ns" not in tree_manifest(root)["files"]["model.safetensors"]


def test_an_old_manifest_without_times_is_read_in_full_then_restamped(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "out")
    manifest = tree_manifest(root)
    old = {
        **manifest,
        "files": {rel: {"size": m["size"], "sha256": m["sha256"]} for rel, m in manifest["files"].items()},
    }
    rewrite_in_place(root / "stats.json", keep_time=True)
    read = count_reads(monkeypatch)
    assert check_manifest(root, old).problems == ["stats.json: SHA-256 differs from its manifest (changed in place)"]
    assert sorted(read) == sorted(str(root / rel) for rel in old["files"])
    # unchanged files read and found old enough get their times recorded: the next check reads none
    (root / "stats.json").write_text(json.dumps({"rows": 3}))
    backdate(root, HOUR_NS)
    check = check_manifest(root, old)
    assert check.problems == [] and set(check.restamped) == set(old["files"])
    restamped = check.restamp(old)
    assert restamped["digest"] == old["digest"]
    read.clear()
    assert check_manifest(root, restamped).problems == [] and read == []


def test_times_are_bookkeeping_not_content(tmp_path):
    """A copy with new modification times has its original's digest (the one that names an
    artifact and enters the cache keys downstream), which is the digest of paths, sizes and
    SHA-256 alone, and passes the check by being read."""
    root = make_tree(tmp_path / "out")
    manifest = tree_manifest(root)
    copy = shutil.copytree(root, tmp_path / "copy", copy_function=shutil.copyfile)
    backdate(copy, 2 * HOUR_NS)
    assert tree_manifest(copy)["digest"] == manifest["digest"]
    product = {
        rel: {"size": (root / rel).stat().st_size, "sha256": hashlib.sha256((root / rel).read_bytes()).hexdigest()}
        for rel in ("model/model.safetensors", "stats.json")  # metrics.jsonl records the work: not in the digest
    }
    assert manifest["digest"] == hashlib.sha256(json.dumps(product, sort_keys=True).encode()).hexdigest()
    check = check_manifest(copy, manifest)
    assert check.problems == [] and len(check.read) == 3 and set(check.restamped) == set(manifest["files"])


def test_a_file_written_moments_ago_has_no_recorded_time(tmp_path, monkeypatch):
    """A rewrite within the file system's timestamp granularity could keep the time: a file
    written less than a second before its manifest is read at every check."""
    root = make_tree(tmp_path / "out", age_ns=0)
    manifest = tree_manifest(root)
    assert not any("mtime_ns" in meta for meta in manifest["files"].values())
    rewrite_in_place(root / "model" / "model.safetensors", keep_time=True)
    assert manifest_mismatch(root, manifest) is not None


@pytest.mark.parametrize(
    "damage, rel, found",
    [
        (lambda root: (root / "stats.json").unlink(), "stats.json", "stats.json: missing"),
        (
            lambda root: (root / "stats.json").write_text("{}"),
            "stats.json",
            "stats.json: 2 bytes, its manifest says 11",
        ),
        (lambda root: shutil.rmtree(root / "model"), "model/model.safetensors", "model/model.safetensors: missing"),
    ],
)
def test_a_missing_file_or_one_of_another_size_is_named_without_reading_it(tmp_path, monkeypatch, damage, rel, found):
    root = make_tree(tmp_path / "out")
    manifest = tree_manifest(root)
    damage(root)
    read = count_reads(monkeypatch)
    assert verify_manifest(root, manifest) == [found]
    assert str(root / rel) not in read and len(read) == len(manifest["files"]) - 1


def test_verify_finds_an_edited_manifest(tmp_path):
    root = make_tree(tmp_path / "out")
    manifest = tree_manifest(root)
    assert verify_manifest(root, manifest) == []
    manifest["files"]["stats.json"]["size"] = 14  # edited by hand
    assert verify_manifest(root, manifest) == [
        "stats.json: 11 bytes, its manifest says 14",
        "the manifest's digest is not that of its entries (the manifest was edited)",
    ]


def test_a_directory_made_by_another_process_meanwhile_is_kept_and_ours_removed(tmp_path):
    """Two processes building one cache directory at once (two test processes converting one
    GGUF tokenizer): the one that finishes second finds the first's directory, which stays
    whole; it gets FileExistsError and leaves no partial directory behind."""
    target = tmp_path / "tokenizer"
    with pytest.raises(FileExistsError, match="made by another process meanwhile"):
        with io.atomic_directory(target) as tmp:
            (tmp / "ours.json").write_text("{}")
            target.mkdir()  # the other process's rename, after this one's check
            (target / "theirs.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer"]
    assert [p.name for p in target.iterdir()] == ["theirs.json"]
    with io.atomic_directory(target, overwrite=True) as tmp:  # asked to replace it: replaced
        (tmp / "ours.json").write_text("{}")
    assert [p.name for p in target.iterdir()] == ["ours.json"]
