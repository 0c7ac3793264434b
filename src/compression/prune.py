"""Structured channel pruning of a trained ResNet's residual blocks (issue 57, pruning: compression prune).

Golden Stick 1.3.0's pruners were tried on this repository's resnet18 and resnet50 on CPU
(docs/compression.md): UniPruner's graph analyzer pruned the stem and the residual streams but left
layer1's convolutions at 64 input channels, so the pruned network failed at its first block; SCOP's
cells that cut channels out fail on CPU (`Clone`), and its fine-tune stage only masks channels to
zero (the same parameters and FLOPs). So channels are removed here: only the INNER channels of each
block (the outputs of conv1 in BasicBlock, of conv1 and conv2 in Bottleneck, with their BatchNorms
and the next convolution's inputs), so every residual addition keeps its shape. Which channels stay
is the criterion's choice: the filters of largest L1 norm (`prune_criterion l1`: no BatchNorm
statistics, no training stage of its own) or of highest SCOP score (`scop`: Golden Stick's knockoff
stage, src/compression/scop.py). Kept counts are multiples of 16 where possible (the oneDNN CPU
layers block channels by 16).

A pruned network is a standard ResNet with narrower blocks, and its checkpoint holds nothing else:
the kept widths are the shapes of its inner convolutions' weights (`layer1.0.conv1.weight`).
`pruned_widths` reads them from a checkpoint (against the full widths the network's architecture
gives, which the un-pruned convolutions still show), and `narrow_blocks` builds a fresh network to
them, so eval.py and export.py rebuild the pruned structure from the checkpoint alone.
"""
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from mindspore import Parameter, Tensor, nn

from src.compression import check_prune_ratio
from src.errors import UserInputError
from src.resnet import BasicBlock, Bottleneck, ResNet, batch_norm, bottleneck_width, conv2d

BLOCK = 16


def kept_channels(channels: int, prune_ratio: float) -> int:
    """How many of `channels` stay: (1 - prune_ratio) of them, rounded to a multiple of 16 when that
    leaves at least 16, never 0 and never more than `channels`."""
    check_prune_ratio(prune_ratio)
    keep = max(1, int(round(channels * (1.0 - prune_ratio))))
    if keep >= BLOCK:
        keep = max(BLOCK, int(round(keep / BLOCK)) * BLOCK)
    return min(keep, channels)


def _highest(scores: np.ndarray, keep: int) -> np.ndarray:
    """The indices of the `keep` highest `scores` (the first of equal ones), in their original order."""
    return np.sort(np.argsort(-scores, kind="stable")[:keep])


def _l1_norms(conv: nn.Conv2d) -> np.ndarray:
    """The L1 norm of each output filter of `conv`."""
    weight = conv.weight.asnumpy()
    return np.abs(weight).reshape(weight.shape[0], -1).sum(axis=1)


def _set(param: Parameter, values: np.ndarray) -> None:
    param.set_data(Tensor(np.ascontiguousarray(values, dtype=np.float32)))


def _pruned_pair(conv: nn.Conv2d, bn: nn.BatchNorm2d, idx: np.ndarray, stride: int, group: int):
    """A copy of conv (its output filters `idx`) and bn (the same channels)."""
    new_conv = conv2d(conv.in_channels, len(idx), conv.kernel_size[0], stride, group)
    _set(new_conv.weight, conv.weight.asnumpy()[idx])
    new_bn = batch_norm(len(idx), eps=bn.eps)
    new_bn.use_batch_statistics = bn.use_batch_statistics  # freeze_bn stays as it was
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        _set(getattr(new_bn, name), getattr(bn, name).asnumpy()[idx])
    return new_conv, new_bn


def _narrowed_input(conv: nn.Conv2d, idx: np.ndarray, stride: int) -> nn.Conv2d:
    """A copy of conv that reads only the input channels `idx`."""
    new_conv = conv2d(len(idx), conv.out_channels, conv.kernel_size[0], stride)
    _set(new_conv.weight, conv.weight.asnumpy()[:, idx])
    return new_conv


def _stride(conv: nn.Conv2d) -> int:
    return conv.stride[2] if len(conv.stride) == 4 else conv.stride[0]


def _blocks(net: nn.Cell) -> List[Tuple[str, nn.Cell]]:
    """(name, block) of every BasicBlock/Bottleneck of `net`, in order."""
    return [(name, cell) for name, cell in net.cells_and_names() if isinstance(cell, (BasicBlock, Bottleneck))]


def _remove_channels(net: nn.Cell, keep: Callable[[str, nn.Conv2d], np.ndarray]) -> List[int]:
    """Narrow the inner channels of every block of `net` in place to the output filters
    `keep(name, conv)` chooses for each inner convolution (`name`: its cell's, `layer1.0.conv1`);
    returns the inner widths, block by block."""
    widths: List[int] = []
    blocks = _blocks(net)
    if not blocks:
        raise UserInputError("compression prune needs a torchvision-family ResNet (BasicBlock or Bottleneck blocks)")
    for name, block in blocks:
        if not isinstance(block.conv1, nn.Conv2d) or type(block.conv1) is not nn.Conv2d:
            raise UserInputError("compression prune works on nn.Conv2d layers: prune before choosing oneDNN layers")
        if isinstance(block, BasicBlock):
            idx = keep(f"{name}.conv1", block.conv1)
            block.conv1, block.bn1 = _pruned_pair(block.conv1, block.bn1, idx, _stride(block.conv1), 1)
            block.conv2 = _narrowed_input(block.conv2, idx, _stride(block.conv2))
            widths.append(len(idx))
        else:
            if block.conv2.group != 1:
                raise UserInputError("compression prune does not prune grouped convolutions (ResNeXt)")
            idx1 = keep(f"{name}.conv1", block.conv1)
            block.conv1, block.bn1 = _pruned_pair(block.conv1, block.bn1, idx1, _stride(block.conv1), 1)
            conv2 = _narrowed_input(block.conv2, idx1, _stride(block.conv2))
            idx2 = keep(f"{name}.conv2", conv2)
            block.conv2, block.bn2 = _pruned_pair(conv2, block.bn2, idx2, _stride(conv2), 1)
            block.conv3 = _narrowed_input(block.conv3, idx2, _stride(block.conv3))
            widths += [len(idx1), len(idx2)]
    for name, param in net.parameters_and_names():  # the new cells' parameters take their full names
        param.name = name
    return widths


def prune_blocks(net: nn.Cell, prune_ratio: float, scores: Optional[Mapping[str, np.ndarray]] = None) -> List[int]:
    """Remove `prune_ratio` of the inner channels of every BasicBlock/Bottleneck of `net`, in place,
    and return the inner widths kept, block by block (two per Bottleneck: conv1's, then conv2's).
    The channels kept are those of the highest `scores` (by convolution cell name, one per output
    channel: SCOP's, src/compression/scop.py), or of the largest filter L1 norms without them."""
    def keep(name: str, conv: nn.Conv2d) -> np.ndarray:
        score = _l1_norms(conv) if scores is None else np.asarray(scores[name])
        if score.shape != (conv.out_channels,):
            raise ValueError(f"{score.shape} scores for the {conv.out_channels} output channels of {name}")
        return _highest(score, kept_channels(conv.out_channels, prune_ratio))

    return _remove_channels(net, keep)


def narrow_blocks(net: nn.Cell, widths: Sequence[int]) -> nn.Cell:
    """`net`, freshly built, narrowed in place to the inner `widths` of a pruned checkpoint (as
    prune_blocks returns them): each block keeps its first filters, which loading the checkpoint
    then replaces."""
    inner = len(full_widths(net))
    if len(widths) != inner:
        raise ValueError(f"{len(widths)} widths given for the {inner} inner convolutions of the network")
    remaining = iter(widths)
    _remove_channels(net, lambda name, conv: np.arange(next(remaining)))
    return net


def full_widths(net: nn.Cell) -> Dict[str, int]:
    """The parameter name of each block's inner convolution weights -> its width before pruning, as
    the architecture gives it (read from what pruning leaves whole: a BasicBlock's conv2 outputs,
    a Bottleneck's conv3 outputs); empty for a network pruning does not handle."""
    if not isinstance(net, ResNet):
        return {}
    shapes = {param.name: tuple(param.shape) for param in net.get_parameters()}
    widths: Dict[str, int] = {}
    for name, block in _blocks(net):
        if isinstance(block, BasicBlock):
            widths[f"{name}.conv1.weight"] = shapes[f"{name}.conv2.weight"][0]
        else:
            planes = shapes[f"{name}.conv3.weight"][0] // Bottleneck.expansion
            width = bottleneck_width(planes, net.groups, net.width_per_group)
            widths[f"{name}.conv1.weight"] = widths[f"{name}.conv2.weight"] = width
    return widths


def pruned_widths(net: nn.Cell, params: Mapping[str, Parameter]) -> Optional[List[int]]:
    """The inner widths of `params` (a checkpoint's network tensors under this repository's names)
    when it is a pruned checkpoint of `net`'s architecture: every inner convolution there, none wider
    than the full width and some narrower. None otherwise (a float checkpoint, or one of another
    network, which the name and shape checks report)."""
    full = full_widths(net)
    if not full or any(name not in params for name in full):
        return None
    found = [int(params[name].shape[0]) for name in full]
    if found == list(full.values()) or any(got > width for got, width in zip(found, full.values())):
        return None
    return found
