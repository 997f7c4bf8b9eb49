"""A JSONL cache of judge answers, so that an answer is paid for once."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .prompt import prompt_sha256

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedAnswer:
    """An answer stored in a :class:`JudgementCache` and the requests it took."""

    answer: str
    attempts: int


class JudgementCache:
    """Judge answers in a JSONL file, keyed by SHA-256 of (judge identity, full prompt): the
    identity names what decides the answer (:class:`~.runner.Judge`).

    One line per answer: ``{"key", "judge", "prompt_sha256", "answer", "attempts"}``.
    :meth:`put` appends a line and flushes and fsyncs it, so an answer survives a crash as
    soon as it is stored. On loading, a last line cut short by a crash mid-write is
    dropped (and cut from the file, so later lines start cleanly); for a repeated key the
    last line wins. Invalid answers are stored like valid ones (a re-run never pays for
    them again); transport errors are never stored. Thread-safe.

    Raises:
        ValueError: a line other than the last is not a valid record (a corrupt file).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._entries: dict[str, CachedAnswer] = {}
        self._load()

    @staticmethod
    def key(judge: str, prompt: str) -> str:
        """Hex SHA-256 of ``[judge, prompt]`` as JSON (unambiguous for any strings)."""
        return hashlib.sha256(json.dumps([judge, prompt], ensure_ascii=False).encode("utf-8")).hexdigest()

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            entry = self._parse(raw)
            if entry is None:
                raise ValueError(f"{self.path}:{number}: not a judgement cache record: {raw[:80]!r}")
            self._entries[entry[0]] = entry[1]
        if tail.strip():
            entry = self._parse(tail)
            if entry is None:
                log.warning("%s: dropping a truncated last line (%d bytes)", self.path, len(tail))
                with open(self.path, "r+b") as fh:
                    fh.truncate(len(data) - len(tail))
                    fh.flush()
                    os.fsync(fh.fileno())
            else:
                self._entries[entry[0]] = entry[1]
                with open(self.path, "ab") as fh:
                    fh.write(b"\n")
                    fh.flush()
                    os.fsync(fh.fileno())

    @staticmethod
    def _parse(raw: bytes) -> tuple[str, CachedAnswer] | None:
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict) or not isinstance(rec["key"], str) or not isinstance(rec["answer"], str):
                return None
            return rec["key"], CachedAnswer(rec["answer"], int(rec.get("attempts", 1)))
        except (ValueError, KeyError, TypeError):
            return None

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, judge: str, prompt: str) -> CachedAnswer | None:
        """The stored answer of ``judge`` to ``prompt``, or ``None``."""
        with self._lock:
            return self._entries.get(self.key(judge, prompt))

    def put(self, judge: str, prompt: str, answer: str, attempts: int = 1) -> None:
        """Store ``answer`` (valid or not) and make it durable before returning.

        Raises:
            TypeError: ``answer`` is not a string.
        """
        if not isinstance(answer, str):
            raise TypeError(f"answer must be a string, got {type(answer).__name__}")
        key = self.key(judge, prompt)
        line = (
            json.dumps(
                {
                    "key": key,
                    "judge": judge,
                    "prompt_sha256": prompt_sha256(prompt),
                    "answer": answer,
                    "attempts": int(attempts),
                },
                ensure_ascii=False,
            )
            + "\n"
        )
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            self._entries[key] = CachedAnswer(answer, int(attempts))
