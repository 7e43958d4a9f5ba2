"""The golden cases of issue 47: every registered preset trained 12 optimizer steps (past ``start_step``) at W = 2, 3 and 4
on :class:`GoldenNet`, whose layers have tiny, odd and prime sizes, a sparse embedding, a frozen and a tied weight.

One case is a preset name at one world size; each rank of a :func:`~lightning_gradcomp.gloo_workers.run_workers`
group fits every case in turn with ``Trainer(strategy=name)`` (the group is a torchelastic-like environment, so
Lightning launches nothing and reuses the process group). A case's record: a SHA-256 of each rank's flat
parameters after every optimizer step (ranks must agree at the end, and after every step but for Local SGD and SwarmSGD), the digest of the final ones (after ``fit``: SwarmSGD's average), and the wire, node and
dense-equivalent bytes after every step. ``record.py`` writes the records of the current code to
``golden.pt``; ``test_golden.py`` compares the current code with them, bit for bit.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.presets import PRESETS, preset_class

STEPS = 12
"""Optimizer steps of a GradCompStrategy or Swarm case (``start_step`` is 2: ten compressed steps)."""
LOCAL_SGD_STEPS = 40
"""Optimizer steps of a Local SGD / DiLoCo case: two outer rounds of 20 local steps."""
LOCAL_SGD = ("localsgd", "diloco", "diloco_cltk")
WORLD_SIZES = (2, 3, 4)
PRESET_NAMES = (
    "gradcomp_fp16", "gradcomp_bf16", "scalecom", "scalecom_compact", "diana", "gradcomp_none", "powersgd_gc", "qsgd",
    "gradcomp_randomk", "signsgd", "terngrad", "gradcomp_topk", "lgreco", "gradcomp_fsdp", "scalecom_fsdp",
    "powersgd_fsdp", "qsgd_fsdp", "localsgd", "diloco", "diloco_cltk", "diloco_fsdp", "diloco_cltk_fsdp", "swarmsgd",
)
"""The presets ``import lightning_gradcomp`` registers (``test_golden`` checks this in a fresh interpreter; a test
process may hold more, registered by other tests)."""
SHARDED = ("gradcomp_fsdp", "scalecom_fsdp", "powersgd_fsdp", "qsgd_fsdp", "diloco_fsdp", "diloco_cltk_fsdp")
"""GradCompFSDPStrategy and LocalSGDFSDPStrategy presets: not recorded (they need a model that shards itself; tests/fsdp checks them)."""
HIERARCHICAL = ("scalecom", "powersgd_gc", "qsgd", "gradcomp_topk")
"""Presets also recorded with ``hierarchy=2`` (two nodes of two ranks) at W = 4."""


class GoldenNet(pl.LightningModule):
    """Sparse embedding (13 x 7) -> 7x37 -> 37x61 (2,257: compressed) -> frozen 61x61 -> 61x37 -> tied 37x37 (used
    twice) -> 37x2: every weight size is odd, prime or tiny."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 7, sparse=True)
        self.inp = nn.Linear(7, 37)
        self.wide = nn.Linear(37, 61)
        self.frozen = nn.Linear(61, 61, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.narrow = nn.Linear(61, 37)
        self.tied_a = nn.Linear(37, 37)
        self.tied_b = nn.Linear(37, 37, bias=False)
        self.tied_b.weight = self.tied_a.weight
        self.out = nn.Linear(37, 2)
        data = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 13, (96,), generator=data)
        self.y = torch.randn(96, 2, generator=data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(self.embed(x)))
        h = torch.tanh(self.frozen(torch.tanh(self.wide(h))))
        h = torch.tanh(self.narrow(h))
        h = torch.tanh(self.tied_b(torch.tanh(self.tied_a(h))))
        return self.out(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self(x) - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=4, shuffle=True)


def flat_parameters(module: nn.Module) -> torch.Tensor:
    """Every parameter (frozen ones too), flattened in registration order, as float32 on the CPU."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in module.parameters()])


def digest(tensor: torch.Tensor) -> bytes:
    """SHA-256 of a tensor's bytes: equal digests are ``torch.equal`` tensors (same dtype and shape)."""
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).digest()


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.digests: list[bytes] = []
        self.bytes: list[tuple[float, float, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.digests.append(digest(flat_parameters(pl_module)))
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is not None:
            self.bytes.append((float(stats.wire_bytes), float(stats.intra_bytes), float(stats.dense_bytes)))


SMALL = {"bucket_cap_mb": 0.004, "min_numel": 1}
"""Options of the ``_small`` cases: 4 KB buckets (five of them) and every layer compressed, even a 2-element bias."""
SUFFIXES = ("_lockstep", "_hierarchy2", "_small")


def cases(world_size: int) -> list[tuple[str, dict[str, Any]]]:
    """``(case name, strategy options)`` of one world size: every preset with its defaults, every GradCompStrategy
    preset again with :data:`SMALL` (``name_small``), and at W = 4 the :data:`HIERARCHICAL` ones with two nodes."""
    found: list[tuple[str, dict[str, Any]]] = [
        (name, {}) for name in PRESET_NAMES if name != "swarmsgd" and name not in SHARDED
    ]
    found.append(("swarmsgd_lockstep", {"mode": "lockstep"}))  # async gossip is not reproducible run to run
    found += [(f"{name}_small", SMALL) for name in PRESET_NAMES if preset_class(name) is GradCompStrategy]
    if world_size == 4:
        found += [(f"{name}_hierarchy2", {"hierarchy": 2}) for name in HIERARCHICAL]
    return found


def preset_of(case: str) -> str:
    """The preset a case name starts with."""
    for suffix in SUFFIXES:
        case = case.removesuffix(suffix)
    return case


def _strategy(case: str, options: dict[str, Any]) -> Any:
    name = preset_of(case)
    description, factory = PRESETS[name]
    return preset_class(name)(**{**factory(), **options})


def run_case(case: str, options: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Fit one case on this rank (the group is up); return its record."""
    name = preset_of(case)
    steps = LOCAL_SGD_STEPS if name in LOCAL_SGD else STEPS
    record = _Record()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=_strategy(case, options), max_steps=steps, max_epochs=-1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[record], num_sanity_val_steps=0,
    )
    pl.seed_everything(0, verbose=False)
    model = GoldenNet()
    trainer.fit(model)
    return {"digests": record.digests, "bytes": record.bytes, "final": digest(flat_parameters(model))}


def run_world(rank: int, world_size: int, only: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Every case of ``world_size`` (or those named in ``only``) on this rank of a ``run_workers`` group."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0", NODE_RANK="0", TORCHELASTIC_RUN_ID="golden",
    )
    import warnings

    warnings.filterwarnings("ignore")
    return {case: run_case(case, options, world_size) for case, options in cases(world_size) if not only or case in only}


def merge_ranks(ranks: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One record per case from every rank's: ``digests`` becomes a list per rank; ``bytes`` and ``final`` are rank 0's.

    Raises:
        AssertionError: two ranks' parameters differ where they must be equal: at the end, and after every step
            but for Local SGD and SwarmSGD (whose replicas differ between rounds by design).
    """
    merged = {}
    for case, first in ranks[0].items():
        per_rank = [rank[case]["digests"] for rank in ranks]
        local = case in LOCAL_SGD or case.startswith("swarmsgd")
        for rank, other in enumerate(ranks[1:], start=1):
            same = other[case]["final"] == first["final"]
            if not local:
                same = same and other[case]["digests"] == first["digests"]
            assert same, f"{case}: rank {rank} holds other parameters than rank 0"
        merged[case] = {**first, "digests": per_rank}
    return merged
