"""A small, learnable 10-class image dataset, written as real CIFAR-10 binary files and as an
ImageNet-style tree of JPEG class folders. Deterministic for a seed.

Each class is a shape (stripes, checkerboard, disc, ring, square, cross, triangle, ...) drawn in
a colour near the class's own hue, at a random place and size, over a noisy background.

    python -m src.data.sample_data data/sample            # both formats, default sizes
"""
import argparse
import colorsys
import os
import sys
from typing import List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

CLASS_NAMES = ["hstripes", "vstripes", "dstripes", "checker", "disc",
               "ring", "square", "cross", "triangle", "diamond"]
CIFAR_RECORD_BYTES = 1 + 32 * 32 * 3
CIFAR_TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
CIFAR_TEST_FILE = "test_batch.bin"


def _shape_mask(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """A boolean HxW mask of the class's shape, randomly placed and scaled."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    cy, cx = rng.uniform(0.35, 0.65, 2)
    radius = rng.uniform(0.22, 0.34)
    period = rng.uniform(0.16, 0.26)
    phase = rng.uniform(0, 1)
    dy, dx = y - cy, x - cx
    inside = (np.abs(dy) < radius) & (np.abs(dx) < radius)
    if label == 0:
        return ((y / period + phase) % 1.0) < 0.5
    if label == 1:
        return ((x / period + phase) % 1.0) < 0.5
    if label == 2:
        return (((x + y) / period + phase) % 1.0) < 0.5
    if label == 3:
        return ((np.floor(x / period + phase) + np.floor(y / period + phase)) % 2) == 0
    if label == 4:
        return dy ** 2 + dx ** 2 < radius ** 2
    if label == 5:
        dist = np.sqrt(dy ** 2 + dx ** 2)
        return (dist < radius) & (dist > radius * 0.55)
    if label == 6:
        return inside
    if label == 7:
        return inside & ((np.abs(dy) < radius * 0.3) | (np.abs(dx) < radius * 0.3))
    if label == 8:
        return inside & (dy > -radius) & (np.abs(dx) < (dy + radius) * 0.5)
    return np.abs(dy) + np.abs(dx) < radius


def _hue_rgb(hue: float, saturation: float, value: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(hue % 1.0, saturation, value), dtype=np.float32)


def render_image(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One HxWx3 uint8 image of class `label`."""
    background = _hue_rgb(rng.uniform(0, 1), rng.uniform(0.0, 0.4), rng.uniform(0.2, 0.6))
    gradient = np.linspace(-0.15, 0.15, size, dtype=np.float32)[None, :, None] * rng.choice([-1, 1])
    image = np.broadcast_to(background, (size, size, 3)) + gradient
    colour = _hue_rgb(label / 10.0 + rng.uniform(-0.06, 0.06), rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0))
    image = np.where(_shape_mask(label, size, rng)[:, :, None], colour, image)
    image = image + rng.normal(0.0, 0.06, image.shape)
    return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)


def make_split(per_class: int, size: int, seed: int, total: Optional[int] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
    """Images (N,H,W,3 uint8) and labels (N,) for a balanced split, classes interleaved.

    `total` trims the split to an exact size (e.g. an odd count for eval tests)."""
    rng = np.random.default_rng(seed)
    count = per_class * len(CLASS_NAMES) if total is None else total
    labels = np.arange(count, dtype=np.int64) % len(CLASS_NAMES)
    images = np.stack([render_image(int(label), size, rng) for label in labels])
    return images, labels


def write_cifar_binary(path: str, images: np.ndarray, labels: np.ndarray) -> None:
    """Records of 1 label byte + 3072 bytes of CHW pixels, as in cifar-10-batches-bin."""
    chw = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    records = np.concatenate([labels.astype(np.uint8)[:, None], chw], axis=1)
    tmp = path + ".tmp"
    records.tofile(tmp)
    os.replace(tmp, path)


def write_cifar10(folder: str, train: Tuple[np.ndarray, np.ndarray],
                  test: Tuple[np.ndarray, np.ndarray], class_names: Sequence[str] = CLASS_NAMES) -> None:
    """Write data_batch_1..5.bin (train split in five parts), test_batch.bin and batches.meta.txt."""
    os.makedirs(folder, exist_ok=True)
    parts = np.array_split(np.arange(len(train[1])), len(CIFAR_TRAIN_FILES))
    for name, part in zip(CIFAR_TRAIN_FILES, parts):
        write_cifar_binary(os.path.join(folder, name), train[0][part], train[1][part])
    write_cifar_binary(os.path.join(folder, CIFAR_TEST_FILE), *test)
    with open(os.path.join(folder, "batches.meta.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(class_names) + "\n")


def write_image_folder(folder: str, images: np.ndarray, labels: np.ndarray) -> None:
    """One sub-folder per class name holding JPEG files."""
    for name in CLASS_NAMES:
        os.makedirs(os.path.join(folder, name), exist_ok=True)
    for index, (image, label) in enumerate(zip(images, labels)):
        path = os.path.join(folder, CLASS_NAMES[int(label)], f"{index:05d}.jpg")
        Image.fromarray(image).save(path, quality=95)


def write_sample_data(root: str, *, train_per_class: int = 300, test_per_class: int = 50,
                      test_total: Optional[int] = None, seed: int = 0,
                      formats: Sequence[str] = ("cifar10", "imagenet"),
                      cifar_size: int = 32, folder_size: int = 64) -> List[str]:
    """Write the sample dataset under root/cifar10 and/or root/imagenet/{train,val}.

    Returns the folders written."""
    written = []
    if "cifar10" in formats:
        folder = os.path.join(root, "cifar10")
        write_cifar10(folder, make_split(train_per_class, cifar_size, seed),
                      make_split(test_per_class, cifar_size, seed + 1, test_total))
        written.append(folder)
    if "imagenet" in formats:
        folder = os.path.join(root, "imagenet")
        write_image_folder(os.path.join(folder, "train"), *make_split(train_per_class, folder_size, seed))
        write_image_folder(os.path.join(folder, "val"),
                           *make_split(test_per_class, folder_size, seed + 1, test_total))
        written.append(folder)
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="output folder")
    parser.add_argument("--train_per_class", type=int, default=300)
    parser.add_argument("--test_per_class", type=int, default=50)
    parser.add_argument("--test_total", type=int, default=None, help="exact test-split size (overrides per class)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default="cifar10,imagenet", help="comma list: cifar10,imagenet")
    args = parser.parse_args(argv)
    for folder in write_sample_data(args.root, train_per_class=args.train_per_class,
                                    test_per_class=args.test_per_class, test_total=args.test_total,
                                    seed=args.seed, formats=args.formats.split(",")):
        print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
