"""Per-sample transforms to a uint8 HWC image of the network's size: CIFAR's pad-crop-flip,
the class folders' random resized crop and flip, evaluation's resize and center crop."""
import math
import threading
from typing import Callable, Optional, Tuple

import cv2
import mindspore.dataset.vision as vision
import numpy as np
from PIL import Image

from src.data.auto_augment import interpolation_mode
from src.data.image_decode import crop_resize

EVAL_CROP_RATIO = 0.875  # resize to 256 then center-crop 224
PIL_INTERPOLATIONS = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}


def random_crop_flip(image: np.ndarray, rng: np.random.Generator, padding: int = 4) -> np.ndarray:
    """CIFAR augmentation: zero-pad, crop back to the original size at random, flip half the time
    (a view of a per-thread padded buffer: copy it before the next call)."""
    height, width = image.shape[:2]
    padded = _padded_buffer(height + 2 * padding, width + 2 * padding, image.shape[2])
    padded[padding:padding + height, padding:padding + width] = image  # the border stays zero
    top, left = rng.integers(0, 2 * padding + 1, size=2)
    out = padded[top:top + height, left:left + width]
    return out[:, ::-1] if rng.random() < 0.5 else out


class _PaddedBuffers(threading.local):
    def __init__(self):
        self.by_shape = {}


_padded = _PaddedBuffers()


def _padded_buffer(height: int, width: int, channels: int) -> np.ndarray:
    """A zeroed buffer per thread and shape, reused (np.pad allocates and fills one per call)."""
    shape = (height, width, channels)
    if shape not in _padded.by_shape:
        _padded.by_shape[shape] = np.zeros(shape, np.uint8)
    return _padded.by_shape[shape]


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale: Tuple[float, float] = (0.08, 1.0),
                            ratio: Tuple[float, float] = (3 / 4, 4 / 3)) -> Tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (left, top, width, height), falling back to a center crop."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        crop_w = int(round(math.sqrt(target_area * aspect)))
        crop_h = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            left = int(rng.integers(0, width - crop_w + 1))
            top = int(rng.integers(0, height - crop_h + 1))
            return left, top, crop_w, crop_h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        crop_w, crop_h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        crop_w, crop_h = int(round(height * ratio[1])), height
    else:
        crop_w, crop_h = width, height
    return (width - crop_w) // 2, (height - crop_h) // 2, crop_w, crop_h


def pil_interpolation(name: str) -> int:
    interpolation_mode(name)  # the one check of the name
    return PIL_INTERPOLATIONS[name]


def eval_resize_side(image_size: int, resize_size: int = 0) -> int:
    """The short side evaluation resizes to: `resize_size`, or image_size / 0.875 when 0."""
    return resize_size or int(round(image_size / EVAL_CROP_RATIO))


def folder_train_transform(image, size: int, rng: np.random.Generator, interpolation: str = "bilinear",
                           antialias: bool = True, out: Optional[np.ndarray] = None) -> np.ndarray:
    """ImageNet augmentation: random resized crop to size x size, flip half the time. The resize
    antialiases as Pillow does (bilinear: OpenCV's approximation of it) or, without `antialias`,
    samples as the model zoo's native pipeline does (src/data/image_decode.py RESIZE_MODES).
    Written into `out` when given."""
    left, top, crop_w, crop_h = random_resized_crop_box(image.width, image.height, rng)
    array = crop_resize(image, (left, top, left + crop_w, top + crop_h), (size, size), pil_interpolation(interpolation),
                        mode="fast" if antialias else "plain", out=out)
    return cv2.flip(array, 1, dst=array) if rng.random() < 0.5 else array


def folder_eval_transform(image, size: int, resize_size: int = 0,
                          interpolation: str = "bilinear") -> np.ndarray:
    """Resize the short side to `resize_size` (default size / 0.875: 256 for 224), then center-crop
    size x size."""
    short = eval_resize_side(size, resize_size)
    scale = short / min(image.width, image.height)
    resized_w, resized_h = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    left, top = (resized_w - size) // 2, (resized_h - size) // 2
    # The crop's box in the original image: resizing only it gives the pixels of resize-then-crop.
    scale_x, scale_y = resized_w / image.width, resized_h / image.height
    box = (left / scale_x, top / scale_y, (left + size) / scale_x, (top + size) / scale_y)
    return crop_resize(image, box, (size, size), pil_interpolation(interpolation))


def sample_transform(dataset: str, image_size: int, resize_size: int = 0, interpolation: str = "bilinear",
               antialias: bool = True) -> Callable:
    """The per-sample (Python) transform of `dataset` to a uint8 HWC image of image_size x
    image_size (possibly written into `out`); it gets rng=None when augmentation is off."""
    if dataset == "cifar10":
        def transform(image, rng, out=None):
            return fit_size(image if rng is None else random_crop_flip(image, rng), image_size, interpolation)
        return transform

    def transform(image, rng, out=None):
        if rng is None:
            return folder_eval_transform(image, image_size, resize_size, interpolation)
        return folder_train_transform(image, image_size, rng, interpolation, antialias, out=out)
    return transform


def fit_size(image: np.ndarray, image_size: int, interpolation: str = "bilinear") -> np.ndarray:
    """An RGB uint8 HWC image resized to image_size x image_size where it has another size (CIFAR
    at a network size other than 32; folder transforms already give that size)."""
    if image.shape[:2] != (image_size, image_size):
        resize = vision.Resize((image_size, image_size), interpolation_mode(interpolation))
        return resize(np.ascontiguousarray(image))
    return image
