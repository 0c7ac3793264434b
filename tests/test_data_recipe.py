"""The modern data recipe: each operation against an independent expectation, policy sampling
statistics, random erasing bounds, mixup/cutmix targets, repeated augmentation, keyed determinism,
soft-target loss and the one-line errors for bad values."""
import hashlib
from collections import Counter

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from PIL import Image

from conftest import PYTHON, REPO, last_json, run
from src.data.auto_augment import (
    AUGMIX_OPS,
    BASIC_OPS,
    POLICIES,
    TrivialAugmentWide,
    apply_op,
    create_policy,
    magnitude_bins,
    ops_in,
)
from src.data.batch_mixing import draw_mix, mix_batch, one_hot
from src.data.host_stage import IMAGENET_MEAN, IMAGENET_STD, host_mix, host_normalize, normalization_of
from src.data.random_erasing import erase, erase_box
from src.data.sampling import EpochSampler
from src.data.transforms import folder_eval_transform
from src.dataset import Augmentation, create_dataset, create_train_input_stage
from src.errors import UserInputError
from src.training.loss import CrossEntropySmooth

RAMP = np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, axis=2)
FULL_RECIPE = Augmentation(auto_augment="ta_wide", random_erase=0.25, mixup_alpha=0.2, cutmix_alpha=1.0, ra_reps=2)


def noise_image(height=24, width=20, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# ---------------------------------------------------------------- operations

def test_posterize_solarize_invert_on_known_arrays():
    np.testing.assert_array_equal(apply_op(RAMP, "Posterize", 3), RAMP & 0b11100000)
    np.testing.assert_array_equal(apply_op(RAMP, "Posterize", 8), RAMP)
    for threshold in (0.0, 100.0, 128.0, 255.0):
        np.testing.assert_array_equal(apply_op(RAMP, "Solarize", threshold),
                                      np.where(RAMP >= threshold, 255 - RAMP, RAMP))
    np.testing.assert_array_equal(apply_op(RAMP, "Invert", 0), 255 - RAMP)
    np.testing.assert_array_equal(apply_op(RAMP, "Identity", 5), RAMP)


def test_rotate_by_90_degrees_is_a_quarter_turn():
    image = noise_image(15, 15)
    np.testing.assert_array_equal(apply_op(image, "Rotate", 90.0, interpolation=create_nearest()), np.rot90(image))
    np.testing.assert_array_equal(apply_op(image, "Rotate", -90.0, interpolation=create_nearest()),
                                  np.rot90(image, -1))


def create_nearest():
    from mindspore.dataset.vision import Inter
    return Inter.NEAREST


def test_translate_shifts_whole_pixels_and_fills_zero():
    image = noise_image()
    moved = apply_op(image, "TranslateX", 3.7, interpolation=create_nearest())  # truncated to 3 pixels
    np.testing.assert_array_equal(moved[:, 3:], image[:, :-3])
    assert not moved[:, :3].any()
    moved = apply_op(image, "TranslateY", -2.0, interpolation=create_nearest())
    np.testing.assert_array_equal(moved[:-2], image[2:])
    assert not moved[-2:].any()


@pytest.mark.parametrize("amount", [0.3, -0.3])
def test_shear_is_about_the_top_left_corner(amount):
    image = noise_image(20, 20)
    sheared_x = apply_op(image, "ShearX", amount, interpolation=create_nearest())
    np.testing.assert_array_equal(sheared_x[0], image[0])  # the first row stays
    # row y (its center at y + 0.5) moves by amount * (y + 0.5) pixels as torchvision shears, so row 10 moves 3
    row = sheared_x[10]
    shifts = [s for s in range(-4, 5) if np.array_equal(np.roll(image[10], s, axis=0)[4:-4], row[4:-4])]
    assert shifts and abs(shifts[0]) == 3
    sheared_y = apply_op(image, "ShearY", amount, interpolation=create_nearest())
    np.testing.assert_array_equal(sheared_y[:, 0], image[:, 0])  # the first column stays


def test_equalize_flattens_the_histogram():
    # linearly falling density: most pixels dark, no level holding more than 1% of them
    skewed = np.random.default_rng(1).triangular(0, 0, 256, (64, 64, 3)).astype(np.uint8)
    flat = apply_op(skewed, "Equalize", 0)
    for channel in range(3):
        cdf = np.cumsum(np.bincount(flat[..., channel].ravel(), minlength=256)) / flat[..., channel].size
        assert np.abs(cdf - np.arange(1, 257) / 256).max() < 0.03  # uniform: cdf on the diagonal
        before = np.cumsum(np.bincount(skewed[..., channel].ravel(), minlength=256)) / skewed[..., channel].size
        assert np.abs(before - np.arange(1, 257) / 256).max() > 0.2


def test_autocontrast_stretches_each_channel_and_enhance_ops_scale():
    narrow = (RAMP // 4 + 50).astype(np.uint8)
    stretched = apply_op(narrow, "AutoContrast", 0)
    want = (narrow.astype(np.float64) - 50) * 255 / (narrow.max() - 50)  # each channel spans 50..113
    assert np.abs(stretched - want).max() <= 1.0
    flat = np.full((8, 8, 3), 100, np.uint8)
    np.testing.assert_array_equal(apply_op(flat, "Brightness", 0.5), np.full_like(flat, 150))
    np.testing.assert_array_equal(apply_op(flat, "Brightness", -1.0), np.zeros_like(flat))
    gray = np.repeat(noise_image()[..., :1], 3, axis=2)
    np.testing.assert_array_equal(apply_op(gray, "Color", 0.9), gray)  # saturation of gray is gray
    np.testing.assert_array_equal(apply_op(flat, "Contrast", 0.9), flat)  # contrast of flat is flat



def torchvision_blend(image, degenerate, factor):
    return np.clip(factor * image.astype(np.float64) + (1 - factor) * degenerate, 0, 255)


def test_enhance_ops_follow_torchvision_blend_formulas():
    image = noise_image(12, 10)
    gray = np.rint(image.astype(np.float64) @ [0.299, 0.587, 0.114])  # ITU-R 601-2 luma, rounded
    padded = np.pad(image.astype(np.float64), ((1, 1), (1, 1), (0, 0)))
    # PIL's SMOOTH kernel: the 3x3 sum with the center counted 5 times
    smooth = sum(padded[1 + dy:13 + dy, 1 + dx:11 + dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1))
    smooth += 4 * padded[1:-1, 1:-1]
    blurred = image.astype(np.float64)
    blurred[1:-1, 1:-1] = np.rint(smooth[1:-1, 1:-1] / 13)  # torchvision smooths the interior only
    for magnitude in (0.6, -0.7):
        factor = 1 + magnitude
        wants = {"Brightness": torchvision_blend(image, 0, factor),
                 "Color": torchvision_blend(image, gray[..., None], factor),
                 "Contrast": torchvision_blend(image, np.rint(gray.mean()), factor),
                 "Sharpness": torchvision_blend(image, blurred, factor)}
        for name, want in wants.items():
            assert np.abs(apply_op(image, name, magnitude) - want).max() <= 1, name
    sharpened = apply_op(image, "Sharpness", 0.9)
    for edge in (np.s_[0], np.s_[-1], np.s_[:, 0], np.s_[:, -1]):
        np.testing.assert_array_equal(sharpened[edge], image[edge])
    flat = np.full((8, 8, 3), 77, np.uint8)
    np.testing.assert_array_equal(apply_op(flat, "Sharpness", -0.9), flat)


def test_equalize_and_autocontrast_match_pil():
    from PIL import ImageOps
    for image in (noise_image(), (noise_image(30, 17, seed=2) // 5 + 60).astype(np.uint8)):
        np.testing.assert_array_equal(apply_op(image, "Equalize", 0), ImageOps.equalize(Image.fromarray(image)))
        want = np.asarray(ImageOps.autocontrast(Image.fromarray(image))).astype(int)
        assert np.abs(apply_op(image, "AutoContrast", 0) - want).max() <= 1  # PIL's float table: off by 1 rarely


def test_every_op_returns_a_fresh_uint8_image_of_the_same_shape():
    from mindspore.dataset.vision import Inter
    image = noise_image(17, 23)
    original = image.copy()
    for name in BASIC_OPS[1:] + ("Invert",):
        for interpolation in (Inter.NEAREST, Inter.BILINEAR, Inter.BICUBIC):
            out = apply_op(image, name, 5 if name == "Posterize" else 0.5, interpolation)
            assert out.dtype == np.uint8 and out.shape == image.shape and out.flags.c_contiguous, name
            assert out is not image, name
    np.testing.assert_array_equal(image, original)  # the input is never written to
    assert not apply_op(image, "TranslateX", -23.0).any()  # shifted out entirely
    np.testing.assert_array_equal(apply_op(RAMP, "Solarize", 100.5), np.where(RAMP >= 101, 255 - RAMP, RAMP))
    rotated = apply_op(image, "Rotate", 30.0, create_nearest())  # nearest picks input pixels (or the fill)
    assert {tuple(p) for p in rotated.reshape(-1, 3)} <= {tuple(p) for p in image.reshape(-1, 3)} | {(0, 0, 0)}
    assert not np.array_equal(apply_op(image, "Rotate", 30.0, Inter.BILINEAR), rotated)

def test_magnitude_bins_follow_the_definitions():
    standard, wide = magnitude_bins("standard", 31, 331, 331), magnitude_bins("wide", 31, 224, 224)
    assert standard["Rotate"][-1] == 30 and wide["Rotate"][-1] == 135
    assert standard["TranslateX"][-1] == pytest.approx(150) and wide["TranslateX"][-1] == 32
    assert standard["ShearX"][-1] == pytest.approx(0.3) and wide["ShearX"][-1] == pytest.approx(0.99)
    assert list(standard["Posterize"][[0, -1]]) == [8, 4] and list(wide["Posterize"][[0, -1]]) == [8, 2]
    assert standard["Solarize"][0] == 255 and standard["Solarize"][-1] == 0
    assert list(magnitude_bins("augmix", 11, 30, 30)["Posterize"][[0, -1]]) == [4, 0]


# ---------------------------------------------------------------- policy sampling

def test_trivial_augment_draws_ops_and_bins_uniformly():
    policy, rng = TrivialAugmentWide(), np.random.default_rng(0)
    draws = [policy.draw(rng) for _ in range(14000)]
    ops, bins = Counter(d[0] for d in draws), Counter(d[1] for d in draws)
    assert set(ops) == set(BASIC_OPS) and len(BASIC_OPS) == 14
    assert all(abs(count - 1000) < 150 for count in ops.values()), ops  # ~4.7 sigma
    assert set(bins) == set(range(31)) and all(abs(count - 14000 / 31) < 110 for count in bins.values())


def test_policy_tables_and_op_sets():
    from src.data.auto_augment import _POLICY_TABLES, parse_policy_table
    for table in _POLICY_TABLES.values():
        policy = parse_policy_table(table)
        assert len(policy) == 25 and all(len(sub) == 2 for sub in policy)
        assert all(0 <= p <= 1 and (b is None or 0 <= b < 10) for sub in policy for _, p, b in sub)
    assert "Invert" in ops_in("imagenet") and "Invert" in ops_in("svhn") and "Invert" not in ops_in("ta_wide")
    assert set(ops_in("cifar10")) <= set(BASIC_OPS) | {"Invert"}
    assert "Identity" not in AUGMIX_OPS and len(AUGMIX_OPS) == 13


@pytest.mark.parametrize("name", [p for p in POLICIES if p != "none"])
def test_each_policy_is_a_pure_function_of_the_key(name):
    policy = create_policy(name)
    image = noise_image(32, 32)
    outputs = [policy(image, np.random.default_rng([7, key])) for key in range(12)]
    assert all(o.shape == image.shape and o.dtype == np.uint8 for o in outputs)
    np.testing.assert_array_equal(policy(image, np.random.default_rng([7, 3])), outputs[3])
    assert len({o.tobytes() for o in outputs}) > 3  # the key changes what is applied


# ---------------------------------------------------------------- random erasing

def test_erase_boxes_stay_within_torchvision_bounds():
    rng = np.random.default_rng(0)
    boxes = [erase_box(64, 48, rng, probability=0.5) for _ in range(4000)]
    erased = [b for b in boxes if b[2]]
    assert abs(len(erased) / len(boxes) - 0.5) < 0.04
    for top, left, height, width in erased:
        assert 0 <= top and top + height <= 64 and 0 <= left and left + width <= 48
        # rounding each side to whole pixels moves area and aspect a little past the nominal bounds
        assert 0.02 * 0.7 <= height * width / (64 * 48) <= 0.33 * 1.15
        assert 0.3 * 0.6 <= height / width <= 3.3 / 0.6
    assert erase_box(64, 48, rng, probability=0.0) == (0, 0, 0, 0)
    images = np.ones((2, 3, 8, 8), np.float32)
    erase(images, np.array([[1, 2, 3, 4], [0, 0, 0, 0]]))
    assert images[0].sum() == 3 * (64 - 12) and not images[0, :, 1:4, 2:6].any() and images[1].all()


# ---------------------------------------------------------------- mixup and cutmix

def constant_batch(n=6, size=16):
    """Image i is filled with the value i, so every pixel says which image it came from."""
    return np.arange(n, dtype=np.float32)[:, None, None, None] * np.ones((n, 3, size, size), np.float32)


@pytest.mark.parametrize("mixup_alpha,cutmix_alpha", [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_mixed_targets_are_distributions_weighted_like_the_pixels(mixup_alpha, cutmix_alpha):
    labels = np.array([0, 1, 2, 3, 4, 5])
    for key in range(20):
        images, targets = mix_batch(constant_batch(), labels, np.random.default_rng(key), num_classes=10,
                                    mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha)
        np.testing.assert_allclose(targets.sum(axis=1), 1.0, atol=1e-6)
        # each image's mean pixel is the targets' weighted mean of the source values
        np.testing.assert_allclose(images.mean(axis=(1, 2, 3)), targets @ np.arange(10), atol=1e-4)


def test_cutmix_lambda_is_the_pasted_area():
    for key in range(50):
        mix = draw_mix(np.random.default_rng(key), 16, 12, mixup_alpha=0.0, cutmix_alpha=1.0)
        images, targets = host_mix(constant_batch(4, 16)[..., :12], one_hot(np.arange(4), 4), mix)
        pasted = (images[1, 0] == 0).mean()  # image 1 receives image 0's pixels
        assert targets[1, 0] == pytest.approx(pasted) and targets[1, 1] == pytest.approx(1 - pasted)


def test_soft_target_loss_equals_numpy_and_matches_integer_labels():
    logits = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    soft = np.random.default_rng(1).dirichlet(np.ones(5), size=4).astype(np.float32)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    for smooth in (0.0, 0.1):
        loss = CrossEntropySmooth(5, smooth)
        want = -(((1 - smooth) * soft + smooth / 5) * log_softmax).sum(axis=1).mean()
        assert float(loss(Tensor(logits), Tensor(soft)).asnumpy()) == pytest.approx(want, rel=1e-5)
        labels = np.array([0, 3, 1, 4], np.int32)
        assert float(loss(Tensor(logits), Tensor(one_hot(labels, 5))).asnumpy()) == pytest.approx(
            float(loss(Tensor(logits), Tensor(labels)).asnumpy()), rel=1e-6)


# ---------------------------------------------------------------- repeated augmentation

def test_repeated_augmentation_spreads_copies_over_ranks_with_distinct_keys():
    total, reps, world = 120, 3, 4
    shards = [EpochSampler(total, training=True, shuffle=True, num_shards=world, shard_id=r, seed=5, repeats=reps)
              for r in range(world)]
    keys = [s.epoch_keys(2) for s in shards]
    assert [len(k) for k in keys] == [len(s) for s in shards] == [total // world] * world  # epoch length unchanged
    flat = np.concatenate(keys)
    assert len(set(flat.tolist())) == len(flat)  # every copy has its own key: its own augmentation
    assert set((flat // total // reps).tolist()) == {2}  # all keys belong to epoch 2
    copies = Counter((flat % total).tolist())
    assert set(copies.values()) == {reps}  # total / reps samples, each `reps` times
    first_index = int(keys[0][0] % total)
    assert all(first_index in (k % total).tolist() for k in keys[1:reps])  # the copies sit on other ranks
    plain = EpochSampler(total, training=True, shuffle=True, num_shards=world, shard_id=1, seed=5)
    assert list(plain.epoch_keys(2)) == [2 * total + i for i in plain.epoch_indices(2)]


# ---------------------------------------------------------------- the pipeline, keyed

def recipe_batches(path, workers, augmentation=FULL_RECIPE, epochs=1, start_epoch=0, worker_kind="process"):
    data = create_dataset("imagenet2012", str(path), training=True, batch_size=8, image_size=32, class_num=10,
                          num_parallel_workers=workers, worker_kind=worker_kind, seed=11, augmentation=augmentation,
                          start_epoch=start_epoch)
    it = data.create_tuple_iterator(num_epochs=epochs, output_numpy=True)
    return [[tuple(row) for row in it] for _ in range(epochs)]


def digest(epochs) -> str:
    h = hashlib.sha256()
    for epoch in epochs:
        for row in epoch:
            for column in row:
                h.update(column.tobytes())
    return h.hexdigest()


@pytest.mark.slow
def test_full_recipe_batches_are_keyed_across_workers_restarts_and_resume(folder_dir):
    two_epochs = recipe_batches(folder_dir, workers=1, epochs=2)
    images, labels, boxes, mix = two_epochs[0][0]
    assert images.shape == (8, 32, 32, 3) and images.dtype == np.uint8 and labels.dtype == np.int32
    assert boxes.shape == (8, 4) and mix.shape == (8,)
    for kind in ("process", "thread"):  # two workers: same batches, whichever kind
        assert digest(recipe_batches(folder_dir, workers=2, epochs=2, worker_kind=kind)) == digest(two_epochs), kind
    assert digest(recipe_batches(folder_dir, workers=1, start_epoch=1)) == digest(two_epochs[1:])  # resume
    code = ("import sys, json; sys.path.insert(0, 'tests'); from test_data_recipe import recipe_batches, digest; "
            f"print(json.dumps(digest(recipe_batches({str(folder_dir)!r}, workers=1, epochs=2))))")
    restarted = run([PYTHON, "-c", code], cwd=REPO)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert last_json(restarted.stdout) == digest(two_epochs)
    plain = recipe_batches(folder_dir, workers=1, augmentation=Augmentation())
    assert len(plain[0][0]) == 2  # without erasing or mixing: images and labels only


@pytest.mark.slow
def test_the_graph_input_stage_computes_what_the_host_would(folder_dir):
    """Normalization, each sample's erase box and the batch's mixing, in the GRAPH-mode cell the
    training step runs first, against the same steps in numpy (and normalization against the
    float64 formula, as the host pipeline computed it before the stage moved into the graph)."""
    (epoch,) = recipe_batches(folder_dir, workers=1)
    assert {int(mix[0] < 1) for *_, mix in epoch} == {0, 1} and any(mix[6] > 0 for *_, mix in epoch)  # both kinds
    assert any(boxes[:, 2].any() for _, _, boxes, _ in epoch)
    stage = create_train_input_stage("imagenet2012", FULL_RECIPE, 10)
    normalization = normalization_of("imagenet2012")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        for images, labels, boxes, mix in epoch:
            got_images, got_targets = stage(Tensor(images), Tensor(labels), Tensor(boxes), Tensor(mix))
            normalized = host_normalize(images, normalization)
            exact = (images.transpose(0, 3, 1, 2) - 255 * np.array(IMAGENET_MEAN)[:, None, None]) / \
                (255 * np.array(IMAGENET_STD)[:, None, None])
            np.testing.assert_allclose(normalized, exact, rtol=0, atol=1e-6)
            want_images, want_targets = host_mix(erase(normalized, boxes), one_hot(labels, 10), mix)
            np.testing.assert_allclose(got_images.asnumpy(), want_images, rtol=0, atol=1e-6)
            np.testing.assert_allclose(got_targets.asnumpy(), want_targets, rtol=0, atol=1e-7)
            np.testing.assert_allclose(want_targets.sum(axis=1), 1.0, atol=1e-6)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def test_eval_resize_size_sets_the_short_side_before_the_crop():
    image = Image.fromarray(noise_image(300, 400))
    # resize-then-crop, computed the plain way (the pipeline resizes only the crop's box: within rounding)
    got = folder_eval_transform(image, 16, resize_size=20)
    want = np.asarray(image.resize((27, 20), Image.BILINEAR).crop((5, 2, 21, 18)))
    assert got.shape == want.shape and np.abs(got.astype(int) - want).max() <= 1
    default = folder_eval_transform(image, 14)  # 14 / 0.875 = 16
    want = np.asarray(image.resize((21, 16), Image.BILINEAR).crop((3, 1, 17, 15)))
    assert default.shape == want.shape and np.abs(default.astype(int) - want).max() <= 1


# ---------------------------------------------------------------- bad values

@pytest.mark.slow
def test_a_bad_recipe_value_is_one_line_error_naming_the_key(cifar_dir, tmp_path):
    """Through train.py once; every key's check is tested in-process below."""
    key, value = "auto_augment", "autoaug"
    result = run([PYTHON, "train.py", "--config_path", str(REPO / "config" / "sample_resnet18.yaml"),
                  "--data_path", str(cifar_dir), "--output_dir", str(tmp_path), f"--{key}", value], timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and key in lines[0], result.stderr[-2000:]
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("key,value", [("auto_augment", "rand"), ("mixup_alpha", -0.2), ("cutmix_alpha", -1.0),
                                       ("random_erase", 1.5), ("ra_magnitude", 31),
                                       ("ra_num_ops", -1), ("ra_reps", 0), ("augmix_severity", 0),
                                       ("random_erase", -0.1)])
def test_every_recipe_key_is_checked(key, value):
    with pytest.raises(UserInputError, match=key):
        Augmentation(**{key: value}).check()
    FULL_RECIPE.check()


def test_unknown_interpolation_names_the_key(cifar_dir):
    with pytest.raises(UserInputError, match="interpolation"):
        create_dataset("cifar10", str(cifar_dir), training=False, batch_size=4, image_size=32, interpolation="lanczos")
