"""ResNet (He et al., 2016) without torchvision: ResNet-18/50 for ImageNet and small variants for 28x28 inputs.

``stem="imagenet"`` is the 7x7/2 convolution + 3x3/2 max-pool of the paper (224x224 inputs);
``stem="small"`` is one 3x3/1 convolution (28x28 or 32x32 inputs, as for CIFAR ResNets).
"""

from __future__ import annotations

from typing import Literal, Sequence, Union

import torch
from torch import Tensor, nn

from recipes.models.registry import register_model

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet8", "resnet18", "resnet20", "resnet50"]


def _conv_bn(cin: int, cout: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(_conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True), _conv_bn(width, cout, 3, 1))
        self.shortcut = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()
        self.out_channels = cout

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (with the stride), 1x1 expand by 4, plus shortcut (ResNet-50 v1.5 placement)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(_conv_bn(cin, width, 1, 1), nn.ReLU(inplace=True),
                                  _conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
                                  _conv_bn(width, cout, 1, 1))
        self.shortcut = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()
        self.out_channels = cout

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """A residual network: stem, stages of blocks (the first block of each later stage strides by 2), head.

    Args:
        block: ``BasicBlock`` or ``Bottleneck``.
        layers: blocks per stage.
        widths: base width of each stage (output channels = width * block expansion).
        num_classes: classifier outputs.
        in_channels: input image channels (3 for RGB, 1 for grey).
        stem: ``"imagenet"`` (7x7/2 + max-pool, 64 channels) or ``"small"`` (3x3/1, ``widths[0]`` channels).
        zero_init_residual: zero the last BN of each block, so blocks start as identities (helps large batches).
    """

    def __init__(self, block: type[Union[BasicBlock, Bottleneck]], layers: Sequence[int], widths: Sequence[int],
                 num_classes: int = 1000, in_channels: int = 3, stem: Literal["imagenet", "small"] = "imagenet",
                 zero_init_residual: bool = False) -> None:
        super().__init__()
        if len(layers) != len(widths) or not layers or min(layers) < 1:
            raise ValueError(f"`layers` and `widths` must be equally long and non-empty with layers >= 1, "
                             f"got {list(layers)} and {list(widths)}")
        if num_classes < 1 or in_channels < 1:
            raise ValueError(f"`num_classes` and `in_channels` must be >= 1, got {num_classes} and {in_channels}")
        if stem == "imagenet":
            cin = 64
            self.stem = nn.Sequential(_conv_bn(in_channels, cin, 7, 2), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(3, 2, 1))
        elif stem == "small":
            cin = widths[0]
            self.stem = nn.Sequential(_conv_bn(in_channels, cin, 3, 1), nn.ReLU(inplace=True))
        else:
            raise ValueError(f"`stem` must be 'imagenet' or 'small', got {stem!r}")
        stages = []
        for i, (n, width) in enumerate(zip(layers, widths)):
            blocks = []
            for j in range(n):
                b = block(cin, width, 2 if (j == 0 and i > 0) else 1)
                cin = b.out_channels
                blocks.append(b)
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, num_classes)
        self._init_weights(zero_init_residual)

    def _init_weights(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.body[-1][1].weight)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (N, C, H, W) images -> (N, num_classes) logits."""
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


@register_model
def resnet8(num_classes: int = 10, in_channels: int = 1, stem: Literal["imagenet", "small"] = "small") -> ResNet:
    """3 BasicBlocks at 16/32/64 channels (78k parameters for 10 grey classes): the CPU recipe."""
    return ResNet(BasicBlock, (1, 1, 1), (16, 32, 64), num_classes, in_channels, stem)


@register_model
def resnet20(num_classes: int = 10, in_channels: int = 3, stem: Literal["imagenet", "small"] = "small") -> ResNet:
    """The CIFAR ResNet-20: 3 stages of 3 BasicBlocks at 16/32/64 channels."""
    return ResNet(BasicBlock, (3, 3, 3), (16, 32, 64), num_classes, in_channels, stem)


@register_model
def resnet18(num_classes: int = 1000, in_channels: int = 3, stem: Literal["imagenet", "small"] = "imagenet") -> ResNet:
    """ResNet-18: BasicBlocks (2, 2, 2, 2) at 64..512 channels."""
    return ResNet(BasicBlock, (2, 2, 2, 2), (64, 128, 256, 512), num_classes, in_channels, stem)


@register_model
def resnet50(num_classes: int = 1000, in_channels: int = 3, stem: Literal["imagenet", "small"] = "imagenet") -> ResNet:
    """ResNet-50: Bottlenecks (3, 4, 6, 3) at 64..512 base widths (2048 output channels)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), (64, 128, 256, 512), num_classes, in_channels, stem,
                  zero_init_residual=True)
