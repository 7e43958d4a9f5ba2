"""The "nothing was compressed" guard: warn once, loudly, when compression silently does nothing.

Compressed training that "pretends to run" is the most common complaint about gradient compression
(a missing backend, a wrong strategy name, every layer below the size threshold): the run succeeds,
but no byte is saved. :class:`CompressionGuard` checks, after the dense warm-up plus a few compressed
steps, that the compression (dense / wire bytes) measured over those steps is clearly above 1, and otherwise
explains why and how to fix it. The diagnosis functions are pure so they can be tested without a run.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gradcomp.checks import check_int, check_number
from lightning_gradcomp.comm import compression_ratio
from lightning_gradcomp.hook import GradCompHook
from lightning_gradcomp.plan import SlotPolicy
from lightning_gradcomp.strategy import GradCompStrategy

__all__ = [
    "CompressionGuard",
    "CompressionWarning",
    "diagnose_layout",
    "diagnose_strategy",
    "loud",
    "single_process_note",
]


class CompressionWarning(UserWarning):
    """Compression is configured but does not reduce the bytes on the wire."""


def loud(headline: str, why: str) -> str:
    """Format a multi-line, hard-to-miss warning message."""
    bar = "!" * 78
    return f"\n{bar}\nGradComp: {headline}\n{why}\n{bar}"


def compressing_strategies() -> tuple[Any, ...]:
    """The strategies whose gradient reduction compresses (their ``hook`` has the surface the callbacks read).

    Imported here, not at the top: importing ``fsdp_strategy`` declares its presets, which must come after the
    ``GradCompStrategy`` ones in ``lightning-gradcomp list``."""
    from lightning_gradcomp.fsdp_strategy import GradCompFSDPStrategy

    return (GradCompStrategy, GradCompFSDPStrategy)


def judged(strategy: Any) -> bool:
    """Whether the guard judges ``strategy``: one of :func:`compressing_strategies` that reduces at every step (not
    Local SGD on FSDP2, whose replicas meet every ``local_steps`` steps)."""
    return isinstance(strategy, compressing_strategies()) and getattr(strategy, "per_step_reduction", True)


def diagnose_strategy(strategy: Any) -> Optional[str]:
    """Problems visible before any step: wrong strategy, a single process, no hook.

    Returns:
        A human explanation with a fix, or ``None`` when the strategy can compress.
    """
    if not judged(strategy):
        return (
            f"trainer.strategy is {type(strategy).__name__}, not GradCompStrategy, so gradients are "
            f"reduced densely (or not communicated at all).\nFix: Trainer(strategy=GradCompStrategy("
            f'compressor=...)) or a preset name such as strategy="gradcomp_topk" (run '
            f"`lightning-gradcomp list` for all names; `import lightning_gradcomp` registers them)."
        )
    if strategy.world_size < 2:
        return single_process_note(strategy)
    if not isinstance(strategy, GradCompStrategy):  # GradCompFSDPStrategy
        if strategy.num_replicas < 2:
            return (
                f"GradCompFSDPStrategy shards the model over all {strategy.world_size} processes: one replica, "
                "so no gradient crosses replicas and nothing is compressed (FSDP2's reduce-scatter is dense).\nFix: "
                "shard_size= a divisor of the world size below it (the processes of one node), so that replicas exist."
            )
        if strategy.hook is None:
            return (
                "GradCompFSDPStrategy has no replica reduction: no FSDPModule of the model holds parameters.\nFix: "
                "call fully_shard(module, mesh=self.device_mesh['shard']) in configure_model, or pass shard_modules=."
            )
        return None
    if strategy.hook is None:
        return (
            "GradCompStrategy has no communication hook: the model was not wrapped in "
            "DistributedDataParallel, or a subclass overrode _register_ddp_hooks() without calling "
            "super().\nFix: keep GradCompStrategy._register_ddp_hooks() in the call chain."
        )
    return None


def single_process_note(strategy: Any) -> str:
    """What a strategy does on one process (world size 1), where no gradient is communicated."""
    if getattr(strategy, "single_process", "dense") == "dense":
        return (
            "only one process takes part (world size 1): there is no gradient communication to compress, so "
            "gradients pass through densely, as with DDP (single_process='dense').\nTo exercise the compressor "
            "on one device: single_process='compress'; to save bytes: devices>=2 (or num_nodes>=2)."
        )
    return (
        "only one process takes part (world size 1): the compressor runs (single_process='compress'), but there "
        "is no gradient communication, so no byte is saved.\nCompression only pays off across processes: "
        "devices>=2 (or num_nodes>=2)."
    )


def diagnose_layout(hook: GradCompHook, policy: SlotPolicy, ratio: float, steps: int) -> str:
    """Explain why the compression ``ratio`` (dense / wire bytes over ``steps`` compressed steps) stayed near 1.

    Args:
        hook: the rank's engine (its layer plans and compressor).
        policy: the strategy's size policy.
        ratio: the measured compression (dense / wire bytes).
        steps: number of steps the compression was measured over.
    """
    head = f"compression (dense / wire bytes) {ratio:.3f}x over {steps} step(s) after the dense warm-up."
    compressor = type(hook.compressor).__name__
    slots = [slot for plan in hook.plans() for slot in plan.slots]
    if hook.stats.steps == 0 or not slots:
        return (
            f"the communication hook never ran ({head})\nDDP did not call it: are all parameters frozen, "
            f"or is every backward run under no_sync()?\nFix: check that gradients are produced and "
            f"synchronised."
        )
    compressed = [s for s in slots if s.compressed]
    if not compressed:
        one_d = [s for s in slots if len(s.shape) <= 1 and not policy.compress_1d]
        small = [s for s in slots if s not in one_d and s.numel < policy.min_numel]
        vetoed = [s for s in slots if s not in one_d and s not in small]
        largest = max(slots, key=lambda s: s.numel)
        parts = [f"{len(small)} tensor(s) have fewer than min_numel={policy.min_numel} elements"] if small else []
        if one_d:
            parts.append(f"{len(one_d)} are 1-D (compress_1d=False)")
        if vetoed:
            parts.append(f"{len(vetoed)} were declined by {compressor}.accepts()")
        return (
            f"NO gradient tensor is compressed: {head}\nOf {len(slots)} gradient tensors, "
            f"{'; '.join(parts)}. Everything goes through the dense all-reduce.\nThe largest tensor is "
            f"{largest.name!r} with {largest.numel} elements.\nFix: lower GradCompStrategy(min_numel=...) to "
            f"at most {largest.numel} (and set compress_1d=True to compress vectors too), or train a larger "
            f"model."
        )
    total = sum(s.numel for s in slots)
    share = sum(s.numel for s in compressed) / total if total else 0.0
    params = sorted({str(hook.param_of(s.name)) for s in compressed})
    pname = hook.compressor.param_name or "parameter"
    return (
        f"compression does not reduce traffic: {head}\nOnly {len(compressed)} of {len(slots)} tensors "
        f"({100 * share:.1f}% of the gradient elements) are compressed by {compressor} "
        f"({pname}: {', '.join(params)}); the dense remainder and the compressed payloads (which may grow with "
        f"the world size, e.g. all-gathered sparse values plus indices) cost as much as a dense all-reduce.\n"
        f"Fix: lower min_numel / set compress_1d=True to compress more tensors, or compress harder."
    )


class CompressionGuard(Callback):
    """Warn once, loudly (a :class:`CompressionWarning` on rank 0), when nothing is being compressed.

    Checks at train start that the strategy can compress (a :class:`GradCompStrategy` over >= 2
    processes with its hook registered), then, ``warmup_steps`` compressed steps after the strategy's
    ``start_step``, that the compression (dense / wire bytes) over those compressed steps is at least
    ``min_compression``. A dense compressor (``NoCompression``, the reference) and a single process (world size 1,
    where the strategy's ``single_process`` decides) only get an info message.

    Args:
        warmup_steps: compressed steps to observe before judging (>= 1).
        min_compression: a compression below this counts as "nothing compressed" (> 1).
        min_ratio: deprecated name of ``min_compression`` (warns with a ``DeprecationWarning``).
    """

    def __init__(
        self, warmup_steps: int = 3, min_compression: float = 1.05, *, min_ratio: Optional[float] = None
    ) -> None:
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1, 10**9)
        name = "min_compression"
        if min_ratio is not None:
            warnings.warn(
                f"CompressionGuard(min_ratio=...) is deprecated: use CompressionGuard(min_compression={min_ratio!r})",
                DeprecationWarning,
                stacklevel=2,
            )
            name, min_compression = "min_ratio", min_ratio
        self.min_compression = float(check_number(name, min_compression, 1.0, float("inf"), high_open=True))
        self.message: Optional[str] = None
        self._done = False
        self._baseline: Optional[tuple[int, float, float]] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the strategy itself."""
        self._done, self._baseline = False, None
        strategy: Any = trainer.strategy  # a GradCompStrategy or GradCompFSDPStrategy when judged
        problem = diagnose_strategy(strategy)
        if judged(strategy) and strategy.world_size < 2:  # by design: say it, quietly
            self._done = True
            rank_zero_info(f"GradComp: {single_process_note(strategy)}")
        elif problem is not None:
            self._warn("NOTHING IS BEING COMPRESSED.", problem)
        elif judged(strategy) and strategy.compressor.dense:  # no problem: by design
            self._done = True
            rank_zero_info(
                f"GradComp: {type(strategy.compressor).__name__} sends dense gradients "
                f"(reference configuration): compression 1x by design."
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Judge the ratio once ``warmup_steps`` compressed steps have been seen."""
        self.check(trainer, final=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Judge short runs that ended before the warm-up did (if any step was compressed)."""
        self.check(trainer, final=True)

    def check(self, trainer: pl.Trainer, final: bool) -> None:
        """Measure the compression since the warm-up and warn (once) when it stays below ``min_compression``."""
        if self._done:
            return
        strategy: Any = trainer.strategy  # duck-typed: anything with hook, start_step and policy
        hook: Optional[GradCompHook] = getattr(strategy, "hook", None)
        if hook is None:
            return
        stats = hook.stats
        if hook.stats.steps == 0 and trainer.global_step >= strategy.start_step + self.warmup_steps:
            self._warn("NOTHING IS BEING COMPRESSED.", diagnose_layout(hook, strategy.policy, 1.0, 0))
            return
        if hook.step < hook.start_step:
            return
        if self._baseline is None:
            self._baseline = (hook.step, stats.wire_bytes, stats.dense_bytes)
            if not final:
                return
        step0, wire0, dense0 = self._baseline
        steps = hook.step - step0
        if steps < (1 if final else self.warmup_steps):
            return
        wire, dense = stats.wire_bytes - wire0, stats.dense_bytes - dense0
        ratio = compression_ratio(dense, wire)
        self._done = True
        if ratio < self.min_compression:
            self._warn("NOTHING IS BEING COMPRESSED.", diagnose_layout(hook, strategy.policy, ratio, steps))

    def _warn(self, headline: str, why: str) -> None:
        self._done = True
        self.message = why
        rank_zero_warn(loud(headline, why), category=CompressionWarning)
