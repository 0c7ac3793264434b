"""A model summary: parameters, GFLOPs per image at a given size, and the size of a checkpoint.

GFLOPs follow torchvision's published convention (resnet18 1.81, resnet50 4.09 at 224 px): the
multiply-accumulates of the convolution and fully connected layers, traced through the network's
cells at the input size. BatchNorm, ReLU, pooling and the residual additions are left out, as there.
"""
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
from mindspore import nn

from src.resnet import Border, Classifier

# A training step costs about three forward passes: the forward, and twice its work backward
# (gradients of the inputs and of the weights).
TRAIN_PASSES = 3


def _pair(value) -> Tuple[int, int]:
    values = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    return int(values[0]), int(values[-1])


def conv_macs(conv: nn.Conv2d, height: int, width: int) -> Tuple[int, int, int]:
    """Multiply-accumulates of `conv` on a height x width input, and the output's height and width."""
    (kh, kw), (sh, sw), (dh, dw) = _pair(conv.kernel_size), _pair(conv.stride), _pair(conv.dilation)
    if conv.pad_mode == "same":  # the model zoo's SE-ResNet50: the output is ceil(input / stride)
        out_h, out_w = -(-height // sh), -(-width // sw)
    elif conv.pad_mode == "pad":
        padding = conv.padding if isinstance(conv.padding, (tuple, list)) else (conv.padding,) * 4
        out_h = (height + padding[0] + padding[1] - dh * (kh - 1) - 1) // sh + 1
        out_w = (width + padding[-2] + padding[-1] - dw * (kw - 1) - 1) // sw + 1
    else:
        raise ValueError(f"cannot trace pad_mode '{conv.pad_mode}'")
    per_output = kh * kw * conv.in_channels // conv.group
    return conv.out_channels * out_h * out_w * per_output, out_h, out_w


def pool_size(pool: nn.MaxPool2d, height: int, width: int) -> Tuple[int, int]:
    """The output height and width of a max-pool."""
    kernel, stride = _pair(pool.kernel_size)[0], _pair(pool.stride)[0]
    if str(pool.pad_mode).lower() == "same":
        return -(-height // stride), -(-width // stride)
    return (height - kernel) // stride + 1, (width - kernel) // stride + 1


def trace_macs(cells: Iterable[nn.Cell], height: int, width: int) -> Tuple[int, int, int]:
    """Multiply-accumulates of `cells` applied one after another (their order of construction),
    and the output's height and width. Dense layers (squeeze-excitation) see pooled features."""
    total = 0
    for cell in cells:
        if isinstance(cell, nn.Conv2d):
            macs, height, width = conv_macs(cell, height, width)
            total += macs
        elif isinstance(cell, nn.MaxPool2d):
            height, width = pool_size(cell, height, width)
        elif isinstance(cell, Border):
            height, width = height + 2, width + 2
        elif isinstance(cell, nn.Dense):
            total += cell.in_channels * cell.out_channels
    return total, height, width


def _leaves(cell: nn.Cell, skip: str = "") -> List[nn.Cell]:
    """The cells inside `cell` in construction order, without those under the name `skip`."""
    return [sub for name, sub in cell.cells_and_names()
            if not (skip and (name == skip or name.startswith(skip + ".")))]


def count_macs(net: Classifier, image_size: int) -> int:
    """Multiply-accumulates of one image through `net` at image_size x image_size."""
    stem = [cell for name, cell in net.cells_and_names() if not name.startswith(("layer", "fc"))]
    total, height, width = trace_macs(stem, image_size, image_size)
    for layer in (net.layer1, net.layer2, net.layer3, net.layer4):
        for block in layer:
            if block.downsample is not None:  # the shortcut sees the block's input
                total += trace_macs(_leaves(block.downsample), height, width)[0]
            macs, height, width = trace_macs(_leaves(block, skip="downsample"), height, width)
            total += macs
    return total + net.fc.in_channels * net.fc.out_channels


def parameter_counts(net: nn.Cell) -> Tuple[int, int]:
    """(all parameters, trainable ones); all includes BatchNorm's moving statistics."""
    every = sum(int(np.prod(p.shape)) for p in net.get_parameters())
    trainable = sum(int(np.prod(p.shape)) for p in net.trainable_params())
    return every, trainable


def parameter_bytes(cell: nn.Cell) -> int:
    """Bytes of every parameter of `cell` (a training network: the weights and the optimizer state)."""
    return sum(int(np.prod(p.shape)) * p.data.itemsize for p in cell.get_parameters())


def model_summary(net: Classifier, *, image_size: int, checkpoint_bytes: Optional[int] = None) -> Dict:
    """Parameters, GFLOPs per image at `image_size` and the checkpoint size (the weights in their
    precision when `checkpoint_bytes` is not given)."""
    every, trainable = parameter_counts(net)
    return {"parameters": every, "trainable_parameters": trainable, "image_size": image_size,
            "gflops": round(count_macs(net, image_size) / 1e9, 4),
            "checkpoint_mb": round((parameter_bytes(net) if checkpoint_bytes is None else checkpoint_bytes) / 2**20, 2)}


def format_gflops(gflops: float) -> str:
    """Two decimals as torchvision publishes them; three significant digits below 1 (small images)."""
    return f"{gflops:.2f}" if gflops >= 1 else f"{gflops:.3g}"


def summary_line(name: str, summary: Dict, checkpoint_what: str = "checkpoint") -> str:
    """One log line of a model summary."""
    return (f"model {name}: {summary['trainable_parameters']:,} trainable parameters "
            f"({summary['parameters']:,} with BatchNorm statistics), {format_gflops(summary['gflops'])} GFLOPs "
            f"per image at {summary['image_size']} px (multiply-accumulates, torchvision's convention), "
            f"{checkpoint_what} {summary['checkpoint_mb']:.1f} MiB")
