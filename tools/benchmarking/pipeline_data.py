"""The files the pipeline comparison reads: tiny JPEGs, generated and real photographs, CIFAR-10
binary files, and MindRecord shards of the photographs."""
import argparse
import os
from typing import Dict, Tuple

import numpy as np

CIFAR_RECORDS = 10_000  # MindSpore's Cifar10Dataset rejects files with fewer records


def write_pipeline_data(args: argparse.Namespace, data_root: str) -> Tuple[Dict[str, str], Dict]:
    """The pipelines' files: tiny JPEGs (the ceiling), generated and real photographs, CIFAR-10
    binary files of 10,000 records (MindSpore's reader takes no fewer); their folders and descriptions."""
    from src.data.photo_data import describe_files, write_photo_folder, write_real_photo_folder, write_tiny_jpegs
    folders = {name: os.path.join(data_root, name) for name in ("tiny", "photos", "real")}
    files = {"tiny": describe_files(write_tiny_jpegs(folders["tiny"], args.ceiling_images)),
             "photos": describe_files(write_photo_folder(folders["photos"], args.photos)),
             "real": describe_files(write_real_photo_folder(folders["real"], args.photos))}
    folders["cifar"] = write_cifar_records(os.path.join(data_root, "cifar"), CIFAR_RECORDS)
    for name in ("photos", "real"):
        folders[f"{name}_shards"] = write_shards(folders[name], os.path.join(data_root, f"{name}_shards"))
    return folders, files


def write_shards(folder: str, output: str) -> str:
    """`folder`'s class folders converted to MindRecord shards (src/data/mindrecord.py), 4 of them."""
    from src.data.mindrecord import convert_split
    from src.data.sources import ImageFolderSource
    convert_split(ImageFolderSource(folder, True), output, shards=4, workers=1, overwrite=False,
                  log=lambda line: None)
    return output


def write_cifar_records(folder: str, records: int) -> str:
    """A CIFAR-10 binary training file (data_batch_1.bin) of `records` random images, and a
    one-record test_batch.bin; the folder."""
    from src.data.sources import CIFAR_RECORD_BYTES
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, count in (("data_batch_1.bin", records), ("test_batch.bin", 1)):
        data = rng.integers(0, 256, (count, CIFAR_RECORD_BYTES), dtype=np.uint8)
        data[:, 0] %= 10
        data.tofile(os.path.join(folder, name))
    return folder

