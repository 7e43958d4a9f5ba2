"""L-GreCo reproduction (uniform vs layer-wise at the same error budget) and PowerSGD vs ``torch``'s hook.

Two CPU ranks (gloo, fork, one thread each). Four offline tasks whose layers differ in shape and gradients:

``resnet``
    Fashion-MNIST (Debian ``dataset-fashion-mnist``, loaded by ``benchmarks/scalecom_fidelity.py``; the first
    ``--train-size`` training images and the full 10k test set) learned by the recipes' ResNet-8
    (``recipes.models.resnet.resnet8``: a 3x3 stem and three BasicBlocks at 16/32/64 channels with batch norm,
    78k parameters). Its compressed layers are 3x3 and 1x1 convolutions, reshaped to ``(out, in * kh * kw)``
    matrices from 16x144 to 64x576, and the 10x64 classifier. SGD with momentum 0.9, weight decay 5e-4,
    lr 0.1 with a per-step cosine decay, 4 epochs.
``cnn``
    The same data learned by the ScaleCom check's CNN (``_common.make_cnn``: conv 1-32, conv 32-32,
    fc 1568-320, fc 320-10). SGD with momentum 0.9, weight decay 5e-4, lr 0.05 with cosine decay, 4 epochs.
``lm``
    Next-token prediction on the English sentences of the Ding dictionary (Debian ``trans-de-en``, read by
    ``recipes.data.parallel_text.read_ding``; a CRC32 split holds out 1 sentence in 10) with a word vocabulary of
    4000, learned by a 2-layer pre-norm Transformer (width 64, tied embedding, context 32). AdamW (lr 2e-3,
    weight decay 0.01) with cosine decay, 32 sequences per rank, 6 epochs; the metric is next-token accuracy.
``lm_untied``
    The same sentences and model with an 8000-word vocabulary and an **untied** output projection, so that the
    embedding and the output projection (8000x64 each) hold 90 % of the weights, as in most language models; the
    case where L-GreCo re-allocates most (the large matrices gain little from a higher rank or density, the small
    ones much). Same optimiser; run it with ``--epochs 12`` (docs/benchmarks.md).
``mlp``
    10-class classification of synthetic data (256 Gaussian features with a power-law spectrum, labelled by a
    fixed random teacher; 8192 training and 4096 test samples generated from a seed) learned by an MLP with
    layers of very different sizes (256-1024-512-256-128-64-32-10: 320 to 524k weights). SGD with momentum
    0.9, lr 0.05 with a per-step cosine decay, 6 epochs.

Part ``lgreco`` (Lightning, ``GradCompStrategy``, compression from step 2): for each task, family
(PowerSGD rank 4, TopK 1 %, QSGD 4 bits) and seed, one run with the uniform default and one with
:class:`~lightning_gradcomp.callbacks.LGreCo` at the **same error budget** (``alpha = 1``), both with the same
seed (initialisation, data order and compressor randomness). L-GreCo first re-plans a quarter epoch in, then
every half epoch, each time from the last 10 steps' statistics (``LGreCo``'s defaults: the raw gradients and the
sum of un-squared errors). ``--variants`` runs several L-GreCo settings against the same uniform run, e.g.
``statistic=input`` (the official code's error-compensated inputs), ``error=feedback`` or ``period=1`` (epochs
between re-plans). Prints the bytes rank 0 sent (all layers, and the compressed layers only), the final test
accuracy and loss, the compression error each run actually incurred per step (:class:`ErrorMeter`), how much the
per-layer choice moves between re-plans (:func:`oscillation`), and draws every family's per-layer choice (last
re-plan of the first seed, first variant) to ``--figure``.

Part ``torch`` (raw DDP, no Lightning, ``mlp`` task): the MLP trained with our ``PowerSGD(rank=4)`` hook engine
and with ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (rank 4, error feedback, warm start).
torch's hook issues collectives from Future callbacks, which deadlocks gloo with several buckets, so both run
with a single DDP bucket (``bucket_cap_mb=1000``). Prints bytes per compressed step (ours from
:class:`~lightning_gradcomp.comm.CommStats`, torch's from its own ``compression_stats`` counters with the same
all-reduce formula), time inside the hook function per step, step time, and final accuracy.

With ``--dense-epochs E`` compression starts after ``E`` dense epochs (both settings) and L-GreCo's first re-plan
comes a quarter epoch later; the bytes of the compressed layers are then also reported over the compressed steps
only.

    python benchmarks/lgreco_compare.py [--part all|lgreco|torch] [--tasks resnet cnn lm lm_untied mlp] [--seeds 0 1]
        [--families powersgd topk qsgd] [--epochs N] [--train-size 20000] [--error norm|squared]
        [--variants statistic=gradient statistic=input,period=1 ...] [--uniform-from earlier.json ...]
        [--json out.json] [--plot-from out.json [more.json ...]] [--dense-epochs 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _common import ROOT, make_cnn  # benchmarks/ (puts ROOT on sys.path for ``recipes``); the ScaleCom check's CNN
from _common import load_data as load_fashion_mnist  # the shared Fashion-MNIST loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import LGreCo
from lightning_gradcomp.comm import Comm, all_reduce_bytes
from lightning_gradcomp.compressors import PowerSGD, TopK
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.functional.lowrank import matrix_shape
from lightning_gradcomp.gloo_workers import free_port, run_workers
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook
from recipes.data.parallel_text import DING_PATH, is_held_out, read_ding  # Debian trans-de-en
from recipes.data.vocab import EOS, WordVocab
from recipes.models.resnet import resnet8  # the image recipe's CPU model
from recipes.models.seq2seq import sinusoidal_positions

WORLD = 2
BATCH = 64  # per rank
START_STEP = 2  # first compressed step (both settings) unless --dense-epochs asks for a longer dense warm-up
ACCUMULATE = 10  # steps summed into L-GreCo's statistic before each re-plan


# ---------------------------------------------------------------------------------------------- families
FAMILIES: dict[str, tuple[str, Callable[[], Any], dict[str, Any]]] = {
    # key: (label, uniform compressor, LGreCo candidate arguments); the same for every task
    "powersgd": ("PowerSGD rank 4", lambda: PowerSGD(rank=4), {"min_factor": 0.25, "max_factor": 4.0}),
    "topk": ("TopK 1 %", lambda: TopK(density=0.01), {"min_factor": 1 / 16, "max_factor": 4.0, "num_candidates": 13}),
    "qsgd": ("QSGD 4 bits", lambda: QSGD(bits=4, group_size=512), {"min_factor": 0.5, "max_factor": 2.0}),
    # a higher default rank with a wider grid (ranks 1 to 32), for the question whether PowerSGD leaves more room
    # for re-allocation above rank 4; not in the default set of families
    "powersgd8": ("PowerSGD rank 8", lambda: PowerSGD(rank=8), {"min_factor": 0.125, "max_factor": 4.0}),
}


# ---------------------------------------------------------------------------------------------- tasks
WIDTHS = (256, 1024, 512, 256, 128, 64, 32, 10)


def make_data(seed: int = 0, train: int = 8192, test: int = 4096) -> tuple[torch.Tensor, ...]:
    """Gaussian inputs with a power-law spectrum (like natural signals), labelled by a random teacher.

    ``x = (z * i^-1) R`` with ``z ~ N(0, I)`` and a random rotation ``R``; labels are the argmax of a fixed
    ``d -> 32 (tanh) -> 10`` teacher applied to ``x``, normalised to unit variance per direction.
    """
    gen = torch.Generator().manual_seed(1234 + seed)
    d = WIDTHS[0]
    scales = torch.arange(1, d + 1, dtype=torch.float32) ** -1.0
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    x = (torch.randn(train + test, d, generator=gen) * scales) @ rotation.T
    x = x / x.std()
    w1 = torch.randn(d, 32, generator=gen) / d ** 0.5
    w2 = torch.randn(32, 10, generator=gen)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    return x[:train], y[:train], x[train:], y[train:]


def make_mlp(seed: int) -> nn.Sequential:
    """The ``WIDTHS`` MLP with ReLUs, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_resnet(seed: int) -> nn.Module:
    """The image recipe's ResNet-8 for 1-channel 28x28 images, initialised from ``seed``."""
    torch.manual_seed(seed)
    return resnet8(num_classes=10, in_channels=1)


CONTEXT = 32  # tokens per language-model sequence
VOCAB = 4000


class TinyLM(nn.Module):
    """Decoder-only Transformer language model: tied token embedding, sine positions, pre-norm causal blocks.

    ``(N, T)`` token ids -> ``(N, T, vocab)`` next-token logits.
    """

    def __init__(self, vocab: int = VOCAB, d_model: int = 64, nhead: int = 4, layers: int = 2, ff: int = 256,
                 dropout: float = 0.1, context: int = CONTEXT, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.out = None if tied else nn.Linear(d_model, vocab)
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)
        self.register_buffer("positions", sinusoidal_positions(context, d_model), persistent=False)
        block = nn.TransformerEncoderLayer(d_model, nhead, ff, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.scale = d_model ** 0.5

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) * self.scale + self.positions[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        h = self.norm(self.blocks(h, mask=mask, is_causal=True))
        if self.out is not None:
            return self.out(h)
        return h @ self.embed.weight.T  # output projection tied to the embedding


def make_lm(seed: int) -> nn.Module:
    """:class:`TinyLM` with the default sizes, initialised from ``seed``."""
    torch.manual_seed(seed)
    return TinyLM()


LARGE_VOCAB = 8000  # the untied LM's vocabulary: the words seen at least twice in the training sentences


def make_lm_untied(seed: int) -> nn.Module:
    """:class:`TinyLM` with an 8000-word vocabulary and an untied output projection, initialised from ``seed``."""
    torch.manual_seed(seed)
    return TinyLM(vocab=LARGE_VOCAB, tied=False)


def load_ding_lm(vocab_size: int = VOCAB, context: int = CONTEXT) -> tuple[Any, ...]:
    """``(name, x_train, y_train, x_test, y_test)``: next-token sequences of the Ding dictionary's English sentences.

    Sentences whose CRC32 is divisible by 10 are held out (``recipes.data.parallel_text.is_held_out``); the
    word vocabulary is the ``vocab_size - 4`` most frequent words of the training sentences (others map to
    ``<unk>``). Each split is one stream of sentences, each ended by ``</s>``, cut into ``context + 1``-token
    windows: ``x`` is a window's first ``context`` tokens, ``y`` its last ``context``.
    """
    english = [en for en, _ in read_ding()]
    train = [s for s in english if not is_held_out(s, 10)]
    test = [s for s in english if is_held_out(s, 10)]
    vocab = WordVocab.from_texts(train, vocab_size)

    def windows(sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        stream = torch.tensor([i for s in sentences for i in [*vocab.encode(s), EOS]], dtype=torch.int64)
        n = (len(stream) - 1) // context
        x = stream[:n * context].view(n, context)
        y = stream[1:n * context + 1].view(n, context)
        return x, y

    (xtr, ytr), (xte, yte) = windows(train), windows(test)
    name = (f"English sentences of the Ding dictionary ({DING_PATH}, Debian trans-de-en): {len(train)} training / "
            f"{len(test)} held-out sentences, {xtr.numel()} / {xte.numel()} tokens, {len(vocab)} words")
    return name, xtr, ytr, xte, yte


@dataclass
class Task:
    """A model, its data and its optimiser settings."""

    name: str
    description: str
    make_net: Callable[[int], nn.Module]
    data: tuple[torch.Tensor, ...]
    epochs: int
    batch: int  # per rank
    optimizer: str  # "sgd" (momentum 0.9) or "adamw"
    lr: float
    weight_decay: float
    min_numel: int  # smallest weight tensor that is compressed (biases and norms always go dense)


def build_task(name: str, args: argparse.Namespace) -> Task:
    """Load the data of task ``name`` (``mlp``, ``lm``, ``cnn`` or ``resnet``) and fix its settings."""
    if name == "mlp":
        return Task("mlp", "synthetic 256-feature task, MLP 256-1024-512-256-128-64-32-10", make_mlp, make_data(),
                    args.epochs or 6, 64, "sgd", 0.05, 0.0, 256)
    if name in ("lm", "lm_untied"):
        tied = name == "lm"
        data_name, *data = load_ding_lm(VOCAB if tied else LARGE_VOCAB)
        embedding = (f"tied {VOCAB}x64 embedding" if tied
                     else f"{LARGE_VOCAB}x64 embedding and output projection (untied)")
        return Task(name, f"{data_name}; Transformer LM (2 pre-norm layers, d 64, 4 heads, ff 256, {embedding}, "
                          f"context {CONTEXT})", make_lm if tied else make_lm_untied, tuple(data),
                    args.epochs or 6, 32, "adamw", 2e-3, 0.01, 256)
    data_name, *data = load_fashion_mnist(args.train_size)
    if name == "cnn":
        return Task("cnn", f"{data_name}, CNN conv 1-32-32 (3x3) + fc 1568-320-10 (benchmarks/scalecom_fidelity.py)",
                    make_cnn, tuple(data), args.epochs or 4, 64, "sgd", 0.05, 5e-4, 256)
    return Task("resnet", f"{data_name}, ResNet-8 (16/32/64 channels, batch norm)", make_resnet, tuple(data),
                args.epochs or 4, 64, "sgd", 0.1, 5e-4, 256)


def evaluate(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(top-1 accuracy, mean cross-entropy)`` in eval mode over every target (image, sample or token)."""
    was_training = net.training
    net.eval()
    hits, loss = 0, 0.0
    with torch.no_grad():
        for a, b in zip(x.split(500), y.split(500)):
            logits = net(a)
            logits = logits.reshape(-1, logits.shape[-1])
            hits += int((logits.argmax(1) == b.reshape(-1)).sum())
            loss += float(nn.functional.cross_entropy(logits, b.reshape(-1), reduction="sum"))
    net.train(was_training)
    return hits / y.numel(), loss / y.numel()


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy in eval mode."""
    return evaluate(net, x, y)[0]


def make_optimizer(task: Task, params: Any) -> torch.optim.Optimizer:
    """The task's optimiser: AdamW, or SGD with momentum 0.9, at the task's learning rate and weight decay."""
    if task.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=task.lr, weight_decay=task.weight_decay)
    return torch.optim.SGD(params, lr=task.lr, momentum=0.9, weight_decay=task.weight_decay)


class Classifier(pl.LightningModule):
    """A task's network, SGD with momentum 0.9 and a per-step cosine learning-rate decay."""

    def __init__(self, task: Task, seed: int) -> None:
        super().__init__()
        self.net = task.make_net(seed)
        self.task = task

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        opt = make_optimizer(self.task, self.parameters())
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        xtr, ytr = self.task.data[:2]
        return DataLoader(TensorDataset(xtr, ytr), batch_size=self.task.batch, shuffle=True)


class ErrorMeter:
    """Engine observer (rank 0): the compression error each compressed step actually incurred.

    Per step, over the compressed layers: ``sum_l ||p_l - c_l||`` (the metric L-GreCo's budget bounds, here
    per step instead of on the 10-step sum), ``sum_l ||p_l - c_l||^2`` and ``sum_l ||p_l||``, where ``p_l`` is the
    compressor input (error-compensated with error feedback) and ``c_l`` this rank's compressed contribution.
    """

    def __init__(self) -> None:
        self.steps: dict[int, list[float]] = {}

    def wants(self, step: int) -> bool:
        return True

    def __call__(self, record: Any) -> None:
        if record.residuals is None:
            return
        acc = self.steps.setdefault(record.step, [0.0, 0.0, 0.0])
        for x, r in zip(record.inputs, record.residuals):
            e = float(r.detach().double().norm())
            acc[0] += e
            acc[1] += e * e
            acc[2] += float(x.detach().double().norm())

    def summary(self) -> dict[str, float]:
        rows = list(self.steps.values())
        if not rows:
            return {}
        return {"error": statistics.fmean(r[0] for r in rows), "squared_error": statistics.fmean(r[1] for r in rows),
                "input_norm": statistics.fmean(r[2] for r in rows), "error_steps": len(rows)}


class Probe(pl.Callback):
    """Rank 0 writes accuracy, bytes, incurred errors, per-layer figures and the LGreCo history to a JSON file."""

    def __init__(self, out: Path, start_step: int = START_STEP) -> None:
        self.out = out
        self.meter = ErrorMeter()
        self.start_step = start_step
        self.warmup_bytes: dict[str, int] = {}  # per layer, sent during the dense warm-up (steps < start_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        hook = getattr(trainer.strategy, "hook", None)
        if hook is not None and hook.step == self.start_step and not self.warmup_bytes:
            self.warmup_bytes = {k: v.wire_bytes for k, v in trainer.strategy.comm_stats.layers.items()}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hook = getattr(trainer.strategy, "hook", None)
        if trainer.global_rank == 0 and hook is not None and getattr(hook, "compressor", None) is not None:
            hook.observers.append(self.meter)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Classifier) -> None:
        if trainer.global_rank != 0:
            return
        stats = trainer.strategy.comm_stats
        lg = [cb for cb in trainer.callbacks if isinstance(cb, LGreCo)]
        shapes = {name: list(p.shape) for name, p in pl_module.named_parameters()}
        order = [name for name in shapes if name in stats.layers and stats.layers[name].compressed]
        compressed = {k: stats.layers[k] for k in order}  # model order
        xte, yte = pl_module.task.data[2:]
        acc, loss = evaluate(pl_module.net, xte, yte)
        result = {
            "accuracy": acc,
            "test_loss": loss,
            "wire_bytes": stats.wire_bytes,
            "dense_bytes": stats.dense_bytes,
            "compressed_layer_bytes": sum(v.wire_bytes for v in compressed.values()),
            # the same layers' bytes over the compressed steps only (without the dense warm-up)
            "compressed_phase_bytes": sum(v.wire_bytes - self.warmup_bytes.get(k, 0) for k, v in compressed.items()),
            "start_step": self.start_step,
            "steps": stats.steps,
            "layers": {k: {"numel": v.numel, "shape": shapes.get(k), "param": v.param, "wire_bytes": v.wire_bytes}
                       for k, v in compressed.items()},
            "history": lg[0].history if lg else [],
            **self.meter.summary(),
        }
        self.out.write_text(json.dumps(result))


def steps_per_epoch(task: Task) -> int:
    """Optimizer steps per epoch (the distributed sampler pads every rank to ``ceil(N / W)`` samples)."""
    per_rank = -(-len(task.data[1]) // WORLD)
    return -(-per_rank // task.batch)


def parse_variant(text: str, error: str = "norm") -> dict[str, Any]:
    """``"statistic=gradient,error=squared,period=1,window=steps,min_factor=0.5"`` -> LGreCo settings (``period``
    in epochs, default 0.5; ``min_factor`` / ``max_factor`` replace the family's candidate grid ends)."""
    out: dict[str, Any] = {"statistic": "gradient", "error": error, "period": 0.5, "window": "sum"}
    numeric = ("period", "min_factor", "max_factor")
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in out and key not in numeric:
            raise SystemExit(f"--variants: unknown key {key!r} in {text!r} (statistic, error, period, window, "
                             f"min_factor, max_factor)")
        out[key] = float(value) if key in numeric else value
    return out


def lgreco_for(kwargs: dict[str, Any], spe: int, error: str = "norm", statistic: str = "gradient",
               period: float = 0.5, window: str = "sum", start_step: int = START_STEP, **grid: float) -> LGreCo:
    """Re-plan a quarter epoch after compression starts (``start_step``), then every ``period`` epochs (default
    half), from the last 10 steps (``alpha = 1``)."""
    first = start_step + spe // 4 if start_step > START_STEP else spe // 4
    return LGreCo(warmup_steps=max(first, start_step + ACCUMULATE + 1),
                  period=max(int(round(spe * period)), ACCUMULATE), accumulate_steps=ACCUMULATE, alpha=1.0,
                  error=error, statistic=statistic, window=window, **{**kwargs, **grid})


def oscillation(history: list[dict[str, Any]]) -> tuple[float, list[float]]:
    """``(mean |log2(v_{t+1} / v_t)| over layers and consecutive re-plans, planned saving per re-plan)``."""
    feasible = [h for h in history if h.get("feasible")]
    steps = []
    for a, b in zip(feasible, feasible[1:]):
        if a["layers"] == b["layers"]:
            steps.extend(abs(math.log2(y / x)) for x, y in zip(a["values"], b["values"]) if x > 0 and y > 0)
    plans = [h["uniform_bytes"] / h["bytes"] for h in feasible if h.get("bytes")]
    return (statistics.fmean(steps) if steps else math.nan), plans


def run_fit(task: Task, compressor: Any, layerwise: Optional[LGreCo], seed: int, workdir: Path,
            start_step: int = START_STEP) -> dict[str, Any]:
    """One 2-rank fit (fork launcher); returns rank 0's :class:`Probe` record plus the wall time."""
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    pl.seed_everything(seed, verbose=False)  # the data order (DistributedSampler) follows PL_GLOBAL_SEED
    out = workdir / f"probe_{time.monotonic_ns()}.json"
    strategy = GradCompStrategy(compressor=compressor, start_step=start_step, min_numel=task.min_numel, seed=seed,
                                start_method="fork", layerwise=layerwise)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=task.epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Probe(out, start_step)], default_root_dir=str(workdir))
    start = time.perf_counter()
    trainer.fit(Classifier(task, seed))
    record = json.loads(out.read_text())
    record["seconds"] = time.perf_counter() - start
    return record


# ---------------------------------------------------------------------------------------------- part 1
def reused_uniform(args: argparse.Namespace, task: str, family: str, seed: int,
                   start: int = START_STEP) -> Optional[dict[str, Any]]:
    """The uniform run of ``(task, family, seed, start step)`` from ``--uniform-from`` (the runs are
    deterministic), if any."""
    for path in args.uniform_from or []:
        rows = json.loads(Path(path).read_text()).get("lgreco", {}).get(task, {}).get(family, [])
        for row in rows:
            if row["seed"] == seed and row["uniform"].get("start_step", START_STEP) == start:
                print(f"[{task}] {family} seed {seed}: uniform run reused from {path}", flush=True)
                return row["uniform"]
    return None


def part_lgreco(task: Task, args: argparse.Namespace, workdir: Path,
                results: Optional[dict[str, Any]] = None, saved: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Uniform and L-GreCo runs of every family and seed of ``task``, filled into ``results`` (``saved()`` is
    called after each seed, so a crash loses only the runs in progress)."""
    spe = steps_per_epoch(task)
    start = max(START_STEP, round(args.dense_epochs * spe))
    print(f"\n[{task.name}] {task.description}; W={WORLD}, batch {task.batch}/rank, {task.epochs} epochs of {spe} "
          f"steps, compressed from step {start}, seeds {args.seeds}", flush=True)
    results = {} if results is None else results
    for key in args.families:
        label, make, kwargs = FAMILIES[key]
        for seed in args.seeds:
            uni = reused_uniform(args, task.name, key, seed, start) or run_fit(task, make(), None, seed, workdir, start)
            row: dict[str, Any] = {"seed": seed, "uniform": uni, "variants": {}}
            for variant in args.variants:
                lg = run_fit(task, make(), lgreco_for(kwargs, spe, start_step=start,
                                                      **parse_variant(variant, args.error)), seed, workdir, start)
                row["variants"][variant] = lg
                row.setdefault("lgreco", lg)  # the first variant (read by --plot-from and older tools)
                saving = uni["compressed_layer_bytes"] / lg["compressed_layer_bytes"]
                # records written before the compressed-phase figure existed have only the whole run's
                phase = uni.get("compressed_phase_bytes", math.nan) / lg["compressed_phase_bytes"]
                osc, plans = oscillation(lg["history"])
                print(f"[{task.name}] {label:15s} seed {seed} [{variant}]: uniform "
                      f"{uni['compressed_layer_bytes'] / 1e6:8.2f} MB acc {uni['accuracy']:.4f} | L-GreCo "
                      f"{lg['compressed_layer_bytes'] / 1e6:8.2f} MB acc {lg['accuracy']:.4f} | saving {saving:.2f}x "
                      f"(compressed steps {phase:.2f}x, all layers {uni['wire_bytes'] / lg['wire_bytes']:.2f}x) | incurred error x"
                      f"{lg['error'] / uni['error']:.2f} | oscillation {osc:.2f}, planned savings "
                      f"{' '.join(f'{x:.2f}' for x in plans)} | {uni['seconds']:.0f} s, {lg['seconds']:.0f} s",
                      flush=True)
            results.setdefault(key, []).append(row)
            saved()
    if args.dense:
        dense = run_fit(task, None, None, args.seeds[0], workdir)
        results["dense"] = dense
        print(f"[{task.name}] dense DDP seed {args.seeds[0]}: {dense['wire_bytes'] / 1e6:.2f} MB "
              f"acc {dense['accuracy']:.4f}", flush=True)
    print_lgreco_table(task, results, args)
    return results


def print_lgreco_table(task: Task, results: dict[str, Any], args: argparse.Namespace) -> None:
    mean = statistics.fmean
    print(f"\n[{task.name}] L-GreCo vs uniform at alpha = 1, {task.epochs} epochs, W={WORLD}, mean over seeds "
          f"{args.seeds}")
    print("| family | setting | MB sent, compressed layers | MB sent, all layers | bytes saving (compressed / all) "
          "| test accuracy | test loss | incurred error per step, vs uniform | last re-plan: error / budget, saving "
          "| oscillation |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in args.families:
        runs = results[key]
        label = FAMILIES[key][0]
        comp = mean([r["uniform"]["compressed_layer_bytes"] for r in runs]) / 1e6
        total = mean([r["uniform"]["wire_bytes"] for r in runs]) / 1e6
        acc = mean([r["uniform"]["accuracy"] for r in runs])
        loss = mean([r["uniform"]["test_loss"] for r in runs])
        print(f"| {label} | uniform | {comp:.2f} | {total:.2f} | 1.00x / 1.00x | {acc:.4f} | {loss:.4f} | 1.00 | - "
              f"| - |")
        for variant in args.variants:
            lgs = [r["variants"][variant] for r in runs]
            comp = mean([lg["compressed_layer_bytes"] for lg in lgs]) / 1e6
            total = mean([lg["wire_bytes"] for lg in lgs]) / 1e6
            acc = mean([lg["accuracy"] for lg in lgs])
            loss = mean([lg["test_loss"] for lg in lgs])
            incurred = mean([lg["error"] / r["uniform"]["error"] for lg, r in zip(lgs, runs)])
            save_c = mean([r["uniform"]["compressed_layer_bytes"] / lg["compressed_layer_bytes"]
                           for lg, r in zip(lgs, runs)])
            save_t = mean([r["uniform"]["wire_bytes"] / lg["wire_bytes"] for lg, r in zip(lgs, runs)])
            last = [lg["history"][-1] for lg in lgs if lg["history"]]
            last = [h for h in last if h.get("feasible")]
            used = mean([h["error"] / h["budget"] for h in last]) if last else math.nan
            plan = mean([h["uniform_bytes"] / h["bytes"] for h in last]) if last else math.nan
            osc = mean([oscillation(lg["history"])[0] for lg in lgs])
            print(f"| {label} | L-GreCo [{variant}] | {comp:.2f} | {total:.2f} | {save_c:.2f}x / {save_t:.2f}x "
                  f"| {acc:.4f} | {loss:.4f} | {incurred:.2f} | {used:.3f}, {plan:.2f}x | {osc:.2f} |")
    if "dense" in results:
        dense = results["dense"]
        print(f"| dense DDP (seed {args.seeds[0]}) | - | - | {dense['wire_bytes'] / 1e6:.2f} | - "
              f"| {dense['accuracy']:.4f} | {dense['test_loss']:.4f} | - | - |")
    for key in args.families:
        for variant in args.variants:
            per_seed = "; ".join(
                f"seed {r['seed']}: {r['uniform']['compressed_layer_bytes'] / 1e6:.2f} MB / "
                f"{r['uniform']['accuracy']:.4f} vs {lg['compressed_layer_bytes'] / 1e6:.2f} MB / {lg['accuracy']:.4f} "
                f"({r['uniform']['compressed_layer_bytes'] / lg['compressed_layer_bytes']:.2f}x, incurred error "
                f"{r['uniform']['error']:.4g} vs {lg['error']:.4g}, x{lg['error'] / r['uniform']['error']:.2f})"
                for r in results[key] for lg in [r["variants"][variant]])
            print(f"[{task.name}] {FAMILIES[key][0]} [{variant}] per seed (compressed MB / accuracy, uniform vs "
                  f"L-GreCo): {per_seed}")


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the ``"lgreco"`` parts of several ``--json`` records: per task and family, the seed rows of all
    records sorted by seed (a later record's row replaces an earlier one of the same seed); ``"dense"`` from the
    first record that has it."""
    out: dict[str, Any] = {}
    for record in records:
        for task, families in record.items():
            merged = out.setdefault(task, {})
            for key, value in families.items():
                if key == "dense":
                    merged.setdefault("dense", value)
                    continue
                rows = {row["seed"]: row for row in merged.get(key, [])}
                rows.update({row["seed"]: row for row in value})
                merged[key] = [rows[seed] for seed in sorted(rows)]
    return out


def _layer_label(info: dict[str, Any]) -> str:
    if info.get("shape"):
        n, m = matrix_shape(info["shape"])
        return f"{n}x{m}"
    return str(info["numel"])


def plot_layers(all_results: dict[str, dict[str, Any]], families: list[str], path: Path) -> None:
    """Per-layer chosen parameter (last re-plan of the first seed's L-GreCo run) relative to the uniform default.

    One row per task, one panel per family; layers in model order, labelled with their matrix shape.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(all_results)
    fig, axes = plt.subplots(len(tasks), len(families), figsize=(4.6 * len(families), 3.9 * len(tasks)),
                             constrained_layout=True, squeeze=False)
    for row, task in enumerate(tasks):
        for ax, key in zip(axes[row], families):
            label, make, _ = FAMILIES[key]
            run = all_results[task][key][0]["lgreco"]
            default = make().default_param
            names = list(run["layers"])  # model order (the order of the strategy's layer plan)
            chosen = [run["layers"][n]["param"] for n in names]
            rel = [c / default for c in chosen]
            ax.bar(range(len(names)), [r - 1.0 for r in rel], bottom=1.0,
                   color=["tab:orange" if r < 1 else "tab:blue" for r in rel])
            uniform = f"{100 * default:g}%" if key == "topk" else f"{default:g}"
            ax.axhline(1.0, color="k", lw=0.8, ls="--", label=f"uniform ({uniform})")
            ax.set_yscale("log", base=2)
            span = max(max(abs(math.log2(r)) for r in rel), 1.0) + 0.6
            ax.set_ylim(2 ** -span, 2 ** span)
            ax.set_xticks(range(len(names)), [_layer_label(run["layers"][n]) for n in names], fontsize=7,
                          rotation=60)
            for i, c in enumerate(chosen):
                text = f"{100 * c:.2g}%" if key == "topk" else f"{c:g}"
                ax.annotate(text, (i, c / default), ha="center", va="bottom" if c >= default else "top", fontsize=6)
            runs = all_results[task][key]
            whole = statistics.fmean([r["uniform"]["compressed_layer_bytes"] / r["lgreco"]["compressed_layer_bytes"]
                                      for r in runs])
            ax.set_title(f"{task}: {label}\n{whole:.2f}x fewer bytes over the run (seed mean)", fontsize=9)
            ax.set_xlabel("compressed layer (matrix shape n x m), in parameter order", fontsize=8)
            ax.legend(fontsize=7)
        axes[row][0].set_ylabel("chosen / uniform default (log2)")
    fig.suptitle("L-GreCo per-layer parameters at the uniform setting's error budget (alpha = 1), last re-plan",
                 fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------- part 2
def _timed(hook_fn: Callable, box: list[float]) -> Callable:
    """Wrap a comm hook: ``box[0]`` += time in the hook body, ``box[1]`` += time until its Future resolved.

    torch's hook does most of its work in Future callbacks, ours in the body; the second figure covers both
    (and the wait for the other rank).
    """

    def wrapper(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        start = time.perf_counter()
        fut = hook_fn(state, bucket)
        box[0] += time.perf_counter() - start

        def done(f: torch.futures.Future) -> torch.Tensor:
            box[1] += time.perf_counter() - start
            return f.value()

        return fut.then(done)

    # DDP checks these annotations (they are strings under ``from __future__ import annotations``).
    wrapper.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return wrapper


def torch_compare_strategy() -> GradCompStrategy:
    """Our side of the raw-DDP comparison, set up like torch's hook: PowerSGD rank 4 with error feedback and warm
    start, compressed from step 2, no size threshold (``min_compression_rate=2`` decides, as in torch's). Its hook
    is built by ``make_hook``, as in a fit."""
    return GradCompStrategy(compressor=PowerSGD(rank=4), start_step=2, min_numel=1)


def _train_torch(rank: int, world: int, which: str, seed: int, epochs: int) -> dict[str, Any]:
    """One rank of the raw-DDP comparison (run by :func:`run_workers`, which set up gloo and one thread)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = make_mlp(seed)
    xtr, ytr, xte, yte = make_data()
    model = DDP(net, bucket_cap_mb=1000)
    box = [0.0, 0.0]
    if which == "ours":
        names = {id(p): n for n, p in net.named_parameters()}
        hook = torch_compare_strategy().make_hook(Comm(), names)
        model.register_comm_hook(hook, _timed(gradcomp_comm_hook, box))
    else:
        hook = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                  min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
        model.register_comm_hook(hook, _timed(psgd.powerSGD_hook, box))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if isinstance(hook, GradCompHook):  # our engine commits its memories on optimizer steps
        hook.attach_optimizer(opt)
    n = xtr.shape[0] // world
    spe = n // BATCH
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=spe * epochs)
    step_times, hook_times, resolve_times = [], [], []
    for epoch in range(epochs):
        perm = torch.randperm(xtr.shape[0], generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        mine = perm[rank * n:(rank + 1) * n]
        for i in range(spe):
            idx = mine[i * BATCH:(i + 1) * BATCH]
            box[0] = box[1] = 0.0
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step_times.append(time.perf_counter() - start)
            hook_times.append(box[0])
            resolve_times.append(box[1])
    compressed_steps = epochs * spe - 2
    if which == "ours":
        dense_steps_bytes = 2 * all_reduce_bytes(4 * sum(p.numel() for p in net.parameters()), world)
        per_step = (hook.stats.wire_bytes - dense_steps_bytes) / compressed_steps
    else:
        _, _, after = hook.compression_stats()
        per_step = all_reduce_bytes(4 * after / compressed_steps, world)
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    skip = 2 + 5
    return {"accuracy": accuracy(net, xte, yte), "bytes_per_step": per_step,
            "hook_ms": 1e3 * statistics.median(hook_times[skip:]),
            "resolve_ms": 1e3 * statistics.median(resolve_times[skip:]),
            "step_ms": 1e3 * statistics.median(step_times[skip:]), "checksum": float(params.double().sum())}


def run_torch_compare(which: str, seed: int, epochs: int) -> dict[str, Any]:
    """Rank 0's figures of one raw-DDP run (``which``: ``"torch"`` or ``"ours"``); checks the replicas agree."""
    results = run_workers(_train_torch, WORLD, which, seed, epochs, timeout=3600.0)
    assert results[0]["checksum"] == results[1]["checksum"], f"{which}: replicas differ"
    return results[0]


def part_torch(args: argparse.Namespace) -> dict[str, Any]:
    epochs = args.epochs or 6
    out: dict[str, Any] = {}
    for seed in args.seeds:
        for which in ("torch", "ours", "torch", "ours"):  # alternate so machine noise hits both alike
            out.setdefault(which, []).append(run_torch_compare(which, seed, epochs))
    dense_bytes = all_reduce_bytes(4 * sum(p.numel() for p in make_mlp(0).parameters()), WORLD)
    mean = statistics.fmean
    print(f"\nPowerSGD rank 4, single bucket, W={WORLD}, {epochs} epochs, seeds {args.seeds} (2 runs each)")
    print("| hook | bytes per compressed step | vs dense | hook body ms/step | hook call to result ms/step "
          "| step ms | test accuracy |")
    print("|---|---|---|---|---|---|---|")
    for which, label in (("torch", "torch `powerSGD_hook`"), ("ours", "`PowerSGD(rank=4)` (this library)")):
        runs = out[which]
        b = mean([r["bytes_per_step"] for r in runs])
        print(f"| {label} | {b:,.0f} | {dense_bytes / b:.1f}x less | {mean([r['hook_ms'] for r in runs]):.2f} "
              f"| {mean([r['resolve_ms'] for r in runs]):.2f} | {mean([r['step_ms'] for r in runs]):.2f} "
              f"| {mean([r['accuracy'] for r in runs]):.4f} |")
    for key, what in (("resolve_ms", "hook call to result"), ("step_ms", "step")):
        ratio = mean([r[key] for r in out["ours"]]) / mean([r[key] for r in out["torch"]])
        print(f"{what} time ratio ours / torch (medians, same run set): {ratio:.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "lgreco", "torch"), default="all")
    parser.add_argument("--tasks", nargs="+", choices=("resnet", "cnn", "lm", "lm_untied", "mlp"),
                        default=["resnet", "cnn", "lm", "mlp"])
    parser.add_argument("--families", nargs="+", choices=tuple(FAMILIES), default=["powersgd", "topk", "qsgd"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=None, help="default: 4 (resnet), 6 (mlp)")
    parser.add_argument("--dense-epochs", type=float, default=0.0,
                        help="dense warm-up before compression starts, in epochs (default 0: compress from step 2)")
    parser.add_argument("--train-size", type=int, default=20000, help="Fashion-MNIST training images (resnet)")
    parser.add_argument("--no-dense", dest="dense", action="store_false", help="skip the dense DDP reference run")
    parser.add_argument("--figure", default=str(ROOT / "docs" / "figures" / "lgreco_layers.png"),
                        help="per-layer chart (PNG; '' to skip)")
    parser.add_argument("--error", choices=("norm", "squared", "feedback"), default="norm",
                        help="LGreCo(error=...): budget on the sum of norms (paper), on the total squared error, or "
                             "on the steady-state error-feedback memories")
    parser.add_argument("--variants", nargs="+", default=["statistic=gradient"],
                        help="L-GreCo settings compared with the same uniform run, each 'key=value,...' with keys "
                             "statistic (gradient|input), error (norm|squared|feedback), period (epochs between "
                             "re-plans, default 0.5), window (sum|steps); the first variant is the one drawn")
    parser.add_argument("--uniform-from", nargs="+", default=None,
                        help="--json files of earlier runs whose uniform runs are reused (same task, family, seed, "
                             "epochs and train size; the runs are deterministic) instead of re-run")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's record here")
    parser.add_argument("--plot-from", type=Path, nargs="+", default=None,
                        help="only redraw --figure from --json files written by earlier runs (merged; each family's "
                             "lowest seed is drawn)")
    args = parser.parse_args()
    if args.plot_from is not None:
        lgreco = merge_records([json.loads(path.read_text())["lgreco"] for path in args.plot_from])
        plot_layers(lgreco, [f for f in args.families if all(f in r for r in lgreco.values())], Path(args.figure))
        return
    torch.set_num_threads(1)
    records: dict[str, Any] = {}

    def save() -> None:
        if args.json is not None:
            args.json.write_text(json.dumps(records))

    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("all", "lgreco"):
            lgreco: dict[str, Any] = {}
            records["lgreco"] = lgreco
            for name in args.tasks:
                lgreco[name] = {}
                part_lgreco(build_task(name, args), args, Path(tmp), lgreco[name], save)
                save()
            if args.figure:
                plot_layers(lgreco, args.families, Path(args.figure))
        if args.part in ("all", "torch"):
            records["torch"] = part_torch(args)
            save()


if __name__ == "__main__":
    main()
