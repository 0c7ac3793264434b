"""Batch assembly: each sample keyed, augmented from its key's generator and written into its
batch slot; whole batches (with their erase boxes and mixing) by batch number."""
import os
import threading
from typing import Callable, Optional

import cv2
import numpy as np

from src.data.bad_samples import UNREADABLE_ERRORS, BadSampleLog, reason_of, sample_name
from src.data.batch_mixing import draw_mix
from src.data.host_stage import NO_MIX
from src.data.random_erasing import erase_box
from src.data.recipe import Augmentation
from src.data.sampling import EpochSampler
from src.errors import UserInputError

MIXING_STREAM = 1  # keeps the batch generator apart from the per-sample ones


class AugmentedSource:
    """Random-access source over sample keys (index = key % N); augmentation seeded by (seed, key).

    Draws come in a fixed order from the sample's generator: crop and flip, then the policy, then
    the erasing box. `fill` writes a sample's uint8 HWC image into a batch slot and returns its
    label and, with `batch_stage`, its erase box.
    With a `bad_samples` log, an unreadable sample (failing at open or at decode) is recorded and
    replaced by the next readable index, augmented as the key says: the replacement depends on the
    key alone, so resume stays exact. Without one, it is an error naming the file."""

    def __init__(self, source, transform: Callable, augment: bool, seed: int, *,
                 policy: Optional[Callable] = None, erase_probability: float = 0.0, image_size: int = 0,
                 batch_stage: bool = False,
                 bad_samples: Optional[BadSampleLog] = None, keys_per_epoch: int = 0):
        self.source = source
        self.transform = transform
        self.augment_samples = augment
        self.seed = seed
        self.policy = policy
        self.erase_probability, self.image_size = erase_probability, image_size
        self.batch_stage = batch_stage
        self.bad_samples = bad_samples
        self.keys_per_epoch = keys_per_epoch or len(source)
        self.known_bad = set()

    def __len__(self) -> int:
        return len(self.source)

    def augment(self, key: int, raw, label: int, out: np.ndarray):
        """Write sample `key` (its raw image `raw`, as the source loads it) into `out`; returns its
        label and, with `batch_stage`, its erase box (else None)."""
        rng = sample_generator(self.seed, key) if self.augment_samples else None
        image = self.transform(raw, rng, out)
        if self.policy is not None and rng is not None:
            image = self.policy(np.ascontiguousarray(image), rng)
        if image is not out:
            out[...] = image
        if not self.batch_stage:
            return label, None
        return label, erase_box(self.image_size, self.image_size, rng, self.erase_probability)

    def fill(self, key: int, out: np.ndarray):
        """Write the sample of `key` into `out` (uint8, image_size x image_size x 3); returns its
        label and, with `batch_stage`, its erase box (else None)."""
        key = int(key)
        total = len(self.source)
        first = key % total
        for index in (i % total for i in range(first, first + total)):
            if index in self.known_bad:
                continue
            try:
                return self.augment(key, self.source.load(index), self.source.labels[index], out)
            except UNREADABLE_ERRORS as err:
                if self.bad_samples is None:
                    raise UserInputError(f"cannot read {sample_name(self.source, index)} ({reason_of(err)}); "
                                         f"remove or replace the file") from None
                self.record_unreadable(key, index, err)
        raise UserInputError("no readable sample in the dataset; check the image files")

    def record_unreadable(self, key: int, index: int, err: BaseException) -> None:
        """Sample `index`, met for `key`, cannot be read: record it in the log (which stops the run
        past max_bad_samples); `fill` then passes over it."""
        self.known_bad.add(index)
        self.bad_samples.add(key // self.keys_per_epoch, index, sample_name(self.source, index), reason_of(err))

    def __getitem__(self, key: int):
        """(image, label[, erase box]) of `key`, the image in a buffer of its own."""
        image = np.empty((self.image_size, self.image_size, 3), np.uint8)
        label, box = self.fill(key, image)
        return (image, label) if box is None else (image, label, box)


def sample_generator(seed: int, key: int) -> np.random.Generator:
    """The generator of one sample's draws: Philox keyed by (seed, key), its streams independent
    across keys. One generator per thread is re-keyed for each sample (5x cheaper than building
    one), so use it before the next call in the same thread."""
    generator = _generators.philox
    generator.bit_generator.state = {"bit_generator": "Philox",
                                     "state": {"counter": np.zeros(4, np.uint64),
                                               "key": np.array([seed & _WORD, key], np.uint64)},
                                     "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0,
                                     "uinteger": 0}
    return generator


class _Generators(threading.local):
    def __init__(self):
        self.philox = np.random.Generator(np.random.Philox(key=0))


_generators = _Generators()
_WORD = (1 << 64) - 1  # Philox keys are unsigned 64-bit words


class BatchKeys:
    """The sample keys of each batch number (`epoch * batches_per_epoch + position`), from
    `sampler.epoch_keys`: any worker computes any batch's keys."""

    def __init__(self, sampler: "EpochSampler", batch_size: int, batches_per_epoch: int):
        self.sampler, self.batch_size, self.batches_per_epoch = sampler, batch_size, batches_per_epoch
        self._epoch, self._keys = None, None

    def epoch_keys(self, epoch: int) -> np.ndarray:
        """The keys of `epoch`'s batches, one after another (a partial epoch's tail included)."""
        if epoch != self._epoch:
            self._epoch, self._keys = epoch, self.sampler.epoch_keys(epoch)[self.sampler.skip:]
        return self._keys

    def __call__(self, number: int) -> np.ndarray:
        epoch, position = divmod(number, self.batches_per_epoch)
        return self.epoch_keys(epoch)[position * self.batch_size:(position + 1) * self.batch_size]


class BatchAssembly:
    """One batch from its sample keys: uint8 NHWC images and int32 labels, plus, for the training
    recipe's batch stage, each sample's erase box (int32 [B, 4]) and the batch's mixing (float32
    [8], src/data/input_stage.py MIX_FIELDS) drawn from a generator keyed by (seed, the batch's
    first key). `fill(slot, key, out)` writes one sample and returns (label, erase box or None)."""

    def __init__(self, image_size: int, *, augmentation: "Augmentation", batch_stage: bool, seed: int):
        self.image_size, self.augmentation, self.batch_stage, self.seed = image_size, augmentation, batch_stage, seed
        self._process = None

    def __call__(self, keys: np.ndarray, fill: Callable[[int, int, np.ndarray], tuple]):
        if self._process != os.getpid():
            # Each worker is one thread of work: OpenCV's own threads would only oversubscribe
            # the cores the other workers and the training process use.
            cv2.setNumThreads(1)
            self._process = os.getpid()
        size = self.image_size
        images = np.empty((len(keys), size, size, 3), np.uint8)
        labels = np.empty(len(keys), np.int32)
        boxes = np.empty((len(keys), 4), np.int32)
        for slot, key in enumerate(keys):
            labels[slot], box = fill(slot, int(key), images[slot])
            if box is not None:
                boxes[slot] = box
        if not self.batch_stage:
            return images, labels
        mix = NO_MIX.copy()
        if self.augmentation.mixes:
            rng = np.random.default_rng([self.seed, MIXING_STREAM, int(keys[0])])
            mix = draw_mix(rng, size, size, mixup_alpha=self.augmentation.mixup_alpha,
                           cutmix_alpha=self.augmentation.cutmix_alpha)
        return images, labels, boxes, mix


class BatchSource:
    """Whole batches by batch number from a random-access source, so a worker hands over one batch
    at a time (see BatchAssembly for what a batch holds)."""

    def __init__(self, samples: AugmentedSource, keys: BatchKeys, assembly: BatchAssembly):
        self.samples, self.keys, self.assembly = samples, keys, assembly

    def __len__(self) -> int:
        return self.keys.batches_per_epoch

    def __getitem__(self, number: int):
        return self.assembly(self.keys(int(number)), lambda slot, key, out: self.samples.fill(key, out))
