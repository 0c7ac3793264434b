"""One process's runtime: which convolutions run, the device and mode, and the kernel threads.
The entry points that train, evaluate or compare set it up here, once, before they build a network
(export.py and predict.py run MindSpore's own layers: src.device.init_device is all they need)."""
from typing import NamedTuple, Optional, Sequence

from src.cpu_layers import ProbeLayer, choose_convolutions
from src.cpu_layers import set_threads as set_convolution_threads
from src.device import init_device, kernel_threads


def caps_mindspore_isa(device_target: str, convolutions: str, mindspore_stages: Sequence[str] = ()) -> bool:
    """Whether MindSpore's oneDNN is capped at AVX2 (src.device.prefer_fast_cpu_convolutions): on CPU,
    wherever one of its convolutions will run, the network's (`convolutions` "mindspore") or a stage's
    (`mindspore_stages`: SCOP's knockoff stage trains Golden Stick's cells, MindSpore's convolutions,
    before our layers train the pruned network). Uncapped, they run oneDNN's reference kernel on an
    AVX-512 CPU (SCOP's knockoff steps 17x slower); only a process whose every convolution is ours
    leaves MindSpore's pooling and products their AVX-512 kernels."""
    return device_target == "CPU" and (convolutions == "mindspore" or bool(mindspore_stages))


class Runtime(NamedTuple):
    """What set_up_runtime chose."""
    convolutions: str      # create_model's `convolutions`: "mindspore", "onednn" or "onednn-bf16"
    note: Optional[str]    # why, for the log (None: nothing to say)
    threads: int           # CPU kernel threads (0 on other devices)


def set_up_runtime(device_target: str, *, cpu_convolution: str, mode_name: str = "GRAPH",
                   device_id: Optional[int] = 0, processes_per_node: int = 1, cpu_threads: int = 0,
                   amp_level: str = "O0", optimizer: str = "Momentum", cpu_amp_dtype: str = "auto",
                   probe_layers: Sequence[ProbeLayer] = (), mindspore_stages: Sequence[str] = ()) -> Runtime:
    """Choose the convolutions (src.cpu_layers.choose_convolutions; with `probe_layers` it may
    time them on this process's threads), then select the device (src.device.init_device, its oneDNN
    capped where MindSpore's convolutions will run: caps_mindspore_isa, with `mindspore_stages` naming
    the stages that run them beside ours) and give ours the same threads."""
    threads = kernel_threads(processes_per_node, cpu_threads)
    convolutions, note = choose_convolutions(
        cpu_convolution, device_target=device_target, amp_level=amp_level, optimizer=optimizer,
        cpu_amp_dtype=cpu_amp_dtype, probe_layers=probe_layers, threads=threads if probe_layers else 0)
    capped = caps_mindspore_isa(device_target, convolutions, mindspore_stages)
    threads = init_device(device_target, mode_name=mode_name, device_id=device_id,
                          processes_per_node=processes_per_node, cpu_threads=threads, cap_cpu_isa=capped)
    if convolutions != "mindspore":
        set_convolution_threads(threads)
        if capped:
            stages = f"{' and '.join(mindspore_stages)} runs MindSpore's convolutions: its oneDNN capped at AVX2"
            note = f"{note}; {stages}" if note else stages
    return Runtime(convolutions, note, threads)
