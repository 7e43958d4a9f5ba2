"""L-GreCo's allocation solver (vs brute force) and the per-candidate error/size tables."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest
import torch

from lightning_gradcomp.functional import solve_layerwise
from lightning_gradcomp.functional.layerwise import (error_units, feedback_errors, lowrank_errors, lowrank_sizes,
                                                     quantized_sizes, quantization_errors, randomk_errors,
                                                     sparse_sizes, topk_errors)
from lightning_gradcomp.functional.quantize import qsgd_quantize


def _brute_force(sizes, errors, max_error, resolution):
    """Minimal total size over all assignments whose rounded-up units fit (None if none fits)."""
    units = [[math.ceil(Fraction(e) * resolution / Fraction(max_error)) if max_error > 0
              else (0 if e == 0 else resolution + 1) for e in layer] for layer in errors]
    best = None
    for combo in itertools.product(*[range(len(s)) for s in sizes]):
        if sum(units[i][c] for i, c in enumerate(combo)) <= resolution:
            total = sum(sizes[i][c] for i, c in enumerate(combo))
            best = total if best is None else min(best, total)
    return best


def _continuous_best(sizes, errors, max_error):
    best = None
    for combo in itertools.product(*[range(len(s)) for s in sizes]):
        if sum(Fraction(errors[i][c]) for i, c in enumerate(combo)) <= Fraction(max_error):
            total = sum(sizes[i][c] for i, c in enumerate(combo))
            best = total if best is None else min(best, total)
    return best


def _random_instance(rng: random.Random):
    layers = rng.randint(1, 4)
    cands = [rng.randint(1, 4) for _ in range(layers)]
    sizes = [[rng.randint(1, 50) for _ in range(c)] for c in cands]
    errors = [[rng.choice([0.0, rng.uniform(0, 10), float(rng.randint(0, 10))]) for _ in range(c)] for c in cands]
    uniform = sum(rng.choice(e) for e in errors)
    max_error = uniform * rng.uniform(0.5, 1.5)
    resolution = rng.choice([1, 3, 10, 100, 10_000])
    return sizes, errors, max_error, resolution


@pytest.mark.parametrize("seed", range(300))
def test_solver_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    sizes, errors, max_error, resolution = _random_instance(rng)
    expected = _brute_force(sizes, errors, max_error, resolution)
    if expected is None:
        with pytest.raises(ValueError, match="no assignment"):
            solve_layerwise(sizes, errors, max_error, resolution)
        return
    choice = solve_layerwise(sizes, errors, max_error, resolution)
    assert len(choice) == len(sizes)
    assert all(0 <= c < len(s) for c, s in zip(choice, sizes))
    assert sum(sizes[i][c] for i, c in enumerate(choice)) == expected
    # The constraint truly holds (exact arithmetic), and never beats the continuous optimum.
    assert sum(Fraction(errors[i][c]) for i, c in enumerate(choice)) <= Fraction(max_error)
    assert expected >= _continuous_best(sizes, errors, max_error)


@pytest.mark.parametrize("seed", range(40))
def test_fine_resolution_reaches_continuous_optimum_on_integer_errors(seed: int) -> None:
    rng = random.Random(1000 + seed)
    layers = rng.randint(1, 5)
    sizes = [[rng.randint(1, 100) for _ in range(3)] for _ in range(layers)]
    errors = [[float(rng.randint(0, 20)) for _ in range(3)] for _ in range(layers)]
    max_error = float(rng.randint(0, 20 * layers))
    expected = _continuous_best(sizes, errors, max_error)
    if expected is None:
        with pytest.raises(ValueError):
            solve_layerwise(sizes, errors, max_error, resolution=int(max_error) or 1)
        return
    # Integer errors and a budget of integer units: rounding up is exact, so the discrete optimum is the true one.
    choice = solve_layerwise(sizes, errors, max_error, resolution=int(max_error) or 1)
    assert sum(sizes[i][c] for i, c in enumerate(choice)) == expected


def test_rounding_up_never_overshoots() -> None:
    # Three layers at exactly a third of the budget each: 0.1 * 3 > 0.3 in floating point, so this must fail
    # rather than return an assignment whose true error exceeds the budget.
    errors = [[0.1], [0.1], [0.1]]
    sizes = [[1], [1], [1]]
    assert sum(Fraction(0.1) for _ in range(3)) > Fraction(0.3)
    with pytest.raises(ValueError):
        solve_layerwise(sizes, errors, 0.3, resolution=10_000)
    assert solve_layerwise(sizes, errors, 0.3003, resolution=10_000) == [0, 0, 0]  # 3 x 3331 units fit


def test_coarse_resolution_is_conservative() -> None:
    # Errors 0.4 + 0.4 <= 1.0, but with 2 units of 0.5 each rounds up to 1 unit: still fits; with 1 unit it
    # rounds to 1 + 1 > 1 and the cheaper pair is refused.
    sizes = [[1, 10], [1, 10]]
    errors = [[0.4, 0.0], [0.4, 0.0]]
    assert solve_layerwise(sizes, errors, 1.0, resolution=2) == [0, 0]
    assert sorted(solve_layerwise(sizes, errors, 1.0, resolution=1)) == [0, 1]


def test_picks_minimum_size_under_budget() -> None:
    sizes = [[8, 4, 2], [8, 4, 2]]
    errors = [[0.0, 1.0, 5.0], [0.0, 2.0, 3.0]]
    # resolution = budget: one unit per unit of error, so these integer errors round exactly.
    assert solve_layerwise(sizes, errors, 3.0, resolution=3) == [1, 1]
    assert solve_layerwise(sizes, errors, 8.0, resolution=8) == [2, 2]
    assert solve_layerwise(sizes, errors, 5.0, resolution=5) == [1, 2]
    assert solve_layerwise(sizes, errors, 0.0) == [0, 0]
    # At the default resolution 1/3 of the budget rounds up to 3334 units: [1, 1] (3334 + 6667) no longer fits.
    assert solve_layerwise(sizes, errors, 3.0) == [0, 2]


def test_edge_cases() -> None:
    assert solve_layerwise([], [], 1.0) == []
    assert solve_layerwise([[5, 1]], [[3.0, 2.0]], math.inf) == [1]
    # NaN / inf errors and inf sizes are never chosen.
    assert solve_layerwise([[1, 5]], [[math.nan, 0.5]], 1.0) == [1]
    assert solve_layerwise([[1, 5]], [[math.inf, 0.5]], 1.0) == [1]
    assert solve_layerwise([[math.inf, 5]], [[0.0, 0.5]], 1.0) == [1]
    # Ties go to the lowest index.
    assert solve_layerwise([[3, 3]], [[0.5, 0.5]], 1.0) == [0]


@pytest.mark.parametrize("budget", [-1.0, 0.0, 0.5])
def test_infeasible_raises(budget: float) -> None:
    with pytest.raises(ValueError, match="no assignment"):
        solve_layerwise([[1, 2], [1]], [[2.0, 1.0], [0.6]], budget)


@pytest.mark.parametrize("kwargs, match", [
    ({"resolution": 0}, "resolution"),
    ({"resolution": 2.5}, "resolution"),
    ({"max_error": math.nan}, "max_error"),
    ({"sizes": [[1, 2]], "errors": [[1.0]]}, "same"),
    ({"sizes": [[]], "errors": [[]]}, "non-zero"),
    ({"sizes": [[1], [2]], "errors": [[1.0]]}, "same layers"),
    ({"sizes": [[-1]], "errors": [[1.0]]}, "sizes"),
    ({"sizes": [[1]], "errors": [[-1.0]]}, "errors"),
])
def test_bad_input(kwargs: dict, match: str) -> None:
    args = {"sizes": [[1]], "errors": [[1.0]], "max_error": 1.0, "resolution": 10}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        solve_layerwise(**args)


def test_error_units_round_up_exactly() -> None:
    assert error_units([0.0, 0.25, 0.2500001, 1.0, 2.0, math.nan], 1.0, 4) == [0, 1, 2, 4, 5, 5]


def test_large_instance_is_fast_and_valid() -> None:
    rng = random.Random(0)
    layers, cands = 60, 15
    sizes = [[(c + 1) * rng.randint(10, 1000) for c in range(cands)] for _ in range(layers)]
    errors = [[rng.uniform(1, 2) / (c + 1) for c in range(cands)] for _ in range(layers)]
    budget = sum(e[4] for e in errors)
    choice = solve_layerwise(sizes, errors, budget)
    assert sum(errors[i][c] for i, c in enumerate(choice)) <= budget
    assert sum(sizes[i][c] for i, c in enumerate(choice)) <= sum(s[4] for s in sizes)


# ---------------------------------------------------------------------------------------------- tables
def test_lowrank_errors_match_svd_reconstruction() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, 5, generator=gen)
    mat = x.reshape(12, 15).double()
    u, s, vh = torch.linalg.svd(mat, full_matrices=False)
    errs = lowrank_errors(x, [1, 2, 5, 12, 20])
    for r, e in zip([1, 2, 5, 12], errs):
        best = (u[:, :r] * s[:r]) @ vh[:r]
        assert e == pytest.approx(float(torch.linalg.norm(mat - best)), rel=1e-6, abs=1e-9)
    assert errs[-2] == pytest.approx(0.0, abs=1e-6) and errs[-1] == 0.0
    assert lowrank_errors(torch.zeros(4, 6), [1, 2]) == [0.0, 0.0]


def test_topk_errors_match_direct_computation() -> None:
    x = torch.randn(200, generator=torch.Generator().manual_seed(1))
    for k, e in zip([1, 10, 199, 200], topk_errors(x, [1, 10, 199, 200])):
        kept = torch.zeros_like(x)
        idx = x.abs().topk(k).indices
        kept[idx] = x[idx]
        assert e == pytest.approx(float(torch.linalg.norm(x - kept)), rel=1e-5)


def test_randomk_errors_match_monte_carlo() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(100, generator=gen)
    (err,) = randomk_errors(x, [30])
    trials = []
    for _ in range(2000):
        keep = torch.randperm(100, generator=gen)[:30]
        rest = x.clone()
        rest[keep] = 0
        trials.append(float(rest.square().sum()))
    assert err ** 2 == pytest.approx(sum(trials) / len(trials), rel=0.03)


@pytest.mark.parametrize("p", ["inf", 2])
def test_quantization_errors_match_qsgd_monte_carlo(p: object) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, generator=gen)
    bits, bucket = 3, 16
    (err,) = quantization_errors(x, [bits], bucket, p=p)
    trials = 3000
    total = sum(float((qsgd_quantize(x, bits, bucket, gen, p=p).decode() - x).square().sum()) for _ in range(trials))
    assert err ** 2 == pytest.approx(total / trials, rel=0.05)
    finer = quantization_errors(x, [2, 4, 8], bucket, p=p)
    assert finer[0] > finer[1] > finer[2] > 0


def test_sizes() -> None:
    assert lowrank_sizes((10, 2, 3), [1, 2, 6, 7]) == [64.0, 128.0, 384.0, math.inf]
    assert sparse_sizes([3, 5]) == [24.0, 40.0]
    assert sparse_sizes([3], value_bytes=2, index_bytes=0) == [6.0]
    assert quantized_sizes(1000, [2, 4], bucket_size=512) == [250.0 + 8, 500.0 + 8]


def test_feedback_errors_are_the_error_feedback_fixed_point() -> None:
    # A compressor that keeps (1 - q) of its input leaves e = q ||A||; error feedback with a constant gradient
    # A then converges to the memory q A / (1 - q), whose norm feedback_errors predicts.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(50, generator=gen, dtype=torch.float64)
    norm = float(a.norm())
    for q in (0.0, 0.3, 0.9):
        memory = torch.zeros_like(a)
        for _ in range(2000):
            p = memory + a
            memory = p - (1 - q) * p
        assert feedback_errors([q * norm], norm)[0] == pytest.approx(float(memory.norm()), rel=1e-9, abs=1e-12)
    assert feedback_errors([0.0, 0.5, 1.0, 2.0], 1.0) == [0.0, 1.0, math.inf, math.inf]
    assert feedback_errors([0.3, 0.7], 0.0) == [0.0, 0.0]
    errors = [0.1, 0.5, 0.9, 0.99]  # monotone, and it grows without bound where e saturates at ||A||
    out = feedback_errors(errors, 1.0)
    assert out == sorted(out) and out[-1] > 90


def test_solve_or_uniform_falls_back_to_the_uniform_setting_only_when_it_fits() -> None:
    from lightning_gradcomp.functional.layerwise import solve_or_uniform

    # layer 0's error at the uniform candidate is 1e-9, not 0: rounded up it takes one unit, so a budget equal to
    # the uniform setting's own error excludes that setting from the solver's answers.
    sizes, errors = [[1.0, 2.0], [1.0, 2.0]], [[5.0, 1e-9], [5.0, 1.0]]
    budget = 1e-9 + 1.0
    with pytest.raises(ValueError):
        solve_layerwise(sizes, errors, budget, 100)
    assert solve_or_uniform(sizes, errors, [1, 1], budget, 100) == ([1, 1], True)
    # a cheaper answer of the solver wins over the uniform setting
    assert solve_or_uniform(sizes, errors, [1, 1], 20.0, 100) == ([0, 0], False)
    # with a dearer exact candidate the solver has an answer, but the uniform setting is cheaper and fits
    sizes3, errors3 = [[1.0, 2.0, 3.0], [1.0, 2.0]], [[5.0, 1e-9, 0.0], [5.0, 1.0]]
    assert solve_layerwise(sizes3, errors3, budget, 100) == [2, 1]
    assert solve_or_uniform(sizes3, errors3, [1, 1], budget, 100) == ([1, 1], True)
    with pytest.raises(ValueError, match="no assignment"):
        solve_or_uniform(sizes, errors, [0, 0], 1.0, 100)  # neither fits
    with pytest.raises(ValueError, match="same layers"):  # malformed input is reported, not replaced by uniform
        solve_or_uniform(sizes, errors[:1], [1, 1], budget, 100)
    with pytest.raises(ValueError, match="one candidate index per layer"):
        solve_or_uniform(sizes, errors, [1, 2], budget, 100)


def test_randomk_errors_of_an_empty_tensor_are_zero() -> None:
    """An empty layer divided by its zero size."""
    assert randomk_errors(torch.tensor([]), [0, 1]) == [0.0, 0.0]
