"""Rule-based rewards for PPO, and loading a reward function named by ``ppo.reward``.

``ppo.reward: python:MODULE:FUNCTION`` replaces the reward model's score by
``FUNCTION(queries, responses, query_ids, response_ids)``, where for a batch of ``n``:

* ``queries``: ``n`` query texts (the formatted prompt, Detail 2);
* ``responses``: ``n`` response texts, up to (not including) the first EOS;
* ``query_ids``: ``n`` lists of query token ids, PAD removed;
* ``response_ids``: ``n`` lists of response token ids up to (not including) the first EOS,
  PAD removed;

and the result is one float per response, as a list or a ``(n,)`` tensor. PPO applies the
EOS trick (Detail 23), the KL penalty and the whitening to it exactly as to the reward
model's score (:class:`RuleReward`, scored by :func:`rlhf_core.train.reward.score_responses`). A rule reward makes PPO's learning
measurable without a reward model: what the policy is asked to do is known, so a rise of the
score shows that the policy gradient works.

Rewards shipped here (each ``ppo.reward: python:rlhf_core.train.rule_rewards:NAME``):

* :func:`word_count_12`: closeness of the summary's word count to 12 words. For SmolLM2-135M
  on TL;DR (``benchmarks/ppo_learning.py``): the reference summaries have 26 words
  (median), so the policy must learn to end its summary, with an EOS, earlier.
* :func:`no_first_person`: minus the share of first-person words. Most reference
  summaries (88%) use them.
* :func:`non_repeating_tokens`: the share of response tokens that differ from the token
  before them. Made for the tiny random model of the ``smoke`` preset, see its docstring.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models.sources import RewardSpecError, parse_reward_spec, reward_code_digest, reward_source  # noqa: F401

#: ``f(queries, responses, query_ids, response_ids) -> n floats``.
RewardFunction = Callable[[list[str], list[str], list[list[int]], list[list[int]]], "Sequence[float] | torch.Tensor"]


# ----------------------------------------------------------------------- loading


def load_reward_function(spec: str) -> RewardFunction | None:
    """Import the function of a ``ppo.reward`` spec; ``None`` for ``"model"``.

    Raises:
        RewardSpecError: naming ``ppo.reward`` and the spec, when the module cannot be
            imported, has no such attribute, or the attribute is not callable.
    """
    parsed = parse_reward_spec(spec)
    if parsed is None:
        return None
    module_name, name = parsed
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or any error raised while the module runs
        raise RewardSpecError(
            f"ppo.reward {spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardSpecError(f"ppo.reward {spec!r}: module {module_name!r} has no attribute {name!r}")
    if not callable(fn):
        raise RewardSpecError(f"ppo.reward {spec!r}: {module_name}.{name} is a {type(fn).__name__}, not a function")
    return fn


def describe_reward(spec: str, reward_model_dir: str | Path | None) -> str:
    """What PPO maximises, in one line, for the run's params: the reward model's directory (after
    the existing model's spec, ``model:SOURCE``, when it was imported), or the function's
    qualified name and source file."""
    parsed = parse_reward_spec(spec)
    if parsed is None and spec != "model":
        return f"{spec} ({Path(reward_model_dir).resolve() if reward_model_dir is not None else '<none>'})"
    if parsed is None:
        return f"model:{Path(reward_model_dir).resolve()}" if reward_model_dir is not None else "model:<none>"
    return f"python:{parsed[0]}:{parsed[1]} ({reward_source(spec)})"


def reward_tensor(output: Sequence[float] | torch.Tensor, n: int, spec: str) -> torch.Tensor:
    """A reward function's output as ``(n,)`` float32 on the CPU.

    Raises:
        RewardSpecError: not ``n`` numbers (a list of another length, a tensor of another
            shape, or values that are not numbers), naming ``ppo.reward`` and the spec.
    """
    try:
        scores = torch.as_tensor(
            output.detach().cpu() if isinstance(output, torch.Tensor) else list(output), dtype=torch.float32
        )
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RewardSpecError(
            f"ppo.reward {spec!r}: the function must return {n} floats, got {type(output).__name__} ({exc})"
        ) from exc
    if scores.shape != (n,):
        raise RewardSpecError(
            f"ppo.reward {spec!r}: the function must return {n} floats (one per response), "
            f"got shape {tuple(scores.shape)}"
        )
    return scores


def reward_inputs(
    tokenizer, queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int, eos_token_id: int
) -> tuple[list[str], list[str], list[list[int]], list[list[int]]]:
    """The four arguments of a reward function for a batch of query + response token ids.

    Args:
        tokenizer: the data's tokenizer (``rlhf_core.data.prepared.load_data_tokenizer``).
        queries: ``(n, query_length)`` long token ids, left-padded with PAD.
        responses: ``(n, response_length)`` long token ids (PAD after the first EOS, or not
            truncated at all: everything from the first EOS on is dropped either way).

    Returns:
        ``(query_texts, response_texts, query_ids, response_ids)``: ids with PAD removed,
        response ids up to (not including) the first EOS, and their texts decoded with
        special tokens skipped and surrounding whitespace stripped (as
        :func:`rlhf_core.train.generation.decode_responses`).
    """
    query_ids = [[t for t in row if t != pad_token_id] for row in queries.tolist()]
    response_ids = []
    for row in responses.tolist():
        end = row.index(eos_token_id) if eos_token_id in row else len(row)
        response_ids.append([t for t in row[:end] if t != pad_token_id])
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
    return [decode(ids) for ids in query_ids], [decode(ids) for ids in response_ids], query_ids, response_ids


def rule_scores(
    fn: RewardFunction,
    spec: str,
    tokenizer,
    queries: torch.Tensor,
    responses: torch.Tensor,
    pad_token_id: int,
    eos_token_id: int,
) -> torch.Tensor:
    """``fn`` on a batch (:func:`reward_inputs`), checked (:func:`reward_tensor`): ``(n,)`` float32, CPU."""
    inputs = reward_inputs(tokenizer, queries, responses, pad_token_id, eos_token_id)
    return reward_tensor(fn(*inputs), len(responses), spec)


@dataclass
class RuleReward:
    """A rule reward (``ppo.reward: python:MODULE:FUNCTION``) as a scorer of query + response
    token ids, as :func:`rlhf_core.train.reward.score_responses` reads one.

    Attributes:
        fn: the reward function; spec: its ``ppo.reward`` spec (named in errors);
        tokenizer: the data's tokenizer, which decodes the ids.
    """

    fn: RewardFunction
    spec: str
    tokenizer: Any

    def score(
        self,
        queries: torch.Tensor,
        responses: torch.Tensor,
        pad_token_id: int,
        eos_token_id: int,
        batch_size: int,
        bf16: bool | str = False,
    ) -> torch.Tensor:
        """:func:`rule_scores` of the batch: ``(n,)`` float32 on the CPU (``batch_size`` and
        ``bf16``, a model's settings, are not read)."""
        return rule_scores(self.fn, self.spec, self.tokenizer, queries, responses, pad_token_id, eos_token_id)


# ------------------------------------------------------------------------- rules

_WORD = re.compile(r"[A-Za-z0-9]+(?:['’][A-Za-z]+)*")

#: First-person pronouns and their contractions, lower case.
FIRST_PERSON = frozenset(
    {
        "i",
        "me",
        "my",
        "mine",
        "myself",
        "i'm",
        "i've",
        "i'd",
        "i'll",
        "we",
        "us",
        "our",
        "ours",
        "ourselves",
        "we're",
        "we've",
        "we'd",
        "we'll",
    }
)


def words(text: str) -> list[str]:
    """Words of ``text``: runs of letters and digits, with apostrophe contractions kept whole
    (``"I'm"``, ``"don't"``), lower-cased, curly apostrophes made straight."""
    return [w.lower().replace("’", "'") for w in _WORD.findall(text)]


def word_count_score(n_words: int, target: int) -> float:
    """``-|n_words - target| / max(n_words, target)``, in ``[-1, 0]``; 0 exactly at ``target``.

    The relative error against the larger of the two, so that no summary scores below -1,
    the default ``ppo.non_eos_penalty``: with the EOS trick a finished summary never scores
    worse than an unfinished one, however long it is.
    """
    if target <= 0:
        raise ValueError(f"target must be positive, not {target}")
    return -abs(n_words - target) / max(n_words, target)


def word_count_reward(target: int) -> RewardFunction:
    """A reward function: :func:`word_count_score` of each response's word count (:func:`words`)."""

    def reward(
        queries: list[str], responses: list[str], query_ids: list[list[int]], response_ids: list[list[int]]
    ) -> list[float]:
        return [word_count_score(len(words(text)), target) for text in responses]

    reward.__name__ = reward.__qualname__ = f"word_count_{target}"
    reward.__doc__ = (
        f"Closeness of each summary's word count to {target}: "
        f"``word_count_score(len(words(response)), {target})``, in [-1, 0]."
    )
    return reward


#: ``python:rlhf_core.train.rule_rewards:word_count_12``: closeness of the word count to 12, in [-1, 0].
#: For SmolLM2-135M on TL;DR (``benchmarks/ppo_learning.py``): reference summaries have 26
#: words (median; 10th percentile 20; they score -0.54 on average), so the policy must learn
#: to finish sooner.
word_count_12 = word_count_reward(12)


def first_person_share(text: str) -> float:
    """Share of the words of ``text`` that are first-person pronouns (:data:`FIRST_PERSON`);
    1.0 for a text without words (an empty summary is no better than a first-person one)."""
    ws = words(text)
    return sum(w in FIRST_PERSON for w in ws) / len(ws) if ws else 1.0


def no_first_person(
    queries: list[str], responses: list[str], query_ids: list[list[int]], response_ids: list[list[int]]
) -> list[float]:
    """Minus the share of first-person words in each summary (:func:`first_person_share`), in
    ``[-1, 0]``: a summary in the third person, as a summary by someone else would be.

    88% of the TL;DR reference summaries (``sft_validation`` and ``sft_test`` files) use a
    first-person word; on average 9% of their words are.
    """
    return [-first_person_share(text) for text in responses]


def repeat_share(ids: Sequence[int]) -> float:
    """Share of the tokens after the first that equal the token before them; 0.0 for fewer
    than two tokens. ``[5, 5, 5, 7]`` -> ``2 / 3``."""
    if len(ids) < 2:
        return 0.0
    return sum(a == b for a, b in zip(ids[1:], ids[:-1])) / (len(ids) - 1)


def non_repeating_tokens(
    queries: list[str], responses: list[str], query_ids: list[list[int]], response_ids: list[list[int]]
) -> list[float]:
    """``1 - repeat_share(response_ids)`` per response, in ``[0, 1]``: penalises a token that
    repeats the one before it, the degenerate repetition of an untrained or collapsed policy.

    Made for the learning check on the ``smoke`` preset's tiny random model
    (``tests/rlhf_core/ppo/test_ppo_learning.py``). That model samples almost uniformly from its
    49k-token vocabulary at the paper's temperature, so a reward on any fixed set of tokens
    (say half the vocabulary) can only be raised token by token, for the few tokens sampled in
    each context: far too slowly for a short test. Its one structure is that input and output
    embeddings are tied: the largest logit is usually the token just read (its own embedding's
    squared norm). At a low sampling temperature (0.1) it therefore repeats the token before
    in more than half of the positions, and this reward starts well below 1 with a wide
    spread between responses. Repeats are frequent, so every update sees many of them, and
    the policy can lower them all at once (e.g. by moving its hidden state away from the input
    embedding); the reward stays flat when the policy does not learn (figures in
    ``benchmarks/README.md`` and the learning test). It ignores EOS, which such a model never
    samples (use it with ``ppo.non_eos_penalty: null``).
    """
    return [1.0 - repeat_share(ids) for ids in response_ids]
