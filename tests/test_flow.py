import pytest
import torch

from dit.attention import PackedAttention
from dit.clips import TrainClip, micro_batch_loss
from dit.flow import add_noise, clip_token_weights, shift_for_tokens, shift_sigmas
from dit.model import VideoDiT
from dit.packing import grid_positions

SMALL = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=3, text_dim=8,
             freq_dim=16, ffn_dim=32, num_layers=1, adaln_zero_init=False)  # fmt: skip


def _clip(index, grid, g):
    n = grid[0] * grid[1] * grid[2]
    return TrainClip(index, torch.randn(n, 12, generator=g), torch.randn(n, 12, generator=g),
                     float(torch.rand((), generator=g)), grid_positions(grid), torch.randn(3, 8, generator=g))  # fmt: skip


def test_path_endpoints_and_shift():
    x0, noise = torch.randn(4, 3), torch.randn(4, 3)
    assert torch.equal(add_noise(x0, noise, torch.zeros(4)), x0)
    assert torch.equal(add_noise(x0, noise, torch.ones(4)), noise)
    s = torch.linspace(0.01, 0.99, 20)
    assert torch.all(shift_sigmas(s, 3.0) > s) and torch.allclose(shift_sigmas(s, 1.0), s)
    assert shift_for_tokens(32760) > shift_for_tokens(4096) > shift_for_tokens(256)


def test_every_clip_weighs_the_same_whatever_its_length():
    w = clip_token_weights(torch.tensor([10, 1000]), torch.tensor([10, 1000]), num_clips=2)
    assert torch.isclose(w[:10].sum(), w[10:].sum()) and torch.isclose(w.sum(), torch.tensor(1.0))


def test_loss_is_invariant_to_micro_batching_and_token_sharding():
    """Sum over micro-batches, or over token shards of one micro-batch, equals the one-batch loss."""
    torch.manual_seed(0)
    model = VideoDiT(**SMALL)
    g = torch.Generator().manual_seed(1)
    clips = [_clip(0, (3, 2, 3), g), _clip(1, (1, 1, 2), g), _clip(2, (2, 3, 3), g)]
    total = micro_batch_loss(model, clips, PackedAttention([c.num_tokens for c in clips]), 3)
    split = sum(micro_batch_loss(model, [c], PackedAttention([c.num_tokens]), 3) for c in clips)
    torch.testing.assert_close(total, split, rtol=1e-6, atol=0)
    # a token range over a single clip: attention inside a clip needs all of it, so shard a clip-aligned
    # range here; sharding inside clips is tested with real CP attention in the dynamic_cp tests
    lens = [c.num_tokens for c in clips]
    a = micro_batch_loss(model, clips, PackedAttention([lens[0], 0, 0]), 3, token_range=(0, lens[0]))
    b = micro_batch_loss(model, clips[1:], PackedAttention(lens[1:]), 3)
    torch.testing.assert_close(a + b, total, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- exact values
# (each pins a formula or a default that the mutation tool found unpinned)


def test_flow_loss_is_weighted_mean_squared_error():
    from dit.flow import flow_loss

    pred = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    target = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    # per token: (1 + 4) / 2 = 2.5 and (4 + 16) / 2 = 10; weighted 0.5 * 2.5 + 0.25 * 10
    assert float(flow_loss(pred, target, torch.tensor([0.5, 0.25]))) == pytest.approx(3.75)


def test_shift_sigmas_matches_the_flow_scheduler_formula():
    from dit.flow import shift_sigmas

    sigmas = torch.tensor([0.0, 0.25, 0.5, 1.0])
    got = shift_sigmas(sigmas, 3.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.75 / 1.5, 0.75, 1.0]))  # 3s / (1 + 2s)
    torch.testing.assert_close(shift_sigmas(sigmas, 1.0), sigmas)


def test_shift_for_tokens_is_exp_of_a_line_through_the_sd3_anchors():
    import math

    from dit.flow import shift_for_tokens

    assert float(shift_for_tokens(256)) == pytest.approx(math.exp(0.5), rel=1e-6)
    assert float(shift_for_tokens(4096)) == pytest.approx(math.exp(1.15), rel=1e-6)
    assert float(shift_for_tokens(2176)) == pytest.approx(math.exp(0.825), rel=1e-6)  # midpoint
    got = shift_for_tokens(
        torch.tensor([100, 8192]), base_tokens=100, max_tokens=8192, base_shift=0.0, max_shift=1.0
    )
    torch.testing.assert_close(got, torch.tensor([1.0, math.e]))


def test_sigma_sampling_distributions():
    from dit.flow import sample_sigmas

    g = torch.Generator().manual_seed(0)
    logits = torch.logit(sample_sigmas(20_000, g).double())  # default: logit-normal(0, 1)
    assert abs(float(logits.mean())) < 0.03 and abs(float(logits.std()) - 1.0) < 0.03
    logits = torch.logit(sample_sigmas(20_000, g, mean=0.5, std=0.7).double())
    assert abs(float(logits.mean()) - 0.5) < 0.03 and abs(float(logits.std()) - 0.7) < 0.03
    uniform = sample_sigmas(20_000, g, mode="uniform").double()
    assert abs(float(uniform.mean()) - 0.5) < 0.01 and abs(float(uniform.std()) - (1 / 12) ** 0.5) < 0.01
    with pytest.raises(ValueError, match="flow.timestep_sampling='cosine'"):
        sample_sigmas(4, g, mode="cosine")


def test_uniform_sigmas_are_clamped_inside_the_open_interval(monkeypatch):
    from dit import flow

    monkeypatch.setattr(flow.torch, "rand", lambda num, generator=None: torch.tensor([0.0, 1.0, 0.5]))
    got = flow.sample_sigmas(3, torch.Generator(), mode="uniform")
    assert torch.equal(got, torch.tensor([1e-5, 1 - 1e-5, 0.5]))
