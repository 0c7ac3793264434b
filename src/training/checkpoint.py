"""Checkpoints: atomic saving with rotation, finding the one to resume, and loading with checks
that name what does not fit (for eval, resume and fine-tuning)."""
import contextlib
import importlib
import logging
import os
import re
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn

from src.compression import NONE, PRUNE, QUANTIZATIONS, check_checkpoint_compression
from src.compression.prune import full_widths, narrow_blocks, pruned_widths
from src.compression.qat import apply_qat
from src.errors import UserInputError
from src.files import atomic_target
from src.resnet import create_model, use_convolutions

# Keys a training checkpoint holds besides the network: optimizer slots and counters, and the
# EMA of the weights (`ema.<parameter name>`, written by the train step with model_ema on).
OPTIMIZER_PREFIXES = ("moments.", "moment1.", "moment2.", "adam_m.", "adam_v.", "accum.", "accu_grads.", "stat.")
EMA_PREFIX = "ema."
STEP_COUNTER = "train_steps"  # the train step's count of optimizer steps (times the EMA updates)
STATE_SCALARS = {"global_step", "learning_rate", "momentum", "beta1_power", "beta2_power",
                 "scale_sense", "current_iterator_step", "last_overflow_iterator_step",
                 "epoch_num", "step_num", "top_1_accuracy", STEP_COUNTER}
# The model zoo's names for the same modules (ResNet in mindspore-ai/models, official/cv/ResNet).
ZOO_RENAMES = {"down_sample_layer": "downsample", "end_point": "fc", "bn1d": "bn1", "bn2d": "bn2"}
# Stem convolutions that mark where a network's names start: the torchvision family's conv1 and
# the zoo SE-ResNet50's conv1_0 (a network built as the zoo's: its checkpoints give the zoo's outputs).
ZOO_BUILT_STEM = "conv1_0.weight"
STEM_CONVS = ("conv1.weight", ZOO_BUILT_STEM)
CHECKPOINT_NAME = re.compile(r"^(?P<net>.+)-(?P<epoch>\d+)_(?P<step>\d+)\.ckpt$")
BEST_NAME = "best.ckpt"
MAX_LISTED = 8


def checkpoint_name(net_name: str, epoch: int, step_in_epoch: int) -> str:
    """The model zoo's naming: <net>-<epoch>_<step in epoch>.ckpt."""
    return f"{net_name}-{epoch}_{step_in_epoch}.ckpt"


def list_checkpoints(folder: str, net_name: str) -> List[Tuple[int, int, str]]:
    """(epoch, step in epoch, path) of the run's checkpoints, oldest first."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = CHECKPOINT_NAME.match(name)
        if match and match["net"] == net_name:
            found.append((int(match["epoch"]), int(match["step"]), os.path.join(folder, name)))
    return sorted(found)


class NonFiniteWeightsError(UserInputError):
    """Refused to save weights holding NaN or Inf."""


def non_finite_parameters(cell: nn.Cell) -> List[str]:
    """Names of the floating-point parameters of `cell` (weights, BN statistics, optimizer slots)
    that hold a NaN or an Inf."""
    return [param.name for param in cell.get_parameters() if not _finite(param)]


def _finite(param: Parameter) -> bool:
    value = param.asnumpy()
    return not np.issubdtype(value.dtype, np.floating) or bool(np.isfinite(value).all())


def save_atomic(cell: nn.Cell, path: str, append_dict: Optional[Dict] = None) -> None:
    """Save through a hidden temporary file and a rename: a kill never leaves half a file under
    `path`, a failed write (disk full) is one WriteError and leaves no temporary behind, and weights
    with NaN or Inf are never written (NonFiniteWeightsError)."""
    bad = non_finite_parameters(cell) + [name for name, value in (append_dict or {}).items()
                                         if isinstance(value, Parameter) and not _finite(value)]
    if bad:
        raise NonFiniteWeightsError(f"not saving {path}: {len(bad)} parameter(s) hold NaN/Inf (first {bad[0]}); "
                                    f"training diverged")
    with atomic_target(path) as tmp:
        # MindSpore writes <name>.tmp itself and renames it; a failed save leaves it behind.
        framework_tmp = os.path.splitext(tmp)[0] + ".tmp"
        try:
            with _framework_errors_silenced():
                ms.save_checkpoint(cell, tmp, append_dict=append_dict, crc_check=True)
        finally:
            if os.path.exists(framework_tmp):
                os.remove(framework_tmp)


def rotate(folder: str, net_name: str, keep: int, steps_per_epoch: int) -> List[str]:
    """Keep `keep` checkpoints: the newest end-of-epoch one (what --resume continues from) and the
    most recently written others; delete the rest. best.ckpt is not counted. Returns the deleted."""
    found = list_checkpoints(folder, net_name)
    ends = [path for _, step, path in found if step == steps_per_epoch]
    by_age = sorted((path for _, _, path in found), key=os.path.getmtime)
    removable = [path for path in by_age if path not in ends[-1:]]
    removed = removable[:max(0, len(found) - max(keep, 1))]
    for path in removed:
        os.remove(path)
    return removed


def read_checkpoint(path: str) -> Dict[str, Parameter]:
    """Read a MindSpore checkpoint; a missing, empty or corrupt file is a one-line error."""
    if not os.path.isfile(path):
        raise UserInputError(f"checkpoint not found: {path}; pass the path of an existing .ckpt file")
    if os.path.getsize(path) == 0:
        raise UserInputError(f"checkpoint {path} is empty (0 bytes); pick another checkpoint")
    try:
        with _framework_errors_silenced(), _memory_check_counts_page_cache():
            return ms.load_checkpoint(path, crc_check=True)  # also verifies our files' CRC
    except Exception as err:  # the framework raises ValueError/RuntimeError/TypeError alike here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "exceeds current available memory" in reason:
            raise UserInputError(f"checkpoint {path} ({os.path.getsize(path) / 2**20:.0f} MiB) does not fit in the "
                                 f"memory available now; stop other processes that hold memory and run again") from None
        raise UserInputError(f"checkpoint {path} cannot be read (truncated, corrupt or not a MindSpore "
                             f"checkpoint: {reason[:160]}); pick another checkpoint") from None


def available_memory(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """The kernel's estimate of the bytes a process can still get (MemAvailable: free memory plus
    the page cache it can reclaim), or None where there is no such file."""
    try:
        with open(meminfo, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@contextlib.contextmanager
def _memory_check_counts_page_cache():
    """MindSpore 2.10's load_checkpoint refuses a file larger than the free memory it reads from
    sysconf(SC_AVPHYS_PAGES), which leaves out the page cache: once a run has read its data, free
    memory can be a few hundred MB on a machine with gigabytes to give (a sound 255 MiB checkpoint
    was refused so in the test suite). While reading, that check gets MemAvailable instead."""
    serialization = importlib.import_module("mindspore.train.serialization")
    original = getattr(serialization, "_get_available_memory", None)
    if original is None:  # another MindSpore version: its own check, whatever it is
        yield
        return
    serialization._get_available_memory = lambda: available_memory() or original()  # noqa: SLF001
    try:
        yield
    finally:
        serialization._get_available_memory = original  # noqa: SLF001


@contextlib.contextmanager
def _framework_errors_silenced():
    """MindSpore logs an ERROR (or, for a failed save, CRITICAL) line of its own before raising; the
    caller reports it in one line."""
    from mindspore import log as ms_log
    logger = ms_log._get_logger()  # pylint: disable=protected-access
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def is_training_state(name: str) -> bool:
    """True for optimizer slots and training counters (of this repo's and the model zoo's checkpoints)."""
    return name in STATE_SCALARS or name.startswith(OPTIMIZER_PREFIXES + (EMA_PREFIX,))


def ema_part(params: Dict[str, Parameter]) -> Dict[str, Parameter]:
    """The EMA weights of a checkpoint under the network's own names ({} when it holds none)."""
    return {name[len(EMA_PREFIX):]: value for name, value in params.items() if name.startswith(EMA_PREFIX)}


def network_part(params: Dict[str, Parameter]) -> Dict[str, Parameter]:
    """The checkpoint without optimizer slots and training counters."""
    return {name: value for name, value in params.items() if not is_training_state(name)}


def zoo_to_ms_name(name: str) -> str:
    """Model-zoo parameter name -> this repo's (identity for names that already are this repo's)."""
    return ".".join(ZOO_RENAMES.get(part, part) for part in name.split("."))


def common_prefix(keys: Iterable[str]) -> str:
    """The wrapper prefix in front of the network's names ('module.', '_orig_mod.', 'network.'...).

    Found from the stem convolution `<prefix>conv1.weight` or `<prefix>conv1_0.weight` (not inside a layer)."""
    for key in keys:
        for stem in STEM_CONVS:
            if key.endswith(stem) and "layer" not in key:
                prefix = key[: -len(stem)]
                if prefix == "" or prefix.endswith("."):
                    return prefix
    return ""


def repo_name(key: str, prefix: str) -> str:
    """A checkpoint key under this repo's name: `prefix` dropped, model-zoo module names renamed."""
    return zoo_to_ms_name(key[len(prefix):] if prefix and key.startswith(prefix) else key)


def network_params(params: Dict[str, Parameter], path: str) -> Tuple[Dict[str, Parameter], Optional[str]]:
    """A checkpoint's network tensors under this repo's names, so model-zoo checkpoints load as they
    are; with a one-line note when names were mapped (None when the file already uses ours)."""
    network = network_part(params)
    prefix = common_prefix(network)
    mapped = {}
    for key, value in network.items():
        name = repo_name(key, prefix)
        mapped[name] = value if name == key else Parameter(value.asnumpy(), name=name)
    renamed = sum(zoo_to_ms_name(key) != key for key in network)
    if not renamed and not prefix:
        return mapped, None
    done = [f"mapped {renamed} model-zoo names (down_sample_layer->downsample, end_point->fc, bn1d/bn2d->bn1/bn2)"
            ] if renamed else []
    done += [f"prefix '{prefix}' dropped"] if prefix else []
    dropped = len(params) - len(network)
    done += [f"{dropped} optimizer entries skipped"] if dropped else []
    zoo_built = ZOO_BUILT_STEM in mapped  # SE-ResNet50 is built as the zoo's: nothing computes differently
    caveat = ("; the zoo's networks compute slightly differently (padding, BatchNorm eps: "
              "docs/pytorch.md)") if renamed and not zoo_built else ""
    return mapped, f"checkpoint {path}: {', '.join(done)}{caveat}"


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f", ... (+{len(items) - MAX_LISTED})" if len(items) > MAX_LISTED else "")


def network_mismatches(net: nn.Cell, params: Dict[str, Parameter]) -> Dict[str, List[str]]:
    """Missing, unexpected and shape-mismatched names between `net` and a checkpoint."""
    expected = {p.name: tuple(p.shape) for p in net.get_parameters()}
    found = {name: tuple(value.shape) for name, value in network_part(params).items()}
    return {
        "missing": [name for name in expected if name not in found],
        "unexpected": [name for name in found if name not in expected],
        "shape mismatch": [f"{name} {found[name]} vs network {shape}" for name, shape in expected.items()
                           if name in found and found[name] != shape],
    }


def raise_if_mismatched(problems: Dict[str, List[str]], path: str, what: str, hint: str) -> None:
    if any(problems.values()):
        parts = [f"{kind} {len(names)} ({_listed(names)})" for kind, names in problems.items() if names]
        raise UserInputError(f"checkpoint {path} does not fit {what}: {'; '.join(parts)}; {hint}")


def network_weights(path: str, use_ema: bool = False) -> Tuple[Dict[str, Parameter], Dict[str, Parameter],
                                                                 Optional[str]]:
    """A checkpoint's tensors, its network weights under this repo's names (its EMA weights with
    `use_ema`), and the note of names mapped (None when none were)."""
    checkpoint = read_checkpoint(path)
    if not use_ema:
        return (checkpoint, *network_params(checkpoint, path))
    params = ema_part(checkpoint)
    if not params:
        raise UserInputError(f"checkpoint {path} holds no EMA weights (ema.*): it was trained without "
                             f"model_ema; drop --use_ema")
    return checkpoint, params, None


def check_weights_compression(net: nn.Cell, checkpoint: Dict[str, Parameter], params: Dict[str, Parameter],
                              path: str, compression: str, *, pre_trained: bool = False) -> Optional[List[int]]:
    """One line when the checkpoint's kind (float, QAT, pruned) does not fit the run's `compression`
    (src.compression.check_checkpoint_compression); returns the inner widths of a pruned checkpoint,
    None for any other. `net`: a network of the run's architecture, float or pruned."""
    widths = pruned_widths(net, params)
    ours = widths is not None or all(name in params for name in full_widths(net))
    check_checkpoint_compression(checkpoint, path, compression, pre_trained=pre_trained,
                                 pruned=widths is not None if ours else None)
    return widths


def _load_checked(net: nn.Cell, loaded: Tuple[Dict[str, Parameter], Dict[str, Parameter], Optional[str]], *,
                  path: str, what: str, log: Callable[[str], None], compression: str) -> Dict[str, Parameter]:
    """Load the `loaded` weights of network_weights into `net`, every name and shape checked."""
    checkpoint, params, note = loaded
    check_weights_compression(net, checkpoint, params, path, compression)
    raise_if_mismatched(network_mismatches(net, params), path, what, "check net_name and class_num")
    ms.load_param_into_net(net, params, strict_load=True)
    if note:
        log(note)
    return params


def load_into_network(net: nn.Cell, path: str, what: str = "the network",
                      log: Callable[[str], None] = print, use_ema: bool = False,
                      compression: str = NONE) -> Dict[str, Parameter]:
    """Load every network parameter from `path` (this repo's or the model zoo's names; its EMA weights
    with `use_ema`); any mismatch is one error line listing names, a float checkpoint for a
    compressed network (`compression`) or the other way round one line naming the fix. Returns the
    loaded tensors under this repo's names."""
    return _load_checked(net, network_weights(path, use_ema), path=path, what=what, log=log, compression=compression)


def compressed(net: nn.Cell, *, compression: str, convolutions: str = "mindspore",
               widths: Optional[Sequence[int]] = None) -> nn.Cell:
    """`net`, built with nn.Conv2d, made the network a `compression` run trains, in place: narrowed
    to a pruned network's inner `widths` (first: this repository's CPU layers replace the nn.Conv2d
    cells it narrows), computing with `convolutions`, and quantization-aware for qat and lsq."""
    if widths is not None:
        narrow_blocks(net, widths)
    use_convolutions(net, convolutions)
    if compression in QUANTIZATIONS:
        apply_qat(net, compression)
    return net


def network_from_checkpoint(net_name: str, class_num: int, path: str, *, use_ema: bool = False,
                            convolutions: str = "mindspore", compression: str = NONE,
                            log: Callable[[str], None] = print) -> nn.Cell:
    """A new `net_name` network with `class_num` classes holding the weights of `path` (its EMA
    weights with `use_ema`): quantization-aware with `compression` qat or lsq, narrowed to the
    checkpoint's own inner widths with `compression` prune. A checkpoint of another network, or of
    another compression, is one error line."""
    net = create_model(net_name, num_classes=class_num, initialize=False)  # the checkpoint sets every parameter
    loaded = network_weights(path, use_ema)
    widths = check_weights_compression(net, loaded[0], loaded[1], path, compression)
    compressed(net, compression=compression, convolutions=convolutions, widths=widths if compression == PRUNE else None)
    _load_checked(net, loaded, path=path, what=f"{net_name} with class_num {class_num}", log=log,
                  compression=compression)
    return net


def load_pretrained(net: nn.Cell, path: str, *, head: Sequence[str], filter_weight: bool,
                    what: str, log: Callable[[str], None] = print, compression: str = NONE) -> List[str]:
    """Load a pre-trained backbone (this repo's or the model zoo's names) into the float network: a
    compressed (QAT or pruned) checkpoint is one error line (`compression`: the run's, which decides
    the fix). With `filter_weight`, the head (`head` names) is skipped and keeps its fresh
    initialization. Returns the skipped descriptions."""
    checkpoint = read_checkpoint(path)
    params, note = network_params(checkpoint, path)
    check_weights_compression(net, checkpoint, params, path, compression, pre_trained=True)
    skipped = []
    if filter_weight:
        skipped = [f"{name} {tuple(params[name].shape)}" for name in head if name in params]
        params = {name: value for name, value in params.items() if name not in head}
    problems = network_mismatches(net, params)
    if filter_weight:
        problems["missing"] = [name for name in problems["missing"] if name not in head]
    hint = "check net_name" if filter_weight else \
        "for a different class_num pass --filter_weight True to drop the classifier head"
    raise_if_mismatched(problems, path, what, hint)
    ms.load_param_into_net(net, params, strict_load=False)
    if note:
        log(note)
    return skipped


def training_position(params: Dict[str, Parameter], path: str) -> Tuple[int, int]:
    """(epochs done, global step) recorded in a checkpoint written by train.py."""
    if "epoch_num" not in params or "step_num" not in params:
        raise UserInputError(f"checkpoint {path} has no training position (epoch_num/step_num): it was "
                             f"not written by this train.py; use it as --pre_trained instead")
    return int(params["epoch_num"].asnumpy()), int(params["step_num"].asnumpy())


def restore_training_state(train_network: nn.Cell, params: Dict[str, Parameter], path: str) -> None:
    """Load weights, optimizer slots and counters into the whole training cell (not the lr array,
    which the schedule recomputes)."""
    wanted = {p.name: p for p in train_network.get_parameters() if p.name != "learning_rate"}
    missing = [name for name in wanted if name not in params]
    if missing:
        raise UserInputError(f"checkpoint {path} lacks training state {_listed(missing)}: it was saved with "
                             f"another optimizer, loss scaling or model_ema; resume with the same config")
    ms.load_param_into_net(train_network, {name: params[name] for name in wanted}, strict_load=True)


def find_latest(folder: str, net_name: str, steps_per_epoch: int, mid_epoch: bool = True) -> Optional[str]:
    """The checkpoint --resume continues from: the furthest in training, end-of-epoch or (with
    `mid_epoch`) mid-epoch (a step save, or the one a stop signal left). None when the folder holds
    no checkpoint of `net_name` at all (a run not started, or stopped before its first save); an
    error when it holds only checkpoints of another epoch length (another batch size or dataset)."""
    found = list_checkpoints(folder, net_name)
    candidates = [(epoch, step, path) for epoch, step, path in found
                  if step == steps_per_epoch or (mid_epoch and step < steps_per_epoch)]
    if not found:
        return None
    if not candidates:
        kind = f"<epoch>_<step <= {steps_per_epoch}>" if mid_epoch else f"<epoch>_{steps_per_epoch}"
        raise UserInputError(f"no checkpoint ({net_name}-{kind}.ckpt) in {folder} to resume from; pass "
                             f"--resume_ckpt, or start anew with another --output_dir")
    return max(candidates)[2]
