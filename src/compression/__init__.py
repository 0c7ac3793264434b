"""Compressing a trained network: quantization-aware training (QAT) with MindSpore Golden Stick,
and structured channel pruning.

`compression: qat` (train.py, eval.py, export.py) wraps every convolution and the fc head in Golden
Stick's SimQAT quantization cells (src/compression/qat.py); `compression: lsq` in its LSQ cells
(learned step sizes), the same way. `compression: prune` removes
`prune_ratio` of the inner channels of every residual block (src/compression/prune.py), those of
lowest L1 norm or, with `prune_criterion: scop`, of lowest SCOP score after a knockoff stage with
Golden Stick's cells (src/compression/scop.py); a pruned
checkpoint is recognized by its shapes: its blocks' inner convolutions are narrower than the
network's. The checks here are plain functions of names and config values: they import neither
MindSpore nor Golden Stick, so only a run that asks for compression pays for Golden Stick's import.
"""
from typing import Iterable, List, Optional, Tuple

from src.errors import UserInputError

NONE, QAT, PRUNE, LSQ = "none", "qat", "prune", "lsq"
L1, SCOP = "l1", "scop"
PRUNE_CRITERIA = (L1, SCOP)  # which channels pruning keeps: largest filter L1 norms, or SCOP's scores
COMPRESSIONS = (NONE, QAT, PRUNE, LSQ)
QUANTIZATIONS = (QAT, LSQ)  # the compressions that wrap the cells in Golden Stick's quantization cells
# What a checkpoint of each compression is, and what marks it.
KINDS = {QAT: "quantization-aware", PRUNE: "pruned", LSQ: "quantization-aware with learned step sizes"}
# What each compression's network is, in a sentence about it.
NETWORKS = {QAT: "quantization-aware", PRUNE: "pruned", LSQ: "quantization-aware"}
MARKS = {QAT: "no fake-quantizer ranges", PRUNE: "its blocks have the network's full widths",
         LSQ: "no learned step sizes"}
# Golden Stick's fake quantizers keep their ranges as <cell>._{input,output,weight}_quantizer._float_min/max;
# its LSQ quantizers alone also keep their level count there, as quant_max (SimQAT's hold it as an attribute).
QUANTIZER_MARK = "_quantizer._float_"
LSQ_MARK = "_quantizer.quant_max"
INSTALL_HINT = "install it with: .venv/bin/python -m pip install mindspore-gs==1.3.0 tqdm"
# Why each compression refuses optimizer Thor (its own training path).
THOR_CONFLICTS = {QAT: "Thor replaces the convolution cells that quantization wraps",
                  LSQ: "Thor replaces the convolution cells that quantization wraps",
                  PRUNE: "Thor replaces the convolution cells with its own, untried on pruned widths"}


def check_prune_ratio(prune_ratio: float) -> None:
    """The fraction of channels pruning removes: strictly between 0 and 1."""
    if not 0.0 < prune_ratio < 1.0:
        raise UserInputError(f"prune_ratio must be between 0 and 1 (exclusive), got {prune_ratio}; pass e.g. "
                             f"--prune_ratio 0.5 (half of each block's inner channels removed)")


def check_prune_criterion(prune_criterion: str, compression: str, *, knockoff_epochs: float = 1.0,
                          knockoff_lr: float = 0.1) -> None:
    """The pruning criterion and its knockoff stage's keys (scop), and that it comes with pruning."""
    if prune_criterion not in PRUNE_CRITERIA:
        raise UserInputError(f"unknown prune_criterion '{prune_criterion}'; choose one of {', '.join(PRUNE_CRITERIA)}")
    if prune_criterion == SCOP and compression != PRUNE:
        raise UserInputError(f"prune_criterion scop chooses the channels compression prune removes; add "
                             f"--compression prune (this run has compression {compression})")
    if prune_criterion == SCOP and not (knockoff_epochs > 0 and knockoff_lr > 0):
        raise UserInputError(f"prune_criterion scop trains a knockoff stage first: knockoff_epochs and knockoff_lr "
                             f"must be positive, got {knockoff_epochs:g} and {knockoff_lr:g}")


def check_compression(compression: str, *, optimizer: str = "Momentum", freeze_backbone: bool = False,
                      pre_trained: Optional[str] = None, prune_ratio: float = 0.5, prune_criterion: str = L1,
                      knockoff_epochs: float = 1.0, knockoff_lr: float = 0.1) -> None:
    """One line for a compression request that cannot work (pre_trained None: not a training run)."""
    if compression not in COMPRESSIONS:
        raise UserInputError(f"unknown compression '{compression}'; choose one of {', '.join(COMPRESSIONS)}")
    if pre_trained is not None:
        check_prune_criterion(prune_criterion, compression, knockoff_epochs=knockoff_epochs, knockoff_lr=knockoff_lr)
    if compression == NONE:
        return
    if optimizer == "Thor":
        raise UserInputError(f"compression {compression} does not combine with optimizer Thor "
                             f"({THOR_CONFLICTS[compression]}); use --optimizer Momentum")
    if freeze_backbone:
        raise UserInputError(f"compression {compression} fine-tunes the whole {NETWORKS[compression]} network; "
                             f"drop --freeze_backbone True")
    if pre_trained == "":
        raise UserInputError(f"compression {compression} fine-tunes a trained float network; pass --pre_trained CKPT "
                             f"(a checkpoint of this net_name trained without compression)")
    if compression == PRUNE and pre_trained is not None:
        check_prune_ratio(prune_ratio)


def compression_convolutions(compression: str, cpu_convolution: str, device_target: str) -> Tuple[str, Optional[str]]:
    """The cpu_convolution a run uses, and a line for the log when compression overrides it: Golden
    Stick wraps MindSpore's nn.Conv2d cells, so this repository's oneDNN layers cannot run under QAT
    or LSQ (a pruned network is made of standard layers, which they run)."""
    if compression not in QUANTIZATIONS or device_target != "CPU" or cpu_convolution == "mindspore":
        return cpu_convolution, None
    return "mindspore", (f"compression {compression}: MindSpore's CPU convolutions (Golden Stick quantizes "
                         f"nn.Conv2d cells; this repository's oneDNN layers are not used)")


def mindspore_convolution_stages(compression: str, prune_criterion: str) -> Tuple[str, ...]:
    """The stages of a run that train on MindSpore's convolutions whatever `cpu_convolution` says
    (src.runtime.caps_mindspore_isa): SCOP's knockoff stage, whose Golden Stick cells wrap nn.Conv2d.
    Named by configuration, not by whether a relaunch will skip the stage, so that a relaunched run
    computes in the same kernels as the uninterrupted one."""
    return ("SCOP's knockoff stage",) if compression == PRUNE and prune_criterion == SCOP else ()


def quantizer_names(names: Iterable[str]) -> List[str]:
    """The names of a checkpoint that only a quantization-aware network has (fake-quantizer ranges)."""
    return [name for name in names if QUANTIZER_MARK in name]


def checkpoint_compression(names: Iterable[str], *, pruned: Optional[bool]) -> str:
    """The compression a checkpoint was trained with: lsq by its quantizers' level counts, qat by
    their ranges alone, prune when its shapes are narrower than the network's (`pruned`, found by the
    caller), else none."""
    names = list(names)
    if quantizer_names(names):
        return LSQ if any(LSQ_MARK in name for name in names) else QAT
    return PRUNE if pruned else NONE


def check_checkpoint_compression(names: Iterable[str], path: str, compression: str, *,
                                 pre_trained: bool = False, pruned: Optional[bool] = False) -> None:
    """A checkpoint whose kind (float, QAT, LSQ or pruned) does not fit the run is one line naming the
    fix. `pre_trained`: the weights a run starts from, which must be float (a compressed network is
    not compressed again). `pruned`: the checkpoint's blocks are narrower than the network's; None
    when it lacks the network's blocks (another network's, which the name checks report)."""
    kind = checkpoint_compression(names, pruned=pruned)
    if kind != NONE and pre_trained:
        raise UserInputError(f"checkpoint {path} is already {KINDS[kind]} (compression {kind}) and "
                             f"--pre_trained takes float weights; pass the float checkpoint it was fine-tuned from, "
                             f"or continue its run with --compression {kind} --resume True")
    if kind != NONE and compression != kind:
        raise UserInputError(f"checkpoint {path} is {KINDS[kind]} (trained with compression {kind}); pass "
                             f"--compression {kind}")
    if kind == NONE and compression != NONE and not pre_trained and not (compression == PRUNE and pruned is None):
        raise UserInputError(f"checkpoint {path} is a float checkpoint ({MARKS[compression]}); drop "
                             f"--compression {compression}, or compress it first: train.py --compression "
                             f"{compression} --pre_trained {path}")
