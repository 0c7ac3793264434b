"""Convert ResNet weights between torchvision (.pth), the MindSpore model zoo (.ckpt) and this repo.

    python -m src.migration.convert_torch --arch resnet50 --pth resnet50-0676ba61.pth --ckpt resnet50_tv.ckpt
    python -m src.migration.convert_torch --arch resnet50 --ckpt_in resnet50_zoo.ckpt --ckpt resnet50.ckpt
    python -m src.migration.convert_torch --arch resnet50 --ckpt_in resnet50.ckpt --pth_out resnet50.pth

The input is a torchvision-style state dict (bare, or under `state_dict` / `model` /
`model_state_dict` of a training checkpoint, with or without a `module.` prefix), read with
`torch.load(..., weights_only=True)` so an untrusted file never runs code; or a MindSpore checkpoint
with this repo's names or the model zoo's (`down_sample_layer`, `end_point`, `bn1d`/`bn2d`;
optimizer state is dropped). The zoo's SE-ResNet50 (`--arch se-resnet50`) converts between MindSpore
checkpoints only: torchvision has no such network. The format is detected from the file's first
bytes. The output is a MindSpore checkpoint for `create_model(arch, num_classes)` (`--ckpt`),
verified by loading it back into that network, or a torchvision-loadable state dict (`--pth_out`).
`num_classes` comes from the head (`fc.weight`). torch is optional: only .pth files need it.
"""
import argparse
import os
import re
import tempfile
import warnings
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

# common_prefix and zoo_to_ms_name live with the loader (one name mapping); src.migration.parity imports them from here.
from src.device import prefer_fast_cpu_convolutions
from src.errors import OneLineParser, UserInputError, require_module, run_cli
from src.resnet import ARCHS, NET_NAMES, ZOO_NETWORKS, create_model
from src.training.checkpoint import (  # noqa: F401
    ZOO_BUILT_STEM,
    common_prefix,
    is_training_state,
    load_into_network,
    read_checkpoint,
    repo_name,
    zoo_to_ms_name,
)

TORCH_PIN = "torch==2.13.0+cpu"
INSTALL_HINT = (f"pip install {TORCH_PIN} (the CPU build: from https://download.pytorch.org/whl/cpu, or "
                f"a local wheel with --find-links; a plain 'pip install torch' may pull the CUDA build)")

# BatchNorm fields: PyTorch name -> MindSpore name; PyTorch's state_dict order of a BN layer.
BN_TORCH_TO_MS = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean",
                  "running_var": "moving_variance"}
BN_MS_TO_TORCH = {ms_name: torch_name for torch_name, ms_name in BN_TORCH_TO_MS.items()}
TORCH_BN_ORDER = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
# In a torchvision ResNet the BatchNorm modules are bn1/bn2/bn3 and the shortcut's downsample.1.
_BN_MODULE = re.compile(r"(?:^|\.)(?:bn\d+|downsample\.1)$")
# Where a training checkpoint keeps the model's state dict.
WRAPPER_KEYS = ("state_dict", "model", "model_state_dict")
STAGES = ("layer1", "layer2", "layer3", "layer4")
MAX_LISTED = 8


# ---------------------------------------------------------------------------------------------
# Name mapping: pure functions over key names.

def split_key(key: str) -> Tuple[str, str]:
    """'layer1.0.bn1.weight' -> ('layer1.0.bn1', 'weight')."""
    module, _, field = key.rpartition(".")
    return module, field


def is_batch_norm(module: str) -> bool:
    """Whether a module path of a torchvision ResNet is a BatchNorm layer."""
    return bool(_BN_MODULE.search(module))


def torch_to_ms_name(key: str) -> Optional[str]:
    """torchvision key -> this repo's parameter name; None for `num_batches_tracked` (dropped)."""
    module, field = split_key(key)
    if field == "num_batches_tracked":
        return None
    if is_batch_norm(module) and field in BN_TORCH_TO_MS:
        return f"{module}.{BN_TORCH_TO_MS[field]}"
    return key


def ms_to_torch_name(name: str) -> str:
    """This repo's parameter name -> torchvision key (gamma/beta/moving_* exist only in BatchNorm)."""
    module, field = split_key(name)
    return f"{module}.{BN_MS_TO_TORCH[field]}" if field in BN_MS_TO_TORCH else name


def torch_state_dict_order(ms_names: Sequence[str]) -> List[str]:
    """torchvision's keys, in torchvision's order, for this repo's parameter names (network order).

    Each BatchNorm layer gets weight, bias, running_mean, running_var, num_batches_tracked."""
    order: List[str] = []
    seen_bn = set()
    for name in ms_names:
        module, field = split_key(name)
        if field in BN_MS_TO_TORCH:
            if module not in seen_bn:
                seen_bn.add(module)
                order += [f"{module}.{bn_field}" for bn_field in TORCH_BN_ORDER]
        else:
            order.append(name)
    return order


def guess_arch(params: Mapping[str, object]) -> Optional[str]:
    """The network (in NET_NAMES) whose block layout and 3x3 grouping match these parameters, if any:
    the zoo's SE-ResNet50 by its three-convolution stem (ZOO_BUILT_STEM), no torchvision network has.

    `params` maps this repo's names to arrays or tensors: the shape of layer1.0.conv2.weight,
    [groups x width_per_group, width_per_group, 3, 3], tells ResNet, ResNeXt and Wide ResNet apart."""
    if ZOO_BUILT_STEM in params:
        return "se-resnet50"
    names = list(params)
    blocks = []
    for stage in STAGES:
        indices = {int(m.group(1)) for m in (re.match(rf"{stage}\.(\d+)\.", n) for n in names) if m}
        blocks.append(max(indices) + 1 if indices else 0)
    kind = "bottleneck" if any(re.match(r"layer\d\.\d+\.conv3\.", n) for n in names) else "basic"
    shape = tuple(getattr(params.get("layer1.0.conv2.weight"), "shape", ()))
    groups, width_per_group = (int(shape[0]) // int(shape[1]), int(shape[1])) if len(shape) == 4 else (1, 64)
    for name, arch in ARCHS.items():
        if (arch.kind, arch.layers, arch.groups, arch.width_per_group) == (kind, blocks, groups, width_per_group):
            return name
    return None


def listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f", ... (+{len(items) - MAX_LISTED})" if len(items) > MAX_LISTED else "")


# ---------------------------------------------------------------------------------------------
# Reading.

def import_torch():
    """torch, or a one-line error saying how to install its CPU build."""
    return require_module("torch", needed_for="reading or writing .pth files", install_hint=INSTALL_HINT)


def _first_reason(err: BaseException) -> str:
    """The informative line of an exception message (torch's weights_only text is mostly boilerplate)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    boilerplate = ("Weights only load failed", "Check the documentation", "Please file an issue")
    useful = [line for line in lines if not line.startswith(boilerplate)]
    reason = (useful or lines or [type(err).__name__])[0]
    return reason.split(". ")[0][:200]


def detect_format(path: str, declared: str) -> str:
    """'torch' or 'mindspore', from the first bytes (zip or pickle vs protobuf), else `declared`."""
    with open(path, "rb") as handle:
        head = handle.read(4)
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "torch"
    if head[:1] == b"\x0a":  # a protobuf message opening with field 1 (length-delimited): a .ckpt
        return "mindspore"
    return declared


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise UserInputError(f"input not found: {path}; pass an existing .pth (--pth) or .ckpt (--ckpt_in)")
    if os.path.getsize(path) == 0:
        raise UserInputError(f"input {path} is empty (0 bytes); pick another file")


def load_torch_file(path: str):
    """torch.load with weights_only=True: tensors and plain containers only, never code."""
    torch = import_torch()
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": not the user's concern
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError for refused content; RuntimeError etc. for corrupt files
        if type(err).__name__ == "UnpicklingError":
            raise UserInputError(
                f"{path} refused: it holds more than tensors and plain containers "
                f"({_first_reason(err)}), so loading it could run code and it is not loaded "
                f"(torch.load weights_only=True); from a source you trust, re-save model.state_dict() "
                f"alone with torch.save") from None
        raise UserInputError(f"{path} cannot be read by torch.load (truncated, corrupt or not a PyTorch "
                             f"file: {_first_reason(err)}); pick another file") from None


def find_state_dict(obj, path: str) -> Tuple[Dict[str, object], str]:
    """The tensors of a state dict: the object itself or under a training checkpoint's key."""
    torch = import_torch()

    def tensors_of(value) -> Dict[str, object]:
        if not isinstance(value, Mapping):
            return {}
        return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}

    if isinstance(obj, Mapping):
        for key in WRAPPER_KEYS:
            found = tensors_of(obj.get(key))
            if found:
                return found, f"under '{key}'"
        found = tensors_of(obj)
        if found:
            return found, "bare"
        shown = listed([str(k) for k in obj.keys()])
        raise UserInputError(f"{path} holds no state dict: no tensors at the top level nor under "
                             f"{'/'.join(WRAPPER_KEYS)} (top-level keys: {shown}); save model.state_dict()")
    raise UserInputError(f"{path} holds a {type(obj).__name__}, not a state dict; save model.state_dict()")


def torch_to_numpy(tensor) -> np.ndarray:
    """A float tensor as float32 (the network's dtype), integer tensors as they are."""
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point():
        tensor = tensor.float()
    return tensor.numpy().copy()


class Source:
    """Parameters read from one input, renamed to this repo's names, with what was done to them."""

    def __init__(self, path: str, kind: str):
        self.path = path
        self.kind = kind                      # 'torch' or 'mindspore'
        self.params: Dict[str, np.ndarray] = OrderedDict()
        self.origin: Dict[str, str] = {}      # this repo's name -> the input's key
        self.notes: List[str] = []
        self.from_zoo = False

    def input_name(self, name: str) -> str:
        """How the input would name one of this repo's parameters (for error messages)."""
        if name in self.origin:
            return self.origin[name]
        return ms_to_torch_name(name) if self.kind == "torch" else name


def read_torch_source(path: str) -> Source:
    """A torchvision-style .pth, renamed to this repo's names."""
    state, where = find_state_dict(load_torch_file(path), path)
    source = Source(path, "torch")
    prefix = common_prefix(state)
    renamed = dropped = 0
    for key, tensor in state.items():
        bare = key[len(prefix):] if prefix and key.startswith(prefix) else key
        name = torch_to_ms_name(bare)
        if name is None:
            dropped += 1
            continue
        renamed += name != bare
        source.params[name] = torch_to_numpy(tensor)
        source.origin[name] = key
    source.notes.append(f"read {path}: PyTorch state dict ({where}), {len(state)} tensors"
                        + (f", prefix '{prefix}' stripped" if prefix else ""))
    source.notes.append(f"mapped: {renamed // 4} BatchNorm layers (weight->gamma, bias->beta, "
                        f"running_mean->moving_mean, running_var->moving_variance), "
                        f"{len(source.params) - renamed} conv/fc tensors as they are, "
                        f"{dropped} num_batches_tracked dropped")
    return source


def read_mindspore_source(path: str) -> Source:
    """A MindSpore checkpoint (this repo's or the model zoo's names), renamed to this repo's names."""
    params = read_checkpoint(path)
    source = Source(path, "mindspore")
    optimizer = [name for name in params if is_training_state(name)]
    network = [name for name in params if not is_training_state(name)]
    prefix = common_prefix(network)
    renamed = 0
    for key in network:
        name = repo_name(key, prefix)
        renamed += zoo_to_ms_name(key) != key
        source.params[name] = params[key].asnumpy().copy()
        source.origin[name] = key
    source.from_zoo = renamed > 0
    source.notes.append(f"read {path}: MindSpore checkpoint, {len(network)} network tensors"
                        + (f", {len(optimizer)} optimizer entries dropped" if optimizer else "")
                        + (f", prefix '{prefix}' stripped" if prefix else ""))
    if renamed:
        source.notes.append(f"mapped: {renamed} model-zoo names (down_sample_layer->downsample, "
                            f"end_point->fc, bn1d/bn2d->bn1/bn2), the rest as they are")
    return source


def read_source(path: str, declared: str) -> Source:
    _check_file(path)
    kind = detect_format(path, declared)
    source = read_torch_source(path) if kind == "torch" else read_mindspore_source(path)
    if kind != declared:
        source.notes.append(f"note: {path} is a {'PyTorch' if kind == 'torch' else 'MindSpore'} file "
                            f"(from its content), read as such")
    return source


# ---------------------------------------------------------------------------------------------
# Checking against this repo's network and writing.

def head_classes(source: Source, num_classes: Optional[int]) -> int:
    """num_classes from the head's weight; an explicit --num_classes must agree with it."""
    weight = source.params.get("fc.weight")
    if weight is None or weight.ndim != 2:
        raise UserInputError(f"{source.path} has no classifier head ({source.input_name('fc.weight')} "
                             f"of shape [classes, features]); it is not a ResNet classifier state dict")
    found = int(weight.shape[0])
    if num_classes is not None and num_classes != found:
        raise UserInputError(f"--num_classes {num_classes} disagrees with the head "
                             f"{source.input_name('fc.weight')} {list(weight.shape)} ({found} classes); "
                             f"drop --num_classes")
    return found


def build_checked_network(source: Source, arch: str, num_classes: int):
    """create_model(arch, num_classes) after checking every name and shape of the source against it."""
    net = create_model(arch, num_classes=num_classes, initialize=False)  # the source fills every parameter
    shapes = {p.name: tuple(p.shape) for p in net.get_parameters()}
    described = {
        "missing": [source.input_name(n) for n in shapes if n not in source.params],
        "unexpected": [source.input_name(n) for n in source.params if n not in shapes],
        "shape mismatch": [f"{source.input_name(n)} {list(source.params[n].shape)} vs {list(shapes[n])}"
                           for n in shapes if n in source.params and tuple(source.params[n].shape) != shapes[n]],
    }
    if any(described.values()):
        parts = [f"{kind} {len(names)} ({listed(names)})" for kind, names in described.items() if names]
        guessed = guess_arch(source.params)
        hint = (f"it looks like {guessed}: pass --arch {guessed}" if guessed and guessed != arch
                else "check --arch and that the file is a torchvision-style ResNet (or the model zoo's SE-ResNet50)")
        raise UserInputError(f"{source.path} does not fit {arch} with {num_classes} classes: "
                             f"{'; '.join(parts)}; {hint}")
    return net


def _staging_path(target: str, suffix: str) -> str:
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    handle, staged = tempfile.mkstemp(prefix=".convert-", suffix=suffix, dir=folder)
    os.close(handle)
    return staged


def write_ckpt(net, source: Source, target: str, arch: str) -> int:
    """Write the network's parameters (in network order) atomically, then load them back into
    `net` and compare every value. Returns the number of trainable parameters."""
    import mindspore as ms  # noqa: PLC0415
    names = [p.name for p in net.get_parameters()]
    staged = _staging_path(target, ".ckpt")
    try:
        ms.save_checkpoint([{"name": n, "data": ms.Tensor(source.params[n].astype(np.float32))} for n in names],
                           staged)
        load_into_network(net, staged, what=f"{arch}")
        for param in net.get_parameters():
            if not np.array_equal(param.asnumpy(), source.params[param.name].astype(np.float32)):
                raise UserInputError(f"verification failed: {param.name} differs after loading {target} "
                                     f"back; the file was not written")
        os.replace(staged, target)
    finally:
        if os.path.exists(staged):
            os.remove(staged)
    return sum(int(np.prod(p.shape)) for p in net.trainable_params())


def torch_state_dict(net, source: Source) -> "OrderedDict":
    """A torchvision-loadable state dict (strict): float32 tensors in torchvision's order, and an
    int64 zero `num_batches_tracked` per BatchNorm (MindSpore does not count batches)."""
    torch = import_torch()
    state = OrderedDict()
    for key in torch_state_dict_order([p.name for p in net.get_parameters()]):
        if key.endswith(".num_batches_tracked"):
            state[key] = torch.tensor(0, dtype=torch.int64)
        else:
            state[key] = torch.from_numpy(source.params[torch_to_ms_name(key)].astype(np.float32))
    return state


def write_pth(state: "OrderedDict", target: str) -> None:
    """torch.save atomically; read back with weights_only=True to check it."""
    torch = import_torch()
    staged = _staging_path(target, ".pth")
    try:
        with open(staged, "wb") as handle:
            # Through a handle, the zip archive's folder is torch's fixed "archive"; given a path, it
            # is named after the staging file, whose name holds the pid: every run's bytes differed.
            torch.save(state, handle)
        back = torch.load(staged, map_location="cpu", weights_only=True)
        if list(back) != list(state) or any(not torch.equal(back[k], v) for k, v in state.items()):
            raise UserInputError(f"verification failed: {target} does not read back equal; not written")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staged, 0o666 & ~umask)  # mkstemp's 0600 -> what a plain torch.save would give
        os.replace(staged, target)
    finally:
        if os.path.exists(staged):
            os.remove(staged)


def zoo_note(arch: str) -> Optional[str]:
    """How this repo's network computes differently from the model zoo's with the same weights
    (None for SE-ResNet50, built as the zoo builds it)."""
    if arch in ZOO_NETWORKS:
        return None
    if ARCHS[arch].kind == "basic":  # the zoo's resnet18/34 (res_base=True) pad symmetrically like this repo
        return ("note: model-zoo weights: the zoo's ResNet18/34 block BatchNorms (bn1d/bn2d) use eps 1e-4, "
                "this repo's 1e-5, so outputs differ slightly (~0.2% of the logits) from the zoo's network")
    return ("note: model-zoo weights: the zoo's ResNet50/101/152 pad with pad_mode='same' (asymmetric at "
            "stride 2: the extra row/column at the bottom/right) and use BatchNorm eps 1e-4; this repo pads "
            "symmetrically like torchvision with eps 1e-5, so outputs differ from the zoo's own network; "
            "re-measure accuracy with eval.py (docs/pytorch.md)")


def convert(arch: str, source: Source, *, ckpt: Optional[str], pth_out: Optional[str],
            num_classes: Optional[int] = None) -> None:
    classes = head_classes(source, num_classes)
    for note in source.notes:
        print(note, flush=True)
    net = build_checked_network(source, arch, classes)
    print(f"num_classes {classes} (from {source.input_name('fc.weight')} "
          f"{list(source.params['fc.weight'].shape)})", flush=True)
    if ckpt:
        values = write_ckpt(net, source, ckpt, arch)
        print(f"wrote {ckpt}: {arch}, {len(list(net.get_parameters()))} tensors, {values:,} parameters; verified: "
              f"loads into create_model('{arch}', num_classes={classes}) with every value equal", flush=True)
    if pth_out:
        state = torch_state_dict(net, source)
        write_pth(state, pth_out)
        bn_layers = sum(k.endswith(".num_batches_tracked") for k in state)
        print(f"wrote {pth_out}: torchvision {arch} state dict, {len(state)} keys ({bn_layers} BatchNorm "
              f"layers with num_batches_tracked = 0), float32; load it with "
              f"torchvision.models.{arch}(num_classes={classes}).load_state_dict(torch.load(path))", flush=True)
    note = zoo_note(arch) if source.from_zoo else None
    if note:
        print(note, flush=True)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m src.migration.convert_torch",
        description="Convert ResNet weights: torchvision .pth or MindSpore/model-zoo .ckpt -> this repo's "
                    ".ckpt (--ckpt) or a torchvision state dict (--pth_out).")
    parser.add_argument("--arch", required=True, choices=list(NET_NAMES), help="this repo's network")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pth", metavar="IN.pth",
                        help="input: torchvision-style state dict (.pth/.pt), read with weights_only=True")
    source.add_argument("--ckpt_in", "--zoo_ckpt", dest="ckpt_in", metavar="IN.ckpt",
                        help="input: MindSpore checkpoint, this repo's or the model zoo's names")
    parser.add_argument("--ckpt", metavar="OUT.ckpt", help="output: MindSpore checkpoint for this repo's network")
    parser.add_argument("--pth_out", metavar="OUT.pth", help="output: torchvision-loadable state dict")
    parser.add_argument("--num_classes", type=int, default=None,
                        help="optional check; the class count is read from fc.weight")
    args = parser.parse_args(argv)
    if not args.ckpt and not args.pth_out:
        parser.error("give an output: --ckpt OUT.ckpt and/or --pth_out OUT.pth")
    if args.arch in ZOO_NETWORKS and (args.pth or args.pth_out):
        parser.error(f"--arch {args.arch} is the model zoo's network, which torchvision does not have: convert "
                     f"MindSpore checkpoints only (--zoo_ckpt IN.ckpt --ckpt OUT.ckpt)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    prefer_fast_cpu_convolutions()
    if args.pth_out:
        import_torch()  # fail before any work when torch is missing
    source = read_source(args.pth or args.ckpt_in, "torch" if args.pth else "mindspore")
    convert(args.arch, source, ckpt=args.ckpt, pth_out=args.pth_out, num_classes=args.num_classes)
    return 0


if __name__ == "__main__":
    run_cli(main)
