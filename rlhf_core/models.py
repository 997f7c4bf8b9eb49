"""Base models and tokenizers: hub ids, local directories and GGUF files shipped in packages.

Every model the project builds or loads goes through :func:`disable_dropout` (Huang et
al. 2024, Detail 7) and every tokenizer through :func:`ensure_pad_token` (Detail 3).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .config import ModelConfig, RandomInitConfig
from .errors import ModelSourceError  # noqa: F401  (re-exported: ModelSourceError of this module)
from .generation import first_true_indices
from .io import atomic_directory, write_json_atomic
from .sources import (  # noqa: F401  (re-exported: these names of this module)
    GGUF_CONVERSION,
    Source,
    _package_dir,
    cache_root,
    gguf_cache_dir,
    resolve_source,
    source_fingerprint,
)
from .training import device_tuning

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: The GGUF metadata key of each special token's id, by tokenizer role.
GGUF_SPECIAL_TOKEN_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
}

_GGUF_SPECIAL_TOKENS: dict[str, dict[str, dict]] = {}  # by the GGUF file's SHA-256, per process


def gguf_special_tokens(source: Source) -> dict[str, dict]:
    """The special tokens the GGUF metadata of ``source`` names, as ``{role: {"id", "token"}}``
    for the roles ``bos``, ``eos``, ``unk`` and ``pad`` that it has (keys
    :data:`GGUF_SPECIAL_TOKEN_KEYS`, tokens from ``tokenizer.ggml.tokens``).

    Read with ``gguf.GGUFReader`` (seconds for a 100 MB file) once per file, then from
    ``special_tokens.json`` in :func:`gguf_cache_dir` (keyed by the file's SHA-256) and a
    per-process memo.

    Raises:
        ModelSourceError: an id is not an index of ``tokenizer.ggml.tokens``.
    """
    cached = gguf_cache_dir(source) / "special_tokens.json"
    key = cached.parent.name
    if key not in _GGUF_SPECIAL_TOKENS:
        if cached.is_file():
            _GGUF_SPECIAL_TOKENS[key] = json.loads(cached.read_text())
        else:
            from gguf import GGUFReader

            reader = GGUFReader(source.gguf_path)
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            special: dict[str, dict] = {}
            for role, name in GGUF_SPECIAL_TOKEN_KEYS.items():
                field = reader.fields.get(name)
                if field is None:
                    continue
                token_id = int(field.contents())
                if tokens is None or not 0 <= token_id < len(tokens.data):
                    raise ModelSourceError(
                        f"{source.gguf_path}: {name} = {token_id} is not an index of tokenizer.ggml.tokens"
                    )
                special[role] = {"id": token_id, "token": tokens.contents(token_id)}
            write_json_atomic(cached, special)
            _GGUF_SPECIAL_TOKENS[key] = special
    return _GGUF_SPECIAL_TOKENS[key]


def _special_token_disagreements(tokenizer: PreTrainedTokenizerBase, special: dict[str, dict]) -> dict[str, str]:
    """``{role: description}`` of the roles whose id in ``tokenizer`` is not the one of
    ``special`` (:func:`gguf_special_tokens`)."""
    wrong = {}
    for role, want in special.items():
        got_id = getattr(tokenizer, f"{role}_token_id")
        if got_id != want["id"]:
            wrong[role] = (
                f"{role.upper()} is {getattr(tokenizer, f'{role}_token')!r} (id {got_id}) where the GGUF metadata "
                f"({GGUF_SPECIAL_TOKEN_KEYS[role]}) names {want['token']!r} (id {want['id']})"
            )
    return wrong


def _token_at(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str | None:
    try:
        return tokenizer.convert_ids_to_tokens(token_id)
    except (IndexError, OverflowError, TypeError):
        return None


def _convert_gguf_tokenizer(source: Source, special: dict[str, dict]) -> PreTrainedTokenizerBase:
    """The tokenizer ``transformers`` converts from the GGUF file, its BOS, EOS, UNK and PAD
    set to those of the GGUF metadata where they differ (transformers 5.17 gives a Llama-type
    GGUF's BOS as its EOS too).

    Raises:
        ModelSourceError: a role cannot be set to the metadata's token (the converted
            vocabulary has another token at that id); the message names both tokens and ids
            and the installed transformers version.
    """
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    wrong = _special_token_disagreements(tokenizer, special)
    if wrong:
        log.warning(
            "%s: transformers %s converts a tokenizer whose %s; set from the GGUF metadata",
            source.gguf_path,
            transformers.__version__,
            "; ".join(wrong.values()),
        )
    for role in wrong:
        if _token_at(tokenizer, special[role]["id"]) == special[role]["token"]:
            setattr(tokenizer, f"{role}_token", special[role]["token"])
    wrong = [
        f"{line}, and the converted vocabulary has {_token_at(tokenizer, special[role]['id'])!r} at that id"
        for role, line in _special_token_disagreements(tokenizer, special).items()
    ]
    if wrong:
        raise ModelSourceError(
            f"{source.gguf_path}: the tokenizer transformers {transformers.__version__} converts cannot be made "
            f"to agree with the GGUF metadata: its {'; its '.join(wrong)}"
        )
    return tokenizer


def _gguf_tokenizer(source: Source) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file, converted once and cached in ``gguf_cache_dir(source) /
    "tokenizer"``; a cached one is checked against the GGUF metadata on every load and
    converted again (with a warning) where its special tokens differ.

    Raises:
        ModelSourceError: see :func:`_convert_gguf_tokenizer`, or the saved tokenizer does
            not load back with the metadata's special tokens.
    """
    special = gguf_special_tokens(source)
    target = gguf_cache_dir(source) / "tokenizer"
    stale = False
    if (target / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(target, clean_up_tokenization_spaces=False)
        wrong = _special_token_disagreements(tokenizer, special)
        if not wrong:
            return tokenizer
        log.warning(
            "cached tokenizer %s: its %s; converting %s again", target, "; ".join(wrong.values()), source.gguf_path
        )
        stale = True
    else:
        log.info("converting the tokenizer of %s (once; cached in %s)", source.gguf_path, target)
    converted = _convert_gguf_tokenizer(source, special)
    with contextlib.suppress(FileExistsError), atomic_directory(target, overwrite=stale) as tmp:
        converted.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(target, clean_up_tokenization_spaces=False)
    wrong = _special_token_disagreements(tokenizer, special)
    if wrong:
        raise ModelSourceError(
            f"{target}: the tokenizer converted from {source.gguf_path} by transformers {transformers.__version__} "
            f"loads back with its {'; its '.join(wrong.values())}"
        )
    return tokenizer


def gguf_to_safetensors(source: Source) -> Path:
    """Dequantise a GGUF checkpoint once and cache it as a plain safetensors model directory.

    ``transformers`` dequantises GGUF weights on load but refuses to ``save_pretrained``
    such a model, so a plain model is rebuilt from its config and given the state dict.
    Later loads read the cached directory (well under a second for 135M parameters).

    Returns:
        The cached directory (``config.json``, ``model.safetensors``).
    """
    target = gguf_cache_dir(source) / "model"
    if (target / "config.json").is_file():
        return target
    log.info("dequantising %s (once; cached in %s)", source.gguf_path, target)
    gguf_model = AutoModelForCausalLM.from_pretrained(source.location, gguf_file=source.gguf_file, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = str(source.gguf_path)
    special = gguf_special_tokens(source)
    for role in ("bos", "eos"):  # as the tokenizer's (PAD is the project's, set on import)
        if role in special:
            setattr(config, f"{role}_token_id", special[role]["id"])
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k not in getattr(plain, "_tied_weights_keys", {})]
    if missing or unexpected:
        raise ModelSourceError(f"{source.gguf_path}: state dict mismatch (missing {missing}, unexpected {unexpected})")
    if plain.generation_config is not None:
        for role in ("bos", "eos"):
            if role in special:
                setattr(plain.generation_config, f"{role}_token_id", special[role]["id"])
    with contextlib.suppress(FileExistsError), atomic_directory(target) as tmp:
        plain.save_pretrained(tmp)
    return target


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase, pad_token: str = "[PAD]") -> bool:
    """Give ``tokenizer`` a PAD token distinct from EOS, adding ``pad_token`` when needed.

    Huang et al. 2024, Detail 3: padding with EOS would mask the EOS out of the SFT loss
    and the model would never learn to stop.

    Returns:
        ``True`` when a token was added (the model's embeddings must then grow).

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token")
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return False
    tokenizer.add_special_tokens({"pad_token": pad_token})
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(f"PAD token {pad_token!r} maps to the EOS id {tokenizer.eos_token_id}")
    return True


#: The files of a hub or local source whose ``eos_token_id`` the tokenizer's EOS must be among.
EOS_FILES = ("generation_config.json", "config.json")


def _source_file(source: Source, name: str, revision: str | None) -> tuple[Path | None, str]:
    """File ``name`` of a hub or local source (``None`` where it has none) and how to name it:
    a hub file is fetched with ``huggingface_hub.hf_hub_download`` (from the local cache when
    offline; ``None`` where neither the repository nor the cache has it)."""
    if source.kind == "local":
        path = Path(source.location) / name
        return (path if path.is_file() else None), str(path)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    where = f"{source.location}/{name}" + (f" (revision {revision})" if revision else "")
    try:
        return Path(hf_hub_download(source.location, name, revision=revision)), where
    except EntryNotFoundError:  # not in the repository, or offline and not in the cache
        return None, where


def check_source_eos(tokenizer: PreTrainedTokenizerBase, source: Source, revision: str | None = None) -> None:
    """Check that the EOS id of ``tokenizer`` is among the ``eos_token_id`` (an int or a list)
    that each of :data:`EOS_FILES` of a hub or local ``source`` names, where it names one.
    GGUF sources are checked against their metadata instead (:func:`gguf_special_tokens`).

    Raises:
        ModelSourceError: a file names other ids; the message names the file, both ids and
            their tokens. Also an unreadable file.
    """
    eos_id = tokenizer.eos_token_id
    if source.kind not in ("hub", "local") or eos_id is None:  # no EOS: ensure_pad_token says so
        return
    for name in EOS_FILES:
        path, where = _source_file(source, name, revision)
        if path is None:
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as err:
            raise ModelSourceError(f"{where}: cannot read eos_token_id: {err}") from err
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if eos_id not in ids:
            named = ", ".join(f"{_token_at(tokenizer, i)!r} (id {i})" for i in ids)
            raise ModelSourceError(
                f"{where}: eos_token_id names {named}, but the tokenizer's EOS is {tokenizer.eos_token!r} "
                f"(id {eos_id}); a model trained with this tokenizer would end its text with another token"
            )


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """Load the tokenizer of ``cfg`` (hub, local or GGUF) with a PAD distinct from EOS.

    Padding side is ``right``; data processing pads queries on the left itself. A GGUF
    tokenizer's BOS, EOS, UNK and PAD are those of the GGUF metadata (:func:`_gguf_tokenizer`;
    PAD then replaced by :func:`ensure_pad_token` where it is EOS); a hub or local
    tokenizer's EOS must be one its source's ``generation_config.json`` and ``config.json``
    name (:func:`check_source_eos`).

    Raises:
        ModelSourceError: the source cannot be resolved, or its tokenizer's special tokens
            disagree with the GGUF metadata or the source's config files.
    """
    source = resolve_source(cfg.tokenizer_source)
    if source.kind == "gguf":
        tokenizer = _gguf_tokenizer(source)
    else:
        revision = cfg.revision if source.kind == "hub" else None
        tokenizer = AutoTokenizer.from_pretrained(
            source.location, revision=revision, clean_up_tokenization_spaces=False
        )
        check_source_eos(tokenizer, source, revision)
    tokenizer.padding_side = "right"
    ensure_pad_token(tokenizer, cfg.pad_token)
    return tokenizer


def disable_dropout(model: nn.Module) -> nn.Module:
    """Turn every dropout in ``model`` off, in place (Huang et al. 2024, Detail 7).

    Sets ``p = 0`` on ``nn.Dropout`` modules, and zeroes float attributes whose name
    contains ``dropout`` on every module and on ``model.config`` (Llama-style attention
    reads ``self.attention_dropout`` in its forward pass). PPO's ratio is then exactly 1
    on the first epoch, and two forward passes in train mode give identical logits.

    Returns:
        ``model`` itself.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for name, value in list(vars(config).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)
    return model


def build_random_model(tokenizer: PreTrainedTokenizerBase, cfg: RandomInitConfig) -> PreTrainedModel:
    """A tiny Llama-architecture causal LM with random weights, sized for ``tokenizer``.

    Weights depend only on ``cfg`` (including ``cfg.seed``) and ``len(tokenizer)``.
    Dropout is off.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    return disable_dropout(model)


def save_pretrained_atomic(
    model: PreTrainedModel, path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase | None = None
) -> Path:
    """``save_pretrained`` of ``model`` (and ``tokenizer``) into ``path``, replacing it atomically."""
    with atomic_directory(path, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(path)


def load_causal_lm(path: str | os.PathLike, dtype: str = "float32") -> PreTrainedModel:
    """Load a causal LM saved by :func:`import_base_model` (or any ``save_pretrained`` dir), dropout off."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    return disable_dropout(model)


def import_base_model(cfg: ModelConfig, out_dir: str | os.PathLike, overwrite: bool = False) -> dict:
    """Materialise the base model of ``cfg`` as a plain safetensors directory with its tokenizer.

    Loads from the hub, a local directory or a (cached, dequantised) GGUF file, or
    builds a tiny random model (``cfg.random_init``); grows the embeddings when a PAD
    token was added; turns dropout off; writes ``out_dir`` atomically with
    ``model.safetensors``, ``config.json``, the tokenizer files and ``import.json``.

    Returns:
        A small record: source, kind, parameter count, vocabulary size, PAD/EOS ids and
        the seconds taken.

    Raises:
        ModelSourceError: unresolvable source, or special tokens that disagree with the
            source (:func:`load_tokenizer`, :func:`check_source_eos` for a ``base`` other than
            the tokenizer's source). FileExistsError: ``out_dir`` exists and ``overwrite``
            is false.
    """
    start = time.perf_counter()
    tokenizer = load_tokenizer(cfg)
    if cfg.random_init is not None:
        kind = "random_init"
        model = build_random_model(tokenizer, cfg.random_init)
    else:
        source = resolve_source(cfg.base)  # type: ignore[arg-type]
        kind = source.kind
        if cfg.base != cfg.tokenizer_source:  # else load_tokenizer has checked it
            check_source_eos(tokenizer, source, cfg.revision if source.kind == "hub" else None)
        if source.kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(gguf_to_safetensors(source), dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                source.location, revision=cfg.revision if source.kind == "hub" else None, dtype=torch.float32
            )
    n_embeddings = model.get_input_embeddings().num_embeddings
    if n_embeddings < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    disable_dropout(model)
    model.to(DTYPES[cfg.dtype])
    info = {
        "source": cfg.base if cfg.random_init is None else f"random_init({cfg.tokenizer_source})",
        "kind": kind,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.get_input_embeddings().num_embeddings,
        "tokenizer_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "dtype": cfg.dtype,
    }
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / "import.json", info)  # what was imported; the time is returned, not stored
    return {**info, "seconds": round(time.perf_counter() - start, 3)}


# ---------------------------------------------------------------- padding-free forward


def padding_aware_inputs(
    query_responses: torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention mask and position ids that make left padding invisible (Detail 14).

    Args:
        query_responses: ``(batch, length)`` ids, PAD anywhere (left of the query, right of
            the response).

    Returns:
        ``(input_ids, attention_mask, position_ids)``, each ``(batch, length)``: PAD
        replaced by 0, mask 1 on real tokens, positions counting real tokens from 0.
    """
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return input_ids, attention_mask.long(), position_ids


@dataclass(frozen=True)
class CausalLayout:
    """Where the real tokens of a batch's rows are: what :func:`causal_forward` decides its call from.

    Attributes:
        contiguous: every row is one run of real tokens (PAD only before and after it).
        width: the columns ``fn`` is called with: the longest run (at least 1) rounded up to a
            multiple of ``width_multiple`` and capped at the batch's length.
        start: ``(batch,)`` long, the column of each row's first real token (the length for a
            row of PAD only).
        n_real: ``(batch,)`` long, each row's number of real tokens.
    """

    contiguous: bool
    width: int
    start: torch.Tensor
    n_real: torch.Tensor

    def to(self, device: torch.device | str) -> CausalLayout:
        """The same layout with its tensors on ``device``, copied without waiting for the copy
        (``non_blocking``): from the CPU the copy is queued behind the device's work, in order."""
        return CausalLayout(
            self.contiguous,
            self.width,
            self.start.to(device, non_blocking=True),
            self.n_real.to(device, non_blocking=True),
        )


def causal_layout(
    query_responses: torch.Tensor,
    pad_token_id: int,
    device: torch.device | str | None = None,
    width_multiple: int | None = None,
) -> CausalLayout:
    """The :class:`CausalLayout` of ``query_responses``, for a :func:`causal_forward` on ``device``.

    Reading ``contiguous`` and ``width`` makes the host wait for ``query_responses``' device;
    computed from a CPU copy before the ids move to a GPU, the layout costs the GPU no
    synchronisation, and its tensors are then copied to ``device`` (:meth:`CausalLayout.to`).

    Args:
        query_responses: ``(batch, length)`` token ids, on any device.
        device: where the forward pass runs, and where the returned tensors are
            (default: ``query_responses``' device).
        width_multiple: round the width up to a multiple of this (default: the
            ``width_multiple`` of ``device``, :func:`rlhf_core.training.device_tuning`; 1 on the
            CPU, which keeps the longest run's width).

    Raises:
        ValueError: ``width_multiple`` below 1.
    """
    device = query_responses.device if device is None else torch.device(device)
    multiple = device_tuning(device).width_multiple if width_multiple is None else width_multiple
    if multiple < 1:
        raise ValueError(f"width_multiple must be at least 1, not {multiple}")
    real = query_responses != pad_token_id
    length = query_responses.size(1)
    n_real = real.sum(1)
    start = first_true_indices(real)
    positions = torch.arange(length, device=query_responses.device)
    contiguous = bool((real == ((positions >= start[:, None]) & (positions < (start + n_real)[:, None]))).all())
    width = max(int(n_real.max()), 1) if len(n_real) else 1
    width = min(-(-width // multiple) * multiple, length)
    return CausalLayout(contiguous, width, start, n_real).to(device)


def causal_forward(
    fn: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor],
    query_responses: torch.Tensor,
    pad_token_id: int,
    layout: CausalLayout | None = None,
) -> torch.Tensor:
    """``fn(input_ids, attention_mask, position_ids)`` with padding invisible, at the cost of no mask.

    When every row is one contiguous run of real tokens (left-padded query, right-padded
    response: the layout of every batch in this project), each row is rotated so that its
    run starts at position 0, the PAD columns after the longest run are dropped, and ``fn``
    is called with ``attention_mask=None, position_ids=None``: the model then uses its plain
    causal attention (fused SDPA kernels, no ``(batch, 1, length, length)`` mask) and the
    default positions, which equal :func:`padding_aware_inputs`' positions on the rotated
    rows. Outputs are rotated back; at PAD positions they are 0. A row with a PAD between real
    tokens sends the whole batch through the mask of :func:`padding_aware_inputs` instead.
    Real positions get the same values as the masked call (Detail 14), up to kernel rounding.

    The width of the call is the layout's (:func:`causal_layout`): on a device whose
    ``width_multiple`` is above 1 (CUDA) the longest run rounded up, the extra columns token 0
    after every row's run, which causal attention keeps from every real position (their outputs
    are dropped). Pass ``layout``, computed from a CPU copy of the ids, to spare the host the
    wait for the device that deciding the call from device tensors costs.

    Args:
        fn: a model call returning ``(batch, width, ...)`` for ``(batch, width)`` inputs.
        query_responses: ``(batch, length)`` token ids.
        layout: :func:`causal_layout` of ``query_responses`` (any copy), its tensors on
            ``query_responses``' device; computed here when not given.

    Returns:
        ``(batch, length, ...)``, the output of ``fn`` with gradients flowing through it.
    """
    if layout is None:
        layout = causal_layout(query_responses, pad_token_id)
    if not layout.contiguous:
        return fn(*padding_aware_inputs(query_responses, pad_token_id))
    batch, length = query_responses.shape
    width, start, n_real = layout.width, layout.start, layout.n_real
    positions = torch.arange(width, device=query_responses.device)
    gather = (positions[None, :] + start[:, None]) % length  # (batch, width): rotated column -> original
    real = positions[None, :] < n_real[:, None]  # (batch, width)
    input_ids = torch.gather(query_responses, 1, gather).masked_fill(~real, 0)
    out = fn(input_ids, None, None)  # (batch, width, ...)
    rotated_back = out.new_zeros((batch, length, *out.shape[2:]))
    index = gather.view(batch, width, *([1] * (out.dim() - 2))).expand_as(out)
    keep = real.view(batch, width, *([1] * (out.dim() - 2)))
    return rotated_back.scatter(1, index, out * keep)


# ---------------------------------------------------------------- pairs sharing their query


def pair_layout(
    chosen: torch.Tensor, rejected: torch.Tensor, pad_token_id: int
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Where the rows of preference pairs end and how many first tokens each pair shares: what
    :func:`pair_forward`'s callers decide its split from.

    Args:
        chosen, rejected: ``(batch, length)`` token ids of the same queries.

    Returns:
        ``(right_padded, last, common)``: whether every row is its tokens followed only by PAD;
        ``(batch, 2)`` long, the index of each row's last token before its first PAD
        (``[:, 0]`` chosen, ``[:, 1]`` rejected; ``-1`` for a row that starts with PAD);
        ``(batch,)`` long, the number of first tokens the two rows share, PAD excluded.
    """
    rows = torch.stack([chosen, rejected], 1)  # (batch, 2, length)
    last = first_true_indices((rows == pad_token_id).flatten(0, 1)).view(-1, 2) - 1
    positions = torch.arange(chosen.size(1), device=chosen.device)
    right_padded = bool(((rows != pad_token_id) == (positions < (last + 1)[..., None])).all())
    common = first_true_indices((chosen != rejected) | (chosen == pad_token_id))
    return right_padded, last, common


def pair_forward(
    backbone: nn.Module, chosen: torch.Tensor, rejected: torch.Tensor, prefix: torch.Tensor, ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backbone's hidden states of a pair's two rows, running the tokens they share once.

    A causal model's hidden state at a token depends only on the tokens before it, so tokens
    that two rows share from their start (a pair's query) give both the same keys and values.
    The first ``prefix[i]`` tokens of pair ``i`` run once, with plain causal attention; each
    row's tokens from there up to (not including) its end then run against that prefix's
    key/value cache, the pair's two rows side by side. Used by the reward model's
    :func:`rlhf_core.reward.pair_scores` and DPO's :func:`rlhf_core.dpo.pair_logprobs`; the
    caller checks that the rows share their first ``prefix`` tokens and that the backbone can
    build a cache (no activation checkpointing in training).

    Args:
        backbone: a transformers decoder (``model.base_model``).
        chosen, rejected: ``(batch, length)`` token ids.
        prefix: ``(batch,)`` long, the shared tokens to run once, at least 1 somewhere.
        ends: ``(batch, 2)`` long, the exclusive end position of each row's second pass, each
            above ``prefix``: ``ends[:, 0]`` for ``chosen``, ``ends[:, 1]`` for ``rejected``.

    Returns:
        ``(hidden, positions, valid)``: hidden states ``(2 * batch, width, d_model)`` of rows
        ``chosen_0, rejected_0, chosen_1, ...``, each at the positions ``(2 * batch, width)``
        from its pair's ``prefix`` on; ``valid`` ``(2 * batch, width)`` bool marks the
        positions before the row's end (the others hold position 0 and are to be ignored).
    """
    batch, length = chosen.shape
    device = chosen.device
    width = int(prefix.max())
    prefix_out = backbone(input_ids=chosen[:, :width], use_cache=True)
    # transformers >= 5.2x names the key/value cache `cache`; `past_key_values` before (removed in 5.40)
    new_name = "cache" in inspect.signature(backbone.forward).parameters
    cache = prefix_out.cache if new_name else prefix_out.past_key_values
    cache.batch_repeat_interleave(2)  # rows (chosen_0, rejected_0, chosen_1, ...)
    rows = torch.stack([chosen, rejected], 1).reshape(2 * batch, length)
    start = prefix.repeat_interleave(2)  # (2 * batch,)
    n_suffix = ends.reshape(-1) - start  # (2 * batch,), each >= 1
    offsets = torch.arange(int(n_suffix.max()), device=device)
    valid = offsets < n_suffix[:, None]
    positions = (start[:, None] + offsets).masked_fill(~valid, 0)
    input_ids = torch.gather(rows, 1, positions).masked_fill(~valid, 0)
    attention_mask = torch.cat([torch.arange(width, device=device) < start[:, None], valid], 1).long()
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        **{"cache" if new_name else "past_key_values": cache},
    ).last_hidden_state
    return hidden, positions, valid
