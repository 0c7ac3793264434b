"""Device and execution-mode set-up, called once by an entry point before any MindSpore op."""
import os

import mindspore as ms

from src.errors import UserInputError

DEVICE_TARGETS = ("CPU", "GPU", "Ascend")
MODES = {"GRAPH": ms.GRAPH_MODE, "PYNATIVE": ms.PYNATIVE_MODE}


def prefer_fast_cpu_convolutions() -> str:
    """Cap oneDNN at AVX2 unless the user chose an ISA.

    With AVX-512 available, oneDNN runs MindSpore's NCHW 3x3 convolutions through its
    `jit_uni_ncsp:conv+ref` path, tens of times slower than the `gemm:jit` path it picks under
    AVX2. oneDNN reads the variable when it creates its first primitive, so this must run
    before the first CPU op. Returns the value in force."""
    return os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")


def init_device(device_target: str, *, device_id: int = 0, mode_name: str = "GRAPH") -> None:
    """Select the execution mode and device; a device this machine lacks is a clear error."""
    if device_target not in DEVICE_TARGETS:
        raise UserInputError(f"unknown device_target '{device_target}'; choose one of {', '.join(DEVICE_TARGETS)}")
    if mode_name not in MODES:
        raise UserInputError(f"unknown mode_name '{mode_name}'; choose GRAPH or PYNATIVE")
    if device_target == "CPU":
        prefer_fast_cpu_convolutions()
    elif not ms.hal.is_available(device_target):
        raise UserInputError(f"device_target {device_target} is not available on this machine (no "
                             f"{device_target} device or MindSpore {device_target} package); "
                             f"use --device_target CPU")
    ms.set_context(mode=MODES[mode_name])
    ms.set_device(device_target, device_id)
