"""Our input pipeline (create_dataset) and MindSpore's native one as the model zoo builds it, on
the same files, timed in one measuring process (benchmark.py --worker pipelines) confined to its
first --cores cores."""
import argparse
import functools
import json
import os
import resource
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from tools.benchmarking.worker import reply

PHOTO_SIZE, PHOTO_RESIZE = 224, 256  # the ImageNet pipelines: train crop and eval center crop, eval short side
CIFAR_SIZE = 32
# resnet50_imagenet2012_v2.yaml's data recipe (TrivialAugmentWide, erasing, mixup/cutmix, repeated augmentation)
V2_RECIPE = {"auto_augment": "ta_wide", "random_erase": 0.1, "mixup_alpha": 0.2, "cutmix_alpha": 1.0, "ra_reps": 4}


def native_imagenet_dataset(path: str, *, training: bool, batch: int, workers: int,
                            samples: Optional[int] = None):
    """MindSpore's C++ ImageNet pipeline as the model zoo builds it (for comparison only): decode
    with the random crop, flip, normalize, HWC->CHW; eval: decode, resize 256, center crop 224.
    An epoch holds at most `samples` of the folder's images (None: all)."""
    import mindspore as ms
    import mindspore.dataset as ds
    import mindspore.dataset.transforms as transforms
    import mindspore.dataset.vision as vision

    from src.dataset import IMAGENET_MEAN, IMAGENET_STD
    data = ds.ImageFolderDataset(path, num_parallel_workers=workers, shuffle=training, num_samples=samples)
    if training:
        ops = [vision.RandomCropDecodeResize(PHOTO_SIZE, scale=(0.08, 1.0), ratio=(0.75, 1.333)),
               vision.RandomHorizontalFlip(prob=0.5)]
    else:
        ops = [vision.Decode(), vision.Resize(PHOTO_RESIZE), vision.CenterCrop(PHOTO_SIZE)]
    ops += [vision.Normalize(mean=[m * 255 for m in IMAGENET_MEAN], std=[s * 255 for s in IMAGENET_STD]),
            vision.HWC2CHW()]
    data = data.map(operations=ops, input_columns="image", num_parallel_workers=workers)
    data = data.map(operations=transforms.TypeCast(ms.int32), input_columns="label", num_parallel_workers=workers)
    return data.batch(batch, drop_remainder=True)


def native_cifar_dataset(path: str, *, training: bool, batch: int, workers: int, samples: Optional[int] = None):
    """MindSpore's C++ CIFAR-10 training pipeline as the model zoo builds it, at 32 px: random crop
    with 4 pixels of padding, flip, rescale, normalize, HWC->CHW. An epoch holds at most `samples`
    of the file's records (None: all)."""
    import mindspore as ms
    import mindspore.dataset as ds
    import mindspore.dataset.transforms as transforms
    import mindspore.dataset.vision as vision

    from src.dataset import CIFAR_MEAN, CIFAR_STD
    data = ds.Cifar10Dataset(path, usage="train", num_parallel_workers=workers, shuffle=training,
                             num_samples=samples)
    ops = [vision.RandomCrop((CIFAR_SIZE, CIFAR_SIZE), (4, 4, 4, 4)), vision.RandomHorizontalFlip(prob=0.5),
           vision.Rescale(1.0 / 255.0, 0.0), vision.Normalize(mean=list(CIFAR_MEAN), std=list(CIFAR_STD)),
           vision.HWC2CHW()]
    data = data.map(operations=ops, input_columns="image", num_parallel_workers=workers)
    data = data.map(operations=transforms.TypeCast(ms.int32), input_columns="label", num_parallel_workers=workers)
    return data.batch(batch, drop_remainder=True)


@functools.lru_cache(maxsize=None)
def _source_length(dataset: str, path: str, training: bool) -> int:
    """The samples of one epoch of create_dataset's source (read once per process: a CIFAR source
    loads every record)."""
    from src.dataset import create_source
    return len(create_source(dataset, path, training))


def our_dataset(path: str, *, training: bool, batch: int, workers: int, samples: Optional[int] = None,
                dataset: str = "imagenet2012", worker_kind: str = "process", **options):
    """This repository's pipeline (create_dataset) on the same files, an epoch of at most `samples`
    of them (None: all; otherwise the rest of each epoch's draws skipped); `options` are its keyword
    arguments."""
    from src.dataset import Augmentation, create_dataset
    recipe = Augmentation(**options.pop("recipe", {}))
    size = CIFAR_SIZE if dataset == "cifar10" else PHOTO_SIZE
    skip = 0 if samples is None else max(0, _source_length(dataset, path, training) - samples)
    return create_dataset(dataset, path, training=training, batch_size=batch, image_size=size, class_num=10,
                          num_parallel_workers=workers, worker_kind=worker_kind, augmentation=recipe,
                          skip_samples=skip, **options)


# What each pipeline process measures: case -> (data folder, {pipeline: (builder, training)}).
PIPELINE_CASES = {
    "ceiling": ("tiny", {
        "ours": (functools.partial(our_dataset), True),
        "ours_threads": (functools.partial(our_dataset, worker_kind="thread"), True),
        "v2": (functools.partial(our_dataset, recipe=V2_RECIPE), True),
        "native": (native_imagenet_dataset, True)}),
    "photos": ("photos", {
        "ours_train": (our_dataset, True),
        "no_aa_train": (functools.partial(our_dataset, antialias=False), True),
        "v2_train": (functools.partial(our_dataset, recipe=V2_RECIPE), True),
        "native_train": (native_imagenet_dataset, True),
        "ours_eval": (our_dataset, False),
        "native_eval": (native_imagenet_dataset, False)}),
    "real": ("real", {
        "ours_train": (our_dataset, True),
        "native_train": (native_imagenet_dataset, True),
        "ours_eval": (our_dataset, False),
        "native_eval": (native_imagenet_dataset, False)}),
    "photos_shards": ("photos_shards", {"ours_train": (our_dataset, True), "ours_eval": (our_dataset, False)}),
    "real_shards": ("real_shards", {"ours_train": (our_dataset, True), "ours_eval": (our_dataset, False)}),
    "cifar": ("cifar", {
        "ours": (functools.partial(our_dataset, dataset="cifar10"), True),
        "v2": (functools.partial(our_dataset, dataset="cifar10", recipe=V2_RECIPE), True),
        "native": (native_cifar_dataset, True)}),
}


def dataset_rate(data, batches: int) -> Tuple[float, float]:
    """img/s of a batched dataset over `batches` batches after one start-up batch (epochs repeat),
    and the main process's own CPU time per sample in microseconds (getrusage: all its threads,
    not its worker processes): the cost no number of workers takes off the training process.
    The epochs those batches need are then read to their end, untimed: MindSpore stopped the worker
    processes of an iterator left mid-epoch with results queued only after a 5 s join timeout.
    (measure_pipelines keeps that end short: each epoch holds what is timed, where files allow.)"""
    epochs = -(-(batches + 1) // data.get_dataset_size())
    iterator = data.repeat(epochs).create_tuple_iterator(num_epochs=1, output_numpy=True)
    next(iterator)
    start, cpu_start, images = time.perf_counter(), _own_cpu_seconds(), 0
    for _ in range(batches):
        images += len(next(iterator)[1])
    elapsed, cpu = time.perf_counter() - start, _own_cpu_seconds() - cpu_start
    for _ in iterator:
        pass
    return round(images / elapsed, 1), round(cpu / images * 1e6, 1)


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_pipelines(folders: Dict[str, str], *, batch: int, workers: int, batches: Dict[str, int],
                      repeats: int) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Every case's pipelines, alternating repeat by repeat: medians of img/s and of the main
    process's CPU microseconds per sample."""
    samples: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
    for _ in range(repeats):
        for case, (folder, pipelines) in PIPELINE_CASES.items():
            # An epoch of the timed batches and the start-up one: the CIFAR file holds 10,000 records
            # (MindSpore's reader takes no fewer), and reading its untimed rest cost a CIFAR pipeline
            # ~4 times its timed batches at the defaults, ~600 times at the suite's sizes.
            epoch = (batches[folder] + 1) * batch
            for name, (build, training) in pipelines.items():
                if name.endswith("threads") and workers < 2:
                    continue  # one worker is a thread either way
                data = build(folders[folder], training=training, batch=batch, workers=workers, samples=epoch)
                samples.setdefault((case, name), []).append(dataset_rate(data, batches[folder]))
    result: Dict[str, Dict[str, Dict[str, float]]] = {}
    for (case, name), values in samples.items():
        rates, cpus = zip(*values)
        result.setdefault(case, {})[name] = {"img_per_s": round(float(np.median(rates)), 1),
                                             "main_cpu_us": round(float(np.median(cpus)), 1)}
    return result


def serve_pipelines(args: argparse.Namespace) -> int:
    """A measuring process for the input pipelines, confined to its first --cores cores."""
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    os.sched_setaffinity(0, cores)  # threads and worker processes started from here on inherit the mask
    folders = json.loads(args.photo_dir)
    small, photos = max(2, args.ceiling_images // args.photo_batch), max(2, 2 * args.photos // args.photo_batch)
    batches = {"tiny": small, "photos": photos, "real": photos, "photos_shards": photos, "real_shards": photos,
               "cifar": small}
    result = measure_pipelines(folders, batch=args.photo_batch, workers=args.workers, batches=batches,
                               repeats=args.repeats)
    reply({"cores": len(cores), "workers": args.workers, **result})
    return 0
