"""The fast JPEG path (src/image_decode.py) against the full decode the pipeline used before it.

For the same key, training must draw the same crop box and flip from the same generator, and both
transforms must give the pixels of a full-resolution decode: equal up to float rounding where the
image is decoded at full resolution, within one gray level (mean absolute difference) where a crop
large enough is decoded at a reduced DCT scale."""
import io

import numpy as np
import pytest
from PIL import Image

from src.dataset import EVAL_CROP_RATIO, folder_eval_transform, folder_train_transform, random_resized_crop_box
from src.image_decode import _decode_for, dct_scale, open_image, sof_height_offset
from src.photo_data import render_photo

SIZE = 224
GRAY_LEVEL = 1.0  # the stated tolerance: mean absolute difference, in 0-255 levels


def reference_train(image: Image.Image, size: int, rng: np.random.Generator) -> np.ndarray:
    """The training transform before the fast path: full decode, crop-resize, flip."""
    left, top, crop_w, crop_h = random_resized_crop_box(image.width, image.height, rng)
    image = image.resize((size, size), Image.BILINEAR, box=(left, top, left + crop_w, top + crop_h))
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(image)


def reference_eval(image: Image.Image, size: int) -> np.ndarray:
    """The evaluation transform before the fast path: short side to size / 0.875, center crop."""
    scale = int(round(size / EVAL_CROP_RATIO)) / min(image.width, image.height)
    resized_w, resized_h = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    image = image.resize((resized_w, resized_h), Image.BILINEAR)
    left, top = (resized_w - size) // 2, (resized_h - size) // 2
    return np.asarray(image.crop((left, top, left + size, top + size)))


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """ImageNet-sized photograph-like JPEGs, one large enough for reduced-scale decoding, one
    progressive JPEG and one PNG (both take the plain path)."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    paths = []
    for index, (width, height, suffix, options) in enumerate([
            (500, 375, "jpg", {}), (375, 500, "jpg", {}), (640, 480, "jpg", {}), (1600, 1200, "jpg", {}),
            (500, 333, "jpg", {"progressive": True}), (400, 300, "png", {})]):
        path = folder / f"{index}.{suffix}"
        Image.fromarray(render_photo(rng, width, height)).save(path, quality=90, **options)
        paths.append(str(path))
    return paths


def mean_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def test_train_draws_the_same_crop_and_flip_and_matches_a_full_decode(photos):
    for path in photos:
        full = Image.open(path).convert("RGB")
        for key in range(12):
            reference_rng, rng = np.random.default_rng([1, key]), np.random.default_rng([1, key])
            expected = reference_train(full, SIZE, reference_rng)
            got = folder_train_transform(open_image(path), SIZE, rng)
            assert reference_rng.random() == rng.random()  # the same draws, in the same order
            box = random_resized_crop_box(full.width, full.height, np.random.default_rng([1, key]))
            reduced = dct_scale((box[0], box[1], box[0] + box[2], box[1] + box[3]), (SIZE, SIZE)) > 1
            assert got.shape == expected.shape == (SIZE, SIZE, 3)
            # full resolution: the same pixels; reduced DCT scale: within a gray level
            assert mean_abs(got, expected) <= (GRAY_LEVEL if reduced else 0.0), (path, key)


def test_eval_matches_resize_then_center_crop_of_a_full_decode(photos):
    for path in photos:
        expected = reference_eval(Image.open(path).convert("RGB"), SIZE)
        got = folder_eval_transform(open_image(path), SIZE)
        assert got.shape == expected.shape
        assert mean_abs(got, expected) < GRAY_LEVEL, path
        if Image.open(path).height < 2 * SIZE * 2:  # full-resolution decode: equal up to float rounding
            assert np.abs(got.astype(np.int16) - expected).max() <= 1, path


def test_a_crop_near_the_top_decodes_only_the_rows_it_needs(photos):
    image = open_image(photos[0])  # 500x375 baseline JPEG
    decoded, scale = _decode_for(image, (100, 10, 300, 160), (SIZE, SIZE))
    assert scale == 1 and decoded.size[0] == image.width and 160 < decoded.size[1] < image.height


def test_a_large_crop_decodes_at_reduced_scale(photos):
    image = open_image(photos[3])  # 1600x1200: a whole-image crop is more than 4x the output
    decoded, scale = _decode_for(image, (0, 0, 1600, 1200), (SIZE, SIZE))
    assert scale == 2 and decoded.size == (800, 600)


def test_sof_height_offset_finds_baseline_frames_only(photos):
    for path in photos:
        with open(path, "rb") as handle:
            data = handle.read()
        offset = sof_height_offset(data)
        if path.endswith(".jpg") and not Image.open(io.BytesIO(data)).info.get("progressive"):
            assert int.from_bytes(data[offset:offset + 2], "big") == Image.open(path).height
        else:
            assert offset is None
