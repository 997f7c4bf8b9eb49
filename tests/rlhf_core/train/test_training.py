import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rlhf_core.config.presets import load_config
from rlhf_core.models.saved import load_causal_lm
from rlhf_core.train import training
from rlhf_core.train.reward import reward_model_from_causal_lm
from rlhf_core.train.training import (
    autocast,
    device_tuning,
    enable_activation_checkpointing,
    precision_name,
    resolve_bf16,
    row_order,
)


@pytest.fixture(scope="module")
def base_dir(smoke_stages):
    return smoke_stages / "base"


def _step(model, ids):
    """Loss, parameter gradients, matmul FLOPs of forward+backward, and bytes that autograd
    saves outside checkpointed regions."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        loss = hidden.float().pow(2).mean()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter.get_total_flops(), saved[0]


@pytest.mark.parametrize("build", ["causal_lm", "scalar_model"])
def test_selective_recomputation_keeps_gradients_and_recomputes_no_matmul(base_dir, build):
    """``"selective"`` gives the plain forward's loss and gradients, saves far fewer tensors
    outside the checkpointed layers, and, unlike full checkpointing, runs no matmul twice."""

    def make(mode):
        torch.manual_seed(0)
        model = load_causal_lm(base_dir) if build == "causal_lm" else reward_model_from_causal_lm(base_dir, seed=0)
        model.train()
        enable_activation_checkpointing(model, mode)
        return model

    ids = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(1))
    loss0, grads0, flops0, saved0 = _step(make(False), ids)
    loss_sel, grads_sel, flops_sel, saved_sel = _step(make("selective"), ids)
    loss_full, grads_full, flops_full, saved_full = _step(make(True), ids)

    torch.testing.assert_close(loss_sel, loss0)
    torch.testing.assert_close(loss_full, loss0)
    assert grads_sel.keys() == grads0.keys() and len(grads0) > 0
    for name in grads0:
        torch.testing.assert_close(grads_sel[name], grads0[name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(grads_full[name], grads0[name], rtol=1e-4, atol=1e-6)
    assert flops_sel == flops0  # matmul and attention outputs are kept, never recomputed
    assert flops_full > flops0 * 1.2  # full checkpointing runs each layer's forward again
    assert saved_sel < saved0 / 2 and saved_full < saved0 / 2  # the layers' activations are held elsewhere


def test_selective_recomputation_is_off_in_eval_mode_and_a_bad_mode_is_named(base_dir):
    model = load_causal_lm(base_dir)
    enable_activation_checkpointing(model, "selective")
    model.eval()
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 16  # generation keeps its cache
    with pytest.raises(ValueError, match="'partial'"):
        enable_activation_checkpointing(load_causal_lm(base_dir), "partial")


@pytest.mark.parametrize(
    "features, native",
    [
        (frozenset({"avx2", "avx512_f", "avx512_bw", "avx512_vnni"}), False),  # AVX-512 without bf16: emulated
        (frozenset({"avx2", "avx512_f", "avx512_bf16"}), True),
        (frozenset({"avx2", "amx_tile", "amx_bf16"}), True),
        (frozenset(), False),
    ],
)
def test_bf16_auto_follows_the_cpu_features(monkeypatch, features, native):
    """`bf16: auto` is bf16 autocast exactly where the CPU computes bf16 natively."""
    monkeypatch.setattr(training, "cpu_features", lambda: features)
    cpu = torch.device("cpu")
    assert resolve_bf16("auto", cpu) is native
    assert precision_name("auto", cpu) == ("bf16-autocast" if native else "float32")
    assert resolve_bf16(True, cpu) is True and resolve_bf16(False, cpu) is False  # explicit settings win
    layer = torch.nn.Linear(4, 4)
    with autocast(cpu, "auto"):
        out = layer(torch.ones(1, 4))
    assert out.dtype == (torch.bfloat16 if native else torch.float32)


def test_bf16_setting_is_validated():
    with pytest.raises(ValueError, match="bf16 must be true, false or 'auto'"):
        resolve_bf16("sometimes", torch.device("cpu"))
    assert load_config("cpu-demo").sft.bf16 == "auto"  # every stage's default, presets included
    with pytest.raises(Exception, match="sft.bf16"):
        load_config("smoke", ["sft.bf16=sometimes"])


def test_cpu_features_are_read_from_this_machine():
    features = training.cpu_features()
    with open("/proc/cpuinfo") as fh:
        flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    if flags:  # torch's cpuinfo and the kernel agree on the feature that decides the precision
        assert ("avx512_bf16" in features) == ("avx512_bf16" in flags)
        assert ("avx2" in features) == ("avx2" in flags)


def test_read_metrics_replaces_the_steps_a_resumed_run_did_again(tmp_path):
    """An attempt logs steps 1-5 and dies; the next resumes from the checkpoint after step 3,
    marks it, and logs steps 4-6 again: the reader gives steps 1-6 once, the new 4 and 5."""
    from rlhf_core.common.tracking import RESUME_METRIC, JsonlTracker, read_metrics

    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    tracker.log_metrics({"final/x": 1.0})  # no step: kept whatever follows
    for step in range(1, 6):
        tracker.log_metrics({"train/loss": float(step)}, step=step)
    tracker.log_metrics({RESUME_METRIC: 3.0}, step=3)
    for step in range(4, 7):
        tracker.log_metrics({"train/loss": 10.0 + step}, step=step)
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        (None, {"final/x": 1.0}),
        (1, {"train/loss": 1.0}),
        (2, {"train/loss": 2.0}),
        (3, {"train/loss": 3.0}),
        (4, {"train/loss": 14.0}),
        (5, {"train/loss": 15.0}),
        (6, {"train/loss": 16.0}),
    ]


def test_device_tuning_keeps_the_cpu_as_it_was_and_speeds_up_cuda():
    """One place picks each kernel choice by device type; the CPU's are the code's original
    ones (its learning figures must not move)."""
    cpu = training.device_tuning(torch.device("cpu"))
    assert cpu == training.DEFAULT_TUNING
    assert (cpu.fused_adamw, cpu.head_chunk_bytes, cpu.width_multiple) == (False, 32 * 2**20, 1)
    assert training.device_tuning("cuda:1") == training.device_tuning("cuda") == training.CUDA_TUNING
    assert training.CUDA_TUNING.fused_adamw and training.CUDA_TUNING.width_multiple > 1
    assert training.CUDA_TUNING.head_chunk_bytes > cpu.head_chunk_bytes


def _adamw_run(init, grads, fused, state=None):
    params = [p.clone().requires_grad_() for p in init]
    optimizer = training.adamw(params, lr=1e-2, eps=1e-5, fused=fused)
    if state is not None:
        optimizer.load_state_dict(state)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params], optimizer


def test_adamw_is_the_default_kernel_on_cpu_and_the_fused_one_steps_the_same():
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(7, 5, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in init] for _ in range(5)]
    picked, optimizer = _adamw_run(init, grads, fused=None)  # the device's choice: CPU parameters
    assert optimizer.param_groups[0]["fused"] is None and optimizer.param_groups[0]["foreach"] is None
    assert optimizer.defaults["lr"] == 1e-2 and optimizer.defaults["eps"] == 1e-5
    plain, _ = _adamw_run(init, grads, fused=False)
    fused, fused_optimizer = _adamw_run(init, grads, fused=True)  # torch has the fused kernel on the CPU too
    assert fused_optimizer.param_groups[0]["fused"] is True
    for a, b, c in zip(picked, plain, fused):
        assert torch.equal(a, b)  # the CPU's choice is torch's default, bit for bit
        assert not torch.equal(a, init[0] if a.dim() == 2 else init[1])
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("saved_fused", [False, True])
def test_adamw_keeps_its_kernel_when_it_loads_the_other_kernels_state(saved_fused):
    """A checkpoint written by one kernel resumes with the loading optimiser's kernel, and the
    run continues as if it had not stopped."""
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(6, 3, generator=g), torch.randn(3, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in init] for _ in range(6)]
    whole, _ = _adamw_run(init, grads, fused=saved_fused)
    first, writer = _adamw_run(init, grads[:3], fused=saved_fused)
    state = writer.state_dict()
    resumed, reader = _adamw_run(first, grads[3:], fused=not saved_fused, state=state)
    assert reader.param_groups[0]["fused"] is (True if not saved_fused else None)
    assert state["param_groups"][0]["fused"] is (True if saved_fused else None)  # the saved state is untouched
    assert reader.state_dict()["state"][0]["step"].item() == 6
    for a, b in zip(resumed, whole):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_row_order_groups_rows_by_length_only_where_the_device_says_so():
    """CUDA runs a global batch's rows shortest first (stable among equal lengths), so each
    micro-batch pads less; the CPU keeps the drawn order, so its results do not move."""
    lengths = torch.tensor([30, 5, 30, 12, 5, 40])
    assert row_order(lengths, "cpu") == [0, 1, 2, 3, 4, 5]
    assert row_order(lengths, torch.device("cuda", 0)) == [1, 4, 3, 0, 2, 5]
    assert row_order(lengths, "cpu", group=True) == [1, 4, 3, 0, 2, 5]
    assert device_tuning("cuda").group_lengths and not device_tuning("cpu").group_lengths
