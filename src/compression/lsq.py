"""LSQ's activation step sizes started from data (compression lsq).

Golden Stick's LSQ starts every activation quantizer's clipping point alpha (step size x quant_max)
at 6. The activations of a trained ResNet are far from [-6, 6] (a convolution's output, before its
BatchNorm, reaches a few hundred in the demo's ResNet18), and at a fine-tuning lr LSQ's gradient
moves alpha (which Golden Stick learns at the network's lr) by little: 2 epochs left every alpha
within 0.2 of 6, the activations clipped throughout (0.676 top-1 against the float network's
0.964). So before a fresh run trains, each activation quantizer's alpha is set from the first
training batch by the LSQ paper's rule, step = 2 mean(|x|) / sqrt(Qp), that is alpha = 2 mean(|x|)
sqrt(Qp) (docs/compression.md has the figures of the rules tried).

The batch runs as training runs it: BatchNorm normalizes with the batch's statistics (its moving
statistics are put back afterwards). Starting from what inference mode sees instead (max |x|)
left the quantizers clipping in training, and the network at 0.884. The quantizers are out of the
way meanwhile (float activations), so no start depends on another quantizer's.

Every rank reads rank 0's first batch of epoch 1, so every rank sets the same alphas with no
communication; a resumed run loads the checkpoint's alphas and starts nothing. This module imports
no Golden Stick: it works on the cells apply_qat built.
"""
import math
from typing import Dict, Iterable, List, Tuple

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

# The activation quantizers of a Golden Stick quantization cell (its weights' is _weight_quantizer).
ACTIVATION_QUANTIZERS = ("_input_quantizer", "_output_quantizer")


class MeanMagnitude(nn.Cell):
    """Stands in for an activation quantizer's fake quantizer while the steps start: x passes
    unchanged, and the batch's mean |x| is added to `total`."""

    def __init__(self, name: str):
        super().__init__()
        # Named after the quantizer: parameter names must be unique in a graph.
        self.total = Parameter(Tensor(np.zeros(1, np.float32)), name=f"{name}.mean_abs", requires_grad=False)

    def construct(self, x, alpha, quant_max):
        added = ops.assign_add(self.total, ops.reshape(ops.reduce_mean(ops.abs(x)), (1,)))
        return ops.depend(x, added)


def lsq_alpha(mean_abs: float, quant_max: float) -> float:
    """The LSQ paper's starting step 2 mean(|x|) / sqrt(Qp), as alpha (step x Qp)."""
    return 2.0 * mean_abs * math.sqrt(quant_max)


def activation_quantizers(net: nn.Cell) -> List[Tuple[str, nn.Cell]]:
    """The LSQ input and output quantizers of `net`'s quantization cells, by name."""
    return [(name, cell) for name, cell in net.cells_and_names()
            if name.rsplit(".", 1)[-1] in ACTIVATION_QUANTIZERS and hasattr(cell, "quant_max")]


def _moving_statistics(net: nn.Cell) -> List[Parameter]:
    return [stat for _, cell in net.cells_and_names() if isinstance(cell, nn.BatchNorm2d)
            for stat in (cell.moving_mean, cell.moving_variance)]


def start_activation_steps(net: nn.Cell, batches: Iterable[np.ndarray]) -> Dict[str, float]:
    """Set every activation quantizer's alpha in `net` from its float activations on `batches`
    (NCHW float32 images, as the train step gets them), run in training mode; returns the alphas by
    quantizer name. The network gets its fake quantizers, its BatchNorm moving statistics and its
    mode back."""
    quantizers = activation_quantizers(net)
    saved = [(cell.fake_quant_train, cell.fake_quant_infer) for _, cell in quantizers]
    meters = [MeanMagnitude(f"lsq_start.{name}") for name, _ in quantizers]
    statistics = _moving_statistics(net)
    kept = [Tensor(stat.asnumpy().copy()) for stat in statistics]
    was_training, count = net.training, 0
    try:
        for (_, cell), meter in zip(quantizers, meters):
            cell.fake_quant_train = cell.fake_quant_infer = meter
        net.set_train(True)
        for images in batches:
            net(Tensor(images))
            count += 1
    finally:
        for (_, cell), (train, infer) in zip(quantizers, saved):
            cell.fake_quant_train, cell.fake_quant_infer = train, infer
        for stat, value in zip(statistics, kept):
            stat.set_data(value)
        net.set_train(was_training)
    return {name: _set_alpha(cell, float(meter.total.asnumpy()[0]) / max(count, 1))
            for (name, cell), meter in zip(quantizers, meters)}


def _set_alpha(quantizer: nn.Cell, mean_abs: float) -> float:
    """Give `quantizer` the alpha of `mean_abs`, as -alpha..alpha (export reads _float_min beside
    the _float_max LSQ learns). A quantizer that saw only zeros keeps its alpha."""
    alpha = lsq_alpha(mean_abs, float(quantizer.quant_max.asnumpy()[0]))
    if alpha > 0:
        quantizer._float_max.set_data(Tensor(np.array([alpha], np.float32)))  # noqa: SLF001
        quantizer._float_min.set_data(Tensor(np.array([-alpha], np.float32)))  # noqa: SLF001
    return float(quantizer._float_max.asnumpy()[0])  # noqa: SLF001
