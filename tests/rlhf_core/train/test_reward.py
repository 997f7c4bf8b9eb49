import json
import math

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_core.config.presets import load_config
from rlhf_core.data.prepared import load_prepared
from rlhf_core.evaluation.reward_eval import evaluate_reward_model
from rlhf_core.train.forward import causal_forward, padding_aware_inputs
from rlhf_core.train.generation import first_true_indices
from rlhf_core.train.reward import (
    ScalarModel,
    get_reward,
    init_head,
    normalize_reward_model,
    pair_scores,
    preference_loss,
    response_reward_logits,
    reward_model_from_causal_lm,
    run_reward_training,
    score_responses,
)
from rlhf_core.train.training import TrainingError


@pytest.fixture(scope="module")
def smoke(smoke_stages):
    sft, pref, stats = load_prepared(smoke_stages / "data")
    return load_config("smoke"), smoke_stages, sft, pref, stats


def test_head_initialisation_statistics():
    """Detail 11: weights ~ N(0, 1/sqrt(d_model + 1)), bias 0."""
    d = 4096
    head = nn.Linear(d, 1)
    init_head(head, d, torch.Generator().manual_seed(0))
    std = head.weight.std().item()
    assert abs(std - 1 / math.sqrt(d + 1)) < 0.03 / math.sqrt(d + 1)
    assert abs(head.weight.mean().item()) < 3 / math.sqrt(d) / math.sqrt(d + 1)
    assert head.bias.item() == 0.0


def test_reward_model_starts_from_the_causal_lm_backbone(smoke):
    cfg, root, *_ = smoke
    rm = reward_model_from_causal_lm(root / "base", seed=3)
    lm = AutoModelForCausalLM.from_pretrained(root / "base")
    lm_params = dict(lm.base_model.named_parameters())
    for name, p in rm.backbone.named_parameters():
        assert torch.equal(p, lm_params[name]), name
    assert rm.head.bias.item() == 0.0
    assert not hasattr(rm, "lm_head")


def test_reward_is_read_at_the_eos(smoke):
    """Detail 12: the score is the head output at the token before the first PAD."""
    cfg, root, sft, _, stats = smoke
    pad = stats["tokenizer"]["pad_token_id"]
    rm = reward_model_from_causal_lm(root / "base").eval()
    rows = torch.tensor(sft["train"]["query_reference_response_token"][:4])
    with torch.no_grad():
        logits, scores, lengths = get_reward(rm, rows, pad)
    for i in range(4):
        n_real = int((rows[i] != pad).sum())
        assert lengths[i] == n_real - 1
        assert rows[i, lengths[i]] == stats["tokenizer"]["eos_token_id"]
        assert scores[i] == logits[i, n_real - 1]
        with torch.no_grad():  # the same as scoring the unpadded sequence alone
            alone = rm(input_ids=rows[i : i + 1, :n_real], attention_mask=torch.ones(1, n_real, dtype=torch.long))
        torch.testing.assert_close(scores[i], alone[0, -1], rtol=1e-4, atol=1e-5)
    no_pad = rows[:1, : int((rows[0] != pad).sum()) - 3]  # cut before the EOS: no PAD left
    with torch.no_grad():
        _, _, lengths = get_reward(rm, no_pad, pad)
    assert lengths.item() == no_pad.size(1) - 1


def test_left_and_right_padding_give_the_same_reward(smoke):
    """Detail 14: left-padded query + right-padded response scores as the right-padded sequence."""
    cfg, root, sft, _, stats = smoke
    pad = stats["tokenizer"]["pad_token_id"]
    rm = reward_model_from_causal_lm(root / "base").eval()
    ds = sft["train"].select(range(6))
    right = torch.tensor(ds["query_reference_response_token"])
    left = torch.cat([torch.tensor(ds["query_token"]), torch.tensor(ds["reference_response_token"])], dim=1)
    assert (left[:, 0] == pad).any()  # really left-padded
    with torch.no_grad():
        _, right_scores, _ = get_reward(rm, right, pad)
        _, left_scores, left_lengths = get_reward(rm, left, pad, context_length=len(ds[0]["query_token"]))
    assert (left[torch.arange(6), left_lengths] == stats["tokenizer"]["eos_token_id"]).all()
    torch.testing.assert_close(left_scores, right_scores, rtol=1e-4, atol=1e-5)


def test_causal_forward_equals_the_padding_aware_mask_with_gradients(smoke):
    """The unmasked, rotated call gives the masked call's values and gradients at real tokens."""
    cfg, root, sft, _, stats = smoke
    pad = stats["tokenizer"]["pad_token_id"]
    rm = reward_model_from_causal_lm(root / "base").eval()
    ds = sft["train"].select(range(4))
    rows = torch.cat([torch.tensor(ds["query_token"]), torch.tensor(ds["reference_response_token"])], dim=1)
    real = rows != pad
    assert (rows[:, 0] == pad).any() and (rows[:, -1] == pad).any()  # left and right padding

    def call(ids, mask, pos):
        return rm(input_ids=ids, attention_mask=mask, position_ids=pos)

    calls = []

    def recording(ids, mask, pos):
        calls.append((ids.shape, mask))
        return call(ids, mask, pos)

    fast = causal_forward(recording, rows, pad)
    assert calls[0][1] is None and calls[0][0][1] == int(real.sum(1).max()) < rows.size(1)  # no mask, PAD columns cut
    masked = call(*padding_aware_inputs(rows, pad))
    assert fast.shape == masked.shape
    torch.testing.assert_close(fast[real], masked[real], rtol=1e-4, atol=1e-4)
    assert (fast[~real] == 0).all()
    weights = torch.randn(rows.shape, generator=torch.Generator().manual_seed(0)) * real
    (grad_fast,) = torch.autograd.grad((fast * weights).sum(), rm.head.weight)
    (grad_masked,) = torch.autograd.grad((masked * weights).sum(), rm.head.weight)
    torch.testing.assert_close(grad_fast, grad_masked, rtol=1e-3, atol=1e-4)

    holed = rows.clone()  # a PAD between real tokens: the whole batch takes the masked path
    first = int(real[0].nonzero()[0])
    holed[0, first + 2] = pad
    calls.clear()
    with torch.no_grad():
        out = causal_forward(recording, holed, pad)
        expected = call(*padding_aware_inputs(holed, pad))
    assert calls[0][1] is not None
    torch.testing.assert_close(out, expected)


def test_pair_scores_run_the_query_once_and_equal_get_reward(smoke):
    """Shared-prefix scoring: the same scores and gradients as scoring both rows in full."""
    cfg, root, _, pref, stats = smoke
    pad = stats["tokenizer"]["pad_token_id"]
    rm = reward_model_from_causal_lm(root / "base", seed=1)
    rows = pref["train"].select(range(4))
    chosen, rejected = torch.tensor(rows["query_chosen_token"]), torch.tensor(rows["query_rejected_token"])
    rejected[3] = chosen[3]  # identical responses: only the EOS is left for the second pass
    widths = []
    hook = rm.backbone.register_forward_hook(
        lambda module, args, kwargs, out: widths.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    c, r = pair_scores(rm, chosen, rejected, pad)
    hook.remove()
    query_length = int(first_true_indices(chosen[0] != rejected[0]))
    assert widths[0][0] == 4 and widths[0][1] >= query_length  # the prefix once per pair
    assert widths[1][0] == 8 and widths[1][1] < chosen.size(1) - query_length  # then both responses
    _, full, _ = get_reward(rm, torch.cat([chosen, rejected]), pad)
    torch.testing.assert_close(c, full[:4], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r, full[4:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c[3], r[3])
    params = [rm.backbone.get_input_embeddings().weight, rm.head.weight]
    grads = torch.autograd.grad(preference_loss(c, r).sum(), params)
    expected = torch.autograd.grad(preference_loss(full[:4], full[4:]).sum(), params)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


def test_preference_loss():
    loss = preference_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(loss, torch.tensor([math.log(1 + math.exp(-1)), math.log(2)]))


@pytest.mark.heavy
def test_training_normalisation_and_evaluation(smoke, tmp_path):
    cfg, root, sft, _, stats = smoke
    pad = stats["tokenizer"]["pad_token_id"]
    rm_cfg = cfg.reward.model_copy(update={"bf16": False})  # float32, as the direct passes below
    # SFT output is any causal LM directory; the base model stands in for it here
    train = run_reward_training(rm_cfg, root / "data", root / "base", tmp_path / "rm")
    assert train["train/steps"] == 4 and math.isfinite(train["train/loss"])
    trained = ScalarModel.from_pretrained(tmp_path / "rm" / "model")
    assert trained.head.weight.abs().sum() > 0

    norm = normalize_reward_model(rm_cfg, root / "data", tmp_path / "rm" / "model", tmp_path / "norm")
    # right-padded query+reference rows, the reward model's training layout (Detail 14)
    seqs = torch.tensor(sft[rm_cfg.normalization_split]["query_reference_response_token"])
    after_model = ScalarModel.from_pretrained(tmp_path / "norm" / "model")
    with torch.no_grad():
        before, after = (get_reward(model, seqs, pad)[1] for model in (trained, after_model))
    assert norm["normalization/mean_before"] == pytest.approx(before.double().mean().item(), abs=1e-5)
    assert abs(after.double().mean().item()) < 1e-3 and abs(norm["normalization/mean_after"]) < 1e-3
    assert after_model.head.bias.item() == pytest.approx(
        trained.head.bias.item() - norm["normalization/mean_before"], abs=1e-5
    )
    assert after_model.config.normalization_mean == pytest.approx(norm["normalization/mean_before"])

    metrics = evaluate_reward_model(rm_cfg, root / "data", tmp_path / "norm" / "model", tmp_path / "eval")
    assert 0 <= metrics["eval/accuracy"] <= 1
    assert "eval/accuracy/batch/batch18" in metrics and "eval/validation_cnndm/accuracy" in metrics
    assert any(k.startswith("eval/accuracy/confidence/") for k in metrics)
    assert any(k.startswith("eval/accuracy/split/valid") for k in metrics)
    expected = min(len(smoke[3]["validation"]), rm_cfg.eval_max_samples)
    assert metrics["eval/count"] == expected == 8
    # the shared-query evaluation pass scores each pair as a full forward pass of each row does
    rows = smoke[3]["validation"].select(range(expected))
    with torch.no_grad():
        _, c, _ = get_reward(after_model, torch.tensor(rows["query_chosen_token"]), pad)
        _, r, _ = get_reward(after_model, torch.tensor(rows["query_rejected_token"]), pad)
    assert metrics["eval/accuracy"] == pytest.approx((c > r).float().mean().item())
    assert metrics["eval/reward/chosen/mean"] == pytest.approx(c.mean().item(), abs=1e-4)
    assert metrics["eval/accuracy_ci_low"] < metrics["eval/accuracy"] < metrics["eval/accuracy_ci_high"] or metrics[
        "eval/accuracy"
    ] in (0.0, 1.0)
    assert (tmp_path / "eval" / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    table = json.loads((tmp_path / "eval" / "calibration.json").read_text())
    assert sum(r["count"] for r in table["validation"]) == expected


def test_normalisation_off_writes_the_model_unchanged(smoke, tmp_path, caplog):
    """reward.normalize: false scores the references all the same but shifts nothing (Detail 15)."""
    cfg, root, *_ = smoke
    reward_model_from_causal_lm(root / "base", seed=1).save_pretrained(tmp_path / "rm")
    # float32: under bf16 autocast the shifted mean is 0 only to bf16's 3 significant digits
    rm_cfg = cfg.reward.model_copy(update={"normalize": False, "normalization_max_samples": 8, "bf16": False})
    with caplog.at_level("INFO", logger="rlhf_core.train.reward"):
        off = normalize_reward_model(rm_cfg, root / "data", tmp_path / "rm", tmp_path / "off")
    assert "normalisation off" in caplog.text
    on = normalize_reward_model(
        rm_cfg.model_copy(update={"normalize": True}), root / "data", tmp_path / "rm", tmp_path / "on"
    )
    mean = on["normalization/mean_before"]
    assert abs(mean) > 1e-3  # a random head: the references' mean score is not 0
    assert off["normalization/mean_before"] == pytest.approx(mean, abs=1e-6)
    assert off["normalization/shift"] == 0.0 and off["normalization/mean_after"] == off["normalization/mean_before"]
    assert on["normalization/shift"] == mean and abs(on["normalization/mean_after"]) < 1e-4
    original = ScalarModel.from_pretrained(tmp_path / "rm")
    unchanged = ScalarModel.from_pretrained(tmp_path / "off" / "model")
    for name, weight in original.state_dict().items():
        assert torch.equal(unchanged.state_dict()[name], weight), name
    assert unchanged.config.normalization_mean == 0.0
    shifted = ScalarModel.from_pretrained(tmp_path / "on" / "model")
    assert shifted.head.bias.item() == pytest.approx(original.head.bias.item() - mean, abs=1e-6)
    assert shifted.config.normalization_mean == pytest.approx(mean)


class CrashAfter:
    """A tracker that fails when step ``n`` is reported: a crash part way through a stage."""

    def __init__(self, n):
        self.n = n
        self.steps = []  # the optimiser steps reported

    def log_params(self, params):
        pass

    def log_metrics(self, metrics, step=None):
        if any(k.endswith("/loss") for k in metrics) and step not in self.steps:
            self.steps.append(step)
        if step == self.n:
            raise RuntimeError("simulated crash")

    def log_table(self, name, rows):
        pass

    def log_artifact(self, path, artifact_path=None):
        pass


@pytest.mark.heavy
def test_reward_training_resumes_to_the_same_weights(smoke, tmp_path):
    """Two epochs of two steps (32 pairs in batches of 16): the crash comes right after the
    checkpoint of step 2, the last of the first epoch, and the resumed run trains the second."""
    cfg, root, *_ = smoke
    rm_cfg = cfg.reward.model_copy(update={"checkpoint_every": 2, "batch_size": 16, "num_epochs": 2})
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_reward_training(rm_cfg, root / "data", root / "base", tmp_path / "crashed", tracker=CrashAfter(3))
    assert (tmp_path / "crashed" / "checkpoints" / "step-000002").is_dir()
    assert not (tmp_path / "crashed" / "model").exists()
    resumed, clean = CrashAfter(None), CrashAfter(None)  # never crash: they record the steps
    run_reward_training(rm_cfg, root / "data", root / "base", tmp_path / "crashed", tracker=resumed)
    run_reward_training(rm_cfg, root / "data", root / "base", tmp_path / "clean", tracker=clean)
    assert (resumed.steps, clean.steps) == ([3, 4], [1, 2, 3, 4])
    a = ScalarModel.from_pretrained(tmp_path / "crashed" / "model").state_dict()
    b = ScalarModel.from_pretrained(tmp_path / "clean" / "model").state_dict()
    for k in b:
        assert torch.equal(a[k], b[k]), k
    # a checkpoint from another configuration is refused, not silently mixed in
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_reward_training(rm_cfg, root / "data", root / "base", tmp_path / "other", tracker=CrashAfter(3))
    with pytest.raises(TrainingError, match="different configuration"):
        run_reward_training(
            rm_cfg.model_copy(update={"learning_rate": 0.5}), root / "data", root / "base", tmp_path / "other"
        )


def test_a_saved_reward_model_loads_in_transformers_alone_with_our_scores(smoke, tmp_path):
    """The normalised reward model is a one-label ``AutoModelForSequenceClassification``
    checkpoint: its logits plus the stored ``rlhf_score_bias`` (the head's bias, which holds the
    normalisation of Detail 15) are our scores on real right-padded rows; and it loads back into
    a ScalarModel bitwise."""
    cfg, root, sft, _, stats = smoke
    pad = stats["tokenizer"]["pad_token_id"]
    rm_cfg = cfg.reward.model_copy(update={"bf16": False})
    norm = normalize_reward_model(rm_cfg, root / "data", root / "rm", tmp_path / "norm")
    assert norm["normalization/shift"] != 0
    ours_model = ScalarModel.from_pretrained(tmp_path / "norm" / "model")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "norm" / "model")
    assert type(hf).__name__.endswith("ForSequenceClassification") and hf.config.num_labels == 1
    assert hf.config.rlhf_score_bias == pytest.approx(-norm["normalization/shift"], abs=1e-6)  # the rm's bias was 0
    seqs = torch.tensor(sft[rm_cfg.normalization_split]["query_reference_response_token"])
    with torch.no_grad():
        ours = get_reward(ours_model, seqs, pad)[1]
        theirs = hf(seqs, attention_mask=(seqs != pad).long()).logits[:, 0] + hf.config.rlhf_score_bias
    assert torch.allclose(theirs, ours, atol=1e-5), (theirs, ours)
    assert abs(theirs.double().mean().item()) < 1e-3  # normalised: references score 0 on average
    # saved and loaded again, the model is the same, bit for bit
    ours_model.save_pretrained(tmp_path / "again")
    again = ScalarModel.from_pretrained(tmp_path / "again").state_dict()
    assert all(torch.equal(v, again[k]) for k, v in ours_model.state_dict().items())
    with pytest.raises(ValueError, match="not a reward model saved by rlhf_core"):
        ScalarModel.from_pretrained(root / "base")


def test_response_reward_logits_are_the_heads_outputs_with_the_score_at_the_eos(smoke):
    """Details 12-13: the reward logits of every response token are the ScalarModel's own outputs
    there, and the one at the returned EOS index is the score PPO and evaluation read."""
    cfg, root, sft, _, stats = smoke
    pad, eos = stats["tokenizer"]["pad_token_id"], stats["tokenizer"]["eos_token_id"]
    rm = ScalarModel.from_pretrained(root / "rm").eval()
    queries = torch.tensor(sft["validation"]["query_token"][:4])
    assert (queries[:, 0] == pad).any()  # left-padded, as PPO's and evaluation's queries are
    a, b, c, d, e, f = sft["validation"]["reference_response_token"][0][:6]
    responses = torch.tensor(
        [
            [a, b, eos, pad, pad, pad],  # EOS at 2
            [a, b, c, d, e, f],  # no EOS: read at 5
            [eos, pad, pad, pad, pad, pad],  # EOS at 0
            [a, b, c, d, eos, pad],  # EOS at 4
        ]
    )
    logits, scores, indices = response_reward_logits(rm, queries, responses, pad)
    assert logits.shape == (4, 6) and logits.dtype == torch.float32
    assert indices.tolist() == [2, 5, 0, 4]
    assert scores.equal(logits[torch.arange(4), indices])
    for i in range(4):  # each row alone, unpadded: the head's outputs at its response tokens
        q = queries[i][queries[i] != pad]
        end = int(indices[i]) + 1
        with torch.no_grad():
            alone = rm(input_ids=torch.cat([q, responses[i, :end]]).unsqueeze(0))[0, len(q) :]
        torch.testing.assert_close(logits[i, :end], alone, rtol=1e-4, atol=1e-5)
    scored = score_responses(rm, queries, responses, pad, eos, -1.0, batch_size=3)  # the scoring path
    torch.testing.assert_close(scores, scored.raw_scores, rtol=1e-4, atol=1e-5)
