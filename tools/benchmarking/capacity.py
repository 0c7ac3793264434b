"""This CPU's capacity: the path train.py takes here, the peak multiply-accumulate rates, and what
the model achieves on each path."""
from typing import Dict


def cpu_capacity(net_name: str, batch: int, size: int, threads: int, cpu_isa: str = "all") -> Dict:
    """What train.py runs on this CPU (`default_path`; and with amp on, the precision its probe
    chooses, `amp_choice`), and this CPU's peak multiply-accumulate rates (`peak_gmacs`: a large
    oneDNN 1x1 convolution in float32 and bfloat16, null where there is none), measured before the
    workers start, on `threads` threads."""
    from src.cpu_layers import choose_convolutions, library, unavailable_reason
    from src.resnet import probe_layers
    if unavailable_reason():
        return {"default_path": "mindspore", "amp_choice": None, "peak_gmacs": None}
    if cpu_isa != "all":
        library.cap_isa(cpu_isa)
    library.set_threads(threads)
    choice, note = choose_convolutions("auto", device_target="CPU", amp_level="O2", threads=threads,
                                       probe_layers=probe_layers(net_name, size, batch))
    peak = {"float32": round(library.peak_gmacs(bf16=False), 1),
            "bfloat16": round(library.peak_gmacs(bf16=True), 1) if library.channels_per_block("bfloat16") else None}
    return {"default_path": "ours", "amp_choice": {"path": "ours_bf16" if choice == "onednn-bf16" else "ours",
                                                   "note": note}, "peak_gmacs": peak}


def achieved_gmacs(report: Dict, path: str) -> Dict[str, float]:
    """Multiply-accumulates per second of `path`: training counts three forward passes per image."""
    from src.evaluation.model_summary import TRAIN_PASSES
    gmacs, measured = report["model"]["gflops"], report[path]
    rates = {"train": gmacs * TRAIN_PASSES * measured["train_compute_img_per_s"]}
    rates.update({label: gmacs * measured[label]["img_per_s"] for label in measured if label.startswith("eval_batch_")})
    return {label: round(rate, 1) for label, rate in rates.items()}


def model_figures(report: Dict) -> Dict:
    """The model summary beside the measured speeds: achieved GFLOP/s (torchvision's GFLOPs, i.e.
    multiply-accumulates; a training step counted as three forward passes)."""
    from src.evaluation.model_summary import TRAIN_PASSES
    measured = report["mindspore"]
    model = measured.pop("model")
    achieved = {"train": model["gflops"] * TRAIN_PASSES * measured["train_compute_img_per_s"]}
    achieved.update({label: model["gflops"] * measured[label]["img_per_s"]
                     for label in measured if label.startswith("eval_batch_")})
    return {**model, "achieved_gflop_per_s": {k: round(v, 2) for k, v in achieved.items()}}

