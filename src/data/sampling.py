"""Which sample keys each shard reads in each epoch, and batch numbers over them."""
import mindspore.dataset as ds
import numpy as np


class BatchSampler(ds.Sampler):
    """Batch numbers for a BatchSource; each call to iter() is the next epoch of `sampler`."""

    def __init__(self, sampler: "EpochSampler", batch_size: int, drop_remainder: bool):
        self.sampler = sampler
        samples = len(sampler)
        self.batches_per_epoch = samples // batch_size if drop_remainder else -(-samples // batch_size)
        super().__init__()  # reads len(self)

    def __iter__(self):
        epoch = self.sampler.epoch
        self.sampler.epoch += 1
        yield from range(epoch * self.batches_per_epoch, (epoch + 1) * self.batches_per_epoch)

    def __len__(self) -> int:
        return self.batches_per_epoch


class EpochSampler(ds.Sampler):
    """Yields sample keys `(epoch * repeats + repeat) * N + index` for this shard; each call to
    iter() is the next epoch.

    Training: the epoch's permutation (seeded by seed and epoch), cut into equal shards. With
    `repeats` > 1 (repeated augmentation), each index of the permutation stands `repeats` times in
    a row and the shards take every `num_shards`-th entry, so the copies of a sample land on
    different ranks with different keys; each shard keeps N / num_shards entries, so an epoch is as
    long as without repeats. Evaluation: every sample exactly once across shards, in order.
    `skip` leaves out the first samples of each epoch: a one-epoch dataset with it is the rest
    of an epoch interrupted after `skip` samples (MindSpore needs every epoch of a dataset to have
    the same length, so a mid-epoch resume trains that rest as a dataset of its own)."""

    def __init__(self, num_samples: int, *, training: bool, shuffle: bool, num_shards: int,
                 shard_id: int, seed: int, start_epoch: int = 0, repeats: int = 1,
                 skip: int = 0):
        self.total = num_samples
        self.training = training
        self.shuffle = shuffle
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.seed = seed
        self.epoch = start_epoch
        self.repeats = repeats if training else 1
        self.skip = skip
        super().__init__()  # reads len(self)

    def epoch_keys(self, epoch: int) -> np.ndarray:
        """The sample keys this shard reads in `epoch`."""
        order = np.arange(self.total)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.total)
        positions = np.arange(self.shard_id, self.total * self.repeats, self.num_shards)
        if self.training:
            positions = positions[:self.total // self.num_shards]
        index, repeat = order[positions // self.repeats], positions % self.repeats
        return (epoch * self.repeats + repeat) * self.total + index

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """The sample indices this shard reads in `epoch`."""
        return self.epoch_keys(epoch) % self.total

    def __iter__(self):
        epoch = self.epoch
        self.epoch += 1
        for key in self.epoch_keys(epoch)[self.skip:]:
            yield int(key)

    def __len__(self) -> int:
        if self.training:
            return self.total // self.num_shards - self.skip
        return len(range(self.shard_id, self.total, self.num_shards)) - self.skip
