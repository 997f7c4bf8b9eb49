"""LLM-as-a-judge win rates of policy summaries against reference summaries.

A judge reads the prompt of Huang et al. 2024, Appendix I (:data:`JUDGE_PROMPT`): a post,
"Summary A" and "Summary B", and answers with a one-sentence comparison and a final line
``Preferred: A`` or ``Preferred: B``. Following the paper, the order of the two summaries
is randomised per comparison to remove positional bias; here it is derived from a seed and
the comparison's id (:func:`response_is_a`), so it is reproducible and does not depend on
which other comparisons are judged.

Three judges share one interface (``name``, ``thread_safe``, ``answer(prompt) -> str``):

- :class:`AnthropicJudge`: a Claude model through the Anthropic Messages API.
- :class:`OpenAIJudge`: a model on any OpenAI-compatible server (the OpenAI API, vLLM,
  llama.cpp, Ollama) through the Chat Completions API.

  Both build on ``api_judge.ApiJudge``: the settings, the key kept out of every message, the
  token count and the errors their SDKs' failures become.
- :class:`OfflineJudge`: a local Hugging Face causal LM that compares the next-token
  probabilities of the letters A and B after ``Preferred:``; for runs without network.

:func:`judge_comparisons` runs a judge over :class:`Comparison` records with a
:class:`JudgementCache` (a JSONL file: an answer is paid for once), a spending cap and
bounded concurrency, and returns one :class:`Judgement` per comparison judged. Answers are
parsed strictly (:func:`parse_preference`); an unparseable answer is asked again once and
then recorded as invalid, never guessed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .cache import CachedAnswer, JudgementCache
from .errors import JudgeConfigError, JudgeError, JudgeRequestError, JudgeUnreadableError
from .offline import OfflineJudge
from .prompt import JUDGE_PROMPT, Preference, format_judge_prompt, parse_preference, prompt_sha256, response_is_a
from .records import Comparison, Judgement, win_counts
from .runner import Judge, judge_comparisons, require_readable, unreadable_answers

if TYPE_CHECKING:
    from .anthropic_judge import AnthropicJudge
    from .openai_judge import OpenAIJudge

__all__ = [
    "JUDGE_PROMPT",
    "AnthropicJudge",
    "CachedAnswer",
    "Comparison",
    "Judge",
    "JudgeConfigError",
    "JudgeError",
    "JudgeRequestError",
    "JudgeUnreadableError",
    "Judgement",
    "JudgementCache",
    "OfflineJudge",
    "OpenAIJudge",
    "Preference",
    "format_judge_prompt",
    "judge_comparisons",
    "parse_preference",
    "prompt_sha256",
    "require_readable",
    "response_is_a",
    "unreadable_answers",
    "win_counts",
]


def __getattr__(name: str) -> Any:
    """``AnthropicJudge`` and ``OpenAIJudge`` are imported on first use, so the offline judge needs
    neither the ``anthropic`` nor the ``openai`` SDK."""
    if name == "AnthropicJudge":
        from .anthropic_judge import AnthropicJudge

        return AnthropicJudge
    if name == "OpenAIJudge":
        from .openai_judge import OpenAIJudge

        return OpenAIJudge
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
