"""Class names of a dataset or a labels file, as training labels the classes and predictions name them."""
import os
from typing import List

from src.errors import UserInputError


def read_class_names(source: str) -> List[str]:
    """Class names from a text file (one per line), a folder of class folders (sorted, as the
    dataset labels them; its train/ split when it has one) or a CIFAR-10 folder (batches.meta.txt)."""
    if os.path.isfile(source):
        with open(source, encoding="utf-8") as handle:
            names = [line.strip() for line in handle if line.strip()]
    elif os.path.isdir(source):
        meta = os.path.join(source, "batches.meta.txt")
        split = os.path.join(source, "train")
        folder = split if os.path.isdir(split) else source
        if os.path.isfile(meta):
            return read_class_names(meta)
        names = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
    else:
        raise UserInputError(f"labels not found: {source}; pass a text file with one class name per "
                             f"line or the dataset folder holding one sub-folder per class")
    if not names:
        raise UserInputError(f"no class names in {source}; expected one name per line or class sub-folders")
    return names
