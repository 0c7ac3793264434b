"""One training step of the demo's network taken apart layer by layer, to compare two machines'
MindSpore CPU kernels (x86_64 against aarch64: docs/aarch64.md).

    python tools/layer_tape.py capture TAPE.npz --data_path DATA/cifar10    # on each machine
    python tools/layer_tape.py replay TAPE.npz OUT.npz                       # each layer alone on TAPE's inputs
    python tools/layer_tape.py compare A.npz B.npz                            # anywhere: where they part

capture: the demo's first state (config/sample_resnet18.yaml, its seed, MindSpore's layers) and its
first training batch, as train.py builds them; the forward layer by layer (convolutions, BatchNorms
in training mode, ReLUs, residual additions, the stem's pool, the head with the loss), then the
backward layer by layer in reverse, each layer's own gradient fed the one the later layers produced.
Every layer's inputs, output, incoming gradient and input/parameter gradients are saved.
replay: each layer's forward and backward alone, on the tape's inputs and incoming gradient: two
machines' kernels on the same numbers. compare: per layer, the relative L2 difference of each saved
tensor (the first beyond --threshold in backward order is where the two part), and for every ReLU
the elements whose input has opposite signs on the two (a mask flip: a gradient passes on one machine
and not on the other), with the input's float value on each side.
"""
import argparse
import os
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (layer name, cell, names of its inputs, name of its output): the network's forward, in order.
Program = List[Tuple[str, object, List[str], str]]


def block_program(prefix: str, block, x: str) -> Program:
    """A BasicBlock's or Bottleneck's layers as its construct runs them (float32, MindSpore's cells)."""
    from mindspore import nn

    class Add(nn.Cell):
        def construct(self, a, b):
            return a + b

    convs = [name for name in ("conv1", "conv2", "conv3") if hasattr(block, name)]
    program, value = [], x
    for index, conv in enumerate(convs, start=1):
        norm = f"bn{index}"
        program += [(f"{prefix}.{conv}", getattr(block, conv), [value], f"{prefix}.{conv}.out"),
                    (f"{prefix}.{norm}", getattr(block, norm), [f"{prefix}.{conv}.out"], f"{prefix}.{norm}.out")]
        value = f"{prefix}.{norm}.out"
        if index < len(convs):
            program.append((f"{prefix}.relu{index}", block.relu, [value], f"{prefix}.relu{index}.out"))
            value = f"{prefix}.relu{index}.out"
    identity = x
    if block.downsample is not None:
        program += [(f"{prefix}.downsample.0", block.downsample[0], [x], f"{prefix}.downsample.0.out"),
                    (f"{prefix}.downsample.1", block.downsample[1], [f"{prefix}.downsample.0.out"],
                     f"{prefix}.downsample.1.out")]
        identity = f"{prefix}.downsample.1.out"
    program += [(f"{prefix}.add", Add(), [value, identity], f"{prefix}.sum"),
                (f"{prefix}.relu", block.relu, [f"{prefix}.sum"], f"{prefix}.out")]
    return program


def network_program(net, loss) -> Program:
    """The whole forward of a ResNet (stem, the four stages, the head and its loss) as layers."""
    from mindspore import nn

    class Head(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mean, self.fc, self.loss = net.mean, net.fc, loss

        def construct(self, features, labels):
            return self.loss(self.fc(self.mean(features, (2, 3))), labels)

    program = [("conv1", net.conv1, ["images"], "conv1.out"), ("bn1", net.bn1, ["conv1.out"], "bn1.out"),
               ("relu", net.relu, ["bn1.out"], "relu.out"), ("maxpool", net.maxpool, ["relu.out"], "stem.out")]
    value = "stem.out"
    for stage in range(1, 5):
        for index, block in enumerate(getattr(net, f"layer{stage}")):
            program += block_program(f"layer{stage}.{index}", block, value)
            value = f"layer{stage}.{index}.out"
    return program + [("head", Head(), [value, "labels"], "loss")]


def layer_gradients(cell, inputs: Sequence, incoming) -> Tuple[List[np.ndarray], Dict[str, np.ndarray]]:
    """The gradients of one layer's inputs and parameters, given the gradient of its output."""
    from mindspore import ParameterTuple, ops
    params = cell.trainable_params()
    if params:
        grads, param_grads = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(
            cell, ParameterTuple(params))(*inputs, incoming)
    else:
        grads, param_grads = ops.GradOperation(get_all=True, sens_param=True)(cell)(*inputs, incoming), ()
    return [g.asnumpy() for g in grads], {p.name: g.asnumpy() for p, g in zip(params, param_grads)}


def demo_network(data_path: str, state: Dict[str, np.ndarray] = None):
    """The demo's network in its first state (or `state`), its loss and its first batch (the batch
    only when there is no state: a replay reads the tape's)."""
    import mindspore as ms

    from src.config import load_config
    from src.dataset import host_batches
    from src.runtime import set_up_runtime
    from src.training.factory import create_network, seed_everything
    from src.training.loss import loss_from_config
    cfg = load_config(["--config_path", os.path.join(REPO, "config", "sample_resnet18.yaml"),
                       "--data_path", data_path or "unused"], prog="layer_tape.py")
    set_up_runtime("CPU", cpu_convolution="mindspore", mode_name="PYNATIVE")
    seed_everything(cfg.seed)
    net = create_network(cfg, log=lambda line: None)
    if state is not None:
        ms.load_param_into_net(net, {name[len("param:"):]: ms.Parameter(ms.Tensor(value), name=name[len("param:"):])
                                     for name, value in state.items() if name.startswith("param:")})
    net.set_train(True)
    batch = host_batches(cfg, 0, 1, first=0, count=1)[0] if state is None else None
    return net, loss_from_config(cfg), batch


def capture(path: str, data_path: str) -> None:
    """Write the tape of the demo's first step on this machine."""
    from mindspore import Tensor
    net, loss, (images, labels) = demo_network(data_path)
    tape = {f"param:{p.name}": p.asnumpy() for p in net.get_parameters()}
    values = {"images": images.astype(np.float32), "labels": labels}
    program = network_program(net, loss)
    for name, cell, inputs, output in program:
        values[output] = cell(*[Tensor(values[i]) for i in inputs]).asnumpy()
        tape.update({f"{name}|in{j}": values[i] for j, i in enumerate(inputs)})
        tape[f"{name}|out"] = values[output]
    gradients = {"loss": np.ones((), np.float32)}
    for name, cell, inputs, output in reversed(program):
        tape[f"{name}|dy"] = gradients[output]
        grads, param_grads = layer_gradients(cell, [Tensor(values[i]) for i in inputs], Tensor(gradients[output]))
        for j, (value, grad) in enumerate(zip(inputs, grads)):
            tape[f"{name}|dx{j}"] = grad
            gradients[value] = gradients[value] + grad if value in gradients else grad
        tape.update({f"{name}|dp:{param}": grad for param, grad in param_grads.items()})
    tape["order"] = np.array([name for name, *_ in program])
    np.savez(path, **tape)
    print(f"captured {len(program)} layers, loss {float(values['loss']):.9g}: {path}")


def replay(tape_path: str, path: str) -> None:
    """Each layer of a tape alone, on its inputs and incoming gradient, here."""
    from mindspore import Tensor
    tape = dict(np.load(tape_path))
    net, loss, _ = demo_network("", state=tape)
    out = {}
    for name, cell, inputs, _ in network_program(net, loss):
        given = [Tensor(tape[f"{name}|in{j}"]) for j in range(len(inputs))]
        out[f"{name}|out"] = cell(*given).asnumpy()
        grads, param_grads = layer_gradients(cell, given, Tensor(tape[f"{name}|dy"]))
        out.update({f"{name}|dx{j}": grad for j, grad in enumerate(grads)})
        out.update({f"{name}|dp:{param}": grad for param, grad in param_grads.items()})
    out["order"] = tape["order"]
    np.savez(path, **out)
    print(f"replayed {len(tape['order'])} layers alone: {path}")


class LayerDifference(NamedTuple):
    """How one layer's saved tensors differ between two tapes."""
    layer: str
    differences: Dict[str, float]   # saved tensor ("out", "dx0", "dp:NAME", ...) -> relative L2 difference
    flips: List[Tuple[Tuple[int, ...], float, float]]   # a ReLU's input of opposite signs: index, value on each
    rest: Optional[float]           # with flips: the input gradient's difference everywhere else


def compare_tapes(first: Dict[str, np.ndarray], second: Dict[str, np.ndarray]) -> List[LayerDifference]:
    """Layer by layer in backward order (where a difference travels), `second` against `first`."""
    from src.migration.layer_diff import relative_difference
    rows = []
    for name in reversed(list(first["order"])):
        keys = sorted(k for k in first if k.startswith(f"{name}|") and k in second)
        differences = {k.split("|", 1)[1]: relative_difference(first[k], second[k]) for k in keys}
        flips, rest = [], None
        if name.split(".")[-1].startswith("relu") and f"{name}|in0" in second:
            x, y = first[f"{name}|in0"], second[f"{name}|in0"]
            differ = (x > 0) != (y > 0)
            flips = [(tuple(int(i) for i in index), float(x[tuple(index)]), float(y[tuple(index)]))
                     for index in np.argwhere(differ)]
            if flips and f"{name}|dx0" in second:
                rest = relative_difference(np.where(differ, 0, first[f"{name}|dx0"]),
                                           np.where(differ, 0, second[f"{name}|dx0"]))
        rows.append(LayerDifference(name, differences, flips, rest))
    return rows


def compare(first: str, second: str, threshold: float) -> int:
    """Print compare_tapes' rows and where the two first part."""
    rows = compare_tapes(dict(np.load(first)), dict(np.load(second)))
    for row in rows:
        flips = ""
        if row.flips:
            flips = f"  mask flips {len(row.flips)}" + "".join(
                f" at {index}: {x:.3g} vs {y:.3g}" for index, x, y in row.flips[:3]) + (
                f"; dx0 elsewhere {row.rest:.1e}" if row.rest is not None else "")
        print(f"{row.layer:24s} " + " ".join(f"{k} {v:.1e}" for k, v in row.differences.items()) + flips)
    worst = max(max(row.differences.values(), default=0.0) for row in rows)
    parted = next((row.layer for row in rows if max(row.differences.values(), default=0.0) > threshold), None)
    print(f"largest relative L2 difference {worst:.2e}; "
          + (f"first beyond {threshold:g} (backward order): {parted}" if parted else f"every one within {threshold:g}"))
    return 0


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    take = commands.add_parser("capture", help="the demo's first step, layer by layer")
    take.add_argument("tape")
    take.add_argument("--data_path", required=True, help="the demo's CIFAR-10 folder (data/sample*/cifar10)")
    again = commands.add_parser("replay", help="each layer alone on a tape's inputs")
    again.add_argument("tape")
    again.add_argument("out")
    both = commands.add_parser("compare", help="two tapes, or a tape and a replay, layer by layer")
    both.add_argument("first")
    both.add_argument("second")
    both.add_argument("--threshold", type=float, default=1e-5)
    args = parser.parse_args(argv)
    if REPO not in sys.path:  # run as a script: the repository's src/ beside it
        sys.path.insert(0, REPO)
    if args.command == "capture":
        capture(args.tape, args.data_path)
    elif args.command == "replay":
        replay(args.tape, args.out)
    else:
        return compare(args.first, args.second, args.threshold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
