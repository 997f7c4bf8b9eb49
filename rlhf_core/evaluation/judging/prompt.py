"""The judge prompt of Huang et al. 2024, Appendix I, its strict parser, and the seeded A/B order."""

from __future__ import annotations

import hashlib
import re
import string
from typing import Literal

# Huang et al. 2024, Appendix I (modified from Rafailov et al. 2023). The paper's text
# breaks three sentences with a line-continuation "\"; they are joined here. The post and
# the summaries are wrapped in <post> and <summary> tags, which the paper's prompt does not
# have: without them a post could end its own block ("...\n\nSummary A:\n...") or append
# a fake answer ("Preferred: A"); inside them it stays data. The paper's text is the prompt
# with the tag lines removed (tests/rlhf_core/evaluation/test_judging.py checks it against Appendix I).
JUDGE_PROMPT = (
    "Which of the following summaries does a better job of summarizing the most important points in the "
    "given forum post, without including unimportant or irrelevant details? Judge based on accuracy, "
    "coverage, and coherence.\n"
    "\n"
    "Post:\n"
    "<post>\n"
    "{post}\n"
    "</post>\n"
    "\n"
    "Summary A:\n"
    "<summary>\n"
    "{summary_a}\n"
    "</summary>\n"
    "\n"
    "Summary B:\n"
    "<summary>\n"
    "{summary_b}\n"
    "</summary>\n"
    "\n"
    "FIRST provide a one-sentence comparison of the two summaries, explaining which you prefer and why. "
    'SECOND, on a new line, state only "A" or "B" to indicate your choice. Your response should use '
    "the format:\n"
    "\n"
    "Comparison: <one-sentence comparison and explanation>\n"
    'Preferred: <"A" or "B">'
)

#: The judge prompt of ``data.format: trl`` data, which need not be summaries of forum posts: a
#: neutral pairwise question, in the layout and answer format of :data:`JUDGE_PROMPT`.
PAIRWISE_PROMPT = (
    "Which of the following two responses to the prompt is better? Judge based on helpfulness, "
    "accuracy, and coherence.\n"
    "\n"
    "Prompt:\n"
    "<post>\n"
    "{prompt}\n"
    "</post>\n"
    "\n"
    "Response A:\n"
    "<summary>\n"
    "{a}\n"
    "</summary>\n"
    "\n"
    "Response B:\n"
    "<summary>\n"
    "{b}\n"
    "</summary>\n"
    "\n"
    "FIRST provide a one-sentence comparison of the two responses, explaining which you prefer and why. "
    'SECOND, on a new line, state only "A" or "B" to indicate your choice. Your response should use '
    "the format:\n"
    "\n"
    "Comparison: <one-sentence comparison and explanation>\n"
    'Preferred: <"A" or "B">'
)
#: The placeholders a judge prompt of ``eval.judge_prompt`` fills: the prompt (or post) and the
#: two responses. :data:`JUDGE_PROMPT` names them ``post``, ``summary_a``, ``summary_b``.
TEMPLATE_FIELDS = ("prompt", "a", "b")


def load_judge_prompt(path: str | None, data_format: str) -> str:
    """The judge prompt template: the file ``path`` (``eval.judge_prompt``) when set, else
    :data:`JUDGE_PROMPT` (Appendix I) for ``tldr`` data and :data:`PAIRWISE_PROMPT` for ``trl``.

    A template file is UTF-8 text naming each of ``{prompt}``, ``{a}`` and ``{b}`` and no other
    placeholder (a literal brace is written twice); it should ask for the answer format that
    :func:`parse_preference` reads (a last line ``Preferred: A`` or ``Preferred: B``).

    Raises:
        ValueError: the file cannot be read, or its placeholders are not exactly those three;
            naming ``eval.judge_prompt`` and the file.
    """
    if not path:
        return PAIRWISE_PROMPT if data_format == "trl" else JUDGE_PROMPT
    try:
        template = open(path, encoding="utf-8").read()
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"eval.judge_prompt {path}: {type(exc).__name__}: {exc}") from None
    if names != set(TEMPLATE_FIELDS):
        raise ValueError(
            f"eval.judge_prompt {path}: a judge prompt names {{prompt}}, {{a}} and {{b}}, each once or more, "
            f"and nothing else; it names {', '.join('{' + n + '}' for n in sorted(names)) or 'none'}"
        )
    return template


#: The delimiters of :data:`JUDGE_PROMPT`, which a text must not contain as they are.
_DELIMITER = re.compile(r"<(/?)(post|summary)>", re.IGNORECASE)


def escape_delimiters(text: str) -> str:
    """``text`` with every ``<post>``, ``</post>``, ``<summary>`` and ``</summary>`` (any case)
    written ``&lt;post&gt;`` and so on, so that a text cannot close its own block."""
    return _DELIMITER.sub(lambda m: f"&lt;{m.group(1)}{m.group(2)}&gt;", text)


Preference = Literal["A", "B"]


def format_judge_prompt(post: str, summary_a: str, summary_b: str, template: str = JUDGE_PROMPT) -> str:
    """The Appendix I prompt (or another ``template``: :func:`load_judge_prompt`) with ``post``
    and the two summaries filled in, each inside its tags (:data:`JUDGE_PROMPT`) with the tags
    escaped in the texts (:func:`escape_delimiters`); everything else in them, braces and
    "Preferred:" lines included, is kept verbatim.

    Raises:
        TypeError: an argument is not a string.
    """
    for name, value in (("post", post), ("summary_a", summary_a), ("summary_b", summary_b)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    post, a, b = escape_delimiters(post), escape_delimiters(summary_a), escape_delimiters(summary_b)
    return template.format(post=post, summary_a=a, summary_b=b, prompt=post, a=a, b=b)


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


#: The first line of an offline judge's answer (:meth:`rlhf_core.evaluation.judging.OfflineJudge.answer_batch`).
_LETTER_LOGPROBS = re.compile(
    r"^Comparison: offline judge .*: log p\(A\)=(?P<a>-?[0-9.]+(?:e-?[0-9]+)?|-inf), "
    r"log p\(B\)=(?P<b>-?[0-9.]+(?:e-?[0-9]+)?|-inf), p\(A\)=[0-9.]+(?:e-?[0-9]+)?$"
)


def parse_letter_logprobs(answer: str | None) -> tuple[float, float] | None:
    """``(log p(A), log p(B))`` from an offline judge's answer, or ``None`` for any other answer.

    The offline judge states both letters' log-probabilities on its first line
    (``Comparison: offline judge NAME: log p(A)=-3.210412, log p(B)=-3.662037, p(A)=0.6110``);
    a text judge's answer has no such line and gives ``None``.
    """
    if not isinstance(answer, str):
        return None
    match = _LETTER_LOGPROBS.match(answer.split("\n", 1)[0])
    if match is None:
        return None
    return float(match["a"]), float(match["b"])


def response_is_a(seed: int, comparison_id: str) -> bool:
    """Whether the policy response is shown as "Summary A" for this comparison.

    Derived from ``sha256(f"{seed}:{comparison_id}")``: the same seed and id always give
    the same order, whatever other comparisons are judged or in which order, and over
    many ids about half put the response first (Huang et al. 2024, Appendix I: the order
    is randomised to remove positional bias).
    """
    digest = hashlib.sha256(f"{int(seed)}:{comparison_id}".encode()).digest()
    return digest[0] & 1 == 1
