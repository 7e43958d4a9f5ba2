"""benchmarks/lgreco_compare.py: the language models, the variant parser and the re-plan schedule."""

from __future__ import annotations

import pytest
import torch
from lgreco_compare import START_STEP, TinyLM, lgreco_for, parse_variant  # benchmarks/ (on sys.path: conftest.py)


def test_untied_lm_has_its_own_output_projection() -> None:
    tied, untied = TinyLM(vocab=50, tied=True), TinyLM(vocab=50, tied=False)
    tokens = torch.randint(0, 50, (3, 7))
    assert tied(tokens).shape == untied(tokens).shape == (3, 7, 50)
    assert tied.out is None
    assert untied.out.weight.shape == (50, 64)
    assert untied.out.weight.data_ptr() != untied.embed.weight.data_ptr()
    extra = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert extra == 50 * 64 + 50  # the projection's weight and bias


def test_parse_variant_reads_grid_ends_and_rejects_unknown_keys() -> None:
    out = parse_variant("error=squared,period=1,min_factor=0.5,max_factor=2")
    assert out == {"statistic": "gradient", "error": "squared", "period": 1.0, "window": "sum",
                   "min_factor": 0.5, "max_factor": 2.0}
    with pytest.raises(SystemExit, match="unknown key 'alpha'"):
        parse_variant("alpha=0.5")


def test_replans_start_a_quarter_epoch_after_compression_starts() -> None:
    spe = 71
    assert lgreco_for({}, spe).warmup_steps == spe // 4  # compression from step 2: as before
    lg = lgreco_for({"min_factor": 0.25}, spe, start_step=spe, min_factor=0.5)
    assert lg.warmup_steps == spe + spe // 4
    assert lg.period == round(spe * 0.5)
    assert lg.min_factor == 0.5  # the variant's grid end replaces the family's
    assert lgreco_for({}, 20, start_step=START_STEP).warmup_steps == START_STEP + 11  # after a full window


def test_merge_records_joins_seeds_and_families() -> None:
    from lgreco_compare import merge_records

    a = {"lm": {"powersgd": [{"seed": 1, "x": "a1"}, {"seed": 0, "x": "a0"}], "dense": {"x": "d"}}}
    b = {"lm": {"powersgd": [{"seed": 1, "x": "b1"}], "topk": [{"seed": 2, "x": "b2"}]}, "mlp": {"qsgd": []}}
    out = merge_records([a, b])
    assert [r["x"] for r in out["lm"]["powersgd"]] == ["a0", "b1"]  # sorted by seed, later record wins
    assert out["lm"]["topk"] == [{"seed": 2, "x": "b2"}]
    assert out["lm"]["dense"] == {"x": "d"}
    assert out["mlp"] == {"qsgd": []}


def test_screen_plans_like_lgreco() -> None:
    from lgreco_screen import planned_saving

    from lightning_gradcomp.compressors import PowerSGD

    gen = torch.Generator().manual_seed(0)
    big = torch.randn(512, 1, generator=gen) @ torch.randn(1, 64, generator=gen)  # exactly rank 1
    small = torch.randn(64, 64, generator=gen)  # flat spectrum: every extra rank removes error
    stats = {"big": big, "small": small, "bias": torch.randn(64, 1)}
    shapes = {k: tuple(v.shape) for k, v in stats.items()}
    saving, choice = planned_saving(PowerSGD(rank=4), {"min_factor": 0.25, "max_factor": 4.0}, stats, shapes)
    assert set(choice) == {"big", "small"}  # a 64x1 matrix is not worth compressing at rank 4
    assert choice["big"] == 1 and choice["small"] >= 4
    assert saving > 1.0
    same, _ = planned_saving(PowerSGD(rank=4), {"min_factor": 1.0, "max_factor": 1.0}, stats, shapes)
    assert same == 1.0  # a grid of the default alone can only give the uniform setting


def test_raw_ddp_comparison_sets_our_hook_up_like_torchs() -> None:
    from lgreco_compare import torch_compare_strategy

    strategy = torch_compare_strategy()  # _train_torch builds its hook with strategy.make_hook, as a fit does
    assert repr(strategy.compressor) == "PowerSGD(rank=4)"  # error feedback, warm start, min_compression_rate 2
    assert strategy.compressor.warm_start and strategy.compressor.uses_error_feedback
    assert strategy.start_step == 2 and strategy.policy.min_numel == 1  # as torch's start_powerSGD_iter=2
