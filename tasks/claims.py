"""Stage claims on an S3 artifact store: one worker trains a stage key, across machines.

A stage's ``fcntl`` lock (:func:`rlhf_core.common.io.exclusive_lock`) holds among the processes of one
machine. Workers on several machines that share an S3 artifact store also claim the stage in
the store, beside its artifact, before they train it (:class:`StageClaim`):

* The claim is an object ``<key>.claim.json`` created with a conditional write
  (``If-None-Match: *``): of two workers creating it at once, S3 lets exactly one succeed.
  It names the worker (host and process), when it started, and the lease.
* The holder renews it every third of the lease with a write conditional on its own version
  (``If-Match: <ETag>``), and deletes it when the stage has ended, finished or failed, with a
  delete conditional on that version too: a claim taken over meanwhile stays. (A store whose
  S3 API has no conditional deletes gets a read, then a delete; a takeover in between is lost.)
* A worker that finds the claim taken waits, polling, until the stage's record is in the store
  (it then takes the artifact from there: :func:`tasks.stages.finished_record`), or until the
  claim has not been renewed for a whole lease: its holder is gone (a container removed, a
  SIGKILL), and the worker takes the claim over, with a write conditional on the lapsed
  claim's version, so that of two waiting workers one takes it.

Lapse is judged by the store's clock (the claim's ``Last-Modified`` against the ``Date`` of the
store's answer), never by the machines' own clocks. What a claim guarantees: while its holder
renews it, no other worker sharing the store starts that stage key; a holder that stops
renewing for a lease (``RLHF_CLAIM_LEASE_SECONDS``, default 120) is taken over, and learns
that it lost the claim at its next renewal (logged; :attr:`StageClaim.lost`). A stored
artifact is never half-written whatever happens (:mod:`tasks.storage`: manifest last).
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

#: Seconds a claim stays valid without renewal (``RLHF_CLAIM_LEASE_SECONDS``).
DEFAULT_LEASE_SECONDS = 120.0


def _s3_client():
    import boto3

    return boto3.client("s3")  # endpoint and credentials from the AWS variables, as s3fs's


def _precondition_failed(exc: Exception) -> bool:
    """Whether a conditional write lost: 412, or 409 when S3 saw two such writes at once."""
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
    return code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")


def _unsupported(exc: Exception) -> bool:
    """Whether the store refused a request's condition as not implemented (an S3 API without
    conditional deletes), rather than as not holding."""
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
    return code in ("NotImplemented", "501", "InvalidArgument", "InvalidRequest")


class StageClaim:
    """A claim on stage key ``key`` in the S3 store ``root`` (``s3://bucket/prefix``); a context
    manager. On entry it either holds the claim (``record`` is None: train the stage) or returns
    with ``record`` set to what ``finished()`` found once another worker finished the stage.

    Args:
        root: the artifact store's root URI (``s3://bucket/prefix``).
        key: the stage key (``sft/3f2a...``).
        finished: returns the finished stage's record from the store, or None.
        lease_seconds: validity of a claim without renewal; default ``RLHF_CLAIM_LEASE_SECONDS``
            or 120.
        poll_seconds: how often a waiting worker looks again (default a tenth of the lease,
            at most 10).
        logger: where waiting, takeovers and a lost claim are told (default ``tasks.claims``).
    """

    def __init__(
        self,
        root: str,
        key: str,
        finished: Callable[[], Any],
        lease_seconds: float | None = None,
        poll_seconds: float | None = None,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
    ):
        bucket, _, prefix = root.removeprefix("s3://").partition("/")
        self.bucket, self.object = bucket, "/".join(p for p in (prefix.strip("/"), f"{key}.claim.json") if p)
        self.key, self.finished = key, finished
        self.lease = lease_seconds or float(os.environ.get("RLHF_CLAIM_LEASE_SECONDS", DEFAULT_LEASE_SECONDS))
        self.poll = poll_seconds or min(10.0, self.lease / 10)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.record: Any = None
        self.lost = False
        self._etag: str | None = None
        self._writes = 0
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._client = _s3_client()
        self.log = logger or logging.getLogger(__name__)

    def _body(self, started: str) -> bytes:
        # a new body each write, hence a new ETag: a takeover conditional on a lapsed claim's
        # ETag fails if its holder renewed it meanwhile
        self._writes += 1
        body = {"worker": self.worker, "started": started, "lease_seconds": self.lease, "writes": self._writes}
        return json.dumps(body).encode()

    def _put(self, condition: dict[str, str], started: str) -> bool:
        try:
            answer = self._client.put_object(Bucket=self.bucket, Key=self.object, Body=self._body(started), **condition)
        except Exception as exc:
            if _precondition_failed(exc):
                return False
            raise
        self._etag = answer["ETag"]
        return True

    def _read(self) -> tuple[dict, str, float] | None:
        """The claim (its body, ETag and age in seconds by the store's clock), or None when absent."""
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=self.object)
        except self._client.exceptions.NoSuchKey:
            return None
        body = json.loads(answer["Body"].read() or b"{}")
        now = email.utils.parsedate_to_datetime(answer["ResponseMetadata"]["HTTPHeaders"]["date"])
        return body, answer["ETag"], (now - answer["LastModified"]).total_seconds()

    def __enter__(self) -> StageClaim:
        started = datetime.now(UTC).isoformat(timespec="seconds")
        waiting_for = None
        while True:
            if self._put({"IfNoneMatch": "*"}, started):
                break
            self.record = self.finished()
            if self.record is not None:
                return self
            held = self._read()
            if held is None:
                continue  # released meanwhile: try again at once
            body, etag, age = held
            if age > self.lease:
                if self._put({"IfMatch": etag}, started):
                    self.log.warning(
                        "stage %s: took over the claim of %s, not renewed for %.0f s (lease %.0f s)",
                        self.key, body.get("worker"), age, self.lease,
                    )  # fmt: skip
                    break
                continue
            if waiting_for != body.get("worker"):
                waiting_for = body.get("worker")
                self.log.info("stage %s: claimed by %s (since %s); waiting", self.key, waiting_for, body.get("started"))
            time.sleep(self.poll)
        # held; the stage may have been finished by a worker that released it just before
        self.record = self.finished()
        if self.record is not None:
            self._release()
            return self
        self._renewer = threading.Thread(target=self._renew, args=(started,), daemon=True, name=f"claim {self.key}")
        self._renewer.start()
        return self

    def _renew(self, started: str) -> None:
        while not self._stop.wait(self.lease / 3):
            try:
                renewed = self._put({"IfMatch": self._etag or ""}, started)
            except Exception as exc:  # the store unreachable for a while: try again next time
                self.log.warning("stage %s: could not renew its claim: %s", self.key, exc)
                continue
            if not renewed:
                self.lost = True
                self.log.error(
                    "stage %s: its claim was taken over by another worker; this run's artifact may be replaced",
                    self.key,
                )
                return

    def _release(self) -> None:
        """Delete the claim while it is still this worker's: a delete conditional on its version
        (``If-Match: <ETag>``), so that a claim taken over since, even an instant before, stays.
        A store that refuses conditional deletes (an S3 API without them) gets a read, then a
        delete if the version read is this worker's: a takeover between the two is deleted."""
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self.object, IfMatch=self._etag or "")
            return
        except Exception as exc:
            if _precondition_failed(exc):
                self.log.info("stage %s: its claim was taken over by another worker; left to it", self.key)
                return
            if not _unsupported(exc):
                raise
            self.log.warning(
                "stage %s: the store refuses conditional deletes (%s); the claim is read, then deleted",
                self.key,
                exc,
            )
        held = self._read()
        if held is not None and held[1] == self._etag:  # still this worker's
            self._client.delete_object(Bucket=self.bucket, Key=self.object)

    def __exit__(self, *exc: object) -> None:
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        if not self.lost:
            self._release()
