"""RateCorrectedAdamW: AdamW on dense gradients, linear in the delivered mass on sparsified ones, clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_gradcomp import RateCorrectedAdamW


def _net(seed: int, sizes: tuple[int, ...]) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


@pytest.mark.parametrize("sizes", [(7, 13, 3), (1, 2, 1), (31, 5, 17, 2)])
@pytest.mark.parametrize("betas,wd", [((0.9, 0.98), 0.01), ((0.8, 0.999), 0.0), ((0.0, 0.5), 0.1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_gradients_take_adamw_steps(sizes: tuple[int, ...], betas: tuple[float, float], wd: float,
                                          dtype: torch.dtype) -> None:
    net = _net(0, sizes).to(dtype)
    ref = copy.deepcopy(net)
    ours = RateCorrectedAdamW(net.parameters(), lr=1e-2, betas=betas, weight_decay=wd)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=betas, weight_decay=wd)
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        x = torch.randn(8, sizes[0], generator=gen, dtype=dtype)
        for model, opt in ((net, ours), (ref, theirs)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)


@pytest.mark.parametrize("period", [10, 50, 100])
def test_periodic_bursts_move_as_far_as_the_dense_gradient(period: int) -> None:
    """A coordinate whose gradient ``g`` arrives as ``period * g`` once per ``period`` steps (error feedback's
    burst) moves about as far over many periods as under dense ``g``; plain AdamW moves about
    ``sqrt(period)`` times less."""
    steps, g = 20 * period, 1e-3

    def travel(opt_cls: type, burst: bool) -> float:
        p = torch.nn.Parameter(torch.zeros(1))
        opt = opt_cls([p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
        for t in range(steps):
            p.grad = torch.full((1,), (period * g if t % period == period - 1 else 0.0) if burst else g)
            opt.step()
        return -float(p.detach())

    dense = travel(torch.optim.AdamW, burst=False)
    assert travel(RateCorrectedAdamW, burst=False) == pytest.approx(dense, rel=1e-5)
    corrected, plain = travel(RateCorrectedAdamW, burst=True), travel(torch.optim.AdamW, burst=True)
    assert corrected == pytest.approx(dense, rel=0.25)
    assert plain < dense / (0.5 * period**0.5)


def test_state_round_trips_and_resumes_exactly() -> None:
    def run(split: bool) -> list[torch.Tensor]:
        net = _net(3, (5, 9, 2))
        opt = RateCorrectedAdamW(net.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(4)
        for i in range(12):
            if split and i == 6:
                saved_net, saved_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
                net = _net(99, (5, 9, 2))
                net.load_state_dict(saved_net)
                opt = RateCorrectedAdamW(net.parameters(), lr=3e-3)
                opt.load_state_dict(saved_opt)
            x = torch.randn(4, 5, generator=gen)
            opt.zero_grad()
            net(x).sum().backward()
            for p in net.parameters():  # sparse, as after top-k
                p.grad.mul_(torch.rand(p.shape, generator=gen) < 0.3)
            opt.step()
        return [p.detach().clone() for p in net.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs,name", [({"lr": 0.0}, "lr"), ({"betas": (1.0, 0.9)}, "betas[0]"),
                                          ({"betas": (0.9, -0.1)}, "betas[1]"), ({"eps": -1.0}, "eps"),
                                          ({"weight_decay": -0.1}, "weight_decay")])
def test_bad_arguments_name_themselves(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        RateCorrectedAdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)


# ---------------------------------------------------------------------------------------------- in a fit
def _rate_adamw_net() -> object:
    """TinyNet (13 hidden, 7 inputs) trained with RateCorrectedAdamW."""
    from helpers.models import TinyNet

    class Net(TinyNet):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return RateCorrectedAdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.01)

    return Net(hidden=13, in_features=7, samples=64, batch_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("name", ["cltk", "topk"])
def test_replicas_stay_identical_under_sparsified_gradients(tmp_path, world: int, name: str) -> None:
    """W = 2..5 ranks, CLT-k / TopK at 10 % with error feedback: every rank's parameters are equal after every step
    (the arrival rates are computed from the averaged gradient, the same on every rank)."""
    from helpers.models import assert_replicas_identical, fit

    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.compressors import CLTK, TopK

    compressor = CLTK(density=0.1) if name == "cltk" else TopK(density=0.1)
    records = fit(GradCompStrategy(compressor=compressor, min_numel=1, start_step=2, start_method="fork"),
                  tmp_path, devices=world, model=_rate_adamw_net(), max_epochs=2)
    assert_replicas_identical(records)
    assert len(records[0]["params"]) >= 4
    moved = [not torch.equal(a, b) for a, b in zip(records[0]["params"], records[0]["params"][1:])]
    assert all(moved), "a step left the parameters unchanged"
