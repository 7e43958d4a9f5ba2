"""Four CPU processes train the model of fsdp_hsdp.py with DiLoCo on sharded replicas (LocalSGDFSDPStrategy): 2
replicas x 2 shards, FSDP2 inside each pair for the inner steps, compressed pseudo-gradients across the pairs every
``local_steps`` steps.

    python examples/fsdp_diloco.py [COMPRESSOR] [LOCAL_STEPS]   # e.g. cltk 20, signsgd 20, none 20

Each rank prints the bytes it sent across replicas per step against per-step HSDP's all-reduce of the same shards,
and the bytes inside its shard group (FSDP2's all-gathers and reduce-scatters, the same as HSDP's). Nothing is
written to the current folder.
"""

import sys
import tempfile

import lightning.pytorch as pl
import torch
from fsdp_hsdp import Net
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import LocalSGDFSDPStrategy


class PrintBytes(pl.Callback):
    def on_train_end(self, trainer, pl_module):  # on every rank, before the end-of-fit sync
        s = trainer.strategy.comm_stats
        steps = max(s.steps, 1)
        print(f"rank {trainer.global_rank}: across replicas {s.wire_bytes / steps:,.0f} B/step vs per-step HSDP "
              f"{s.dense_bytes / steps:,.0f} ({s.dense_bytes / max(s.wire_bytes, 1):,.0f}x fewer, "
              f"{trainer.strategy.hook.step} syncs in {s.steps} steps); inside the shard group "
              f"{s.intra_bytes / steps:,.0f} B/step")


def main(compressor="cltk", local_steps=20, shard_size=2, devices=4, max_epochs=5, start_method="popen"):
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()), batch_size=16)
    strategy = LocalSGDFSDPStrategy(local_steps=local_steps, compressor=compressor, shard_size=shard_size,
                                    start_method=start_method)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=max_epochs,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=root, callbacks=[PrintBytes()])
        trainer.fit(Net(), data)
    return trainer


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cltk", int(sys.argv[2]) if len(sys.argv) > 2 else 20)
