"""The model zoo's SE-ResNet50 (`net_name: se-resnet50`): its structure and names as the zoo
defines it (mindspore-ai/models official/cv/ResNet/src/resnet.py, `se_resnet50`), and a checkpoint
under the zoo's names through eval.py, export.py and the converter."""
from pathlib import Path
from typing import List

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from conftest import PYTHON, last_json, run
from src.errors import UserInputError
from src.evaluation.model_summary import model_summary
from src.resnet import create_model
from src.training.checkpoint import common_prefix, read_checkpoint, zoo_to_ms_name

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier

# Counted by hand from the zoo's definition. Stem: 3x3 convs 3->32, 32->32, 32->64 (864 + 9,216 +
# 18,432) and three BNs (64 + 64 + 128): 28,768, 19,232 more than ResNet50's 7x7 stem (9,536). The
# blocks have ResNet50's convolutions (the 3x3 of a downsampling block sits in e2, at stride 1), plus
# squeeze-excitation in layer3.5 (1024->256->1024: 525,568) and layer4.2 (2048->512->2048: 2,099,712).
# 25,557,032 + 19,232 + 2,625,280 = 28,201,544 at 1000 classes; +2,049 at 1001.
PARAMETERS_1000 = 28_201_544
PARAMETERS_1001 = 28_203_593
# 55 convolutions + 55 BatchNorms x (gamma, beta) + 5 dense layers x (weight, bias) = 175 trainable
# tensors; with the BatchNorm statistics 285 (ResNet50: 161 / 267).
TRAINABLE_TENSORS, ALL_TENSORS = 175, 285
BN_FIELDS = ("gamma", "beta", "moving_mean", "moving_variance")
STAGES = ((3, 1), (4, 2), (6, 2), (3, 2))  # (blocks, stride) of layer1..4


def zoo_name(name: str) -> str:
    """This repository's SE-ResNet50 name -> the model zoo's (the two modules every zoo checkpoint renames)."""
    renames = {"downsample": "down_sample_layer", "fc": "end_point"}
    return ".".join(renames.get(part, part) for part in name.split("."))


def zoo_se_resnet50_names() -> List[str]:
    """The zoo's se_resnet50 parameter names, from the rules of its definition (not from our network)."""
    def conv(module):
        return [f"{module}.weight"]

    def bn(module):
        return [f"{module}.{field}" for field in BN_FIELDS]

    names = conv("conv1_0") + bn("bn1_0") + conv("conv1_1") + bn("bn1_1") + conv("conv1_2") + bn("bn1")
    for stage, (blocks, stride) in enumerate(STAGES, start=1):
        for index in range(blocks):
            block = f"layer{stage}.{index}"
            names += conv(f"{block}.conv1") + bn(f"{block}.bn1")
            strided = index == 0 and stride == 2
            names += conv(f"{block}.e2.0") + bn(f"{block}.e2.1") if strided else \
                conv(f"{block}.conv2") + bn(f"{block}.bn2")
            names += conv(f"{block}.conv3") + bn(f"{block}.bn3")
            if stage >= 3 and index == blocks - 1:  # SE only in the last block of layer3 and layer4
                names += [f"{block}.se_dense_{i}.{field}" for i in (0, 1) for field in ("weight", "bias")]
            if index == 0:  # shortcut: max-pool (no parameters) first where the block strides
                first = 1 if strided else 0
                names += conv(f"{block}.down_sample_layer.{first}") + bn(f"{block}.down_sample_layer.{first + 1}")
    return names + ["end_point.weight", "end_point.bias"]


@pytest.fixture(scope="module")
def se_net():
    return create_model("se-resnet50", num_classes=1001)


def test_parameters_and_names_are_the_zoos(se_net):
    params = list(se_net.get_parameters())
    trainable = se_net.trainable_params()
    assert (len(trainable), len(params)) == (TRAINABLE_TENSORS, ALL_TENSORS)
    assert sum(int(np.prod(p.shape)) for p in trainable) == PARAMETERS_1001
    expected = zoo_se_resnet50_names()
    assert sorted(zoo_name(p.name) for p in params) == sorted(expected)
    assert all(zoo_to_ms_name(zoo_name(p.name)) == p.name for p in params)  # the loader maps them back
    assert common_prefix(["network.layer1.0.conv1.weight", "network.conv1_0.weight"]) == "network."
    shapes = {zoo_name(p.name): tuple(p.shape) for p in params}
    assert shapes["conv1_0.weight"] == (32, 3, 3, 3) and shapes["conv1_2.weight"] == (64, 32, 3, 3)
    assert shapes["layer2.0.e2.0.weight"] == (128, 128, 3, 3)
    assert shapes["layer2.0.down_sample_layer.1.weight"] == (512, 256, 1, 1)
    assert shapes["layer3.5.se_dense_0.weight"] == (256, 1024) and shapes["layer4.2.se_dense_1.weight"] == (2048, 512)
    assert shapes["end_point.weight"] == (1001, 2048)


def test_zoo_layers_pad_same_and_use_bn_eps_1e4(se_net):
    cells = [cell for _, cell in se_net.cells_and_names()]
    convs = [cell for cell in cells if isinstance(cell, nn.Conv2d)]
    norms = [cell for cell in cells if isinstance(cell, nn.BatchNorm2d)]
    assert len(convs) == len(norms) == 55
    assert {conv.pad_mode for conv in convs} == {"same"}
    assert {norm.eps for norm in norms} == {1e-4}


def test_parameter_count_at_1000_classes_and_forward_shape():
    net = create_model("se-resnet50", num_classes=1000)
    assert model_summary(net, image_size=224)["trainable_parameters"] == PARAMETERS_1000
    net.set_train(False)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32))
    assert net.forward_features(x).shape == (2, 2048, 2, 2)  # /32 as in ResNet50: 32, 16, 8, 4, 2
    logits = net(x).asnumpy()
    assert logits.shape == (2, 1000) and np.isfinite(logits).all()


def test_unknown_net_name_lists_se_resnet50():
    with pytest.raises(UserInputError, match="se-resnet50"):
        create_model("se_resnet50")


@pytest.fixture(scope="module")
def zoo_checkpoint(se_net, tmp_path_factory) -> Path:
    """A checkpoint as the zoo's training writes it (zoo names, optimizer slots, counters), whose head
    always answers class 0: zero weights, bias 10 for class 0."""
    path = tmp_path_factory.mktemp("se_zoo") / "se-resnet50-24_5004.ckpt"
    entries = []
    for param in se_net.get_parameters():
        value = param.asnumpy()
        if param.name == "fc.weight":
            value = np.zeros_like(value)
        elif param.name == "fc.bias":
            value = np.where(np.arange(value.size) == 0, 10.0, 0.0).astype(np.float32)
        entries.append({"name": zoo_name(param.name), "data": ms.Tensor(value)})
        if param.requires_grad:
            entries.append({"name": f"moments.{zoo_name(param.name)}", "data": ms.Tensor(np.zeros_like(value))})
    entries += [{"name": "global_step", "data": ms.Tensor(np.array([5004], np.int32))},
                {"name": "learning_rate", "data": ms.Tensor(np.array([0.1], np.float32))}]
    ms.save_checkpoint(entries, str(path))
    return path


def test_zoo_checkpoint_evaluates_through_eval_py(zoo_checkpoint, tiny_folder_dir):
    """Every network tensor loads strictly from the zoo's names; with the head answering class 0
    the top-1 is the share of class-0 images in the evaluated split."""
    result = run([PYTHON, "eval.py", f"--data_path={tiny_folder_dir}", f"--checkpoint_file_path={zoo_checkpoint}",
                  "--net_name", "se-resnet50", "--class_num", "1001", "--dataset", "imagenet2012",
                  "--eval_image_size", "32", "--batch_size", "20", "--device_target=CPU"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    top1 = last_json(result.stdout)["top_1_accuracy"]
    split = tiny_folder_dir / "val"
    classes = sorted(p for p in split.iterdir() if p.is_dir())
    total = sum(len(list(folder.iterdir())) for folder in classes)
    assert top1 == pytest.approx(len(list(classes[0].iterdir())) / total, abs=1e-9)


def test_zoo_checkpoint_exports_to_mindir_that_computes_like_the_network(zoo_checkpoint, tmp_path):
    result = run([PYTHON, "export.py", "--ckpt_file", str(zoo_checkpoint), "--net_name", "se-resnet50",
                  "--class_num", "1001", "--file_name", str(tmp_path / "se-resnet50"), "--file_format", "MINDIR",
                  "--width", "32", "--height", "32", "--batch_size", "1", "--device_target", "CPU"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    graph = nn.GraphCell(ms.load(str(tmp_path / "se-resnet50.mindir")))
    x = ms.Tensor(np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32))
    logits = graph(x).asnumpy()
    assert logits.shape == (1, 1001) and int(logits.argmax()) == 0
    np.testing.assert_allclose(logits[0, 0], 10.0, atol=1e-5)  # the zoo head's bias reached the file


def test_converter_takes_a_zoo_se_resnet50_checkpoint(zoo_checkpoint, tmp_path):
    """--zoo_ckpt -> this repo's names, optimizer state dropped; torchvision has no such network."""
    from src.migration import convert_torch
    target = tmp_path / "se.ckpt"
    assert convert_torch.main(["--arch", "se-resnet50", "--zoo_ckpt", str(zoo_checkpoint), "--ckpt", str(target)]) == 0
    converted = read_checkpoint(str(target))
    assert len(converted) == ALL_TENSORS and "fc.bias" in converted and "layer4.0.downsample.1.weight" in converted
    with pytest.raises(UserInputError, match="torchvision does not have"):
        convert_torch.main(["--arch", "se-resnet50", "--zoo_ckpt", str(zoo_checkpoint), "--pth_out",
                            str(tmp_path / "se.pth")])


def test_zoo_checkpoint_is_a_pre_trained_backbone_for_a_new_head(zoo_checkpoint, se_net):
    """train.py --pre_trained ZOO.ckpt --class_num 10 --filter_weight True: the zoo's backbone
    arrives (names mapped), the 1001-class head is skipped."""
    from src.training.checkpoint import load_pretrained
    net, lines = create_model("se-resnet50", num_classes=10), []
    skipped = load_pretrained(net, str(zoo_checkpoint), head=["fc.weight", "fc.bias"], filter_weight=True,
                              what="se-resnet50", log=lines.append)
    assert skipped == ["fc.weight (1001, 2048)", "fc.bias (1001,)"] and len(lines) == 1
    source = {p.name: p.asnumpy() for p in se_net.get_parameters()}
    loaded = {p.name: p.asnumpy() for p in net.get_parameters()}
    for name in ("conv1_0.weight", "layer2.0.e2.0.weight", "layer3.0.downsample.1.weight",
                 "layer4.2.se_dense_1.bias", "bn1.moving_variance"):
        assert np.array_equal(loaded[name], source[name]), name
