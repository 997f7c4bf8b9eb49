import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rlhf_core.common.tracking import JsonlTracker, read_metrics
from rlhf_core.config.presets import load_config
from rlhf_core.metrics.text import rouge_l
from rlhf_core.models.base import build_random_model
from rlhf_core.train.chunked_head import linear_cross_entropy_sum
from rlhf_core.train.forward import causal_forward, causal_layout
from rlhf_core.train.sft import (
    make_loss_mask,
    masked_token_loss,
    run_sft,
    sft_batch,
    sft_batch_loss_sum,
    sft_loss_sum,
)
from rlhf_core.train.training import micro_batches, native_bf16, row_order
from tests.conftest import tiny_random_init
from tests.stages import kill_then_resume

PAD, EOS = 0, 9
TINY = tiny_random_init()


def test_loss_mask_keeps_eos_and_drops_pad():
    ids = torch.tensor([[3, 4, 5, 6, EOS, PAD, PAD], [3, 4, 5, 6, 7, 8, EOS]])
    mask = make_loss_mask(ids, PAD)
    assert mask.tolist() == [[True] * 5 + [False] * 2, [True] * 7]
    response_only = make_loss_mask(ids, PAD, torch.tensor([3, 2]))
    assert response_only.tolist() == [[False] * 3 + [True] * 2 + [False] * 2, [False] * 2 + [True] * 5]


def test_masked_token_loss_is_cross_entropy_on_targets_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.tensor([[1, 2, EOS, PAD, PAD], [1, 2, 3, 4, EOS]])
    mask = make_loss_mask(ids, PAD)
    total, n = masked_token_loss(logits, ids, mask)
    manual = [
        F.cross_entropy(logits[b, t - 1][None], ids[b, t][None]) for b in range(2) for t in range(1, 5) if mask[b, t]
    ]
    assert n == len(manual) == 6
    torch.testing.assert_close(total, torch.stack(manual).sum())
    # what the model predicts at padding does not matter
    logits2 = logits.clone()
    logits2[0, 2:] = 100.0
    torch.testing.assert_close(masked_token_loss(logits2, ids, mask)[0], total)


def test_sft_loss_sum_matches_full_logits(smol_tokenizer):
    tok = smol_tokenizer
    model = build_random_model(tok, TINY)
    rows = [
        tok("SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: some post\n\nTL;DR:")["input_ids"] + [tok.eos_token_id],
        tok("SUBREDDIT: r/b\n\nTITLE: t\n\nPOST: x\n\nTL;DR: y")["input_ids"] + [tok.eos_token_id],
    ]
    width = max(map(len, rows)) + 3
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    mask = make_loss_mask(ids, tok.pad_token_id)
    fast, n_fast = sft_loss_sum(model, ids, mask, tok.pad_token_id)
    logits = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits
    full, n_full = masked_token_loss(logits, ids, mask)
    assert n_fast == n_full == sum(len(r) - 1 for r in rows)
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-4)


def _sft_rows(tok) -> torch.Tensor:
    rows = [
        tok("SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: some post\n\nTL;DR:")["input_ids"] + [tok.eos_token_id],
        tok("SUBREDDIT: r/b\n\nTITLE: t\n\nPOST: x\n\nTL;DR: y")["input_ids"] + [tok.eos_token_id],
        tok("SUBREDDIT: r/c\n\nTITLE: a title\n\nPOST: a longer post than the others\n\nTL;DR:")["input_ids"],
    ]
    width = max(map(len, rows)) + 9
    return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])


def _loss_and_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("response_only", [False, True])
def test_sft_batch_from_the_host_equals_the_boolean_mask_path_bit_for_bit(smol_tokenizer, response_only):
    """The loss of a batch worked out on the host (layout, target positions, targets, count)
    equals, with every gradient, the former path that read them from the device's tensors with
    boolean masks: SFT's CPU figures do not move."""
    tok, pad = smol_tokenizer, smol_tokenizer.pad_token_id
    model = build_random_model(tok, TINY)
    ids = _sft_rows(tok)
    mask = make_loss_mask(ids, pad, torch.tensor([5, 7, 9]) if response_only else None)

    def boolean_mask_path():
        hidden = causal_forward(
            lambda i, m, p: model.base_model(input_ids=i, attention_mask=m, position_ids=p).last_hidden_state, ids, pad
        )
        target_mask = mask[:, 1:]
        head = model.get_output_embeddings()
        return linear_cross_entropy_sum(hidden[:, :-1][target_mask], head.weight, ids[:, 1:][target_mask])

    batch = sft_batch(ids, mask, pad, torch.device("cpu"))
    assert batch.n_targets == int(mask[:, 1:].sum()) and batch.targets.shape == (batch.n_targets,)
    assert batch.layout.width == int((ids != pad).sum(1).max())  # the CPU's width: the longest row
    want_loss, want_grads = _loss_and_grads(model, boolean_mask_path())
    got_loss, got_grads = _loss_and_grads(model, sft_batch_loss_sum(model, batch))
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    loss, n = sft_loss_sum(model, ids, mask, pad)  # the same, from the ids alone
    assert torch.equal(loss.detach(), want_loss) and n == batch.n_targets


def test_sft_loss_with_a_rounded_width_equals_the_longest_row_width(smol_tokenizer):
    """CUDA rounds the backbone's width up (PAD-as-0 columns after every row): the SFT loss and
    its gradients are those of the longest row's width."""
    tok, pad = smol_tokenizer, smol_tokenizer.pad_token_id
    model = build_random_model(tok, TINY)
    ids = _sft_rows(tok)
    batch = sft_batch(ids, make_loss_mask(ids, pad), pad)
    rounded = dataclasses.replace(batch, layout=causal_layout(ids, pad, width_multiple=12))
    assert rounded.layout.width > batch.layout.width
    want_loss, want_grads = _loss_and_grads(model, sft_batch_loss_sum(model, batch))
    got_loss, got_grads = _loss_and_grads(model, sft_batch_loss_sum(model, rounded))
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_rouge_l():
    assert rouge_l(["the cat sat"], ["the cat sat"]) == [1.0]
    assert rouge_l(["dogs bark"], ["the cat sat"]) == [0.0]
    assert 0 < rouge_l(["the cat ran"], ["the cat sat"])[0] < 1


@pytest.fixture(scope="module")
def smoke_inputs(smoke_stages):
    return load_config("smoke"), smoke_stages


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_non_finite_loss_stops_with_the_step_named_and_the_last_good_state_saved(smoke_inputs, tmp_path):
    """train_loop (SFT and the reward model): a NaN loss raises TrainingError naming the stage
    and step, after a checkpoint of the parameters before it; no model is written."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.train.training import TrainingError

    cfg, root = smoke_inputs
    broken = AutoModelForCausalLM.from_pretrained(root / "base")
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("nan"))
    broken.save_pretrained(tmp_path / "broken")
    with pytest.raises(TrainingError, match=r"sft: non-finite loss nan at step 1; last good state saved in "):
        run_sft(cfg.sft.model_copy(update={"max_steps": 2}), root / "data", tmp_path / "broken", tmp_path / "sft")
    state = torch.load(tmp_path / "sft" / "checkpoints" / "step-000000" / "state.pt", weights_only=False)
    assert state["step"] == 0
    assert not (tmp_path / "sft" / "model").exists()


def test_gradient_accumulation_equals_one_big_batch(smoke_inputs, tmp_path):
    cfg, root = smoke_inputs
    # float32 on every machine: accumulation sums the same float32 products in another order
    base = cfg.sft.model_copy(update={"max_steps": 1, "eval_max_samples": 1, "bf16": False})
    run_sft(base.model_copy(update={"micro_batch_size": 8}), root / "data", root / "base", tmp_path / "big")
    run_sft(base.model_copy(update={"micro_batch_size": 2}), root / "data", root / "base", tmp_path / "small")
    big, small = _weights(tmp_path / "big" / "model"), _weights(tmp_path / "small" / "model")
    init = _weights(root / "base")
    assert any(not torch.equal(big[k], init[k]) for k in big)
    for k in big:
        torch.testing.assert_close(big[k], small[k], rtol=1e-4, atol=1e-6)


def test_sft_stage_learns_and_reports(smoke_inputs, tmp_path):
    cfg, root = smoke_inputs
    sft_cfg = cfg.sft.model_copy(update={"max_steps": 6, "batch_size": 4, "micro_batch_size": 4, "eval_max_samples": 4})
    metrics = run_sft(
        sft_cfg, root / "data", root / "base", tmp_path / "sft", tracker=JsonlTracker(tmp_path / "m.jsonl")
    )
    losses = [m["train/loss"] for _, m in read_metrics(tmp_path / "m.jsonl") if "train/loss" in m]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert 0.0 <= metrics["eval/rougeL"] <= 1.0 and 0.0 <= metrics["eval/rougeL_base"] <= 1.0
    assert metrics["eval/samples"] == 4
    samples = [json.loads(line) for line in (tmp_path / "sft" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and set(samples[0]) >= {"post", "reference", "base", "sft"}
    max_new = json.loads((root / "data" / "stats.json").read_text())["padded_lengths"]["sft_response"]
    for policy, suffix in (("sft", ""), ("base", "_base")):  # EOS rate and length of the greedy summaries
        assert metrics[f"eval/eos_rate{suffix}"] == sum(s[f"has_eos_{policy}"] for s in samples) / 4
        assert metrics[f"eval/response_length{suffix}"] == sum(s[f"length_{policy}"] for s in samples) / 4
        assert all(1 <= s[f"length_{policy}"] <= max_new for s in samples)
        # a summary that ends before the response length ends with EOS
        assert all(s[f"has_eos_{policy}"] for s in samples if s[f"length_{policy}"] < max_new)
    logged = [m for _, m in read_metrics(tmp_path / "m.jsonl") if "eval/eos_rate" in m]
    assert logged and logged[-1]["eval/eos_rate_base"] == metrics["eval/eos_rate_base"]
    assert json.loads((tmp_path / "sft" / "metrics.json").read_text()) == metrics
    assert (tmp_path / "sft" / "model" / "tokenizer_config.json").is_file()
    # bf16: auto, resolved for this machine and logged with the settings
    params = [
        json.loads(line)["params"]
        for line in (tmp_path / "m.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "params"
    ]
    assert params and params[0]["sft.bf16"] == "auto"
    assert params[0]["sft.precision"] == ("bf16-autocast" if native_bf16(torch.device("cpu")) else "float32")


def test_response_only_loss_option(smoke_inputs, tmp_path):
    cfg, root = smoke_inputs
    common = {"max_steps": 1, "eval_max_samples": 1}
    a = run_sft(cfg.sft.model_copy(update=common), root / "data", root / "base", tmp_path / "seq")
    b = run_sft(
        cfg.sft.model_copy(update={**common, "loss_on": "response"}), root / "data", root / "base", tmp_path / "resp"
    )
    assert a["train/loss"] != b["train/loss"]


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    """Kill `rlhf sft` with SIGKILL after a mid-stage checkpoint; the resumed run ends with identical
    weights. Three epochs of two steps over 8 rows: the checkpoint is that of step 2, the last of
    the first epoch, and the resumed run goes on into the second (verl #7401)."""
    overrides = [
        "data.sft_splits.train.max_rows=8",
        "sft.num_epochs=3",
        "sft.batch_size=4",
        "sft.micro_batch_size=2",
        "sft.checkpoint_every=2",
        "sft.eval_max_samples=1",
    ]
    logs = kill_then_resume("sft", "sft", overrides, tmp_path)
    killed_dir, clean_dir = tmp_path / "killed", tmp_path / "clean"
    assert "stage data: finished earlier with the same config and code, reused" in logs["killed"]
    resumed, clean = _weights(killed_dir / "sft" / "model"), _weights(clean_dir / "sft" / "model")
    assert resumed.keys() == clean.keys()
    for k in clean:
        assert torch.equal(resumed[k], clean[k]), k

    # Steps after the checkpoint were run again after the kill: the file keeps both attempts'
    # records, and its reader returns each step once, with the resumed attempt's values, equal
    # to the uninterrupted run's.
    def losses(out: Path) -> list[tuple[int, float]]:
        return [(s, m["train/loss"]) for s, m in read_metrics(out / "sft" / "metrics.jsonl") if "train/loss" in m]

    assert losses(killed_dir) == losses(clean_dir) and [s for s, _ in losses(clean_dir)] == [1, 2, 3, 4, 5, 6]
    raw = [json.loads(line) for line in (killed_dir / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert {"resume/from_step": 2.0} in [r.get("metrics") for r in raw]


def test_sft_micro_batches_grouped_by_length_pad_less_for_the_same_loss_and_gradients(smol_tokenizer):
    """The order CUDA runs a global batch in (rows by length, :func:`row_order`): fewer PAD
    columns through the backbone, and the same summed loss and gradients as the drawn order."""
    tok, pad = smol_tokenizer, smol_tokenizer.pad_token_id
    model = build_random_model(tok, TINY)
    short = tok("SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: x\n\nTL;DR: y")["input_ids"] + [tok.eos_token_id]
    long = tok("SUBREDDIT: r/c\n\nTITLE: a title\n\nPOST: " + "a longer post " * 6 + "\n\nTL;DR: z")["input_ids"]
    rows = [long, short, long[:-3], short[:-1]]
    width = max(map(len, rows)) + 4
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = make_loss_mask(ids, pad)

    def run(order):
        loss, columns = 0.0, 0
        for mb in micro_batches(order, 2):
            batch = sft_batch(ids[mb], mask[mb], pad)
            loss = loss + sft_batch_loss_sum(model, batch)
            columns += batch.layout.width * len(mb)
        return (*_loss_and_grads(model, loss), columns)

    grouped = row_order((ids != pad).sum(1), "cpu", group=True)
    assert grouped == [3, 1, 2, 0]
    want_loss, want_grads, drawn_columns = run(list(range(4)))
    got_loss, got_grads, grouped_columns = run(grouped)
    assert grouped_columns < drawn_columns
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
