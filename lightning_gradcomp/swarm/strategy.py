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

The strategy is assembled from mixins, one concept each: :mod:`~lightning_gradcomp.swarm.training` (the local steps
and the gossip), :mod:`~lightning_gradcomp.swarm.async_mode` (asynchronous mode inside Lightning's loops),
:mod:`~lightning_gradcomp.swarm.evaluation` (the evaluated model) and :mod:`~lightning_gradcomp.swarm.checkpoints`;
its argument checks are in :mod:`~lightning_gradcomp.swarm.checks`. Their names are re-exported here.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.checks import MAX_TIMEOUT_SECONDS, check_bool, check_int, check_number, check_timeout
from lightning_gradcomp.comm import Comm, CommStats
from lightning_gradcomp.distributed import DEFAULT_TIMEOUT, release_group
from lightning_gradcomp.functional.finite import DeferredCount
from lightning_gradcomp.functional.realview import real_view, real_view_numel
from lightning_gradcomp.presets import register_preset, register_presets
from lightning_gradcomp.replicas import DivergentReplicas
from lightning_gradcomp.sharded_checkpoints import ShardedCheckpoints
from lightning_gradcomp.swarm.async_mode import _T as _T
from lightning_gradcomp.swarm.async_mode import AsyncMode
from lightning_gradcomp.swarm.async_mode import _sync_dist_names as _sync_dist_names
from lightning_gradcomp.swarm.asynchronous import EXCHANGE_TIMEOUT_SETTING, AsyncGossip, PairingRecord, exchange_group
from lightning_gradcomp.swarm.checkpoints import _CHECKPOINT_VERSION as _CHECKPOINT_VERSION
from lightning_gradcomp.swarm.checkpoints import _SHARD_WORDS as _SHARD_WORDS
from lightning_gradcomp.swarm.checkpoints import CHECKPOINT_KEY, SwarmCheckpoints
from lightning_gradcomp.swarm.checks import _check_log as _check_log
from lightning_gradcomp.swarm.checks import _check_replay, _check_replay_ranks, _check_shape, _check_topology
from lightning_gradcomp.swarm.checks import _is_index as _is_index
from lightning_gradcomp.swarm.evaluation import AveragedEvaluation
from lightning_gradcomp.swarm.exchange import ROUNDINGS, LatticeCodec, PairwiseGossip, PendingExchange, SwarmStats
from lightning_gradcomp.swarm.flat_vectors import _split_real as _split_real
from lightning_gradcomp.swarm.flat_vectors import _write_flat
from lightning_gradcomp.swarm.flat_vectors import _write_named as _write_named
from lightning_gradcomp.swarm.pairing import Edges, Topology, matching, round_local_steps, topology_edges
from lightning_gradcomp.swarm.training import GossipTraining

__all__ = ["CHECKPOINT_KEY", "SwarmStrategy"]

log = logging.getLogger(__name__)

_EVAL_MODELS = ("mean", "rank0", "local")
MODES = ("async", "lockstep")


class SwarmStrategy(
    GossipTraining, AsyncMode, AveragedEvaluation, SwarmCheckpoints, DivergentReplicas, ShardedCheckpoints, DDPStrategy
):
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

    @override
    def on_train_start(self) -> None:
        self._restored = self._restored_counters = None  # consumed by setup and the optimizer restore
        if self._async is not None:
            self._unlock_training_loop()
            self._warn_collective_validation()
            self._rank_local = True
        super().on_train_start()

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


# the defaults: H=1, 8 bits, non-blocking
register_preset(
    "swarmsgd",
    "SwarmSGD: local steps + random pairwise gossip of 8-bit lattice-coded models",
    dict,
    strategy=SwarmStrategy,
)
