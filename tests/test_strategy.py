"""GradCompStrategy end to end with Lightning (fork launcher, gloo, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from helpers.distributed import run_workers
from helpers.models import (ReadyOrderNet, SparseEmbeddingNet, TinyNet, assert_replicas_identical,
                            assert_resume_matches, fit)
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.comm import Comm, all_gather_bytes, all_reduce_bytes
from lightning_gradcomp.compressors import (CLTK, DIANA, QSGD, Cast, Compressor, NoCompression, PowerSGD, RandomK,
                                            SignSGD, TernGrad, TopK)
from lightning_gradcomp.functional import kept_count
from lightning_gradcomp.hook import gradcomp_comm_hook
from lightning_gradcomp.strategy import CHECKPOINT_KEY

COMPRESSORS = {
    "none": lambda: NoCompression(),
    "fp16": lambda: Cast(torch.float16),
    "bf16": lambda: Cast(torch.bfloat16),
    "topk": lambda: TopK(0.05),
    "topk16": lambda: TopK(0.05, value_dtype=torch.float16),
    "randomk": lambda: RandomK(0.1),
    "randomk_unbiased": lambda: RandomK(0.3, unbiased=True),
}


def strategy(compressor: Compressor, **kwargs: Any) -> GradCompStrategy:
    return GradCompStrategy(compressor=compressor, start_method="fork", **kwargs)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_replicas_identical_after_every_step(tmp_path: Path, name: str, world: int) -> None:
    records = fit(strategy(COMPRESSORS[name]()), tmp_path, devices=world, max_epochs=2)
    assert_replicas_identical(records)
    stats = records[0]["stats"]
    assert stats["steps"] == records[0]["hook_step"] == len(records[0]["params"])
    if name != "none":
        assert stats["compressed_steps"] == stats["steps"] - 2
        assert stats["wire_bytes"] < stats["dense_bytes"]


@pytest.mark.parametrize("world", [2, 3])
def test_no_compression_is_bit_identical_to_ddp(tmp_path: Path, world: int) -> None:
    """At W = 3 too, where DDP's scaling by ``1 / W`` and a division by W differ (tests/functional/test_mean.py)."""
    ours = fit(strategy(NoCompression()), tmp_path / "ours", devices=world, max_epochs=2)
    ddp = fit(DDPStrategy(start_method="fork"), tmp_path / "ddp", devices=world, max_epochs=2)
    for a, b in zip(ours[0]["params"], ddp[0]["params"], strict=True):
        assert torch.equal(a, b)
    assert ours[0]["losses"] == ddp[0]["losses"]


@pytest.mark.parametrize("name", ["topk", "fp16", "randomk_unbiased"])
def test_gradients_as_bucket_views_change_no_bit(tmp_path: Path, name: str) -> None:
    """The default ``gradient_as_bucket_view=True`` trains exactly as DDP's copies between buckets and gradients."""
    views = fit(strategy(COMPRESSORS[name]()), tmp_path / "views", max_epochs=2)
    copies = fit(strategy(COMPRESSORS[name](), gradient_as_bucket_view=False), tmp_path / "copies", max_epochs=2)
    for a, b in zip(views[0]["params"], copies[0]["params"], strict=True):
        assert torch.equal(a, b)
    assert views[0]["losses"] == copies[0]["losses"]


@pytest.mark.parametrize("make", [lambda: CLTK(0.05), lambda: PowerSGD(rank=2)], ids=["cltk", "powersgd"])
def test_static_graph_changes_no_bit(tmp_path: Path, make: Any) -> None:
    """``static_graph=True`` (which Lightning suggests at the end of a fit) trains exactly as without it, with the
    replicas identical: DDP's first static iteration reduces every bucket at the end of backward, through the hook
    too."""
    static = fit(strategy(make(), static_graph=True), tmp_path / "static", max_epochs=2)
    plain = fit(strategy(make()), tmp_path / "plain", max_epochs=2)
    assert_replicas_identical(static)
    assert static[0]["hook_step"] == plain[0]["hook_step"] == 8
    for a, b in zip(static[0]["params"], plain[0]["params"], strict=True):
        assert torch.equal(a, b)
    assert static[0]["stats"]["wire_bytes"] == plain[0]["stats"]["wire_bytes"]


def _tinynet_layout() -> tuple[list[int], int]:
    net = TinyNet()
    compressed = [p.numel() for p in net.parameters() if p.dim() > 1 and p.numel() >= 1024]
    total = sum(p.numel() for p in net.parameters())
    return compressed, total


@pytest.mark.parametrize("world", [2, 3])
def test_wire_bytes_match_the_formula(tmp_path: Path, world: int) -> None:
    records = fit(strategy(TopK(0.05)), tmp_path, devices=world, max_epochs=1)
    stats = records[0]["stats"]
    compressed, total = _tinynet_layout()
    dense_numel = total - sum(compressed)
    steps = stats["steps"]
    k = sum(kept_count(n, 0.05) for n in compressed)
    per_dense_step = all_reduce_bytes(4 * total, world)
    per_compressed_step = all_reduce_bytes(4 * (dense_numel + 1), world) + all_gather_bytes(8 * k, world)
    assert stats["dense_bytes"] == pytest.approx(steps * per_dense_step)
    assert stats["wire_bytes"] == pytest.approx(2 * per_dense_step + (steps - 2) * per_compressed_step)
    layer = stats["layers"]["body.2.weight"]
    assert layer["compressed"] and layer["param"] == 0.05 and layer["numel"] == 4096
    assert not stats["layers"]["head.weight"]["compressed"]


RESUMABLE = {  # name: (compressor, strategy kwargs, TinyNet kwargs)
    "fp16": (lambda: Cast(torch.float16), {}, {}),
    "topk": (lambda: TopK(0.05), {}, {}),
    "randomk": (lambda: RandomK(0.1), {}, {}),
    "randomk_unbiased": (lambda: RandomK(0.3, unbiased=True), {}, {}),
    "cltk_lowpass": (lambda: CLTK(0.05), {"beta": 0.5}, {}),
    # hidden=10: PowerSGD's decode p @ q.T of a 10 x 2 by 2 x 128 product depends on the thread count (MKL)
    "powersgd": (lambda: PowerSGD(rank=2), {}, {"hidden": 10, "in_features": 128}),
    "signsgd": (lambda: SignSGD(bucket_size=128), {}, {}),
    "diana": (lambda: DIANA(), {}, {}),
    "qsgd": (lambda: QSGD(bits=4, bucket_size=128), {}, {}),
    "terngrad": (lambda: TernGrad(bucket_size=128), {}, {}),
}


STATELESS = {"fp16", "qsgd", "terngrad"}  # no per-rank state but the step counter: W = 2 covers their resume


@pytest.mark.parametrize(("name", "world"), [(name, world) for name in sorted(RESUMABLE) for world in (2, 3)
                                             if world == 2 or name not in STATELESS])
def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path, name: str, world: int) -> None:
    make, kwargs, net = RESUMABLE[name]

    def run(out: Path, epochs: int, **options: Any) -> list[dict[str, Any]]:
        model = (TinyNet if world == 2 else ReadyOrderNet)(samples=32 * world, **net)  # 4 steps per epoch
        return fit(strategy(make(), **kwargs), out, devices=world, model=model, max_epochs=epochs, **options)

    straight = run(tmp_path / "straight", 4)
    ckpt_dir = tmp_path / "ckpt"
    run(tmp_path / "first", 2, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], enable_checkpointing=True)
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    assert saved[CHECKPOINT_KEY]["world_size"] == world and len(saved[CHECKPOINT_KEY]["shards"]) == world
    resumed = run(tmp_path / "resumed", 4, ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert_resume_matches(straight, resumed)


def test_gradient_accumulation_compresses_once_per_optimizer_step(tmp_path: Path) -> None:
    records = fit(strategy(TopK(0.05)), tmp_path, max_epochs=2, accumulate_grad_batches=2)
    assert_replicas_identical(records)
    batches = len(records[0]["params"])
    assert records[0]["stats"]["steps"] == batches // 2


def test_bf16_mixed_on_cpu(tmp_path: Path) -> None:
    records = fit(strategy(TopK(0.05)), tmp_path, max_epochs=2, precision="bf16-mixed")
    assert_replicas_identical(records)
    assert records[0]["stats"]["compressed_steps"] > 0


def test_find_unused_parameters(tmp_path: Path) -> None:
    records = fit(strategy(RandomK(0.1), find_unused_parameters=True), tmp_path, max_epochs=2,
                  model=TinyNet(unused_branch=True))
    assert_replicas_identical(records)


@pytest.mark.parametrize("nonfinite", ["zero", "dense"])
def test_sparse_embedding_gradients_train_next_to_compressed_layers(tmp_path: Path, nonfinite: str) -> None:
    """``nn.Embedding(sparse=True)``: its sparse gradient is reduced as DDP reduces it, the dense layers are
    compressed; rank 1's NaN in it at step 3 is seen on every rank's sum alike: zeroed (``"zero"``), or passed on as
    DDP would (``"dense"``: the embedding becomes NaN on every rank, the same bits, and so do later gradients)."""
    records = fit(
        strategy(TopK(0.05), nonfinite=nonfinite), tmp_path, max_epochs=2, model=SparseEmbeddingNet(poison_step=3)
    )
    for rec in records[1:]:  # the same bits on every rank after every step (NaN included: compared as integers)
        pairs = zip(records[0]["params"], rec["params"], strict=True)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in pairs)
    embedding = SparseEmbeddingNet().embed.weight.numel()  # its weight is the model's last parameter
    for rec in records:
        stats = rec["stats"]
        assert stats["compressed_steps"] == stats["steps"] - 2 and stats["wire_bytes"] < stats["dense_bytes"]
        last = rec["params"][-1]
        if nonfinite == "zero":
            assert stats["nonfinite_steps"] == 1  # the sparse bucket of step 3, on every rank
            assert bool(torch.isfinite(last).all())
        else:  # the NaN embedding then poisons every later step's gradients, as with DDP
            assert stats["nonfinite_steps"] > 1 and not bool(torch.isfinite(last[-embedding:]).all())


def test_sparse_embedding_gradients_resume_exactly(tmp_path: Path) -> None:
    def run(out: Path, epochs: int, **options: Any) -> list[dict[str, Any]]:
        model = SparseEmbeddingNet()
        return fit(strategy(TopK(0.05)), out, model=model, max_epochs=epochs, **options)

    straight = run(tmp_path / "straight", 4)
    ckpt_dir = tmp_path / "ckpt"
    run(tmp_path / "first", 2, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], enable_checkpointing=True)
    resumed = run(tmp_path / "resumed", 4, ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert_resume_matches(straight, resumed)


def test_frozen_layers_are_left_out(tmp_path: Path) -> None:
    records = fit(strategy(TopK(0.05)), tmp_path, max_epochs=2, model=TinyNet(freeze_first=True))
    assert_replicas_identical(records)
    layers = records[0]["stats"]["layers"]
    assert "body.0.weight" not in layers and layers["body.2.weight"]["compressed"]
    first = records[0]["params"][0][: 32 * 64]
    assert torch.equal(records[0]["params"][-1][: 32 * 64], first)


@pytest.mark.parametrize("policy", ["zero", "dense"])
@pytest.mark.parametrize("target", ["weight", "bias"])
def test_nonfinite_gradient_spares_the_memory(tmp_path: Path, policy: str, target: str) -> None:
    """A NaN in a compressed slot (checked in the compensation's pass) or in a dense one (the bias: scanned with
    the dense slots) is caught alike."""
    records = fit(strategy(TopK(0.05), nonfinite=policy), tmp_path, max_epochs=2, model=_NaNOnce(target=target))
    for rank in range(2):
        assert records[rank]["stats"]["nonfinite_steps"] >= 1
        assert records[rank]["memory"] and all(bool(torch.isfinite(m).all()) for m in records[rank]["memory"].values())
    if policy == "zero":  # training continues with finite parameters; the step added no gradient
        assert records[0]["stats"]["nonfinite_steps"] == 1
        assert_replicas_identical(records)
        assert all(bool(torch.isfinite(p).all()) for p in records[0]["params"])
        assert all(loss == loss for loss in records[0]["losses"])
    else:  # DDP semantics: the NaN reaches the optimizer (fp16 AMP's GradScaler would skip that step)
        assert not bool(torch.isfinite(records[0]["params"][-1]).all())


@pytest.mark.parametrize("value", [float("nan"), 1e6])
@pytest.mark.parametrize("size_rule", [{}, {"min_numel": 1024, "compress_1d": False}])
def test_cast_decides_on_the_result_without_a_flag(tmp_path: Path, value: float, size_rule: dict) -> None:
    """fp16 sends no NaN/Inf flag: a NaN, or a finite 1e6 whose fp16 cast overflows (inf), shows in the averaged
    bucket, identical on every rank, and is caught there (counted once; "zero": the step adds nothing). By default
    every layer is cast (one span, checked by the kernel's widening pass); with the default size rule of the other
    compressors, biases and small layers go dense in an async all-reduce and the whole bucket is checked."""
    cast = strategy(Cast(torch.float16), nonfinite="zero", **size_rule)
    records = fit(cast, tmp_path, max_epochs=2, model=_NaNOnce(value))
    assert_replicas_identical(records)
    dense = {name for name, layer in records[0]["stats"]["layers"].items() if not layer["compressed"]}
    assert bool(dense) == bool(size_rule)  # biases and the head go dense only under the explicit rule
    for rank in range(2):
        assert records[rank]["stats"]["nonfinite_steps"] == 1
        assert all(bool(torch.isfinite(p).all()) for p in records[rank]["params"])


class _NaNOnce(TinyNet):
    """Rank 1's gradient of ``body.2.<target>`` holds ``value`` (NaN) at step 4 (injected before the comm hook
    runs)."""

    def __init__(self, value: float = float("nan"), target: str = "weight") -> None:
        super().__init__()
        self.value = value
        self.target = target

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 4 and self.global_rank == 1:
            def poison(grad: torch.Tensor) -> torch.Tensor:
                handle.remove()
                return grad.index_fill(0, torch.tensor([0]), self.value)

            handle = getattr(self.body[2], self.target).register_hook(poison)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"start_step": 1}, ValueError, r"`start_step` must be in \[2, inf\)"),
    ({"start_step": 2.5}, TypeError, "`start_step` must be an integer"),
    ({"min_numel": 0}, ValueError, "`min_numel` must be in"),
    ({"beta": 0.0}, ValueError, r"`beta` must be a number in \(0, 1\]"),
    ({"beta": 1.5}, ValueError, "beta"),
    ({"seed": -1}, ValueError, "`seed`"),
    ({"compress_1d": 1}, TypeError, "`compress_1d` must be a bool"),
    ({"nonfinite": "skip"}, ValueError, "`nonfinite` must be 'dense' or 'zero'"),
    ({"compressor": 3}, TypeError, "`compressor` must be a Compressor"),
    ({"compressor": "nope"}, KeyError, "unknown compressor"),
    ({"ddp_comm_hook": lambda s, b: None}, ValueError, "`ddp_comm_hook` cannot be combined"),
    ({"model_averaging_period": 4}, ValueError, "`model_averaging_period` cannot be combined"),
    ({"ddp_comm_state": object()}, ValueError, "`ddp_comm_state` cannot be combined"),
    ({"ddp_comm_wrapper": lambda h: h}, ValueError, "`ddp_comm_wrapper` cannot be combined"),
])
def test_invalid_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        GradCompStrategy(**kwargs)


def test_compressor_by_name_and_set_beta() -> None:
    s = GradCompStrategy(compressor="topk")
    assert isinstance(s.compressor, TopK)
    s.set_beta(0.5)
    assert s.beta == 0.5
    with pytest.raises(ValueError, match="beta"):
        s.set_beta(2)
    assert s.comm_stats.steps == 0 and s.hook is None


def _with_world(world: int, rank: int = 0, compressor: Compressor | None = None) -> GradCompStrategy:
    s = GradCompStrategy(compressor=compressor or TopK())
    env = LightningEnvironment()
    env.set_world_size(world)
    env.set_global_rank(rank)
    s.cluster_environment = env
    return s


def test_checkpoint_selection_policies() -> None:
    saved = {"version": 1, "compressor": "TopK", "world_size": 2,
             "per_rank": [{"step": 5, "memory": {"w": torch.ones(2)}}, {"step": 5, "memory": {"w": torch.zeros(2)}}]}
    state, per_rank = _with_world(2, rank=1)._select_state(saved)
    assert per_rank and state["memory"]["w"].sum() == 0
    with pytest.warns(UserWarning, match="written by 2 ranks, resuming on 3"):
        state, per_rank = _with_world(3)._select_state(saved)
    assert not per_rank and state["step"] == 5
    with pytest.raises(ValueError, match="written with compressor TopK, but this strategy uses RandomK"):
        _with_world(2, compressor=RandomK())._select_state(saved)
    with pytest.raises(ValueError, match="malformed"):
        _with_world(2)._select_state({"version": 99})
    assert _with_world(2)._select_state(None) is None


def test_world_size_change_on_resume_continues(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    first = fit(strategy(TopK(0.05)), tmp_path / "first", devices=3, max_epochs=1,
                callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], enable_checkpointing=True)
    resumed = fit(strategy(TopK(0.05)), tmp_path / "resumed", devices=2, max_epochs=2,
                  ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert_replicas_identical(resumed)
    assert resumed[0]["hook_step"] == first[0]["hook_step"] + len(resumed[0]["params"])


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "signsgd", "diana", "topk", "cltk", "powersgd", "fp16"])
def test_the_compressors_bucket_size_applies_unless_the_user_sets_one(name: str) -> None:
    """``Compressor.bucket_cap_mb`` (4 MB for the quantizers) reaches DDP's kwargs; an explicit value wins."""
    from lightning_gradcomp.compressors import create
    from lightning_gradcomp.compressors.quantized import QuantizedCompressor

    preferred = create(name).bucket_cap_mb
    assert preferred == (4.0 if isinstance(create(name), QuantizedCompressor) else None)
    assert GradCompStrategy(compressor=name)._ddp_kwargs.get("bucket_cap_mb") == preferred
    assert GradCompStrategy(compressor=name, bucket_cap_mb=12)._ddp_kwargs["bucket_cap_mb"] == 12


@pytest.mark.parametrize(("given", "expected"), [({}, True), ({"gradient_as_bucket_view": None}, True),
                                                 ({"gradient_as_bucket_view": False}, False),
                                                 ({"gradient_as_bucket_view": True}, True)])
def test_gradients_are_views_of_the_buckets_unless_the_user_says_otherwise(given: dict, expected: bool) -> None:
    """The hook writes its result into DDP's bucket; with the gradients as views of it DDP copies nothing back."""
    assert GradCompStrategy(compressor="topk", **given)._ddp_kwargs["gradient_as_bucket_view"] is expected


@pytest.mark.parametrize(("given", "expected"), [({}, True), ({"gradient_as_bucket_view": False}, False)])
def test_the_cli_gets_the_same_views_default(given: dict, expected: bool) -> None:
    """LightningCLI's parser passes every DDP default explicitly (DDP's own ``False`` included): the strategy's named
    argument keeps ``True`` the default there too."""
    import json

    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=GradCompStrategy)
    init = {"compressor": "topk", "start_method": "fork", **given}
    spec = json.dumps({"class_path": "lightning_gradcomp.GradCompStrategy", "init_args": init})
    strategy = parser.instantiate(parser.parse_args(["--strategy", spec])).strategy
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is expected


def test_a_bad_views_flag_is_refused_by_name() -> None:
    with pytest.raises((ValueError, TypeError), match="gradient_as_bucket_view"):
        GradCompStrategy(compressor="topk", gradient_as_bucket_view="yes")


def _layer_params_on_one_rank(rank: int, world: int) -> tuple[dict[str, Any], list[str]]:
    net = TinyNet()
    strategy = GradCompStrategy(compressor=TopK(0.05))
    strategy._hook = strategy.make_hook(Comm(), {id(p): n for n, p in net.named_parameters()})
    strategy.set_layer_params({"body.0.weight": 0.2})
    errors = []
    for bad in ({"body.0.wieght": 0.2}, {"body.0.weight": 1.5}):
        try:
            strategy.set_layer_params(bad)
        except ValueError as error:
            errors.append(str(error))
    return dict(strategy._hook.layer_params), errors


def test_set_layer_params_rejects_unknown_names_and_bad_values() -> None:
    """A misspelt layer name would otherwise change nothing, silently; nothing is applied from a rejected call."""
    applied, errors = run_workers(_layer_params_on_one_rank, 1)[0]
    assert applied == {"body.0.weight": 0.2}
    assert len(errors) == 2 and "['body.0.wieght'] name no parameter of the model" in errors[0]
    assert "density" in errors[1]


def test_compiled_ddps_python_reducer_is_refused_at_setup(tmp_path: Path) -> None:
    """``torch._dynamo.config.optimize_ddp = "python_reducer"`` makes DDP call comm hooks once per parameter with
    ``(grad, param)`` and drop their result: the strategy refuses it by name instead of failing inside backward."""
    strategy = GradCompStrategy(compressor=TopK(0.1), start_method="fork")  # the ranks' process groups stay there
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"), pytest.raises(Exception) as err:
        fit(strategy, tmp_path, devices=2, max_steps=2)
    assert "ValueError: GradCompStrategy: the compression hook needs DDP's bucketed reducer" in str(err.value)
    assert "optimize_ddp = 'python_reducer'" in str(err.value) and "ddp_optimizer" in str(err.value)
    assert not torch.distributed.is_initialized()


def test_the_hook_refuses_the_python_reducers_per_parameter_call() -> None:
    """The same, for the hook registered without the strategy: a ``(grad, param)`` pair is not a bucket."""
    grad = torch.zeros(3)
    with pytest.raises(TypeError, match="optimize_ddp = 'python_reducer'"):
        gradcomp_comm_hook(None, (grad, torch.nn.Parameter(grad)))  # type: ignore[arg-type]


class _CenteredAcrossRanks(torch.autograd.Function):
    """``x`` minus its mean over the batch and the ranks, like SyncBatchNorm without the scale: its forward and its
    backward each all-reduce on the default group (SyncBatchNorm's backward does, during backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(0, keepdim=True)
        torch.distributed.all_reduce(mean)
        return x - mean / torch.distributed.get_world_size()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        total = grad.sum(0, keepdim=True)
        torch.distributed.all_reduce(total)  # in the autograd thread, while the hook's thread communicates
        return grad - total / (grad.shape[0] * torch.distributed.get_world_size())


class _BackwardCollectiveNet(TinyNet):
    """Six 64 x 64 layers, each followed by :class:`_CenteredAcrossRanks`."""

    def __init__(self) -> None:
        super().__init__(hidden=64, in_features=64)
        torch.manual_seed(0)
        self.body = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body:
            x = torch.tanh(_CenteredAcrossRanks.apply(layer(x)))
        return self.head(x)


@pytest.mark.parametrize(("name", "world"), [("none", 2), ("none", 5), ("topk", 2), ("topk", 3), ("topk", 4),
                                             ("qsgd", 2), ("qsgd", 3), ("powersgd", 2), ("powersgd", 3)])
def test_collectives_the_model_issues_during_backward_do_not_meet_the_hooks(tmp_path: Path, name: str,
                                                                              world: int) -> None:
    """With one layer per bucket the hook communicates while backward still runs the model's own all-reduces (as
    SyncBatchNorm's backward does on GPUs). On DDP's group the two threads' collectives met in different orders on
    different ranks: gloo aborted or timed out, even without compression. The hook has a group of its own."""
    strategy = GradCompStrategy(compressor=name, start_step=2, bucket_cap_mb=0.02, timeout=20, start_method="fork")
    records = fit(strategy, tmp_path, devices=world, model=_BackwardCollectiveNet(), max_epochs=4, max_steps=6)
    assert_replicas_identical(records)
    assert records[0]["stats"]["steps"] == 6
    assert records[0]["stats"]["compressed_steps"] == (0 if name == "none" else 4)


def _beta_probe(rank: int, world_size: int) -> list[float]:
    from lightning_gradcomp.comm import Comm, CommStats

    strategy = GradCompStrategy(compressor="topk", beta=0.3)
    seen = [strategy.beta]
    strategy._hook = strategy.make_hook(Comm(None, CommStats()), {}, torch.device("cpu"))
    seen.append(strategy._hook.memory.beta)
    state = strategy._hook.state_dict()
    strategy.set_beta(0.7)
    seen += [strategy.beta, strategy._hook.memory.beta]
    strategy._hook.load_state_dict(state)  # a resume restores the saved beta
    seen.append(strategy.beta)
    strategy.beta = 0.5
    seen.append(strategy._hook.memory.beta)
    try:
        strategy.beta = 1.5
    except ValueError as err:
        seen.append(-1.0 if "beta" in str(err) else -2.0)
    return seen


def test_beta_is_one_value_the_hooks_once_it_exists() -> None:
    """``strategy.beta`` is the memory's ``beta`` once the hook exists: a restored state's value, not a stale copy."""
    from lightning_gradcomp.gloo_workers import run_workers

    assert run_workers(_beta_probe, 1)[0] == [0.3, 0.3, 0.7, 0.7, 0.3, 0.5, -1.0]
