"""Real handwritten digits as CIFAR-10 binary files: scikit-learn's copy of the UCI digits
(1,797 scans of 8x8 pixels, 17 gray levels), enlarged to 32x32 RGB. A small real dataset that a
package ships, for learning benchmarks (tools/benchmark_learning.py) that must not download anything.

    python -m src.data.digits_data data/digits      # 1,297 training and 500 held-out images
"""
import argparse
import sys
from typing import Optional, Sequence, Tuple

import cv2
import numpy as np

from src.data.sample_data import write_cifar10
from src.errors import UserInputError

DIGIT_NAMES = [str(digit) for digit in range(10)]
HELD_OUT = 500


def load_digits(size: int = 32) -> Tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as uint8 (N, size, size, 3) white-on-black images, and int64 labels."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise UserInputError("the digits dataset comes with scikit-learn; install it "
                             "(pip install -r requirements-dev.txt)") from None
    digits = sklearn_digits()
    gray = (digits.images * (255 / 16)).round().astype(np.uint8)
    enlarged = np.stack([cv2.resize(image, (size, size), interpolation=cv2.INTER_LINEAR) for image in gray])
    return np.repeat(enlarged[..., None], 3, axis=3), digits.target.astype(np.int64)


def split(images: np.ndarray, labels: np.ndarray, held_out: int = HELD_OUT, seed: int = 0):
    """A seeded split into (training, held-out) pairs of (images, labels)."""
    order = np.random.default_rng(seed).permutation(len(labels))
    test, train = order[:held_out], order[held_out:]
    return (images[train], labels[train]), (images[test], labels[test])


def write_digits(folder: str, *, size: int = 32, held_out: int = HELD_OUT, seed: int = 0) -> str:
    """Write the digits under `folder` as data_batch_1..5.bin, test_batch.bin and batches.meta.txt."""
    train, test = split(*load_digits(size), held_out=held_out, seed=seed)
    write_cifar10(folder, train, test, class_names=DIGIT_NAMES)
    return folder


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="output folder")
    parser.add_argument("--held_out", type=int, default=HELD_OUT, help="images kept for evaluation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {write_digits(args.folder, held_out=args.held_out, seed=args.seed)}")
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
