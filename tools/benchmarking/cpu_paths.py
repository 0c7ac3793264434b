"""The paths measured: each measuring process's framework and settings, its label in the tables,
the instruction-set caps, and which paths run on this CPU."""
from typing import List, Optional, Set

CLASSES = 10  # the benchmark's networks classify 10 classes, on every path
ONNX_WORKERS = ("onnxruntime", "onnxruntime_hostnorm", "onnxruntime_pixels", "onnxruntime_int8")
# MindSpore with its own convolutions, with this repository's oneDNN layers (float32; bfloat16 under
# amp on CPUs with AMX): the cpu_convolution and amp_level each runs with.
# cpu_convolution, amp_level, cpu_amp_dtype of each MindSpore worker.
MINDSPORE_WORKERS = {"mindspore": ("mindspore", "O0", "auto"), "ours": ("onednn", "O0", "auto"),
                     "ours_bf16": ("onednn", "O2", "bfloat16")}
# PyTorch eager: NCHW float32, channels_last float32, bfloat16 autocast with channels_last.
TORCH_WORKERS = {"torch": ("nchw", False), "torch_cl": ("channels_last", False), "torch_bf16": ("channels_last", True)}
LABELS = {"mindspore": "MindSpore convolutions", "ours": "ours (oneDNN, blocked)", "ours_bf16": "ours, bf16",
          "torch": "PyTorch NCHW", "torch_cl": "PyTorch channels_last", "torch_bf16": "PyTorch bf16 autocast+CL"}
# --cpu_isa: the cap for our oneDNN (library.ISAS) and the same cap for PyTorch (ATEN_CPU_CAPABILITY,
# ONEDNN_MAX_CPU_ISA for its oneDNN), so every path runs as on a CPU without the instructions above it.
CPU_ISAS = {"all": (None, None), "avx2": ("avx2", "AVX2"), "avx512_core": ("avx512", "AVX512_CORE"),
            "avx512_core_bf16": ("avx512", "AVX512_CORE_BF16"), "avx512_core_amx": ("avx512", "AVX512_CORE_AMX")}


def compute_paths(vs_torch: bool, cpu_features: Optional[Set[str]] = None, cpu_isa: str = "all") -> List[str]:
    """The workers to measure: MindSpore's convolutions, ours where they are built (in bfloat16 too
    where the CPU, or the ISA it is capped at, has bfloat16 instructions), and with --vs-torch
    PyTorch's NCHW, channels_last and bf16 autocast likewise. `cpu_features` stands in for this
    CPU's flags."""
    from src.cpu import cpu_flags
    from src.cpu_layers import unavailable_reason
    flags = cpu_flags() if cpu_features is None else cpu_features
    bf16 = bool(flags & {"avx512_bf16", "amx_bf16"}) and cpu_isa not in ("avx2", "avx512_core")
    paths = ["mindspore"]
    reason = unavailable_reason()
    if reason:
        print(f"note: no rows for this repository's CPU layers: {reason}", flush=True)
    else:
        paths += ["ours"] + (["ours_bf16"] if bf16 else [])
    if vs_torch:
        paths += ["torch", "torch_cl"] + (["torch_bf16"] if bf16 else [])
    return paths
