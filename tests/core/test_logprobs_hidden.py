"""Checks of sdp_cli.core.logprobs.logprobs_from_hidden: the logits h·Wᵀ + b made block by block
give the same log-probs, entropy and gradients as materialising them (docs/math.md §6.2)."""

import math

import pytest
import torch

from sdp_cli.core.logprobs import logprobs_from_hidden, logprobs_from_logits


def naive(hidden, weight, targets, bias=None, temperature=1.0):
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def test_hand_values():
    # h = [1, 0], W rows [0, 0] and [ln 3, 0] → logits [0, ln 3] → p = [1/4, 3/4]
    hidden = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    weight = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    lp, ent = logprobs_from_hidden(hidden, weight, torch.tensor([1]), return_entropy=True)
    assert lp.item() == pytest.approx(math.log(0.75))
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    # a bias of [ln 3, 0] evens the logits out: p = [1/2, 1/2]
    bias = torch.tensor([math.log(3.0), 0.0], dtype=torch.float64)
    lp = logprobs_from_hidden(hidden, weight, torch.tensor([1]), bias=bias)
    assert lp.item() == pytest.approx(math.log(0.5))
    # temperature 2 halves the logits: p(1) = √3 / (1 + √3)
    lp = logprobs_from_hidden(hidden, weight, torch.tensor([1]), temperature=2.0)
    assert lp.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


@pytest.mark.parametrize("block_size", [1, 3, 5, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_naive(block_size, temperature, with_bias):
    hidden = torch.randn(3, 5, 8, dtype=torch.float64)
    weight = torch.randn(13, 8, dtype=torch.float64)
    bias = torch.randn(13, dtype=torch.float64) if with_bias else None
    targets = torch.randint(0, 13, (3, 5))
    lp, ent = logprobs_from_hidden(
        hidden, weight, targets, bias=bias, temperature=temperature, block_size=block_size, return_entropy=True
    )
    ref_lp, ref_ent = naive(hidden, weight, targets, bias, temperature)
    assert lp.shape == targets.shape and ent.shape == targets.shape
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block_size", [1, 4, 100])
def test_gradcheck_every_input(block_size):
    hidden = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (2, 3))

    def both(h, w, b):
        return logprobs_from_hidden(h, w, targets, bias=b, temperature=0.8, block_size=block_size, return_entropy=True)

    assert torch.autograd.gradcheck(both, (hidden, weight, bias))
    # each output alone (the other's gradient arrives as None)
    assert torch.autograd.gradcheck(lambda h, w, b: both(h, w, b)[0], (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w, b: both(h, w, b)[1], (hidden, weight, bias))


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    # LoRA freezes the output embedding: only the hidden states need a gradient
    hidden = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(10, 8, dtype=torch.float64)
    targets = torch.randint(0, 10, (4,))
    logprobs_from_hidden(hidden, weight, targets).sum().backward()
    ref_h = hidden.detach().clone().requires_grad_(True)
    naive(ref_h, weight, targets)[0].sum().backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad)
    assert weight.grad is None


def test_bfloat16_hidden_matches_the_logits_path_and_returns_float32():
    # The matmul runs in bf16 (as under autocast), the softmax in float32. Against the same bf16
    # logits fed to logprobs_from_logits the two paths agree to float32 rounding.
    torch.manual_seed(0)
    hidden = torch.randn(40, 16).bfloat16()
    weight = torch.randn(50, 16)  # float32 master weight, cast to bf16 for the matmul
    targets = torch.randint(0, 50, (40,))
    lp, ent = logprobs_from_hidden(hidden, weight, targets, temperature=0.9, block_size=7, return_entropy=True)
    logits = hidden @ weight.bfloat16().t()
    ref_lp, ref_ent = logprobs_from_logits(logits, targets, temperature=0.9, return_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)


def test_bfloat16_gradients_come_back_in_each_inputs_dtype_close_to_float64():
    torch.manual_seed(1)
    hidden64 = torch.randn(30, 16, dtype=torch.float64)
    weight64 = torch.randn(50, 16, dtype=torch.float64) * 0.3
    targets = torch.randint(0, 50, (30,))
    h = hidden64.bfloat16().requires_grad_(True)
    w = weight64.float().requires_grad_(True)
    logprobs_from_hidden(h, w, targets, block_size=8).sum().backward()
    h_ref = h.detach().double().requires_grad_(True)
    w_ref = w.detach().double().requires_grad_(True)
    naive(h_ref, w_ref, targets)[0].sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    # bf16 has an 8-bit mantissa: relative error ≈ 2⁻⁸ per product, a few % in the worst entry
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=0.05, atol=0.05)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=0.05, atol=0.05)


def test_autocast_around_the_call_changes_nothing():
    hidden = torch.randn(6, 8)
    weight = torch.randn(12, 8)
    targets = torch.randint(0, 12, (6,))
    plain = logprobs_from_hidden(hidden, weight, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = logprobs_from_hidden(hidden, weight, targets)
    assert torch.equal(plain, inside)


def test_bad_inputs_are_refused():
    h, w, t = torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 4])
    with pytest.raises(ValueError, match="must be \\[..., H\\] and \\[V, H\\]"):
        logprobs_from_hidden(h, torch.randn(5, 3), t)
    with pytest.raises(ValueError, match="token ids in \\[0, 5\\)"):
        logprobs_from_hidden(h, w, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="bias must have shape"):
        logprobs_from_hidden(h, w, t, bias=torch.zeros(4))
    with pytest.raises(ValueError, match="targets has shape"):
        logprobs_from_hidden(h, w, torch.tensor([0]))
    with pytest.raises(ValueError, match="block_size"):
        logprobs_from_hidden(h, w, t, block_size=0)


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_online_logsumexp_across_blocks_with_extreme_logits(block_size):
    # logits [−1000, 3, 1000, 999, −5]: the running max jumps by 1000 and more between blocks;
    # exp of a raw logit would overflow, the online rescaling must not
    weight = torch.tensor([[-1000.0], [3.0], [1000.0], [999.0], [-5.0]], dtype=torch.float64)
    hidden = torch.ones(5, 1, dtype=torch.float64)
    targets = torch.arange(5)
    lp, ent = logprobs_from_hidden(hidden, weight, targets, block_size=block_size, return_entropy=True)
    ref_lp, ref_ent = naive(hidden, weight, targets)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    # by hand: p(1000) = 1/(1 + e^−1), p(999) = e^−1/(1 + e^−1), the rest ≈ 0
    assert lp[2].item() == pytest.approx(-math.log1p(math.exp(-1)), rel=1e-12)


def test_one_position_is_that_row_of_a_batch():
    # hidden [..., H] includes no leading dimension at all: [H] with a 0-d target (a mutation that
    # refused a 1-D hidden survived every other test)
    hidden, weight = torch.randn(3, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    targets = torch.randint(0, 11, (3,))
    lp, ent = logprobs_from_hidden(hidden, weight, targets, return_entropy=True)
    one_lp, one_ent = logprobs_from_hidden(hidden[1], weight, targets[1], return_entropy=True)
    assert one_lp.shape == one_ent.shape == ()
    torch.testing.assert_close(one_lp, lp[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(one_ent, ent[1], rtol=0, atol=1e-12)
