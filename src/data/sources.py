"""Where samples come from: CIFAR-10 binary files and class folders. A source has `labels`,
`class_names`, `len()`, `load(index)` (the raw image: pixels, or an opened file the transform
decodes) and `check(index)` (decode it whole, for --check_data)."""
import glob
import os
from typing import List

import numpy as np

from src.data.class_names import read_class_names
from src.data.image_decode import crop_resize, open_image
from src.errors import UserInputError

CIFAR_SIDE = 32
CIFAR_RECORD_BYTES = 1 + CIFAR_SIDE * CIFAR_SIDE * 3
# CIFAR-10's labels 0..9 (batches.meta.txt of the binary release), for a folder without that file
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class CifarBinarySource:
    """Images and labels from CIFAR-10 binary files (any record count)."""

    def __init__(self, data_path: str, training: bool):
        folder = _cifar_folder(data_path)
        pattern = "data_batch_*.bin" if training else "test_batch.bin"
        files = sorted(glob.glob(os.path.join(folder, pattern)))
        if not files:
            wanted = "data_batch_1.bin ... data_batch_5.bin" if training else "test_batch.bin"
            raise UserInputError(f"no CIFAR-10 {'training' if training else 'test'} file ({wanted}) in "
                                 f"{folder}; point data_path at the folder cifar-10-batches-bin")
        records = [self._read(path) for path in files]
        data = np.concatenate(records)
        self.labels = data[:, 0].astype(np.int32)
        self.images = data[:, 1:].reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE).transpose(0, 2, 3, 1)
        self.images = np.ascontiguousarray(self.images)
        meta = os.path.join(folder, "batches.meta.txt")
        self.class_names = read_class_names(meta) if os.path.isfile(meta) else list(CIFAR10_CLASSES)

    @staticmethod
    def _read(path: str) -> np.ndarray:
        size = os.path.getsize(path)
        if size == 0 or size % CIFAR_RECORD_BYTES:
            raise UserInputError(f"{path} is not a CIFAR-10 binary file: {size} bytes is not a whole "
                                 f"number of {CIFAR_RECORD_BYTES}-byte records; re-extract the dataset")
        return np.fromfile(path, dtype=np.uint8).reshape(-1, CIFAR_RECORD_BYTES)

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, index: int) -> np.ndarray:
        return self.images[index]

    def check(self, index: int) -> None:
        """Records are raw pixels: nothing to decode."""


def _cifar_folder(data_path: str) -> str:
    _require_folder(data_path)
    nested = os.path.join(data_path, "cifar-10-batches-bin")
    return nested if os.path.isdir(nested) else data_path


class ImageFolderSource:
    """Images in one sub-folder per class (sorted folder names give the labels)."""

    def __init__(self, data_path: str, training: bool, eval_folder: str = "val"):
        _require_folder(data_path)
        split = os.path.join(data_path, "train" if training else eval_folder)
        if not training and not os.path.isdir(split) and os.path.isdir(os.path.join(data_path, "train")):
            raise UserInputError(f"{data_path} has train/ but no {eval_folder}/ folder to evaluate on; pass the "
                                 f"validation folder (--eval_dataset_path, or DATASET_PATH for run_eval.sh)")
        self.root = split if os.path.isdir(split) else data_path
        self.class_names = sorted(entry.name for entry in os.scandir(self.root) if entry.is_dir())
        if not self.class_names:
            raise UserInputError(f"no class sub-folders in {self.root}; expected "
                                 f"{self.root}/<class name>/<image>.jpg")
        self.paths: List[str] = []
        labels = []
        for label, name in enumerate(self.class_names):
            folder = os.path.join(self.root, name)
            files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTENSIONS))
            self.paths += [os.path.join(folder, f) for f in files]
            labels += [label] * len(files)
        if not self.paths:
            raise UserInputError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in the class folders of "
                                 f"{self.root}")
        self.labels = np.asarray(labels, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int):
        """The image, read but not decoded: the transform decodes only what its crop needs."""
        return open_image(self.paths[index])

    def check(self, index: int) -> None:
        """Read and decode the whole image (UnreadableImageError names the file where it fails)."""
        image = self.load(index)
        crop_resize(image, (0, 0, image.width, image.height), image.size, mode="plain")


def _require_folder(path: str) -> None:
    if not path:
        raise UserInputError("data_path is empty; pass --data_path /path/to/dataset")
    if not os.path.isdir(path):
        raise UserInputError(f"dataset folder not found: {path}; pass --data_path with an existing folder")
