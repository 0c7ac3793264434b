"""The two references the augmentation operations (src/data/auto_augment.py) answer to, each with
the same explicit parameters as `apply_op`:

- `torchvision_op`: the operation's definition as torchvision's policies apply it to a PIL image
  (torchvision's reference training feeds PIL images): the policies' affine matrices (shear about
  the top-left corner of the pixel grid, rotation about the image center, whole-pixel translation,
  black fill) through PIL's transform, PIL's ImageEnhance for brightness, color, contrast and
  sharpness, PIL's ImageOps for posterize, solarize, autocontrast, equalize and invert.
- `mindspore_op`: the MindSpore vision operations the OpenCV code replaced, kept as the second
  reference so the tables show how far those operations are from torchvision's definition.

`compare` measures an operation against a reference on a set of images; `fidelity_rows` does so
for every operation of the four policies at their lowest, a middle and the highest magnitude bin
and both signs, which is both the fidelity table and the suite's guard. `torchvision_erase_boxes`
and `torchvision_mixes` draw random erasing and mixup/CutMix as torchvision does, to compare the
distributions. `python -m src.migration.augment_reference` prints the tables (docs/recipe_fidelity.md).
"""
import math
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
from mindspore.dataset import vision
from mindspore.dataset.vision import Inter
from PIL import Image, ImageEnhance, ImageOps

from src.data.auto_augment import AUGMIX_BINS, AUGMIX_OPS, BASIC_OPS, RA_BINS, SIGNED_OPS, magnitude_bins

Operation = Callable[[np.ndarray, str, float, Inter], np.ndarray]
_PIL_RESAMPLE = {Inter.BILINEAR: Image.BILINEAR, Inter.NEAREST: Image.NEAREST, Inter.BICUBIC: Image.BICUBIC}
_ENHANCERS = {"Brightness": ImageEnhance.Brightness, "Color": ImageEnhance.Color,
              "Contrast": ImageEnhance.Contrast, "Sharpness": ImageEnhance.Sharpness}
# The magnitude spaces and their bin counts: AutoAugment's 10 bins span the same ranges as RandAugment's 31.
SPACES = {"standard": RA_BINS, "wide": RA_BINS, "augmix": AUGMIX_BINS}


def torchvision_op(image: np.ndarray, name: str, magnitude: float, interpolation: Inter = Inter.BILINEAR
                   ) -> np.ndarray:
    """The operation as torchvision's autoaugment `_apply_op` defines it on a PIL image."""
    picture = Image.fromarray(image)
    resample = _PIL_RESAMPLE[interpolation]
    # PIL's AFFINE data map each output point to its input point, in coordinates whose origin is
    # the top-left corner of the pixel grid (pixel centers at +0.5), as torchvision's inverse
    # matrices are written.
    affine = {"ShearX": (1, magnitude, 0, 0, 1, 0), "ShearY": (1, 0, 0, magnitude, 1, 0),
              "TranslateX": (1, 0, -int(magnitude), 0, 1, 0), "TranslateY": (1, 0, 0, 0, 1, -int(magnitude))}
    if name == "Identity":
        out = picture
    elif name in affine:
        out = picture.transform(picture.size, Image.AFFINE, affine[name], resample, fillcolor=(0, 0, 0))
    elif name == "Rotate":
        out = picture.rotate(magnitude, resample, fillcolor=(0, 0, 0))
    elif name in _ENHANCERS:
        out = _ENHANCERS[name](picture).enhance(1.0 + magnitude)
    elif name == "Posterize":
        # Pillow refuses 0 bits; torchvision's tensor definition keeps no bit: black
        out = ImageOps.posterize(picture, int(magnitude)) if int(magnitude) else Image.new("RGB", picture.size)
    elif name == "Solarize":
        out = ImageOps.solarize(picture, magnitude)
    elif name == "AutoContrast":
        out = ImageOps.autocontrast(picture)
    elif name == "Equalize":
        out = ImageOps.equalize(picture)
    elif name == "Invert":
        out = ImageOps.invert(picture)
    else:
        raise ValueError(f"unknown augmentation operation {name}")
    return np.asarray(out)


def mindspore_op(image: np.ndarray, name: str, magnitude: float, interpolation: Inter = Inter.BILINEAR
                 ) -> np.ndarray:
    """The operation as MindSpore's deterministic vision operations computed it before the OpenCV
    rewrite (Affine shears about the image center, so a translation moved the center back)."""
    height, width = image.shape[:2]
    if name == "Identity":
        return image
    if name in ("ShearX", "ShearY"):
        shear_x, shear_y = (magnitude, 0.0) if name == "ShearX" else (0.0, magnitude)
        translate = [-shear_x * (height - 1) / 2 / width, -shear_y * (width - 1) / 2 / height]
        shear = [math.degrees(math.atan(shear_x)), math.degrees(math.atan(shear_y))]
        return vision.Affine(0.0, translate, 1.0, shear, interpolation)(image)
    if name in ("TranslateX", "TranslateY"):
        dx, dy = (float(int(magnitude)), 0.0) if name == "TranslateX" else (0.0, float(int(magnitude)))
        if abs(dx) >= width or abs(dy) >= height:
            return np.zeros_like(image)
        return vision.Affine(0.0, [dx / width, dy / height], 1.0, [0.0, 0.0], interpolation)(image)
    simple = {"Rotate": lambda: vision.Rotate(float(magnitude), resample=interpolation),
              "Brightness": lambda: vision.AdjustBrightness(1.0 + magnitude),
              "Color": lambda: vision.AdjustSaturation(1.0 + magnitude),
              "Contrast": lambda: vision.AdjustContrast(1.0 + magnitude),
              "Sharpness": lambda: vision.AdjustSharpness(1.0 + magnitude),
              "Posterize": lambda: vision.Posterize(int(magnitude)),
              "Solarize": lambda: vision.Solarize(float(magnitude)),
              "AutoContrast": vision.AutoContrast, "Equalize": vision.Equalize, "Invert": vision.Invert}
    if name not in simple:
        raise ValueError(f"unknown augmentation operation {name}")
    return simple[name]()(image)


@dataclass(frozen=True)
class Difference:
    """How far an operation's outputs lie from a reference's over a set of images, in gray levels."""
    mean: float         # mean absolute difference
    max: int            # largest absolute difference
    beyond_one: float   # share of values more than one level apart (rounding moves a value by one)


def compare(operation: Operation, reference: Operation, images: Sequence[np.ndarray], name: str,
            magnitude: float, interpolation: Inter = Inter.BILINEAR) -> Difference:
    """`operation` against `reference` with the same parameters on every image."""
    gaps = [np.abs(operation(image, name, magnitude, interpolation).astype(np.int16)
                   - reference(image, name, magnitude, interpolation).astype(np.int16)) for image in images]
    every = np.concatenate([gap.ravel() for gap in gaps])
    return Difference(float(every.mean()), int(every.max()), float((every > 1).mean()))


GEOMETRIC = ("ShearX", "ShearY", "Rotate")


def within_tolerance(name: str, difference: Difference) -> bool:
    """Whether an operation's Difference from torchvision's definition is rounding only. Warps
    sample between pixels, where OpenCV's bilinear weights step in 1/32 of a pixel and PIL's do not:
    a few levels on sharp edges (measured: mean <= 0.5, max 4, <= 3% of values beyond one level).
    Every other operation computes the same integers, up to one level where PIL's float
    arithmetic rounds differently (measured: mean <= 0.002)."""
    if name in GEOMETRIC:
        return difference.mean <= 0.7 and difference.max <= 8 and difference.beyond_one <= 0.05
    return difference.mean <= 0.01 and difference.max <= 1


@dataclass(frozen=True)
class Case:
    """One operation at one magnitude: its space, bin and sign, and the magnitude they give."""
    name: str
    space: str
    magnitude_bin: int
    sign: int
    magnitude: float


def cases(height: int, width: int, spaces: Iterable[str] = tuple(SPACES)) -> List[Case]:
    """Every operation of the policies at the lowest, a middle and the highest bin of each space it
    has magnitudes in, both signs where the sign is drawn; operations without magnitude once. A
    magnitude that two spaces share is one case, its space named 'standard+augmix'."""
    found: Dict[tuple, Case] = {}
    for space in spaces:
        bins = SPACES[space]
        table = magnitude_bins(space, bins, height, width)
        names = AUGMIX_OPS if space == "augmix" else BASIC_OPS + ("Invert",)
        for name in names:
            if name not in table:
                found.setdefault((name,), Case(name, "-", 0, 1, 0.0))
                continue
            for magnitude_bin in (0, bins // 2, bins - 1):
                unsigned = float(table[name][magnitude_bin])
                for sign in ((1, -1) if name in SIGNED_OPS and unsigned else (1,)):
                    magnitude = sign * unsigned
                    key = (name, round(magnitude, 9))
                    if key in found:
                        seen = found[key]
                        if space not in seen.space.split("+"):
                            found[key] = Case(name, f"{seen.space}+{space}", seen.magnitude_bin, sign, magnitude)
                    else:
                        found[key] = Case(name, space, magnitude_bin, sign, magnitude)
    return list(found.values())


def fidelity_rows(operation: Operation, images: Sequence[np.ndarray], references: Dict[str, Operation],
                  interpolation: Inter = Inter.BILINEAR) -> List[Dict]:
    """One row per case of `cases`: the case and its Difference from each reference (None where
    the reference refuses the parameters, as MindSpore's Posterize refuses 0 bits)."""
    height, width = images[0].shape[:2]
    rows = []
    for case in cases(height, width):
        row = {"op": case.name, "space": case.space, "bin": case.magnitude_bin, "sign": case.sign,
               "magnitude": round(case.magnitude, 4)}
        for label, reference in references.items():
            try:
                row[label] = compare(operation, reference, images, case.name, case.magnitude, interpolation)
            except ValueError:
                row[label] = None
        rows.append(row)
    return rows


# ---------------------------------------------------------------- erasing and mixing, as distributions

def torchvision_erase_boxes(count: int, height: int, width: int, probability: float, seed: int,
                            scale=(0.02, 0.33), ratio=(0.3, 3.3)) -> np.ndarray:
    """`count` draws of torchvision's RandomErasing.get_params (torch's generator): (top, left,
    height, width), height 0 where nothing is erased."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    log_ratio = torch.log(torch.tensor(ratio))
    boxes = np.zeros((count, 4), np.int64)
    for row in range(count):
        if torch.rand(1, generator=generator).item() >= probability:
            continue
        for _ in range(10):
            erase_area = height * width * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
            aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
            box_h, box_w = int(round(math.sqrt(erase_area * aspect))), int(round(math.sqrt(erase_area / aspect)))
            if box_h < height and box_w < width:
                top = torch.randint(0, height - box_h + 1, (1,), generator=generator).item()
                left = torch.randint(0, width - box_w + 1, (1,), generator=generator).item()
                boxes[row] = (top, left, box_h, box_w)
                break
    return boxes


def torchvision_mixes(count: int, height: int, width: int, mixup_alpha: float, cutmix_alpha: float,
                      seed: int) -> np.ndarray:
    """`count` draws of torchvision's RandomChoice([MixUp(mixup_alpha), CutMix(cutmix_alpha)]) as
    rows of the `mix` column (src/data/host_stage.py MIX_FIELDS)."""
    import torch
    rows = np.zeros((count, 8), np.float64)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        mixup, cutmix = (torch.distributions.Beta(torch.tensor([a]), torch.tensor([a]))
                         for a in (mixup_alpha, cutmix_alpha))
        for row in range(count):
            if torch.randint(2, (1,)).item() == 0:
                lam = float(mixup.sample())
                rows[row] = (lam, 1 - lam, lam, 1 - lam, 0, 0, 0, 0)
                continue
            lam = float(cutmix.sample())
            center_x, center_y = torch.randint(width, (1,)).item(), torch.randint(height, (1,)).item()
            half = 0.5 * math.sqrt(1.0 - lam)
            half_w, half_h = int(half * width), int(half * height)
            x1, y1 = max(center_x - half_w, 0), max(center_y - half_h, 0)
            x2, y2 = min(center_x + half_w, width), min(center_y + half_h, height)
            kept = 1.0 - (x2 - x1) * (y2 - y1) / (width * height)
            rows[row] = (1, 0, kept, 1 - kept, y1, x1, y2, x2)
    return rows


def erase_statistics(boxes: np.ndarray, height: int, width: int) -> Dict[str, np.ndarray]:
    """What defines erasing's distribution: whether a sample is erased, and the erased boxes'
    area (share of the image) and aspect (log of height / width)."""
    erased = boxes[boxes[:, 2] > 0]
    return {"erased": (boxes[:, 2] > 0).astype(np.float64),
            "area": erased[:, 2] * erased[:, 3] / (height * width),
            "log_aspect": np.log(erased[:, 2] / erased[:, 3])}


def mix_statistics(mixes: np.ndarray, height: int, width: int) -> Dict[str, np.ndarray]:
    """What defines mixing's distribution: whether a batch uses CutMix, mixup's weight, CutMix's
    target weight (the area kept) and its box's center."""
    cut = mixes[:, 0] == 1.0
    boxes = mixes[cut][:, 4:]
    return {"cutmix": cut.astype(np.float64), "mixup_lambda": mixes[~cut][:, 0],
            "cutmix_kept": mixes[cut][:, 2],
            "cutmix_box_rows": (boxes[:, 2] - boxes[:, 0]) / height,
            "cutmix_box_center_y": (boxes[:, 0] + boxes[:, 2]) / (2 * height)}


def ks_distance(first: np.ndarray, second: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    values = np.sort(np.concatenate([first, second]))
    cdf_first = np.searchsorted(np.sort(first), values, side="right") / len(first)
    cdf_second = np.searchsorted(np.sort(second), values, side="right") / len(second)
    return float(np.abs(cdf_first - cdf_second).max())


def distribution_rows(ours: Dict[str, np.ndarray], theirs: Dict[str, np.ndarray]) -> List[Dict]:
    """Per statistic: both means and the KS distance between the two samples."""
    return [{"statistic": key, "ours": float(ours[key].mean()), "torchvision": float(theirs[key].mean()),
             "ks": ks_distance(ours[key], theirs[key]), "draws": (len(ours[key]), len(theirs[key]))}
            for key in ours]


# ---------------------------------------------------------------- the fidelity report

def photographs(size: int) -> List[np.ndarray]:
    """Real photographs that packages ship (matplotlib's portrait; scikit-learn's two views where it
    is installed), center-cropped square and resized to size x size with area averaging."""
    import cv2

    from src.data.photo_data import real_photograph
    pictures = [real_photograph()]
    try:
        from sklearn.datasets import load_sample_images
        pictures += [Image.fromarray(image) for image in load_sample_images().images]
    except ImportError:
        pass
    out = []
    for picture in pictures:
        array = np.asarray(picture)
        side = min(array.shape[:2])
        top, left = (array.shape[0] - side) // 2, (array.shape[1] - side) // 2
        out.append(cv2.resize(array[top:top + side, left:left + side], (size, size), interpolation=cv2.INTER_AREA))
    return out


def _cell(difference) -> str:
    return "n/a" if difference is None else f"{difference.mean:.3f} / {difference.max} / {difference.beyond_one:.2%}"


def measure_operations(sizes: Sequence[int] = (224, 32)) -> Dict[int, List[Dict]]:
    """fidelity_rows of this repository's operations on the photographs at each size, against
    torchvision's definition and MindSpore's operations."""
    from src.data.auto_augment import apply_op
    references = {"torchvision": torchvision_op, "mindspore": mindspore_op}
    return {size: fidelity_rows(apply_op, photographs(size), references) for size in sizes}


def operation_table(by_size: Dict[int, List[Dict]]) -> List[str]:
    """Markdown rows: every case at every size, against both references."""
    sizes = list(by_size)
    header = f"| op | space | bin | sign | magnitude (at {sizes[0]} px) | " + " | ".join(
        f"{size} px vs torchvision | {size} px vs MindSpore" for size in sizes) + " |"
    lines = [header, "|" + "---|" * (5 + 2 * len(sizes))]
    for index, row in enumerate(by_size[sizes[0]]):
        cells = [row["op"], row["space"], str(row["bin"]), "+" if row["sign"] > 0 else "-", f"{row['magnitude']:g}"]
        for size in sizes:
            other = by_size[size][index]
            cells += [_cell(other["torchvision"]), _cell(other["mindspore"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary_table(by_size: Dict[int, List[Dict]]) -> List[str]:
    """Markdown rows: per operation, its worst case at any size and magnitude against each reference
    (largest mean, largest max, largest share beyond one level, each over every case), and whether
    the torchvision difference is within `within_tolerance`."""
    worst: Dict[str, Dict[str, List]] = {}
    for rows in by_size.values():
        for row in rows:
            for label in ("torchvision", "mindspore"):
                difference = row[label]
                if difference is not None:
                    worst.setdefault(row["op"], {}).setdefault(label, []).append(difference)
    lines = ["| op | vs torchvision: mean / max / beyond one level | rounding only | "
             "vs MindSpore (before the rewrite) |", "|---|---|---|---|"]
    for name, by_label in worst.items():
        cells = []
        for label in ("torchvision", "mindspore"):
            found = by_label[label]
            cells.append(f"{max(d.mean for d in found):.3f} / {max(d.max for d in found)} / "
                         f"{max(d.beyond_one for d in found):.2%}")
        ok = all(within_tolerance(name, difference) for difference in by_label["torchvision"])
        lines.append(f"| {name} | {cells[0]} | {'yes' if ok else 'NO'} | {cells[1]} |")
    return lines


def distribution_table(draws: int = 20000, size: int = 224, seed: int = 0) -> List[str]:
    """Markdown rows: random erasing (p 0.25) and mixup 0.2 / CutMix 1.0 as this repository draws
    them and as torchvision does, `draws` times each."""
    from src.data.batch_mixing import draw_mix
    from src.data.random_erasing import erase_box
    ours_boxes = np.array([erase_box(size, size, np.random.default_rng([seed, key]), 0.25) for key in range(draws)])
    ours_mixes = np.array([draw_mix(np.random.default_rng([seed, 1, key]), size, size, mixup_alpha=0.2,
                                    cutmix_alpha=1.0) for key in range(draws)])
    rows = distribution_rows(erase_statistics(ours_boxes, size, size),
                             erase_statistics(torchvision_erase_boxes(draws, size, size, 0.25, seed), size, size))
    rows += distribution_rows(mix_statistics(ours_mixes, size, size),
                              mix_statistics(torchvision_mixes(draws, size, size, 0.2, 1.0, seed), size, size))
    lines = ["| statistic | mean here | mean torchvision | KS distance | draws (here, torchvision) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['statistic']} | {r['ours']:.4f} | {r['torchvision']:.4f} | {r['ks']:.4f} | "
              f"{r['draws'][0]}, {r['draws'][1]} |" for r in rows]
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description="Every augmentation operation against torchvision's definition "
                                     "and MindSpore's operations (mean / max absolute difference in gray levels / "
                                     "share of values more than one level apart), and erasing and mixing as "
                                     "distributions against torchvision's.")
    parser.add_argument("--sizes", nargs="+", type=int, default=[224, 32], help="image sizes")
    parser.add_argument("--draws", type=int, default=20000, help="draws of erasing and mixing")
    parser.add_argument("--full", action="store_true", help="every case, not only each operation's worst")
    args = parser.parse_args(argv)
    by_size = measure_operations(args.sizes)
    print("\n".join(summary_table(by_size)))
    if args.full:
        print()
        print("\n".join(operation_table(by_size)))
    print()
    print("\n".join(distribution_table(args.draws)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
