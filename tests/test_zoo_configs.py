"""Every config file of the model zoo's official ResNet config/ folder (mindspore-ai/models,
official/cv/ResNet/config, 19 files): each trains through train.py unchanged, with command-line
additions only, or stops with one `error:` line saying why; the flower_photos file fine-tunes
through fine_tune.py as the zoo's users run it.

The files are written here with each zoo file's structure (its keys and the values that decide
what runs: network, dataset, optimizer, schedule, initializers, boost), with small values of our
own, as tests/test_zoo.py does."""
import re
import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from test_zoo import HEAD, RUN, TAIL, TRAIN, write_zoo_file

from conftest import PYTHON, REPO, one_line_error, read_metrics, run
from src.config import load_config
from src.dataset import DATASETS
from src.errors import UserInputError
from src.migration.zoo_fine_tune import fine_tune_argv
from src.resnet import NET_NAMES, create_model
from src.training.checkpoint import read_checkpoint
from src.training.factory import check_step_keys, create_schedule

SMALL = {"epoch_size": 1, "warmup_epochs": 0, "train_image_size": 32, "eval_image_size": 32, "batch_size": 64}
CIFAR = {"class_num": 10, "dataset": "cifar10", "lr_decay_mode": "poly", "conv_init": "XavierUniform",
         "dense_init": "TruncatedNormal"}
IMAGENET = {"class_num": 1001, "dataset": "imagenet2012", "lr_decay_mode": "linear", "use_label_smooth": True,
            "label_smooth_factor": 0.1, "conv_init": "XavierUniform", "dense_init": "TruncatedNormal"}
THOR = {"optimizer": "Thor", "class_num": 1001, "dataset": "imagenet2012", "use_label_smooth": True, "lr_init": 0.05,
        "lr_decay": 4.0, "lr_end_epoch": 50, "damping_init": 0.02, "damping_decay": 0.5, "frequency": 834,
        "conv_init": "HeUniform", "dense_init": "HeUniform", "all_reduce_fusion_config": [85, 160]}

THOR_ON_CPU = "optimizer Thor runs on Ascend or GPU only"


def structure(net_name: str, kind: dict, device: str = "Ascend", **values) -> dict:
    return {**HEAD, **TRAIN, **RUN, "device_target": device, "net_name": net_name, **kind, **SMALL,
            "lr_init": 0.01, "lr_max": 0.1, "lr_end": 0.0001, **TAIL, **values}


# file name -> (its structure, what train.py does with it: None trains, else a word of its one-line error)
ZOO_FILES = {
    "resnet18_cifar10_config.yaml": (structure("resnet18", CIFAR), None),
    "resnet18_cifar10_config_gpu.yaml": (structure("resnet18", CIFAR, "GPU"), None),
    "resnet34_cifar10_config_gpu.yaml": (structure("resnet34", CIFAR, "GPU"), None),
    "resnet50_cifar10_config.yaml": (structure("resnet50", CIFAR), None),
    "resnet152_cifar10_config_gpu.yaml": (structure("resnet152", CIFAR, "GPU"), None),
    "resnet18_imagenet2012_config.yaml": (structure("resnet18", IMAGENET), None),
    "resnet18_imagenet2012_config_gpu.yaml": (structure("resnet18", IMAGENET, "GPU"), None),
    "resnet34_imagenet2012_config.yaml": (structure("resnet34", IMAGENET), None),
    "resnet34_imagenet2012_config_gpu.yaml": (structure("resnet34", IMAGENET, "GPU"), None),
    "resnet50_imagenet2012_config.yaml": (structure("resnet50", IMAGENET), None),
    "resnet101_imagenet2012_config.yaml": (structure("resnet101", IMAGENET, lr_decay_mode="cosine"), None),
    "resnet152_imagenet2012_config.yaml": (structure("resnet152", IMAGENET, lr_decay_mode="step"), None),
    "resnet152_imagenet2012_config_gpu.yaml": (structure("resnet152", IMAGENET, "GPU"), None),
    "resnet50_imagenet2012_Boost_config.yaml": (structure(
        "resnet50", IMAGENET, optimizer="LARS", lars_epsilon=0.0, lars_coefficient=0.001, boost_mode="O1",
        lr_decay_mode="poly", conv_init="TruncatedNormal", dense_init="RandomNormal",
        all_reduce_fusion_config=[85, 160]), None),
    # THOR trains on Ascend/GPU only (untested here); the rows' outcome is with --device_target CPU
    "resnet50_imagenet2012_Ascend_Thor_config.yaml": (structure("resnet50", THOR), THOR_ON_CPU),
    "resnet50_imagenet2012_GPU_Thor_config.yaml": (structure("resnet50", THOR, "GPU"), THOR_ON_CPU),
    "se-resnet50_imagenet2012_config.yaml": (structure(
        "se-resnet50", IMAGENET, lr_decay_mode="cosine", lr_init=0, lr_max=0.3, train_epoch_size=24,
        lars_epsilon=0.0, lars_coefficient=0.001, eval_start_epoch=40, all_reduce_fusion_config=[85, 160],
        batch_size=32, file_name="se-resnet50", network_dataset="se-resnet50_imagenet2012"), None),
    "resnet34_cpu_config.yaml": (structure(
        "resnet34", {**CIFAR, "dataset": "flower_photos", "class_num": 5}, "CPU",
        checkpoint_path="./resnet34_imagenet2012.ckpt", checkpoint_file_path="./best_acc.ckpt", learning_rate=0.001,
        eval_start_epoch=40), None),
    # gpu_resnet_benchmark.py's file: no network, dataset or schedule keys
    "resnet_benchmark_GPU.yaml": ({**HEAD, "device_target": "GPU", "optimizer": "Momentum", "batch_size": 256,
                                   "epoch_size": 2, "print_per_steps": 20, "eval": False, "save_ckpt": False,
                                   "mode_name": "GRAPH", "dtype": "fp16", "boost_mode": "O0"},
                                  "gpu_resnet_benchmark.py"),
}


@pytest.fixture(scope="module")
def zoo_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("zoo_config")
    for name, (values, _) in ZOO_FILES.items():
        write_zoo_file(folder / name, values)
    return folder


def test_the_zoo_folder_has_19_files():
    assert len(ZOO_FILES) == 19


@pytest.mark.parametrize("name", sorted(ZOO_FILES))
def test_each_zoo_file_is_ready_to_train_or_refused_before_any_work(name, zoo_folder):
    """What train.py checks before it touches a device: the config, the optimizer keys, the
    network name, the dataset and the lr schedule (in-process, cheap)."""
    refusal = ZOO_FILES[name][1]

    def prepare():
        cfg = load_config(["--config_path", str(zoo_folder / name), "--device_target", "CPU"])
        check_step_keys(cfg)
        if cfg.net_name not in NET_NAMES:
            create_model(cfg.net_name)  # the one-line refusal of an unknown network
        create_schedule(cfg, steps_per_epoch=10)
        return cfg

    if refusal is None:
        cfg = prepare()
        assert cfg.dataset in DATASETS
    else:
        with pytest.raises(UserInputError, match=re.escape(refusal)):
            prepare()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50_imagenet2012_GPU_Thor_config.yaml", "resnet_benchmark_GPU.yaml"])
def test_refused_zoo_files_stop_with_one_line_and_write_nothing(name, zoo_folder, folder_dir, tmp_path):
    result = run([PYTHON, "train.py", "--config_path", str(zoo_folder / name), "--data_path", str(folder_dir),
                  "--device_target", "CPU", "--output_dir", str(tmp_path / "out")])
    assert ZOO_FILES[name][1] in one_line_error(result)
    assert not (tmp_path / "out").exists()


def test_a_zoo_warmup_longer_than_a_short_run_is_cut_short_in_one_line(zoo_folder):
    """The zoo's ImageNet files warm up for 5 epochs (this folder's copies are shortened, so the
    key is given); run for 2 as the zoo would: the lr stays on the warmup's line, and the run says so once."""
    cfg = load_config(["--config_path", str(zoo_folder / "resnet50_imagenet2012_config.yaml"), "--device_target",
                       "CPU", "--epoch_size", "2", "--warmup_epochs", "5"])
    lines = []
    lrs = create_schedule(cfg, steps_per_epoch=6, log=lines.append)
    assert lines == ["warmup of 30 steps is longer than the run's 12: the lr stays on the warmup's line (as the "
                     "model zoo's schedules do) and never reaches lr_max"]
    np.testing.assert_allclose(lrs, [cfg.lr_init + (cfg.lr_max - cfg.lr_init) * s / 30 for s in range(12)],
                               rtol=1e-6)


@pytest.mark.parametrize("name", [name for name in sorted(ZOO_FILES) if "_Thor_" in name])
def test_thor_files_pass_the_checks_on_their_own_device(name, zoo_folder):
    """On the device the file names (Ascend, GPU) a Thor file is ready for THOR: its keys are this
    repository's, the checks pass and the lr is THOR's, 0.01 * (1 - e / 50) ** 4 at epoch e."""
    cfg = load_config(["--config_path", str(zoo_folder / name)])
    assert (cfg.optimizer, cfg.lr_end_epoch, cfg.lr_decay, cfg.frequency) == ("Thor", 50, 4.0, 834)
    check_step_keys(cfg)
    lrs = create_schedule(cfg, steps_per_epoch=10)
    assert lrs[9] == pytest.approx(0.01 * (1 - 1 / 50) ** 4)


@pytest.mark.slow
def test_zoo_imagenet_structure_trains_one_epoch(zoo_folder, folder_dir, tmp_path):
    """resnet18_imagenet2012_config.yaml's structure (linear decay, label smoothing, 1001 classes,
    Xavier/TruncatedNormal init) with only command-line additions: 3 steps."""
    result = run([PYTHON, "train.py", "--config_path", str(zoo_folder / "resnet18_imagenet2012_config.yaml"),
                  "--data_path", str(folder_dir), "--device_target", "CPU", "--output_dir", str(tmp_path),
                  "--num_parallel_workers", "1"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (tmp_path / "resnet18" / "imagenet2012" / "resnet18-1_3.ckpt").is_file()


@pytest.mark.slow
def test_zoo_se_resnet50_structure_trains_one_step(zoo_folder, tiny_folder_dir, tmp_path):
    """se-resnet50_imagenet2012_config.yaml's structure (SE-ResNet50, cosine decay, label smoothing,
    1001 classes, Xavier/TruncatedNormal init, batch 32) with only command-line additions: one step
    over 40 images."""
    result = run([PYTHON, "train.py", "--config_path", str(zoo_folder / "se-resnet50_imagenet2012_config.yaml"),
                  "--data_path", str(tiny_folder_dir), "--device_target", "CPU", "--output_dir", str(tmp_path),
                  "--num_parallel_workers", "1"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    folder = tmp_path / "se-resnet50" / "imagenet2012"
    params = read_checkpoint(str(folder / "se-resnet50-1_1.ckpt"))
    assert params["fc.weight"].shape == (1001, 2048) and "layer4.2.se_dense_1.weight" in params
    losses = [float(row["loss"]) for row in read_metrics(folder)]
    assert len(losses) == 1 and np.isfinite(losses[0])


def zoo_names(name: str) -> str:
    """This repository's resnet18/34 name -> the model zoo's."""
    name = re.sub(r"^(layer\d\.\d+\.)bn([12])\.", r"\1bn\2d.", name)
    return name.replace("downsample", "down_sample_layer").replace("fc.", "end_point.")


@pytest.fixture(scope="module")
def flower_photos(folder_dir, tmp_path_factory) -> Path:
    """A flower_photos-shaped dataset: 5 class folders under train/ and test/."""
    root = tmp_path_factory.mktemp("flower_photos")
    classes = sorted(p.name for p in (folder_dir / "train").iterdir())[:5]
    for split, source in (("train", "train"), ("test", "val")):
        for name in classes:
            shutil.copytree(folder_dir / source / name, root / split / name)
    return root


def test_fine_tune_needs_checkpoint_path_to_name_a_checkpoint(zoo_folder):
    """The other zoo files' checkpoint_path is a save folder ('./checkpoint/'): not a pre-trained file."""
    with pytest.raises(UserInputError, match="does not name a pre-trained .ckpt file"):
        fine_tune_argv(["--config_path", str(zoo_folder / "resnet18_cifar10_config.yaml")])
    argv = fine_tune_argv(["--config_path", str(zoo_folder / "resnet34_cpu_config.yaml"),
                                     "--weight_decay", "0.0001", "--learning_rate", "0.01"])
    assert argv[:2] == ["--pre_trained", "./resnet34_imagenet2012.ckpt"]
    assert argv[argv.index("--lr_max") + 1] == "0.01"  # the command line's learning_rate over the file's
    assert argv[-2:] == ["--weight_decay", "0.0001"] and "--learning_rate" not in argv  # the user's last: it wins


@pytest.mark.slow
def test_zoo_fine_tune_flow_trains_a_new_head_on_flower_photos(zoo_folder, flower_photos, tmp_path):
    """python fine_tune.py --config_path resnet34_cpu_config.yaml, its checkpoint_path naming a zoo
    ImageNet resnet34 checkpoint (zoo names, 1001 classes): a 5-class head trains, the backbone stays
    bit-identical, and the test/ split is evaluated after the last epoch."""
    net = create_model("resnet34", num_classes=1001)
    before = {p.name: p.asnumpy() for p in net.get_parameters()}
    ms.save_checkpoint([{"name": zoo_names(p.name), "data": p.data} for p in net.get_parameters()],
                       str(tmp_path / "resnet34_imagenet2012.ckpt"))
    result = run([PYTHON, str(REPO / "fine_tune.py"), "--config_path",
                  str(zoo_folder / "resnet34_cpu_config.yaml"), "--data_path", str(flower_photos),
                  "--output_dir", "out", "--epoch_size", "2"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    folder = tmp_path / "out" / "resnet34" / "flower_photos"
    after = {k: v.asnumpy() for k, v in read_checkpoint(str(folder / "resnet34-2_1.ckpt")).items()}
    assert after["fc.weight"].shape == (5, 512)
    assert all(np.array_equal(after[n], v) for n, v in before.items() if not n.startswith("fc."))
    rows = read_metrics(folder)
    evaluated = [row["epoch"] for row in rows if row["top_1"]]
    assert evaluated == ["2"]  # once, after the last epoch (the file's eval_start_epoch 40 is past the end)
    lrs = [float(row["lr"]) for row in rows if row["lr"]]
    np.testing.assert_allclose(lrs, 0.001, rtol=1e-6)  # the file's learning_rate, constant
