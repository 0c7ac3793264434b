"""Compressing a trained network: quantization-aware training (QAT) with MindSpore Golden Stick.

`compression: qat` (train.py, eval.py, export.py) wraps every convolution and the fc head in Golden
Stick's SimQAT quantization cells (src/compression/qat.py). The checks here are plain functions of
names and config values: they import neither MindSpore nor Golden Stick, so only a run that asks for
compression pays for Golden Stick's import.
"""
from typing import Iterable, List, Optional, Tuple

from src.errors import UserInputError

NONE, QAT = "none", "qat"
COMPRESSIONS = (NONE, QAT)
# Golden Stick's fake quantizers keep their ranges as <cell>._{input,output,weight}_quantizer._float_min/max.
QUANTIZER_MARK = "_quantizer._float_"
INSTALL_HINT = "install it with: .venv/bin/python -m pip install mindspore-gs==1.3.0 tqdm"


def check_compression(compression: str, *, optimizer: str = "Momentum", freeze_backbone: bool = False,
                      pre_trained: Optional[str] = None) -> None:
    """One line for a compression request that cannot work (pre_trained None: not a training run)."""
    if compression not in COMPRESSIONS:
        raise UserInputError(f"unknown compression '{compression}'; choose one of {', '.join(COMPRESSIONS)}")
    if compression == NONE:
        return
    if optimizer == "Thor":
        raise UserInputError("compression qat does not combine with optimizer Thor (Thor replaces the convolution "
                             "cells that quantization wraps); use --optimizer Momentum")
    if freeze_backbone:
        raise UserInputError("compression qat fine-tunes the whole quantized network; drop --freeze_backbone True")
    if pre_trained == "":
        raise UserInputError("compression qat fine-tunes a trained float network; pass --pre_trained CKPT "
                             "(a checkpoint of this net_name trained without compression)")


def compression_convolutions(compression: str, cpu_convolution: str, device_target: str) -> Tuple[str, Optional[str]]:
    """The cpu_convolution a run uses, and a line for the log when compression overrides it: Golden
    Stick wraps MindSpore's nn.Conv2d cells, so this repository's oneDNN layers cannot run under QAT."""
    if compression == NONE or device_target != "CPU" or cpu_convolution == "mindspore":
        return cpu_convolution, None
    return "mindspore", ("compression qat: MindSpore's CPU convolutions (Golden Stick quantizes nn.Conv2d cells; "
                         "this repository's oneDNN layers are not used)")


def quantizer_names(names: Iterable[str]) -> List[str]:
    """The names of a checkpoint that only a quantization-aware network has (fake-quantizer ranges)."""
    return [name for name in names if QUANTIZER_MARK in name]


def check_checkpoint_compression(names: Iterable[str], path: str, compression: str, *,
                                 pre_trained: bool = False) -> None:
    """A checkpoint whose kind (float or QAT) does not fit the run is one line naming the fix.
    `pre_trained`: the weights a QAT run starts from, which must be float."""
    quantized = bool(quantizer_names(names))
    if quantized and pre_trained:
        raise UserInputError(f"checkpoint {path} is already quantization-aware (compression qat) and "
                             f"--pre_trained takes float weights; pass the float checkpoint it was fine-tuned from, "
                             f"or continue its run with --compression qat --resume True")
    if quantized and compression == NONE:
        raise UserInputError(f"checkpoint {path} is quantization-aware (trained with compression qat); pass "
                             f"--compression qat")
    if not quantized and compression == QAT and not pre_trained:
        raise UserInputError(f"checkpoint {path} is a float checkpoint (no fake-quantizer ranges); drop "
                             f"--compression qat, or fine-tune it first: train.py --compression qat --pre_trained "
                             f"{path}")
