"""Decode only the part of a JPEG that a crop needs, at the coarsest resolution that still serves it.

Decoding dominates the ImageNet pipeline's cost. Two decoders, with the same savings where they can:
- libjpeg-turbo's partial decoder (`src/data/native/jpeg_crop.c`, built by scripts/setup_env.sh, used
  when built): it entropy-decodes the rows down to the crop's last one, runs the inverse DCT,
  upsampling and colour conversion only for the crop's rows and columns, and never reads the rest.
- Pillow (when the library is not built, and for files it does not take: PNG, CMYK JPEGs): rows
  below the crop are left out by lowering the frame height in the SOF header (libjpeg then stops
  there; the leftover data is a warning, not an error); progressive JPEGs are decoded whole.
Both decode at 1/2, 1/4 or 1/8 scale (libjpeg's scaled IDCT) when the crop is at least four times
the output in both directions, leaving at least twice the output's pixels per side for the filter.
The decoded pixels are a full decode's (at that scale); the crop is then resized (`RESIZE_MODES`).
"""
import ctypes
import functools
import io
import math
import os
import re
import threading
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union

import cv2
import numpy as np
from PIL import Image

from src.data.bad_samples import UnreadableImageError

DCT_SCALES = (8, 4, 2)
# A reduced decode must keep twice the output's pixels per side: the filter then still does the
# final shrinking, and the result stays within a gray level of a full decode (measured: mean 0.2).
HEADROOM = 2
# Rows decoded below the last one a crop uses (Pillow path): covers a 2x2-subsampled chroma MCU row
# (16) and the fancy upsampling that reads one chroma row further.
ROW_MARGIN = 24
# Columns the partial decoder gets beyond the crop: its first and last two columns are upsampled
# without their outer neighbours (measured: they differ from a full decode; the third does not).
EDGE_COLUMNS = 2
_NO_FILTER = np.ones(1, np.float32)
APPROXIMATE_SHRINK = 2.0  # "fast" approximates Pillow's filter below this shrink factor (see crop_resize)
# Pillow's widest filter (Lanczos) reads 3 source pixels per output pixel beyond the box edge.
FILTER_REACH = 3
_SOF_SEQUENTIAL = (0xC0, 0xC1)  # baseline and extended sequential, Huffman coded
_SOF_PROGRESSIVE = 0xC2
_STANDALONE_MARKERS = set(range(0xD0, 0xD9)) | {0x01}
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "libjpeg_crop.so")

Box = Tuple[float, float, float, float]
# How crop_resize resizes: "exact": Pillow's filter (antialiased where it shrinks); "fast": for
# bilinear, OpenCV's approximation of Pillow's filter (`_opencv_resize`: within a gray level on
# average), other filters exact; "plain": OpenCV's interpolation without antialiasing, as the
# model zoo's native pipeline resizes.
RESIZE_MODES = ("exact", "fast", "plain")
_OPENCV_FILTERS = {Image.BILINEAR: cv2.INTER_LINEAR, Image.BICUBIC: cv2.INTER_CUBIC,
                   Image.NEAREST: cv2.INTER_NEAREST_EXACT}


class JpegFrame(NamedTuple):
    """What a JPEG's frame header (SOF) says."""
    height_offset: int  # byte offset of the 2-byte frame height
    height: int
    width: int
    components: int
    progressive: bool


@dataclass
class JpegFile:
    """A JPEG read into memory, not decoded: what the partial decoder takes."""
    path: str
    data: bytes
    frame: JpegFrame

    @property
    def width(self) -> int:
        return self.frame.width

    @property
    def height(self) -> int:
        return self.frame.height

    @property
    def size(self) -> Tuple[int, int]:
        return self.frame.width, self.frame.height


def open_image(path: str, partial: bool = True) -> Union[JpegFile, Image.Image]:
    """The image at `path`, read into memory and not decoded: a JpegFile where the partial decoder
    is built and takes the file (3-component or grayscale, sequential or progressive) and `partial`
    is on, otherwise a Pillow image opened lazily (header only)."""
    try:
        data = read_file(path)
    except OSError as err:
        raise _unreadable(path, err) from None
    return image_from_bytes(data, path, partial)


def image_from_bytes(data: bytes, path: str, partial: bool = True) -> Union[JpegFile, Image.Image]:
    """An encoded image already in memory, as `open_image` returns it; `path` names it in errors."""
    frame = jpeg_frame(data)
    if partial and frame is not None and frame.components in (1, 3) and partial_decoder() is not None:
        return JpegFile(path, data, frame)
    try:
        image = Image.open(io.BytesIO(data))
    except (OSError, ValueError) as err:
        raise _unreadable(path, err) from None
    image.filename = path  # names the file in decode errors
    return image


def read_file(path: str) -> bytes:
    """The whole file, through the os module's calls (half the cost of a Python file object, which
    counts at thousands of small images per second)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(descriptor).st_size
        chunks, remaining = [], size
        while remaining > 0:
            chunk = os.read(descriptor, remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    finally:
        os.close(descriptor)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _unreadable(path: str, err: BaseException) -> UnreadableImageError:
    return UnreadableImageError(path, _IN_MEMORY.sub("", str(err)))


_IN_MEMORY = re.compile(r" <_io\.BytesIO object at 0x[0-9a-f]+>")  # Pillow names the buffer, not the file


def crop_resize(image: Union[JpegFile, Image.Image], box: Box, size: Tuple[int, int],
                resample: int = Image.BILINEAR, mode: str = "exact", out: Optional[np.ndarray] = None) -> np.ndarray:
    """The region `box` (left, top, right, bottom in the image's full-size pixels) resized to
    `size` (width, height) with Pillow's filter `resample`, computed as `mode` says
    (RESIZE_MODES): an RGB uint8 array (height, width, 3), written into `out` when given (a batch's
    slot: no per-sample buffer to allocate and fault in)."""
    out = np.empty((size[1], size[0], 3), np.uint8) if out is None else out
    path = getattr(image, "path", None) or getattr(image, "filename", "") or "<image>"
    scale = dct_scale(box, size)
    shrink = max((box[2] - box[0]) / size[0], (box[3] - box[1]) / size[1]) / scale
    # The approximation holds while a side shrinks by less than APPROXIMATE_SHRINK (measured: 2-3
    # gray levels at 2-2.7); larger crops (images well beyond ImageNet's size) take Pillow's filter.
    approximate = mode == "fast" and resample == Image.BILINEAR and shrink < APPROXIMATE_SHRINK
    try:
        if isinstance(image, JpegFile):
            decoded, box = _decode_region(image, box, size, scale)
        else:
            decoded, box = _decode_with_pillow(image, box, size, scale)
        if mode == "plain" or approximate:
            return _opencv_resize(np.asarray(decoded), box, size, _OPENCV_FILTERS[resample], approximate, out)
        if isinstance(decoded, np.ndarray):
            decoded = Image.fromarray(decoded)
        out[...] = np.asarray(decoded.resize(size, resample, box=box))
        return out
    except (OSError, ValueError, SyntaxError) as err:
        raise _unreadable(path, err) from None


def dct_scale(box: Box, size: Tuple[int, int]) -> int:
    """The largest of 8, 4, 2 by which the crop can shrink and still cover `size` HEADROOM times, else 1."""
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    for scale in DCT_SCALES:
        if crop_w >= size[0] * scale * HEADROOM and crop_h >= size[1] * scale * HEADROOM:
            return scale
    return 1


def _filter_reach(box: Box, size: Tuple[int, int]) -> float:
    """Source pixels beyond the box edge that resizing `box` to `size` may read."""
    return FILTER_REACH * max(1.0, (box[2] - box[0]) / size[0], (box[3] - box[1]) / size[1])


def _decode_region(image: JpegFile, box: Box, size: Tuple[int, int], scale: int) -> Tuple[np.ndarray, Box]:
    """The pixels around `box` (all a filter can read) decoded at 1/`scale`, and the box in them."""
    width, height = -(-image.width // scale), -(-image.height // scale)  # libjpeg rounds up
    scaled = tuple(value / scale for value in box)
    reach = _filter_reach(scaled, size)
    left = max(0, math.floor(scaled[0] - reach) - EDGE_COLUMNS)
    right = min(width, math.ceil(scaled[2] + reach) + EDGE_COLUMNS)
    top, bottom = max(0, math.floor(scaled[1] - reach)), min(height, math.ceil(scaled[3] + reach))
    pixels, first_column = decode_jpeg_region(image.data, scale, (left, top, right, bottom), width)
    return pixels, (scaled[0] - first_column, scaled[1] - top, scaled[2] - first_column, scaled[3] - top)


def decode_jpeg_region(data: bytes, scale: int, region: Tuple[int, int, int, int],
                       width: int) -> Tuple[np.ndarray, int]:
    """Rows region[1]:region[3] and at least columns region[0]:region[2] of the JPEG `data` decoded
    at 1/`scale` (scaled width `width`): RGB uint8 (rows, columns, 3) and its first column (the
    decoder starts columns on a block boundary)."""
    left, top, right, bottom = region
    out = np.empty((bottom - top) * width * 3, np.uint8)
    decoded = (ctypes.c_int * 2)()
    message = _scratch.message
    status = partial_decoder()(data, len(data), scale, left, top, right, bottom, out.ctypes.data, out.size,
                               decoded, message, len(message))
    if status != 0:
        raise OSError(message.value.decode(errors="replace") or "cannot decode")
    first_column, columns = decoded[0], decoded[1]
    return out[:(bottom - top) * columns * 3].reshape(bottom - top, columns, 3), first_column


class _Scratch(threading.local):
    """Per-thread buffers the decoder reuses (worker threads decode at the same time)."""

    def __init__(self):
        self.message = ctypes.create_string_buffer(200)


_scratch = _Scratch()


@functools.lru_cache(maxsize=None)
def partial_decoder():
    """libjpeg-turbo's partial decoder (ctypes function), or None where it is not built."""
    if not os.path.exists(LIBRARY_PATH):
        return None
    # DEEPBIND: the library binds to the libjpeg it was linked with, not to a copy another
    # extension (MindSpore, OpenCV) may have made global.
    library = ctypes.CDLL(LIBRARY_PATH, mode=os.RTLD_LOCAL | os.RTLD_DEEPBIND)
    function = library.jpeg_crop_decode
    function.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                         ctypes.c_char_p, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def decoder_name() -> str:
    """Which decoder reads JPEGs here (for benchmark reports)."""
    return "libjpeg-turbo partial" if partial_decoder() is not None else "Pillow"


def _opencv_resize(pixels: np.ndarray, box: Box, size: Tuple[int, int], interpolation: int,
                   antialias: bool, out: np.ndarray) -> np.ndarray:
    """OpenCV's `interpolation` of the (rounded) box. With `antialias` (bilinear), Pillow's
    antialiased filter approximated: where a side shrinks by s, a Gaussian prefilter first (sigma
    0.5 * sqrt(s^2 - 1): the spread Pillow's widened triangle has beyond plain bilinear sampling's),
    fed by the pixels around the box as Pillow's filter is."""
    left, top, right, bottom = (int(round(value)) for value in box)
    shrinks = ((right - left) / size[0], (bottom - top) / size[1])
    if antialias and max(shrinks) > 1:
        kernels = [_gaussian_taps(0.5 * math.sqrt(s * s - 1)) if s > 1 else _NO_FILTER for s in shrinks]
        pad_x, pad_y = len(kernels[0]) // 2, len(kernels[1]) // 2
        outer_left, outer_top = max(0, left - pad_x), max(0, top - pad_y)
        outer = pixels[outer_top:bottom + pad_y, outer_left:right + pad_x]
        pixels = cv2.sepFilter2D(outer, -1, kernels[0], kernels[1])
        left, right, top, bottom = left - outer_left, right - outer_left, top - outer_top, bottom - outer_top
    return cv2.resize(pixels[top:bottom, left:right], size, dst=out, interpolation=interpolation)


def _gaussian_taps(sigma: float) -> np.ndarray:
    """A normalized Gaussian kernel over +-1.5 sigma (3 taps up to sigma 0.67): wider kernels
    changed the result by under 0.05 gray levels and cost 40% more."""
    radius = max(1, math.ceil(1.5 * sigma))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2).astype(np.float32)
    return taps / taps.sum()


def _decode_with_pillow(image: Image.Image, box: Box, size: Tuple[int, int], scale: int) -> Tuple[Image.Image, Box]:
    """Pillow's decode of what a crop needs (see the module docstring), at 1/`scale` where the
    image is a JPEG, and the box in its pixels."""
    data = _lazy_jpeg_bytes(image)
    if data is None:
        image.load()
        return (image if image.mode == "RGB" else image.convert("RGB")), box
    rows = min(image.height, int(math.ceil(box[3] + _filter_reach(box, size))) + ROW_MARGIN * scale)
    reduced = _with_height(data, rows) if rows < image.height else None
    decoded = Image.open(io.BytesIO(reduced)) if reduced is not None else image
    if scale > 1:
        decoded.draft("RGB", (decoded.width // scale, decoded.height // scale))
    decoded.load()
    if decoded.mode != "RGB":
        decoded = decoded.convert("RGB")
    return decoded, tuple(value / scale for value in box)


def _lazy_jpeg_bytes(image: Image.Image) -> Optional[bytes]:
    """The encoded bytes of a JPEG that `open_image` opened and nobody decoded yet, else None."""
    if image.format != "JPEG" or len(getattr(image, "tile", ()) or ()) != 1:
        return None
    handle = getattr(image, "fp", None)
    return handle.getvalue() if isinstance(handle, io.BytesIO) else None


def _with_height(data: bytes, rows: int) -> Optional[bytes]:
    """`data` with the frame height lowered to `rows`, or None when the JPEG is not sequential
    (progressive scans cover the whole frame) or its header cannot be walked."""
    frame = jpeg_frame(data)
    if frame is None or frame.progressive:
        return None
    offset = frame.height_offset
    return data[:offset] + rows.to_bytes(2, "big") + data[offset + 2:]


def jpeg_frame(data: bytes) -> Optional[JpegFrame]:
    """The frame header of a Huffman-coded sequential or progressive JPEG whose headers are whole
    up to the first scan; None for anything else (other frame types, not a JPEG, a cut header)."""
    if data[:2] != b"\xff\xd8":
        return None
    position, frame = 2, None
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
        length = int.from_bytes(data[position + 2:position + 4], "big")
        if marker == 0xDA:  # the first scan: the headers before it are complete
            return frame if position + 2 + length <= len(data) else None
        if marker in _SOF_SEQUENTIAL or marker == _SOF_PROGRESSIVE:
            header = data[position + 5:position + 10]
            if len(header) < 5:
                return None
            height, width = int.from_bytes(header[0:2], "big"), int.from_bytes(header[2:4], "big")
            if height == 0 or width == 0:
                return None
            frame = JpegFrame(position + 5, height, width, header[4], marker == _SOF_PROGRESSIVE)
        elif 0xC3 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return None  # lossless or arithmetic-coded frames: Pillow decodes them whole
        position += 2 + length
    return None
