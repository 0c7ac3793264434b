"""Per-sample augmentation policies: AutoAugment (imagenet / cifar10 / svhn), RandAugment,
TrivialAugmentWide and AugMix, with torchvision's names, operations, magnitude bins and signs.

A policy is called with a uint8 HWC image and the sample's generator. It draws only its choices
from the generator (which operation, which magnitude bin, which sign, whether to apply) and does
the pixel work with MindSpore's deterministic vision operations called with explicit parameters,
so the output is a pure function of (seed, epoch, sample index) like the rest of the pipeline.
"""
import math
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import mindspore.dataset.vision as vision
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


def _shear(image: np.ndarray, shear_x: float, shear_y: float, interpolation: Inter) -> np.ndarray:
    """Shear about the top-left corner (as torchvision's policies do): MindSpore's Affine shears
    about the image center, so the shift of the center row/column is undone by a translation."""
    height, width = image.shape[:2]
    translate = [-shear_x * (height - 1) / 2 / width, -shear_y * (width - 1) / 2 / height]
    return vision.Affine(0.0, translate, 1.0, [math.degrees(math.atan(shear_x)), math.degrees(math.atan(shear_y))],
                         interpolation)(image)


def _translate(image: np.ndarray, dx: float, dy: float, interpolation: Inter) -> np.ndarray:
    """Shift by whole pixels (torchvision truncates the magnitude to an int); MindSpore's Affine
    takes the shift as a fraction of the image size."""
    height, width = image.shape[:2]
    dx, dy = float(int(dx)), float(int(dy))
    if abs(dx) >= width or abs(dy) >= height:
        return np.zeros_like(image)
    return vision.Affine(0.0, [dx / width, dy / height], 1.0, [0.0, 0.0], interpolation)(image)


def apply_op(image: np.ndarray, name: str, magnitude: float, interpolation: Inter = Inter.BILINEAR) -> np.ndarray:
    """One operation with an explicit magnitude on a uint8 HWC image (signed magnitudes for the
    geometric and enhance operations; bits for Posterize; the threshold for Solarize)."""
    if name == "Identity":
        return image
    if name == "ShearX":
        return _shear(image, magnitude, 0.0, interpolation)
    if name == "ShearY":
        return _shear(image, 0.0, magnitude, interpolation)
    if name == "TranslateX":
        return _translate(image, magnitude, 0.0, interpolation)
    if name == "TranslateY":
        return _translate(image, 0.0, magnitude, interpolation)
    if name == "Rotate":
        return vision.Rotate(float(magnitude), resample=interpolation)(image)
    if name == "Brightness":
        return vision.AdjustBrightness(1.0 + magnitude)(image)
    if name == "Color":
        return vision.AdjustSaturation(1.0 + magnitude)(image)
    if name == "Contrast":
        return vision.AdjustContrast(1.0 + magnitude)(image)
    if name == "Sharpness":
        return vision.AdjustSharpness(1.0 + magnitude)(image)
    if name == "Posterize":
        return vision.Posterize(int(magnitude))(image)
    if name == "Solarize":
        return vision.Solarize(float(magnitude))(image)
    if name == "AutoContrast":
        return vision.AutoContrast()(image)
    if name == "Equalize":
        return vision.Equalize()(image)
    if name == "Invert":
        return vision.Invert()(image)
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
        table = magnitude_bins("standard", 10, *image.shape[:2])
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
        table = magnitude_bins("standard", RA_BINS, *image.shape[:2])
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
        magnitude = _signed(name, _magnitude(magnitude_bins("wide", RA_BINS, *image.shape[:2]), name,
                                             magnitude_bin), rng)
        return apply_op(image, name, magnitude, self.interpolation)


class AugMix:
    """AugMix: `width` chains of 1-3 random operations (magnitude bins below `severity` of 11),
    mixed with Dirichlet weights, then blended with the original by a Beta(alpha, alpha) weight."""

    def __init__(self, severity: int = 3, width: int = 3, alpha: float = 1.0, interpolation: Inter = Inter.BILINEAR):
        self.severity, self.width, self.alpha, self.interpolation = severity, width, alpha, interpolation

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        table = magnitude_bins("augmix", AUGMIX_BINS, *image.shape[:2])
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
        return np.clip(np.rint(blended), 0, 255).astype(np.uint8)


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
