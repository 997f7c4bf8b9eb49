"""A local causal LM as judge, for runs without network."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...config.settings import ModelConfig
from ...models.saved import load_causal_lm
from ...models.tokenizers import load_tokenizer
from ...train.training import Precision, autocast, resolve_bf16


def judge_digest(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> str:
    """``sha256:<hex>`` of what decides a local judge's answers: every tensor of the model's
    ``state_dict`` (name, dtype, shape, bytes) and the tokenizer's vocabulary, special tokens
    and chat template."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name} {flat.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(flat.view(torch.uint8).numpy())
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(tokenizer.all_special_tokens)
    digest.update(json.dumps([vocab, special, getattr(tokenizer, "chat_template", None)]).encode())
    return f"sha256:{digest.hexdigest()}"


class OfflineJudge:
    """A local causal LM as judge: A or B by the next-token probabilities after ``Preferred:``.

    The prompt is the same :data:`JUDGE_PROMPT`. With a chat template, it is the user turn
    (``apply_chat_template(..., add_generation_prompt=True)``) and the assistant turn
    starts with ``Preferred:``; without one, the model reads ``prompt + "\\n\\nPreferred:"``
    (with the tokenizer's special tokens). At the next position the log-probability of a
    letter is the log-sum-exp of those of its two single tokens, with and without a
    leading space (``" A"`` and ``"A"``; ``" B"`` and ``"B"``), so both tokenisation styles
    count. The larger one wins (A on an exact tie). The answer reads, e.g.::

        Comparison: offline judge NAME: log p(A)=-3.210412, log p(B)=-3.662037, p(A)=0.6110
        Preferred: A

    so :func:`parse_preference` and the cache treat it like any judge's answer, and
    :func:`rlhf_core.evaluation.judging.prompt.parse_letter_logprobs` reads both log-probabilities back
    (to combine two orders: :attr:`rlhf_core.evaluation.judging.Judgement.outcome`). The judge
    is deterministic and not thread-safe (``thread_safe = False``).

    Args:
        model: a causal LM; it is put in eval mode and used on its own device.
        tokenizer: its tokenizer.
        name: the judge's name, shown. With bf16 autocast in effect, `` (bf16)`` is
            appended. Its ``identity``, which keys the judgement cache, is the name and
            :func:`judge_digest` of the model and tokenizer: a judge retrained or re-imported
            under the same name shares no cached answer with the one before.
        batch_size: prompts per forward pass in :meth:`answer_batch`.
        bf16: the forward pass under bf16 autocast: true, false or ``"auto"`` (where the
            hardware computes bf16 natively: :func:`rlhf_core.train.training.resolve_bf16`).

    Raises:
        ValueError: a letter variant is not a single token of ``tokenizer``.
    """

    thread_safe = False

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        batch_size: int = 4,
        bf16: Precision = False,
    ):
        if not name:
            raise ValueError("OfflineJudge needs a name")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.bf16 = resolve_bf16(bf16, next(self.model.parameters()).device)
        self.name = f"{name} (bf16)" if self.bf16 else name
        self.identity = f"{self.name} {judge_digest(self.model, tokenizer)}"
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
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        name: str | None = None,
        dtype: str = "float32",
        device: str | torch.device | None = None,
        batch_size: int = 4,
        bf16: Precision = False,
    ) -> OfflineJudge:
        """Load a model directory (``save_pretrained`` layout with its tokenizer) as a judge.

        Uses :func:`rlhf_core.models.saved.load_causal_lm` and :func:`rlhf_core.models.tokenizers.load_tokenizer`.
        ``name`` defaults to ``offline:<absolute path>``.
        """
        path = Path(path)
        model = load_causal_lm(path, dtype)
        if device is not None:
            model.to(device)
        tokenizer = load_tokenizer(ModelConfig(base=str(path.resolve())))
        return cls(model, tokenizer, name or f"offline:{path.resolve()}", batch_size=batch_size, bf16=bf16)

    def __repr__(self) -> str:
        return f"OfflineJudge(name={self.name!r}, letters={self.letter_token_ids})"

    def encode(self, prompt: str) -> list[int]:
        """Token ids the model reads for ``prompt``, ending with ``Preferred:``.

        Raises:
            ValueError: longer than the model's ``max_position_embeddings``.
        """
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
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
            with autocast(device, self.bf16):
                logits = self.model(
                    input_ids=input_ids.to(device),
                    attention_mask=mask.to(device),
                    position_ids=positions.to(device),
                    logits_to_keep=1,
                ).logits[:, -1]
            logp = torch.log_softmax(logits.double(), dim=-1)
            out.append(torch.stack([logp[:, ids_a].logsumexp(-1), logp[:, ids_b].logsumexp(-1)], dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros((0, 2), dtype=torch.float64)

    def _format(self, lp_a: float, lp_b: float) -> str:
        p_a = 1.0 / (1.0 + math.exp(lp_b - lp_a))
        choice = "A" if lp_a >= lp_b else "B"
        return (
            f"Comparison: offline judge {self.name}: log p(A)={lp_a:.6f}, log p(B)={lp_b:.6f}, p(A)={p_a:.4f}\n"
            f"Preferred: {choice}"
        )

    def answer(self, prompt: str) -> str:
        """The answer to one prompt (see the class docstring for its format)."""
        return self.answer_batch([prompt])[0]

    def answer_batch(self, prompts: Sequence[str]) -> list[str]:
        """Answers to several prompts, :attr:`batch_size` per forward pass."""
        return [self._format(float(a), float(b)) for a, b in self.letter_logprobs(list(prompts)).tolist()]
