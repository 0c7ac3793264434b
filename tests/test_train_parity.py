"""Training parity with PyTorch (train_parity.py): runs that agree, planted differences found and
named, the non-finite finder, bad input; and the pieces both sides share."""
import json
from pathlib import Path
from typing import List, Tuple

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from conftest import NO_CURVES, NO_TORCH, PYTHON, last_json, read_metrics, run

torch = pytest.importorskip("torch", reason=NO_TORCH)  # before the modules below import it

from src.data.host_stage import Normalization, host_input_stage  # noqa: E402
from src.data.input_stage import TrainInputStage  # noqa: E402
from src.migration import torch_resnet  # noqa: E402
from src.migration.learning import LEARN_FLOOR, learning_verdict  # noqa: E402
from src.migration.torch_training import EmaPlan, TorchRecipe, torch_param_groups  # noqa: E402
from src.resnet import create_model  # noqa: E402
from src.training.checkpoint import read_checkpoint  # noqa: E402
from src.training.optimizer import param_groups  # noqa: E402

pytestmark = pytest.mark.slow
TOOL = [PYTHON, "train_parity.py"]
NET = "resnet10"  # the smallest of the family: what is compared does not depend on depth
SMALL = ["--config_path", "config/resnet18_cifar10.yaml", "--net_name", NET, "--device_target", "CPU",
         "--train_image_size", "32",
         "--batch_size", "8", "--num_parallel_workers", "1", "--lr_max", "0.01", "--warmup_epochs", "1",
         "--epoch_size", "3", *NO_CURVES]
PLANTED = '''
import torch

from src.migration import torch_resnet


def resnet10_planted(num_classes=1000):
    """Two wrong definitions: an epsilon in one BatchNorm, a momentum in another."""
    model = torch_resnet.resnet10(num_classes)
    model.layer2[0].bn1.eps = 1e-2
    model.layer3[0].bn2.momentum = 0.5
    return model


class LateBiasGradient(torch.nn.Linear):
    """A Linear whose bias gradient is scaled by 1.5 from its second forward on: the loss and every
    step-1 tensor agree, only the weights after step 2 (fc.bias) differ."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        bias = self.bias if self.calls < 2 else self.bias * 1.5 - self.bias.detach() * 0.5
        return torch.nn.functional.linear(x, self.weight, bias)


def resnet10_late_bias(num_classes=1000):
    model = torch_resnet.resnet10(num_classes)
    late = LateBiasGradient(model.fc.in_features, model.fc.out_features)
    late.load_state_dict(model.fc.state_dict())
    model.fc = late
    return model


class TransposedKernelGradient(torch.nn.Conv2d):
    """A convolution whose output and input gradient are right but whose kernel gradient comes back
    transposed (in <-> out channels): only a comparison of weight gradients can see it."""

    def forward(self, x):
        kernel = self.weight.transpose(0, 1)
        kernel = kernel + (self.weight - kernel).detach()  # the value of weight, the gradient transposed
        return self._conv_forward(x, kernel, self.bias)


def resnet10_transposed_kernel_gradient(num_classes=1000):
    model = torch_resnet.resnet10(num_classes)
    old = model.layer2[0].conv2
    planted = TransposedKernelGradient(old.in_channels, old.out_channels, old.kernel_size, old.stride, old.padding,
                                       bias=False)
    planted.load_state_dict(old.state_dict())
    model.layer2[0].conv2 = planted
    return model


def resnext_reflect(num_classes=1000):
    """One 3x3 grouped convolution that pads by reflection instead of zeros."""
    model = torch_resnet.resnext50_32x4d(num_classes)
    model.layer2[0].conv2.padding_mode = "reflect"
    return model
'''


def parity(cifar_dir: Path, out: Path, *extra: str, env=None):
    result = run(TOOL + SMALL + ["--data_path", str(cifar_dir), "--output_dir", str(out)] + list(extra),
                 env=env)
    return result, (last_json(result.stdout) if result.stdout.strip() else None)


def planted(tmp_path: Path, model: str) -> Tuple[List[str], dict]:
    """The arguments and environment that run train_parity.py against a model of PLANTED, in
    PYNATIVE mode: these tests check the finder's verdict, which does not depend on the mode, and
    their one or two steps cost less than a graph compile (the runs that agree check GRAPH mode)."""
    (tmp_path / "planted.py").write_text(PLANTED)
    import os
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{Path(__file__).resolve().parents[1]}")
    return ["--torch_model", f"planted:{model}", "--pynative"], env


def test_the_v2_switches_train_alike_step_by_step(cifar_dir, tmp_path):
    """Nesterov SGD, decay groups, label smoothing, erasing, mixup/CutMix soft targets, clipping,
    two micro-batches and an EMA updated every step: every loss, gradient, weight, statistic,
    momentum buffer and EMA weight within tolerance; the files a user checks with their own code."""
    out = tmp_path / "out"
    result, report = parity(
        cifar_dir, out, "--steps", "3", "--optimizer", "SGD", "--use_nesterov", "True", "--weight_decay", "1e-4",
        "--norm_weight_decay", "0.0", "--bias_weight_decay", "1e-4", "--auto_augment", "ta_wide",
        "--random_erase", "0.5", "--mixup_alpha", "0.2", "--cutmix_alpha", "1.0", "--use_label_smooth", "True",
        "--label_smooth_factor", "0.1", "--clip_grad_norm", "0.5", "--batch_size", "4",
        "--grad_accumulation_steps", "2", "--model_ema", "True", "--model_ema_steps", "1",
        "--model_ema_decay", "0.9", "--plot_curves", "True")  # loss.png is checked below
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["ok"] and report["first_difference"] is None and report["steps"] == 3
    steps = read_metrics(out / "steps.csv")
    assert [int(r["step"]) for r in steps] == [1, 2, 3] and all(r["within"] == "True" for r in steps)
    model = torch_resnet.resnet10(10)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert [r["name"] for r in read_metrics(out / "gradients.csv")] == trained
    weights = read_metrics(out / "weights.csv")
    kinds = {r["what"] for r in weights}
    assert kinds == {"after step 1", "batch statistics of step 1", "optimizer state after step 1", "after step 3",
                     "EMA after step 3"}
    assert {r["name"] for r in weights if r["what"] == "optimizer state after step 1"} == \
        {f"momentum_buffer.{name}" for name in trained}
    assert all(r["within"] == "True" for r in weights)
    model.load_state_dict(torch.load(out / "final.pth", weights_only=True), strict=True)
    saved = read_checkpoint(str(out / "final.ckpt"))
    assert np.abs(saved["fc.weight"].asnumpy() - model.fc.weight.detach().numpy()).max() < 1e-3
    assert any(name.startswith("ema.") for name in saved)
    assert (out / "loss.png").stat().st_size > 1000


def test_adamw_on_dumped_batches_in_pynative_mode_compares_every_layer(cifar_dir, tmp_path):
    """--batches (a user's own loader), AdamW, PYNATIVE, --per_layer: every layer within its floor."""
    batches = tmp_path / "batches"
    batches.mkdir()
    rng = np.random.default_rng(3)
    for step in range(2):
        np.save(batches / f"{step:06d}_images.npy", rng.standard_normal((4, 3, 32, 32)).astype(np.float32))
        np.save(batches / f"{step:06d}_labels.npy", rng.integers(0, 10, 4).astype(np.int64))
    out = tmp_path / "out"
    # Gradients near zero whose sign the frameworks round apart (two BatchNorm scales of resnet18 on an
    # AMD EPYC with AVX2) are set aside in the step-1 weights: AdamW's first step moves them by +-lr.
    result, report = parity(cifar_dir, out, "--steps", "2", "--batches", str(batches), "--optimizer", "AdamW",
                            "--weight_decay", "0.05", "--pynative", "--per_layer", "--net_name", "resnet18")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["ok"] and report["mode"] == "PYNATIVE" and report["first_difference"] is None
    layers = read_metrics(out / "layers.csv")
    judged = [r for r in layers if not r["status"].startswith("not compared")]
    assert len(judged) > 50 and all(r["status"] == "ok" for r in judged)
    slots = {r["name"].split(".")[0] for r in read_metrics(out / "weights.csv") if r["what"].startswith("optimizer")}
    assert slots == {"exp_avg", "exp_avg_sq"}


def test_weights_whose_gradient_sign_is_a_rounding_tie_are_set_aside_after_a_sign_step():
    """AdamW's first step moves a weight by ~lr times its gradient's sign: an element whose gradient
    the frameworks round to opposite signs parts by 2 lr. Those elements (and only those) are set
    aside in the step-1 weights, with a note; the others are judged as before."""
    from src.migration.train_compare import compare_tables, opposite_signs
    ms_grad = np.array([1e-3, -2e-9, 5e-4], np.float32)
    torch_grad = np.array([1e-3, 3e-9, 5e-4], np.float32)
    ties = opposite_signs({"w": ms_grad}, {"w": torch_grad})
    assert ties["w"].tolist() == [False, True, False]
    lr = 0.01
    torch32 = np.array([1.0, 1.0 - lr, 2.0], np.float32)
    torch64 = torch32.astype(np.float64) + 1e-9
    ms_after = np.array([1.0, 1.0 + lr, 2.0], np.float32)  # the tied element stepped the other way
    (judged,) = compare_tables("after step 1", {"w": ms_after}, {"w": torch32}, {"w": torch64}, 100.0)
    assert not judged["within"]
    (aside,) = compare_tables("after step 1", {"w": ms_after}, {"w": torch32}, {"w": torch64}, 100.0, ties)
    assert aside["within"] and aside["note"].startswith("1 element(s) not compared")
    ms_after[2] += lr  # a difference where the signs agree is still judged
    (other,) = compare_tables("after step 1", {"w": ms_after}, {"w": torch32}, {"w": torch64}, 100.0, ties)
    assert not other["within"]


def test_planted_batchnorm_epsilon_and_momentum_are_found_and_named(cifar_dir, tmp_path):
    out = tmp_path / "out"
    args, env = planted(tmp_path, "resnet10_planted")
    result, report = parity(cifar_dir, out, "--steps", "1", *args, env=env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["ok"] is False and report["first_bad_step"] == 1
    assert report["first_difference"] == "layer2.0.bn1"
    assert not (out / "loss.png").exists() and (out / "steps.csv").exists()  # --plot_curves False
    differing = {r["layer"] for r in read_metrics(out / "layers.csv") if r["status"] == "differs"}
    leaves = {name for name in differing if name.split(".")[-1].startswith(("bn", "conv"))}
    assert leaves == {"layer2.0.bn1", "layer3.0.bn2"}
    momentum_row = next(r for r in read_metrics(out / "layers.csv") if r["layer"] == "layer3.0.bn2")
    assert float(momentum_row["running_mean_ratio"]) > 1e3 and float(momentum_row["output_ratio"]) < 30


def test_a_difference_only_in_the_final_weights_fails_and_is_named(cifar_dir, tmp_path):
    """Every loss and step-1 tensor agree; only fc.bias after step 2 does not: the verdict must say FAIL."""
    out = tmp_path / "out"
    args, env = planted(tmp_path, "resnet10_late_bias")
    result, report = parity(cifar_dir, out, "--steps", "2", *args, env=env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["ok"] is False and report["first_bad_step"] is None
    assert report["tensors_beyond"] == ["after step 2: fc.bias"]
    assert report["tensors_within"] == report["tensors"] - 1
    beyond = [r for r in read_metrics(out / "weights.csv") if r["within"] != "True"]
    assert [(r["what"], r["name"]) for r in beyond] == [("after step 2", "fc.bias")]


def test_a_kernel_gradient_wrong_only_in_the_weights_is_named_by_the_layer_finder(cifar_dir, tmp_path):
    out = tmp_path / "out"
    args, env = planted(tmp_path, "resnet10_transposed_kernel_gradient")
    result, report = parity(cifar_dir, out, "--steps", "1", *args, env=env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["first_bad_step"] == 1 and report["first_difference"] == "layer2.0.conv2"
    layer = next(r for r in read_metrics(out / "layers.csv") if r["layer"] == "layer2.0.conv2")
    assert layer["weight_grad_worst"] == "weight" and float(layer["weight_grad_ratio"]) > 1e3
    assert float(layer["output_ratio"]) < 100 and float(layer["input_grad_ratio"]) < 100
    differing = {r["layer"] for r in read_metrics(out / "layers.csv") if r["status"] == "differs"}
    assert {name for name in differing if name.split(".")[-1].startswith(("bn", "conv"))} == {"layer2.0.conv2"}


def test_a_planted_convolution_padding_in_resnext_is_found(cifar_dir, tmp_path):
    out = tmp_path / "out"
    args, env = planted(tmp_path, "resnext_reflect")
    result, report = parity(cifar_dir, out, "--steps", "1", "--arch", "resnext50_32x4d", "--batch_size", "4", *args,
                            env=env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["first_difference"] == "layer2.0.conv2"


def test_the_first_non_finite_layer_of_a_replayed_step_is_named(cifar_dir, tmp_path):
    """A checkpoint whose layer3.0.conv1 weights overflow float32: its output is the first Inf."""
    net = create_model(NET, num_classes=10)
    entries = []
    for param in net.get_parameters():
        value = param.asnumpy()
        if param.name == "layer3.0.conv1.weight":
            value = np.full_like(value, 1e38)
        entries.append({"name": param.name, "data": Tensor(value)})
    ckpt = tmp_path / "planted.ckpt"
    ms.save_checkpoint(entries, str(ckpt))
    out = tmp_path / "out"
    result, report = parity(cifar_dir, out, "--find_nonfinite", "--ckpt", str(ckpt), "--step", "2")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["first_nonfinite_layer"] == "layer3.0.conv1"
    found = json.loads((out / "nonfinite.json").read_text())
    assert found["first_layer"] == "layer3.0.conv1" and found["first_layer_input_finite"] is True


def test_a_data_parallel_runs_step_is_replayed_as_its_rank_saw_it(cifar_dir, tmp_path):
    """A checkpoint beside another rank's files is from a data-parallel run: without --ranks and
    --rank the replay refuses in one line; with them it replays that rank's share of the step."""
    net = create_model(NET, num_classes=10)
    ckpt = tmp_path / "run" / f"{NET}-1_4.ckpt"
    ckpt.parent.mkdir()
    ms.save_checkpoint(net, str(ckpt))
    (tmp_path / "run" / "nonfinite_rank1.json").write_text("{}")
    refused, _ = parity(cifar_dir, tmp_path / "out", "--find_nonfinite", "--ckpt", str(ckpt), "--step", "3")
    assert refused.returncode == 2
    assert "is from a data-parallel run (nonfinite_rank1.json)" in refused.stderr and "--ranks N" in refused.stderr
    replays = {}
    for rank in (0, 1):
        result, report = parity(cifar_dir, tmp_path / f"out{rank}", "--find_nonfinite", "--ckpt", str(ckpt),
                                "--step", "3", "--ranks", "2", "--rank", str(rank))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert (report["rank"], report["ranks"], report["ok"]) == (rank, 2, True)
        replays[rank] = report["loss"]
    assert replays[0] != replays[1]  # each rank's own batch


@pytest.mark.parametrize("extra, expected", [
    (["--arch", "se-resnet50"], "has no PyTorch reference"),
    (["--optimizer", "LARS"], "torch.optim has no LARS"),
    (["--batches", "missing_folder"], "is not a folder"),
])
def test_bad_requests_are_refused_before_any_work(cifar_dir, tmp_path, extra, expected):
    """The command refuses in one line (exit 2) before it makes its output folder."""
    result, report = parity(cifar_dir, tmp_path / "out", *extra)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and report is None and len(lines) == 1, result.stderr[-3000:]
    assert expected in lines[0]
    assert not (tmp_path / "out").exists()


def test_bad_dumped_batches_are_named(cifar_dir, tmp_path):
    batches = tmp_path / "batches"
    batches.mkdir()
    np.save(batches / "000000_images.npy", np.zeros((4, 32, 32, 3), np.float32))
    np.save(batches / "000000_labels.npy", np.zeros(4, np.int64))
    result, _ = parity(cifar_dir, tmp_path / "out", "--steps", "1", "--batches", str(batches))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1
    assert "000000_images.npy: images must be float32 [B, 3, H, W]" in lines[0]


# ---------------------------------------------------------------------------------------------
# The pieces, in process.

def test_host_input_stage_equals_the_graphs():
    """The float inputs and soft targets PyTorch gets are the ones the training graph computes."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 16, 16, 3)).astype(np.uint8)
    labels = rng.integers(0, 10, 4).astype(np.int32)
    erase = np.array([[2, 3, 5, 4], [0, 0, 0, 0], [10, 10, 6, 6], [1, 0, 3, 16]], np.int32)
    mix = np.array([0.7, 0.3, 0.7, 0.3, 4, 2, 12, 9], np.float32)
    normalization = Normalization((0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    stage = TrainInputStage(normalization, batch_stage=True, mixes=True, num_classes=10)
    graph_images, graph_targets = stage(Tensor(images), Tensor(labels), Tensor(erase), Tensor(mix))
    host_images, host_targets = host_input_stage(images, labels, erase, mix, normalization=normalization,
                                                 num_classes=10, mixes=True)
    assert np.abs(graph_images.asnumpy() - host_images).max() < 1e-5
    assert np.array_equal(graph_targets.asnumpy(), host_targets)


def test_torch_decay_groups_are_this_repositorys():
    net, model = create_model("resnet18", num_classes=10), torch_resnet.resnet18(10)
    ms_groups = param_groups(net, 1e-4, 0.0, 5e-5)[:-1]
    ms_decay = {p.name: group["weight_decay"] for group in ms_groups for p in group["params"]}
    names = {id(p): name for name, p in model.named_parameters()}
    recipe = TorchRecipe(optimizer="SGD", weight_decay=1e-4, norm_weight_decay=0.0, bias_weight_decay=5e-5)
    torch_decay = {names[id(p)]: group["weight_decay"] for group in torch_param_groups(model, recipe)
                   for p in group["params"]}
    renamed = {name.replace(".gamma", ".weight").replace(".beta", ".bias"): value for name, value in ms_decay.items()}
    assert torch_decay == renamed


def test_ema_plan_moves_when_the_mindspore_schedule_does():
    """Values written down from the definition (src/training/train_step.py, EmaSchedule): the average
    moves at the steps whose place in the epoch is a multiple of `every` (places 0, 3, 6 of 7), by
    1 (a copy) up to step `copy_until`, else by alpha."""
    plan = EmaPlan(alpha=0.25, every=3, steps_per_epoch=7, copy_until=2)
    assert [plan.weight_of_raw(step) for step in range(20)] == [
        1.0, 0, 0, 0.25, 0, 0, 0.25,      # epoch 1: places 0..6
        0.25, 0, 0, 0.25, 0, 0, 0.25,     # epoch 2
        0.25, 0, 0, 0.25, 0, 0]           # epoch 3, places 0..5
    every_step = EmaPlan(alpha=0.5, every=1, steps_per_epoch=4, copy_until=2)
    assert [every_step.weight_of_raw(step) for step in range(6)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]


def test_learning_side_by_side_reports_both_curves_per_seed(tmp_path):
    """--learn on the default data (scikit-learn's digits): held-out top-1 of both frameworks for
    each seed and epoch, streamed from the pipelines, and the verdict: the difference of the final
    means against its standard error over the seeds (one seed: LEARN_FLOOR), whichever way it goes."""
    result = run(TOOL + ["--learn", "1", "--seeds", "1", "--config_path", "config/resnet18_cifar10.yaml",
                         "--net_name", NET, "--device_target", "CPU", "--train_image_size", "32",
                         "--eval_image_size", "32", "--batch_size", "128", "--warmup_epochs", "0",
                         "--num_parallel_workers", "1", "--output_dir", str(tmp_path)])
    report = last_json(result.stdout)
    curves = report["learn"]["1"]
    assert list(report["learn"]) == ["1"]
    assert all(len(curves[side]) == 1 and 0.0 <= curves[side][0] <= 1.0 for side in ("mindspore", "torch"))
    verdict = report["verdict"]
    difference = abs(curves["mindspore"][0] - curves["torch"][0])
    assert verdict["standard_error"] == 0.0 and verdict["allowed"] == LEARN_FLOOR  # one seed: no spread
    assert verdict["difference"] == pytest.approx(difference)
    assert report["ok"] == (difference <= LEARN_FLOOR)  # which verdict, and why
    assert result.returncode == (0 if report["ok"] else 1), result.stderr[-3000:]
    assert (tmp_path / "digits" / "test_batch.bin").exists()


def test_the_learning_rule_is_a_difference_of_means_against_the_spread():
    """Seed ranges that overlap (one seed of MindSpore's fell low) but means 0.08 apart with a
    standard error of 0.02 fail; means within two standard errors pass; one seed gets the floor."""
    apart = {seed: {"mindspore": [ms_top1], "torch": [0.70]}
             for seed, ms_top1 in enumerate([0.80, 0.80, 0.80, 0.80, 0.70])}
    verdict = learning_verdict(apart)
    assert verdict["difference"] == pytest.approx(0.08)
    assert verdict["standard_error"] == pytest.approx(np.std([0.8] * 4 + [0.7], ddof=1) / 5 ** 0.5)
    assert verdict["allowed"] == pytest.approx(2 * verdict["standard_error"]) and verdict["ok"] is False
    close = {1: {"mindspore": [0.80], "torch": [0.78]}, 2: {"mindspore": [0.70], "torch": [0.74]}}
    assert learning_verdict(close)["ok"] is True  # 0.01 apart, standard error 0.054
    one = learning_verdict({1: {"mindspore": [0.80], "torch": [0.79]}})
    assert (one["standard_error"], one["allowed"], one["ok"]) == (0.0, LEARN_FLOOR, True)
