"""The chunked language-model head: SFT's summed cross-entropy and DPO's log-probabilities equal,
with their gradients, those of the full logits."""

import pytest
import torch
import torch.nn.functional as F

from rlhf_core.train.chunked_head import head_chunking, linear_cross_entropy_sum, linear_logprobs


def test_head_chunking_default_is_the_devices():
    """The chunked head's default chunk is the device's (32 MiB of float32 logits on the CPU);
    an explicit ``chunk_bytes`` wins."""
    hidden, weight, targets = torch.zeros(3, 4), torch.zeros(1000, 4), torch.zeros(3, dtype=torch.long)
    assert head_chunking(hidden, weight, targets) == (torch.float32, 32 * 2**20 // (4 * 1000))
    assert head_chunking(hidden, weight, targets, chunk_bytes=4 * 1000 * 5) == (torch.float32, 5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_cross_entropy_sum_equals_full_logits_with_gradients(with_bias):
    torch.manual_seed(0)
    n, d, vocab = 37, 16, 101
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    bias = torch.randn(vocab, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab, (n,))
    # 10 rows of logits per chunk: four chunks, the last one short
    chunked = linear_cross_entropy_sum(hidden, weight, targets, bias, chunk_bytes=10 * 4 * vocab)
    (chunked * 0.5).backward()
    got = [hidden.grad.clone(), weight.grad.clone()] + ([bias.grad.clone()] if with_bias else [])
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    full = F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction="sum")
    (full * 0.5).backward()
    want = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])
    torch.testing.assert_close(chunked, full)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    with torch.no_grad():  # evaluation: no gradients computed, same loss
        torch.testing.assert_close(linear_cross_entropy_sum(hidden, weight, targets, bias, chunk_bytes=1), full)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy_sum(hidden, weight, targets[:-1])


def test_linear_cross_entropy_sum_under_bf16_autocast_matches_autocast_linear():
    torch.manual_seed(0)
    hidden = torch.randn(24, 32, requires_grad=True)
    weight = torch.randn(300, 32, requires_grad=True)
    targets = torch.randint(0, 300, (24,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = linear_cross_entropy_sum(hidden, weight, targets, chunk_bytes=7 * 4 * 300)
    chunked.backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
    full.backward()
    assert got[0].dtype == got[1].dtype == torch.float32
    torch.testing.assert_close(chunked, full, rtol=1e-3, atol=1e-2)
    for g, w in zip(got, (hidden.grad, weight.grad)):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_linear_logprobs_equal_full_log_softmax_with_gradients():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    upstream = torch.randn(37, generator=g)  # a different incoming gradient per row
    got = linear_logprobs(hidden, weight, targets, bias, chunk_bytes=4 * 50 * 5)  # chunks of 5 rows
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight, bias))
    full = F.log_softmax(F.linear(hidden, weight, bias), -1).gather(1, targets[:, None]).squeeze(1)
    full_grads = torch.autograd.grad((full * upstream).sum(), (hidden, weight, bias))
    torch.testing.assert_close(got, full)
    for a, b in zip(got_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expected"):
        linear_logprobs(hidden, weight, targets[:3])


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_only_the_inputs_that_need_a_gradient_get_one(frozen):
    """A frozen head (adapters train, the output embedding does not) or frozen hidden states: both
    functions return the gradients of the others, equal to the full logits'."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, 8, generator=g, requires_grad=frozen != "hidden")
    weight = torch.randn(40, 8, generator=g, requires_grad=frozen != "weight")
    bias = torch.randn(40, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (23,), generator=g)
    upstream = torch.randn(23, generator=g)
    inputs = [t for t in (hidden, weight, bias) if t.requires_grad]
    full_logits = F.linear(hidden, weight, bias)
    cases = [
        (linear_cross_entropy_sum, lambda out: out * 0.5, F.cross_entropy(full_logits, targets, reduction="sum") * 0.5),
        (
            linear_logprobs,
            lambda out: (out * upstream).sum(),
            (F.log_softmax(full_logits, -1).gather(1, targets[:, None]).squeeze(1) * upstream).sum(),
        ),
    ]
    for fn, reduce, full in cases:
        got = reduce(fn(hidden, weight, targets, bias, chunk_bytes=4 * 40 * 6))  # chunks of 6 rows
        torch.testing.assert_close(got, full)
        for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(full, inputs, retain_graph=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_linear_logprobs_under_bf16_autocast_matches_autocast_linear():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, 32, generator=g, requires_grad=True)
    weight = torch.randn(300, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (24,), generator=g)
    upstream = torch.randn(24, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_logprobs(hidden, weight, targets, chunk_bytes=7 * 4 * 300)
        full = F.log_softmax(F.linear(hidden, weight).float(), -1).gather(1, targets[:, None]).squeeze(1)
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    full_grads = torch.autograd.grad((full * upstream).sum(), (hidden, weight))
    assert got_grads[0].dtype == got_grads[1].dtype == torch.float32
    torch.testing.assert_close(got, full, rtol=1e-3, atol=1e-2)
    for a, b in zip(got_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_under_bf16_autocast_the_chunks_equal_autocast_linear_to_float32_rounding():
    """Under bf16 autocast (the cpu-demo path on a CPU with AVX512-BF16), in several chunks of
    rows: DPO's log-probabilities and SFT's summed loss equal ``F.linear``'s under autocast to
    float32 rounding and do not depend on the chunks' size; the gradients are within bf16
    rounding (the weight's: one bf16 rounding per chunk's product)."""
    g = torch.Generator().manual_seed(0)
    vocab, d_model, n = 3000, 96, 64
    hidden = torch.randn(n, d_model, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, d_model, generator=g) * 0.05).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head_chunking(hidden, weight, targets, 4 * vocab * 20) == (torch.bfloat16, 20)  # 4 chunks
        got = linear_logprobs(hidden, weight, targets, chunk_bytes=4 * vocab * 20)
        other_chunks = linear_logprobs(hidden, weight, targets, chunk_bytes=4 * vocab * 7)
        full = F.log_softmax(F.linear(hidden, weight).float(), -1).gather(1, targets[:, None]).squeeze(1)
        loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_bytes=4 * vocab * 20)
        full_loss = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
    torch.testing.assert_close(got, full, rtol=0, atol=2e-5)
    torch.testing.assert_close(other_chunks, got, rtol=0, atol=2e-5)
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=0)
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    full_grads = torch.autograd.grad((full * upstream).sum(), (hidden, weight))
    for a, b, bound in zip(got_grads, full_grads, (1e-4, 2**-8)):
        assert a.dtype == torch.float32 and ((a - b).norm() / b.norm()).item() < bound
