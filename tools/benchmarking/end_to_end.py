"""Training through the real input pipeline (one configuration's network, batch and size), and
the training pipeline alone, on generated CIFAR-10 binary files and JPEG class folders."""
import os
import time
from typing import Dict

from tools.benchmarking.cpu_paths import CLASSES
from tools.benchmarking.mindspore_runner import MindSporeRunner


def write_data(root: str, size: int, images: int) -> Dict[str, str]:
    """Generated CIFAR-10 binary files and JPEG class folders (images a bit larger than `size`),
    at least `images` of each: the timed loops never reach the end of an epoch."""
    from src.data.sample_data import write_sample_data
    per_class = -(-images // CLASSES)
    write_sample_data(root, train_per_class=per_class, test_per_class=1, formats=("cifar10",))
    write_sample_data(os.path.join(root, "folders"), train_per_class=per_class, test_per_class=1,
                      formats=("imagenet",), folder_size=max(64, int(size * 1.15)))
    return {"cifar10": os.path.join(root, "cifar10"), "imagenet2012": os.path.join(root, "folders", "imagenet")}


def pipeline_rate(dataset: str, path: str, batch: int, size: int, workers: int, batches: int) -> float:
    """Training-pipeline img/s alone (decode, augmentation, normalization, batching)."""
    from src.dataset import create_dataset
    data = create_dataset(dataset, path, training=True, batch_size=batch, image_size=size,
                          num_parallel_workers=workers)
    iterator = data.create_tuple_iterator(num_epochs=-1, output_numpy=True)
    next(iterator)  # start-up
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        images += len(next(iterator)[1])
    return round(images / (time.perf_counter() - start), 2)


def end_to_end_rate(runner: MindSporeRunner, dataset: str, path: str, batch: int, size: int, workers: int,
                    steps: int) -> float:
    """Training img/s with batches coming from the real pipeline (uint8 batches normalized by the
    input stage's cell, as the training step's first cell does)."""
    from src.data.input_stage import NormalizeImages
    from src.dataset import create_dataset
    data = create_dataset(dataset, path, training=True, batch_size=batch, image_size=size,
                          num_parallel_workers=workers)
    normalize = NormalizeImages(data.normalization)
    iterator = data.create_tuple_iterator(num_epochs=-1)

    def step() -> None:
        images, labels = next(iterator)
        runner.train_step(normalize(images), labels)
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return round(batch * steps / (time.perf_counter() - start), 2)
