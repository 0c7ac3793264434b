"""src/training/thor.py: optimizer Thor (the model zoo's Thor configs) on Ascend/GPU, refused on CPU.

Training with THOR needs an Ascend or GPU device, which this machine lacks; what is tested here is
everything before a device trains: the checks, the split points and the schedules train.py feeds
to nn.thor, and the one-line refusal of a real train.py run on CPU."""
import numpy as np
import pytest

from conftest import PYTHON, one_line_error, run
from src.config import load_config
from src.errors import UserInputError
from src.resnet import create_model
from src.training.distributed import fusion_split_points
from src.training.factory import create_schedule
from src.training.optimizer import parameter_kinds
from src.training.thor import check_thor, create_thor_optimizer, thor_conflicts, thor_damping, thor_layer_points

THOR_ARGS = ["--optimizer", "Thor", "--device_target", "Ascend", "--net_name", "resnet50", "--epoch_size", "4",
             "--lr_end_epoch", "5", "--lr_init", "0.1", "--lr_decay", "2", "--damping_init", "0.04",
             "--damping_decay", "0.25", "--frequency", "4", "--run_eval", "False"]


def thor_config(*extra: str):
    return load_config(THOR_ARGS + list(extra))


def test_the_default_recipe_has_no_conflicts_and_passes_on_ascend_and_gpu():
    assert thor_conflicts(thor_config()) == []
    for device in ("Ascend", "GPU"):
        check_thor(thor_config("--device_target", device))


def test_cpu_is_refused_in_one_line():
    with pytest.raises(UserInputError, match="optimizer Thor runs on Ascend or GPU only") as err:
        check_thor(thor_config("--device_target", "CPU"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("key, value", [
    ("dataset_sink_mode", "False"), ("model_ema", "True"), ("grad_accumulation_steps", "2"),
    ("clip_grad_norm", "1.0"), ("loss_scale_type", "dynamic"), ("boost_mode", "O1"), ("use_nesterov", "True"),
    ("run_eval", "True"), ("resume", "True"), ("resume_ckpt", "x.ckpt"), ("net_name", "resnext50_32x4d"),
    ("norm_weight_decay", "0.5"),
])
def test_switches_thor_does_not_combine_with_are_named(key, value):
    cfg = thor_config(f"--{key}", value)
    assert [item.split()[0] for item in thor_conflicts(cfg)] == [key]
    with pytest.raises(UserInputError, match=key):
        check_thor(cfg)


def test_norm_decay_equal_to_weight_decay_is_one_decay_value():
    assert thor_conflicts(thor_config("--weight_decay", "0.0005", "--norm_weight_decay", "0.0005")) == []


@pytest.mark.parametrize("args, word", [(["--frequency", "1"], "frequency"),
                                        (["--lr_end_epoch", "3"], "lr_end_epoch 3")])
def test_bad_thor_keys_are_refused(args, word):
    with pytest.raises(UserInputError, match=word):
        check_thor(thor_config(*args))


def test_schedules_train_py_feeds_thor():
    """lr 0.1 * (1 - e / 5) ** 2 and damping 0.04 * 0.25 ** (e / 10), 2 steps per epoch, 4 epochs:
    step 1 ends epoch 1 -> lr 0.064, damping 0.04 * 2 ** -0.2 = 0.0348220225."""
    cfg = thor_config()
    lrs = create_schedule(cfg, steps_per_epoch=2)
    damping = thor_damping(cfg, steps_per_epoch=2)
    assert lrs.shape == damping.shape == (8,)
    assert lrs[1] == pytest.approx(0.064) and damping[1] == pytest.approx(0.0348220225)


def resnet50_layers():
    """Per trainable parameter of the zoo's ResNet50 (1001 classes): is it a THOR layer's weight."""
    net = create_model("resnet50", num_classes=1001, initialize=False)  # names and shapes only
    kinds = parameter_kinds(net)
    params = net.trainable_params()
    return [kinds.get(p.name) == "weight" for p in params], [int(np.prod(p.shape)) for p in params]


@pytest.mark.slow
def test_zoo_fusion_points_map_to_thor_layer_points():
    """The Ascend Thor file's all_reduce_fusion_config [80, 160] is the zoo's THOR split_indices
    [26, 53] (53 convolutions and fc: 54 layers); the GPU file's [75, 155] ends at layers 25 and 51."""
    is_layer, sizes = resnet50_layers()
    assert len(is_layer) == 161 and sum(is_layer) == 54
    assert thor_layer_points([80, 160], is_layer) == [26, 53]
    assert thor_layer_points([75, 155], is_layer) == [25, 51]
    derived = thor_layer_points(fusion_split_points(sizes), is_layer)
    assert derived == sorted(derived) and all(0 <= point < 54 for point in derived)
    with pytest.raises(UserInputError, match="161"):
        thor_layer_points([161], is_layer)


@pytest.mark.slow
def test_nn_thor_builds_over_this_repositorys_resnet():
    """nn.thor builds on any device (only its training needs Ascend/GPU): it converts resnet18's
    20 convolutions and fc into THOR's layers (21 A/G pairs) and decays the weights named."""
    from mindspore import nn

    net = create_model("resnet18", num_classes=10)
    kinds = parameter_kinds(net)
    names = [p.name for p in net.trainable_params()]
    decayed = [name for name in names if kinds.get(name) == "weight"]
    opt = create_thor_optimizer(net, lrs=np.full(8, 0.1, np.float32), damping=np.full(8, 0.03, np.float32),
                                momentum=0.9, weight_decay=1e-4, decayed=decayed, loss_scale=128, batch_size=4,
                                frequency=4, split_indices=None)
    assert len(opt.matrix_a_cov) == len(opt.matrix_g_cov) == 21 == len(decayed)
    assert sum(isinstance(cell, nn.Conv2dThor) for _, cell in net.cells_and_names()) == 20
    assert [p.name for p in opt.parameters] == names  # the conversion keeps the parameter names
    assert [flag for flag in opt.decay_flags] == [name in decayed for name in names]
    assert opt.get_frequency() == 4


@pytest.mark.slow
def test_train_py_refuses_thor_on_cpu_and_writes_nothing(tmp_path, folder_dir):
    result = run([PYTHON, "train.py", *THOR_ARGS, "--device_target", "CPU", "--dataset", "imagenet2012",
                  "--data_path", str(folder_dir), "--output_dir", str(tmp_path / "out")])
    assert "optimizer Thor runs on Ascend or GPU only" in one_line_error(result)
    assert not (tmp_path / "out").exists()
