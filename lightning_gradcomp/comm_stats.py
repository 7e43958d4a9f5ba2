"""What one rank's collectives sent: :class:`CommStats` (cumulative figures) and :class:`LayerStats` (per layer)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_gradcomp.wire_bytes import compression_ratio

__all__ = ["CommStats", "LayerShares", "LayerStats"]

LayerShares = Sequence[tuple[str, int]]
"""(layer name, number of elements of the payload that belong to that layer)."""


@dataclass
class LayerStats:
    """Cumulative per-layer figures for one rank (bytes are summed over steps)."""

    numel: int = 0
    compressed: bool = False
    param: Optional[float] = None
    wire_bytes: float = 0.0
    dense_bytes: float = 0.0

    @property
    def compression(self) -> float:
        """Dense-equivalent bytes divided by wire bytes (:func:`compression_ratio`)."""
        return compression_ratio(self.dense_bytes, self.wire_bytes)

    @property
    def ratio(self) -> float:
        """Deprecated name of :attr:`compression` (warns)."""
        warnings.warn("`LayerStats.ratio` is deprecated: use `.compression`", DeprecationWarning, stacklevel=2)
        return self.compression


_CALLBACK_LOCK = threading.Lock()


@dataclass
class CommStats:
    """Cumulative communication figures of one rank.

    Attributes:
        wire_bytes: bytes this rank put on the wire, by the formulas in this module; with
            ``hierarchy=`` the inter-node bytes only (collectives over the cross-node group).
        intra_bytes: with ``hierarchy=``, the bytes of the collectives inside the node (fast links); 0 when flat.
        dense_bytes: bytes dense DDP (fp32 ring all-reduce of every bucket over all W ranks) would have sent.
        steps: optimizer steps whose gradients went through the hook.
        compressed_steps: steps at which the compressor ran (after ``start_step``).
        collectives: number of collectives issued.
        nonfinite_steps: buckets that held NaN/Inf on some rank and were reduced densely.
        hook_seconds: wall time the hook blocks the autograd thread (queueing a bucket: small).
        comm_thread_seconds: wall time the communication thread spends on buckets (compression, decoding,
            and waits for the collectives it needs in line; the last collective of a bucket runs on).
        wait_seconds: the part of ``comm_thread_seconds`` spent blocked in collectives (the blocking calls of
            :class:`Comm` and the hook's explicit waits).
        callback_seconds: wall time of the Future callbacks (decoding, writing the result into the bucket) that
            ran after their collective completed, on the thread that completed it (gloo's); callbacks that ran
            inline are part of ``comm_thread_seconds``. ``comm_thread_seconds - wait_seconds + callback_seconds``
            is the compression work.
        layers: per-layer figures, keyed by parameter name.
    """

    wire_bytes: float = 0.0
    intra_bytes: float = 0.0
    dense_bytes: float = 0.0
    steps: int = 0
    compressed_steps: int = 0
    collectives: int = 0
    nonfinite_steps: int = 0
    hook_seconds: float = 0.0
    comm_thread_seconds: float = 0.0
    wait_seconds: float = 0.0
    callback_seconds: float = 0.0
    layers: dict[str, LayerStats] = field(default_factory=dict)

    @property
    def compression_ratio(self) -> float:
        """Dense-equivalent bytes divided by wire bytes (:func:`compression_ratio`: 1.0 before any traffic)."""
        return compression_ratio(self.dense_bytes, self.wire_bytes)

    def layer(self, name: str) -> LayerStats:
        """The (created on demand) figures of one layer."""
        if name not in self.layers:
            self.layers[name] = LayerStats()
        return self.layers[name]

    def add_wire(self, nbytes: float, shares: Optional[LayerShares] = None) -> None:
        """Count ``nbytes`` sent, attributing them to layers in proportion to ``shares``."""
        self.wire_bytes += nbytes
        self.collectives += 1
        if not shares:
            return
        total = sum(n for _, n in shares)
        if total <= 0:
            return
        for name, n in shares:
            self.layer(name).wire_bytes += nbytes * n / total

    def add_callback(self, seconds: float) -> None:
        """Add ``seconds`` to :attr:`callback_seconds` (safe from several threads at once)."""
        with _CALLBACK_LOCK:
            self.callback_seconds += seconds

    def add_intra(self, nbytes: float) -> None:
        """Count ``nbytes`` sent inside the node (``hierarchy=``: fast links; not attributed to layers)."""
        self.intra_bytes += nbytes
        self.collectives += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain, ``weights_only``-loadable representation."""
        return {
            "wire_bytes": self.wire_bytes,
            "intra_bytes": self.intra_bytes,
            "dense_bytes": self.dense_bytes,
            "steps": self.steps,
            "compressed_steps": self.compressed_steps,
            "collectives": self.collectives,
            "nonfinite_steps": self.nonfinite_steps,
            "hook_seconds": self.hook_seconds,
            "comm_thread_seconds": self.comm_thread_seconds,
            "wait_seconds": self.wait_seconds,
            "callback_seconds": self.callback_seconds,
            "layers": {k: dict(vars(v)) for k, v in self.layers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        for key in (
            "wire_bytes",
            "intra_bytes",
            "dense_bytes",
            "steps",
            "compressed_steps",
            "collectives",
            "nonfinite_steps",
            "hook_seconds",
            "comm_thread_seconds",
            "wait_seconds",
            "callback_seconds",
        ):
            setattr(self, key, state.get(key, getattr(self, key)))
        self.layers = {k: LayerStats(**v) for k, v in state.get("layers", {}).items()}
