"""Find the first layer where a MindSpore network computes differently from a PyTorch one.

Each layer is judged on its own: the PyTorch network runs one training-mode forward and backward
on a batch, which records every module's input, output and the gradient arriving at its output;
then each module (copied, in float32 and in float64) and the MindSpore cell of the same name each
run on that very input and send that very gradient back. So a layer's difference is its own, not
the drift of the layers before it, and it is judged against its own rounding floor: how far the
float64 module is from the float32 one. A layer differs where MindSpore's output, its gradient
with respect to the input, the gradient of any of its weights (a kernel's, a bias's, BatchNorm's
scale and shift: checks named "grad <parameter>"), or (BatchNorm) its updated running statistics
are further from PyTorch's than `multiple` x that floor. Modules called more than once per forward (a shared ReLU)
and modules without a MindSpore cell of their name (torchvision's `avgpool`) are listed, not judged.
Runs in PYNATIVE mode (per-cell calls).
"""
import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

# One float32 rounding: a floor below it says only that both float32 results happened to agree.
FLOAT32_EPS = float(np.finfo(np.float32).eps)
TORCH_STATISTICS = ("running_mean", "running_var")
MS_STATISTICS = ("moving_mean", "moving_variance")


def relative_difference(reference: np.ndarray, other: np.ndarray) -> float:
    """||other - reference|| / ||reference|| in float64 (the absolute difference where the reference is 0)."""
    ref, oth = np.asarray(reference, np.float64).ravel(), np.asarray(other, np.float64).ravel()
    if ref.shape != oth.shape:
        return float("inf")
    norm = float(np.linalg.norm(ref))
    diff = float(np.linalg.norm(oth - ref))
    return diff / norm if norm > 0 else diff


def cosine(reference: np.ndarray, other: np.ndarray) -> float:
    ref, oth = np.asarray(reference, np.float64).ravel(), np.asarray(other, np.float64).ravel()
    if ref.shape != oth.shape:
        return float("nan")
    norms = float(np.linalg.norm(ref) * np.linalg.norm(oth))
    return float(np.dot(ref, oth) / norms) if norms > 0 else float(np.array_equal(ref, oth))


def judged(difference: float, floor: float, multiple: float) -> Dict[str, float]:
    """A difference, its float32 floor and their ratio; `within` when ratio <= multiple."""
    ratio = difference / max(floor, FLOAT32_EPS)
    return {"difference": difference, "floor": floor, "ratio": ratio, "within": bool(ratio <= multiple)}


@dataclass
class Captured:
    """One module's call in the recorded forward/backward."""
    name: str
    module: object
    inputs: np.ndarray
    output: np.ndarray
    output_grad: Optional[np.ndarray] = None
    calls: int = 1


@dataclass
class LayerRow:
    name: str
    kind: str
    shape: List[int]
    status: str  # "ok", "differs", "not compared: <why>"
    checks: Dict[str, Dict[str, float]] = field(default_factory=dict)

    @property
    def differs(self) -> bool:
        return self.status == "differs"

    def worst(self) -> str:
        if not self.checks:
            return ""
        name, check = max(self.checks.items(), key=lambda item: item[1]["ratio"])
        return f"{name} {check['difference']:.3e} = {check['ratio']:.3g} x its floor {check['floor']:.3e}"


def capture(model, images: np.ndarray, labels: np.ndarray, *, label_smoothing: float) -> List[Captured]:
    """Run `model` (a copy, in-place activations off) forward and backward in training mode on one
    batch; every module's input, output and output gradient, in the order the modules finished."""
    import torch  # noqa: PLC0415
    model = copy.deepcopy(model).float().train()
    for module in model.modules():
        if getattr(module, "inplace", False):
            module.inplace = False  # an in-place ReLU would overwrite the output we record
    # the recorded forward moves BatchNorm statistics: each layer is later rerun from its state before it
    pristine = dict(copy.deepcopy(model).named_modules())
    records: Dict[str, Captured] = {}
    order: List[str] = []

    def hook(module, args, output, name):
        if name in records:
            records[name].calls += 1
            return
        if not args or not torch.is_tensor(args[0]) or not torch.is_tensor(output):
            return
        record = Captured(name, pristine[name], args[0].detach().numpy().copy(), output.detach().numpy().copy())
        records[name] = record
        order.append(name)
        if output.requires_grad:
            output.register_hook(lambda grad: setattr(record, "output_grad", grad.detach().numpy().copy()))

    handles = [module.register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
               for name, module in model.named_modules() if name]
    try:
        targets = torch.from_numpy(labels)
        targets = targets.long() if targets.ndim == 1 else targets.float()
        logits = model(torch.from_numpy(images).float())
        torch.nn.functional.cross_entropy(logits, targets, label_smoothing=label_smoothing).backward()
    finally:
        for handle in handles:
            handle.remove()
    return [records[name] for name in order]


def torch_layer(module, inputs: np.ndarray, output_grad: np.ndarray, *, double: bool):
    """A copy of `module` run on `inputs`, `output_grad` sent back: (output, input gradient,
    statistics, the gradient of each of its parameters by its name within the module)."""
    import torch  # noqa: PLC0415
    module = copy.deepcopy(module).train()
    dtype = torch.float64 if double else torch.float32
    module = module.to(dtype)
    x = torch.from_numpy(inputs).to(dtype).requires_grad_(True)
    out = module(x)
    out.backward(torch.from_numpy(output_grad).to(dtype))
    statistics = {name: getattr(module, name).detach().double().numpy().copy()
                  for name in TORCH_STATISTICS if getattr(module, name, None) is not None}
    weight_grads = {name: param.grad.detach().double().numpy().copy()
                    for name, param in module.named_parameters() if param.grad is not None}
    return out.detach().double().numpy(), x.grad.detach().double().numpy(), statistics, weight_grads


def mindspore_layer(cell, inputs: np.ndarray, output_grad: np.ndarray):
    """`cell` run on `inputs` in training mode with `output_grad` sent back: (output, input
    gradient, statistics, the gradient of each trainable parameter by its torch name). Its
    parameters are restored afterwards (a BatchNorm's moving statistics move in training mode)."""
    import mindspore as ms  # noqa: PLC0415

    from src.migration.convert_torch import ms_to_torch_name  # noqa: PLC0415
    saved = {param.name: param.asnumpy().copy() for param in cell.get_parameters()}
    weights = cell.trainable_params()
    cell.set_train(True)
    try:
        out, backward = ms.vjp(cell, ms.Tensor(inputs), weights=weights)
        grad, param_grads = backward(ms.Tensor(output_grad.astype(np.float32)))
        grad = grad[0] if isinstance(grad, tuple) else grad
        statistics = {torch_name: getattr(cell, ms_name).asnumpy().astype(np.float64)
                      for torch_name, ms_name in zip(TORCH_STATISTICS, MS_STATISTICS) if hasattr(cell, ms_name)}
        weight_grads = {ms_to_torch_name(param.name): value.asnumpy().astype(np.float64)
                        for param, value in zip(weights, param_grads)}
    finally:
        for param in cell.get_parameters():
            param.set_data(ms.Tensor(saved[param.name]))
    return out.asnumpy().astype(np.float64), grad.asnumpy().astype(np.float64), statistics, weight_grads


def compare_layer(record: Captured, cell, multiple: float) -> LayerRow:
    kind = type(record.module).__name__
    row = LayerRow(record.name, kind, list(record.output.shape), "ok")
    if record.calls > 1:
        row.status = f"not compared: called {record.calls} times per forward"
        return row
    if cell is None:
        row.status = "not compared: no MindSpore cell of this name"
        return row
    if record.output_grad is None:
        row.status = "not compared: no gradient reaches it"
        return row
    out32, grad32, stats32, weights32 = torch_layer(record.module, record.inputs, record.output_grad, double=False)
    out64, grad64, stats64, weights64 = torch_layer(record.module, record.inputs, record.output_grad, double=True)
    try:
        out_ms, grad_ms, stats_ms, weights_ms = mindspore_layer(cell, record.inputs, record.output_grad)
    except (RuntimeError, TypeError, ValueError) as err:
        row.status = "differs"
        row.checks["runs"] = judged(float("inf"), 0.0, multiple)
        row.kind += f" (MindSpore cell failed on PyTorch's input: {str(err).splitlines()[0][:120]})"
        return row
    row.checks["output"] = judged(relative_difference(out32, out_ms), relative_difference(out32, out64), multiple)
    row.checks["input_grad"] = judged(relative_difference(grad32, grad_ms), relative_difference(grad32, grad64),
                                      multiple)
    for name, value in stats32.items():
        if name in stats_ms:
            row.checks[name] = judged(relative_difference(value, stats_ms[name]),
                                      relative_difference(value, stats64[name]), multiple)
        else:
            row.checks[name] = judged(float("inf"), 0.0, multiple)  # MindSpore's cell keeps no statistics
    for name, value in weights32.items():  # a missing or mis-shaped gradient is an infinite difference
        found = weights_ms.get(f"{record.name}.{name}")
        row.checks[f"grad {name}"] = judged(
            float("inf") if found is None else relative_difference(value, found),
            relative_difference(value, weights64[name]), multiple)
    if not all(check["within"] for check in row.checks.values()):
        row.status = "differs"
    return row


def find_first_difference(model, net, images: np.ndarray, labels: np.ndarray, *, label_smoothing: float,
                          multiple: float) -> List[LayerRow]:
    """Every module of `model` compared with the cell of the same name in `net` (which holds the
    same weights), in the order the forward finished them (inner layers before their block)."""
    cells = dict(net.cells_and_names())
    rows = []
    for record in capture(model, images, labels, label_smoothing=label_smoothing):
        rows.append(compare_layer(record, cells.get(record.name), multiple))
    return rows


def first_differing(rows: List[LayerRow]) -> Optional[LayerRow]:
    return next((row for row in rows if row.differs), None)
