"""Device and execution-mode set-up, called once by an entry point before any MindSpore op."""
import os
from typing import Mapping, Optional, Tuple

import mindspore as ms

from src.cpu import is_x86
from src.errors import UserInputError

DEVICE_TARGETS = ("CPU", "GPU", "Ascend")
MODES = {"GRAPH": ms.GRAPH_MODE, "PYNATIVE": ms.PYNATIVE_MODE}
MINDSPORE_COMPILE_PHASE = ms.nn.Cell.compile_phase  # the property quicken_compiled_calls replaces


def prefer_fast_cpu_convolutions(machine_name: Optional[str] = None) -> Optional[str]:
    """Cap oneDNN at AVX2 on x86 unless the user chose an ISA (nothing elsewhere: the cap names an
    x86 instruction set, and `machine_name` stands in for this machine's architecture).

    With AVX-512 available, oneDNN runs MindSpore's NCHW 3x3 convolutions through its
    `jit_uni_ncsp:conv+ref` path, tens of times slower than the `gemm:jit` path it picks under
    AVX2. oneDNN reads the variable when it creates its first primitive, so this must run
    before the first CPU op. Returns the value in force (None where none applies)."""
    if not is_x86(machine_name):
        return None
    return os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")


# MindSpore's compile cache reloads the graph it saved whenever this repository's Python files are
# unchanged, whatever the settings: a resnet10 run given --weight_decay 0.5 trained with the cached
# run's weight decay (loss 2.5385, without the cache 2.9652), --batch_size 8 failed in Gather, and
# --net_name resnet18 trained the cached resnet10, with a warning in MindSpore's log at most.
COMPILE_CACHE_SWITCH = "MS_COMPILER_CACHE_ENABLE"


def refuse_compile_cache(environ: Mapping[str, str]) -> None:
    """One line, before any graph compiles, where `environ` switches MindSpore's compile cache on."""
    if environ.get(COMPILE_CACHE_SWITCH, "").strip() == "1":
        raise UserInputError(f"{COMPILE_CACHE_SWITCH}=1 makes MindSpore run the graph it cached for earlier "
                             f"settings (it checks only the Python files: a new --weight_decay trained with the "
                             f"old one); unset {COMPILE_CACHE_SWITCH}")


def available_cores() -> int:
    """CPU cores this process may run on (respects affinity masks and container limits)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_from_environment() -> int:
    """OMP_NUM_THREADS as a positive count of CPU kernel threads, else 0 (not set, or not a count)."""
    text = os.environ.get("OMP_NUM_THREADS", "")
    return int(text) if text.isdigit() and int(text) > 0 else 0


def worker_budget(requested: int, local_ranks: int = 1) -> int:
    """Data-pipeline workers one process may start: its share of the cores (cores / processes on
    this node, at least 1). MindSpore refuses more workers than cores with a traceback."""
    return max(1, min(requested, available_cores() // max(1, local_ranks)))


def kernel_threads(processes_per_node: int = 1, cpu_threads: int = 0) -> int:
    """CPU kernel threads per process: `cpu_threads` if > 0, else OMP_NUM_THREADS, else this process's
    share of the cores (see init_device)."""
    return cpu_threads or threads_from_environment() or max(1, available_cores() // max(1, processes_per_node))


def cap_workers(requested: int, local_ranks: int = 1) -> Tuple[int, Optional[str]]:
    """`worker_budget`, and the log line saying so when it lowered `requested` (else None)."""
    workers = worker_budget(requested, local_ranks)
    if workers == requested:
        return workers, None
    share = f"{available_cores()} cores" + (f" / {local_ranks} ranks on this node" if local_ranks > 1 else "")
    return workers, f"num_parallel_workers {requested} capped to {workers} ({share})"


def _set_compile_phase(cell: "ms.nn.Cell", value: str) -> None:
    """Cell.compile_phase's setter: the phase on `cell` and on every cell below it, as MindSpore
    2.10's sets it, written as plain attributes. Its own setter runs on every call of a compiled
    cell and sets each sub-cell's through Cell.__setattr__'s type checks, twice per cell: 0.72 ms
    of a 6.7 ms batch-1 evaluation of ResNet18 at 32 px (docs/performance.md)."""
    if not isinstance(value, str):
        raise TypeError(f"For 'Cell', 'compile_phase' must be string type, but got type {type(value)}.")
    below = [cell]
    while below:
        current = below.pop()
        object.__setattr__(current, "_compile_phase", value)  # what Cell.__setattr__ does for a str
        below.extend(child for child in current._cells.values() if child is not None)  # noqa: SLF001


def quicken_compiled_calls() -> None:
    """Give nn.Cell the compile_phase setter above (once per process; the values are the same)."""
    phase = MINDSPORE_COMPILE_PHASE
    if isinstance(phase, property) and ms.nn.Cell.compile_phase is phase:
        ms.nn.Cell.compile_phase = property(phase.fget, _set_compile_phase, doc=phase.__doc__)


def init_device(device_target: str, *, device_id: Optional[int] = 0, mode_name: str = "GRAPH",
                processes_per_node: int = 1, cpu_threads: int = 0, cap_cpu_isa: bool = True) -> int:
    """Select the execution mode and device; a device this machine lacks, or MindSpore's compile cache
    switched on (refuse_compile_cache), is a clear error.

    On CPU, the kernels get one thread per available core, shared among `processes_per_node`
    ranks, unless `cpu_threads` > 0 or OMP_NUM_THREADS says otherwise (the usual way to give a
    process its share of a shared host): MindSpore's default of 25 threads oversubscribes small
    machines (ResNet50 training at batch 8 ran at 3.3 img/s with it, 4.3 img/s with 2 threads
    on 2 cores), and its ops run synchronously. MindSpore accepts this once per process. Calls
    of compiled cells get the quicker compile_phase setter (quicken_compiled_calls).
    `cap_cpu_isa` False leaves MindSpore's oneDNN uncapped (see prefer_fast_cpu_convolutions):
    right when none of its convolutions run (src/cpu_layers's replace them), and its pooling then
    runs AVX-512 kernels. Returns the CPU kernel threads (0 on other devices)."""
    if device_target not in DEVICE_TARGETS:
        raise UserInputError(f"unknown device_target '{device_target}'; choose one of {', '.join(DEVICE_TARGETS)}")
    if mode_name not in MODES:
        raise UserInputError(f"unknown mode_name '{mode_name}'; choose GRAPH or PYNATIVE")
    refuse_compile_cache(os.environ)
    if device_target == "CPU" and cap_cpu_isa:
        prefer_fast_cpu_convolutions()
    elif device_target != "CPU" and not ms.hal.is_available(device_target):
        raise UserInputError(f"device_target {device_target} is not available on this machine (no "
                             f"{device_target} device or MindSpore {device_target} package); "
                             f"use --device_target CPU")
    ms.set_context(mode=MODES[mode_name])
    quicken_compiled_calls()
    if device_id is None:  # msrun picks each rank's device
        ms.set_device(device_target)
    else:
        ms.set_device(device_target, device_id)
    if device_target == "CPU":
        threads = kernel_threads(processes_per_node, cpu_threads)
        ms.device_context.cpu.op_tuning.threads_num(threads)
        # Dispatched asynchronously (MindSpore's default), the calling thread spins waiting for the
        # queue's threads; run on the calling thread, a PyNative resnet10 step at batch 8 on 2 cores
        # took 30% less CPU time and wall (the parity tool's tests 9% less), and a GRAPH-mode
        # training wrote the same checkpoint bytes.
        ms.runtime.launch_blocking()
        return threads
    return 0
