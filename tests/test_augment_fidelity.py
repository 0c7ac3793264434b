"""The augmentation recipe against its definitions: every operation of the four policies against
torchvision's (PIL's) at the lowest, a middle and the highest magnitude bin and both signs, and
random erasing and mixup/CutMix as distributions against torchvision's draws. Planted defects show
that the checks fail when an operation drifts."""
import copy
import functools

import numpy as np
import pytest

from conftest import needs_torch
from src.data.auto_augment import apply_op, magnitude_bins
from src.data.batch_mixing import draw_mix
from src.data.random_erasing import erase_box
from src.migration.augment_reference import (
    SPACES,
    cases,
    compare,
    distribution_rows,
    erase_statistics,
    fidelity_rows,
    mix_statistics,
    photographs,
    torchvision_erase_boxes,
    torchvision_mixes,
    torchvision_op,
    within_tolerance,
)

SIZES = (32, 64)
DRAWS = 6000


@functools.lru_cache(maxsize=None)
def images(size):
    return tuple(photographs(size))


def failing_ops(operation, size):
    rows = fidelity_rows(operation, images(size), {"torchvision": torchvision_op})
    return {row["op"] for row in rows if not within_tolerance(row["op"], row["torchvision"])}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", cases(32, 32), ids=lambda c: f"{c.name}-{c.space}-{c.magnitude_bin}-{c.sign}")
def test_each_operation_equals_torchvision_up_to_rounding(case, size):
    # the magnitude at this size (translations scale with the image)
    space = case.space.split("+")[0]
    table = magnitude_bins(space, SPACES[space], size, size) if space != "-" else {}
    magnitude = case.sign * float(table[case.name][case.magnitude_bin]) if case.name in table else 0.0
    difference = compare(apply_op, torchvision_op, images(size), case.name, magnitude)
    assert within_tolerance(case.name, difference), difference


def test_a_flipped_shear_sign_is_found():
    def flipped(image, name, magnitude, interpolation):
        return apply_op(image, name, -magnitude if name == "ShearX" else magnitude, interpolation)
    assert failing_ops(flipped, 32) == {"ShearX"}


def test_a_rounded_blend_and_a_moved_rotation_center_are_found():
    import cv2

    def defective(image, name, magnitude, interpolation):
        if name == "Brightness":  # rounding where PIL truncates: half a level on average
            return cv2.convertScaleAbs(image, alpha=1.0 + magnitude)
        if name == "Rotate":  # about the center of the top-left pixel instead of the image's
            height, width = image.shape[:2]
            matrix = cv2.getRotationMatrix2D(((width - 1) / 2, (height - 1) / 2), magnitude, 1.0)
            return cv2.warpAffine(image, matrix, (width, height), flags=cv2.INTER_LINEAR)
        return apply_op(image, name, magnitude, interpolation)
    assert failing_ops(defective, 64) == {"Brightness", "Rotate"}


def erase_rows(erase_draw, size=224):
    ours = np.array([erase_draw(np.random.default_rng([0, key])) for key in range(DRAWS)])
    theirs = torchvision_erase_boxes(DRAWS, size, size, 0.25, seed=0)
    return distribution_rows(erase_statistics(ours, size, size), erase_statistics(theirs, size, size))


def check_distribution(rows):
    """The statistics whose samples differ beyond chance: rates by more than 4 standard errors,
    the rest by a KS distance that a true match exceeds with probability 0.001."""
    bad = []
    for row in rows:
        if row["statistic"] in ("erased", "cutmix"):  # rates: within 4 standard errors
            n = row["draws"][0]
            spread = 4 * np.sqrt(row["torchvision"] * (1 - row["torchvision"]) * 2 / n)
            if abs(row["ours"] - row["torchvision"]) > spread:
                bad.append(row["statistic"])
        elif row["ks"] >= 1.95 * np.sqrt(sum(row["draws"]) / (row["draws"][0] * row["draws"][1])):
            bad.append(row["statistic"])
    return bad


@needs_torch
def test_erase_boxes_are_distributed_as_torchvision_draws_them():
    assert check_distribution(erase_rows(lambda rng: erase_box(224, 224, rng, 0.25))) == []


@needs_torch
def test_a_wider_erase_area_range_is_found():
    assert check_distribution(erase_rows(lambda rng: erase_box(224, 224, rng, 0.25, scale=(0.02, 0.5)))) == ["area"]


def mix_rows(mix_draw, size=224):
    ours = np.array([mix_draw(np.random.default_rng([0, 1, key])) for key in range(DRAWS)])
    theirs = torchvision_mixes(DRAWS, size, size, 0.2, 1.0, seed=0)
    return distribution_rows(mix_statistics(ours, size, size), mix_statistics(theirs, size, size))


@needs_torch
def test_mixup_and_cutmix_are_distributed_as_torchvision_draws_them():
    rows = mix_rows(lambda rng: draw_mix(rng, 224, 224, mixup_alpha=0.2, cutmix_alpha=1.0))
    assert check_distribution(rows) == []


@needs_torch
def test_cutmix_without_the_lambda_correction_is_found():
    def uncorrected(rng):
        start = copy.deepcopy(rng.bit_generator.state)
        mix = draw_mix(rng, 224, 224, mixup_alpha=0.2, cutmix_alpha=1.0)
        if mix[0] == 1.0:  # CutMix: weigh the targets by the lambda drawn, not by the area pasted
            rng.bit_generator.state = start
            rng.random()  # the mixup-or-CutMix coin
            lam = rng.beta(1.0, 1.0)
            mix[2:4] = lam, 1 - lam
        return mix
    assert "cutmix_kept" in check_distribution(mix_rows(uncorrected))
