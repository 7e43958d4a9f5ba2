"""Configurations compared on a topology: their predicted steps, speed-ups, the recommendation and the scaling
efficiency as the cluster grows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from lightning_gradcomp.advise.costs.step_replay import Prediction, StepTrace, simulate_step
from lightning_gradcomp.advise.costs.topology import Topology

__all__ = ["efficiency_curve", "predict", "recommend", "speedups"]


def predict(traces: Mapping[str, StepTrace], topology: Topology) -> dict[str, Prediction]:
    """:func:`simulate_step` for every configuration."""
    return {name: simulate_step(trace, topology) for name, trace in traces.items()}


def speedups(predictions: Mapping[str, Prediction], baseline: str) -> dict[str, float]:
    """Each configuration's speed-up over ``baseline`` (its step over theirs); empty when ``baseline`` is absent."""
    if baseline not in predictions:
        return {}
    base = predictions[baseline].step
    return {name: base / p.step for name, p in predictions.items()}


def recommend(predictions: Mapping[str, Prediction], dense: str = "ddp") -> str:
    """One line: the fastest configuration and its margin over the runner-up and over dense ``dense``; "keep"
    ``dense`` when no configuration beats it by 5 %.

    >>> recommend({"ddp": Prediction(2.0, 1.0, 8e6), "topk": Prediction(1.0, 1.0, 1e5)})
    'use topk: 1000.0 ms/step predicted, scaling efficiency 100%; 2.00x faster than the next (ddp)'
    """
    if not predictions:
        return "no configuration to compare"
    ranked = sorted(predictions, key=lambda name: predictions[name].step)
    best, p = ranked[0], predictions[ranked[0]]
    if dense in predictions and predictions[dense].step < 1.05 * p.step:
        rival = best if best != dense else (ranked[1] if len(ranked) > 1 else dense)
        return (
            f"keep {dense}: compression does not pay by 5 % here ({dense} {predictions[dense].step * 1e3:.1f} ms/step, "
            f"best alternative {rival} {predictions[rival].step * 1e3:.1f} ms/step predicted)"
        )
    text = f"use {best}: {p.step * 1e3:.1f} ms/step predicted, scaling efficiency {p.efficiency:.0%}"
    if len(ranked) > 1:
        runner = ranked[1]
        text += f"; {predictions[runner].step / p.step:.2f}x faster than the next ({runner})"
        if dense in predictions and runner != dense:
            text += f", {predictions[dense].step / p.step:.2f}x faster than dense {dense}"
    return text


def efficiency_curve(
    traces: Mapping[str, StepTrace], topology: Topology, nodes: Iterable[int]
) -> dict[str, list[tuple[int, float]]]:
    """Predicted scaling efficiency of every configuration at each node count (same calibration: compute and
    payloads as calibrated, only the topology changes)."""
    counts: Sequence[int] = list(nodes)
    return {
        name: [(n, simulate_step(trace, topology.with_nodes(n)).efficiency) for n in counts]
        for name, trace in traces.items()
    }
