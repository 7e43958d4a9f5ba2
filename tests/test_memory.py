"""Error-feedback memory: the low-pass update rule, beta validation, state round trip."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.memory import ErrorFeedback


def test_first_compensate_is_a_copy_of_the_gradient() -> None:
    ef = ErrorFeedback()
    g = torch.randn(5, dtype=torch.float16)
    p = ef.compensate("w", g)
    assert p.dtype == torch.float32 and torch.equal(p, g.float())
    p.add_(1)
    assert not torch.equal(p, g.float())  # a new tensor, not a view of the gradient


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_update_rule(beta: float) -> None:
    ef = ErrorFeedback(beta)
    m0 = torch.randn(7)
    ef.memories["w"] = m0.clone()
    g = torch.randn(7)
    p = ef.compensate("w", g)
    c = torch.where(p.abs() > 0.5, p, torch.zeros_like(p))
    ef.update("w", p - c)
    ef.commit()
    expected = (1 - beta) * m0 + beta * (m0 + g - c)
    torch.testing.assert_close(ef.memories["w"], expected)
    # identity from ALGORITHMS.md 1.2: m' = m + beta (g - c)
    torch.testing.assert_close(ef.memories["w"], m0 + beta * (g - c))


def test_beta_one_is_classic_error_feedback() -> None:
    ef = ErrorFeedback(1.0)
    g = torch.randn(4)
    p = ef.compensate("w", g)
    residual = p.clone()
    residual[0] = 0
    ef.update("w", residual)
    ef.commit(["w"])
    assert torch.equal(ef.memories["w"], residual)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, float("nan"), "0.5", True, None])
def test_beta_validation(bad: object) -> None:
    with pytest.raises(ValueError, match=r"`beta` must be a number in \(0, 1\]"):
        ErrorFeedback(bad)  # type: ignore[arg-type]
    ef = ErrorFeedback()
    with pytest.raises(ValueError, match="beta"):
        ef.beta = bad  # type: ignore[assignment]


def test_state_round_trip_and_norm() -> None:
    ef = ErrorFeedback()
    ef.memories = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    assert ef.norm() == pytest.approx(5.0)
    assert ef.norm(["b"]) == pytest.approx(4.0)
    other = ErrorFeedback()
    other.load_state_dict(ef.state_dict())
    assert other.memories.keys() == ef.memories.keys()
    assert all(torch.equal(other.memories[k], ef.memories[k]) for k in ef.memories)
    other.reset()
    assert other.memories == {}


def test_staged_update_is_committed_per_name_or_discarded() -> None:
    ef = ErrorFeedback(0.5)
    ef.staging = True
    ef.memories = {"a": torch.ones(3), "b": torch.ones(2)}
    ef.update("a", torch.zeros(3))
    ef.update("b", torch.zeros(2))
    ef.commit(["a"])
    assert torch.equal(ef.memories["a"], torch.full((3,), 0.5)) and torch.equal(ef.memories["b"], torch.ones(2))
    ef.discard()
    ef.commit()
    assert torch.equal(ef.memories["b"], torch.ones(2))  # the discarded update never lands


@pytest.mark.parametrize("scale", [2.0**-3, 1.0, 2.0**10])
def test_compensate_divides_by_the_loss_scale(scale: float) -> None:
    ef = ErrorFeedback()
    g = torch.randn(5)
    s = torch.tensor([scale])
    assert torch.equal(ef.compensate("w", g * scale, s), g)
    ef.memories["w"] = torch.randn(5)
    assert torch.equal(ef.compensate("w", g * scale, s), ef.memories["w"] + g)


@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_one_copy_of_each_layer_is_resident_between_steps(staging: bool, beta: float) -> None:
    """``p = m + g`` is a fresh tensor with a fresh addition's values, and after each committed step exactly one
    fp32 copy of the layer remains (the memory: no spare buffer is kept)."""
    from lightning_gradcomp.hook import resident_nbytes

    ef = ErrorFeedback(beta)
    ef.staging = staging
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        grad = torch.randn(37, generator=gen)
        expected = ef.memories["w"] + grad if "w" in ef.memories else grad.clone()
        p = ef.compensate("w", grad)
        assert torch.equal(p, expected) and ("w" not in ef.memories or p.data_ptr() != ef.memories["w"].data_ptr())
        p[::3] = 0.0  # a compressor keeps some entries: the residual, in p's storage
        ef.update("w", p)
        ef.commit()
        assert resident_nbytes(ef) == 37 * 4


def test_discarded_steps_and_resized_layers_never_alias_memories() -> None:
    ef = ErrorFeedback(1.0)
    ef.staging = True
    for n in (5, 5, 7, 7, 7):
        grad = torch.ones(n)
        p = ef.compensate("w", grad)
        memory = ef.memories.get("w")
        assert memory is None or p.data_ptr() != memory.data_ptr()
        ef.update("w", p)
        if n == 5:
            ef.discard()
        else:
            ef.commit()
    assert torch.equal(ef.memories["w"], torch.full((7,), 3.0))  # 1 + 1 + 1 over the three committed 7-steps
