"""The adapter EMA (LoRA runs) averages what trains, at the configured decay, and samples with it."""

import torch

from dit.ema import AdapterEMA


def _model():
    """A frozen base layer and a trainable 'adapter' layer, as a LoRA run has them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)
    return model


def test_adapter_ema_moves_one_minus_decay_of_the_way_each_update():
    model = _model()
    ema = AdapterEMA(model, decay=0.75)
    assert sorted(ema.state) == ["1.bias", "1.weight"]  # only the trainable parameters are averaged
    old = {n: v.clone() for n, v in ema.state.items()}
    with torch.no_grad():
        for p in model[1].parameters():
            p.add_(1.0)
    ema.update(model)
    for n, v in ema.state.items():  # 0.75 * old + 0.25 * (old + 1)
        torch.testing.assert_close(v, old[n] + 0.25, rtol=0, atol=1e-6)
    ema.update(model)  # again at the same weights: a quarter of the remaining gap
    for n, v in ema.state.items():
        torch.testing.assert_close(v, old[n] + 0.25 + 0.75 * 0.25, rtol=0, atol=1e-6)


def test_swapped_in_samples_with_the_average_and_restores_the_live_adapters():
    model = _model()
    ema = AdapterEMA(model, decay=0.5)
    averaged = {n: v.clone() for n, v in ema.state.items()}
    with torch.no_grad():
        for p in model[1].parameters():
            p.mul_(3.0)
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(4, 3)
    with ema.swapped_in(model) as m:
        assert m is model
        for n, p in model.named_parameters():
            assert torch.equal(p, averaged.get(n, live[n]))  # adapters averaged, base untouched
        inside = model(x)
    assert not torch.equal(inside, model(x))
    for n, p in model.named_parameters():
        assert torch.equal(p, live[n])
