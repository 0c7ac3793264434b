"""Drop-in for model-zoo users (mindspore-ai/models, official/cv/ResNet): its config files, command
lines and checkpoints work here unchanged; worker counts fit the machine.

The zoo config files are written here with the zoo's structure and keys (a values document, then
`---` and a help document; ModelArts, inference and retrain keys), with small values of our own.
"""
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import NO_CURVES, PYTHON, REPO, last_json, one_line_error, read_metrics, run
from src.config import load_config, read_schema, read_yaml
from src.errors import UserInputError
from src.training.checkpoint import read_checkpoint

SCHEMA = read_schema()  # src/config/schema.yaml: every key, its default and meaning

# The keys every zoo file opens with (ModelArts/OBS, then local paths).
HEAD = {"enable_modelarts": False, "data_url": "", "train_url": "", "checkpoint_url": "", "run_distribute": False,
        "enable_profiling": False, "data_path": "/cache/data", "output_dir": "../outputs",
        "load_path": "/cache/checkpoint_path/", "device_target": "Ascend", "checkpoint_path": "./checkpoint/",
        "checkpoint_file_path": ""}
# ... and closes with (export, retrain, Ascend 310 post-processing, prediction, Lite inference).
TAIL = {"device_id": 0, "width": 32, "height": 32, "file_name": "net", "file_format": "MINDIR", "ckpt_file": "",
        "network_dataset": "resnet18_cifar10", "save_graphs": False, "save_graphs_path": "./graphs",
        "has_trained_epoch": 0, "has_trained_step": 0, "result_path": "", "label_path": "", "img_path": "",
        "enable_predict_lite_backend": False, "enable_predict_lite_mindir": False, "mindir_path": "net.mindir"}
RUN = {"net_name": "resnet18", "device_num": 1, "pre_trained": "", "run_eval": False, "eval_dataset_path": "",
       "parameter_server": False, "filter_weight": False, "save_best_ckpt": True, "eval_start_epoch": 1,
       "eval_interval": 1, "enable_cache": False, "cache_session_id": "", "mode_name": "GRAPH"}
TRAIN = {"optimizer": "Momentum", "infer_label": "", "class_num": 10, "batch_size": 64, "loss_scale": 1024,
         "momentum": 0.9, "weight_decay": 1.0e-4, "epoch_size": 1, "start_epoch": 0, "resume_ckpt": "",
         "save_checkpoint": True, "save_checkpoint_epochs": 1, "keep_checkpoint_max": 3}
HELP = {"enable_modelarts": "Whether training on modelarts, default: False", "data_path": "Dataset path for local",
        "output_path": "Training output path for local", "num_classes": "Class for dataset",
        "batch_size": "Batch size for training and evaluation"}
STRUCTURES = {
    # resnet18_cifar10_config.yaml (and the resnet34/152 CIFAR ones): LARS keys, no label smoothing
    "cifar10": {**HEAD, **TRAIN, "warmup_epochs": 0, "lr_decay_mode": "poly", "lr_init": 0.01, "lr_end": 1.0e-5,
                "lr_max": 0.1, "lars_epsilon": 0.0, "lars_coefficient": 0.001, **RUN, "dataset": "cifar10",
                "boost_mode": "O0", "conv_init": "XavierUniform", "dense_init": "TruncatedNormal",
                "train_image_size": 32, "eval_image_size": 32, **TAIL},
    # resnet50_imagenet2012_Boost_config.yaml: LARS, boost O1, fusion points, 1001 classes, label smoothing
    "imagenet2012_boost": {**HEAD, **TRAIN, "optimizer": "LARS", "class_num": 1001, "warmup_epochs": 0,
                           "lr_decay_mode": "poly", "use_label_smooth": True, "label_smooth_factor": 0.1,
                           "lr_init": 0, "lr_max": 0.1, "lr_end": 0.0, "lars_epsilon": 0.0,
                           "lars_coefficient": 0.001, **RUN, "dataset": "imagenet2012", "boost_mode": "O1",
                           "conv_init": "TruncatedNormal", "dense_init": "RandomNormal",
                           "all_reduce_fusion_config": [85, 160], "train_image_size": 32, "eval_image_size": 32,
                           **TAIL},
    # resnet50_imagenet2012_*_Thor_config.yaml: Thor's schedule keys instead of the lr ones
    "imagenet2012_thor": {**HEAD, **TRAIN, "optimizer": "Thor", "class_num": 1001, "use_label_smooth": True,
                          "label_smooth_factor": 0.1, "lr_init": 0.05, "lr_decay": 4.0, "lr_end_epoch": 50,
                          "damping_init": 0.02, "damping_decay": 0.5, "frequency": 834, **RUN,
                          "dataset": "imagenet2012", "boost_mode": "O0", "conv_init": "HeUniform",
                          "dense_init": "HeUniform", "all_reduce_fusion_config": [85, 160],
                          "train_image_size": 32, "eval_image_size": 32, **TAIL},
}
# The keys each structure carries that have no effect here, in file order (lars_* are real keys).
IGNORED = ["enable_modelarts", "data_url", "train_url", "checkpoint_url", "load_path", "checkpoint_path",
           "infer_label", "start_epoch", "lr_decay", "lr_end_epoch",
           "damping_init", "damping_decay", "frequency", "parameter_server", "enable_cache", "cache_session_id",
           "network_dataset", "save_graphs", "save_graphs_path", "has_trained_epoch", "has_trained_step",
           "result_path", "label_path", "img_path", "enable_predict_lite_backend", "enable_predict_lite_mindir",
           "mindir_path"]
FAST = ["--device_target", "CPU", "--log_interval", "1", *NO_CURVES]


def write_zoo_file(path: Path, values: dict, helps: dict = HELP) -> Path:
    """A zoo-style config file: the values document, `---`, the help document."""
    text = "# Builtin Configurations\n" + yaml.safe_dump(values, sort_keys=False)
    helps_text = yaml.safe_dump(helps, sort_keys=False)
    path.write_text(text + "\n---\n# Help description for each configuration\n" + helps_text)
    return path


@pytest.fixture(scope="module")
def zoo_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoo")
    return {name: write_zoo_file(folder / f"{name}_config.yaml", values) for name, values in STRUCTURES.items()}


# ---------------------------------------------------------------------------------------------
# Config files: structure, key mapping, refusals (in-process, cheap).

@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_zoo_structure_loads_and_names_exactly_the_ignored_keys(name, zoo_files):
    cfg = load_config(["--config_path", str(zoo_files[name]), "--optimizer", "Momentum"])
    expected = [key for key in IGNORED if key in STRUCTURES[name] and key not in SCHEMA]
    assert len(cfg.notes) == 1
    listed = cfg.notes[0].split(": ")[-1].split(", ")
    assert listed == expected
    # The values reach our keys; the zoo's are not in the resolved config (nor in the saved config.yaml).
    assert cfg.class_num == STRUCTURES[name]["class_num"] and cfg.boost_mode == STRUCTURES[name]["boost_mode"]
    assert cfg.output_dir == "../outputs" and cfg.loss_scale == 1024.0
    assert not set(expected) & set(cfg.to_dict())


def test_help_shows_the_zoo_files_help_texts(zoo_files, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_config(["--config_path", str(zoo_files["cifar10"]), "--help"])
    assert exit_info.value.code == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")}
    assert lines["--batch_size"].endswith(HELP["batch_size"]) and lines["--data_path"].endswith(HELP["data_path"])
    # no help text in the zoo's file: the schema's meaning of the key
    epoch_size = lines["--epoch_size"]
    schema_help = SCHEMA["epoch_size"].help
    assert epoch_size.split()[1:3] == ["int", "1"] and epoch_size.endswith(schema_help)


@pytest.mark.parametrize("key, value", [("enable_modelarts", True), ("parameter_server", True),
                                        ("enable_cache", True), ("start_epoch", 5), ("has_trained_epoch", 3),
                                        ("save_graphs", True), ("enable_predict_lite_backend", True)])
def test_a_zoo_switch_that_would_change_the_run_is_refused(key, value, tmp_path):
    path = write_zoo_file(tmp_path / "zoo.yaml", {**STRUCTURES["cifar10"], key: value})
    with pytest.raises(UserInputError) as err:
        load_config(["--config_path", str(path)])
    assert str(err.value).startswith(f"{key} {value!r} (config file {path})") and f"set {key} " in str(err.value)
    with pytest.raises(UserInputError, match=f"^{key} .* \\(the command line\\)"):
        load_config(["--config_path", str(write_zoo_file(tmp_path / "plain.yaml", STRUCTURES["cifar10"])),
                     f"--{key}={value}"])


def test_zoo_names_map_onto_ours_in_the_file_and_on_the_command_line(tmp_path):
    path = write_zoo_file(tmp_path / "zoo.yaml", {**STRUCTURES["cifar10"], "ckpt_file": "a.ckpt"})
    cfg = load_config(["--config_path", str(path), "--output_path", "/tmp/out"])
    assert cfg.checkpoint_file_path == "a.ckpt" and cfg.output_dir == "/tmp/out"
    clash = write_zoo_file(tmp_path / "clash.yaml", {**STRUCTURES["cifar10"], "ckpt_file": "a.ckpt",
                                                     "checkpoint_file_path": "b.ckpt"})
    with pytest.raises(UserInputError, match="sets both ckpt_file .* and checkpoint_file_path"):
        load_config(["--config_path", str(clash)])


def test_typos_are_still_unknown_keys_with_a_suggestion(tmp_path):
    path = write_zoo_file(tmp_path / "zoo.yaml", {**STRUCTURES["cifar10"], "batch_sise": 8})
    with pytest.raises(UserInputError, match="unknown config key 'batch_sise'.*did you mean 'batch_size'"):
        load_config(["--config_path", str(path)])


def test_the_boost_structure_asks_for_lars_with_the_zoos_values(zoo_files):
    cfg = load_config(["--config_path", str(zoo_files["imagenet2012_boost"])])
    assert (cfg.optimizer, cfg.lars_coefficient, cfg.lars_epsilon) == ("LARS", 0.001, 0.0)


def test_more_than_two_yaml_documents_is_an_error(tmp_path):
    path = tmp_path / "three.yaml"
    path.write_text("batch_size: 8\n---\nbatch_size: help\n---\nx: 1\n")
    with pytest.raises(UserInputError, match="3 yaml documents"):
        load_config(["--config_path", str(path)])


# ---------------------------------------------------------------------------------------------
# Training, evaluation and export with zoo files (real subprocesses).

@pytest.fixture(scope="module")
def cifar_zoo_run(zoo_files, cifar_dir, tmp_path_factory):
    """The CIFAR-10 structure trained for one epoch (3 steps) with evaluation, as the zoo's CPU line."""
    out = tmp_path_factory.mktemp("zoo_run")
    result = run([PYTHON, "train.py", f"--data_path={cifar_dir}", "--config_path", str(zoo_files["cifar10"]),
                  "--output_dir", str(out), "--run_eval", "True"] + FAST)
    assert result.returncode == 0, result.stdout + result.stderr
    return out / "resnet18" / "cifar10", result


@pytest.mark.slow
def test_zoo_cifar_structure_trains_and_evaluates(cifar_zoo_run):
    folder, result = cifar_zoo_run
    assert (folder / "resnet18-1_3.ckpt").is_file()
    notes = [line for line in result.stdout.splitlines() if line.startswith("config: model-zoo keys")]
    assert len(notes) == 1
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    assert "enable_modelarts" not in saved and saved["conv_init"] == "XavierUniform"
    assert any(row["top_1"] for row in read_metrics(folder))  # an evaluation row with top_1


@pytest.mark.slow
def test_zoo_boost_structure_trains_with_boost_o1(zoo_files, folder_dir, tmp_path):
    """The Boost structure as it is (LARS, boost_mode O1, fixed loss scale 1024, label smoothing, 1001
    classes) on class folders; evaluation is covered by the CIFAR-10 structure."""
    result = run([PYTHON, "train.py", "--config_path", str(zoo_files["imagenet2012_boost"]),
                  "--data_path", str(folder_dir), "--output_dir", str(tmp_path),
                  "--num_parallel_workers", "1"] + FAST)
    assert result.returncode == 0, result.stdout + result.stderr
    folder = tmp_path / "resnet18" / "imagenet2012"
    assert (folder / "resnet18-1_3.ckpt").is_file()
    losses = [float(row["loss"]) for row in read_metrics(folder)]
    assert len(losses) == 3 and all(np.isfinite(losses))


@pytest.mark.slow
def test_zoo_checkpoint_evaluates_like_the_converted_one(cifar_zoo_run, zoo_files, cifar_dir, tmp_path):
    """The run's checkpoint renamed as the zoo names it (bn1d/bn2d, down_sample_layer, end_point, with
    optimizer slots) evaluates through eval.py to the top-1 of the run's own evaluation; converting it
    (src.migration.convert_torch) gives back exactly the run's tensors, so the converted file scores the same."""
    import mindspore as ms

    from src.migration.convert_torch import read_source
    from src.training.checkpoint import zoo_to_ms_name
    folder, _ = cifar_zoo_run
    ours = read_checkpoint(str(folder / "resnet18-1_3.ckpt"))
    renames = {"downsample": "down_sample_layer", "fc": "end_point"}

    def zoo_name(name: str) -> str:
        parts = [renames.get(part, part) for part in name.split(".")]
        # the zoo's ResNet18/34 blocks (layerN.<index>.bn1/bn2) name their BatchNorms bn1d/bn2d
        return ".".join(part + "d" if part in ("bn1", "bn2") and i and parts[i - 1].isdigit() else part
                        for i, part in enumerate(parts))

    entries = [{"name": zoo_name(name), "data": value} for name, value in ours.items()]
    names = {entry["name"] for entry in entries}
    assert {"layer1.0.bn1d.gamma", "layer2.0.down_sample_layer.0.weight", "end_point.weight", "bn1.gamma",
            "moments.layer1.0.bn2d.beta", "global_step"} <= names
    assert all(zoo_to_ms_name(entry["name"]) == name for entry, name in zip(entries, ours))
    zoo_ckpt = tmp_path / "resnet18_zoo.ckpt"
    ms.save_checkpoint(entries, str(zoo_ckpt))

    converted = read_source(str(zoo_ckpt), "mindspore").params
    network = {name: value for name, value in ours.items() if name in converted}
    assert len(network) == len(converted) == 102  # 62 trainable + 40 BatchNorm statistics
    assert all(np.array_equal(converted[name], value.asnumpy()) for name, value in network.items())

    # as --pre_trained (with a fresh head): the backbone arrives, the log line names the mapping
    from src.resnet import create_model
    from src.training.checkpoint import load_pretrained
    net, lines = create_model("resnet18", num_classes=10), []
    skipped = load_pretrained(net, str(zoo_ckpt), head=["fc.weight", "fc.bias"], filter_weight=True,
                              what="resnet18", log=lines.append)
    assert skipped == ["fc.weight (10, 512)", "fc.bias (10,)"] and len(lines) == 1 and "mapped 81" in lines[0]
    loaded = {p.name: p.asnumpy() for p in net.get_parameters()}
    assert np.array_equal(loaded["layer1.0.bn1.gamma"], ours["layer1.0.bn1.gamma"].asnumpy())
    assert np.array_equal(loaded["layer4.0.downsample.0.weight"], ours["layer4.0.downsample.0.weight"].asnumpy())

    # the zoo README's eval line: --data_path= --checkpoint_file_path= --config_path --device_target=
    result = run([PYTHON, "eval.py", f"--data_path={cifar_dir}", f"--checkpoint_file_path={zoo_ckpt}",
                  "--config_path", str(zoo_files["cifar10"]), "--device_target=CPU"])
    assert result.returncode == 0, result.stderr
    top1 = last_json(result.stdout)["top_1_accuracy"]
    assert top1 == pytest.approx(float([row for row in read_metrics(folder) if row["top_1"]][-1]["top_1"]), abs=1e-9)
    mapped = [line for line in result.stdout.splitlines() if "model-zoo names" in line]
    # 64 bn1d/bn2d tensors, 15 of the shortcuts, 2 of the head
    assert len(mapped) == 1 and "mapped 81 model-zoo names" in mapped[0] and "optimizer entries skipped" in mapped[0]


@pytest.mark.slow
def test_zoo_export_line_with_a_zoo_checkpoint_name(cifar_zoo_run, zoo_files, tmp_path):
    """The zoo README's export line, with the zoo's own key for the checkpoint (ckpt_file)."""
    folder, _ = cifar_zoo_run
    target = tmp_path / "resnet18"
    result = run([PYTHON, "export.py", "--ckpt_file", str(folder / "resnet18-1_3.ckpt"), "--file_name", str(target),
                  "--file_format", "MINDIR", "--config_path", str(zoo_files["cifar10"]), "--batch_size", "1",
                  "--device_target", "CPU"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "resnet18.mindir").is_file()


# ---------------------------------------------------------------------------------------------
# Worker counts and command lines.

@pytest.mark.slow
def test_recipe_config_with_8_workers_runs_on_2_cores(cifar_dir, tmp_path):
    """config/resnet50_imagenet2012.yaml asks for 8 pipeline workers; on 2 cores they are capped
    (on CIFAR files, where the workers are threads: cheaper to start than processes)."""
    assert read_yaml(str(REPO / "config" / "resnet50_imagenet2012.yaml"))["num_parallel_workers"] == 8
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    result = run(["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:2])), PYTHON, "train.py",
                  "--config_path", "config/resnet50_imagenet2012.yaml", "--data_path", str(cifar_dir),
                  "--dataset", "cifar10", "--output_dir", str(tmp_path), "--net_name", "resnet10", "--class_num", "10",
                  "--batch_size", "64",
                  "--train_image_size", "32", "--eval_image_size", "32", "--epoch_size", "1", "--warmup_epochs", "0",
                  "--loss_scale_type", "none"] + FAST)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "num_parallel_workers 8 capped to 2 (2 cores)" in result.stdout.splitlines()


def test_worker_budget_is_the_core_share_per_local_rank():
    from src.device import available_cores, cap_workers, worker_budget
    cores = available_cores()
    assert worker_budget(cores + 6) == cores
    assert worker_budget(1, local_ranks=cores * 4) == 1
    assert worker_budget(cores, local_ranks=2) == max(1, cores // 2)
    assert cap_workers(1) == (1, None)


def test_local_ranks_come_from_the_launcher(monkeypatch):
    from src.training.distributed import local_rank_count
    monkeypatch.delenv("LOCAL_WORKER_NUM", raising=False)
    assert local_rank_count(False, 8) == 1 and local_rank_count(True, 8) == 8
    monkeypatch.setenv("LOCAL_WORKER_NUM", "4")  # two nodes of 4 ranks
    assert local_rank_count(True, 8) == 4


@pytest.mark.parametrize("script, args, expected", [
    # bash run_standalone_train.sh [DATASET_PATH] [CONFIG_PATH] [RESUME_CKPT]
    ("run_standalone_train.sh", ["/data/cifar", "zoo.yaml", "/ckpt/resnet-90_195.ckpt"],
     ["train.py", "--config_path", "zoo.yaml", "--data_path", "/data/cifar",
      "--resume_ckpt", "/ckpt/resnet-90_195.ckpt"]),
    # ... [RUN_EVAL] [EVAL_DATASET_PATH] [RESUME_CKPT], next to our own options
    ("run_standalone_train.sh", ["/data/cifar", "zoo.yaml", "True", "/data/val", "/c.ckpt", "--epoch_size", "3"],
     ["train.py", "--config_path", "zoo.yaml", "--data_path", "/data/cifar", "--run_eval", "True",
      "--eval_dataset_path", "/data/val", "--resume_ckpt", "/c.ckpt", "--epoch_size", "3"]),
    # bash run_standalone_train_gpu.sh [DATASET_PATH] [CONFIG_PATH]
    ("run_standalone_train_gpu.sh", ["/data/cifar", "zoo.yaml"],
     ["train.py", "--config_path", "zoo.yaml", "--data_path", "/data/cifar", "--device_target", "GPU"]),
    # bash run_eval.sh [DATASET_PATH] [CHECKPOINT_PATH] [CONFIG_PATH]
    ("run_eval.sh", ["/data/cifar", "/c.ckpt", "zoo.yaml"],
     ["eval.py", "--config_path", "zoo.yaml", "--data_path", "/data/cifar", "--eval_dataset_path", "/data/cifar",
      "--checkpoint_file_path", "/c.ckpt"]),
    ("run_eval_gpu.sh", ["/data/cifar", "/c.ckpt", "zoo.yaml"],
     ["eval.py", "--config_path", "zoo.yaml", "--data_path", "/data/cifar", "--eval_dataset_path", "/data/cifar",
      "--checkpoint_file_path", "/c.ckpt", "--device_target", "GPU"]),
])
def test_zoo_command_lines_dry_run(script, args, expected):
    result = run(["bash", str(REPO / "scripts" / script)] + args + ["--dry_run"])
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[0].endswith("python") and words[1].endswith(expected[0]) and words[2:] == expected[1:]


def test_zoo_distributed_command_line_dry_run(zoo_files):
    # bash run_distribute_train.sh [RANK_TABLE_FILE] [DATASET_PATH] [CONFIG_PATH] [RESUME_CKPT]
    result = run(["bash", str(REPO / "scripts" / "run_distribute_train.sh"), "/x/hccl_8p.json", "/data/imagenet",
                  str(zoo_files["cifar10"]), "/c.ckpt", "--dry_run"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 8 and lines[3].startswith("RANK_TABLE_FILE=/x/hccl_8p.json RANK_SIZE=8 RANK_ID=3 DEVICE_ID=3 ")
    assert lines[3].split()[6:] == ["--config_path", str(zoo_files["cifar10"]), "--data_path", "/data/imagenet",
                                    "--device_target", "Ascend", "--run_distribute", "True", "--device_num", "8",
                                    "--resume_ckpt", "/c.ckpt"]
    # bash run_distribute_train_gpu.sh [DATASET_PATH] [CONFIG_PATH]: msrun, 8 GPUs
    gpu = run(["bash", str(REPO / "scripts" / "run_distribute_train_gpu.sh"), "/data/imagenet",
               str(zoo_files["cifar10"]), "--dry_run"])
    assert gpu.returncode == 0, gpu.stderr
    assert gpu.stdout.startswith("msrun --worker_num=8 ") and "--device_target GPU --run_distribute True" in gpu.stdout


def test_too_many_trailing_arguments_is_one_line():
    result = run(["bash", str(REPO / "scripts" / "run_standalone_train.sh"), "/d", "c.yaml", "a", "b", "c", "d",
                  "--dry_run"])
    assert "too many arguments after CONFIG_PATH" in one_line_error(result)
