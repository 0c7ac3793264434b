"""The fast JPEG paths (src/data/image_decode.py) against the full decode the pipeline used before them.

libjpeg-turbo's partial decoder must give a full decode's pixels inside the region it returns.
For the same key, training must draw the same crop box and flip from the same generator; its
antialiased resize must stay within a gray level (mean absolute difference) of Pillow's filter on
a full decode, and evaluation must compute what the reference transform computes, within float
rounding at full resolution and a gray level where a large image is decoded at a reduced DCT
scale. Both decoders (partial and Pillow) are checked; the Pillow path also serves PNG and CMYK."""
import io

import numpy as np
import pytest
from PIL import Image

from src.data.bad_samples import UnreadableImageError
from src.data.image_decode import (
    EDGE_COLUMNS,
    JpegFile,
    _decode_with_pillow,
    crop_resize,
    dct_scale,
    decode_jpeg_region,
    jpeg_frame,
    open_image,
    partial_decoder,
)
from src.data.photo_data import render_photo
from src.data.transforms import EVAL_CROP_RATIO, folder_eval_transform, folder_train_transform, random_resized_crop_box

SIZE = 224
GRAY_LEVEL = 1.0  # the stated tolerance: mean absolute difference, in 0-255 levels


def reference_train(image: Image.Image, size: int, rng: np.random.Generator) -> np.ndarray:
    """The training transform before the fast paths: full decode, Pillow's crop-resize, flip."""
    left, top, crop_w, crop_h = random_resized_crop_box(image.width, image.height, rng)
    image = image.resize((size, size), Image.BILINEAR, box=(left, top, left + crop_w, top + crop_h))
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(image)


def reference_eval(image: Image.Image, size: int) -> np.ndarray:
    """The evaluation transform before the fast paths: short side to size / 0.875, center crop."""
    scale = int(round(size / EVAL_CROP_RATIO)) / min(image.width, image.height)
    resized_w, resized_h = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    image = image.resize((resized_w, resized_h), Image.BILINEAR)
    left, top = (resized_w - size) // 2, (resized_h - size) // 2
    return np.asarray(image.crop((left, top, left + size, top + size)))


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """ImageNet-sized photograph-like JPEGs, one large enough for reduced-scale decoding, one
    progressive, one grayscale, one CMYK and one PNG (the last two take the Pillow path)."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    paths = []
    for index, (width, height, suffix, mode, options) in enumerate([
            (500, 375, "jpg", "RGB", {}), (375, 500, "jpg", "RGB", {}), (640, 480, "jpg", "RGB", {}),
            (1600, 1200, "jpg", "RGB", {}), (500, 333, "jpg", "RGB", {"progressive": True}),
            (480, 360, "jpg", "L", {}), (400, 300, "jpg", "CMYK", {}), (400, 300, "png", "RGB", {})]):
        path = folder / f"{index}.{suffix}"
        Image.fromarray(render_photo(rng, width, height)).convert(mode).save(path, quality=90, **options)
        paths.append(str(path))
    return paths


def mean_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def full_decode(path: str) -> Image.Image:
    return Image.open(path).convert("RGB")


def test_the_partial_decoder_is_built_and_takes_rgb_and_gray_jpegs(photos):
    assert partial_decoder() is not None  # scripts/setup_env.sh builds src/data/native/libjpeg_crop.so
    kinds = [type(open_image(path)) for path in photos]
    assert kinds[:6] == [JpegFile] * 6  # baseline, progressive and grayscale JPEGs
    assert [kind is JpegFile for kind in kinds[6:]] == [False, False]  # CMYK JPEG, PNG: Pillow
    assert all(not isinstance(open_image(path, partial=False), JpegFile) for path in photos)


def test_partial_decode_gives_the_pixels_of_a_full_decode(photos):
    rng = np.random.default_rng(3)
    for path in photos[:6]:
        image = open_image(path)
        for scale in (1, 2):
            full = Image.open(path)
            full.draft("RGB", (full.width // scale, full.height // scale))
            full = np.asarray(full.convert("RGB"))
            height, width = full.shape[:2]
            for _ in range(8):
                left, top = int(rng.integers(0, width - 8)), int(rng.integers(0, height - 8))
                right, bottom = int(rng.integers(left + 1, width + 1)), int(rng.integers(top + 1, height + 1))
                region = (max(0, left - EDGE_COLUMNS), top, min(width, right + EDGE_COLUMNS), bottom)
                pixels, first_column = decode_jpeg_region(image.data, scale, region, width)
                assert first_column <= region[0] and pixels.shape[0] == bottom - top
                inside = pixels[:, left - first_column:right - first_column]
                np.testing.assert_array_equal(inside, full[top:bottom, left:right], err_msg=f"{path} {scale}")


@pytest.mark.parametrize("partial", [True, False])
def test_train_draws_the_same_crop_and_flip_and_stays_within_a_gray_level(photos, partial):
    for path in photos:
        full = full_decode(path)
        differences = []
        for key in range(12):
            reference_rng, rng = np.random.default_rng([1, key]), np.random.default_rng([1, key])
            expected = reference_train(full, SIZE, reference_rng)
            got = folder_train_transform(open_image(path, partial=partial), SIZE, rng)
            assert reference_rng.random() == rng.random()  # the same draws, in the same order
            assert got.shape == expected.shape == (SIZE, SIZE, 3)
            differences.append(mean_abs(got, expected))
            flipped = np.asarray(Image.fromarray(expected).transpose(Image.FLIP_LEFT_RIGHT))
            assert mean_abs(got, expected) < mean_abs(got, flipped) or mean_abs(expected, flipped) < 2
        assert np.mean(differences) <= GRAY_LEVEL and max(differences) <= 2 * GRAY_LEVEL, (path, differences)


def test_train_without_antialiasing_samples_the_crop_bilinearly(photos):
    """antialias False: the model zoo's filter, plain bilinear sampling, on the same crop and flip."""
    import cv2
    full = np.asarray(full_decode(photos[0]))
    for key in range(6):
        rng = np.random.default_rng([1, key])
        left, top, crop_w, crop_h = random_resized_crop_box(full.shape[1], full.shape[0], rng)
        expected = cv2.resize(full[top:top + crop_h, left:left + crop_w], (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)
        if rng.random() < 0.5:
            expected = expected[:, ::-1]
        got = folder_train_transform(open_image(photos[0]), SIZE, np.random.default_rng([1, key]), antialias=False)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("partial", [True, False])
def test_eval_matches_resize_then_center_crop_of_a_full_decode(photos, partial):
    for path in photos:
        expected = reference_eval(full_decode(path), SIZE)
        got = folder_eval_transform(open_image(path, partial=partial), SIZE)
        assert got.shape == expected.shape
        assert mean_abs(got, expected) < GRAY_LEVEL, path
        if Image.open(path).height < 2 * SIZE * 2:  # full-resolution decode: equal up to float rounding
            assert np.abs(got.astype(np.int16) - expected).max() <= 1, path


def test_exact_resize_of_a_partial_decode_equals_pillow_on_the_full_image(photos):
    full = full_decode(photos[2])
    for box in [(0, 0, 640, 480), (10.5, 20.25, 300.5, 260), (400, 300, 640, 480), (100, 50, 180, 120)]:
        got = crop_resize(open_image(photos[2]), box, (SIZE, SIZE), Image.BICUBIC)
        expected = np.asarray(full.resize((SIZE, SIZE), Image.BICUBIC, box=box))
        assert np.abs(got.astype(np.int16) - expected).max() <= 1, box


def test_a_crop_near_the_top_decodes_only_the_rows_it_needs_with_pillow(photos):
    image = open_image(photos[0], partial=False)  # 500x375 baseline JPEG
    decoded, box = _decode_with_pillow(image, (100, 10, 300, 160), (SIZE, SIZE), 1)
    assert box == (100, 10, 300, 160) and decoded.size[0] == image.width and 160 < decoded.size[1] < image.height


def test_a_large_crop_decodes_at_reduced_scale(photos):
    assert dct_scale((0, 0, 1600, 1200), (SIZE, SIZE)) == 2 and dct_scale((0, 0, 800, 600), (SIZE, SIZE)) == 1
    decoded, box = _decode_with_pillow(open_image(photos[3], partial=False), (0, 0, 1600, 1200), (SIZE, SIZE), 2)
    assert decoded.size == (800, 600) and box == (0, 0, 800, 600)


def test_a_jpeg_cut_inside_the_region_is_unreadable_and_named(photos, tmp_path):
    path = tmp_path / "cut.jpg"
    with open(photos[0], "rb") as handle:
        path.write_bytes(handle.read()[:20000])  # the header and the first rows only
    image = open_image(str(path))
    assert isinstance(image, JpegFile)
    with pytest.raises(UnreadableImageError, match="cut.jpg.*truncated"):
        crop_resize(image, (0, 200, 500, 375), (SIZE, SIZE))
    with pytest.raises(UnreadableImageError, match="cut.jpg"):
        crop_resize(open_image(str(path), partial=False), (0, 200, 500, 375), (SIZE, SIZE))


def test_jpeg_frame_reads_sequential_and_progressive_headers(photos):
    for path in photos:
        with open(path, "rb") as handle:
            data = handle.read()
        frame = jpeg_frame(data)
        image = Image.open(io.BytesIO(data))
        if path.endswith(".png"):
            assert frame is None
            continue
        assert (frame.width, frame.height) == image.size
        assert frame.components == len(image.getbands())
        assert frame.progressive == bool(image.info.get("progressive"))
        assert int.from_bytes(data[frame.height_offset:frame.height_offset + 2], "big") == image.height
    assert jpeg_frame(b"\xff\xd8\xff\xdb\x00") is None and jpeg_frame(b"GIF89a") is None
