"""SwarmStrategy: decentralized SGD with local steps and quantized pairwise model averaging (SwarmSGD).

Design choice: the strategy subclasses Lightning's ``DDPStrategy`` for its launchers, process-group
setup, distributed samplers and logging collectives, but **does not wrap the model in
DistributedDataParallel**: there is no gradient reducer at all, so every rank steps on its own
gradient with no per-step collective (a DDP wrapper with a no-op hook would still copy gradients into
buckets, and its construction-time broadcast would overwrite per-rank models on resume). The initial
parameters are broadcast from rank 0 once at the start of ``fit`` (skipped when resuming per-rank
models).

Two modes: ``"async"`` (default) pairs whoever is ready, with no global round, through store-based
match-making and a background exchange thread (:mod:`lightning_gradcomp.swarm.asynchronous`); ``"lockstep"``
runs the shared-seed matching rounds (the reproducible baseline).
"""

from __future__ import annotations

import copy
import logging
import numbers
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Optional, TypeVar, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.callbacks import EarlyStopping, Timer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp import checkpoint_shards
from lightning_gradcomp.checkpoint_shards import load_verified, resumable_hpc_checkpoint
from lightning_gradcomp.checks import (
    MAX_TIMEOUT_SECONDS,
    ArgumentTypeError,
    check_bool,
    check_int,
    check_number,
    check_timeout,
    is_int,
)
from lightning_gradcomp.comm import Comm, CommStats, all_reduce_bytes
from lightning_gradcomp.distributed import DEFAULT_TIMEOUT, release_group
from lightning_gradcomp.functional.finite import DeferredCount
from lightning_gradcomp.functional.realview import from_real, real_shape, real_view, real_view_numel
from lightning_gradcomp.presets import register_preset, register_presets
from lightning_gradcomp.replicas import DivergentReplicas
from lightning_gradcomp.sharded_checkpoints import ShardedCheckpoints
from lightning_gradcomp.swarm.asynchronous import (
    EXCHANGE_TIMEOUT_SETTING,
    AsyncGossip,
    PairingRecord,
    StoreMatchmaker,
    exchange_group,
)
from lightning_gradcomp.swarm.exchange import (
    ROUNDINGS,
    LatticeCodec,
    PairwiseGossip,
    PendingExchange,
    SwarmStats,
    contained_mean,
)
from lightning_gradcomp.swarm.pairing import TOPOLOGIES, Edges, Topology, matching, round_local_steps, topology_edges

__all__ = ["CHECKPOINT_KEY", "SwarmStrategy"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "swarm"
"""Top-level checkpoint key holding ``bits``, rank 0's round counters and the manifest of the per-rank shards."""

_CHECKPOINT_VERSION = 1
"""Version of the old single-file entry (every rank's state inline); still loaded, no longer written."""
_SHARD_WORDS = {"what": "rank-state", "contents": "model, optimizer states and gossip state"}
_EVAL_MODELS = ("mean", "rank0", "local")
MODES = ("async", "lockstep")
_T = TypeVar("_T")


class SwarmStrategy(DivergentReplicas, ShardedCheckpoints, DDPStrategy):
    """SwarmSGD: each rank trains its own model and averages it with one random partner every H steps.

    Every rank steps on its own gradient (no gradient all-reduce). In ``mode="async"`` (default) a rank
    that finished its ``local_steps`` looks for a neighbour that is ready *now* (store match-making, no
    global round) and the pair exchanges its ``bits``-bit lattice-coded models on a background thread
    while both keep training; the average is applied at the next step boundary with the local progress
    made meanwhile. A slow rank slows only itself. Every applied exchange is logged
    (:attr:`pairing_log`); ``replay`` reproduces a run from the logs. In ``mode="lockstep"`` all ranks
    enter a gossip round after every ``local_steps`` steps: a matching of ``topology`` drawn from
    ``(seed, round)`` (the same on every rank, so nobody has to ask) pairs them up, and each pair
    exchanges its models point-to-point as ``bits``-bit lattice codes decoded against the receiver's own
    model; both ends then hold ``(Q(x_a) + Q(x_b)) / 2``. With ``non_blocking`` (default) the exchange
    overlaps the next local steps and the average is applied at the next round, together with the local
    progress made meanwhile: ``x <- avg(x_old, x_partner_old) + (x_now - x_old)``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=4, strategy=SwarmStrategy(local_steps=4, bits=8))
        trainer.fit(model)
        trainer.strategy.comm_stats.wire_bytes   # gossip bytes sent by this rank
        trainer.strategy.swarm_stats.fallback_blocks   # blocks resent in fp32 (wrap-around guard)

    Tuning: small ``local_steps`` (1-4) keep the models close (raise it when the link is slow);
    lower ``bits`` shrink messages further but coarsen the average (per-coordinate error at most half a
    lattice side, the side being about ``lattice_margin * distance / 2**(bits - 1)``); if
    ``swarm_stats.fallback_blocks`` grows by more than a few percent of the blocks exchanged, the
    distance estimate is too tight: raise ``lattice_margin``.

    Args:
        local_steps: optimizer steps between gossip rounds (H, >= 1).
        geometric_local_steps: draw each round's H from a geometric distribution with mean
            ``local_steps`` (shared draw, so ranks stay in lock-step) instead of using it fixed.
        topology: ``"complete"``, ``"ring"``, ``"torus"``, or a connected graph as a list of edges
            ``[(i, j), ...]`` over ranks.
        torus_shape: ``(rows, cols)`` of the torus (default: the most square factorization of W).
        bits: bits per coordinate of the lattice codes, 1 to 8; ``None`` exchanges fp32 models.
        block_size: coordinates sharing one lattice side and one checksum (8 bytes per block).
        lattice_margin: sides decode exactly for partners up to this many times the estimated
            distance away (>= 1); blocks that wrap (or could have) are resent in fp32.
        non_blocking: overlap the exchange with the next local steps (``False``: average at once).
        eval_model: model used by validation/test/predict: ``"mean"`` of all ranks (one all-reduce
            at evaluation start, local models restored after), ``"rank0"`` (broadcast) or ``"local"``.
        average_at_end: replace every rank's model with the mean when ``fit`` ends.
        monitor_every: every this many rounds measure the consensus distance
            ``max_i ||x_i - mean||`` (two global collectives; 0 disables).
        seed: shared seed of the pairings, of geometric H and of the dither.
        mode: ``"async"`` (pair with whoever is ready, no global round) or ``"lockstep"`` (shared matching
            rounds; the reproducible baseline).
        replay: async only: every rank's pairing log (a list indexed by rank of :attr:`pairing_log` lists,
            or a dict rank -> list); each rank then repeats the logged exchanges at the logged steps.
        rounding: ``"nearest"`` (deterministic, biased) or ``"dithered"`` (shared-seed dither: unbiased,
            same bytes) lattice rounding.
        gossip_buffers: gossip floating-point buffers (BatchNorm running statistics) with the parameters,
            so every model's statistics follow its averaged weights.
        exchange_timeout: seconds after which an async exchange with a silent partner fails (dead partner), at
            least 1e-6 (a microsecond, the unit of the process group's timeout), at most 1e12
            (:data:`~lightning_gradcomp.checks.MAX_TIMEOUT_SECONDS`).
        timeout: process-group timeout, a ``timedelta`` or seconds (> 0); ``None`` uses PyTorch's backend
            default. Default :data:`~lightning_gradcomp.distributed.DEFAULT_TIMEOUT` (10 minutes), as for
            :class:`~lightning_gradcomp.GradCompStrategy`.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, start_method: as for :class:`~lightning.pytorch.strategies.DDPStrategy`.
    """

    strategy_name = "swarmsgd"
    _name_in_messages = "SwarmStrategy"

    def __init__(
        self,
        local_steps: int = 1,
        geometric_local_steps: bool = False,
        topology: Topology = "complete",
        torus_shape: Optional[tuple[int, int]] = None,
        bits: Optional[int] = 8,
        block_size: int = 1024,
        lattice_margin: float = 4.0,
        non_blocking: bool = True,
        eval_model: Literal["mean", "rank0", "local"] = "mean",
        average_at_end: bool = True,
        monitor_every: int = 0,
        seed: int = 0,
        mode: Literal["async", "lockstep"] = "async",
        replay: Optional[Any] = None,
        rounding: Literal["nearest", "dithered"] = "nearest",
        gossip_buffers: bool = True,
        exchange_timeout: float = 120.0,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[timedelta, float, None] = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.local_steps = check_int("local_steps", local_steps, 1)
        self.geometric_local_steps = check_bool("geometric_local_steps", geometric_local_steps)
        self.topology = _check_topology(topology)
        self.torus_shape = None if torus_shape is None else _check_shape(torus_shape)
        if self.torus_shape is not None and self.topology != "torus":
            raise ValueError(f"`torus_shape` applies to topology='torus' only, got topology={self.topology!r}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"`rounding` must be one of {ROUNDINGS}, got {rounding!r}")
        self.rounding = rounding
        # built whatever ``bits`` is, so that block_size and lattice_margin are checked for fp32 exchanges too
        codec = LatticeCodec(
            bits=8 if bits is None else bits, block_size=block_size, margin=lattice_margin, rounding=rounding
        )
        self.codec = None if bits is None else codec
        self.bits = bits
        self.non_blocking = check_bool("non_blocking", non_blocking)
        if eval_model not in _EVAL_MODELS:
            raise ValueError(f"`eval_model` must be one of {_EVAL_MODELS}, got {eval_model!r}")
        self.eval_model = eval_model
        self.average_at_end = check_bool("average_at_end", average_at_end)
        self.monitor_every = check_int("monitor_every", monitor_every, 0)
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        self.mode = mode
        if mode == "async" and self.monitor_every:
            raise ValueError(
                "`monitor_every` needs mode='lockstep': measuring the consensus distance is a global "
                "collective, which would put the asynchronous ranks back in lock-step"
            )
        if replay is not None and mode != "async":
            raise ValueError("`replay` reproduces an asynchronous run: it needs mode='async'")
        self.replay = _check_replay(replay)
        self.gossip_buffers = check_bool("gossip_buffers", gossip_buffers)
        self.exchange_timeout = float(  # a timedelta holds whole microseconds: less would round to no timeout
            check_number("exchange_timeout", exchange_timeout, 1e-6, MAX_TIMEOUT_SECONDS, low_open=False)
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=check_timeout(timeout),
            start_method=start_method,
        )
        self._swarm_stats = SwarmStats()
        self._nonfinite = DeferredCount()  # local steps zeroed for NaN/Inf, not yet in swarm_stats
        self._comm_stats = CommStats()
        self._aux_stats = CommStats()
        self._comm: Optional[Comm] = None
        self._aux: Optional[Comm] = None
        self._engine: Optional[PairwiseGossip] = None
        self._params: list[Tensor] = []
        self._gossip_names: list[str] = []
        self._param_numel = 0
        self._async: Optional[AsyncGossip] = None
        self._store: Optional[dist.Store] = None
        self._edges: Optional[Edges] = None
        self._pending: Optional[PendingExchange] = None
        self._round_index = 0
        self._steps_in_round = 0
        self._round_length = round_local_steps(self.local_steps, self.geometric_local_steps, self.seed, 0)
        self._eval_backup: Optional[dict[str, Tensor]] = None
        self._restored: Optional[dict[str, Any]] = None
        self._restored_counters: Optional[dict[str, Any]] = None
        self._rank_local = False  # async training: Lightning's global decisions are taken on each rank alone
        self._warned_sync_dist = False

    # ------------------------------------------------------------------ public state
    @property
    def comm_stats(self) -> CommStats:
        """This rank's gossip traffic (``wire_bytes``) next to what DDP would send (``dense_bytes``)."""
        return self._comm_stats

    @property
    def aux_comm_stats(self) -> CommStats:
        """Traffic outside gossip rounds: start broadcast, evaluation averages, monitoring, checkpoints."""
        return self._aux_stats

    @property
    def swarm_stats(self) -> SwarmStats:
        """Rounds, exchanges, rounds sat out, fp32 fallbacks, the last consensus distance and NaN/Inf events (the
        zeroed local steps counted up to now: a host read)."""
        self._fold_nonfinite()
        return self._swarm_stats

    def _fold_nonfinite(self) -> None:
        """Add the local steps counted on the device since the last fold to ``swarm_stats`` (a host read)."""
        self._swarm_stats.nonfinite_steps += self._nonfinite.take()

    @property
    def round_index(self) -> int:
        """Lock-step: gossip rounds started so far (identical on all ranks). Async: this rank's attempts."""
        return self._async.attempts if self._async is not None else self._round_index

    @property
    def pairing_log(self) -> list[PairingRecord]:
        """Async: this rank's applied exchanges.

        Entries are ``(pub_step, partner, partner_pub_step, ticket, apply_step, drained)``.
        """
        return list(self._async.log) if self._async is not None else []

    def message_bytes(self, numel: int) -> int:
        """Bytes one rank sends per exchange of a ``numel``-parameter model (no fallback)."""
        return self.codec.message_bytes(numel) if self.codec is not None else 4 * numel

    def partners(self, round_index: int) -> list[int]:
        """Partner of every rank in ``round_index`` (``-1``: sits out)."""
        return matching(
            self.topology, self.world_size, self.seed, round_index, shape=self.torus_shape, edges=self._edges
        )

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self._layer_sync is not None:
            raise ValueError(
                "SwarmStrategy does not support `sync_batchnorm=True`: ranks train separate models "
                "(BatchNorm statistics stay local and are averaged for evaluation)"
            )
        super().setup(trainer)
        self._ensure_comms()

    @override
    def configure_ddp(self) -> None:
        """Keep the LightningModule unwrapped (no gradient reducer) and prepare the gossip engine."""
        assert isinstance(self.model, pl.LightningModule)
        self._ensure_comms()
        assert self._comm is not None
        if self._edges is None and not isinstance(self.topology, str):
            self._edges = topology_edges(self.topology, self.world_size)
        elif isinstance(self.topology, str):
            topology_edges(self.topology, self.world_size, self.torus_shape)  # validates torus_shape
        if self.replay is not None:
            _check_replay_ranks(self.replay, self.world_size)
        named: list[tuple[str, Tensor]] = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._param_numel = sum(real_view_numel(p) for _, p in named)  # real numbers: a complex entry is two
        if self.gossip_buffers:
            named += [(n, b) for n, b in self.model.named_buffers() if b.is_floating_point()]
        self._gossip_names = [n for n, _ in named]
        self._params = [t for _, t in named]
        numel = sum(real_view_numel(p) for p in self._params)
        comm = self._comm
        if self.mode == "async" and self.world_size > 1:
            comm = Comm(
                exchange_group(self.exchange_timeout), self._comm_stats, timeout_setting=EXCHANGE_TIMEOUT_SETTING
            )
        self._engine = PairwiseGossip(comm, numel, self.codec, self._swarm_stats, seed=self.seed)
        restored = self._restored
        if restored is None:
            self._broadcast_start()
        else:
            self._engine.load_state_dict(restored["gossip"])
            self._comm_stats.load_state_dict(restored["comm_stats"])
            if restored.get("pending") is not None:
                self._pending = self._engine.restore_pending(restored["pending"])
        if self._restored_counters is not None:
            self._round_index = int(self._restored_counters["round_index"])
            self._steps_in_round = int(self._restored_counters["steps_in_round"])
            self._round_length = int(self._restored_counters["round_length"])
        if self.codec is not None and restored is None:
            self._engine.anchor = self._flat_params().clone()  # the common start: first distance estimate
        if self.mode == "async" and self.world_size > 1:
            self._setup_async(restored)

    def _setup_async(self, restored: Optional[dict[str, Any]]) -> None:
        """Match-making store (fresh prefix per setup), the background exchange engine, restored counters."""
        assert self._engine is not None
        edges = (
            self._edges if self._edges is not None else topology_edges(self.topology, self.world_size, self.torus_shape)
        )
        rank = self.global_rank
        neighbours = sorted({j for i, j in edges if i == rank} | {i for i, j in edges if j == rank})
        default = dist.distributed_c10d._get_default_store()
        generation = (int(default.add("swarmsgd/setups", 1)) - 1) // self.world_size
        self._store = dist.PrefixStore(f"swarmsgd/{generation}/", default)
        replay, matchmaker = None, None
        if self.replay is not None:
            replay = self.replay.get(rank, []) if isinstance(self.replay, dict) else self.replay[rank]
        else:
            matchmaker = StoreMatchmaker(self._store, rank, neighbours, self.seed)
            matchmaker.reset()
        self._async = AsyncGossip(
            self._engine,
            matchmaker,
            self.local_steps,
            self.geometric_local_steps,
            self.seed,
            self.exchange_timeout,
            replay=replay,
        )
        if restored is not None and restored.get("async") is not None:
            self._async.load_state_dict(restored["async"])
        dist.barrier(group=self._engine.comm.group)  # every state key exists before anybody claims
        self._async.start()

    def _await_peers(self, poll: float = 0.2) -> None:
        """Wait until every rank has finished training (async mode), however long the slowest one takes.

        Each rank counts its batches in the store (``beat/<rank>``, see :meth:`_unlock_training_loop`). The wait
        fails when a rank that has not finished completes no batch for ``max(exchange_timeout, 600)`` seconds
        (dead or hung; an evaluation loop in between is allowed that long).
        """
        assert self._store is not None
        store, rank, world = self._store, self.global_rank, self.world_size
        store.set(f"done/{rank}", "1")
        patience = max(self.exchange_timeout, 600.0)
        seen: dict[int, tuple[int, float]] = {}
        while True:
            pending = [r for r in range(world) if not store.check([f"done/{r}"])]
            if not pending:
                return
            now = time.monotonic()
            for r in pending:
                beat = int(store.add(f"beat/{r}", 0))
                if r not in seen or seen[r][0] != beat:
                    seen[r] = (beat, now)
                elif now - seen[r][1] > patience:
                    raise RuntimeError(
                        f"SwarmStrategy (rank {rank}): rank {r} has completed no batch for "
                        f"{patience:.0f} s while this rank waits for every rank to finish training: "
                        f"presumed dead or hung"
                    )
            time.sleep(poll)

    @override
    def on_train_start(self) -> None:
        self._restored = self._restored_counters = None  # consumed by setup and the optimizer restore
        if self._async is not None:
            self._unlock_training_loop()
            self._warn_collective_validation()
            self._rank_local = True
        super().on_train_start()

    def _unlock_training_loop(self) -> None:
        """Replace Lightning's per-batch SIGTERM broadcast by a store flag (async mode only).

        Lightning 2.6's training epoch loop broadcasts a SIGTERM flag from rank 0 before *every* batch
        (``_TrainingEpochLoop._broadcast_sigterm_tensor``): a global collective that would put the
        asynchronous ranks back in lock-step (measured: a 3x slower rank held every rank at its pace). On
        this trainer's loop instance, the check becomes: a rank that received SIGTERM sets a store key,
        and every rank raises ``SIGTERMException`` at its next batch once the key exists (no waiting).
        """
        loop = getattr(getattr(self.lightning_module.trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not hasattr(loop, "_broadcast_sigterm_tensor"):
            return
        assert self._store is not None
        store, trainer, beat = self._store, self.lightning_module.trainer, f"beat/{self.global_rank}"

        def check_sigterm() -> None:
            store.add(beat, 1)  # liveness for the end-of-training wait (_await_peers)
            if getattr(trainer, "received_sigterm", False):
                store.set("sigterm", "1")
            if store.check(["sigterm"]):
                raise SIGTERMException()

        loop._broadcast_sigterm_tensor = check_sigterm

    # ------------------------------------------------------------------ Lightning's decisions during async training
    @override
    def broadcast(self, obj: _T, src: int = 0) -> _T:
        """Lightning's broadcast; during asynchronous training ``obj`` itself, so each rank decides on its own.

        Lightning decides through this collective after every batch (``Timer``, ``max_time``) and around
        checkpoints; that would put the asynchronous ranks back in lock-step (docs/swarm.md).
        """
        return obj if self._rank_local else super().broadcast(obj, src)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's all/any over ranks; during asynchronous training this rank's ``decision`` (``EarlyStopping``,
        ``ModelCheckpoint``'s top-k)."""
        return decision if self._rank_local else super().reduce_boolean_decision(decision, all=all)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        """Lightning's barrier; no-op during asynchronous training (the end of ``fit`` waits for every rank)."""
        if not self._rank_local:
            super().barrier(name)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Lightning's reduction (``self.log(..., sync_dist=True)``); during asynchronous training this rank's value,
        with one warning naming the metrics (an all-reduce per step would put the ranks back in lock-step)."""
        if not self._rank_local:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        if not self._warned_sync_dist:
            self._warned_sync_dist = True
            names = _sync_dist_names(getattr(self.lightning_module.trainer, "_results", None))
            rank_zero_warn(
                f"SwarmStrategy(mode='async'): self.log(..., sync_dist=True) of {names or 'a metric'} would "
                "all-reduce over every rank at every step, which puts the asynchronous ranks back in lock-step (and "
                "hangs once they stop at different steps). During training each rank logs its own value, "
                "unreduced; log with sync_dist=False to silence this warning."
            )
        return tensor

    def _warn_collective_validation(self) -> None:
        """Warn when validation during ``fit`` is collective while the ranks may stop at different epochs."""
        trainer = self.lightning_module.trainer
        if self.eval_model == "local" or self.world_size < 2 or not getattr(trainer, "enable_validation", False):
            return
        own_clock = any(
            isinstance(c, EarlyStopping) or (isinstance(c, Timer) and c._duration is not None)
            for c in trainer.callbacks
        )
        if own_clock:
            rank_zero_warn(
                f"SwarmStrategy(mode='async', eval_model={self.eval_model!r}): every validation during fit "
                "averages over all ranks (a collective), but with a time limit or EarlyStopping each rank stops "
                "on its own clock, possibly after another number of validations: a rank left waiting there hangs. "
                "Use eval_model='local', or validate the averaged model after fit."
            )

    def _ensure_comms(self) -> None:
        if self._comm is None and dist.is_available() and dist.is_initialized():
            self._comm = Comm(None, self._comm_stats)
            self._aux = Comm(None, self._aux_stats)

    def _broadcast_start(self) -> None:
        """Give every rank rank 0's parameters and buffers (the common starting point)."""
        if self._aux is None or self.world_size < 2:
            return
        tensors = list(self.lightning_module.parameters()) + list(self.lightning_module.buffers())
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([real_view(t.detach()).reshape(-1) for t in group])
            self._aux.broadcast(flat, 0)
            _write_flat(group, flat)

    # ------------------------------------------------------------------ training
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Run the local step, then a gossip round every ``local_steps`` steps (first optimizer only).

        A gradient holding NaN/Inf is zeroed before the update (counted in ``swarm_stats.nonfinite_steps``),
        so it never reaches this rank's model and, through gossip, its partners. With a loss scaler (fp16 AMP)
        the scaler's own skip logic is left in charge.
        """
        closure = self._guarded(optimizer, closure, self._nonfinite.add)  # counted without a host sync
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._engine is not None and self._is_first_optimizer(optimizer):
            self._local_step_done()
        return output

    def _is_first_optimizer(self, optimizer: Optimizer) -> bool:
        if not self.optimizers:
            return True
        first = self.optimizers[0]
        return getattr(optimizer, "_optimizer", optimizer) is getattr(first, "_optimizer", first)

    def _local_step_done(self) -> None:
        assert self._engine is not None
        self._comm_stats.steps += 1
        self._comm_stats.dense_bytes += all_reduce_bytes(4 * self._param_numel, self.world_size)
        if self._async is not None:
            updated = self._async.boundary(self._comm_stats.steps, self._flat_params)
            if updated is not None:
                _write_flat(self._params, updated)
            return
        self._steps_in_round += 1
        if self._steps_in_round < self._round_length:
            return
        self._gossip_round()
        self._steps_in_round = 0
        self._round_index += 1
        self._round_length = round_local_steps(
            self.local_steps, self.geometric_local_steps, self.seed, self._round_index
        )

    def _gossip_round(self) -> None:
        assert self._engine is not None
        x = self._flat_params()
        if self._pending is not None:
            x = self._engine.complete(self._pending, x)
            self._pending = None
            _write_flat(self._params, x)
        partner = self.partners(self._round_index)[self.global_rank] if self.world_size > 1 else -1
        self._swarm_stats.rounds += 1
        if partner < 0:
            self._swarm_stats.sat_out += 1
        else:
            self._swarm_stats.exchanges += 1
            pending = self._engine.post(x, partner, self._round_index)
            if self.non_blocking:
                self._pending = pending
            else:
                _write_flat(self._params, self._engine.complete(pending))
        if self.monitor_every and (self._round_index + 1) % self.monitor_every == 0:
            self._measure_consensus()

    def flush(self, final: bool = False) -> None:
        """Apply a posted, not yet applied exchange now (no-op in blocking mode).

        Async: withdraw an unclaimed offer and finish and apply an exchange in flight (``final``: this rank
        takes part in no further exchange).
        """
        if self._async is not None:
            updated = self._async.drain(self._comm_stats.steps, self._training_flat, final=final)
            if updated is not None:
                self._write_training_flat(updated)
            return
        if self._pending is not None and self._engine is not None:
            _write_flat(self._params, self._engine.complete(self._pending, self._flat_params()))
            self._pending = None

    def _measure_consensus(self) -> None:
        assert self._aux is not None
        x = self._flat_params().double()
        mean = x.clone()
        self._aux.all_reduce(mean)
        mean /= self.world_size
        distance = torch.linalg.vector_norm(x - mean).reshape(1)
        self._aux.all_reduce(distance, op=dist.ReduceOp.MAX)
        self._swarm_stats.consensus = float(distance)
        self._swarm_stats.consensus_history.append(float(distance))

    @override
    def on_train_end(self) -> None:
        """Apply the last exchange and (``average_at_end``) give every rank the mean model.

        Async: every rank waits here for the others, so no rank leaves, taking the store server or its end of
        the exchange group with it, while another still trains. A fast rank may wait for a straggler far
        longer than any collective timeout, so it polls the store (:meth:`_await_peers`) and fails only when a
        rank that is still training stops completing batches; then one barrier, which every rank reaches.
        """
        self._rank_local = False
        self.flush(final=True)
        if self._async is not None:
            assert self._engine is not None  # _setup_async ran with it
            self._await_peers()
            dist.barrier(group=self._engine.comm.group)
        if self.average_at_end and self._aux is not None and self.world_size > 1:
            _write_named(self.lightning_module, self._mean_of(self._model_tensors()))
        super().on_train_end()

    # ------------------------------------------------------------------ evaluation on the averaged model
    def _model_tensors(self) -> dict[str, Tensor]:
        """Parameters and floating-point buffers, by name (what evaluation averages)."""
        module = self.lightning_module
        named = {n: p.detach() for n, p in module.named_parameters()}
        named.update({n: b.detach() for n, b in module.named_buffers() if b.is_floating_point()})
        return named

    def _mean_of(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Element-wise mean over ranks of named floating tensors (one all-reduce of their fp64 values).

        Where some rank's model holds NaN/Inf (it diverged and has not healed through an exchange yet), the mean
        there is over the finite ranks only (:func:`~lightning_gradcomp.swarm.exchange.contained_mean`, one more
        all-reduce of twice the size, only then), so one diverged rank does not poison the averaged model. Every
        rank reads the same sum, so every rank takes the same branch.
        """
        assert self._aux is not None
        flat = torch.cat([real_view(t).reshape(-1).double() for t in tensors.values()])
        self._aux.all_reduce(flat)
        finite = torch.isfinite(flat)
        if bool(finite.all()):  # one host read; evaluation, checkpoints and the end of fit only
            flat /= self.world_size
            return _split_real(flat, tensors)
        local = torch.cat([real_view(t).reshape(-1).double() for t in tensors.values()])
        local_finite = torch.isfinite(local)
        parts = torch.cat(
            [
                torch.where(local_finite, local, torch.zeros((), dtype=local.dtype, device=local.device)),
                local_finite.double(),
            ]
        )
        self._aux.all_reduce(parts)
        finite_total, finite_count = parts.chunk(2)
        mean = contained_mean(flat, finite_total, finite_count, self.world_size)
        if self.global_rank == 0:
            log.warning(
                f"SwarmSGD: {int((~finite).sum())} of {flat.numel()} coordinates of the mean over ranks met a "
                f"NaN/Inf model value; there the mean is over the ranks whose value is finite "
                f"({int((finite_count == 0).sum())} coordinates have none and stay NaN/Inf)"
            )
        return _split_real(mean, tensors)

    def _enter_eval(self) -> None:
        self._ensure_comms()
        if self._aux is None or self.world_size < 2 or self.eval_model == "local" or self._eval_backup is not None:
            return
        tensors = self._model_tensors()
        self._eval_backup = {n: t.clone() for n, t in tensors.items()}
        if self.eval_model == "mean":
            _write_named(self.lightning_module, self._mean_of(tensors))
        else:
            flat = torch.cat([real_view(t).reshape(-1).double() for t in tensors.values()])
            self._aux.broadcast(flat, 0)
            _write_named(self.lightning_module, _split_real(flat, tensors))

    def _exit_eval(self) -> None:
        if self._eval_backup is not None:
            _write_named(self.lightning_module, self._eval_backup)
            self._eval_backup = None

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``state_dict``: the mean over ranks of every floating tensor (an all-reduce).

        Integer buffers (e.g. ``num_batches_tracked``) are this rank's. Every rank must call this (as
        ``Trainer.save_checkpoint`` does). During asynchronous training: rank 0's own model, no collective
        (:meth:`save_checkpoint`).
        """
        if self._rank_local:
            if self.global_rank == 0:
                self.flush()  # its exchange in flight, if any, is applied first (waits for that partner only)
            return self._local_model_state()
        if self._async is not None:
            self.flush()  # async: apply exchanges in flight first, so the mean and the per-rank models agree
        state = self._local_model_state()
        self._ensure_comms()
        if self._aux is None or self.world_size < 2:
            return state
        floating = {k: v for k, v in state.items() if isinstance(v, Tensor) and v.is_floating_point()}
        state.update(self._mean_of(floating))
        return state

    def _rank_state(self) -> dict[str, Any]:
        if self._async is not None:
            self.flush()  # async: no exchange in flight while saving (lock-step keeps its pending exchange)
        self._fold_nonfinite()
        return {
            "async": self._async.state_dict() if self._async is not None else None,
            "model": self._local_model_state(),
            "optimizers": [copy.deepcopy(self.optimizer_state(o)) for o in self.optimizers],
            "counters": {
                "round_index": self._round_index,
                "steps_in_round": self._steps_in_round,
                "round_length": self._round_length,
            },
            "gossip": self._engine.state_dict() if self._engine is not None else None,
            "pending": self._pending.state_dict() if self._pending is not None else None,
            "comm_stats": self._comm_stats.state_dict(),
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write this rank's model, optimizer and gossip state to its shard next to ``filepath`` (all ranks).

        Rank 0's checkpoint gets, under ``"swarm"``, ``bits``, its round counters and the manifest of the shards
        (:mod:`lightning_gradcomp.sharded_checkpoints`); every rank gets the same error if one cannot write.

        During asynchronous training (a ``ModelCheckpoint`` firing on each rank's own step count or metrics) the save
        is rank 0's alone, without a collective: its file holds rank 0's model and optimizer states, and resuming from
        it starts every rank from them (:meth:`_save_replica`).
        """
        if self._rank_local:
            self._save_replica(checkpoint, filepath, storage_options)
            return
        local = self._rank_state()
        codec = type(self.codec).__name__ if self.codec is not None else "NoCompression"
        self._save_with_shards(
            checkpoint,
            filepath,
            storage_options,
            CHECKPOINT_KEY,
            local,
            codec,
            {},
            bits=self.bits,
            counters=local["counters"],
        )  # rank 0's counters: rank 0 writes

    def _save_replica(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        """Rank 0 writes ``checkpoint`` (its own model and optimizers) with ``bits``, its counters and
        ``"replica": 0`` under ``"swarm"``; the other ranks write nothing."""
        if self.global_rank != 0:
            return
        counters = {
            "round_index": self._round_index,
            "steps_in_round": self._steps_in_round,
            "round_length": self._round_length,
        }
        checkpoint[CHECKPOINT_KEY] = {"bits": self.bits, "counters": counters, "replica": 0}
        self._write_file(checkpoint, filepath, storage_options)  # atomically, as the sharded saves

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the (CRC-checked) checkpoint and this rank's shard (world-size policy: docs/swarm.md).

        An old single-file checkpoint (version 1, every rank's state inline) still loads.

        Raises:
            FileNotFoundError, RuntimeError: this or another rank's shard is missing or does not match the
                manifest (every rank raises; the message names the file).
            ValueError: the entry is malformed, or ``bits`` differs from this strategy's.
        """
        checkpoint_path = resumable_hpc_checkpoint(checkpoint_path)
        checkpoint = load_verified(
            lambda: super(SwarmStrategy, self).load_checkpoint(checkpoint_path, weights_only=weights_only),
            checkpoint_path,
        )
        saved = checkpoint.get(CHECKPOINT_KEY)
        self._restored = self._restored_counters = None
        if saved is None:
            return checkpoint
        if isinstance(saved, dict) and "replica" in saved:
            return self._load_replica(checkpoint, saved)
        sharded = checkpoint_shards.is_sharded(saved)
        checkpoint_shards.check_entry(saved, sharded, CHECKPOINT_KEY, ("bits", "counters"), _CHECKPOINT_VERSION)
        if saved["bits"] != self.bits:
            raise ValueError(
                f"checkpoint was written with bits={saved['bits']}, this strategy uses "
                f"bits={self.bits}; resume with the same setting"
            )
        self._restored_counters = saved["counters"] if sharded else saved["per_rank"][0]["counters"]
        if saved["world_size"] == self.world_size:
            self._restored = (
                self._load_own_shard(checkpoint_path, saved, weights_only, self.root_device, **_SHARD_WORDS)
                if sharded
                else saved["per_rank"][self.global_rank]
            )
        else:
            rank_zero_warn(
                f"SwarmStrategy: checkpoint was written by {saved['world_size']} ranks, resuming on "
                f"{self.world_size}: every rank starts from the mean model with rank 0's optimizer "
                f"state; the round counter is kept, the in-flight exchange is dropped"
            )
        return checkpoint

    def _load_replica(self, checkpoint: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint saved during asynchronous training (:meth:`_save_replica`): every rank resumes from it."""
        if saved.get("bits") != self.bits or not isinstance(saved.get("counters"), dict):
            raise ValueError(
                f"checkpoint entry {CHECKPOINT_KEY!r} must hold this strategy's bits={self.bits} and the counters, "
                f"got bits={saved.get('bits')!r}"
            )
        self._restored_counters = saved["counters"]
        rank_zero_info(
            "SwarmStrategy: this checkpoint was saved during asynchronous training and holds rank 0's model and "
            "optimizer states: every rank resumes from them"
        )
        return checkpoint

    @override
    def teardown(self) -> None:
        self._pending = None
        self._rank_local = False
        if self._async is not None and self._async.close():  # kept: its pairing log and counters stay readable
            assert self._engine is not None
            release_group(self._engine.comm.group)  # the exchange group (setup makes a new one for each fit)
        super().teardown()

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Re-register ``swarmsgd`` (+ ``_spawn`` / ``_fork``); idempotent, the preset below is registered already."""
        register_presets(strategy_registry, cls)

    # ------------------------------------------------------------------ helpers
    def _flat_params(self) -> Tensor:
        return torch.cat([real_view(p.detach()).reshape(-1).float() for p in self._params])

    def _training_tensors(self) -> list[Tensor]:
        """The gossiped tensors of this rank's *training* model (the saved copies during evaluation)."""
        if self._eval_backup is None:
            return self._params
        return [self._eval_backup.get(n, p) for n, p in zip(self._gossip_names, self._params)]

    def _training_flat(self) -> Tensor:
        return torch.cat([real_view(t.detach()).reshape(-1).float() for t in self._training_tensors()])

    def _write_training_flat(self, flat: Tensor) -> None:
        _write_flat(self._training_tensors(), flat)


def _write_flat(tensors: list[Tensor], flat: Tensor) -> None:
    """Copy consecutive pieces of the real vector ``flat`` into ``tensors`` (a complex one takes its real view's)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            target = real_view(t.detach())
            target.copy_(flat[offset : offset + target.numel()].view_as(target))
            offset += target.numel()


def _split_real(flat: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """Consecutive pieces of the real vector ``flat`` as tensors of the dtypes and shapes of ``like``'s."""
    out, offset = {}, 0
    for name, t in like.items():
        shape = real_shape(t)
        numel = real_view_numel(t)
        out[name] = from_real(flat[offset : offset + numel].view(shape), t)
        offset += numel
    return out


def _sync_dist_names(results: Any) -> list[str]:
    """Names of the logged metrics that ask for ``sync_dist`` in Lightning's result collection ``results``."""
    metas = [getattr(v, "meta", None) for v in (results or {}).values()]
    return sorted({m.name for m in metas if m is not None and getattr(m.sync, "should", False)})


def _write_named(module: torch.nn.Module, values: dict[str, Tensor]) -> None:
    live: dict[str, Tensor] = dict(module.named_parameters())
    live.update(dict(module.named_buffers()))
    with torch.no_grad():
        for name, value in values.items():
            if name in live:
                live[name].copy_(value)


def _check_replay(replay: Any) -> Any:
    """``replay`` as lists of :data:`~.asynchronous.PairingRecord` tuples (a list indexed by rank, or a dict rank ->
    list), or ``None``; raises ``TypeError`` / ``ValueError`` naming ``replay`` for anything else. The ranks are
    checked against the world size at setup (:func:`_check_replay_ranks`)."""
    if replay is None:
        return None
    if not isinstance(replay, (list, tuple, dict)):
        raise ArgumentTypeError(
            f"`replay` must be a list (or dict) of per-rank pairing logs, got {type(replay).__name__}"
        )
    if isinstance(replay, dict):
        for key in replay:
            if not _is_index(key):
                raise ArgumentTypeError(f"`replay` dict keys must be integer ranks >= 0, got {key!r}")
        return {int(k): _check_log(v) for k, v in replay.items()}
    return [_check_log(v) for v in replay]


def _is_index(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _check_log(entries: Any) -> list[tuple[int, ...]]:
    """One rank's pairing log: a list of ``(pub_step, partner, partner_pub_step, ticket, apply_step, drained)``, the
    first five integers >= 0, ``drained`` 0 or 1."""
    if not isinstance(entries, (list, tuple)):
        raise ArgumentTypeError(f"`replay` must hold one list of pairing records per rank, got {entries!r}")
    out = []
    for entry in entries:
        fields = tuple(entry) if isinstance(entry, (list, tuple)) else ()
        if (
            len(fields) != 6
            or not all(_is_index(v) for v in fields[:5])
            or not (isinstance(fields[5], numbers.Integral) and fields[5] in (0, 1))
        ):
            raise ValueError(
                "`replay` entries must be (pub_step, partner, partner_pub_step, ticket, apply_step, drained): five "
                f"integers >= 0 and drained 0 or 1, got {entry!r}"
            )
        out.append(tuple(int(v) for v in fields))
    return out


def _check_replay_ranks(replay: Any, world_size: int) -> None:
    """Raise ``ValueError`` unless ``replay`` holds one log per rank of ``world_size`` (a dict: ranks below it) whose
    partners are other ranks below it."""
    if isinstance(replay, dict):
        logs = replay
        outside = sorted(r for r in logs if r >= world_size)
        if outside:
            raise ValueError(
                f"`replay` has logs of ranks {outside}, outside 0..{world_size - 1} (world size {world_size})"
            )
    else:
        if len(replay) != world_size:
            raise ValueError(
                f"`replay` must hold one pairing log per rank (world size {world_size}), got {len(replay)}"
            )
        logs = dict(enumerate(replay))
    for rank, entries in logs.items():
        for entry in entries:
            if entry[1] >= world_size or entry[1] == rank:
                raise ValueError(
                    f"`replay`: rank {rank}'s log names partner {entry[1]}, which is not another rank of "
                    f"0..{world_size - 1}: {entry!r}"
                )


def _check_topology(topology: Any) -> Topology:
    if isinstance(topology, str):
        if topology not in TOPOLOGIES:
            raise ValueError(f"`topology` must be one of {TOPOLOGIES} or a list of edges, got {topology!r}")
        return topology
    try:
        edges = [tuple(edge) for edge in topology]
    except TypeError:
        raise ArgumentTypeError(
            f"`topology` must be a name {TOPOLOGIES} or a list of (i, j) edges, got {topology!r}"
        ) from None
    for edge in edges:
        if len(edge) != 2 or not all(is_int(v) and v >= 0 for v in edge):
            raise ValueError(f"`topology` edges must be pairs of non-negative integer ranks, got {edge!r}")
        if edge[0] == edge[1]:
            raise ValueError(f"`topology` edge {edge!r} is a self-loop")
    if not edges:
        raise ValueError("`topology` edge list is empty")
    return [(int(i), int(j)) for i, j in edges]


def _check_shape(shape: Any) -> tuple[int, int]:
    try:
        rows, cols = shape
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"`torus_shape` must be a (rows, cols) pair, got {shape!r}") from None
    for v in (rows, cols):
        if not is_int(v):
            raise ArgumentTypeError(f"`torus_shape` entries must be integers >= 1, got {shape!r}")
        if v < 1:
            raise ValueError(f"`torus_shape` entries must be integers >= 1, got {shape!r}")
    return int(rows), int(cols)


# the defaults: H=1, 8 bits, non-blocking
register_preset(
    "swarmsgd",
    "SwarmSGD: local steps + random pairwise gossip of 8-bit lattice-coded models",
    dict,
    strategy=SwarmStrategy,
)
