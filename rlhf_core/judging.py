"""LLM-as-a-judge win rates of policy summaries against reference summaries.

A judge reads the prompt of Huang et al. 2024, Appendix I (:data:`JUDGE_PROMPT`): a post,
"Summary A" and "Summary B", and answers with a one-sentence comparison and a final line
``Preferred: A`` or ``Preferred: B``. Following the paper, the order of the two summaries
is randomised per comparison to remove positional bias; here it is derived from a seed and
the comparison's id (:func:`response_is_a`), so it is reproducible and does not depend on
which other comparisons are judged.

Two judges share one interface (``name``, ``thread_safe``, ``answer(prompt) -> str``):

- :class:`AnthropicJudge`: a Claude model through the Anthropic Messages API.
- :class:`OfflineJudge`: a local Hugging Face causal LM that compares the next-token
  probabilities of the letters A and B after ``Preferred:``; for runs without network.

:func:`judge_comparisons` runs a judge over :class:`Comparison` records with a
:class:`JudgementCache` (a JSONL file: an answer is paid for once), a spending cap and
bounded concurrency, and returns one :class:`Judgement` per comparison judged. Answers are
parsed strictly (:func:`parse_preference`); an unparseable answer is asked again once and
then recorded as invalid, never guessed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import anthropic
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .config import ModelConfig
from .models import load_causal_lm, load_tokenizer

log = logging.getLogger(__name__)

# Huang et al. 2024, Appendix I (modified from Rafailov et al. 2023). The paper's text
# breaks three sentences with a line-continuation "\"; they are joined here.
JUDGE_PROMPT = (
    "Which of the following summaries does a better job of summarizing the most important points in the "
    "given forum post, without including unimportant or irrelevant details? Judge based on accuracy, "
    "coverage, and coherence.\n"
    "\n"
    "Post:\n"
    "{post}\n"
    "\n"
    "Summary A:\n"
    "{summary_a}\n"
    "\n"
    "Summary B:\n"
    "{summary_b}\n"
    "\n"
    "FIRST provide a one-sentence comparison of the two summaries, explaining which you prefer and why. "
    "SECOND, on a new line, state only \"A\" or \"B\" to indicate your choice. Your response should use "
    "the format:\n"
    "\n"
    "Comparison: <one-sentence comparison and explanation>\n"
    "Preferred: <\"A\" or \"B\">"
)

Preference = Literal["A", "B"]


class JudgeError(RuntimeError):
    """A judge could not produce an answer."""


class JudgeConfigError(JudgeError, ValueError):
    """A judge cannot be set up (for example, no API key)."""


class JudgeRequestError(JudgeError):
    """A request failed after the client's own retries, or its reply could not be read.

    Attributes:
        status: the HTTP status of the last reply, ``None`` for connection errors,
            timeouts and unreadable replies.
        fatal: ``True`` when every further request would fail the same way (HTTP 400,
            401, 403, 404: a bad request shape, key, permission or model name);
            :func:`judge_comparisons` stops on these instead of recording them.
    """

    def __init__(self, message: str, status: int | None = None, fatal: bool = False):
        super().__init__(message)
        self.status = status
        self.fatal = fatal


# ------------------------------------------------------------------------ prompt


def format_judge_prompt(post: str, summary_a: str, summary_b: str) -> str:
    """The Appendix I prompt with ``post`` and the two summaries filled in.

    The texts are inserted verbatim (braces or "Preferred:" inside them are harmless:
    only the template is formatted, and the answer parser never sees the prompt).

    Raises:
        TypeError: an argument is not a string.
    """
    for name, value in (("post", post), ("summary_a", summary_a), ("summary_b", summary_b)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    return JUDGE_PROMPT.format(post=post, summary_a=summary_a, summary_b=summary_b)


def prompt_sha256(prompt: str) -> str:
    """Hex SHA-256 of the UTF-8 prompt text."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


_EMPHASIS = ("**", "__")
_VALUE_STRIP = " \t\"'`*_.\u201c\u201d\u2018\u2019"


def parse_preference(answer: str) -> Preference | None:
    """The judge's choice from its answer text alone: ``"A"``, ``"B"`` or ``None``.

    The last non-empty line must read ``Preferred: A`` or ``Preferred: B``. Accepted
    variations: surrounding whitespace; the label in any case; markdown bold around the
    label or the letter (``**Preferred:** A``, ``**Preferred**: A``, ``Preferred: **B**``);
    the letter in straight or curly quotes or backticks (``Preferred: "A"``); a trailing
    period. The letter itself must be an upper-case ``A`` or ``B`` and stand alone:
    ``Preferred: C``, ``Preferred: A or B``, ``Preferred: <"A" or "B">``, a
    ``Preferred:`` that is not at the start of the last line (e.g. quoted inside the
    comparison sentence), or text after the ``Preferred`` line all give ``None``.

    Args:
        answer: the judge's reply, never the prompt.

    Returns:
        ``"A"``, ``"B"``, or ``None`` when the answer does not follow the format.
    """
    if not isinstance(answer, str):
        return None
    lines = [line.strip() for line in answer.splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[-1]
    for mark in _EMPHASIS:
        if line.startswith(mark):
            line = line[len(mark) :]
            break
    if line[: len("preferred")].lower() != "preferred":
        return None
    line = line[len("preferred") :]
    for mark in _EMPHASIS:
        if line.startswith(mark):
            line = line[len(mark) :]
            break
    line = line.lstrip()
    if not line.startswith(":"):
        return None
    value = line[1:].strip(_VALUE_STRIP)
    return value if value in ("A", "B") else None  # type: ignore[return-value]


def response_is_a(seed: int, comparison_id: str) -> bool:
    """Whether the policy response is shown as "Summary A" for this comparison.

    Derived from ``sha256(f"{seed}:{comparison_id}")``: the same seed and id always give
    the same order, whatever other comparisons are judged or in which order, and over
    many ids about half put the response first (Huang et al. 2024, Appendix I: the order
    is randomised to remove positional bias).
    """
    digest = hashlib.sha256(f"{int(seed)}:{comparison_id}".encode()).digest()
    return digest[0] & 1 == 1


# ------------------------------------------------------------------------ records


@dataclass(frozen=True)
class Comparison:
    """One policy response to judge against the reference summary of the same post.

    Attributes:
        id: unique within one evaluation; it fixes the A/B order (:func:`response_is_a`).
        post: the forum post shown to the judge.
        response: the policy's summary.
        reference: the human-written reference summary.
        title: the post's title; when set the judge sees ``"{title}\\n\\n{post}"``.
        policy: which model produced ``response`` (bookkeeping, copied to the judgement).

    Raises:
        ValueError: ``id`` is empty; TypeError: a text field is not a string.
    """

    id: str
    post: str
    response: str
    reference: str
    title: str | None = None
    policy: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"comparison id must be a non-empty string, got {self.id!r}")
        for name in ("post", "response", "reference"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"comparison {self.id}: {name} must be a string")
        if self.title is not None and not isinstance(self.title, str):
            raise TypeError(f"comparison {self.id}: title must be a string or None")

    @property
    def post_text(self) -> str:
        """The text shown under "Post:"."""
        return f"{self.title}\n\n{self.post}" if self.title else self.post

    def prompt(self, response_first: bool) -> str:
        """The judge prompt, with the response as Summary A when ``response_first``."""
        a, b = (self.response, self.reference) if response_first else (self.reference, self.response)
        return format_judge_prompt(self.post_text, a, b)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Judgement:
    """The judge's verdict on one :class:`Comparison`.

    Attributes:
        id: the comparison's id.
        judge: the judge's name (a model id).
        prompt_sha256: hex SHA-256 of the exact prompt sent.
        response_is_a: whether the policy response was Summary A.
        answer: the judge's last raw answer (``None`` when no answer was received).
        preferred: ``"A"``, ``"B"``, or ``None`` for an invalid answer or an error.
        response_wins: ``True``/``False`` when ``preferred`` is set, else ``None``.
        attempts: requests made in this run (0 for a cache hit; the cache record keeps
            the count of the run that paid for the answer).
        error: why no valid answer could be had from the transport (not cached), else ``None``.
        cached: the answer came from the cache.
        policy: copied from the comparison.
    """

    id: str
    judge: str
    prompt_sha256: str
    response_is_a: bool
    answer: str | None
    preferred: Preference | None
    response_wins: bool | None
    attempts: int
    error: str | None = None
    cached: bool = False
    policy: str | None = None

    @property
    def valid(self) -> bool:
        """A preference was parsed."""
        return self.preferred is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Judgement:
        return cls(**data)


def _outcome(preferred: Preference | None, response_first: bool) -> bool | None:
    if preferred is None:
        return None
    return (preferred == "A") == response_first


def win_counts(judgements: Iterable[Judgement]) -> dict[str, int]:
    """Counts of ``wins``, ``losses``, ``invalid`` answers and transport ``errors``.

    The win rate over valid answers is ``wins / (wins + losses)``.
    """
    counts = {"wins": 0, "losses": 0, "invalid": 0, "errors": 0}
    for j in judgements:
        if j.error is not None:
            counts["errors"] += 1
        elif j.response_wins is None:
            counts["invalid"] += 1
        elif j.response_wins:
            counts["wins"] += 1
        else:
            counts["losses"] += 1
    return counts


# ------------------------------------------------------------------------- cache


@dataclass(frozen=True)
class CachedAnswer:
    """An answer stored in a :class:`JudgementCache` and the requests it took."""

    answer: str
    attempts: int


class JudgementCache:
    """Judge answers in a JSONL file, keyed by SHA-256 of (judge name, full prompt).

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
        line = json.dumps({"key": key, "judge": judge, "prompt_sha256": prompt_sha256(prompt), "answer": answer,
                           "attempts": int(attempts)}, ensure_ascii=False) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            self._entries[key] = CachedAnswer(answer, int(attempts))


# ------------------------------------------------------------------------ judges


class Judge(Protocol):
    """What :func:`judge_comparisons` needs from a judge."""

    name: str
    thread_safe: bool

    def answer(self, prompt: str) -> str: ...


_FATAL_STATUSES = (400, 401, 403, 404)


class AnthropicJudge:
    """A Claude model as judge, through the Anthropic Messages API (``anthropic.Anthropic``).

    The prompt is sent as the single user turn; the reply's text blocks, joined, are the
    answer. The SDK retries connection errors, timeouts, 408, 409, 429 and 5xx replies up
    to ``max_retries`` times with exponential backoff (0.5 s doubling, at most 8 s, with
    jitter), and waits as long as a ``retry-after-ms`` or ``retry-after`` header asks when
    the server sends one. The client is thread-safe (``thread_safe = True``).

    No sampling parameters are sent: the API version that ``anthropic`` 2.x speaks
    (``anthropic-version: 2026-10-21``) rejects ``temperature``, ``top_p`` and ``top_k``
    with HTTP 400, and the SDK no longer accepts them. Answers are therefore not
    guaranteed to repeat; :class:`JudgementCache` makes a finished evaluation reproducible.
    The SDK sends the key as ``Authorization: Bearer <key>``.

    The API key is never shown: ``repr``/``str`` leave it out, it is replaced by
    ``[redacted]`` in every error message this class raises (even one the server echoes),
    and the SDK's own exception is not chained to them.

    Args:
        model: the model id, e.g. ``claude-haiku-4-5``; also the judge's ``name``.
        api_key: the key; ``None`` reads ``ANTHROPIC_API_KEY``.
        base_url: the API's address; ``None`` lets the SDK read ``ANTHROPIC_BASE_URL``
            (default ``https://api.anthropic.com``).
        max_retries: retries per request after the first attempt.
        timeout: seconds per attempt.
        max_tokens: the answer's token limit (a comparison sentence and one line).

    Raises:
        JudgeConfigError: no key given and ``ANTHROPIC_API_KEY`` unset or empty.
    """

    thread_safe = True

    def __init__(self, model: str, api_key: str | None = None, base_url: str | None = None, max_retries: int = 4,
                 timeout: float = 60.0, max_tokens: int = 256):
        if not model:
            raise JudgeConfigError("AnthropicJudge needs a model id (eval.judge_model)")
        key = api_key or os.environ.get("ANTHROPIC_API_KEY") or None
        if key is None:
            raise JudgeConfigError(
                "AnthropicJudge needs an API key: set the ANTHROPIC_API_KEY environment variable "
                "(or pass api_key=...)"
            )
        self.model = model
        self.name = model
        self.max_retries = int(max_retries)
        self.timeout = float(timeout)
        self.max_tokens = int(max_tokens)
        self._client = anthropic.Anthropic(api_key=key, base_url=base_url, max_retries=self.max_retries,
                                           timeout=self.timeout)
        self._secret = key
        self._usage_lock = threading.Lock()
        self.usage = {"requests": 0, "input_tokens": 0, "output_tokens": 0}

    @property
    def base_url(self) -> str:
        """The address requests go to."""
        return str(self._client.base_url)

    def __repr__(self) -> str:
        return (f"AnthropicJudge(model={self.model!r}, base_url={self.base_url!r}, max_retries={self.max_retries}, "
                f"timeout={self.timeout}, max_tokens={self.max_tokens})")

    __str__ = __repr__

    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "[redacted]") if self._secret else text

    def answer(self, prompt: str) -> str:
        """Send ``prompt`` and return the text of the reply (possibly empty).

        Raises:
            JudgeRequestError: the request failed after the SDK's retries (status and
                error type in the message), or the reply is not a readable message.
        """
        try:
            message = self._client.messages.create(model=self.model, max_tokens=self.max_tokens,
                                                   messages=[{"role": "user", "content": prompt}])
        except anthropic.APIStatusError as err:
            error = err.body.get("error") if isinstance(err.body, dict) else None
            etype = error.get("type") if isinstance(error, dict) else None
            emsg = error.get("message") if isinstance(error, dict) else err.message
            request_id = getattr(err, "request_id", None)
            text = f"{self.model}: HTTP {err.status_code} {etype or type(err).__name__}: {emsg}"
            if request_id:
                text += f" (request-id {request_id})"
            if err.status_code not in _FATAL_STATUSES:
                text += f"; gave up after {self.max_retries} retries"
            raise JudgeRequestError(self._scrub(text), err.status_code, err.status_code in _FATAL_STATUSES) from None
        except anthropic.APITimeoutError:
            raise JudgeRequestError(
                f"{self.model}: timed out after {self.timeout} s; gave up after {self.max_retries} retries"
            ) from None
        except anthropic.APIConnectionError as err:
            raise JudgeRequestError(self._scrub(
                f"{self.model}: connection to {self.base_url} failed ({err.message}); "
                f"gave up after {self.max_retries} retries")) from None
        except (anthropic.APIResponseValidationError, ValueError) as err:
            text = f"{self.model}: unreadable reply: {type(err).__name__}: {err}"
            raise JudgeRequestError(self._scrub(text)) from None
        text = self._message_text(message)
        usage = getattr(message, "usage", None)
        with self._usage_lock:
            self.usage["requests"] += 1
            self.usage["input_tokens"] += int(getattr(usage, "input_tokens", 0) or 0)
            self.usage["output_tokens"] += int(getattr(usage, "output_tokens", 0) or 0)
        return text

    def _message_text(self, message: Any) -> str:
        content = getattr(message, "content", None)
        if not isinstance(content, list):
            shown = self._scrub(repr(message)[:200])
            raise JudgeRequestError(f"{self.model}: reply is not a message with content: {shown}")
        return "".join(getattr(block, "text", "") or "" for block in content if getattr(block, "type", None) == "text")


class OfflineJudge:
    """A local causal LM as judge: A or B by the next-token probabilities after ``Preferred:``.

    The prompt is the same :data:`JUDGE_PROMPT`. With a chat template, it is the user turn
    (``apply_chat_template(..., add_generation_prompt=True)``) and the assistant turn
    starts with ``Preferred:``; without one, the model reads ``prompt + "\\n\\nPreferred:"``
    (with the tokenizer's special tokens). At the next position the log-probability of a
    letter is the log-sum-exp of those of its two single tokens, with and without a
    leading space (``" A"`` and ``"A"``; ``" B"`` and ``"B"``), so both tokenisation styles
    count. The larger one wins (A on an exact tie). The answer reads, e.g.::

        Comparison: offline judge NAME: log p(A)=-3.2104, log p(B)=-3.6620, p(A)=0.6110
        Preferred: A

    so :func:`parse_preference` and the cache treat it like any judge's answer. The judge
    is deterministic and not thread-safe (``thread_safe = False``).

    Args:
        model: a causal LM; it is put in eval mode and used on its own device.
        tokenizer: its tokenizer.
        name: the judge's name (part of the cache key: give each checkpoint its own).
        batch_size: prompts per forward pass in :meth:`answer_batch`.

    Raises:
        ValueError: a letter variant is not a single token of ``tokenizer``.
    """

    thread_safe = False

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str, batch_size: int = 4):
        if not name:
            raise ValueError("OfflineJudge needs a name")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.batch_size = int(batch_size)
        self.letter_token_ids: dict[str, list[int]] = {}
        vocab = self.model.get_input_embeddings().num_embeddings
        for letter in ("A", "B"):
            ids: list[int] = []
            for variant in (f" {letter}", letter):
                enc = tokenizer.encode(variant, add_special_tokens=False)
                if len(enc) != 1:
                    raise ValueError(f"{name}: {variant!r} is not a single token ({enc}) for {tokenizer.name_or_path}")
                if enc[0] >= vocab:
                    raise ValueError(f"{name}: token id {enc[0]} of {variant!r} is outside the model's vocabulary")
                if enc[0] not in ids:
                    ids.append(enc[0])
            self.letter_token_ids[letter] = ids
        if set(self.letter_token_ids["A"]) & set(self.letter_token_ids["B"]):
            raise ValueError(f"{name}: the tokens of A and B overlap")
        pad = tokenizer.pad_token_id
        self._pad_id = pad if pad is not None and pad < vocab else (tokenizer.eos_token_id or 0)
        self._max_positions = getattr(self.model.config, "max_position_embeddings", None)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, name: str | None = None, dtype: str = "float32",
                        device: str | torch.device | None = None, batch_size: int = 4) -> OfflineJudge:
        """Load a model directory (``save_pretrained`` layout with its tokenizer) as a judge.

        Uses :func:`rlhf_core.models.load_causal_lm` and :func:`rlhf_core.models.load_tokenizer`.
        ``name`` defaults to ``offline:<absolute path>``.
        """
        path = Path(path)
        model = load_causal_lm(path, dtype)
        if device is not None:
            model.to(device)
        tokenizer = load_tokenizer(ModelConfig(base=str(path.resolve())))
        return cls(model, tokenizer, name or f"offline:{path.resolve()}", batch_size=batch_size)

    def __repr__(self) -> str:
        return f"OfflineJudge(name={self.name!r}, letters={self.letter_token_ids})"

    def encode(self, prompt: str) -> list[int]:
        """Token ids the model reads for ``prompt``, ending with ``Preferred:``.

        Raises:
            ValueError: longer than the model's ``max_position_embeddings``.
        """
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
            ids = self.tokenizer.encode(text + "Preferred:", add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(prompt + "\n\nPreferred:")
        if self._max_positions is not None and len(ids) > self._max_positions:
            raise ValueError(f"{self.name}: prompt of {len(ids)} tokens exceeds the model's {self._max_positions}")
        return ids

    @torch.no_grad()
    def letter_logprobs(self, prompts: Sequence[str]) -> torch.Tensor:
        """Log-probabilities of the letters A and B after each prompt.

        Batches of :attr:`batch_size` are left-padded with position ids that follow the
        attention mask, so padding does not change a prompt's result.

        Returns:
            ``(len(prompts), 2)`` float64 tensor on the CPU: ``[:, 0]`` A, ``[:, 1]`` B.
        """
        device = next(self.model.parameters()).device
        ids_a = torch.tensor(self.letter_token_ids["A"], device=device)
        ids_b = torch.tensor(self.letter_token_ids["B"], device=device)
        out = []
        for start in range(0, len(prompts), self.batch_size):
            encoded = [self.encode(p) for p in prompts[start : start + self.batch_size]]
            width = max(len(e) for e in encoded)
            input_ids = torch.full((len(encoded), width), self._pad_id, dtype=torch.long)
            mask = torch.zeros((len(encoded), width), dtype=torch.long)
            for i, e in enumerate(encoded):
                input_ids[i, width - len(e) :] = torch.tensor(e)
                mask[i, width - len(e) :] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                position_ids=positions.to(device), logits_to_keep=1).logits[:, -1]
            logp = torch.log_softmax(logits.double(), dim=-1)
            out.append(torch.stack([logp[:, ids_a].logsumexp(-1), logp[:, ids_b].logsumexp(-1)], dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros((0, 2), dtype=torch.float64)

    def _format(self, lp_a: float, lp_b: float) -> str:
        p_a = 1.0 / (1.0 + math.exp(lp_b - lp_a))
        choice = "A" if lp_a >= lp_b else "B"
        return (f"Comparison: offline judge {self.name}: log p(A)={lp_a:.4f}, log p(B)={lp_b:.4f}, p(A)={p_a:.4f}\n"
                f"Preferred: {choice}")

    def answer(self, prompt: str) -> str:
        """The answer to one prompt (see the class docstring for its format)."""
        return self.answer_batch([prompt])[0]

    def answer_batch(self, prompts: Sequence[str]) -> list[str]:
        """Answers to several prompts, :attr:`batch_size` per forward pass."""
        return [self._format(float(a), float(b)) for a, b in self.letter_logprobs(list(prompts)).tolist()]


# ---------------------------------------------------------------------- running


@dataclass
class _Job:
    comparison: Comparison
    prompt: str
    response_first: bool


def _judgement(job: _Job, judge_name: str, answer: str | None, attempts: int, error: str | None = None,
               cached: bool = False) -> Judgement:
    preferred = parse_preference(answer) if (answer is not None and error is None) else None
    return Judgement(id=job.comparison.id, judge=judge_name, prompt_sha256=prompt_sha256(job.prompt),
                     response_is_a=job.response_first, answer=answer, preferred=preferred,
                     response_wins=_outcome(preferred, job.response_first), attempts=attempts, error=error,
                     cached=cached, policy=job.comparison.policy)


def _finish(judge: Judge, job: _Job, cache: JudgementCache | None, answer: str | None, attempts: int) -> Judgement:
    """Ask (again, at most once in all, after an invalid answer), store, and record one comparison."""
    while answer is None or (parse_preference(answer) is None and attempts < 2):
        try:
            answer = judge.answer(job.prompt)
        except JudgeRequestError as err:
            if err.fatal:
                raise
            return _judgement(job, judge.name, answer, attempts + 1, error=str(err))
        attempts += 1
    if cache is not None:
        cache.put(judge.name, job.prompt, answer, attempts)
    return _judgement(job, judge.name, answer, attempts)


def judge_comparisons(judge: Judge, comparisons: Iterable[Comparison], *, cache: JudgementCache | None, seed: int,
                      max_comparisons: int | None = None, concurrency: int = 4,
                      progress: bool = True) -> list[Judgement]:
    """Judge each comparison's response against its reference.

    Per comparison: the A/B order comes from :func:`response_is_a` (``seed``, id); the
    prompt is :meth:`Comparison.prompt`; a cached answer of the same judge to the same
    prompt is reused without a request. Otherwise the judge is asked; an answer that
    :func:`parse_preference` cannot read is asked again once with a fresh request, and if
    that one cannot be read either the comparison is recorded as invalid
    (``preferred`` and ``response_wins`` ``None``). Answers, valid or invalid, are cached.
    A :class:`JudgeRequestError` (the client's retries exhausted, an unreadable reply) is
    recorded with ``error`` set and not cached, so a later run asks again; a fatal one
    (bad key, model or request) is raised.

    Judges with ``thread_safe`` run up to ``concurrency`` requests at once; others run
    sequentially, through ``answer_batch`` when they have one.

    Args:
        cache: ``None`` disables caching.
        max_comparisons: spending cap: at most this many uncached comparisons are sent
            (one comparison may take two requests); the rest, in input order, are neither
            judged nor returned, and a log line says how many. Cache hits do not count.
        progress: show a tqdm progress bar.

    Returns:
        Judgements in input order: cache hits and the comparisons sent.

    Raises:
        ValueError: two comparisons share an id, ``max_comparisons`` < 0 or ``concurrency`` < 1.
        JudgeRequestError: a fatal request error (already stored answers stay cached).
    """
    if max_comparisons is not None and max_comparisons < 0:
        raise ValueError(f"max_comparisons must be >= 0, got {max_comparisons}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: dict[int, Judgement] = {}
    pending: list[tuple[int, _Job]] = []
    seen: set[str] = set()
    hits = 0
    for index, comparison in enumerate(comparisons):
        if comparison.id in seen:
            raise ValueError(f"duplicate comparison id {comparison.id!r}")
        seen.add(comparison.id)
        first = response_is_a(seed, comparison.id)
        job = _Job(comparison, comparison.prompt(first), first)
        hit = cache.get(judge.name, job.prompt) if cache is not None else None
        if hit is not None:
            results[index] = _judgement(job, judge.name, hit.answer, 0, cached=True)
            hits += 1
        else:
            pending.append((index, job))
    skipped = 0
    if max_comparisons is not None and len(pending) > max_comparisons:
        skipped = len(pending) - max_comparisons
        pending = pending[:max_comparisons]
        log.warning("judge %s: spending cap max_comparisons=%d reached: %d uncached comparisons not judged",
                    judge.name, max_comparisons, skipped)
    log.info("judge %s: %d cached, %d to send", judge.name, hits, len(pending))

    bar = tqdm(total=len(pending), desc=f"judging ({judge.name})", disable=not progress or not pending,
               dynamic_ncols=True)
    try:
        if getattr(judge, "thread_safe", False) and concurrency > 1 and len(pending) > 1:
            with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="judge") as pool:
                futures = {pool.submit(_finish, judge, job, cache, None, 0): index for index, job in pending}
                try:
                    for future in as_completed(futures):
                        results[futures[future]] = future.result()  # re-raises a fatal error
                        bar.update(1)
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
        elif hasattr(judge, "answer_batch"):
            step = max(1, int(getattr(judge, "batch_size", 8)))
            for start in range(0, len(pending), step):
                chunk = pending[start : start + step]
                answers = judge.answer_batch([job.prompt for _, job in chunk])  # type: ignore[attr-defined]
                for (index, job), answer in zip(chunk, answers):
                    results[index] = _finish(judge, job, cache, answer, 1)
                bar.update(len(chunk))
        else:
            for index, job in pending:
                results[index] = _finish(judge, job, cache, None, 0)
                bar.update(1)
    finally:
        bar.close()
    judgements = [results[i] for i in sorted(results)]
    counts = win_counts(judgements)
    log.info("judge %s: %d judged (%d wins, %d losses, %d invalid, %d errors)%s", judge.name, len(judgements),
             counts["wins"], counts["losses"], counts["invalid"], counts["errors"],
             f"; {skipped} left out by the spending cap" if skipped else "")
    return judgements
