"""Classify images with an exported network (MINDIR or ONNX from export.py): top-k classes.

    python predict.py resnet50.mindir photo.jpg more_photos/ --dataset imagenet2012 \\
        --labels /data/imagenet/train --top_k 5

Each image gets the evaluation transform of --dataset, exactly as eval.py feeds the network
(imagenet2012: short side to --resize_size, default image_size / 0.875, center crop; cifar10:
resize to image_size),
and the dataset's normalization: on the host for a float-input file, inside the model for one
exported with --export_input_stage True (it gets the uint8 crops). image_size defaults to the
model's input size.
For each image one line shows its top-k classes with probabilities (softmax of the logits);
the last line on stdout is one JSON object: {"model", "dataset", "image_size", "predictions":
[{"path", "top_k": [{"index", "label", "probability"}, ...]}, ...]}.
Class names come from --labels (a text file with one name per line, a folder of class folders
or a CIFAR-10 folder with batches.meta.txt); without it, classes are shown by index.
ONNX files (a fixed batch; float or int8 from export.py --quantize int8) run in batches of their
exported size, the last one padded.
For CPU inference, export ONNX: it runs through onnxruntime, on --threads threads (default: one per
core this process may use), about 2-3x faster than MindSpore or PyTorch eager on the same CPU
(benchmark.py measures it).
"""
import argparse
import json
from typing import List, Optional, Sequence

import numpy as np

from src.data.class_names import read_class_names
from src.data.host_stage import normalization_of
from src.data.sources import IMAGE_EXTENSIONS
from src.dataset import DATASETS, load_pixels
from src.deploy.inference import (
    ExportedModel,
    file_format_of,
    list_images,
    require_onnxruntime,
    resolve_image_size,
    top_k,
)
from src.device import DEVICE_TARGETS, init_device
from src.errors import OneLineParser, UserInputError, run_cli
from src.evaluation.metrics import softmax


def build_parser() -> argparse.ArgumentParser:
    """predict.py's command line."""
    parser = OneLineParser(prog="predict.py", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="the exported network: a .mindir or .onnx file")
    parser.add_argument("images", nargs="+",
                        help="image files and/or folders of images (searched recursively)")
    parser.add_argument("--dataset", required=True, choices=DATASETS,
                        help="the dataset the network was trained on: selects the eval transform "
                             "and normalization")
    parser.add_argument("--image_size", type=int, default=0,
                        help="the network's input side (default: read from the model file)")
    parser.add_argument("--resize_size", type=int, default=0,
                        help="imagenet2012: the short side before the center crop, as eval_resize_size in "
                             "training (default: image_size / 0.875)")
    parser.add_argument("--interpolation", default="bilinear", choices=("bilinear", "bicubic", "nearest"),
                        help="resizing, as in training (default bilinear)")
    parser.add_argument("--labels", default="",
                        help="class names: a text file (one per line) or a dataset folder")
    parser.add_argument("--top_k", type=int, default=5, help="how many classes to show per image (default 5)")
    parser.add_argument("--batch_size", type=int, default=32,
                        help="images per run for a dynamic-batch MINDIR (fixed-batch files use their own)")
    parser.add_argument("--threads", type=int, default=0,
                        help="onnxruntime threads for ONNX files (default 0: one per available core)")
    parser.add_argument("--device_target", default="CPU", choices=DEVICE_TARGETS,
                        help="where MindSpore runs a MINDIR file (default CPU)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.top_k < 1 or args.batch_size < 1:
        raise UserInputError("--top_k and --batch_size must be positive")
    if args.resize_size < 0:
        raise UserInputError(f"--resize_size must be >= 0 (0: image_size / 0.875), got {args.resize_size}")
    if args.threads < 0:
        raise UserInputError(f"--threads must be 0 (one per available core) or positive, got {args.threads}")
    file_format = file_format_of(args.model)
    paths = list_images(args.images, IMAGE_EXTENSIONS)
    names: Optional[List[str]] = read_class_names(args.labels) if args.labels else None
    if file_format == "ONNX":
        require_onnxruntime()
    init_device(args.device_target, mode_name="GRAPH")
    model = ExportedModel(args.model, threads=args.threads)
    image_size = resolve_image_size(model, args.image_size)
    # Chunk by chunk, so a folder of 50,000 images never sits in memory at once.
    chunk = args.batch_size * 16
    normalization = normalization_of(args.dataset)
    logits = np.concatenate([
        model.predict_pixels(np.stack([load_pixels(path, args.dataset, image_size, args.resize_size,
                                                   args.interpolation) for path in paths[start:start + chunk]]),
                             normalization, batch_size=args.batch_size)
        for start in range(0, len(paths), chunk)])
    if names is not None and len(names) != logits.shape[1]:
        raise UserInputError(f"--labels {args.labels} has {len(names)} class names but the model has "
                             f"{logits.shape[1]} outputs; pass the labels of its training data")
    predictions = []
    for path, best in zip(paths, top_k(softmax(logits.astype(np.float64)), args.top_k)):
        ranked = [{"index": index, "label": names[index] if names else str(index), "probability": prob}
                  for index, prob in best]
        predictions.append({"path": path, "top_k": ranked})
        print(f"{path}: " + ", ".join(f"{item['label']} {item['probability']:.4f}" for item in ranked))
    print(json.dumps({"model": args.model, "dataset": args.dataset, "image_size": image_size,
                      "predictions": predictions}), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
