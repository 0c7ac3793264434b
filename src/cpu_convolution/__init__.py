"""ResNet's layers on CPU through a private oneDNN (native/onednn_conv.cpp), chosen by `cpu_convolution`.

MindSpore's CPU convolutions hand oneDNN plain NCHW tensors; these kernels let oneDNN choose its
blocked layouts and cache a primitive per shape. In a ResNet the convolutions, BatchNorms and the
stem's max pool all run here and the tensors stay blocked between them (cells.py); elsewhere the
convolutions alone, reordering NCHW in and out. Weights stay ordinary NCHW Parameters, so
checkpoints, conversion and export are unchanged. Only the entry points choose (choose_convolutions)
and build networks with them (src.resnet.create_model's `convolutions`)."""
from typing import Optional, Set, Tuple

from mindspore import nn

from src.cpu import cpu_flags
from src.cpu_convolution.cells import (
    OneDnnConv2d,
    all_finite_op,
    unscale_all_finite_op,
    use_onednn_convolutions,
    use_onednn_layers,
)
from src.cpu_convolution.library import set_threads, unavailable_reason
from src.errors import UserInputError

CPU_CONVOLUTIONS = ("auto", "mindspore", "onednn")
# What create_model's `convolutions` takes: MindSpore's, ours in float32, ours in bfloat16.
IMPLEMENTATIONS = ("mindspore", "onednn", "onednn-bf16")

__all__ = ["CPU_CONVOLUTIONS", "IMPLEMENTATIONS", "OneDnnConv2d", "all_finite_op", "choose_convolutions", "cpu_flags",
           "cpu_has_amx_bf16", "set_threads", "unavailable_reason", "unscale_all_finite_op", "use_onednn_convolutions",
           "use_onednn_layers", "uses_onednn"]


def uses_onednn(net: nn.Cell) -> bool:
    """Whether `net` computes with this package's layers: they choose their own precision (bfloat16
    layers on AMX CPUs), so MindSpore's float16 casts (amp) are not applied on top."""
    return any(isinstance(cell, OneDnnConv2d) for _, cell in net.cells_and_names())


def cpu_has_amx_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 in AMX tiles (where bf16 convolutions beat float32)."""
    return "amx_bf16" in cpu_flags(cpuinfo)


def choose_convolutions(choice: str, *, device_target: str, amp_level: str = "O0",
                        optimizer: str = "Momentum",
                        cpu_features: Optional[Set[str]] = None) -> Tuple[str, Optional[str]]:
    """The implementation for `cpu_convolution` (one of IMPLEMENTATIONS) and a line for the log
    (None when there is nothing to say). Only CPU uses ours; `onednn` where it cannot run is an error,
    `auto` then falls back to MindSpore's and says why. With amp on (amp_level != O0) ours computes
    in bfloat16 on CPUs with AMX, else stays float32. `cpu_features` stands in for this CPU's flags
    (tests force the other branch with it)."""
    if choice not in CPU_CONVOLUTIONS:
        raise UserInputError(f"unknown cpu_convolution '{choice}'; choose one of {', '.join(CPU_CONVOLUTIONS)}")
    if device_target != "CPU" or choice == "mindspore":
        return "mindspore", None
    if optimizer == "Thor":  # THOR replaces the Conv2d cells with its own
        reason = "optimizer Thor replaces the convolution cells with its own"
    else:
        reason = unavailable_reason()
    if reason:
        if choice == "onednn":
            raise UserInputError(f"cpu_convolution onednn cannot run: {reason}; or use --cpu_convolution mindspore")
        return "mindspore", f"cpu_convolution auto: MindSpore's CPU convolutions, because {reason}"
    if amp_level == "O0":
        return "onednn", None
    if "amx_bf16" in (cpu_flags() if cpu_features is None else cpu_features):
        return "onednn-bf16", (f"amp_level {amp_level} on CPU: the layers compute in bfloat16 (AMX) and hand each "
                               f"other bfloat16 tensors; the weights, their gradients and the head stay float32")
    return "onednn", (f"amp_level {amp_level} on CPU: the network stays float32 (this CPU has no AMX, "
                      f"where bfloat16 convolutions are slower than float32)")
