"""src/dataset.py on the generated sample data: shapes, exact eval coverage, sharding, determinism, errors.

The sample data has 200 training images (20 per class) and an odd test split of 101 images, in
CIFAR-10 binary files (cifar_dir) and JPEG class folders (folder_dir)."""
import hashlib
import os
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from conftest import PYTHON, REPO, run
from src.data.sampling import EpochSampler
from src.data.sources import CIFAR_RECORD_BYTES, ImageFolderSource
from src.data.transforms import folder_eval_transform
from src.dataset import (
    CIFAR_MEAN,
    CIFAR_STD,
    create_dataset,
    create_source,
    eval_image,
    host_normalize,
    set_start_epoch,
)
from src.errors import UserInputError, user_error_message

N_TRAIN, N_TEST = 200, 101
# (dataset name, fixture giving its folder, training image size to use)
FORMATS = [("cifar10", "cifar_dir", 32), ("imagenet2012", "folder_dir", 40)]


@pytest.fixture(params=FORMATS, ids=[f[0] for f in FORMATS])
def fmt(request):
    name, fixture, size = request.param
    return name, str(request.getfixturevalue(fixture)), size


def batches(data, epochs=1):
    """[(images, labels) per batch] for each epoch."""
    it = data.create_tuple_iterator(num_epochs=epochs, output_numpy=True)
    return [[(images, labels) for images, labels in it] for _ in range(epochs)]


def flatten(epoch):
    images = np.concatenate([b[0] for b in epoch])
    labels = np.concatenate([b[1] for b in epoch])
    return images, labels


def hashes(images):
    return [hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest() for image in images]


# ---------------------------------------------------------------- shapes and batching

def test_train_batches_shape_dtype_and_partial_batch_dropped(fmt):
    name, path, size = fmt
    batch = 16  # 200 = 12 * 16 + 8: the last 8 are dropped
    data = create_dataset(name, path, training=True, batch_size=batch, image_size=size, class_num=10)
    assert data.get_dataset_size() == N_TRAIN // batch
    (epoch,) = batches(data)
    assert len(epoch) == N_TRAIN // batch
    for images, labels in epoch:  # uint8 RGB pixels: the network's first cell normalizes them
        assert images.shape == (batch, size, size, 3) and images.dtype == np.uint8
        assert labels.shape == (batch,) and labels.dtype == np.int32
        assert labels.min() >= 0 and labels.max() < 10
    normalized = host_normalize(flatten(epoch)[0], data.normalization)
    assert normalized.shape == (len(epoch) * batch, 3, size, size) and -3 < normalized.mean() < 3


def test_cifar_is_resized_to_image_size(cifar_dir):
    for training in (True, False):
        data = create_dataset("cifar10", str(cifar_dir), training=training, batch_size=4, image_size=48)
        images, _ = batches(data)[0][0]
        assert images.shape == (4, 48, 48, 3)


@pytest.mark.parametrize("batch", [8, 16, 33, 100, 128])
def test_eval_keeps_every_sample_exactly_once(fmt, batch):
    name, path, size = fmt
    data = create_dataset(name, path, training=False, batch_size=batch, image_size=32)
    assert data.get_dataset_size() == -(-N_TEST // batch)
    (epoch,) = batches(data)
    images, labels = flatten(epoch)
    assert images.shape == (N_TEST, 32, 32, 3)
    source = create_source(name, path, training=False)
    assert len(source) == N_TEST
    # evaluation reads in source order: every label, counted as in the source
    np.testing.assert_array_equal(labels, source.labels)
    assert Counter(labels.tolist()) == Counter(source.labels.tolist())
    assert len(set(hashes(images))) == N_TEST


def test_eval_sample_matches_eval_image(fmt):
    """The pipeline and the single-image preprocessing (used for prediction) agree."""
    name, path, _ = fmt
    data = create_dataset(name, path, training=False, batch_size=5, image_size=32)
    images, _ = batches(data)[0][0]
    source = create_source(name, path, training=False)
    for i in range(5):
        raw = source.load(i)
        pil = Image.fromarray(raw) if isinstance(raw, np.ndarray) else Image.open(source.paths[i])  # as predict.py
        np.testing.assert_array_equal(images[i], eval_image(pil, name, 32))


def test_cifar_values_are_the_normalized_file_pixels(cifar_dir):
    raw = np.fromfile(os.path.join(cifar_dir, "test_batch.bin"), dtype=np.uint8).reshape(-1, CIFAR_RECORD_BYTES)
    data = create_dataset("cifar10", str(cifar_dir), training=False, batch_size=4, image_size=32)
    pixels, labels = batches(data)[0][0]
    images = host_normalize(pixels, data.normalization)
    chw = raw[:4, 1:].reshape(4, 3, 32, 32).astype(np.float64)
    mean = np.array(CIFAR_MEAN)[None, :, None, None] * 255
    std = np.array(CIFAR_STD)[None, :, None, None] * 255
    np.testing.assert_allclose(images, (chw - mean) / std, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(labels, raw[:4, 0])


# ---------------------------------------------------------------- sharding

@pytest.mark.slow
@pytest.mark.parametrize("num_shards", [2, 3])
def test_eval_shards_are_disjoint_and_cover_every_sample(fmt, num_shards):
    name, path, _ = fmt
    full_images, full_labels = flatten(batches(
        create_dataset(name, path, training=False, batch_size=16, image_size=32))[0])
    shard_hashes, shard_labels = [], []
    for shard in range(num_shards):
        data = create_dataset(name, path, training=False, batch_size=16, image_size=32,
                              num_shards=num_shards, shard_id=shard)
        images, labels = flatten(batches(data)[0])
        assert len(labels) == len(range(shard, N_TEST, num_shards))
        shard_hashes.append(hashes(images))
        shard_labels += labels.tolist()
    all_hashes = [h for hs in shard_hashes for h in hs]
    assert len(all_hashes) == N_TEST
    assert Counter(all_hashes) == Counter(hashes(full_images))
    for i in range(num_shards):
        for j in range(i + 1, num_shards):
            assert not set(shard_hashes[i]) & set(shard_hashes[j])
    assert Counter(shard_labels) == Counter(full_labels.tolist())


@pytest.mark.slow
@pytest.mark.parametrize("num_shards,batch", [(2, 10), (3, 11)])
def test_train_shards_are_equal_and_disjoint_within_an_epoch(fmt, num_shards, batch):
    name, path, size = fmt
    everything = flatten(batches(create_dataset(name, path, training=True, batch_size=10, image_size=size,
                                                shuffle=False, augment=False))[0])[0]
    assert len(everything) == N_TRAIN
    every_hash = set(hashes(everything))
    assert len(every_hash) == N_TRAIN
    per_shard = N_TRAIN // num_shards
    seen = []
    for shard in range(num_shards):
        data = create_dataset(name, path, training=True, batch_size=batch, image_size=size, augment=False,
                              num_shards=num_shards, shard_id=shard, seed=7)
        assert data.get_dataset_size() == per_shard // batch
        images, _ = flatten(batches(data)[0])
        assert len(images) == (per_shard // batch) * batch
        seen.append(set(hashes(images)))
        assert len(seen[-1]) == len(images)
        assert seen[-1] <= every_hash
    for i in range(num_shards):
        for j in range(i + 1, num_shards):
            assert not seen[i] & seen[j]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_sampler_train_shards_partition_the_epoch_permutation(num_shards):
    for epoch in (0, 1, 5):
        parts = [EpochSampler(N_TRAIN, training=True, shuffle=True, num_shards=num_shards, shard_id=s,
                              seed=3).epoch_indices(epoch) for s in range(num_shards)]
        assert {len(p) for p in parts} == {N_TRAIN // num_shards}
        joined = np.concatenate(parts)
        assert len(set(joined.tolist())) == len(joined)
        assert set(joined.tolist()) <= set(range(N_TRAIN))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_sampler_eval_shards_cover_every_index_once(num_shards):
    samplers = [EpochSampler(N_TEST, training=False, shuffle=False, num_shards=num_shards, shard_id=s, seed=0)
                for s in range(num_shards)]
    joined = sorted(np.concatenate([s.epoch_indices(0) for s in samplers]).tolist())
    assert joined == list(range(N_TEST))
    assert [len(s) for s in samplers] == [len(s.epoch_indices(0)) for s in samplers]


# ---------------------------------------------------------------- determinism and resuming

@pytest.mark.slow
def test_same_seed_gives_the_same_first_batch(fmt):
    name, path, size = fmt
    make = lambda seed: create_dataset(name, path, training=True, batch_size=8, image_size=size, seed=seed)  # noqa: E731
    first_a, first_b, other = (batches(make(seed))[0][0] for seed in (5, 5, 6))
    np.testing.assert_array_equal(first_a[0], first_b[0])
    np.testing.assert_array_equal(first_a[1], first_b[1])
    assert not np.array_equal(first_a[0], other[0])


def test_epochs_differ_in_order_but_not_in_content(fmt):
    name, path, size = fmt
    data = create_dataset(name, path, training=True, batch_size=10, image_size=size, augment=False, seed=2)
    one, two = (flatten(epoch) for epoch in batches(data, epochs=2))
    assert len(one[1]) == len(two[1]) == N_TRAIN
    assert hashes(one[0]) != hashes(two[0])
    assert Counter(hashes(one[0])) == Counter(hashes(two[0]))


def test_augmentation_changes_the_images(fmt):
    name, path, size = fmt
    plain = create_dataset(name, path, training=True, batch_size=10, image_size=size, augment=False, seed=2)
    augmented = create_dataset(name, path, training=True, batch_size=10, image_size=size, seed=2)
    (p_images, p_labels), = batches(plain)[0][:1]
    (a_images, a_labels), = batches(augmented)[0][:1]
    np.testing.assert_array_equal(p_labels, a_labels)  # same order: the sampler does not depend on augment
    assert not np.array_equal(p_images, a_images)


def test_augmentation_differs_between_epochs(fmt):
    """Augmentation is keyed by (epoch, index): an image is not cropped the same way every epoch."""
    name, path, size = fmt
    data = create_dataset(name, path, training=True, batch_size=20, image_size=size, shuffle=False, seed=3)
    one, two = (flatten(e) for e in batches(data, epochs=2))
    np.testing.assert_array_equal(one[1], two[1])
    differing = [not np.array_equal(a, b) for a, b in zip(one[0], two[0])]
    assert sum(differing) > N_TRAIN // 2


def test_no_augment_no_shuffle_is_deterministic(fmt):
    name, path, size = fmt
    make = lambda: create_dataset(name, path, training=True, batch_size=20, image_size=size,  # noqa: E731
                                  shuffle=False, augment=False, seed=1)
    a1, a2 = (flatten(e) for e in batches(make(), epochs=2))
    (b1,) = (flatten(e) for e in batches(make()))
    for x, y in ((a1, a2), (a1, b1)):
        np.testing.assert_array_equal(x[0], y[0])
        np.testing.assert_array_equal(x[1], y[1])
    # unshuffled training reads in source order
    np.testing.assert_array_equal(a1[1], create_source(name, path, training=True).labels)


@pytest.mark.slow
def test_start_epoch_reproduces_that_epoch(fmt):
    name, path, size = fmt
    make = lambda **kw: create_dataset(name, path, training=True, batch_size=8, image_size=size,  # noqa: E731
                                       seed=4, **kw)
    fresh = batches(make(), epochs=2)
    second = flatten(fresh[1])
    resumed = flatten(batches(make(start_epoch=1))[0])
    np.testing.assert_array_equal(resumed[1], second[1])
    np.testing.assert_array_equal(resumed[0], second[0])
    assert not np.array_equal(flatten(fresh[0])[0], second[0])
    late = make()
    set_start_epoch(late, 1)
    np.testing.assert_array_equal(flatten(batches(late)[0])[0], second[0])


def test_sampler_keys_and_start_epoch():
    fresh = EpochSampler(N_TRAIN, training=True, shuffle=True, num_shards=2, shard_id=1, seed=9)
    resumed = EpochSampler(N_TRAIN, training=True, shuffle=True, num_shards=2, shard_id=1, seed=9, start_epoch=1)
    epoch0, epoch1 = list(iter(fresh)), list(iter(fresh))
    assert epoch0 == [int(i) for i in fresh.epoch_indices(0)]
    assert epoch1 == [N_TRAIN + int(i) for i in fresh.epoch_indices(1)]
    assert list(iter(resumed)) == epoch1
    assert not np.array_equal(fresh.epoch_indices(0), fresh.epoch_indices(1))
    # seed and epoch alone fix the permutation: a new sampler gives the same one
    again = EpochSampler(N_TRAIN, training=True, shuffle=True, num_shards=2, shard_id=1, seed=9)
    np.testing.assert_array_equal(again.epoch_indices(3), fresh.epoch_indices(3))


# ---------------------------------------------------------------- errors

def expect_error(path_in_message, *args, **kwargs):
    with pytest.raises(UserInputError) as info:
        create_dataset(*args, **kwargs)
    assert path_in_message in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("name", ["cifar10", "imagenet2012"])
def test_missing_folder(tmp_path, name):
    missing = str(tmp_path / "does_not_exist")
    expect_error(missing, name, missing, training=True, batch_size=4, image_size=32)


@pytest.mark.parametrize("name", ["cifar10", "imagenet2012"])
def test_empty_folder(tmp_path, name):
    expect_error(str(tmp_path), name, str(tmp_path), training=False, batch_size=4, image_size=32)


def test_empty_data_path():
    with pytest.raises(UserInputError, match="data_path"):
        create_dataset("cifar10", "", training=True, batch_size=4, image_size=32)


@pytest.mark.parametrize("size", [CIFAR_RECORD_BYTES * 2 + 5, 0, CIFAR_RECORD_BYTES - 1])
def test_cifar_file_of_wrong_size(tmp_path, size):
    bad = tmp_path / "data_batch_1.bin"
    bad.write_bytes(b"\x01" * size)
    expect_error(str(bad), "cifar10", str(tmp_path), training=True, batch_size=1, image_size=32)


def test_cifar_nested_folder_is_found(tmp_path, cifar_dir):
    nested = tmp_path / "cifar-10-batches-bin"
    nested.mkdir()
    (nested / "test_batch.bin").write_bytes((cifar_dir / "test_batch.bin").read_bytes())
    data = create_dataset("cifar10", str(tmp_path), training=False, batch_size=50, image_size=32)
    assert sum(len(b[1]) for b in batches(data)[0]) == N_TEST


def test_folder_without_class_subfolders(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "loose.jpg")
    expect_error(str(tmp_path), "imagenet2012", str(tmp_path), training=True, batch_size=1, image_size=32)


def test_class_folders_without_images(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("not an image")
    message = expect_error(str(tmp_path), "imagenet2012", str(tmp_path), training=True, batch_size=1,
                           image_size=32)
    assert "no images" in message


def test_corrupt_jpeg(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (16, 16), (10, 200, 30)).save(tmp_path / name / "good.jpg")
    bad = tmp_path / "b" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg")
    source = ImageFolderSource(str(tmp_path), training=True)
    assert source.paths[source.paths.index(str(bad))] == str(bad)
    assert source.load(0).size == (16, 16)
    with pytest.raises(UserInputError) as info:
        source.load(source.paths.index(str(bad)))
    assert str(bad) in str(info.value)
    # through the pipeline the error still carries the message naming the file
    data = create_dataset("imagenet2012", str(tmp_path), training=False, batch_size=1, image_size=16)
    with pytest.raises((UserInputError, RuntimeError)) as info:
        batches(data)
    message = user_error_message(info.value)
    assert message is not None and str(bad) in message


def test_truncated_jpeg(tmp_path):
    (tmp_path / "a").mkdir()
    path = tmp_path / "a" / "cut.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(UserInputError, match="cut.jpg"):
        ImageFolderSource(str(tmp_path), training=False).load(0)


def test_jpeg_cut_inside_its_pixel_data_is_named_when_decoded(tmp_path):
    (tmp_path / "a").mkdir()
    path = tmp_path / "a" / "cut.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:-2000])
    image = ImageFolderSource(str(tmp_path), training=False).load(0)  # opened lazily: the header is whole
    with pytest.raises(UserInputError, match="cut.jpg"):
        folder_eval_transform(image, 32)


@pytest.mark.parametrize("name,fixture", [("cifar10", "cifar_dir"), ("imagenet2012", "folder_dir")])
def test_label_beyond_class_num(request, name, fixture):
    path = str(request.getfixturevalue(fixture))
    message = expect_error(path, name, path, training=True, batch_size=4, image_size=32, class_num=5)
    assert "class_num" in message
    # exactly enough classes is fine
    create_dataset(name, path, training=True, batch_size=4, image_size=32, class_num=10)


def test_unknown_dataset(cifar_dir):
    with pytest.raises(UserInputError, match="mnist"):
        create_dataset("mnist", str(cifar_dir), training=True, batch_size=4, image_size=32)


def test_batch_larger_than_the_shard(cifar_dir):
    expect_error(str(cifar_dir), "cifar10", str(cifar_dir), training=True, batch_size=N_TRAIN + 1, image_size=32)
    expect_error(str(cifar_dir), "cifar10", str(cifar_dir), training=True, batch_size=64, image_size=32,
                 num_shards=4)


def test_evaluating_a_tree_with_train_but_no_val_names_the_missing_folder(tmp_path):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "cat" / "0.jpg")
    with pytest.raises(UserInputError, match="no val/ folder"):
        ImageFolderSource(str(tmp_path), training=False)
    assert len(ImageFolderSource(str(tmp_path), training=True)) == 1


FORK_AFTER_OPENCV_THREADS = """
import sys
import cv2
import numpy as np
from src.dataset import create_dataset
image = np.random.default_rng(0).integers(0, 255, (2000, 2000, 3), np.uint8)
for _ in range(3):
    cv2.GaussianBlur(cv2.resize(image, (1500, 1500)), (9, 9), 2)  # OpenCV's thread pool now has threads
data = create_dataset("cifar10", sys.argv[1], training=False, batch_size=64, image_size=32, num_parallel_workers=2)
print(sum(1 for _ in data.create_tuple_iterator(num_epochs=1)))
"""


@pytest.mark.slow
def test_worker_processes_start_after_opencv_ran_threads_in_this_process(cifar_dir):
    """Forked while OpenCV's pool had threads, a worker used to hang for good in its first
    cv2.setNumThreads (an in-process evaluation after other OpenCV work did)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # OpenCV's default threads
    result = run([PYTHON, "-c", FORK_AFTER_OPENCV_THREADS, str(cifar_dir)], cwd=REPO, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "2"  # 101 test images in batches of 64

