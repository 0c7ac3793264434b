"""Input data: per-sample sources' building blocks (JPEG decoding, augmentation policies, erasing,
batch mixing, unreadable-sample handling) and the generated sample and photo datasets."""
