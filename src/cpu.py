"""What CPU this process runs on: its architecture, x86 feature flags and model name.

x86 tuning (oneDNN ISA caps, /proc/cpuinfo flags, this repository's oneDNN layers and their OpenMP
settings) applies only where `is_x86()`; on aarch64 (Kunpeng, Graviton) MindSpore's own CPU
kernels run as they are. No MindSpore here: the OpenMP settings need this before it is imported."""
import platform
import subprocess
from typing import Optional, Set

X86_MACHINES = ("x86_64", "amd64")


def machine() -> str:
    """The architecture as `uname -m` names it, lower case: x86_64, aarch64, ..."""
    return platform.machine().lower()


def is_x86(machine_name: Optional[str] = None) -> bool:
    """Whether `machine_name` (default: this machine) is 64-bit x86."""
    return (machine() if machine_name is None else machine_name.lower()) in X86_MACHINES


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> Set[str]:
    """An x86 CPU's feature flags from the `flags` line (empty elsewhere, or where the file is not there)."""
    try:
        with open(cpuinfo, encoding="utf-8") as handle:
            return next((set(line.split(":", 1)[1].split()) for line in handle if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_model() -> str:
    """lscpu's model name (timings and even ratios move with the CPU); its architecture where lscpu
    names no model."""
    try:
        output = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return f"unknown {machine()} (no lscpu)"
    return next((line.split(":", 1)[1].strip() for line in output.splitlines() if line.startswith("Model name")),
                f"unknown {machine()}")
