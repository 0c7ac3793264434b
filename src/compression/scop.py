"""SCOP's channel scores from Golden Stick's knockoff cells (compression prune, prune_criterion scop).

SCOP (Tang et al. 2020, Golden Stick's `PrunerKfCompressAlgo` + `PrunerFtCompressAlgo`) learns, for
every output channel of a block's convolution, how much the network needs the real features over
"knockoff" ones: `PrunerKfCompressAlgo.apply` wraps each conv+BatchNorm pair of the residual stages
in a `KfConv2d`, which mixes the two halves of a doubled batch (real images, then knockoffs) as
kfscale * real + (1 - kfscale) * knockoff, and leaves kfscale (0.5 at the start) the only trainable
parameter. After that knockoff stage `PrunerFtCompressAlgo` scores each channel |gamma| * (2 kfscale
- 1) and prunes the lowest.

Here Golden Stick's cells and training set-up run as they are; two parts of its pipeline do not run
on CPU and are done here instead (docs/compression.md): its callback draws each step's knockoffs
with `ops.Randperm` (no CPU kernel in MindSpore 2.10), so `knockoff_batch` permutes the batch on the
host, the permutation a function of (seed, step) as every random choice of a run; and its cells
that cut the channels out fail on CPU (`Clone`), so the scores choose the channels that
src/compression/prune.py removes (the inner channels of each block, in multiples of 16).
"""
from typing import Callable, Dict, Iterable, Optional, Tuple

import numpy as np
from mindspore import Tensor, nn

from src.compression.qat import golden_stick

KNOCKOFF_STREAM = 0x5C0B  # the knockoff permutations' own random stream, apart from the data's


def knockoff_batch(images: np.ndarray, labels: np.ndarray, *, seed: int, step: int) -> Tuple[np.ndarray, np.ndarray]:
    """The batch followed by its knockoffs: the same images and labels in an order drawn from (seed,
    step), as Golden Stick's callback doubles each batch with a random permutation of itself."""
    order = np.random.default_rng([seed, KNOCKOFF_STREAM, step]).permutation(len(images))
    return np.concatenate([images, images[order]]), np.concatenate([labels, labels[order]])


def knockoff_scores(net: nn.Cell, batches: Iterable[Tuple[np.ndarray, np.ndarray]], lrs: np.ndarray, *,
                    seed: int, loss_fn: nn.Cell, momentum: float = 0.9,
                    on_step: Optional[Callable[[int, int, Tensor, float], None]] = None) -> Dict[str, np.ndarray]:
    """Train `net`'s knockoff scales (Golden Stick's KfConv2d cells, put in place of its conv+BN
    pairs: `net` is consumed) on `batches` against `loss_fn` (logits, labels or soft targets), one
    step per lr of `lrs` (Momentum, no weight decay, as Golden Stick's ResNet example), and return
    SCOP's score of every wrapped convolution's output channels, |gamma| * (2 kfscale - 1), by the
    convolution's cell name (`layer1.0.conv1`). `on_step(step, images, loss, lr)` follows each step
    (from 1; images with their knockoffs). Golden Stick's example takes MindSpore's
    SoftmaxCrossEntropyWithLogits, whose CPU kernel gives inf where a label's logit is ~87 below the
    largest (its exp underflows); the caller's log-softmax loss gives the true value."""
    golden_stick("prune_criterion scop")
    from mindspore_gs.pruner.scop.scop_pruner import KfConv2d, PrunerKfCompressAlgo

    knockoff = PrunerKfCompressAlgo({}).apply(net)
    optimizer = nn.Momentum(knockoff.trainable_params(), learning_rate=Tensor(np.asarray(lrs, np.float32)),
                            momentum=momentum)
    train_step = nn.TrainOneStepCell(nn.WithLossCell(knockoff, loss_fn), optimizer)
    train_step.set_train(True)
    for step, (images, labels) in enumerate(batches):
        if step == len(lrs):
            break
        doubled, doubled_labels = knockoff_batch(images, labels, seed=seed, step=step)
        value = train_step(Tensor(doubled), Tensor(doubled_labels if labels.ndim > 1
                                                   else doubled_labels.astype(np.int32)))
        if on_step:
            on_step(step + 1, len(doubled), value, float(lrs[step]))
    return {name: np.abs(cell.bn.gamma.asnumpy()) * (2.0 * cell.kfscale.asnumpy().reshape(-1) - 1.0)
            for name, cell in knockoff.cells_and_names() if isinstance(cell, KfConv2d)}
