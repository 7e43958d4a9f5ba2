"""The names of the metrics :class:`~lightning_gradcomp.callbacks.CompressionLogger` logs, and their meaning (the
table in ``docs/monitoring.md``)."""

from __future__ import annotations

__all__ = [
    "COMPRESSION_STEP",
    "COMPRESSION_WHOLE_RUN",
    "DENSE_BYTES",
    "DENSE_BYTES_TOTAL",
    "EPOCH_COMPRESSION",
    "EPOCH_DENSE_BYTES",
    "EPOCH_ERROR",
    "EPOCH_HOOK_MS",
    "EPOCH_HOOK_MS_MAX",
    "EPOCH_RATIO",
    "EPOCH_WIRE_BYTES",
    "ERROR",
    "HOOK_MS",
    "LAYER_COMPRESSION",
    "LAYER_ERROR",
    "LAYER_METRICS",
    "LAYER_PARAM",
    "LAYER_RATIO",
    "LAYER_WIRE_BYTES",
    "MEMORY_NORM",
    "METRICS",
    "NONFINITE_BUCKETS",
    "PROG_BAR_EVERY_N_STEPS",
    "RATIO",
    "RATIO_TOTAL",
    "WIRE_BYTES",
    "WIRE_BYTES_TOTAL",
    "INTRA_BYTES",
]

WIRE_BYTES = "gradcomp/wire_bytes"
DENSE_BYTES = "gradcomp/dense_bytes"
WIRE_BYTES_TOTAL = "gradcomp/wire_bytes_total"
INTRA_BYTES = "gradcomp/intra_bytes"
DENSE_BYTES_TOTAL = "gradcomp/dense_bytes_total"
COMPRESSION_STEP = "gradcomp/compression_step"
COMPRESSION_WHOLE_RUN = "gradcomp/compression_whole_run"
HOOK_MS = "gradcomp/hook_ms"
MEMORY_NORM = "gradcomp/memory_norm"
NONFINITE_BUCKETS = "gradcomp/nonfinite_buckets"
ERROR = "gradcomp/error"
EPOCH_WIRE_BYTES = "gradcomp/epoch/wire_bytes"
EPOCH_DENSE_BYTES = "gradcomp/epoch/dense_bytes"
EPOCH_COMPRESSION = "gradcomp/epoch/compression"
EPOCH_HOOK_MS = "gradcomp/epoch/hook_ms"
EPOCH_HOOK_MS_MAX = "gradcomp/epoch/hook_ms_max"
EPOCH_ERROR = "gradcomp/epoch/error"
LAYER_WIRE_BYTES = "gradcomp/layer_wire_bytes/"
LAYER_COMPRESSION = "gradcomp/layer_compression/"
LAYER_ERROR = "gradcomp/layer_error/"
LAYER_PARAM = "gradcomp/layer_param/"

# names of the release before the compression got one word (the metric strings changed with them)
RATIO = COMPRESSION_STEP
RATIO_TOTAL = COMPRESSION_WHOLE_RUN
EPOCH_RATIO = EPOCH_COMPRESSION
LAYER_RATIO = LAYER_COMPRESSION

PROG_BAR_EVERY_N_STEPS = 10
"""Period (in reductions) of the progress-bar update of ``gradcomp/compression_step``."""

METRICS: dict[str, str] = {
    WIRE_BYTES: "bytes rank 0 sent per step (mean over the steps since the previous log)",
    DENSE_BYTES: "bytes a dense fp32 ring all-reduce would have sent per step (same steps)",
    WIRE_BYTES_TOTAL: "cumulative bytes rank 0 sent since the start of training",
    INTRA_BYTES: "bytes rank 0 sent per step inside its node or shard group (hierarchy= or GradCompFSDPStrategy: "
    "logged only there; the wire bytes are then the ones across nodes or replicas)",
    DENSE_BYTES_TOTAL: "cumulative dense-equivalent bytes",
    COMPRESSION_STEP: "compression dense / wire of the recent steps, those since the previous log: the rate per "
    "compressed step once the dense warm-up is over (progress bar)",
    COMPRESSION_WHOLE_RUN: "compression dense / wire over the whole run so far, the dense warm-up included",
    HOOK_MS: "wall time of the communication hook per step, milliseconds (rank 0)",
    MEMORY_NORM: "L2 norm of rank 0's error-feedback memory (compressors with error feedback)",
    NONFINITE_BUCKETS: "cumulative buckets reduced densely because some rank saw NaN/Inf",
    ERROR: "relative compression error ||p - C(p)|| / ||p|| of rank 0 at a sampled step",
    EPOCH_WIRE_BYTES: "bytes sent by all ranks together during the epoch (torchmetrics SumMetric)",
    EPOCH_DENSE_BYTES: "dense-equivalent bytes of all ranks during the epoch (SumMetric)",
    EPOCH_COMPRESSION: "compression dense / wire of the whole epoch over all ranks (its dense warm-up included)",
    EPOCH_HOOK_MS: "hook milliseconds per step, mean over steps and ranks (MeanMetric)",
    EPOCH_HOOK_MS_MAX: "hook milliseconds per step of the slowest rank (MaxMetric)",
    EPOCH_ERROR: "mean relative compression error over the epoch's samples on all ranks (MeanMetric)",
}
"""Global metric names and their meaning."""

LAYER_METRICS: dict[str, str] = {
    LAYER_WIRE_BYTES: "bytes per step attributed to the layer (``per_layer=True``)",
    LAYER_COMPRESSION: "the layer's compression dense / wire since the previous log (``per_layer=True``)",
    LAYER_ERROR: "the layer's relative compression error at a sampled step (``per_layer=True``)",
    LAYER_PARAM: "the layer's compression parameter (density/rank/bits); the name for any per-layer tuner",
}
"""Per-layer metric prefixes; the full name appends the parameter name (``body.0.weight``)."""
