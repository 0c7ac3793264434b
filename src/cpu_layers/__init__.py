"""ResNet's layers on CPU through a private oneDNN (native/*.cpp), chosen by `cpu_convolution`.

MindSpore's CPU convolutions hand oneDNN plain NCHW tensors; these kernels let oneDNN choose its
blocked layouts and cache a primitive per shape. In a ResNet the convolutions, BatchNorms and the
stem's max pool all run here and the tensors stay blocked between them (blocked_network.py); elsewhere the
convolutions alone, reordering NCHW in and out. Weights stay ordinary NCHW Parameters, so
checkpoints, conversion and export are unchanged. Only the entry points choose (choose_convolutions)
and build networks with them (src.resnet.create_model's `convolutions`)."""
import contextlib
from typing import Callable, Iterator, Optional, Sequence, Tuple

from mindspore import nn

from src.cpu import cpu_model
from src.cpu_layers.bf16_choice import ProbeLayer, bf16_verdict
from src.cpu_layers.blocked_network import use_onednn_layers
from src.cpu_layers.convolution import OneDnnConv2d, use_onednn_convolutions
from src.cpu_layers.custom_ops import record
from src.cpu_layers.elementwise import all_finite_op, unscale_all_finite_op
from src.cpu_layers.library import (
    channels_per_block,
    freeze_weights,
    probe_convolution_ms,
    set_threads,
    take_error,
    thaw_weights,
    unavailable_reason,
)
from src.cpu_layers.optimizer import momentum_step_op
from src.cpu_layers.quantization import fake_quant_op, learned_scale_quant_ops
from src.errors import UserInputError, explain_native_errors_with

CPU_CONVOLUTIONS = ("auto", "mindspore", "onednn")
# What create_model's `convolutions` takes: MindSpore's, ours in float32, ours in bfloat16.
IMPLEMENTATIONS = ("mindspore", "onednn", "onednn-bf16")
CPU_AMP_DTYPES = ("auto", "bfloat16", "float32")

__all__ = ["CPU_AMP_DTYPES", "CPU_CONVOLUTIONS", "IMPLEMENTATIONS", "OneDnnConv2d", "ProbeLayer", "all_finite_op",
           "choose_convolutions", "fake_quant_op", "learned_scale_quant_ops", "momentum_step_op", "record",
           "set_threads", "unavailable_reason", "unscale_all_finite_op", "use_onednn_convolutions",
           "use_onednn_layers", "uses_onednn", "weights_frozen"]


def uses_onednn(net: nn.Cell) -> bool:
    """Whether `net` computes with this package's layers: they choose their own precision (bfloat16
    where it pays, see choose_convolutions), so MindSpore's float16 casts (amp) are not applied on top."""
    return any(isinstance(cell, OneDnnConv2d) for _, cell in net.cells_and_names())


@contextlib.contextmanager
def weights_frozen(net: nn.Cell) -> Iterator[None]:
    """Evaluations of `net` inside the block reorder each convolution's weights once, not on every
    call (library.freeze_weights): the weights must not change inside it but through training, which
    thaws them. Nothing happens for a network without this package's layers."""
    if not uses_onednn(net):
        yield
        return
    freeze_weights()
    try:
        yield
    finally:
        thaw_weights()


def choose_convolutions(choice: str, *, device_target: str, amp_level: str = "O0", optimizer: str = "Momentum",
                        cpu_amp_dtype: str = "auto", probe_layers: Sequence[ProbeLayer] = (), threads: int = 0,
                        cache_file: Optional[str] = None,
                        time_layer: Callable[..., float] = probe_convolution_ms) -> Tuple[str, Optional[str]]:
    """The implementation for `cpu_convolution` (one of IMPLEMENTATIONS) and a line for the log
    (None when there is nothing to say). Only CPU uses ours; `onednn` where it cannot run is an error,
    `auto` then falls back to MindSpore's and says why. With amp on (amp_level != O0) ours computes in
    bfloat16 or float32 as `cpu_amp_dtype` says; `auto` times `probe_layers` (the network's own, see
    src.resnet.probe_layers) in both types on `threads` threads, or reads an earlier run's timing from
    `cache_file` (bf16_choice.bf16_verdict; `time_layer` stands in for the timing in tests)."""
    if choice not in CPU_CONVOLUTIONS:
        raise UserInputError(f"unknown cpu_convolution '{choice}'; choose one of {', '.join(CPU_CONVOLUTIONS)}")
    if cpu_amp_dtype not in CPU_AMP_DTYPES:
        raise UserInputError(f"unknown cpu_amp_dtype '{cpu_amp_dtype}'; choose one of {', '.join(CPU_AMP_DTYPES)}")
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
    explain_native_errors_with(take_error)
    if threads > 0:
        set_threads(threads)
    if amp_level == "O0":
        return "onednn", None
    stays = f"amp_level {amp_level} on CPU: the layers stay float32"
    if cpu_amp_dtype == "float32":
        return "onednn", f"{stays} (cpu_amp_dtype float32)"
    if channels_per_block("bfloat16") == 0:
        missing = ("this CPU has no bfloat16 convolutions (oneDNN offers them from AVX-512 on, natively with "
                   "AVX512_BF16 or AMX)")
        if cpu_amp_dtype == "bfloat16":
            raise UserInputError(f"cpu_amp_dtype bfloat16 cannot run: {missing}; use cpu_amp_dtype auto or float32")
        return "onednn", f"{stays}: {missing}"
    computes = (f"amp_level {amp_level} on CPU: the layers compute in bfloat16 and hand each other bfloat16 tensors "
                f"(the weights, their gradients and the head stay float32)")
    if cpu_amp_dtype == "bfloat16":
        return "onednn-bf16", f"{computes}; cpu_amp_dtype bfloat16"
    if not probe_layers:
        return "onednn", f"{stays}: no layers to time bfloat16 against float32 with (cpu_amp_dtype bfloat16 forces it)"
    verdict = bf16_verdict(probe_layers, cpu_model=cpu_model(), threads=threads, cache_file=cache_file,
                           time_layer=time_layer)
    timing = (f"{len(probe_layers)} of the network's convolutions, forward and backward, in float32 "
              f"{verdict.float32_ms:.1f} ms, in bfloat16 {verdict.bfloat16_ms:.1f} ms"
              + (" (timed by an earlier run on this CPU)" if verdict.cached else ""))
    if verdict.pays:
        return "onednn-bf16", f"{computes}: {timing}"
    return "onednn", f"{stays}, where bfloat16 is not faster: {timing} (cpu_amp_dtype bfloat16 forces it)"
