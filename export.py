"""Export a trained checkpoint for inference: MINDIR (default), ONNX, or AIR (Ascend only).

    python export.py --config_path CONFIG --checkpoint_file_path CKPT [--file_name NAME]
        [--file_format MINDIR|ONNX|AIR] [--batch_size N] [--width W --height H] [--verify] [--use_ema True]

The checkpoint may be this repository's or a model-zoo ResNet checkpoint (its names are mapped,
one log line says so); the zoo's `--ckpt_file` names it too. The network is the config's
net_name/class_num in inference mode (with the checkpoint's EMA weights under --use_ema True); the
input is float32 (batch, 3, height, width), normalized as in evaluation; height/width default to
eval_image_size.
The file NAME.mindir|.onnx|.air (default NAME: net_name) is written atomically.

--export_input_stage True exports the network with its input stage (src/data/input_stage.py) in
front: the file takes uint8 RGB pixels (batch, height, width, 3), as eval_image crops them, and
normalizes them inside the graph (4x fewer input bytes, no host normalization in the deployment).
Its --verify feeds seeded uint8 pixels to the file and the same pixels, normalized on the host, to
the checkpoint network. It does not combine with --quantize int8.

Batch dimension: MINDIR files have a dynamic batch (any size at run time) unless
--dynamic_batch False. ONNX and AIR files have a FIXED batch of --batch_size: feed exactly that
many images (predict.py pads the last batch), and export with --batch_size 1 for single images.

--verify reloads the written file (MINDIR through MindSpore's graph loader, ONNX through
onnxruntime) and compares its logits with the checkpoint network on a seeded random input
(numpy default_rng(0), standard normal); it prints the max abs difference and the top-1 agreement
and exits with code 1, writing no file, when the difference exceeds --verify_tolerance (1e-4).
The last line on stdout is one JSON object: path, file_format, input ("float32 NCHW" or
"uint8 NHWC"), input_shape (in that layout; null batch: dynamic), verified, max_abs_diff,
top1_agreement, max_abs_logit, tolerance, quantization.

--compression qat|lsq exports a checkpoint of train.py --compression qat|lsq (MINDIR only, no --verify):
Golden Stick's convert turns its fake quantizers into quantization ranges (FakeQuantParam) that
MindSpore Lite's converter reads to run int8 (docs/compression.md).

--compression prune exports a checkpoint of train.py --compression prune: the network is rebuilt
to the widths its checkpoint's weights have, then exported as a float one (every format,
--verify, --quantize int8).

--quantize int8 (ONNX only; needs onnx and onnxruntime) writes the int8 model instead of the float
one (default NAME: net_name_int8): onnxruntime's static quantization, QDQ format, int8 weights per
output channel, uint8 activations whose ranges are calibrated (--calibration_method minmax, entropy
or percentile) on --calibration_samples (512) training images of --calibration_data (a dataset
folder, as data_path), in the seeded order of a first training epoch, through the evaluation
transform (eval_image_size, eval_resize_size, as eval.py). With --verify the float export is
checked as above, then the int8 model's top-1 agreement with it and the largest logit difference
on the calibration images are reported ("quantization" in the JSON line). Evaluate the written
file with eval.py --model_file.
"""
import json
import os
import sys
import tempfile
from typing import Optional, Sequence

from src.compression import QUANTIZATIONS
from src.compression.qat import convert_for_export
from src.config import load_config
from src.data.host_stage import normalization_of
from src.data.input_stage import WithInputStage
from src.deploy.exporting import (
    FILE_FORMATS,
    MAX_DYNAMIC_VERIFY_BATCH,
    check_export_request,
    export_network,
    input_layout,
    quantize_export,
    verify_export,
)
from src.device import init_device
from src.errors import run_cli
from src.training.checkpoint import network_from_checkpoint


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
    cfg = load_config(args, prog="export.py")
    for note in cfg.notes:
        print(note, flush=True)
    file_format, height, width, batch_size, calibration = check_export_request(cfg)
    dynamic = batch_size is None

    init_device(cfg.device_target, device_id=cfg.device_id, mode_name="GRAPH")
    net = network_from_checkpoint(cfg.net_name, cfg.class_num, cfg.checkpoint_file_path, use_ema=cfg.use_ema,
                                  compression=cfg.compression)
    if cfg.compression in QUANTIZATIONS:  # the ranges as FakeQuantParam, for MindSpore Lite's int8 converter
        net = convert_for_export(net, cfg.compression)
    net.set_train(False)

    file_name = cfg.file_name or (f"{cfg.net_name}_int8" if calibration else cfg.net_name)
    if file_name.lower().endswith(FILE_FORMATS[file_format]):  # --file_name model.onnx means model + .onnx
        file_name = file_name[:-len(FILE_FORMATS[file_format])]
    target = os.path.abspath(file_name + FILE_FORMATS[file_format])
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    pixels = bool(cfg.export_input_stage)
    normalization = normalization_of(cfg.dataset) if pixels else None
    exported = WithInputStage(net, normalization) if pixels else net
    exported.set_train(False)
    report = {"path": target, "file_format": file_format, "input": "uint8 NHWC" if pixels else "float32 NCHW",
              "input_shape": input_layout(batch_size, height, width, pixels), "verified": False,
              "max_abs_diff": None, "top1_agreement": None, "max_abs_logit": None,
              "tolerance": cfg.verify_tolerance if cfg.verify else None, "quantization": None}
    dims = ["dynamic" if dynamic else batch_size] + report["input_shape"][1:]
    shape_text = f"{report['input']} ({', '.join(map(str, dims))})"
    with tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as staging:
        staged = export_network(exported, file_name=file_name, file_format=file_format, batch_size=batch_size,
                                height=height, width=width, staging=staging, pixels=pixels)
        if cfg.verify:
            batches = [cfg.batch_size] if not dynamic else \
                sorted({min(cfg.batch_size, MAX_DYNAMIC_VERIFY_BATCH), 1}, reverse=True)
            result = verify_export(net, staged, batch_sizes=batches, height=height, width=width,
                                   normalization=normalization)
            report.update(result)
            samples = sum(batches)
            print(f"verify: {file_format} file vs checkpoint network on seeded inputs of batch "
                  f"{' and '.join(map(str, batches))}: max abs difference {result['max_abs_diff']:.3g}, "
                  f"top-1 agreement {round(result['top1_agreement'] * samples)}/{samples} "
                  f"(tolerance {cfg.verify_tolerance:g})", flush=True)
            if not result["max_abs_diff"] <= cfg.verify_tolerance:
                print(json.dumps({**report, "path": None}), flush=True)
                print(f"error: the exported {file_format} differs from the checkpoint network by "
                      f"{result['max_abs_diff']:.3g} (> tolerance {cfg.verify_tolerance:g}; its logits reach "
                      f"{result['max_abs_logit']:.3g}); not written to {target}", file=sys.stderr, flush=True)
                return 1
            report["verified"] = True
        if calibration:
            staged, report["quantization"] = quantize_export(staged, cfg, calibration=calibration, staging=staging)
        os.replace(staged, target)
    print(f"exported {file_format}{' int8' if calibration else ''} with input {shape_text} to {target}", flush=True)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
