"""The artifact store on a local disk and on a real S3 API server (moto on 127.0.0.1)."""

import json

import boto3
import pytest

from tasks.storage import MANIFEST, ArtifactError, ArtifactStore, build_manifest


def make_tree(root):
    (root / "sub").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 1000)
    (root / "sub" / "stats.json").write_text(json.dumps({"rows": 3}))
    return root


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "store"))
    s3 = request.getfixturevalue("moto_s3")
    return ArtifactStore(f"s3://{s3['bucket']}/runs-{tmp_path.name}")


def test_round_trip_is_byte_identical(store, tmp_path):
    src = make_tree(tmp_path / "src")
    record = store.put_dir(src, "sft/abc")
    assert record["digest"] == build_manifest(src)["digest"]
    assert store.exists("sft/abc") and store.manifest("sft/abc")["digest"] == record["digest"]
    out = store.get_dir("sft/abc", tmp_path / "out")
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert json.loads((out / "sub" / "stats.json").read_text()) == {"rows": 3}
    cached = store.local_path("sft/abc", tmp_path / "cache")
    assert (cached / "sub" / "stats.json").is_file()
    if store.is_local:
        assert record["uri"] == str((tmp_path / "store" / "sft" / "abc").resolve())
    else:
        assert record["uri"].startswith("s3://rlhf-test/")


def test_missing_artifact_is_an_error(store, tmp_path):
    assert not store.exists("nothing/here")
    with pytest.raises(ArtifactError, match="missing or incomplete"):
        store.get_dir("nothing/here", tmp_path / "x")


def test_upload_without_manifest_does_not_count(moto_s3, tmp_path):
    """An upload cut off before its manifest (written last) is not a complete artifact."""
    store = ArtifactStore(f"s3://{moto_s3['bucket']}/partial")
    client = boto3.client("s3", endpoint_url=moto_s3["endpoint"])
    client.put_object(Bucket=moto_s3["bucket"], Key="partial/ppo/k1/model.safetensors", Body=b"half")
    assert not store.exists("ppo/k1")
    with pytest.raises(ArtifactError):
        store.local_path("ppo/k1", tmp_path / "cache")
    src = make_tree(tmp_path / "src")
    store.put_dir(src, "ppo/k1")  # a later complete upload replaces the fragment
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=moto_s3["bucket"], Prefix="partial/ppo/k1/")["Contents"]}
    assert keys == {f"partial/ppo/k1/{n}" for n in ("model.safetensors", "sub/stats.json", MANIFEST)}


def test_corrupted_file_is_detected(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    store.put_dir(make_tree(tmp_path / "src"), "k")
    (tmp_path / "store" / "k" / "sub" / "stats.json").write_text("tampered")
    with pytest.raises(ArtifactError, match="does not match"):
        store.get_dir("k", tmp_path / "out")


def test_local_put_is_atomic(tmp_path, monkeypatch):
    store = ArtifactStore(str(tmp_path / "store"))
    import shutil

    def broken_copy(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copytree", broken_copy)
    with pytest.raises(OSError):
        store.put_dir(make_tree(tmp_path / "src"), "k")
    assert not store.exists("k") and not (tmp_path / "store" / "k").exists()


def test_is_intact_notices_deleted_files_and_other_digests(store, tmp_path):
    record = store.put_dir(make_tree(tmp_path / "src"), "sft/k2")
    assert store.is_intact("sft/k2", record["digest"])
    assert not store.is_intact("sft/k2", "0" * 64)  # a cache entry for another artifact
    assert not store.is_intact("sft/other", record["digest"])
    store.fs.rm(f"{store._path('sft/k2')}/sub/stats.json")  # a file deleted after the manifest was written
    assert store.exists("sft/k2") and not store.is_intact("sft/k2", record["digest"])


def test_a_same_size_change_in_place_is_damage_naming_the_file(store, tmp_path):
    """64 KiB overwritten inside a stored file keeps its size: only its SHA-256 tells."""
    record = store.put_dir(make_tree(tmp_path / "src"), "ppo/k3")
    path = f"{store._path('ppo/k3')}/model.safetensors"
    with store.fs.open(path, "rb") as fh:
        data = bytearray(fh.read())
    data[100_000 : 100_000 + 65_536] = bytes(65_536)
    with store.fs.open(path, "wb") as fh:
        fh.write(bytes(data))
    assert store.fs.info(path)["size"] == 256_000
    damage = store.damage("ppo/k3", record["digest"])
    assert damage is not None and "model.safetensors: SHA-256 differs" in damage
    assert not store.is_intact("ppo/k3", record["digest"])


def test_a_failed_local_put_leaves_no_partial_directory(tmp_path, monkeypatch):
    """A copy that fails part way (a full disk) removes what it had written."""
    import errno
    import shutil

    store = ArtifactStore(str(tmp_path / "store"))
    real_copytree = shutil.copytree

    def copy_then_fill_the_disk(src, dst, *args, **kwargs):
        real_copytree(src, dst, *args, **kwargs)  # (its recursion calls this too: one raise is enough)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copytree", copy_then_fill_the_disk)
    with pytest.raises(OSError, match="No space left"):
        store.put_dir(make_tree(tmp_path / "src"), "sft/k")
    assert list((tmp_path / "store" / "sft").iterdir()) == []


def test_an_unwritable_store_is_named(tmp_path, moto_s3):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ArtifactError, match=r"artifact root .*a-file/store \(RLHF_ARTIFACT_ROOT\) is not writable"):
        ArtifactStore(str(tmp_path / "a-file" / "store")).check_writable()
    ArtifactStore(f"s3://{moto_s3['bucket']}/probe").check_writable()
    ArtifactStore(str(tmp_path / "new" / "store")).check_writable()
    assert list((tmp_path / "new" / "store").iterdir()) == []  # the probe is gone


def test_a_stage_needing_more_space_than_is_free_fails_before_running(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from tasks.stages import check_free_space

    src = make_tree(tmp_path / "src")  # 256,000 bytes of "model"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, 100 << 20))
    with pytest.raises(ArtifactError, match=r"stage sft: .*work has 0\.10 GiB free; the stage needs about 0\.25 GiB"):
        check_free_space("sft", [src], [tmp_path / "work"])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, 1 << 30))
    check_free_space("sft", [src], [tmp_path / "work"])


def test_a_local_store_reads_only_changed_files_and_rlhf_verify_reads_all(tmp_path, monkeypatch, capsys):
    """In a local store an artifact whose files keep the size and time its manifest records
    is intact without a file being read; a same-size change with its time set back is the
    quick check's blind spot, which ``rlhf verify`` (every file read) covers."""
    import os
    import time

    from rlhf_core.common import io
    from rlhf_core.run.cli import main

    src = make_tree(tmp_path / "src")
    then = time.time_ns() - 3600 * 10**9
    for path in (src / "model.safetensors", src / "sub" / "stats.json"):
        os.utime(path, ns=(then, then))
    store = ArtifactStore(str(tmp_path / "store"))
    record = store.put_dir(src, "ppo/k4")
    assert all(meta["mtime_ns"] == then for meta in store.manifest("ppo/k4")["files"].values())
    real = io.file_sha256

    def no_reading(path):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(io, "file_sha256", no_reading)
    assert store.damage("ppo/k4", record["digest"]) is None
    weights = tmp_path / "store" / "ppo" / "k4" / "model.safetensors"
    weights.write_bytes(bytes(256) + weights.read_bytes()[256:])
    monkeypatch.setattr(io, "file_sha256", real)
    assert "model.safetensors: SHA-256 differs" in store.damage("ppo/k4", record["digest"])
    os.utime(weights, ns=(then, then))
    assert store.damage("ppo/k4", record["digest"]) is None
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "store")]) == 1
    out = capsys.readouterr().out
    assert f"{weights.parent}: model.safetensors: SHA-256 differs from its manifest (changed in place)" in out
    weights.write_bytes((src / "model.safetensors").read_bytes())
    assert main(["verify", str(tmp_path / "store")]) == 0
    assert f"{weights.parent}: 2 files match" in capsys.readouterr().out


def with_checkpoint(root):
    make_tree(root)
    (root / "checkpoints" / "step-000002").mkdir(parents=True)
    (root / "checkpoints" / "step-000002" / "state.pt").write_bytes(b"optimiser" * 1000)
    return root


def test_a_move_into_a_local_store_renames_the_output_and_keeps_no_copy(tmp_path):
    """The stage's output becomes the artifact itself (same inode: no byte copied), its
    checkpoints deleted, with the digest a copy of the same tree gets."""
    store = ArtifactStore(str(tmp_path / "store"))
    out = with_checkpoint(tmp_path / "work" / "sft" / "k1")
    inode = (out / "model.safetensors").stat().st_ino
    copied = store.put_dir(make_tree(tmp_path / "same"), "sft/copied")
    record = store.move_dir(out, "sft/k1", exclude=("checkpoints",))
    assert not out.exists()
    assert record == {"uri": store.uri("sft/k1"), "digest": copied["digest"]}
    stored = tmp_path / "store" / "sft" / "k1"
    assert (stored / "model.safetensors").stat().st_ino == inode
    assert not (stored / "checkpoints").exists() and store.is_intact("sft/k1", record["digest"])
    assert not list((tmp_path / "store" / "sft").glob("*.partial-*"))


def test_a_move_into_a_local_store_on_another_file_system_copies_then_deletes(tmp_path, monkeypatch):
    import errno
    import os

    store = ArtifactStore(str(tmp_path / "store"))
    out = with_checkpoint(tmp_path / "work" / "k1")

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "rename", cross_device)
    record = store.move_dir(out, "k1", exclude=("checkpoints",))
    assert not out.exists() and store.is_intact("k1", record["digest"])
    assert record["digest"] == build_manifest(make_tree(tmp_path / "same"))["digest"]
    assert not (tmp_path / "store" / "k1" / "checkpoints").exists()


def test_a_move_into_s3_uploads_and_leaves_the_output_as_this_workers_download(moto_s3, tmp_path):
    """Uploaded once; the next stage on this worker reads the moved directory (same inode), no
    download."""
    store = ArtifactStore(f"s3://{moto_s3['bucket']}/moved-{tmp_path.name}")
    out = with_checkpoint(tmp_path / "work" / "ppo" / "k1")
    inode = (out / "model.safetensors").stat().st_ino
    record = store.move_dir(out, "ppo/k1", exclude=("checkpoints",), cache_dir=tmp_path / "downloads")
    assert not out.exists() and store.is_intact("ppo/k1", record["digest"])
    assert set(store.manifest("ppo/k1")["files"]) == {"model.safetensors", "sub/stats.json"}
    local = store.local_path("ppo/k1", tmp_path / "downloads")
    assert local == tmp_path / "downloads" / "ppo" / "k1"
    assert (local / "model.safetensors").stat().st_ino == inode
    gone = with_checkpoint(tmp_path / "work" / "ppo" / "k2")
    store.move_dir(gone, "ppo/k2")  # no cache: the local copy is deleted
    assert not gone.exists() and store.exists("ppo/k2")


def big_file(path, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes((i * 7 + seed) % 256 for i in range(256)) * 8192)  # 2 MiB, over LINK_MIN_BYTES
    return path


def test_a_file_identical_to_a_stored_one_is_stored_once(tmp_path):
    """The normalised reward model keeps the reward model's weights: its artifact links them."""
    store = ArtifactStore(str(tmp_path / "store"))
    big_file(tmp_path / "reward" / "model" / "model.safetensors")
    (tmp_path / "reward" / "model" / "config.json").write_text('{"bias": 0}')
    first = store.put_dir(tmp_path / "reward", "reward/k1")
    out = tmp_path / "work" / "reward_norm"
    big_file(out / "model" / "model.safetensors")
    (out / "model" / "config.json").write_text('{"bias": 0}')  # small: copied, never linked
    record = store.move_dir(out, "reward_norm/k2")
    stored = {k: tmp_path / "store" / k / "model" for k in ("reward/k1", "reward_norm/k2")}
    weights = [(d / "model.safetensors").stat() for d in stored.values()]
    assert weights[0].st_ino == weights[1].st_ino and weights[0].st_nlink == 2
    configs = [(d / "config.json").stat().st_ino for d in stored.values()]
    assert configs[0] != configs[1]
    assert store.is_intact("reward/k1", first["digest"]) and store.is_intact("reward_norm/k2", record["digest"])
    other = store.put_dir(big_file(tmp_path / "dpo" / "model.safetensors", seed=1).parent, "dpo/k3")
    assert (tmp_path / "store" / "dpo" / "k3" / "model.safetensors").stat().st_nlink == 1  # other bytes
    assert store.is_intact("dpo/k3", other["digest"])


def test_a_stored_file_changed_since_it_was_stored_is_not_linked(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    store.put_dir(big_file(tmp_path / "a" / "w.bin").parent, "a/k")
    stored = tmp_path / "store" / "a" / "k" / "w.bin"
    big_file(stored, seed=3)  # rewritten in place: same size, other bytes, a new time
    record = store.put_dir(big_file(tmp_path / "b" / "w.bin").parent, "b/k")
    assert (tmp_path / "store" / "b" / "k" / "w.bin").stat().st_ino != stored.stat().st_ino
    assert (tmp_path / "store" / "b" / "k" / "w.bin").read_bytes() == (tmp_path / "b" / "w.bin").read_bytes()
    assert store.is_intact("b/k", record["digest"])


def test_a_move_that_fails_leaves_the_output_and_its_checkpoints_where_they_were(tmp_path, monkeypatch):
    """A stage whose output could not be stored resumes from its checkpoint next time."""
    import tasks.storage as storage

    store = ArtifactStore(str(tmp_path / "store"))
    out = with_checkpoint(tmp_path / "work" / "k1")

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(storage, "build_manifest", disk_full)
    with pytest.raises(OSError, match="disk full"):
        store.move_dir(out, "k1", exclude=("checkpoints",))
    assert (out / "checkpoints" / "step-000002" / "state.pt").is_file() and (out / "model.safetensors").is_file()
    assert not store.exists("k1") and not list((tmp_path / "store").glob("*.partial-*"))
