"""Where a training step first goes non-finite: replay it cell by cell and name the first layer
whose output, or the first parameter whose gradient, holds a NaN or Inf.

The replay runs in PYNATIVE mode (forward hooks see every cell's output) on a network holding the
step's weights; BatchNorm statistics are put back afterwards, so the replay changes nothing.
"""
import json
import os
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from src.files import write_atomic


@dataclass
class NonFinite:
    """What a replayed step found (None fields: nothing non-finite there)."""
    loss: float
    first_layer: Optional[str]          # the first cell (in the order cells finish) with a NaN/Inf output
    first_layer_input_finite: bool      # True when that cell's input was finite: the cell made it
    first_gradient: Optional[str]       # the parameter nearest the loss whose gradient is NaN/Inf
    non_finite_gradients: int
    non_finite_weights: List[str]       # trainable weights holding NaN/Inf before the step
    non_finite_statistics: List[str]    # BatchNorm statistics (the failed step's forward moved them)

    @property
    def finite(self) -> bool:
        return not (self.first_layer or self.first_gradient or self.non_finite_weights)

    def describe(self) -> str:
        if self.non_finite_weights:
            return (f"{len(self.non_finite_weights)} weight(s) already hold NaN/Inf before the step (first "
                    f"{self.non_finite_weights[0]})")
        if self.first_layer:
            made = "from a finite input" if self.first_layer_input_finite else "(its input already was)"
            return f"first non-finite output: {self.first_layer} {made}"
        if self.first_gradient:
            return (f"the forward pass is finite (loss {self.loss:.6g}); first non-finite gradient (from the "
                    f"loss backwards): {self.first_gradient}, {self.non_finite_gradients} gradient(s) in all")
        return f"the replayed step is finite (loss {self.loss:.6g})"

    def write(self, path: str) -> None:
        write_atomic(path, json.dumps(json_safe(asdict(self)), indent=1, allow_nan=False) + "\n")


def json_safe(value):
    """NaN and Inf (not JSON) as null, inside dicts and lists."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def _all_finite(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_all_finite(item) for item in value)
    return not isinstance(value, ms.Tensor) or bool(np.isfinite(value.asnumpy()).all())


def replay_step(net: nn.Cell, loss_fn: Callable, images: np.ndarray, labels: np.ndarray,
                loss_scale: float = 1.0) -> NonFinite:
    """One forward (hooks on every cell) and backward of `loss_fn(net(images), labels) * loss_scale`
    (as the training step scales it) in PYNATIVE mode on `net`'s current weights, with nothing
    changed afterwards."""
    previous_mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    params = list(net.get_parameters())
    saved = [param.asnumpy().copy() for param in params]
    bad = [param for param, value in zip(params, saved) if not np.isfinite(value).all()]
    found: List = []

    def hook(cell_name, _cell, inputs, output):
        if not found and not _all_finite(output):
            found.append((cell_name, _all_finite(inputs)))

    handles = [cell.register_forward_hook(lambda c, i, o, name=name: hook(name, c, i, o))
               for name, cell in net.cells_and_names() if name]
    weights = [param for param in params if param.requires_grad]
    try:
        net.set_train(True)
        inputs, targets = ms.Tensor(images), ms.Tensor(labels)

        def forward(x, y):
            return loss_fn(ops.cast(net(x), ms.float32), y) * loss_scale

        loss, grads = ms.value_and_grad(forward, None, weights)(inputs, targets)
        loss = loss / loss_scale
    finally:
        for handle in handles:
            handle.remove()
        for param, value in zip(params, saved):
            param.set_data(ms.Tensor(value))
        ms.set_context(mode=previous_mode)
    bad_grads = [param.name for param, grad in zip(weights, grads) if not np.isfinite(grad.asnumpy()).all()]
    return NonFinite(loss=float(loss.asnumpy()), first_layer=found[0][0] if found else None,
                     first_layer_input_finite=bool(found[0][1]) if found else True,
                     first_gradient=bad_grads[-1] if bad_grads else None, non_finite_gradients=len(bad_grads),
                     non_finite_weights=[param.name for param in bad if param.requires_grad],
                     non_finite_statistics=[param.name for param in bad if not param.requires_grad])


def replay_micro_batches(net: nn.Cell, loss_fn: Callable, images: np.ndarray, labels: np.ndarray, *,
                         parts: int = 1, loss_scale: float = 1.0) -> Tuple[NonFinite, str]:
    """A step's batch replayed micro-batch by micro-batch, as the step splits it, until one is not
    finite: that one's result (else the last's), and which micro-batch it was ('' for one)."""
    for part, (image_part, label_part) in enumerate(zip(np.split(images, parts), np.split(labels, parts)), 1):
        result = replay_step(net, loss_fn, image_part, label_part, loss_scale)
        if not result.finite or part == parts:
            return result, (f"micro-batch {part} of {parts}" if parts > 1 else "")
    raise ValueError("parts must be >= 1")


def write_replay(result: NonFinite, folder: str, name: str = "nonfinite.json") -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    result.write(path)
    return path
