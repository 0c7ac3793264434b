"""Per-sample augmentation policies: AutoAugment (imagenet / cifar10 / svhn), RandAugment,
TrivialAugmentWide and AugMix, with torchvision's names, operations, magnitude bins and signs.

A policy is called with a uint8 HWC RGB image and the sample's generator. It draws only its
choices from the generator (which operation, which magnitude bin, which sign, whether to apply)
and does the pixel work with deterministic OpenCV and numpy calls with explicit parameters, so the
output is a pure function of (seed, epoch, sample index) like the rest of the pipeline.

The pixel work is OpenCV rather than MindSpore's eager vision operations because each eager call
cost 100-480 us on a 224x224 image, about 100 us or more of it dispatch around the same OpenCV
kernels, which capped the input pipeline; OpenCV calls also release the GIL. Each operation
computes torchvision's definition (what its policies do to a PIL image; src/migration/augment_reference.py
holds both references and `python -m src.migration.augment_reference` prints the table): the same
integers, except one gray level in about 0.1% of Color's values (PIL's luma rounding) and, in the
warps (shear, rotate), up to 4 levels on sharp edges where OpenCV's bilinear weights step by 1/32
of a pixel (mean 0.5 level). MindSpore's operations, which this code replaced, sheared about the
center of the top-left pixel instead of the grid's corner and filled the border differently (up to
6 levels on average at 32 px), and equalized as cv2.equalizeHist does.
"""
import functools
import math
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np
from mindspore.dataset.vision import Inter

from src.errors import UserInputError

POLICIES = ("none", "imagenet", "cifar10", "svhn", "ra", "ta_wide", "augmix")
INTERPOLATIONS = {"bilinear": Inter.BILINEAR, "bicubic": Inter.BICUBIC, "nearest": Inter.NEAREST}
SIGNED_OPS = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
              "Sharpness")
# The operations of RandAugment and TrivialAugmentWide, in torchvision's order.
BASIC_OPS = ("Identity",) + SIGNED_OPS + ("Posterize", "Solarize", "AutoContrast", "Equalize")
AUGMIX_OPS = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Posterize", "Solarize", "AutoContrast",
              "Equalize", "Brightness", "Color", "Contrast", "Sharpness")
RA_BINS = 31
AUGMIX_BINS = 11

# The AutoAugment paper's learned policies: 25 sub-policies (apart by '|' or a line break) each of
# two (operation, probability, magnitude bin of 10) steps; '-' marks an operation without magnitude.
_POLICY_TABLES = {
    "imagenet": """
        Posterize .4 8, Rotate .6 9 | Solarize .6 5, AutoContrast .6 - | Equalize .8 -, Equalize .6 -
        Posterize .6 7, Posterize .6 6 | Equalize .4 -, Solarize .2 4 | Equalize .4 -, Rotate .8 8
        Solarize .6 3, Equalize .6 - | Posterize .8 5, Equalize 1 - | Rotate .2 3, Solarize .6 8
        Equalize .6 -, Posterize .4 6 | Rotate .8 8, Color .4 0 | Rotate .4 9, Equalize .6 -
        Equalize 0 -, Equalize .8 - | Invert .6 -, Equalize 1 - | Color .6 4, Contrast 1 8
        Rotate .8 8, Color 1 2 | Color .8 8, Solarize .8 7 | Sharpness .4 7, Invert .6 -
        ShearX .6 5, Equalize 1 - | Color .4 0, Equalize .6 - | Equalize .4 -, Solarize .2 4
        Solarize .6 5, AutoContrast .6 - | Invert .6 -, Equalize 1 - | Color .6 4, Contrast 1 8
        Equalize .8 -, Equalize .6 -""",
    "cifar10": """
        Invert .1 -, Contrast .2 6 | Rotate .7 2, TranslateX .3 9 | Sharpness .8 1, Sharpness .9 3
        ShearY .5 8, TranslateY .7 9 | AutoContrast .5 -, Equalize .9 - | ShearY .2 7, Posterize .3 7
        Color .4 3, Brightness .6 7 | Sharpness .3 9, Brightness .7 9 | Equalize .6 -, Equalize .5 -
        Contrast .6 7, Sharpness .6 5 | Color .7 7, TranslateX .5 8 | Equalize .3 -, AutoContrast .4 -
        TranslateY .4 3, Sharpness .2 6 | Brightness .9 6, Color .2 8 | Solarize .5 2, Invert 0 -
        Equalize .2 -, AutoContrast .6 - | Equalize .2 -, Equalize .6 - | Color .9 9, Equalize .6 -
        AutoContrast .8 -, Solarize .2 8 | Brightness .1 3, Color .7 0 | Solarize .4 5, AutoContrast .9 -
        TranslateY .9 9, TranslateY .7 9 | AutoContrast .9 -, Solarize .8 3 | Equalize .8 -, Invert .1 -
        TranslateY .7 9, AutoContrast .9 -""",
    "svhn": """
        ShearX .9 4, Invert .2 - | ShearY .9 8, Invert .7 - | Equalize .6 -, Solarize .6 6
        Invert .9 -, Equalize .6 - | Equalize .6 -, Rotate .9 3 | ShearX .9 4, AutoContrast .8 -
        ShearY .9 8, Invert .4 - | ShearY .9 5, Solarize .2 6 | Invert .9 -, AutoContrast .8 -
        Equalize .6 -, Rotate .9 3 | ShearX .9 4, Solarize .3 3 | ShearY .8 8, Invert .7 -
        Equalize .9 -, TranslateY .6 6 | Invert .9 -, Equalize .6 - | Contrast .3 3, Rotate .8 4
        Invert .8 -, TranslateY 0 2 | ShearY .7 6, Solarize .4 8 | Invert .6 -, Rotate .8 4
        ShearY .3 7, TranslateX .9 3 | ShearX .1 6, Invert .6 - | Solarize .7 2, TranslateY .6 7
        ShearY .8 4, Invert .8 - | ShearX .7 9, TranslateY .8 3 | ShearY .8 5, AutoContrast .7 -
        ShearX .7 2, Invert .1 -""",
}

Step = Tuple[str, float, Optional[int]]


def parse_policy_table(text: str) -> List[Tuple[Step, ...]]:
    """'Op p bin, Op p bin | ...' (sub-policies apart by '|' or a line break) ->
    [((op, p, bin or None), ...), ...]."""
    policy = []
    for sub_policy in filter(str.strip, re.split(r"[|\n]", text)):
        steps = []
        for step in sub_policy.split(","):
            name, probability, magnitude_bin = step.split()
            steps.append((name, float(probability), None if magnitude_bin == "-" else int(magnitude_bin)))
        policy.append(tuple(steps))
    return policy


def magnitude_bins(space: str, bins: int, height: int, width: int) -> Dict[str, np.ndarray]:
    """The magnitude of every bin of each operation that has one, for the three magnitude spaces:
    'standard' (AutoAugment, RandAugment), 'wide' (TrivialAugmentWide) and 'augmix'."""
    strong = space == "wide"
    enhance = 0.99 if strong else 0.9
    translate = {"standard": (150 / 331 * width, 150 / 331 * height), "wide": (32.0, 32.0),
                 "augmix": (width / 3, height / 3)}[space]
    posterize_span, posterize_top = {"standard": (4, 8), "wide": (6, 8), "augmix": (4, 4)}[space]
    steps = np.arange(bins)
    return {
        "ShearX": np.linspace(0.0, 0.99 if strong else 0.3, bins),
        "ShearY": np.linspace(0.0, 0.99 if strong else 0.3, bins),
        "TranslateX": np.linspace(0.0, translate[0], bins),
        "TranslateY": np.linspace(0.0, translate[1], bins),
        "Rotate": np.linspace(0.0, 135.0 if strong else 30.0, bins),
        "Brightness": np.linspace(0.0, enhance, bins),
        "Color": np.linspace(0.0, enhance, bins),
        "Contrast": np.linspace(0.0, enhance, bins),
        "Sharpness": np.linspace(0.0, enhance, bins),
        "Posterize": posterize_top - np.round(steps / ((bins - 1) / posterize_span)).astype(int),
        "Solarize": np.linspace(255.0, 0.0, bins),
    }


@functools.lru_cache(maxsize=64)
def _cached_bins(space: str, bins: int, height: int, width: int) -> Dict[str, np.ndarray]:
    """magnitude_bins once per image size: building it costs more (~130 us) than most operations,
    and the policies ask for it on every sample. Read-only, since every caller shares it."""
    table = magnitude_bins(space, bins, height, width)
    for values in table.values():
        values.flags.writeable = False
    return table


_CV2_INTERPOLATION = {Inter.BILINEAR: cv2.INTER_LINEAR, Inter.LINEAR: cv2.INTER_LINEAR,
                      Inter.BICUBIC: cv2.INTER_CUBIC, Inter.CUBIC: cv2.INTER_CUBIC, Inter.NEAREST: cv2.INTER_NEAREST}
# PIL's ImageFilter.SMOOTH kernel, which torchvision's adjust_sharpness blurs with.
_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=np.float32) / 13
_LEVELS = np.arange(256)


def cv2_interpolation(interpolation: Inter) -> int:
    """OpenCV's interpolation flag for a MindSpore `Inter` value."""
    if interpolation not in _CV2_INTERPOLATION:
        raise ValueError(f"unsupported interpolation {interpolation}")
    return _CV2_INTERPOLATION[interpolation]


def _warp(image: np.ndarray, matrix: np.ndarray, interpolation: Inter) -> np.ndarray:
    """Warp by `matrix`, which maps input to output points in PIL's coordinates (origin at the
    top-left corner of the pixel grid, pixel centers at +0.5), as PIL's transform does for
    torchvision: an output pixel whose point falls outside the input is 0, any other samples the
    input with its edge pixels repeated."""
    height, width = image.shape[:2]
    # the same map between pixel indices (centers at 0): shift in by half a pixel, out by half
    indices = matrix.astype(np.float64)
    indices[:, 2] += indices[:, :2].sum(axis=1) * 0.5 - 0.5
    out = cv2.warpAffine(image, indices, (width, height), flags=cv2_interpolation(interpolation),
                         borderMode=cv2.BORDER_REPLICATE)
    # inside: the points that round to an input pixel, i.e. lie in [0, size) in PIL's coordinates
    inside = cv2.warpAffine(_ones(height, width), indices, (width, height), flags=cv2.INTER_NEAREST,
                            borderMode=cv2.BORDER_CONSTANT, borderValue=0)
    return cv2.bitwise_and(out, out, mask=inside)  # 0 where the mask is 0


@functools.lru_cache(maxsize=16)
def _ones(height: int, width: int) -> np.ndarray:
    ones = np.ones((height, width), np.uint8)
    ones.flags.writeable = False
    return ones


def _shear(image: np.ndarray, shear_x: float, shear_y: float, interpolation: Inter) -> np.ndarray:
    """Shear about the top-left corner of the pixel grid, as torchvision's policies do: row y
    (its center at y + 0.5) moves by -shear_x * (y + 0.5), column x by -shear_y * (x + 0.5)."""
    return _warp(image, np.array([[1.0, -shear_x, 0.0], [-shear_y, 1.0, 0.0]]), interpolation)


def _translate(image: np.ndarray, dx: float, dy: float) -> np.ndarray:
    """Shift by whole pixels (torchvision truncates the magnitude to an int), filling with 0.
    A whole-pixel shift samples no pixel between two, so it is a crop and a pad under any
    interpolation, and much cheaper than a warp."""
    height, width = image.shape[:2]
    dx, dy = int(dx), int(dy)
    if abs(dx) >= width or abs(dy) >= height:
        return np.zeros_like(image)
    kept = image[max(-dy, 0):height - max(dy, 0), max(-dx, 0):width - max(dx, 0)]
    return cv2.copyMakeBorder(kept, max(dy, 0), max(-dy, 0), max(dx, 0), max(-dx, 0), cv2.BORDER_CONSTANT, value=0)


def _rotate(image: np.ndarray, degrees: float, interpolation: Inter) -> np.ndarray:
    """Counter-clockwise about the center of the image, the image size kept (PIL's rotate)."""
    height, width = image.shape[:2]
    return _warp(image, cv2.getRotationMatrix2D((width / 2, height / 2), degrees, 1.0), interpolation)


def _grayscale(image: np.ndarray) -> np.ndarray:
    """ITU-R 601-2 luma, rounded (PIL's convert('L'))."""
    return cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)


# PIL's blend (ImageEnhance) truncates its float result; OpenCV rounds. floor(y) is the rounding of
# y - 0.5 + 1/1024: y >= 0 never rounds down past its floor, and only a y within 1/1024 below an
# integer, where float error decides in PIL too, rounds up.
_TRUNCATE = -0.5 + 1 / 1024


def _blend(image: np.ndarray, degenerate: np.ndarray, factor: float) -> np.ndarray:
    """PIL's blend as ImageEnhance calls it: degenerate + factor * (image - degenerate), truncated
    and clipped."""
    return cv2.addWeighted(image, factor, degenerate, 1.0 - factor, _TRUNCATE)


def _brightness(image: np.ndarray, factor: float) -> np.ndarray:
    """Blend with black: the image scaled by the factor."""
    # convertScaleAbs is one saturated pass; the clamp keeps its abs() from mirroring
    return cv2.convertScaleAbs(image, alpha=max(factor, 0.0), beta=_TRUNCATE)


def _color(image: np.ndarray, factor: float) -> np.ndarray:
    """Saturation: blend with the grayscale image."""
    return _blend(image, cv2.cvtColor(_grayscale(image), cv2.COLOR_GRAY2RGB), factor)


def _contrast(image: np.ndarray, factor: float) -> np.ndarray:
    """Blend with the mean of the grayscale image, rounded to a gray level as PIL does."""
    mean = round(cv2.mean(_grayscale(image))[0])
    return cv2.addWeighted(image, factor, image, 0.0, (1.0 - factor) * mean + _TRUNCATE)


def _sharpness(image: np.ndarray, factor: float) -> np.ndarray:
    """Blend with the image smoothed by PIL's SMOOTH kernel (rounded to gray levels, as PIL's
    filter does); PIL smooths the interior only, so the border pixels stay as they are."""
    if min(image.shape[:2]) <= 2:
        return image.copy()
    smooth = cv2.filter2D(image, -1, _SMOOTH, borderType=cv2.BORDER_REPLICATE)
    smooth[0], smooth[-1], smooth[:, 0], smooth[:, -1] = image[0], image[-1], image[:, 0], image[:, -1]
    return _blend(image, smooth, factor)


def _posterize(image: np.ndarray, bits: int) -> np.ndarray:
    """Keep the top `bits` bits of every value."""
    mask = (0xFF << (8 - bits)) & 0xFF
    return cv2.bitwise_and(image, (mask,) * 4)


def _solarize(image: np.ndarray, threshold: float) -> np.ndarray:
    """Invert the values >= threshold: 255 - v is v xor 0xFF, so xor with a 0/255 mask."""
    # x >= t  <=>  x > ceil(t) - 1 for integer x; cv2.threshold handles levels below 0 and above 255
    mask = cv2.threshold(image, math.ceil(threshold) - 1, 255, cv2.THRESH_BINARY)[1]
    return cv2.bitwise_xor(image, mask)


def _autocontrast_channel(channel: np.ndarray) -> np.ndarray:
    """Stretch min..max to 0..255 as PIL does (its table truncates); kept where min == max."""
    low, high = cv2.minMaxLoc(channel)[:2]
    if low == high:
        return channel
    scale = 255.0 / (high - low)
    # floor(y) as a rounding of y - 0.5 + 1/512: y's fractions are multiples of 1 / (high - low) >= 1/255,
    # so nothing lies within 1/512 of a rounding edge and float32 error cannot tip one
    return cv2.convertScaleAbs(channel, alpha=scale, beta=-low * scale - 0.5 + 1 / 512)


def _autocontrast(image: np.ndarray) -> np.ndarray:
    """AutoContrast of each channel."""
    return cv2.merge([_autocontrast_channel(channel) for channel in cv2.split(image)])


def _equalize_tables(histograms: np.ndarray) -> np.ndarray:
    """PIL's (and torchvision's) equalize LUT of each channel (channels x 256 histograms -> 256 x
    channels): the pixels below each level in steps of (pixels below the top level) / 255;
    identity for a channel whose step is 0."""
    cumulative = np.cumsum(histograms, axis=1, dtype=np.int64)
    # the pixels below the top level: the largest running count short of the total
    steps = np.where(cumulative < cumulative[:, -1:], cumulative, 0).max(axis=1, keepdims=True) // 255
    below = cumulative - histograms.astype(np.int64)
    tables = np.minimum((below + steps // 2) // np.maximum(steps, 1), 255)
    return np.where(steps == 0, _LEVELS, tables).T.astype(np.uint8, order="C")


def _equalize(image: np.ndarray) -> np.ndarray:
    """Histogram equalization of each channel, through one per-channel LUT."""
    histograms = np.stack([cv2.calcHist([image], [c], None, [256], [0, 256])[:, 0] for c in range(image.shape[2])])
    return cv2.LUT(image, _equalize_tables(histograms).reshape(256, 1, -1))


def apply_op(image: np.ndarray, name: str, magnitude: float, interpolation: Inter = Inter.BILINEAR) -> np.ndarray:
    """One operation with an explicit magnitude on a uint8 HWC RGB image (signed magnitudes for the
    geometric and enhance operations; bits for Posterize; the threshold for Solarize). Returns a
    new contiguous uint8 array of the same shape (Identity returns the image itself)."""
    if name == "Identity":
        return image
    if name == "ShearX":
        return _shear(image, magnitude, 0.0, interpolation)
    if name == "ShearY":
        return _shear(image, 0.0, magnitude, interpolation)
    if name == "TranslateX":
        return _translate(image, magnitude, 0.0)
    if name == "TranslateY":
        return _translate(image, 0.0, magnitude)
    if name == "Rotate":
        return _rotate(image, float(magnitude), interpolation)
    if name == "Brightness":
        return _brightness(image, 1.0 + magnitude)
    if name == "Color":
        return _color(image, 1.0 + magnitude)
    if name == "Contrast":
        return _contrast(image, 1.0 + magnitude)
    if name == "Sharpness":
        return _sharpness(image, 1.0 + magnitude)
    if name == "Posterize":
        return _posterize(image, int(magnitude))
    if name == "Solarize":
        return _solarize(image, float(magnitude))
    if name == "AutoContrast":
        return _autocontrast(image)
    if name == "Equalize":
        return _equalize(image)
    if name == "Invert":
        return cv2.bitwise_not(image)
    raise ValueError(f"unknown augmentation operation {name}")


def _signed(name: str, magnitude: float, rng: np.random.Generator) -> float:
    return -magnitude if name in SIGNED_OPS and rng.random() < 0.5 else magnitude


def _magnitude(table: Dict[str, np.ndarray], name: str, magnitude_bin: Optional[int]) -> float:
    return float(table[name][magnitude_bin]) if name in table and magnitude_bin is not None else 0.0


class AutoAugment:
    """One of the paper's sub-policies at random; each of its steps applied with its probability."""

    def __init__(self, policy: str, interpolation: Inter = Inter.BILINEAR):
        self.sub_policies = parse_policy_table(_POLICY_TABLES[policy])
        self.interpolation = interpolation

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        table = _cached_bins("standard", 10, *image.shape[:2])
        for name, probability, magnitude_bin in self.sub_policies[rng.integers(len(self.sub_policies))]:
            if rng.random() < probability:
                magnitude = _signed(name, _magnitude(table, name, magnitude_bin), rng)
                image = apply_op(image, name, magnitude, self.interpolation)
        return image


class RandAugment:
    """`num_ops` operations drawn uniformly, each at the fixed `magnitude` bin of 31, random sign."""

    def __init__(self, num_ops: int = 2, magnitude: int = 9, interpolation: Inter = Inter.BILINEAR):
        self.num_ops, self.magnitude, self.interpolation = num_ops, magnitude, interpolation

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        table = _cached_bins("standard", RA_BINS, *image.shape[:2])
        for _ in range(self.num_ops):
            name = BASIC_OPS[rng.integers(len(BASIC_OPS))]
            magnitude = _signed(name, _magnitude(table, name, self.magnitude), rng)
            image = apply_op(image, name, magnitude, self.interpolation)
        return image


class TrivialAugmentWide:
    """One operation drawn uniformly, at a magnitude bin drawn uniformly from 31, random sign."""

    def __init__(self, interpolation: Inter = Inter.BILINEAR):
        self.interpolation = interpolation

    def draw(self, rng: np.random.Generator) -> Tuple[str, int]:
        """The operation and magnitude bin for one sample."""
        return BASIC_OPS[rng.integers(len(BASIC_OPS))], int(rng.integers(RA_BINS))

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        name, magnitude_bin = self.draw(rng)
        magnitude = _signed(name, _magnitude(_cached_bins("wide", RA_BINS, *image.shape[:2]), name,
                                             magnitude_bin), rng)
        return apply_op(image, name, magnitude, self.interpolation)


class AugMix:
    """AugMix: `width` chains of 1-3 random operations (magnitude bins below `severity` of 11),
    mixed with Dirichlet weights, then blended with the original by a Beta(alpha, alpha) weight."""

    def __init__(self, severity: int = 3, width: int = 3, alpha: float = 1.0, interpolation: Inter = Inter.BILINEAR):
        self.severity, self.width, self.alpha, self.interpolation = severity, width, alpha, interpolation

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        table = _cached_bins("augmix", AUGMIX_BINS, *image.shape[:2])
        keep = rng.beta(self.alpha, self.alpha)
        weights = rng.dirichlet([self.alpha] * self.width)
        mixed = np.zeros(image.shape, dtype=np.float32)
        for weight in weights:
            chain = image
            for _ in range(int(rng.integers(1, 4))):
                name = AUGMIX_OPS[rng.integers(len(AUGMIX_OPS))]
                magnitude = _signed(name, _magnitude(table, name, int(rng.integers(self.severity))), rng)
                chain = apply_op(chain, name, magnitude, self.interpolation)
            mixed += weight * chain
        blended = keep * image.astype(np.float32) + (1.0 - keep) * mixed
        # truncated to uint8, as torchvision's AugMix converts its float mix back
        return np.clip(blended, 0, 255).astype(np.uint8)


def interpolation_mode(name: str) -> Inter:
    """MindSpore's interpolation for the config value `interpolation`."""
    if name not in INTERPOLATIONS:
        raise UserInputError(f"unknown interpolation '{name}'; choose one of {', '.join(INTERPOLATIONS)}")
    return INTERPOLATIONS[name]


def create_policy(name: str, *, num_ops: int = 2, magnitude: int = 9, severity: int = 3,
                  interpolation: str = "bilinear") -> Optional[Callable[[np.ndarray, np.random.Generator], np.ndarray]]:
    """The per-sample policy called `name` (config key `auto_augment`), or None for 'none'."""
    check_policy_settings(name, num_ops=num_ops, magnitude=magnitude, severity=severity)
    mode = interpolation_mode(interpolation)
    if name == "none":
        return None
    if name in _POLICY_TABLES:
        return AutoAugment(name, mode)
    if name == "ra":
        return RandAugment(num_ops, magnitude, mode)
    if name == "ta_wide":
        return TrivialAugmentWide(mode)
    return AugMix(severity, interpolation=mode)


def check_policy_settings(name: str, *, num_ops: int, magnitude: int, severity: int) -> None:
    """One-line errors naming the key for a bad policy name or parameter."""
    if name not in POLICIES:
        raise UserInputError(f"unknown auto_augment '{name}'; choose one of {', '.join(POLICIES)}")
    if not 0 <= magnitude < RA_BINS:
        raise UserInputError(f"ra_magnitude must lie in 0..{RA_BINS - 1}, got {magnitude}")
    if num_ops < 0:
        raise UserInputError(f"ra_num_ops must be >= 0, got {num_ops}")
    if not 1 <= severity <= AUGMIX_BINS - 1:
        raise UserInputError(f"augmix_severity must lie in 1..{AUGMIX_BINS - 1}, got {severity}")


def ops_in(policy: str) -> Sequence[str]:
    """The operations a policy can apply (for tests and documentation)."""
    if policy in _POLICY_TABLES:
        return sorted({step[0] for sub in parse_policy_table(_POLICY_TABLES[policy]) for step in sub})
    return AUGMIX_OPS if policy == "augmix" else BASIC_OPS
