"""Fine-tuning with a frozen backbone (freeze_backbone): only the head trains, BatchNorm statistics
stay as loaded, and no gradient crosses the backbone."""
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from conftest import NO_CURVES, PYTHON, REPO, run
from src.resnet import create_model
from src.training.checkpoint import read_checkpoint

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
RUN = Path("resnet18") / "cifar10"


def test_only_the_head_is_trainable_and_batch_norm_is_in_inference_mode():
    net = create_model("resnet18", num_classes=10, freeze_backbone=True)
    assert [p.name for p in net.trainable_params()] == ["fc.weight", "fc.bias"]
    norms = [cell for _, cell in net.cells_and_names() if isinstance(cell, nn.BatchNorm2d)]
    assert len(norms) == 20 and not any(cell.use_batch_statistics for cell in norms)
    assert len(create_model("resnet18", num_classes=10).trainable_params()) == 62


@pytest.mark.parametrize("frozen", [True, False])
def test_no_gradient_reaches_the_backbone(frozen):
    """The gradient with respect to the input image passes through the whole backbone: a frozen
    network cuts it at the head (zero), an unfrozen one does not."""
    net = create_model("resnet18", num_classes=10, freeze_backbone=frozen)
    net.set_train(True)
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32))
    grad_x = ops.GradOperation()(lambda images: net(images).sum())(x).asnumpy()
    assert (np.abs(grad_x).max() == 0.0) == frozen


def write_pretrained(path: Path) -> dict:
    """A 1001-class resnet18 checkpoint (as the model zoo's ImageNet ones) whose BatchNorm statistics
    are far from their initial 0/1, so an update of any of them would show."""
    net = create_model("resnet18", num_classes=1001)
    rng = np.random.default_rng(1)
    for param in net.get_parameters():
        if param.name.endswith("moving_mean"):
            param.set_data(Tensor(rng.normal(0.0, 0.5, param.shape).astype(np.float32)))
        elif param.name.endswith("moving_variance"):
            param.set_data(Tensor(rng.uniform(0.5, 2.0, param.shape).astype(np.float32)))
    ms.save_checkpoint(net, str(path))
    return {p.name: p.asnumpy() for p in net.get_parameters()}


@pytest.mark.slow
def test_frozen_backbone_run_changes_only_the_head(cifar_dir, tmp_path):
    before = write_pretrained(tmp_path / "imagenet.ckpt")
    common = [PYTHON, "train.py", "--config_path", CONFIG, "--data_path", str(cifar_dir), "--batch_size", "16",
              "--epoch_size", "1", "--warmup_epochs", "0", "--lr_max", "0.05", "--run_eval", "False", *NO_CURVES]
    refused = run(common + ["--output_dir", str(tmp_path / "a"), "--freeze_backbone", "True"])
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
    assert "--pre_trained" in refused.stderr and not (tmp_path / "a").exists()

    tuned = run(common + ["--output_dir", str(tmp_path / "b"), "--freeze_backbone", "True", "--pre_trained",
                          str(tmp_path / "imagenet.ckpt"), "--filter_weight", "True"])
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    after = {k: v.asnumpy() for k, v in read_checkpoint(str(tmp_path / "b" / RUN / "resnet18-1_12.ckpt")).items()}
    backbone = [name for name in before if not name.startswith("fc.")]
    assert len(backbone) == 100  # 20 conv weights, 20 BatchNorms x 4
    for name in backbone:
        assert np.array_equal(after[name], before[name]), name  # bit-identical, statistics included
    assert after["fc.weight"].shape == (10, 512)
    assert [k for k in after if k.startswith("moments.")] == ["moments.fc.weight", "moments.fc.bias"]
    assert np.abs(after["moments.fc.weight"]).max() > 0  # the head did take gradient steps
