"""The compiled library (native/libresnet_conv.so): where it is, whether it loads, its settings, and
the parameter records and argument slots it was built with."""
import ctypes
import functools
import os
from typing import Dict, Optional, Sequence, Tuple

from src.cpu import is_x86, machine

NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
LIBRARY = os.path.join(NATIVE_DIR, "libresnet_conv.so")
ONEDNN_VERSION = 30200  # the onednn-cpu-gomp 2023.2.0 package: oneDNN 3.2.0
BUILD_HINT = "bash scripts/setup_env.sh builds it (it needs g++ and the onednn-devel-cpu-gomp package)"
ISAS = ("avx2", "avx512_core", "avx512_core_bf16", "avx512_core_amx", "all")  # CapIsa's names

# The parameter records the ops write (custom_ops.record) and the argument slots they pass, in order; the library
# defines the same lists (native/core.hpp) and unavailable_reason refuses a library whose differ.
RECORDS: Dict[str, Tuple[str, ...]] = {
    "ConvParams": ("stride_h", "stride_w", "pad_top", "pad_bottom", "pad_left", "pad_right", "dilation_h",
                   "dilation_w", "groups", "bf16", "layout", "inference"),
    "NormParams": ("epsilon", "global_stats", "momentum", "activation"),
    "PoolParams": ("kernel", "stride", "pad"),
    "QuantParams": ("quant_min", "quant_max", "symmetric", "channel_axis"),
    "LsqParams": ("lower", "channel_axis"),
}
SLOTS: Dict[str, Tuple[str, ...]] = {
    "ConvForward": ("x", "w", "params", "y", "matrix"),
    "ConvBackwardData": ("dy", "w", "params", "x_shape", "matrix", "dx"),
    "ConvBackwardWeights": ("x", "dy", "params", "w_shape", "dw"),
    "NormForward": ("x", "gamma", "beta", "mean", "variance", "params", "residual", "y", "batch_mean",
                    "batch_variance", "workspace"),
    "NormBackward": ("x", "dy", "mean", "variance", "gamma", "params", "workspace", "y", "residual", "dx", "dgamma",
                     "dbeta", "dresidual"),
    "NormForwardForked": ("x", "gamma", "beta", "mean", "variance", "params", "residual", "y", "batch_mean",
                          "batch_variance", "workspace", "y_copy"),
    "NormBackwardSummed": ("x", "dy", "mean", "variance", "gamma", "params", "workspace", "y", "dy_copy", "dx",
                           "dgamma", "dbeta", "dresidual"),
    "PoolForward": ("x", "params", "y"),
    "PoolBackward": ("x", "dy", "params", "dx"),
    "ToPlain": ("x", "y"),
    "ToBlocked": ("x", "y"),
    "Sum": ("a", "b", "y"),
    "Fork": ("x", "a", "b"),
    "FakeQuant": ("x", "low", "high", "params", "y"),
    "FakeQuantGrad": ("x", "low", "high", "params", "dy", "dx"),
    "LearnedScaleQuant": ("x", "alpha", "quant_max", "params", "y"),
    "LearnedScaleQuantGrad": ("x", "alpha", "quant_max", "params", "dy", "dx", "dalpha"),
}


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL:
    """The library, loaded once per process (the same handle MindSpore's Custom ops get)."""
    library = ctypes.CDLL(LIBRARY)
    for name in ("TakeError", "RecordFields", "KernelSlots", "BlockedLayout", "IsaCap", "OwnLoopNames",
                 "ConvolutionPath"):
        getattr(library, name).restype = ctypes.c_char_p
    for name in ("RecordFields", "KernelSlots", "BlockedLayout", "CapIsa"):
        getattr(library, name).argtypes = [ctypes.c_char_p]
    library.ProbeConvolution.restype = library.PeakGmacs.restype = ctypes.c_double
    library.ProbeConvolution.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_int, ctypes.c_int]
    library.PeakGmacs.argtypes = [ctypes.c_int]
    library.ScratchpadBytes.restype = library.KeptReorderBytes.restype = ctypes.c_int64
    library.WeightMatrixElements.restype = ctypes.c_int64
    library.WeightMatrixElements.argtypes = [ctypes.POINTER(ctypes.c_int64)] * 3 + [ctypes.POINTER(ctypes.c_int32)]
    library.ConvolutionPath.argtypes = library.WeightMatrixElements.argtypes
    library.FreezeWeights.restype = library.FrozenVersion.restype = ctypes.c_uint64
    library.OwnLoopSeconds.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.c_int]
    return library


def _names(text: bytes) -> Tuple[str, ...]:
    return tuple(name for name in text.decode().split(",") if name)


def definition_mismatch(records: Optional[Dict[str, Tuple[str, ...]]] = None,
                        slots: Optional[Dict[str, Tuple[str, ...]]] = None) -> Optional[str]:
    """None when the library's parameter records and argument slots are `records` and `slots`
    (default: this module's RECORDS and SLOTS), else the first difference in one phrase."""
    library = load_library()
    for kind, expected, read in (("record", records or RECORDS, library.RecordFields),
                                 ("kernel", slots or SLOTS, library.KernelSlots)):
        for name, fields in expected.items():
            built = _names(read(name.encode()))
            if built != fields:
                return f"its {kind} {name} is ({', '.join(built)}), Python's is ({', '.join(fields)})"
    return None


def unavailable_reason() -> Optional[str]:
    """None when the library is built, loads, runs its own oneDNN and was built with this module's
    records; else why not, in one phrase."""
    if not is_x86():
        return (f"they need an x86_64 CPU (oneDNN's CPU wheels are built for x86_64 only; this is "
                f"{machine()})")
    if not os.path.isfile(LIBRARY):
        build_log = os.path.join(NATIVE_DIR, "build.log")
        return (f"{LIBRARY} is not built" + (f" (see {build_log})" if os.path.isfile(build_log) else "")
                + f"; {BUILD_HINT}")
    try:
        library = load_library()
    except (OSError, AttributeError) as error:
        return f"{LIBRARY} does not load ({error}); {BUILD_HINT}"
    version = library.OneDnnVersion()
    if version != ONEDNN_VERSION:  # bound to another libdnnl.so.3 (MindSpore's): the SONAME trick failed
        return f"{LIBRARY} runs oneDNN {version} instead of its private copy {ONEDNN_VERSION}; {BUILD_HINT}"
    mismatch = definition_mismatch()
    if mismatch:
        return f"{LIBRARY} does not match src/cpu_layers ({mismatch}); {BUILD_HINT}"
    return None


def set_threads(threads: int) -> None:
    """Threads per kernel (0: OpenMP's default, the cores this process may use)."""
    load_library().SetThreads(int(threads))


def take_error() -> str:
    """The library's one-line message for the last kernel that failed ("" when none), cleared."""
    return load_library().TakeError().decode()


def _unless_failed(value, failed):
    """`value`, or RuntimeError with the library's message where it is `failed`: the library caught
    what its function threw (at its C edge, where nothing may be thrown) and returned that value."""
    if value == failed:
        raise RuntimeError(take_error())
    return value


def cap_isa(name: str) -> None:
    """Cap the library's oneDNN at `name` (one of ISAS), as a CPU without the instructions above it
    would run; only before its first kernel (tests and the benchmark's capped rows)."""
    status = load_library().CapIsa(name.encode())
    if status == 2:
        raise ValueError(f"unknown ISA '{name}'; choose one of {', '.join(ISAS)}")
    if status == 1:
        raise RuntimeError("the ISA can only be capped before the library's first kernel")


def isa_cap() -> str:
    """The ISA limit in force (one of ISAS; 'all' unless capped)."""
    return load_library().IsaCap().decode()


def blocked_layout(dtype: str) -> str:
    """The layout blocked activations of `dtype` ('float32', 'bfloat16') take on this CPU, as its
    convolutions choose it: 'nChw16c', 'nChw8c', 'nhwc', 'nchw', or '' where it has none."""
    return load_library().BlockedLayout(dtype.encode()).decode()


def channels_per_block(dtype: str) -> int:
    """Channels a blocked layer's tensors must come in multiples of (0 where there is no blocked layout)."""
    return {"nChw16c": 16, "nChw8c": 8, "nhwc": 1, "nchw": 1}.get(blocked_layout(dtype), 0)


def freeze_weights() -> int:
    """Declare the weights of every network fixed for the evaluations that follow: each convolution
    reorders its weights on its first inference call and reuses that reorder until `thaw_weights`,
    the next `freeze_weights` (weights loaded in between are reordered again) or the next training
    step, which thaws them itself. Returns the frozen version."""
    return _unless_failed(load_library().FreezeWeights(), 0)


def thaw_weights() -> None:
    """Inference reorders the weights on every call again (weights may change between calls)."""
    _unless_failed(load_library().ThawWeights(), 1)


def frozen_version() -> int:
    """The frozen version in force (0: thawed)."""
    return load_library().FrozenVersion()


def own_loop_seconds() -> Dict[str, float]:
    """Seconds the layers' kernels have spent in the library's own loops, outside oneDNN's primitives,
    since it loaded, by what each loop does (the residual addition and ReLU, the gradient sums, ...)."""
    library = load_library()
    names = _names(library.OwnLoopNames())
    seconds = (ctypes.c_double * len(names))()
    _unless_failed(library.OwnLoopSeconds(seconds, len(names)), -1)
    return dict(zip(names, seconds))


def weight_matrix_elements(x: Sequence[int], w: Sequence[int], y: Sequence[int], params: Sequence[int]) -> int:
    """How many floats a convolution's training forward (x, w -> y shapes, ConvParams `params`) hands
    the backward of its image gradient: its dense matrix where it runs as one (3x3 layers of 2x2 or
    1x1 maps at a batch of 32 or more, under AVX2's blocks; not a 1x1 kernel over 1x1 maps, whose
    matrix is the weights), the kernel's taps that meet the image where the image lies inside the
    kernel at smaller batches (3x3 layers of 1x1 maps), else 0."""
    shape = ctypes.c_int64 * 4
    record = (ctypes.c_int32 * len(params))(*params)
    return _unless_failed(load_library().WeightMatrixElements(shape(*x), shape(*w), shape(*y), record), -1)


def convolution_path(x: Sequence[int], w: Sequence[int], y: Sequence[int], params: Sequence[int]) -> str:
    """How the library runs a convolution (x, w -> y shapes, ConvParams `params`) on this CPU under
    its ISA cap: "dense" (one matrix product over a matrix built from the weights: 3x3 layers of 2x2
    or 1x1 maps at a batch of 32 or more, float32, where the blocked layout is nChw8c), "dense on the
    weights" (a 1x1 kernel over 1x1 maps: the weights are the matrix), "image inside kernel" (the taps
    that meet the image, convolved) or "convolution"."""
    shape = ctypes.c_int64 * 4
    record = (ctypes.c_int32 * len(params))(*params)
    return _unless_failed(load_library().ConvolutionPath(shape(*x), shape(*w), shape(*y), record).decode(), "")


def plan_count() -> int:
    """Primitive plans the library holds now."""
    return _unless_failed(load_library().PlanCount(), -1)


def set_plan_limit(limit: int) -> int:
    """Keep at most `limit` plans (the least recently used go first); returns the limit in force."""
    return _unless_failed(load_library().SetPlanLimit(int(limit)), -1)


def scratchpad_bytes() -> int:
    """The size of the scratchpad every kernel shares."""
    return _unless_failed(load_library().ScratchpadBytes(), -1)


def kept_reorder_bytes() -> int:
    """Bytes of the weight reorders evaluations keep (freeze_weights); freezing and thawing drop them."""
    return _unless_failed(load_library().KeptReorderBytes(), -1)


def probe_convolution_ms(batch: int, channels: int, size: int, out_channels: int, kernel: int, stride: int, *,
                         bf16: bool, repeats: int = 2) -> float:
    """Milliseconds for one convolution's forward and both backwards on blocked tensors (best of
    `repeats` after a warm-up), in float32 or bfloat16."""
    return _unless_failed(
        load_library().ProbeConvolution(batch, channels, size, out_channels, kernel, stride, int(bf16), repeats), -1)


def peak_gmacs(bf16: bool) -> float:
    """This CPU's practical multiply-accumulate rate (GMAC/s) in float32 or bfloat16: a large 1x1
    convolution through the library's oneDNN."""
    return _unless_failed(load_library().PeakGmacs(int(bf16)), -1)
