"""How far a trained policy's words moved from the base model's: the rank of each summary token
under the base model (Huang et al. 2024, arXiv:2403.17031, Table 8), shown as coloured tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config.settings import EvalConfig
from ..metrics.text import token_ranks
from ..models.saved import load_causal_lm
from ..train.generation import Summaries, trim_left_padding
from ..views.html import token_shift_html

#: The policies whose summaries are shown, by their report labels.
LABELS = {"sft": "SFT", "ppo": "PPO", "dpo": "DPO"}


@torch.no_grad()
def response_token_ranks(model, queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int) -> list[list[int]]:
    """Rank of each response token under ``model`` (1 = its top prediction), per row
    (Huang et al. 2024, Table 8). PAD positions are left out.

    Args:
        queries: ``(n, query_length)`` left-padded; responses: ``(n, response_length)``.

    Returns:
        ``n`` lists of ranks, one per non-PAD response token.
    """
    device = next(model.parameters()).device
    ranks = []
    for i in range(len(queries)):
        q = trim_left_padding(queries[i : i + 1], pad_token_id)
        r = responses[i : i + 1]
        keep = int((r[0] != pad_token_id).sum())
        if keep == 0:
            ranks.append([])
            continue
        seq = torch.cat([q, r[:, :keep]], dim=1).to(device)
        logits = model(input_ids=seq).logits[0, q.size(1) - 1 : q.size(1) - 1 + keep].float().cpu()
        ranks.append(token_ranks(logits, r[0, :keep]).tolist())
    return ranks


def token_shift_blocks(
    base_model_dir: Path,
    tokenizer,
    queries: torch.Tensor,
    summaries: dict[str, Summaries],
    ecfg: EvalConfig,
    device: torch.device,
) -> list[str]:
    """HTML blocks of the first ``eval.token_shift_samples`` SFT, PPO and DPO summaries, each
    token coloured by its rank under the base model (Table 8).

    Args:
        queries: ``(n, query_length)`` long, left-padded: the evaluation prompts.
        summaries: the policies' summaries of them (:func:`rlhf_core.train.generation.summarize`).
    """
    m = min(ecfg.token_shift_samples, len(queries))
    blocks: list[str] = []
    if not m:
        return blocks
    base = load_causal_lm(base_model_dir).to(device)
    for key in LABELS:
        ranks = response_token_ranks(base, queries[:m], summaries[key].responses[:m], tokenizer.pad_token_id)
        for i in range(m):
            tokens = [tokenizer.decode([t]) for t in summaries[key].responses[i, : len(ranks[i])].tolist()]
            blocks.append(f"<h4>{LABELS[key]}, post {i + 1}</h4>" + token_shift_html(tokens, ranks[i]))
    base = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return blocks
