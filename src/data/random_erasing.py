"""Random erasing (Zhong et al.), torchvision's semantics: with probability p, a rectangle of 2-33%
of the image area and aspect ratio 0.3-3.3 is set to 0 after normalization.

The box is drawn per sample from the sample's generator (so it is a pure function of the key);
the pixels are cleared later, on the normalized batch, where 0 means "the dataset mean"."""
import math
from typing import Tuple

import numpy as np

NO_BOX = (0, 0, 0, 0)


def erase_box(height: int, width: int, rng: np.random.Generator, probability: float,
              scale: Tuple[float, float] = (0.02, 0.33), ratio: Tuple[float, float] = (0.3, 3.3),
              attempts: int = 10) -> Tuple[int, int, int, int]:
    """(top, left, height, width) of the region to erase, or NO_BOX (height 0) for none."""
    if probability <= 0 or rng.random() >= probability:
        return NO_BOX
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(attempts):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        box_h = int(round(math.sqrt(target * aspect)))
        box_w = int(round(math.sqrt(target / aspect)))
        if 0 < box_h < height and 0 < box_w < width:
            top = int(rng.integers(0, height - box_h + 1))
            left = int(rng.integers(0, width - box_w + 1))
            return top, left, box_h, box_w
    return NO_BOX


def erase(images: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Zero each image's box in a normalized NCHW batch (in place; returns the batch)."""
    for image, (top, left, box_h, box_w) in zip(images, boxes):
        if box_h:
            image[:, top:top + box_h, left:left + box_w] = 0.0
    return images
