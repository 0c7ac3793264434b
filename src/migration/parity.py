"""Check that a converted checkpoint computes what the PyTorch network computes, stage by stage.

    python -m src.migration.parity --arch resnet50 --pth resnet50-0676ba61.pth --ckpt resnet50_tv.ckpt
    python -m src.migration.parity --arch resnet50 --pth IN.pth --ckpt OUT.ckpt \
        --torch_model src.migration.torch_resnet:resnet50

Both networks get the same seeded input in eval mode. For the stem (conv1, bn1, relu, maxpool),
layer1..layer4 and the logits it prints the max abs difference, the largest PyTorch magnitude,
their ratio and the cosine similarity, so a mismatch is located, not just detected. The last line
on stdout is one JSON object with those numbers. Exit code 0 when the logits differ by at most
--atol and every stage by at most --rtol relative to its magnitude, 1 otherwise, 2 for bad input.

The PyTorch network comes from --torch_model `package.module:factory` (called with num_classes=N),
by default torchvision's `torchvision.models:<arch>` when torchvision is importable. It must be
torchvision-structured: `conv1 bn1 relu maxpool layer1..4 avgpool fc`.
"""
import argparse
import importlib
import importlib.util
import json
import sys
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from src.device import DEVICE_TARGETS, init_device
from src.errors import OneLineParser, UserInputError, run_cli
from src.migration.convert_torch import (
    common_prefix,
    find_state_dict,
    guess_arch,
    import_torch,
    listed,
    load_torch_file,
    torch_to_ms_name,
)
from src.migration.layer_diff import cosine
from src.resnet import ARCHS, create_model
from src.training.checkpoint import load_into_network

STAGES = ("stem", "layer1", "layer2", "layer3", "layer4", "logits")
# The PyTorch module whose output is each stage's output.
TORCH_MODULES = {"stem": "maxpool", "layer1": "layer1", "layer2": "layer2", "layer3": "layer3",
                 "layer4": "layer4"}


def resolve_factory(spec: Optional[str], arch: str) -> Tuple[str, Callable]:
    """'package.module:factory' -> (spec, callable); default torchvision.models:<arch> if importable."""
    if spec is None:
        if importlib.util.find_spec("torchvision") is None:
            raise UserInputError(f"torchvision is not installed, so there is no default PyTorch {arch}; pass "
                                 f"--torch_model package.module:factory building a torchvision-structured "
                                 f"ResNet (e.g. --torch_model src.migration.torch_resnet:{arch})")
        spec = f"torchvision.models:{arch}"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserInputError(f"--torch_model '{spec}' is not of the form package.module:factory "
                             f"(e.g. torchvision.models:{arch})")
    try:
        target = importlib.import_module(module_name)
    except ImportError as err:
        raise UserInputError(f"--torch_model {spec}: cannot import {module_name} ({err}); run from the "
                             f"repository root or fix the import path") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UserInputError(f"--torch_model {spec}: {module_name} has no '{attr}'")
        target = getattr(target, part)
    if not callable(target):
        raise UserInputError(f"--torch_model {spec}: '{attr}' is not callable")
    return spec, target


def read_pth_state(path: str) -> Dict[str, object]:
    """The .pth's state dict (weights_only), wrappers and the `module.` prefix removed."""
    state, _ = find_state_dict(load_torch_file(path), path)
    prefix = common_prefix(state)
    return {key[len(prefix):] if prefix and key.startswith(prefix) else key: value
            for key, value in state.items()}


def build_torch_model(spec: str, factory: Callable, state: Dict[str, object], num_classes: int):
    try:
        model = factory(num_classes=num_classes)
    except TypeError:
        model = factory()
    missing = [name for name in ("fc", *TORCH_MODULES.values()) if not hasattr(model, name)]
    if missing:
        raise UserInputError(f"--torch_model {spec} built a {type(model).__name__} without "
                             f"{', '.join(missing)}; it must build a torchvision-structured ResNet")
    expected = model.state_dict()
    problems = {
        "missing": [k for k in expected if k not in state],
        "unexpected": [k for k in state if k not in expected],
        "shape mismatch": [f"{k} {list(state[k].shape)} vs {list(v.shape)}" for k, v in expected.items()
                           if k in state and tuple(state[k].shape) != tuple(v.shape)],
    }
    if any(problems.values()):
        parts = [f"{kind} {len(keys)} ({listed(keys)})" for kind, keys in problems.items() if keys]
        raise UserInputError(f"the .pth does not fit --torch_model {spec}: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)
    return model.eval()


def torch_outputs(model, x: np.ndarray) -> Dict[str, np.ndarray]:
    torch = import_torch()
    found: Dict[str, np.ndarray] = {}
    hooks = [getattr(model, module).register_forward_hook(
        lambda _m, _i, out, stage=stage: found.__setitem__(stage, out.detach().numpy().copy()))
        for stage, module in TORCH_MODULES.items()]
    try:
        with torch.no_grad():
            found["logits"] = model(torch.from_numpy(x)).numpy().copy()
    finally:
        for hook in hooks:
            hook.remove()
    return found


def mindspore_outputs(net, x: np.ndarray) -> Dict[str, np.ndarray]:
    from mindspore import Tensor  # noqa: PLC0415
    inputs = Tensor(x)
    out = net.maxpool(net.relu(net.bn1(net.conv1(inputs))))
    found = {"stem": out.asnumpy()}
    for stage in STAGES[1:5]:
        out = getattr(net, stage)(out)
        found[stage] = out.asnumpy()
    found["logits"] = net(inputs).asnumpy()
    return found


def compare(reference: np.ndarray, other: np.ndarray) -> Dict[str, object]:
    """Max abs difference, reference magnitude, their ratio and cosine similarity (float64)."""
    ref, oth = reference.astype(np.float64).ravel(), other.astype(np.float64).ravel()
    max_abs_diff = float(np.max(np.abs(ref - oth))) if ref.size else 0.0
    max_abs = float(np.max(np.abs(ref))) if ref.size else 0.0
    return {"shape": list(reference.shape), "max_abs_diff": max_abs_diff, "max_abs": max_abs,
            "rel_diff": max_abs_diff / max_abs if max_abs > 0 else max_abs_diff, "cosine": cosine(ref, oth)}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m src.migration.parity",
        description="Compare a PyTorch ResNet (.pth) with its converted MindSpore checkpoint, stage by stage.")
    parser.add_argument("--arch", required=True, choices=list(ARCHS))
    parser.add_argument("--pth", required=True, help="the PyTorch state dict (read with weights_only=True)")
    parser.add_argument("--ckpt", required=True, help="the converted MindSpore checkpoint")
    parser.add_argument("--torch_model", default=None,
                        help="package.module:factory of the PyTorch ResNet (default torchvision.models:<arch>)")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atol", type=float, default=1e-4, help="max abs difference allowed on the logits")
    parser.add_argument("--rtol", type=float, default=1e-3,
                        help="max abs difference allowed on each stage, relative to its largest magnitude")
    parser.add_argument("--device_target", default="CPU", choices=list(DEVICE_TARGETS),
                        help="where the MindSpore side runs")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.image_size < 32:
        parser.error("--batch_size must be >= 1 and --image_size >= 32 (five stride-2 steps)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import_torch()
    init_device(args.device_target, mode_name="PYNATIVE")
    spec, factory = resolve_factory(args.torch_model, args.arch)
    state = read_pth_state(args.pth)
    head = state.get("fc.weight")
    if head is None or head.dim() != 2:
        raise UserInputError(f"{args.pth} has no fc.weight [classes, features]; it is not a ResNet classifier")
    num_classes = int(head.shape[0])
    found_arch = guess_arch({torch_to_ms_name(k): v for k, v in state.items() if torch_to_ms_name(k)})
    if found_arch and found_arch != args.arch:
        raise UserInputError(f"{args.pth} holds a {found_arch} (from its block layout), not --arch {args.arch}; "
                             f"pass --arch {found_arch}")

    model = build_torch_model(spec, factory, state, num_classes)
    net = create_model(args.arch, num_classes=num_classes, initialize=False)  # every parameter loaded next
    load_into_network(net, args.ckpt, what=f"{args.arch} with {num_classes} classes (from the .pth)")
    net.set_train(False)

    x = np.random.default_rng(args.seed).standard_normal(
        (args.batch_size, 3, args.image_size, args.image_size)).astype(np.float32)
    reference, converted = torch_outputs(model, x), mindspore_outputs(net, x)
    stages = {stage: compare(reference[stage], converted[stage]) for stage in STAGES}

    print(f"parity {args.arch}: input {list(x.shape)} (seed {args.seed}), eval mode; PyTorch {spec} with "
          f"{args.pth} vs MindSpore {args.ckpt}", flush=True)
    print(f"{'stage':<8} {'shape':<20} {'max_abs_diff':>12} {'max_abs':>10} {'rel_diff':>10} {'cosine':>12}")
    for stage, row in stages.items():
        print(f"{stage:<8} {str(row['shape']):<20} {row['max_abs_diff']:>12.3e} {row['max_abs']:>10.3e} "
              f"{row['rel_diff']:>10.2e} {row['cosine']:>12.9f}")
    over = [stage for stage, row in stages.items() if row["rel_diff"] > args.rtol]
    logits_over = stages["logits"]["max_abs_diff"] > args.atol
    ok = not over and not logits_over
    if ok:
        print(f"parity: OK: logits max abs diff {stages['logits']['max_abs_diff']:.3e} <= {args.atol:g}, "
              f"every stage within rel {args.rtol:g}", flush=True)
    print(json.dumps({"arch": args.arch, "torch_model": spec, "input": list(x.shape), "seed": args.seed,
                      "atol": args.atol, "rtol": args.rtol, "ok": ok, "stages": stages}), flush=True)
    if not ok:
        where = (f"first stage over rel {args.rtol:g}: {over[0]} (max abs diff "
                 f"{stages[over[0]]['max_abs_diff']:.3e}, cosine {stages[over[0]]['cosine']:.6f})" if over
                 else "no single stage stands out")
        print(f"parity: FAIL: logits max abs diff {stages['logits']['max_abs_diff']:.3e} (atol {args.atol:g}); "
              f"{where}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    run_cli(main)
