"""Recipe models: known parameter counts, output shapes, decoding helpers, argument checks."""

from __future__ import annotations

import pytest
import torch

from recipes.models import create_model, list_models
from recipes.models.acoustic import CTCAcousticModel, ctc_greedy
from recipes.models.resnet import BasicBlock, ResNet
from recipes.models.seq2seq import EOS, PAD, sinusoidal_positions


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet_parameter_counts_match_the_paper_architectures():
    # torchvision / the ResNet paper: ResNet-18 has 11,689,512 parameters and ResNet-50 25,557,032 (1000 classes)
    assert _count(create_model("resnet18")) == 11_689_512
    assert _count(create_model("resnet50")) == 25_557_032


def test_resnet_shapes_for_small_and_imagenet_stems():
    torch.manual_seed(0)
    small = create_model("resnet8", num_classes=10, in_channels=1).eval()
    assert small(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    assert small(torch.randn(2, 1, 8, 8)).shape == (2, 10)  # sklearn digits
    big = create_model("resnet18", num_classes=7).eval()
    assert big(torch.randn(1, 3, 64, 64)).shape == (1, 7)


def test_resnet_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stem"):
        ResNet(BasicBlock, (1,), (8,), stem="tiny")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layers"):
        ResNet(BasicBlock, (1, 1), (8,))
    with pytest.raises(ValueError, match="arch"):
        create_model("resnet7")
    assert {"resnet8", "resnet18", "resnet50", "transformer_tiny", "lstm_ctc_small"} <= set(list_models())


def test_sinusoidal_positions_are_sin_cos_pairs():
    table = sinusoidal_positions(10, 8)
    assert table.shape == (10, 8)
    assert torch.allclose(table[:, 0::2] ** 2 + table[:, 1::2] ** 2, torch.ones(10, 4), atol=1e-6)
    assert torch.equal(table[0, 0::2], torch.zeros(4))


def test_transformer_forward_and_greedy_decode_shapes():
    torch.manual_seed(0)
    net = create_model("transformer_tiny", src_vocab=20, tgt_vocab=30, max_len=16).eval()
    src = torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, PAD]])
    tgt_in = torch.tensor([[2, 5, 6], [2, 7, PAD]])
    assert net(src, tgt_in).shape == (2, 3, 30)
    out = net.greedy_decode(src, max_new_tokens=5)
    assert out.shape[0] == 2 and out.shape[1] <= 5
    with pytest.raises(ValueError, match="max_len"):
        net(torch.ones(1, 17, dtype=torch.long), tgt_in[:1])


def test_greedy_decode_stops_and_pads_after_eos():
    net = create_model("transformer_tiny", src_vocab=10, tgt_vocab=10).eval()

    def scripted(tgt_in: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(tgt_in.shape[0], tgt_in.shape[1], 10)
        logits[..., 7] = 1.0
        if tgt_in.shape[1] >= 2:
            logits[0, -1, EOS] = 5.0  # row 0 ends after one token
        if tgt_in.shape[1] >= 3:
            logits[1, -1, EOS] = 5.0  # row 1 after two
        return logits

    net.decode = scripted  # type: ignore[method-assign]
    out = net.greedy_decode(torch.tensor([[5, 6, EOS], [4, EOS, PAD]]), max_new_tokens=6)
    assert out.tolist() == [[7, EOS, PAD], [7, 7, EOS]]


def test_ctc_model_output_lengths_and_best_path_decoding():
    model = CTCAcousticModel(n_feats=12, num_classes=5, hidden=8, layers=1, subsample=2)
    log_probs, lengths = model(torch.randn(2, 9, 12), torch.tensor([9, 4]))
    assert log_probs.shape == (2, 5, 5)
    assert lengths.tolist() == [5, 2]
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(2, 5), atol=1e-5)
    frames = torch.tensor([[1, 1, 0, 1, 2, 2, 0, 0], [3, 0, 3, 3, 0, 0, 0, 4]])
    lp = torch.nn.functional.one_hot(frames, 5).float().log()
    assert ctc_greedy(lp, torch.tensor([8, 7])) == [[1, 1, 2], [3, 3]]
    with pytest.raises(ValueError, match="subsample"):
        CTCAcousticModel(subsample=3)
