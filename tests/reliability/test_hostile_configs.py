"""Hostile configurations fail at construction, naming the argument and what it allows.

One table drives two tests: every entry is built directly, and the ones a YAML file can express are also
given to a ``LightningCLI`` (jsonargparse), which must surface the same message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import yaml
from helpers.models import TinyNet
from lightning.pytorch.cli import LightningCLI

from lightning_gradcomp import GradCompStrategy, LocalSGDStrategy, SwarmStrategy
from lightning_gradcomp.callbacks import CompressionGuard, CompressionLogger, LGreCo, LowPassMemoryFilter
from lightning_gradcomp.compressors import CLTK, DIANA, QSGD, Cast, PowerSGD, RandomK, SignSGD, TernGrad, TopK
from lightning_gradcomp.schedule import WarmupSchedule

INF = float("inf")

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")


@dataclass
class Bad:
    """One invalid input: ``target(**kwargs)`` raises ``error`` matching ``message``.

    ``yaml_as`` says where the entry goes in a LightningCLI config: ``"strategy"`` (init args of the
    strategy), ``"compressor"`` (of ``GradCompStrategy``), ``"callback"`` or ``"layerwise"``; ``None`` when
    YAML cannot express the value. ``yaml_message``: for ``Literal``-typed arguments jsonargparse rejects the
    value before the constructor runs, with its own words (still naming the key and the allowed values).
    """

    target: Any
    kwargs: dict[str, Any]
    error: type
    message: str
    yaml_as: Optional[str] = None
    yaml_message: Optional[str] = None
    id: str = field(default="")

    def __post_init__(self) -> None:
        self.id = f"{self.target.__name__}-" + "-".join(f"{k}={v}" for k, v in self.kwargs.items())


TABLE = [
    # GradCompStrategy
    Bad(GradCompStrategy, {"start_step": 1}, ValueError, r"`start_step` must be in \[2, inf\), got 1", "strategy"),
    Bad(GradCompStrategy, {"start_step": 2.5}, TypeError, r"`start_step` must be an integer, got 2.5"),
    Bad(GradCompStrategy, {"min_numel": 0}, ValueError, r"`min_numel` must be in \[1, inf\), got 0", "strategy"),
    Bad(GradCompStrategy, {"beta": 1.5}, ValueError, r"`beta` must be a number in \(0, 1\], got 1.5", "strategy"),
    Bad(GradCompStrategy, {"beta": 0.0}, ValueError, r"`beta` must be a number in \(0, 1\], got 0.0", "strategy"),
    Bad(GradCompStrategy, {"seed": -1}, ValueError, r"`seed` must be in \[0, \d+\], got -1", "strategy"),
    Bad(GradCompStrategy, {"compress_1d": "yes"}, TypeError, r"`compress_1d` must be a bool, got 'yes'"),
    Bad(GradCompStrategy, {"nonfinite": "skip"}, ValueError, r"`nonfinite` must be 'dense' or 'zero', got 'skip'",
        "strategy"),
    Bad(GradCompStrategy, {"compressor": "top_k"}, ValueError,
        r"unknown compressor 'top_k': `compressor` must be a Compressor instance or a registered name \(.*topk.*\)",
        "strategy"),
    Bad(GradCompStrategy, {"compressor": 3}, TypeError, r"`compressor` must be a Compressor instance or a "
                                                        r"registered name \(.*\), got 3"),
    Bad(GradCompStrategy, {"layerwise": "lgreco"}, TypeError,
        r"`layerwise` must be a Lightning Callback such as LGreCo\(...\), got 'lgreco'"),
    Bad(GradCompStrategy, {"timeout": 0}, ValueError, r"`timeout` must be positive and finite \(seconds in "
                                                      r"\[1e-06, 1e\+12\]\), got 0", "strategy"),
    Bad(GradCompStrategy, {"timeout": timedelta(seconds=-5)}, ValueError, r"`timeout` must be positive"),
    Bad(GradCompStrategy, {"timeout": "soon"}, TypeError, r"`timeout` must be a datetime.timedelta, a number of "
                                                          r"seconds or None, got 'soon'"),
    Bad(GradCompStrategy, {"ddp_comm_hook": print}, ValueError, r"`ddp_comm_hook` cannot be combined with "
                                                                r"GradCompStrategy.*use `compressor=` instead"),
    # compressors
    Bad(TopK, {"ratio": 0}, ValueError, r"`ratio` must be in \(0.0, 1.0\], got 0", "compressor"),
    Bad(TopK, {"ratio": 1.5}, ValueError, r"`ratio` must be in \(0.0, 1.0\], got 1.5", "compressor"),
    Bad(TopK, {"ratio": "1%"}, TypeError, r"`ratio` must be a number, got '1%'"),
    Bad(TopK, {"value_dtype": "int8"}, ValueError, r"`value_dtype` must be one of torch.float32, torch.float16, "
                                                   r"torch.bfloat16, got torch.int8", "compressor"),
    Bad(RandomK, {"unbiased": "true"}, TypeError, r"`unbiased` must be a bool, got 'true'"),
    Bad(CLTK, {"selection": "fast"}, ValueError, r"`selection` must be 'exact' or 'approx', got 'fast'", "compressor",
        r"Parser key \"selection\":\s+Expected a typing.Literal\['exact', 'approx'\]. Got value: fast"),
    Bad(CLTK, {"index_coding": "int16"}, ValueError, r"`index_coding` must be 'int32' or 'delta16', got 'int16'",
        "compressor",
        r"Parser key \"index_coding\":\s+Expected a typing.Literal\['int32', 'delta16'\]. Got value: int16"),
    Bad(PowerSGD, {"rank": 0}, ValueError, r"`rank` must be in \[1, inf\), got 0", "compressor"),
    Bad(PowerSGD, {"warm_start": "no"}, TypeError, r"`warm_start` must be a bool, got 'no'"),
    Bad(PowerSGD, {"min_compression_rate": 0.5}, ValueError, r"`min_compression_rate` must be in \[1.0, inf\), "
                                                             r"got 0.5", "compressor"),
    Bad(QSGD, {"bits": 9}, ValueError, r"`bits` must be in \[2, 8\], got 9", "compressor"),
    Bad(QSGD, {"bits": 1}, ValueError, r"`bits` must be in \[2, 8\], got 1", "compressor"),
    Bad(QSGD, {"p": "l1"}, ValueError, r"`p` must be 2 or inf, got 'l1'", "compressor"),
    Bad(QSGD, {"aggregation": "ring"}, ValueError, r"`aggregation` must be one of \('auto', 'alltoall', 'allgather'\), "
                                                   r"got 'ring'", "compressor"),
    Bad(TernGrad, {"bucket_size": 0}, ValueError, r"`bucket_size` must be in \[1, inf\), got 0", "compressor"),
    Bad(SignSGD, {"aggregation": "tree"}, ValueError,
        r"`aggregation` must be one of \('auto', 'alltoall', 'allgather'\), got 'tree'", "compressor"),
    Bad(DIANA, {"quantizer": "l3:64"}, ValueError, r"`quantizer` 'l3:64': `p` must be 2 or inf, got 'l3'",
        "compressor"),
    Bad(DIANA, {"quantizer": "linf:0"}, ValueError, r"`quantizer` 'linf:0': `group_size` must be in \[1, inf\), "
                                                    r"got 0", "compressor"),
    Bad(DIANA, {"alpha": 0.5}, ValueError, r"`alpha` must be a number in \[0, alpha_p = 0.162421\] for quantizer "
                                           r"linf:128 .*got 0.5", "compressor"),
    Bad(DIANA, {"quantizer": 128}, TypeError, r"`quantizer` must be a BlockQuantizer, a string like 'linf:128' or a "
                                              r"mapping, got 128"),
    Bad(Cast, {"dtype": torch.float32}, ValueError, r"`dtype` must be torch.float16 or torch.bfloat16, "
                                                    r"got torch.float32"),
    # callbacks
    Bad(LGreCo, {"period": 0}, ValueError, r"`period` must be in \[1, inf\), got 0", "layerwise"),
    Bad(LGreCo, {"period": 5, "accumulate_steps": 6}, ValueError, r"`accumulate_steps` must be in \[1, period = 5\], got 6",
        "layerwise"),
    Bad(LGreCo, {"alpha": 0}, ValueError, r"`alpha` must be in \(0.0, inf\), got 0", "callback"),
    Bad(LGreCo, {"error": "max"}, ValueError, r"`error` must be 'norm', 'squared' or 'feedback', got 'max'", "callback"),
    Bad(LGreCo, {"candidates": []}, TypeError, r"`candidates` must be a non-empty sequence of numbers, got \[\]"),
    Bad(LowPassMemoryFilter, {"beta": 0}, ValueError, r"`beta` must be a number in \(0, 1\], got 0", "callback"),
    Bad(LowPassMemoryFilter, {"schedule": {-1: 0.5}}, ValueError, r"`schedule` keys must be optimizer steps "
                                                                  r"\(integers >= 0\), got -1"),
    Bad(LowPassMemoryFilter, {"schedule": {10: 2.0}}, ValueError, r"`schedule` values must be numbers in \(0, 1\], "
                                                                  r"got 2.0 at step 10"),
    Bad(CompressionLogger, {"error_every_n_steps": -1}, ValueError, r"`error_every_n_steps` must be in \[0, \d+\], "
                                                                    r"got -1", "callback"),
    Bad(CompressionLogger, {"per_layer": "yes"}, TypeError, r"`per_layer` must be a bool, got 'yes'"),
    Bad(CompressionGuard, {"min_ratio": 1.0}, ValueError, r"`min_ratio` must be in \(1.0, inf\), got 1.0", "callback"),
    Bad(CompressionGuard, {"min_ratio": INF}, ValueError, r"`min_ratio` must be in \(1.0, inf\), got inf"),
    # SwarmSGD
    Bad(SwarmStrategy, {"local_steps": 0}, ValueError, r"`local_steps` must be in \[1, inf\), got 0", "strategy"),
    Bad(SwarmStrategy, {"bits": 9}, ValueError, r"`bits` must be an integer in \[1, 8\] \(or None for fp32\), got 9",
        "strategy"),
    Bad(SwarmStrategy, {"topology": "star"}, ValueError, r"`topology` must be one of \('complete', 'ring', "
                                                         r"'torus'\) or a list of edges, got 'star'", "strategy"),
    Bad(SwarmStrategy, {"lattice_margin": 0.5}, ValueError, r"`lattice_margin` must be a finite number >= 1, got 0.5",
        "strategy"),
    Bad(SwarmStrategy, {"lattice_margin": INF}, ValueError, r"`lattice_margin` must be a finite number >= 1, got inf"),
    Bad(SwarmStrategy, {"exchange_timeout": INF}, ValueError, r"`exchange_timeout` must be in \[1e-06, 1000000000000.0\], got inf"),
    # a layer-wise tuner with nothing to tune
    Bad(GradCompStrategy, {"compressor": Cast(), "layerwise": LGreCo()}, ValueError, r"`layerwise` tunes per-layer "
        r"compression parameters, but Cast is not tunable: it has no per-layer parameter"),
    # a low-pass filter with no memory to filter
    Bad(GradCompStrategy, {"compressor": QSGD(), "beta": 0.5}, ValueError, r"`beta` below 1 low-pass filters the "
        r"error-feedback memory, and QSGD\(.*\) keeps none: use beta=1"),
    Bad(LocalSGDStrategy, {"beta": 0.5}, ValueError, r"`beta` below 1 low-pass filters the error-feedback memory, "
        r"and NoCompression\(.*\) keeps none"),
    # infinite values where only finite ones mean something
    Bad(LocalSGDStrategy, {"outer_lr": INF}, ValueError, r"`outer_lr` must be in \(0.0, inf\), got inf"),
    Bad(PowerSGD, {"min_compression_rate": INF}, ValueError, r"`min_compression_rate` must be in \[1.0, inf\), got inf"),
    Bad(LGreCo, {"alpha": INF}, ValueError, r"`alpha` must be in \(0.0, inf\), got inf"),
    Bad(LGreCo, {"max_factor": INF}, ValueError, r"`max_factor` must be in \[1.0, inf\), got inf"),
    Bad(WarmupSchedule, {"steps": 10, "start": INF}, ValueError, r"`start` must be in \(0.0, inf\), got inf"),
    Bad(SwarmStrategy, {"eval_model": "best"}, ValueError, r"`eval_model` must be one of \('mean', 'rank0', "
                                                           r"'local'\), got 'best'"),
    Bad(SwarmStrategy, {"timeout": 0}, ValueError, r"`timeout` must be positive and finite"),
    Bad(GradCompStrategy, {"timeout": 1e-9}, ValueError, r"`timeout` must be positive and finite \(seconds in "
                                                         r"\[1e-06, 1e\+12\]\), got 1e-09"),
]


def test_the_table_is_big_and_covers_every_family() -> None:
    assert len(TABLE) >= 30 and len({bad.id for bad in TABLE}) == len(TABLE)
    targets = {bad.target for bad in TABLE}
    assert {GradCompStrategy, SwarmStrategy, TopK, CLTK, PowerSGD, QSGD, TernGrad, SignSGD, DIANA, LGreCo,
            LowPassMemoryFilter, CompressionLogger, CompressionGuard} <= targets
    assert sum(bad.yaml_as is not None for bad in TABLE) >= 20


@pytest.mark.parametrize("bad", TABLE, ids=[bad.id for bad in TABLE])
def test_invalid_input_raises_at_construction_naming_argument_and_allowed_values(bad: Bad) -> None:
    with pytest.raises(bad.error, match=bad.message) as info:
        bad.target(**bad.kwargs)
    assert issubclass(info.type, (ValueError, TypeError))
    named = {f"`{name}`" for name in bad.kwargs}
    assert any(n in str(info.value) for n in named), f"no argument named in: {info.value}"


# ---------------------------------------------------------------------------------------------- LightningCLI
def _class_path(target: Any) -> str:
    module = target.__module__
    for public in ("lightning_gradcomp.compressors", "lightning_gradcomp.callbacks"):
        if module.startswith(public + "."):
            module = public
    if target in (GradCompStrategy, SwarmStrategy):
        module = "lightning_gradcomp"
    return f"{module}.{target.__name__}"


def _yaml(bad: Bad) -> dict[str, Any]:
    """A complete LightningCLI config whose only error is ``bad``."""
    entry = {"class_path": _class_path(bad.target), "init_args": bad.kwargs}
    gradcomp = {"class_path": "lightning_gradcomp.GradCompStrategy",
                "init_args": {"compressor": {"class_path": "lightning_gradcomp.compressors.TopK",
                                             "init_args": {"ratio": 0.05}}}}
    trainer: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "logger": False, "strategy": gradcomp}
    if bad.yaml_as == "strategy":
        trainer["strategy"] = entry
    elif bad.yaml_as == "compressor":
        gradcomp["init_args"]["compressor"] = entry
    elif bad.yaml_as == "layerwise":
        gradcomp["init_args"]["compressor"] = {"class_path": "lightning_gradcomp.compressors.PowerSGD"}
        gradcomp["init_args"]["layerwise"] = entry
    else:
        trainer["callbacks"] = [entry]
    return {"trainer": trainer}


YAML_CASES = [bad for bad in TABLE if bad.yaml_as is not None]


def _cli_error(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The message a LightningCLI run with ``path`` fails with: an exception raised while building the
    classes, or a parse error (printed with the usage, then ``SystemExit``)."""
    try:
        LightningCLI(TinyNet, args=["--config", str(path)], run=False, save_config_callback=None,
                     seed_everything_default=0)
    except (ValueError, TypeError) as err:
        return str(err)
    except SystemExit:
        return capsys.readouterr().err
    raise AssertionError(f"LightningCLI accepted {path.read_text()}")


@pytest.mark.parametrize("bad", YAML_CASES, ids=[bad.id for bad in YAML_CASES])
def test_yaml_config_through_lightning_cli_gives_the_same_message(bad: Bad, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_yaml(bad)))
    message = _cli_error(path, capsys)
    assert re.search(bad.yaml_message or bad.message, message), message


def test_a_valid_yaml_config_builds_the_strategy_with_a_timeout(tmp_path: Path) -> None:
    """The control: the same skeleton without the error builds; ``timeout`` accepts 'h:m:s' and seconds."""
    for timeout, seconds in (("0:02:00", 120), (45, 45)):
        config = _yaml(Bad(TopK, {"ratio": 0.1}, ValueError, "", "compressor"))
        config["trainer"]["strategy"]["init_args"]["timeout"] = timeout
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        cli = LightningCLI(TinyNet, args=["--config", str(path)], run=False, save_config_callback=None,
                           seed_everything_default=0)
        strategy = cli.trainer.strategy
        assert isinstance(strategy, GradCompStrategy) and strategy.compressor.ratio == 0.1
        assert strategy._timeout == timedelta(seconds=seconds)
