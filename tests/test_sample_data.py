"""src/data/sample_data.py: deterministic sample data in CIFAR-10 binary and JPEG class-folder formats."""
import os

import numpy as np
import pytest
from PIL import Image

from src.data.sample_data import CIFAR_RECORD_BYTES, CLASS_NAMES, main, make_split, write_sample_data


def tree_bytes(root):
    """{relative path: file bytes} for every file under root."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                out[os.path.relpath(path, root)] = handle.read()
    return out


def write(root, seed=0, **kwargs):
    kwargs = dict(dict(train_per_class=2, test_per_class=1, folder_size=24), **kwargs)
    write_sample_data(str(root), seed=seed, **kwargs)
    return tree_bytes(root)


def test_same_seed_writes_the_same_bytes(tmp_path):
    first, second = write(tmp_path / "a", seed=3), write(tmp_path / "b", seed=3)
    assert first and first.keys() == second.keys()
    assert all(first[name] == second[name] for name in first)


def test_another_seed_writes_other_data(tmp_path):
    first, other = write(tmp_path / "a", seed=3), write(tmp_path / "b", seed=4)
    assert first.keys() == other.keys()
    assert first["cifar10/test_batch.bin"] != other["cifar10/test_batch.bin"]
    assert first["cifar10/data_batch_1.bin"] != other["cifar10/data_batch_1.bin"]


def test_cifar_files_hold_the_requested_records(tmp_path):
    write_sample_data(str(tmp_path), train_per_class=3, test_total=7, seed=0, formats=("cifar10",))
    folder = tmp_path / "cifar10"
    assert not (tmp_path / "imagenet").exists()
    train_labels = []
    for i in range(1, 6):
        data = (folder / f"data_batch_{i}.bin").read_bytes()
        assert len(data) % CIFAR_RECORD_BYTES == 0
        assert len(data) // CIFAR_RECORD_BYTES == 6  # 30 images over five files
        train_labels += list(np.frombuffer(data, np.uint8).reshape(-1, CIFAR_RECORD_BYTES)[:, 0])
    assert sorted(train_labels) == sorted(list(range(10)) * 3)
    test = (folder / "test_batch.bin").read_bytes()
    assert len(test) == 7 * CIFAR_RECORD_BYTES
    assert list(np.frombuffer(test, np.uint8).reshape(-1, CIFAR_RECORD_BYTES)[:, 0]) == list(range(7))
    assert (folder / "batches.meta.txt").read_text().split() == CLASS_NAMES


def test_cifar_records_are_label_then_chw_pixels(tmp_path):
    write_sample_data(str(tmp_path), train_per_class=1, test_total=3, seed=5, formats=("cifar10",))
    images, labels = make_split(1, 32, 6, 3)  # the test split uses seed + 1
    records = np.fromfile(tmp_path / "cifar10" / "test_batch.bin", np.uint8).reshape(-1, CIFAR_RECORD_BYTES)
    np.testing.assert_array_equal(records[:, 0], labels)
    np.testing.assert_array_equal(records[:, 1:].reshape(3, 3, 32, 32).transpose(0, 2, 3, 1), images)


def test_folder_tree_has_ten_class_folders_of_jpegs(tmp_path):
    write_sample_data(str(tmp_path), train_per_class=2, test_per_class=1, seed=0, formats=("imagenet",),
                      folder_size=24)
    assert not (tmp_path / "cifar10").exists()
    for split, per_class in (("train", 2), ("val", 1)):
        root = tmp_path / "imagenet" / split
        assert sorted(os.listdir(root)) == sorted(CLASS_NAMES)
        for name in CLASS_NAMES:
            files = sorted(os.listdir(root / name))
            assert len(files) == per_class and all(f.endswith(".jpg") for f in files)
            with Image.open(root / name / files[0]) as image:
                assert image.format == "JPEG" and image.size == (24, 24) and image.mode == "RGB"


def test_odd_test_total_in_folders(sample_root):
    root = sample_root / "imagenet" / "val"
    counts = [len(os.listdir(root / name)) for name in CLASS_NAMES]
    assert sum(counts) == 101
    assert counts == [11] + [10] * 9
    train = sample_root / "imagenet" / "train"
    assert [len(os.listdir(train / name)) for name in CLASS_NAMES] == [20] * 10


def test_classes_differ_in_their_pixels():
    images, labels = make_split(20, 32, 0)
    assert images.dtype == np.uint8 and images.shape == (200, 32, 32, 3)
    means = np.stack([images[labels == k].reshape(-1, 3).mean(axis=0) for k in range(10)])
    # each class has its own hue: no two classes share the same mean colour
    distances = np.linalg.norm(means[:, None] - means[None], axis=-1) + np.eye(10) * 1e9
    assert distances.min() > 1.0


def test_cli(tmp_path):
    assert main([str(tmp_path), "--train_per_class", "1", "--test_total", "3", "--formats", "cifar10"]) == 0
    assert (tmp_path / "cifar10" / "test_batch.bin").stat().st_size == 3 * CIFAR_RECORD_BYTES
    with pytest.raises(SystemExit):
        main(["--help"])


def test_digits_are_real_scans_split_into_cifar_files(tmp_path):
    from src.data.digits_data import HELD_OUT
    from src.data.digits_data import main as digits_main
    from src.data.sources import CifarBinarySource
    assert digits_main([str(tmp_path / "digits")]) == 0
    train = CifarBinarySource(str(tmp_path / "digits"), training=True)
    test = CifarBinarySource(str(tmp_path / "digits"), training=False)
    assert (len(train), len(test)) == (1797 - HELD_OUT, HELD_OUT)
    assert train.class_names == [str(digit) for digit in range(10)]
    assert set(np.unique(test.labels)) == set(range(10))
    image = train.images[0]
    assert image.shape == (32, 32, 3) and (image[..., 0] == image[..., 2]).all()  # gray, as scanned
    assert image.min() == 0 and image.max() > 200  # dark paper, bright strokes
    # the split is a partition: no scan in both
    train_rows = {row.tobytes() for row in train.images.reshape(len(train), -1)}
    assert not any(row.tobytes() in train_rows for row in test.images.reshape(len(test), -1))
