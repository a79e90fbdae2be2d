"""ResNet (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016): the CNN baseline
of IBM's ImageNet distributed mixed-precision benchmark ("the official implementation of ResNet-50 by PyTorch").

The network is torchvision's ``ResNet``, subclassed rather than rewritten, so parameter names are
torchvision's, which are also timm's (``conv1``, ``bn1``, ``layer1.0.conv1`` ... ``fc``): state dicts
load into ``torchvision.models.resnet50()`` and ``timm.create_model("resnet50")`` strictly.

Choices that differ from the paper:
- Bottlenecks downsample in the 3x3 convolution, not the first 1x1 ("ResNet v1.5", torchvision's
  and timm's layout); the paper's option B projection shortcuts are kept.
- ``zero_init_residual`` (default on) starts the last BatchNorm scale of every residual branch at
  zero, so each block begins as the identity (Goyal et al. 2017, "Accurate, Large Minibatch SGD",
  §5.1), the large-batch recipe of that benchmark.
- ``drop_rate`` adds dropout before the classifier (timm's ``drop_rate``); 0 by default.
- ``in_chans`` other than 3 replaces the stem convolution by one of the same shape otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

# Block type and blocks per stage (He et al. 2016, Table 1).
RESNET_LAYOUTS: dict[int, tuple[type[nn.Module], tuple[int, int, int, int]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
}
_STEM_CHANNELS = 64
_STAGE_WIDTHS = (64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class ResNetArgs:
    """Architecture of a ResNet."""

    depth: Literal[18, 34, 50, 101, 152] = 50
    img_size: int = 224
    """Training resolution (for FLOPs and records); the network itself takes any size."""
    in_chans: int = 3
    num_classes: int = 1000
    zero_init_residual: bool = True
    """Zero-init the last BatchNorm scale of each residual branch (Goyal et al. 2017, §5.1)."""
    drop_rate: float = 0.0
    """Dropout before the classifier."""


class ResNet(torchvision.models.ResNet):
    def __init__(self, args: ResNetArgs, device=None, dtype=None):
        if args.depth not in RESNET_LAYOUTS:
            raise ValueError(f"ResNetArgs.depth {args.depth} is not one of {sorted(RESNET_LAYOUTS)}")
        block, layers = RESNET_LAYOUTS[args.depth]
        # torchvision's constructor takes no device/dtype: build on meta (free, whatever the size),
        # then materialize and initialize here, as a training step's build order does outside
        # (docs/architecture.md, "A training step").
        with torch.device("meta"):
            super().__init__(block, list(layers), num_classes=args.num_classes)
            if args.in_chans != 3:
                self.conv1 = nn.Conv2d(args.in_chans, _STEM_CHANNELS, 7, stride=2, padding=3, bias=False)
        self.args = args
        self.head_drop = nn.Dropout(args.drop_rate)
        if dtype is not None:
            self.to(dtype=dtype)
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    # --- the model protocol (docs/models.md) ------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """torchvision's initialization: He normal (fan out) convs, unit BatchNorm, default fc."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (nn.BatchNorm2d, nn.Linear)):
                module.reset_parameters()
        if self.args.zero_init_residual:
            for block in self.block_modules():
                nn.init.zeros_(block.bn3.weight if isinstance(block, Bottleneck) else block.bn2.weight)

    def no_weight_decay(self) -> set[str]:
        """BatchNorm scales and shifts, and every bias."""
        norm_names = {
            f"{module_name}.{param_name}"
            for module_name, module in self.named_modules()
            if isinstance(module, nn.BatchNorm2d)
            for param_name, _ in module.named_parameters(recurse=False)
        }
        return norm_names | {name for name, _ in self.named_parameters() if name.endswith(".bias")}

    def block_modules(self) -> list[nn.Module]:
        """The residual blocks: units of FSDP sharding and activation checkpointing."""
        return [block for stage in self._stages() for block in stage]

    @property
    def num_layers(self) -> int:
        """Layers between the stem and the classifier, as :meth:`layer_id` counts them: the residual blocks."""
        return sum(RESNET_LAYOUTS[self.args.depth][1])

    def layer_id(self, param_name: str) -> int:
        """Depth of a parameter for layer-wise LR decay: 0 stem, i+1 residual block i (counted over all
        stages), ``num_layers + 1`` the classifier; timm's fine ``group_matcher`` numbering."""
        layers = RESNET_LAYOUTS[self.args.depth][1]
        if param_name.startswith(("conv1.", "bn1.")):
            return 0
        if param_name.startswith("layer"):
            stage, index = param_name.split(".")[:2]
            return sum(layers[: int(stage.removeprefix("layer")) - 1]) + int(index) + 1
        return self.num_layers + 1

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """The feature map after the last stage, ``(batch, channels, H/32, W/32)``, before pooling."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        for stage in self._stages():
            x = stage(x)
        return x

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        pooled = self.head_drop(torch.flatten(self.avgpool(features), 1))
        return pooled if pre_logits else self.fc(pooled)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(images))

    def _stages(self) -> tuple[nn.Sequential, ...]:
        return (self.layer1, self.layer2, self.layer3, self.layer4)


def build_resnet(args: ResNetArgs, device=None, dtype=None) -> ResNet:
    return ResNet(args, device=device, dtype=dtype)


def _conv_output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def resnet_flops(args: ResNetArgs, img_size: int) -> int:
    """Forward FLOPs per image of convolutions and the classifier (a multiply-add counts as 2),
    what ``FlopCounterMode`` counts; BatchNorm, ReLU, pooling and additions are left out."""
    block, layers = RESNET_LAYOUTS[args.depth]
    bottleneck = block is Bottleneck
    size = _conv_output_size(img_size, 7, 2, 3)
    flops = 2 * args.in_chans * _STEM_CHANNELS * 7 * 7 * size * size
    size = _conv_output_size(size, 3, 2, 1)  # max pool
    channels = _STEM_CHANNELS
    for stage, (width, num_blocks) in enumerate(zip(_STAGE_WIDTHS, layers, strict=True)):
        out_channels = width * (4 if bottleneck else 1)
        for index in range(num_blocks):
            stride = 2 if stage > 0 and index == 0 else 1
            out_size = _conv_output_size(size, 3, stride, 1)
            if bottleneck:  # 1x1 reduce at the input size, strided 3x3, 1x1 expand (v1.5)
                flops += 2 * channels * width * size * size
                flops += 2 * width * width * 9 * out_size * out_size
                flops += 2 * width * out_channels * out_size * out_size
            else:
                flops += 2 * channels * width * 9 * out_size * out_size
                flops += 2 * width * width * 9 * out_size * out_size
            if stride != 1 or channels != out_channels:  # 1x1 projection shortcut
                flops += 2 * channels * out_channels * out_size * out_size
            channels, size = out_channels, out_size
    return flops + 2 * channels * args.num_classes
