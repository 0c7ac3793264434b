"""Decode only the part of a JPEG that a crop needs, at the coarsest resolution that still serves it.

Decoding dominates the ImageNet pipeline's cost. Two savings keep the output what a full decode
would give:
- rows: a baseline JPEG is decoded top to bottom, so rows below the crop (plus a margin for the
  resampling filter and chroma upsampling) need not be decoded at all. The frame height in the
  SOF header is lowered before decoding; libjpeg then stops there and skips the remaining
  entropy-coded data as extraneous bytes (a warning, not an error).
- resolution: when the crop is at least four times the output size in both directions, libjpeg's
  scaled IDCT (PIL's `draft`) decodes at 1/2, 1/4 or 1/8 scale, leaving at least twice the
  output's pixels per side, so PIL's filter still does the final shrinking.
Resizing itself is PIL's, from the crop box of the (reduced) image, with the caller's filter.
Progressive JPEGs are decoded down to the last row (their scans cover the whole frame); images that
are not lazily opened JPEGs (PNG, already decoded images) take the plain path: full decode, resize.
"""
import io
import math
from typing import Optional, Tuple

import numpy as np
from PIL import Image

from src.bad_samples import UnreadableImageError

DCT_SCALES = (8, 4, 2)
# A reduced decode must keep twice the output's pixels per side: PIL's filter then still does the
# final shrinking, and the result stays within a gray level of a full decode (measured: mean 0.2).
HEADROOM = 2
# Rows decoded below the last one a crop uses: covers a 2x2-subsampled chroma MCU row (16) and the
# fancy upsampling that reads one chroma row further.
ROW_MARGIN = 24
_SOF_SEQUENTIAL = (0xC0, 0xC1)  # baseline and extended sequential, Huffman coded
_STANDALONE_MARKERS = set(range(0xD0, 0xD9)) | {0x01}

Box = Tuple[float, float, float, float]


def open_image(path: str) -> Image.Image:
    """The image at `path`, read into memory and opened lazily (header only, nothing decoded)."""
    try:
        with open(path, "rb") as handle:
            image = Image.open(io.BytesIO(handle.read()))
    except (OSError, ValueError) as err:
        raise _unreadable(path, err) from None
    image.filename = path  # names the file in decode errors
    return image


def _unreadable(path: str, err: BaseException) -> UnreadableImageError:
    return UnreadableImageError(path, str(err))


def crop_resize(image: Image.Image, box: Box, size: Tuple[int, int], resample: int = Image.BILINEAR) -> np.ndarray:
    """The region `box` (left, top, right, bottom in the image's full-size pixels) resized to
    `size` (width, height) with PIL's filter `resample`: an RGB uint8 array (height, width, 3)."""
    try:
        decoded, scale = _decode_for(image, box, size)
        if decoded.mode != "RGB":
            decoded = decoded.convert("RGB")
        scaled_box = tuple(value / scale for value in box)
        return np.asarray(decoded.resize(size, resample, box=scaled_box))
    except (OSError, ValueError, SyntaxError) as err:
        raise _unreadable(getattr(image, "filename", "") or "<image>", err) from None


def _decode_for(image: Image.Image, box: Box, size: Tuple[int, int]) -> Tuple[Image.Image, int]:
    """The decoded image a crop needs and its DCT scale (1: full resolution)."""
    data = _lazy_jpeg_bytes(image)
    if data is None:
        image.load()
        return image, 1
    scale = dct_scale(box, size)
    # PIL's widest filter (Lanczos) reads 3 source pixels per output pixel beyond the box edge.
    reach = 3 * max((box[2] - box[0]) / size[0], (box[3] - box[1]) / size[1])
    rows = min(image.height, int(math.ceil(box[3] + reach)) + ROW_MARGIN * scale)
    reduced = _with_height(data, rows) if rows < image.height else None
    decoded = Image.open(io.BytesIO(reduced)) if reduced is not None else image
    if scale > 1:
        decoded.draft("RGB", (decoded.width // scale, decoded.height // scale))
    decoded.load()
    return decoded, scale


def dct_scale(box: Box, size: Tuple[int, int]) -> int:
    """The largest of 8, 4, 2 by which the crop can shrink and still cover `size` HEADROOM times, else 1."""
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    for scale in DCT_SCALES:
        if crop_w >= size[0] * scale * HEADROOM and crop_h >= size[1] * scale * HEADROOM:
            return scale
    return 1


def _lazy_jpeg_bytes(image: Image.Image) -> Optional[bytes]:
    """The encoded bytes of a JPEG that `open_image` opened and nobody decoded yet, else None."""
    if image.format != "JPEG" or len(getattr(image, "tile", ()) or ()) != 1:
        return None
    handle = getattr(image, "fp", None)
    return handle.getvalue() if isinstance(handle, io.BytesIO) else None


def _with_height(data: bytes, rows: int) -> Optional[bytes]:
    """`data` with the frame height lowered to `rows`, or None when the JPEG is not sequential
    (progressive scans cover the whole frame) or its header cannot be walked."""
    offset = sof_height_offset(data)
    if offset is None:
        return None
    return data[:offset] + rows.to_bytes(2, "big") + data[offset + 2:]


def sof_height_offset(data: bytes) -> Optional[int]:
    """Byte offset of the frame height in a sequential JPEG's SOF segment; None otherwise."""
    if data[:2] != b"\xff\xd8":
        return None
    position = 2
    while position + 4 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker in _STANDALONE_MARKERS:
            position += 2
            continue
        if marker == 0xDA:  # start of scan before any frame header
            return None
        if marker in _SOF_SEQUENTIAL:
            return position + 5  # marker (2), length (2), precision (1), then the height
        if 0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return None  # progressive, lossless or arithmetic frames: decode them whole
        position += 2 + int.from_bytes(data[position + 2:position + 4], "big")
    return None
