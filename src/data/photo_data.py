"""Generated JPEGs that cost what real photographs cost to decode (for benchmarking input pipelines).

The sample dataset's small flat shapes decode several times faster than photographs, so a
pipeline measured on them says little about ImageNet. These images have ImageNet's usual sizes
(500x375, 375x500, 640x480), JPEG quality 90 with 4:2:0 chroma (what most cameras and ImageNet
use), and photograph-like content: a 1/f-like multi-scale texture with correlated colour channels,
textured polygons with sharp edges, and sensor-like noise. They are not meant to be learned from.
"""
import io
import math
import os
import time
from typing import Dict, List, Tuple

import cv2
import numpy as np
from PIL import Image

PHOTO_SIZES: Tuple[Tuple[int, int], ...] = ((500, 375), (375, 500), (640, 480))
PHOTO_QUALITY = 90
OCTAVES = 8
NOISE_SIGMA = 3.0


def _texture(rng: np.random.Generator, width: int, height: int, slope: float) -> np.ndarray:
    """Unit-variance multi-scale noise; octave k (features ~2^k pixels) weighs 2^(k * slope)."""
    out = np.zeros((height, width, 3), np.float32)
    for octave in range(OCTAVES):
        grid = rng.standard_normal((max(2, height >> octave), max(2, width >> octave), 3)).astype(np.float32)
        grid[..., 1:] = 0.6 * grid[..., :1] + 0.4 * grid[..., 1:]  # colour channels move together, as in photos
        out += cv2.resize(grid, (width, height), interpolation=cv2.INTER_LINEAR) * (2.0 ** (octave * slope))
    return out / out.std()


def render_photo(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """One photograph-like RGB uint8 image (height, width, 3)."""
    image = _texture(rng, width, height, 0.3) * 45 + rng.uniform(70, 180, 3).astype(np.float32)
    detail = _texture(rng, width, height, 0.15) * 35
    for _ in range(int(rng.integers(4, 9))):
        corners = (rng.random((int(rng.integers(3, 8)), 2)) * [width, height]).astype(np.int32)
        mask = np.zeros((height, width), np.uint8)
        cv2.fillPoly(mask, [corners], 1)
        inside = mask.astype(bool)
        image[inside] = detail[inside] + rng.uniform(30, 220, 3).astype(np.float32)
    image += rng.standard_normal((height, width, 3)).astype(np.float32) * NOISE_SIGMA
    return np.clip(image, 0, 255).astype(np.uint8)


def class_file(folder: str, index: int, classes: int) -> str:
    """The path of image `index` in its class sub-folder (`class<index % classes>`), made if missing."""
    class_folder = os.path.join(folder, f"class{index % classes}")
    os.makedirs(class_folder, exist_ok=True)
    return os.path.join(class_folder, f"{index:05d}.jpg")


def write_photo_folder(folder: str, count: int, *, classes: int = 4, seed: int = 0) -> List[str]:
    """`count` photograph-like JPEGs in `classes` class sub-folders of `folder`; their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for index in range(count):
        width, height = PHOTO_SIZES[index % len(PHOTO_SIZES)]
        path = class_file(folder, index, classes)
        Image.fromarray(render_photo(rng, width, height)).save(path, "JPEG", quality=PHOTO_QUALITY)
        paths.append(path)
    return paths


def write_tiny_jpegs(folder: str, count: int, *, side: int = 16, classes: int = 10, seed: int = 0) -> List[str]:
    """`count` noise JPEGs of side x side pixels in `classes` class sub-folders: decoding them is
    almost free, so a pipeline's rate on them is its per-process ceiling."""
    rng = np.random.default_rng(seed)
    paths = []
    for index in range(count):
        path = class_file(folder, index, classes)
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path, "JPEG", quality=PHOTO_QUALITY)
        paths.append(path)
    return paths


def real_photograph() -> Image.Image:
    """A real photograph that ships with a package this repository installs: matplotlib's sample
    portrait (grace_hopper.jpg, 512x600)."""
    from matplotlib import cbook
    with cbook.get_sample_data("grace_hopper.jpg") as handle:
        return Image.open(handle).convert("RGB")


def write_real_photo_folder(folder: str, count: int, *, classes: int = 4, seed: int = 0) -> List[str]:
    """`count` JPEGs re-cropped from `real_photograph` at ImageNet's usual sizes (scaled 1-1.6x,
    random position, mirrored half the time; quality 90), in `classes` class sub-folders: what a
    real photograph costs to decode, beside the generated ones."""
    rng = np.random.default_rng(seed)
    photo = real_photograph()
    paths = []
    for index in range(count):
        width, height = PHOTO_SIZES[index % len(PHOTO_SIZES)]
        scale = max(width / photo.width, height / photo.height) * rng.uniform(1.0, 1.6)
        scaled = photo.resize((math.ceil(photo.width * scale), math.ceil(photo.height * scale)), Image.BILINEAR)
        left = int(rng.integers(0, scaled.width - width + 1))
        top = int(rng.integers(0, scaled.height - height + 1))
        crop = scaled.crop((left, top, left + width, top + height))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        path = class_file(folder, index, classes)
        crop.save(path, "JPEG", quality=PHOTO_QUALITY)
        paths.append(path)
    return paths


def describe_files(paths: List[str]) -> Dict[str, float]:
    """Mean file size (KB) and PIL's mean full-decode time per image (ms, from bytes in memory),
    so a reader can compare the generated files with their own data."""
    blobs = []
    for path in paths:
        with open(path, "rb") as handle:
            blobs.append(handle.read())
    start = time.perf_counter()
    for blob in blobs:
        with Image.open(io.BytesIO(blob)) as image:
            image.convert("RGB")
    decode_s = (time.perf_counter() - start) / len(blobs)
    return {"files": len(paths), "mean_file_kb": round(float(np.mean([len(b) for b in blobs])) / 1024, 1),
            "pil_decode_ms": round(decode_s * 1000, 3)}
