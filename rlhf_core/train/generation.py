"""Sampling responses from left-padded queries, and post-processing them (Details 3, 5, 12, 23).

PAD is never sampled: it marks where a response ends (Details 3, 12), so a sampled PAD would
end a response before its EOS. :func:`generate` removes it from the sampling distribution,
and :func:`rlhf_core.ppo.algorithm.sampling_logits` removes it from the distribution PPO trains, so the
two are the same.

How the decoding steps run is chosen once, by the model's device (:func:`decoding_for`): on
CUDA a static KV cache and a compiled, CUDA-graph-replayed decoding step, elsewhere
transformers' dynamic cache, eagerly. From the same seed both sample the same tokens, from
logits equal up to rounding (:class:`Decoding`).
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from transformers import CompileConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase, StaticCache

from .training import autocast

log = logging.getLogger(__name__)


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Index of the first ``True`` in each row; the row length when there is none.

    Args:
        bools: ``(batch, length)`` bool tensor.

    Returns:
        ``(batch,)`` tensor of ``dtype``.
    """
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def trim_left_padding(queries: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Drop the columns of left padding shared by every row of a left-padded batch.

    Args:
        queries: ``(batch, length)`` token ids, left-padded with ``pad_token_id``.

    Returns:
        ``(batch, length - k)`` where ``k`` is the smallest padding count in the batch.
    """
    first_real = first_true_indices(queries != pad_token_id)
    return queries[:, int(first_real.min()) :]


def truncate_after_eos(responses: torch.Tensor, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Keep each response up to and including its first EOS; fill the rest with PAD (Detail 23).

    Args:
        responses: ``(batch, response_length)`` sampled token ids.

    Returns:
        A new ``(batch, response_length)`` tensor; rows without EOS are unchanged.
    """
    eos_index = first_true_indices(responses == eos_token_id)
    positions = torch.arange(responses.size(1), device=responses.device).unsqueeze(0)
    return torch.where(positions > eos_index.unsqueeze(1), torch.full_like(responses, pad_token_id), responses)


def last_token_indices(responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Index of each response's last real token, the one before its first PAD: where the
    reward model's score is read (Detail 12).

    Args:
        responses: ``(batch, response_length)`` token ids, PAD after the end.

    Returns:
        ``(batch,)`` long: ``response_length - 1`` when there is no PAD, ``-1`` when the
        response starts with PAD.
    """
    return first_true_indices(responses == pad_token_id) - 1


def ends_with_eos(responses: torch.Tensor, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Whether each response's last real token (:func:`last_token_indices`) is EOS (Details 12, 23).

    The reward is read at that token, so a response counts as having an EOS only when the
    token there is one: a response without EOS, one that starts with PAD and one with a PAD
    before its EOS are all False.

    Args:
        responses: ``(batch, response_length)`` token ids, PAD after the first EOS
            (:func:`truncate_after_eos`).

    Returns:
        ``(batch,)`` bool.
    """
    last = last_token_indices(responses, pad_token_id).clamp(min=0)  # a response starting with PAD: its PAD
    return torch.gather(responses, 1, last.unsqueeze(1)).squeeze(1) == eos_token_id


#: A static KV cache's length is a multiple of this many tokens (:func:`static_cache_length`).
CACHE_LENGTH_MULTIPLE = 256


def static_cache_length(query_length: int, max_new_tokens: int, multiple: int = CACHE_LENGTH_MULTIPLE) -> int:
    """Slots per sequence of a static KV cache for ``query_length + max_new_tokens`` tokens,
    rounded up to a multiple of ``multiple``.

    The compiled decoding step is specialised to the cache's shape, ``(batch, kv_heads,
    length, head_dim)`` per layer, and the attention mask is built to that length outside it,
    so one length serves every query length up to it: a length that followed each batch's
    (trimmed) query length would compile and capture the step again for nearly every batch.
    transformers keeps the longest length a model has used (``_previous_max_cache_length``),
    so over a run the cache only grows, by whole multiples.
    """
    needed = query_length + max_new_tokens
    return -(-needed // multiple) * multiple


@dataclass(frozen=True)
class Decoding:
    """How :func:`generate` runs its decoding steps; what it samples does not depend on it.

    ``static_cache=False``: transformers' dynamic KV cache, whose keys and values grow by one
    position a step, run eagerly (every decoding step launches each kernel from Python).
    ``static_cache=True``: transformers' ``StaticCache``, keys and values preallocated per
    layer as ``(batch, kv_heads, static_cache_length(...), head_dim)`` zeros, written in place
    step by step, the slots not yet written masked out of attention. Every decoding step then
    has the same shapes, so with ``compile_config`` (transformers' ``CompileConfig``: the
    arguments of ``torch.compile``; ``mode="reduce-overhead"`` replays the step as a CUDA graph)
    it is compiled once per batch size and cache length and replayed; the prefill (the query's
    forward pass) always runs eagerly. ``compile_config=None`` runs the static cache eagerly.

    The cache's keys and values take the dtype of the first keys and values written into it
    (transformers allocates them lazily), so under bf16 autocast with float32 weights the keys
    are float32 (rotary embeddings promote them) and the values bfloat16, as in the dynamic
    cache; a cache allocated up front in one dtype would fail its in-place writes. Chunked
    prefill (``prefill_chunk_size``) allocates it up front, so it is not used here.

    Attributes:
        static_cache: a static cache instead of the dynamic one.
        compile_config: compile the decoding step (static cache only), on whatever device
            this decoding was chosen for.
        cache_length_multiple: the static cache's length is rounded up to a multiple of this
            (:func:`static_cache_length`).
        max_static_caches: how many static caches (one per decoding shape) a model keeps.
    """

    static_cache: bool = False
    #: The static caches kept for one model, the least recently used dropped beyond it
    #: (:func:`static_cache_for`): each holds keys and values for its batch and length.
    max_static_caches: int = 4
    compile_config: CompileConfig | None = None
    cache_length_multiple: int = CACHE_LENGTH_MULTIPLE

    def cache_length(self, query_length: int, max_new_tokens: int) -> int:
        """The static cache's length for ``query_length`` and ``max_new_tokens`` (:func:`static_cache_length`)."""
        return static_cache_length(query_length, max_new_tokens, self.cache_length_multiple)

    def generation_config_kwargs(self) -> dict[str, Any]:
        """The ``GenerationConfig`` arguments of this decoding: none for the dynamic cache
        (transformers' default); for the static cache, whether and how its step is compiled
        (the cache itself is passed to ``generate``: :func:`static_cache_for`)."""
        if not self.static_cache:
            return {}
        kwargs: dict[str, Any] = {}
        if self.compile_config is None:
            kwargs["disable_compile"] = True  # transformers would compile a static cache's step on CUDA
        else:
            # transformers compiles only on accelerators unless this flag is set: the choice was made already.
            # Copies compare equal, so the model's compiled step (``_compiled_call``) is reused across calls.
            config = copy.copy(self.compile_config)
            config._compile_all_devices = True
            kwargs["compile_config"] = config
        return kwargs


#: The static caches kept for each model, by :func:`static_cache_for`'s key, least recently used first.
_STATIC_CACHES: weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict[tuple, StaticCache]] = (
    weakref.WeakKeyDictionary()
)


def cache_bytes(cache: StaticCache) -> int:
    """Bytes held by a static cache's keys and values (0 for a layer not written yet: they are
    allocated on the first write)."""
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


def static_cache_for(
    model: PreTrainedModel, batch_size: int, cache_length: int, device: torch.device, keep: int = 4
) -> StaticCache:
    """The one static KV cache of ``model`` for ``batch_size`` rows of ``cache_length`` tokens on
    ``device`` in the current autocast state (which decides the dtypes of its keys and values),
    emptied (``reset``: zeroed in place) for a new call.

    transformers builds a new ``StaticCache`` in every ``generate`` call given
    ``cache_implementation="static"``; its tensors are marked as static addresses, so a
    CUDA-graph-compiled decoding step would record its graph again for every call. Kept across
    calls and passed to ``generate`` (its ``cache`` argument), the cache keeps its storage, and
    the graph captured for the first call of a shape replays in the next ones. A model keeps at
    most ``keep`` caches (:attr:`Decoding.max_static_caches`), as long as it lives: a new shape
    beyond them drops the least recently used one, and the log gives the memory the model's
    caches hold.

    Raises:
        ValueError: ``keep`` below 1.
    """
    if keep < 1:
        raise ValueError(f"a model keeps at least one static cache, not {keep}")
    autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
    key = (batch_size, cache_length, str(device), next(model.parameters()).dtype, autocast)
    caches = _STATIC_CACHES.setdefault(model, OrderedDict())
    if key in caches:
        caches.move_to_end(key)
    else:
        dropped = []
        while len(caches) >= keep:
            dropped.append(caches.popitem(last=False))
        caches[key] = StaticCache(config=model.config, max_cache_len=cache_length)
        log.info(
            "generate: a static KV cache for %d rows of %d tokens; %d kept for this model, %.1f MiB before this "
            "one's first write%s",
            batch_size,
            cache_length,
            len(caches),
            sum(cache_bytes(c) for c in caches.values()) / 2**20,
            "".join(
                f"; the least recently used, {k[0]} rows of {k[1]} tokens ({cache_bytes(c) / 2**20:.1f} MiB), dropped"
                for k, c in dropped
            ),
        )
    cache = caches[key]
    cache.reset()
    return cache


#: transformers' dynamic KV cache, eager: what :func:`decoding_for` picks off CUDA.
DYNAMIC_CACHE = Decoding()
#: A static KV cache and the decoding step compiled with CUDA graphs: what :func:`decoding_for`
#: picks on CUDA, where a small model's eager decoding step is bound by kernel launches.
COMPILED_STATIC_CACHE = Decoding(static_cache=True, compile_config=CompileConfig(mode="reduce-overhead"))


#: Why compiling the decoding step failed in this process, once it has: :func:`generate` then
#: samples with :data:`DYNAMIC_CACHE` instead of any compiled decoding.
_compile_failure: list[str] = []


def decoding_for(device: torch.device | str, sharded: bool = False) -> Decoding:
    """The decoding :func:`generate` uses for a model on ``device``: :data:`COMPILED_STATIC_CACHE`
    on CUDA, :data:`DYNAMIC_CACHE` elsewhere and for a ``sharded`` model (FSDP2).

    On CUDA an eager decoding step of a small model spends its time launching kernels, which
    a CUDA graph replays in one launch; the first call per batch size and cache length pays
    for compiling and capturing the step. On the CPU there are no CUDA graphs and compiling
    costs more than it saves over the few calls a CPU run makes. A sharded model is gathered
    afresh for each rollout (:meth:`rlhf_core.train.distributed.DataParallel.gathered`), into new
    memory, and runs FSDP2's hooks in every forward pass: a captured graph's fixed addresses
    would not hold, so it decodes eagerly.
    """
    device = torch.device(device)
    decoding = DYNAMIC_CACHE if sharded or device.type != "cuda" else COMPILED_STATIC_CACHE
    _log_choice(decoding, "a model sharded by FSDP2" if sharded else f"a {device.type} device")
    return decoding


_told: set[tuple[str, str]] = set()


def _log_choice(decoding: Decoding, why: str) -> None:
    """Tell, once per process and reason, which decoding :func:`decoding_for` chose and why."""
    name = "the dynamic KV cache" if not decoding.static_cache else "a static KV cache"
    name += ", compiled" if decoding.compile_config is not None else ""
    if (name, why) not in _told:
        _told.add((name, why))
        log.info("generate: decoding with %s, for %s", name, why)


def _is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` or one of its modules is sharded by FSDP2 (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state sampling on ``device`` draws from: the CPU generator's, and the
    device's own on CUDA."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    queries: torch.Tensor,
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int | None = None,
    return_logits: bool = False,
    decoding: Decoding | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sample responses for a batch of left-padded queries with the KV cache.

    Sampling is plain temperature sampling (no top-k, no top-p) from the model's
    distribution without PAD: PAD's logit is set to ``-inf`` before sampling, so PAD only
    ever follows a stop (:func:`rlhf_core.ppo.algorithm.sampling_logits` is the same distribution).
    With ``eos_token_id`` a sequence stops at its EOS and is padded; with ``None`` exactly
    ``max_new_tokens`` tokens are sampled, EOS or not (PPO rollouts, Detail 23). Position
    ids follow the attention mask, so left padding does not shift positions (Detail 14).

    Args:
        queries: ``(batch, query_length)`` token ids, left-padded with ``pad_token_id``.
        return_logits: also return the raw logits of every sampled position (untempered,
            PAD included).
        decoding: how the decoding steps run; ``None``: :func:`decoding_for` the model's
            device (and whether it is sharded). The same seed gives the same tokens either way.
            Should the compiled decoding step fail in any way (compiling, recording or replaying
            its graph, out of memory included), a warning names the error and this call, from
            the random state it began with, and every later one in the process sample with
            :data:`DYNAMIC_CACHE`.

    Returns:
        ``(batch, max_new_tokens)`` response token ids, PAD after a stop; with
        ``return_logits`` also ``(batch, max_new_tokens, vocab)`` float logits.
    """
    if decoding is None:
        decoding = decoding_for(next(model.parameters()).device, sharded=_is_sharded(model))
    if decoding.compile_config is not None and _compile_failure:
        decoding = DYNAMIC_CACHE
    attention_mask = (queries != pad_token_id).long()

    def sample(decoding: Decoding):
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=None,
            suppress_tokens=[pad_token_id],
            output_logits=return_logits,
            return_dict_in_generate=True,
            **decoding.generation_config_kwargs(),
        )
        cache = {}
        if decoding.static_cache:
            length = decoding.cache_length(queries.size(1), max_new_tokens)
            cache["cache"] = static_cache_for(
                model, queries.size(0), length, queries.device, decoding.max_static_caches
            )
        # synced_gpus off: transformers turns it on for a sharded model under torch.distributed (every
        # rank then steps until all have stopped); the callers sample from unsharded or gathered
        # parameters (DataParallel.gathered), so the ranks' calls are independent.
        return model.generate(
            input_ids=queries, attention_mask=attention_mask, generation_config=config, synced_gpus=False, **cache
        )

    # generate() falls back on the model's own EOS when none is given; clear it to sample through.
    saved_eos = model.generation_config.eos_token_id
    if eos_token_id is None:
        model.generation_config.eos_token_id = None
    rng = _rng_state(queries.device)
    try:
        try:
            out = sample(decoding)
        except Exception as exc:
            if decoding.compile_config is None:
                raise
            # A speed lever never stops a run: whatever failed (compiling, recording or replaying
            # CUDA graphs, autotuning, out of memory while recording), the eager dynamic cache
            # samples the same distribution, from the random state this call began with, so the
            # same seed gives the same tokens as if it had decoded that way from the start.
            _compile_failure.append(f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            del exc  # its traceback holds the attempt's tensors
            if queries.device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning(
                "the compiled decoding step failed (%s); sampling with the dynamic KV cache, eagerly, from now on",
                _compile_failure[0],
            )
            _set_rng_state(queries.device, rng)
            out = sample(DYNAMIC_CACHE)
    finally:
        model.generation_config.eos_token_id = saved_eos
    responses = out.sequences[:, queries.size(1) :]
    short = max_new_tokens - responses.size(1)
    if short > 0:
        pad = torch.full((responses.size(0), short), pad_token_id, dtype=responses.dtype, device=responses.device)
        responses = torch.cat([responses, pad], dim=1)
    if not return_logits:
        return responses
    logits = torch.stack(out.logits, dim=1)
    if short > 0:
        logits = torch.cat([logits, logits.new_zeros(logits.size(0), short, logits.size(2))], dim=1)
    return responses, logits


def decode_responses(
    tokenizer: PreTrainedTokenizerBase, responses: torch.Tensor, eos_token_id: int, pad_token_id: int
) -> list[str]:
    """Text of each response up to (not including) its first EOS, stripped of whitespace.

    Args:
        responses: ``(batch, response_length)`` token ids.
    """
    texts = []
    for row in truncate_after_eos(responses, eos_token_id, pad_token_id).tolist():
        ids = [t for t in row if t not in (eos_token_id, pad_token_id)]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True).strip())
    return texts


@dataclass
class Summaries:
    """One policy's summaries of a set of queries.

    Attributes:
        texts: ``n`` decoded summaries (up to their first EOS).
        responses: ``(n, response_length)`` long token ids, PAD after the first EOS.
        has_eos: ``(n,)`` bool, the summary ends with EOS within the response length
            (:func:`ends_with_eos`).
        lengths: ``(n,)`` long, tokens up to and including the last real token (the EOS,
            or all ``response_length`` without one).
    """

    texts: list[str]
    responses: torch.Tensor
    has_eos: torch.Tensor
    lengths: torch.Tensor


@torch.no_grad()
def summarize(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    queries: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    bf16: bool | str = False,
) -> Summaries:
    """Sample one summary per left-padded query, stopping at EOS, in batches of ``batch_size``.

    The SFT stage's, PPO's and the evaluation stage's summaries all come from here. The
    global RNG is seeded with ``seed`` first, so the same call gives the same summaries
    (callers that must not disturb their own RNG stream wrap it in ``torch.random.fork_rng``).

    Args:
        queries: ``(n, query_length)`` long token ids, left-padded (CPU or the model's device).
        max_new_tokens: the response length (the SFT response length of the data, Detail 4).
        bf16: the stage's precision setting (:func:`rlhf_core.train.training.autocast`).

    Returns:
        :class:`Summaries` with ``(n, max_new_tokens)`` responses, all on the CPU.
    """
    device = next(model.parameters()).device
    model.eval()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    texts, rows = [], []
    for start in range(0, len(queries), batch_size):
        q = trim_left_padding(queries[start : start + batch_size], pad).to(device)
        with autocast(device, bf16):
            responses = generate(model, q, pad, max_new_tokens, temperature, eos_token_id=eos)
        responses = truncate_after_eos(responses, eos, pad).cpu()
        rows.append(responses)
        texts += decode_responses(tokenizer, responses, eos, pad)
    responses = torch.cat(rows) if rows else torch.zeros(0, max_new_tokens, dtype=torch.long)
    return Summaries(texts, responses, ends_with_eos(responses, eos, pad), last_token_indices(responses, pad) + 1)
