"""The printed tables: per configuration, the CPU paths, MindSpore beside PyTorch, the model, the
step breakdown and the deployment paths; then the input-pipeline comparison."""
from typing import Dict, List, Sequence

from tools.benchmarking.cpu_paths import LABELS, MINDSPORE_WORKERS, TORCH_WORKERS
from tools.benchmarking.pipeline_comparison import rate
from tools.benchmarking.pipelines import CIFAR_SIZE


def format_table(reports: List[Dict]) -> str:
    """One table per configuration (benchmark_configuration's reports)."""
    lines = []

    def row(label: str, ms_value, torch_value=None, ratio=None):
        torch_text = "" if torch_value is None else torch_value
        ratio_text = "" if ratio is None else ratio
        lines.append(f"  {label:<38}{ms_value:>22}{torch_text:>22}{ratio_text:>8}")

    for r in reports:
        ms_result, torch_result = r["mindspore"], r.get("torch")
        capped = "" if r.get("cpu_isa", "all") == "all" else f", oneDNN and PyTorch capped at {r['cpu_isa']}"
        lines.append(f"{r['net']} batch {r['batch_size']} @ {r['image_size']}px, {r['threads']} threads, "
                     f"{r['workers']} pipeline workers, on {r['cpu']}{capped}")
        lines += _cpu_path_rows(r)
        lines.append("  MindSpore's own CPU convolutions beside PyTorch eager NCHW: compile, latency, the input "
                     "pipelines")
        lines.append(f"  {'measure':<38}{'MindSpore convs':>22}{'PyTorch':>22}{'ratio':>8}")

        row("graph compile (s)", ms_result["compile_s"])
        row("train img/s (compute)", ms_result["train_compute_img_per_s"],
            torch_result and torch_result["train_compute_img_per_s"], r["ratios"].get("train_mindspore_over_torch"))
        for name, value in ms_result["train_end_to_end_img_per_s"].items():
            row(f"train img/s (end to end, {name})", value)
        for label in [k for k in ms_result if k.startswith("eval_batch_")]:
            ms_eval, torch_eval = ms_result[label], torch_result and torch_result[label]
            row(f"{label.replace('_', ' ')} img/s", ms_eval["img_per_s"], torch_eval and torch_eval["img_per_s"],
                r["ratios"].get(f"{label}_mindspore_over_torch"))
            row(f"{label.replace('_', ' ')} p50/p95/p99 ms",
                "/".join(f"{v:.1f}" for v in ms_eval["latency_ms"].values()),
                torch_eval and "/".join(f"{v:.1f}" for v in torch_eval["latency_ms"].values()))
        for name, value in r["pipeline_img_per_s"].items():
            row(f"pipeline img/s ({name})", value, None, r["ratios"][f"pipeline_{name}_over_training"])
        lines.append("  ratio: MindSpore convs / PyTorch; for the pipeline rows, pipeline img/s / MindSpore convs "
                     "training img/s")
        lines.append(model_line(r))
        lines += _breakdown_rows(r)
        if "onnxruntime" in r:
            lines += _deployment_rows(r)
        lines.append("")
    return "\n".join(lines)


def _cpu_path_rows(r: Dict) -> List[str]:
    """The headline: what train.py runs here first, then every other CPU path (train and eval img/s,
    ratios to PyTorch NCHW and channels_last, training GMAC/s against this CPU's peak)."""
    first = [r["default_path"]] + ([r["amp_choice"]["path"]] if r.get("amp_choice") else [])
    paths = list(dict.fromkeys(first + [name for name in (*MINDSPORE_WORKERS, *TORCH_WORKERS) if name in r]))
    paths = [name for name in paths if name in r]
    evals = [k for k in r["mindspore"] if k.startswith("eval_batch_")]
    peak = r.get("peak_gmacs") or {}
    lines = [f"  what train.py runs here: {LABELS[r['default_path']]}, float32 (amp_level auto is O0 on CPU)"]
    if r.get("amp_choice"):
        lines.append(f"  with --amp_level O2: {LABELS[r['amp_choice']['path']]}; {r['amp_choice']['note']}")
    if peak:
        lines.append("  this CPU's peak (a large oneDNN 1x1 convolution): " + ", ".join(
            f"{dtype} {rate} GMAC/s" for dtype, rate in peak.items() if rate))
    lines += [f"  {'path':<28}{'train img/s':>20}{'GMAC/s (% of peak)':>20}"
              + "".join(f"{label.replace('_', ' ') + ' img/s':>26}" for label in evals)]

    def of_peak(name: str) -> str:
        rate = r["gmacs_per_s"][name]["train"]
        dtype = "bfloat16" if name.endswith("bf16") else "float32"
        return f"{rate:.0f}" + (f" ({100 * rate / peak[dtype]:.0f}%)" if peak.get(dtype) else "")

    def cell(name: str, label: str, value: float) -> str:
        over = [r["ratios"].get(f"{label}_{name}_over_{base}") for base in ("torch", "torch_cl")]
        shown = "/".join(f"{x:.2f}" for x in over if x is not None)
        return f"{value:.2f}" + (f" ({shown}x)" if shown else "")

    for name in paths:
        lines.append(f"  {LABELS[name]:<28}{cell(name, 'train', r[name]['train_compute_img_per_s']):>20}"
                     f"{of_peak(name):>20}"
                     + "".join(f"{cell(name, label, r[name][label]['img_per_s']):>26}" for label in evals))
    lines.append("  x: over PyTorch NCHW / channels_last; GMAC/s: training, three forward passes per image")
    if "train_ours_bf16_over_torch_bf16" in r["ratios"]:
        lines.append(f"  {LABELS['ours_bf16']} over {LABELS['torch_bf16']}: " + ", ".join(
            f"{label.replace('_', ' ')} {r['ratios'][f'{label}_ours_bf16_over_torch_bf16']:.2f}x"
            for label in ["train", *evals]))
    return lines


def _breakdown_rows(r: Dict) -> List[str]:
    """Each MindSpore path's training step taken apart, its convolutions by pass, then its rest: our
    layers' own loops, and MindSpore's operators one by one."""
    lines = []
    for name, parts in r.get("breakdown_ms", {}).items():
        parts = dict(parts)
        unprofiled = parts.pop("unprofiled_step_ms", None)
        lines.append(f"  one training step, {LABELS[name]}: " + ", ".join(
            f"{part} {value:.0f} ms" for part, value in parts.items())
            + (f" (unprofiled: {unprofiled:.0f} ms)" if unprofiled else ""))
        passes = r.get("convolution_passes", {}).get(name)
        if passes:
            lines.append("    the convolutions by pass: " + ", ".join(
                f"{part} {value['ms']:.0f} ms at {value['gmacs_per_s']:.1f} GMAC/s" for part, value in passes.items()))
        own = r.get("own_loops_ms", {}).get(name)
        if own:
            lines.append("    the rest, our layers outside oneDNN's primitives (their timers): " + ", ".join(
                f"{part} {value:.1f}" for part, value in own.items()) + " ms")
        rest = r.get("rest_of_step_ms", {}).get(name)
        if rest:
            lines.append("    the rest, op by op (MindSpore's profiler): " + ", ".join(
                f"{part} {value:.1f}" for part, value in rest.items()) + " ms")
    return lines


def _deployment_rows(r: Dict) -> List[str]:
    """CPU inference paths side by side: MindSpore, PyTorch eager, the ONNX export under onnxruntime
    (float, and int8 where onnx is installed), with the speed-ups of the ONNX files."""
    paths = [name for name in ("mindspore", "torch", "onnxruntime", "onnxruntime_hostnorm", "onnxruntime_pixels",
                               "onnxruntime_int8") if name in r]
    titles = {"mindspore": "MindSpore", "torch": "PyTorch", "onnxruntime": "onnxruntime",
              "onnxruntime_int8": "ort int8", "onnxruntime_hostnorm": "ort+norm", "onnxruntime_pixels": "ort pixels"}
    short = {"onnxruntime": "ort", "onnxruntime_int8": "int8", "onnxruntime_hostnorm": "norm",
             "onnxruntime_pixels": "pixels"}
    speedups = [(p, other) for p, others in (("onnxruntime", ("mindspore", "torch")),
                                             ("onnxruntime_pixels", ("onnxruntime_hostnorm",)),
                                             ("onnxruntime_int8", ("onnxruntime", "torch")))
                for other in others if p in r and other in r]
    lines = [f"  {'CPU inference (eval mode)':<38}" + "".join(f"{titles[p]:>14}" for p in paths)
             + "".join(f"{short[p] + '/' + short.get(other, titles[other]):>16}" for p, other in speedups)]
    for label in [k for k in r["onnxruntime"] if k.startswith("eval_batch_")]:
        values = [r[p][label]["img_per_s"] for p in paths]
        ratios = [r["ratios"][f"{label}_{p}_over_{other}"] for p, other in speedups]
        lines.append(f"  {label.replace('_', ' ') + ' img/s':<38}" + "".join(f"{v:>14}" for v in values)
                     + "".join(f"{v:>16}" for v in ratios))
        lines.append(f"  {label.replace('_', ' ') + ' p50 ms':<38}"
                     + "".join(f"{r[p][label]['latency_ms']['p50']:>14.1f}" for p in paths))
    lines.append(f"  onnxruntime: the ONNX export (export.py) in the session predict.py uses, {r['threads']} threads; "
                 f"ort+norm: the same file after host normalization of a uint8 NHWC batch; ort pixels: the file "
                 f"exported with the input stage (--export_input_stage True) on that uint8 batch")
    if "onnxruntime_int8" in r:
        lines.append("  ort int8: the same files quantized as export.py --quantize int8 does "
                     "(QDQ, per-channel weights)")
    return lines


def model_line(r: Dict) -> str:
    """The model's parameters, GFLOPs per image, weights and achieved GFLOP/s, in one row."""
    from src.evaluation.model_summary import format_gflops
    model = r["model"]
    achieved = ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in model["achieved_gflop_per_s"].items())
    return (f"  model: {model['trainable_parameters']:,} trainable parameters, {format_gflops(model['gflops'])} "
            f"GFLOPs per image at {model['image_size']} px, weights {model['checkpoint_mb']:.1f} MiB; "
            f"achieved GFLOP/s (MindSpore): {achieved}")


def _setting(row: Dict) -> str:
    return f"{row['cores']} / {row['workers']}" + (" (pinned)" if row["cores"] == 1 else "")


def _cells(row: Dict, case: str, names: Sequence[str], width: int = 10) -> str:
    return "".join(f"{(rate(row, case, name) if name in row[case] else '-'):>{width}}" for name in names)


def format_pipeline_table(section: Dict) -> str:
    """The input-pipeline comparison (benchmark_pipelines' section) as tables."""
    files, rows, ratios = section["files"], section["rows"], section["ratios"]
    head = f"batch {section['batch_size']}, {section['image_size']} px, uint8 out (ours) / float32 out (native)"
    lines = [f"Input pipeline ceiling: {files['tiny']['files']} 16x16 JPEGs (decoding ~free), training transforms, "
             f"{head}",
             f"  {'cores / workers':<18}{'ours':>10}{'threads':>10}{'v2':>10}{'native':>10}{'ours/nat':>10}"
             f"{'v2/nat':>10}{'main us/img ours':>18}{'native':>8}"]
    for row, ratio in zip(rows, ratios):
        lines.append(f"  {_setting(row):<18}{_cells(row, 'ceiling', ('ours', 'ours_threads', 'v2', 'native'))}"
                     f"{ratio['ceiling_ours']:>10}{ratio['ceiling_v2']:>10}"
                     f"{row['ceiling']['ours']['main_cpu_us']:>18}{row['ceiling']['native']['main_cpu_us']:>8}")
    lines.append("  img/s; ours: create_dataset, plain recipe (worker processes; threads: data_worker_kind thread); "
                 "v2: "
                 "resnet50_imagenet2012_v2.yaml's recipe (TrivialAugmentWide, erasing, mixup/cutmix, ra_reps 4); "
                 "native: MindSpore's C++ pipeline as the model zoo builds it; main us/img: the training process's own "
                 "CPU per sample (getrusage)")
    lines.append(f"Photographs: generated {files['photos']['files']} (mean {files['photos']['mean_file_kb']} KB, PIL "
                 f"decode {files['photos']['pil_decode_ms']} ms) and real {files['real']['files']} (matplotlib's "
                 f"grace_hopper.jpg re-cropped; {files['real']['mean_file_kb']} KB, "
                 f"{files['real']['pil_decode_ms']} ms), "
                 f"{head}; our JPEG decoder: {section['decoder']}")
    lines.append(f"  {'cores / workers':<18}{'gen ours':>10}{'native':>10}{'ratio':>8}{'no-aa':>9}{'v2':>8}"
                 f"{'eval':>8}{'native':>8}{'ratio':>8}{'real ours':>11}{'native':>8}{'ratio':>8}{'eval':>8}"
                 f"{'native':>8}{'ratio':>8}")
    for row, ratio in zip(rows, ratios):
        lines.append(f"  {_setting(row):<18}{_cells(row, 'photos', ('ours_train', 'native_train'))}"
                     f"{ratio['photos_train']:>8}"
                     f"{_cells(row, 'photos', ('no_aa_train', 'v2_train', 'ours_eval', 'native_eval'), 8)[1:]}"
                     f"{ratio['photos_eval']:>8}{_cells(row, 'real', ('ours_train',), 11)}"
                     f"{_cells(row, 'real', ('native_train',), 8)}{ratio['real_train']:>8}"
                     f"{_cells(row, 'real', ('ours_eval', 'native_eval'), 8)}{ratio['real_eval']:>8}")
    lines.append(f"CIFAR-10 at {CIFAR_SIZE} px, training transforms, batch {section['batch_size']}")
    lines.append(f"  {'cores / workers':<18}{'ours':>10}{'v2':>10}{'native':>10}{'ratio':>8}{'main us/img':>13}")
    for row, ratio in zip(rows, ratios):
        lines.append(f"  {_setting(row):<18}{_cells(row, 'cifar', ('ours', 'v2', 'native'))}{ratio['cifar']:>8}"
                     f"{row['cifar']['ours']['main_cpu_us']:>13}")
    lines.append(f"MindRecord shards (4, python -m src.data.mindrecord) against the class folders they hold, "
                 f"batch {section['batch_size']}, {section['image_size']} px")
    lines.append(f"  {'cores / workers':<18}{'gen folder':>11}{'shards':>8}{'ratio':>8}{'eval':>8}{'shards':>8}"
                 f"{'ratio':>8}{'real folder':>13}{'shards':>8}{'ratio':>8}{'eval':>8}{'shards':>8}{'ratio':>8}")
    for row, ratio in zip(rows, ratios):
        lines.append(f"  {_setting(row):<18}{_cells(row, 'photos', ('ours_train',), 11)}"
                     f"{_cells(row, 'photos_shards', ('ours_train',), 8)}{ratio['photos_shards_train']:>8}"
                     f"{_cells(row, 'photos', ('ours_eval',), 8)}{_cells(row, 'photos_shards', ('ours_eval',), 8)}"
                     f"{ratio['photos_shards_eval']:>8}{_cells(row, 'real', ('ours_train',), 13)}"
                     f"{_cells(row, 'real_shards', ('ours_train',), 8)}{ratio['real_shards_train']:>8}"
                     f"{_cells(row, 'real', ('ours_eval',), 8)}{_cells(row, 'real_shards', ('ours_eval',), 8)}"
                     f"{ratio['real_shards_eval']:>8}")
    calls = section["storage_calls"]
    if calls["photos"] is None:
        lines.append("  storage calls: strace not found (install strace to count them)")
    else:
        folder, shards = calls["photos"], calls["photos_shards"]
        lines.append(f"  per 1,000 training samples (strace, one worker): class folder {folder['files_opened']} files "
                     f"opened, {folder['read_calls']} read calls; shards {shards['files_opened']} files opened, "
                     f"{shards['read_calls']} read calls")
    card = section["cores_per_card"]
    lines.append(f"Cores per Ascend card (ResNet50 at {card['card_img_per_s']} img/s) from the pinned row: "
                 f"{card['generated_photos']} (generated photographs), {card['real_photos']} (real), "
                 f"{card['v2_generated_photos']} (v2 recipe, generated); the widest row on the tiny JPEGs "
                 f"delivered {card['ceiling_over_card']}x a card's rate; the training process's own CPU "
                 f"allows ~{card['main_cpu_ceiling_img_per_s']} img/s (its ceiling on any host)")
    return "\n".join(lines) + "\n"

