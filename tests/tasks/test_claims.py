"""Stage claims across machines: two worker processes that share nothing but an S3 store (a
real moto server on 127.0.0.1) and run one stage key. Each has its own work directory, so its
``fcntl`` lock keeps nothing out: only the claim in the store does."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import boto3
import pytest

REPO = Path(__file__).resolve().parents[2]
#: One worker: claims the stage as tasks.stages.rlhf_stage does, "trains" for HOLD seconds
#: (printing TRAINING), stores an artifact and its record, and prints what it did.
WORKER = textwrap.dedent(
    """
    import logging, os, sys, time, tempfile
    from pathlib import Path
    from tasks.stages import StageRecord, finished_record, stage_claim, work_root
    from tasks.storage import ArtifactStore

    logging.basicConfig(level=logging.INFO, force=True)
    key, hold = sys.argv[1], float(sys.argv[2])
    store = ArtifactStore()
    with stage_claim(store, key) as claim:
        if claim.record is not None:
            print("TOOK", claim.record.mlflow_run_id, flush=True)
            sys.exit(0)
        print("TRAINING", flush=True)
        time.sleep(hold)
        out = Path(tempfile.mkdtemp())
        (out / "model.txt").write_text(f"trained by {os.getpid()}")
        stored = store.put_dir(out, key)
        record = StageRecord(stage="sft", key=key, uri=stored["uri"], digest=stored["digest"], mlflow_run_id=str(os.getpid()))
        store.put_text(f"{key}.record.json", record.model_dump_json())
        print("DONE", os.getpid(), "lost" if claim.lost else "held", flush=True)
    """
)


@pytest.fixture
def store(moto_s3, tmp_path):
    """The workers' environment: the shared moto server (its AWS variables are set), a prefix of
    this test's own in its bucket (no claim or record of another test there), a 3 s lease."""
    prefix = f"claims-{tmp_path.name}"
    env = {
        **os.environ,
        "RLHF_ARTIFACT_ROOT": f"s3://{moto_s3['bucket']}/{prefix}",
        "RLHF_CLAIM_LEASE_SECONDS": "3",
        "PYTHONPATH": str(REPO),
    }
    return {
        "env": env,
        "bucket": moto_s3["bucket"],
        "prefix": prefix,
        "s3": boto3.client("s3", endpoint_url=moto_s3["endpoint"]),
    }


def _start(store: dict, work: Path, key: str, hold: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, key, str(hold)],
        cwd=REPO,
        env={**store["env"], "RLHF_WORK_DIR": str(work)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen, word: str) -> str:
    line = proc.stdout.readline()
    assert line.startswith(word), (line, proc.stderr.read() if proc.poll() is not None else "")
    return line


@pytest.mark.heavy
def test_a_second_machine_waits_for_the_claimed_stage_then_takes_it_from_the_store(store, tmp_path):
    """The first worker trains for longer than the lease (renewing its claim); the second waits
    the whole time, never trains, and ends with the first's record."""
    first = _start(store, tmp_path / "a", "sft/k1", hold=12)  # the second starts (imports) meanwhile
    _wait_for_line(first, "TRAINING")
    second = _start(store, tmp_path / "b", "sft/k1", hold=0)
    out, err = second.communicate(timeout=120)
    assert first.wait(timeout=60) == 0 and second.returncode == 0, err
    assert out.split() == ["TOOK", str(first.pid)], err
    assert "claimed by" in err and "waiting" in err
    assert first.stdout.read().split() == ["DONE", str(first.pid), "held"]
    listed = store["s3"].list_objects_v2(Bucket=store["bucket"], Prefix=f"{store['prefix']}/sft/")["Contents"]
    keys = {o["Key"].removeprefix(f"{store['prefix']}/") for o in listed}
    assert "sft/k1.claim.json" not in keys and "sft/k1/MANIFEST.json" in keys  # released


@pytest.mark.heavy
def test_the_claim_of_a_killed_worker_lapses_and_is_taken_over(store, tmp_path):
    """A worker SIGKILLed while training leaves its claim; another waits one lease (by the
    store's clock), takes the claim over naming the dead worker, and trains the stage."""
    dead = _start(store, tmp_path / "a", "sft/k2", hold=600)
    _wait_for_line(dead, "TRAINING")
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    began = time.monotonic()
    second = _start(store, tmp_path / "b", "sft/k2", hold=0)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert out.split()[0] == "TRAINING" and out.split()[1:] == ["DONE", str(second.pid), "held"], (out, err)
    assert f":{dead.pid}, not renewed for" in err and "took over the claim" in err
    assert time.monotonic() - began >= 2  # it waited for the lease (3 s) to lapse
    stored = store["s3"].get_object(Bucket=store["bucket"], Key=f"{store['prefix']}/sft/k2.record.json")
    record = json.loads(stored["Body"].read())
    assert record["mlflow_run_id"] == str(second.pid)


def test_a_claim_taken_over_as_its_holder_releases_it_stays(store, monkeypatch, caplog):
    """The holder reads its claim as its own, and another worker takes it over before the
    holder's delete: the delete, conditional on the holder's version (If-Match), leaves the new
    holder's claim in place."""
    from tasks.claims import StageClaim

    monkeypatch.setenv("AWS_ENDPOINT_URL", store["s3"].meta.endpoint_url)
    root = f"s3://{store['bucket']}/{store['prefix']}"
    claim = StageClaim(root, "sft/k3", finished=lambda: None, lease_seconds=60)
    claim.__enter__()
    assert claim.record is None
    name = f"{store['prefix']}/sft/k3.claim.json"
    mine = claim._read()
    store["s3"].put_object(Bucket=store["bucket"], Key=name, Body=b'{"worker": "other:1"}')  # a takeover
    monkeypatch.setattr(claim, "_read", lambda: mine)  # read just before it: still this worker's
    with caplog.at_level("INFO", logger="tasks.claims"):
        claim.__exit__(None, None, None)
    left = store["s3"].get_object(Bucket=store["bucket"], Key=name)["Body"].read()
    assert left == b'{"worker": "other:1"}'
    assert "its claim was taken over by another worker; left to it" in caplog.text
