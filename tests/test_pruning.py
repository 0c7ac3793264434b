"""compression prune: pruning of the residual blocks' inner channels by L1 norm and by SCOP's
knockoff scores (Golden Stick's cells); a pruned checkpoint rebuilt from its own shapes; a float
checkpoint pruned by SCOP and fine-tuned by train.py (standalone, relaunched from a mid-run
checkpoint to the same weights, 2 ranks), evaluated by eval.py and exported by export.py (MINDIR,
ONNX); and every checkpoint of the wrong kind one line, nothing written."""
import os
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from test_compression import CONFIG, NET, RUN, TRAIN, train_two_ranks, weights
from test_cpu_layers_convolution import conv_implementations, our_conv_implementations

from conftest import PYTHON, last_json, one_line_error, run, train_args
from src.compression import check_checkpoint_compression, mindspore_convolution_stages
from src.compression.prune import full_widths, kept_channels, prune_blocks, pruned_widths
from src.compression.scop import knockoff_batch, knockoff_scores
from src.config import load_config
from src.cpu_layers import use_onednn_layers
from src.errors import UserInputError
from src.evaluation.model_summary import model_summary
from src.resnet import create_model
from src.runtime import caps_mindspore_isa
from src.training.checkpoint import load_pretrained, network_from_checkpoint
from src.training.factory import check_step_keys, create_ema_twin, prune
from src.training.loss import create_loss

PRUNE = ["--compression", "prune"]
SCOP = ["--prune_criterion", "scop"]
SCOP_RUN = [*SCOP, "--knockoff_epochs", "0.5"]  # 6 knockoff steps of the sample's 12
HALF = [32, 64, 128, 256]  # resnet10's inner widths (64 ... 512) at prune_ratio 0.5


def test_kept_channels_rounds_to_blocks_of_16():
    assert kept_channels(64, 0.5) == 32
    assert kept_channels(512, 0.5) == 256
    assert kept_channels(64, 0.7) == 16
    assert kept_channels(8, 0.5) == 4
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(UserInputError, match="prune_ratio"):
            kept_channels(64, bad)


@pytest.mark.parametrize("net_name", ["resnet18", "resnet50"])
def test_pruning_shrinks_and_keeps_shapes(net_name):
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    net = create_model(net_name, num_classes=10)
    net.set_train(False)
    before = model_summary(net, image_size=32)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32))
    widths = prune_blocks(net, 0.5)
    after = model_summary(net, image_size=32)
    assert widths and all(w % 16 == 0 for w in widths)
    assert after["parameters"] < before["parameters"]
    assert after["gflops"] < before["gflops"]
    assert net(x).shape == (2, 10)
    names = [name for name, _ in net.parameters_and_names()]
    assert [p.name for p in net.get_parameters()] == names
    assert net.layer1[0].conv1.weight.shape[0] == widths[0]
    # the full widths are still read from what pruning leaves whole
    assert list(full_widths(net).values()) == [2 * w for w in widths]


def test_pruning_zero_filters_keeps_outputs():
    """Filters already zero (BatchNorm at its initial beta 0, mean 0) contribute nothing: removing
    them, which L1 ranking does first, leaves the network's outputs as they were."""
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    net = create_model("resnet18", num_classes=10)
    net.set_train(False)
    for cell in (c for _, c in net.cells_and_names() if hasattr(c, "downsample") and hasattr(c, "bn1")):
        weight = cell.conv1.weight.asnumpy().copy()
        weight[1::2] = 0.0
        cell.conv1.weight.set_data(ms.Tensor(weight))
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32))
    expected = net(x).asnumpy()
    prune_blocks(net, 0.5)
    np.testing.assert_allclose(net(x).asnumpy(), expected, rtol=1e-4, atol=1e-5)


def test_knockoffs_are_the_batch_in_an_order_drawn_from_seed_and_step():
    images, labels = np.arange(8, dtype=np.float32).reshape(8, 1), np.arange(8)
    doubled, doubled_labels = knockoff_batch(images, labels, seed=1, step=3)
    assert np.array_equal(doubled[:8], images) and np.array_equal(doubled_labels[8:], doubled[8:, 0].astype(int))
    assert sorted(doubled_labels[8:]) == list(range(8))
    again = knockoff_batch(images, labels, seed=1, step=3)[1]
    assert np.array_equal(again, doubled_labels)
    others = [knockoff_batch(images, labels, seed=seed, step=step)[1] for seed, step in ((1, 4), (2, 3))]
    assert all(not np.array_equal(other, doubled_labels) for other in others)


@pytest.mark.slow
def test_scop_keeps_the_channels_of_highest_knockoff_score():
    """Golden Stick's knockoff cells train their scales off 0.5 in two steps, and pruning keeps each
    block's channels of highest |gamma| (2 kfscale - 1) with their float weights: not the L1 choice."""
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    source = create_model(NET, num_classes=10)
    rng = np.random.default_rng(0)
    for param in source.get_parameters():  # BatchNorm away from its start, so that gamma and the statistics tell
        if param.name.split(".")[-1] in ("gamma", "moving_mean", "moving_variance"):
            param.set_data(ms.Tensor(rng.uniform(0.5, 1.5, param.shape).astype(np.float32)))
    values = {param.name: param.asnumpy() for param in source.get_parameters()}
    batches = [(rng.standard_normal((8, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(2)]
    scores = knockoff_scores(source, batches, np.array([0.1, 0.05], np.float32), seed=1,
                             loss_fn=create_loss(num_classes=10))
    assert sorted(scores) == sorted(f"layer{i}.0.conv{j}" for i in range(1, 5) for j in (1, 2))
    assert all(np.abs(score).max() > 0 for score in scores.values())

    chosen, by_l1 = (create_model(NET, num_classes=10) for _ in range(2))
    for net in (chosen, by_l1):
        ms.load_param_into_net(net, {name: ms.Parameter(ms.Tensor(value), name=name) for name, value in values.items()})
    assert prune_blocks(chosen, 0.5, scores) == prune_blocks(by_l1, 0.5) == HALF
    pruned, l1_pruned = (dict((p.name, p.asnumpy()) for p in net.get_parameters()) for net in (chosen, by_l1))
    for layer, width in zip(range(1, 5), HALF):
        name = f"layer{layer}.0"
        keep = np.sort(np.argsort(-scores[f"{name}.conv1"], kind="stable")[:width])
        assert np.array_equal(pruned[f"{name}.conv1.weight"], values[f"{name}.conv1.weight"][keep])
        for stat in ("gamma", "moving_mean", "moving_variance"):
            assert np.array_equal(pruned[f"{name}.bn1.{stat}"], values[f"{name}.bn1.{stat}"][keep])
        assert np.array_equal(pruned[f"{name}.conv2.weight"], values[f"{name}.conv2.weight"][:, keep])
    assert any(not np.array_equal(pruned[name], l1_pruned[name]) for name in pruned)


def test_a_pruned_resnet18_keeps_the_blocked_cpu_layers():
    """Kept counts in multiples of 16 keep every layer in oneDNN's blocked layout, no override needed."""
    net = create_model("resnet18", num_classes=10)
    prune_blocks(net, 0.5)
    assert use_onednn_layers(net) == "blocked"


@pytest.fixture(scope="module")
def pruned_ckpt(tmp_path_factory):
    """resnet10 pruned at 0.5 from fresh weights, in inference mode, and its checkpoint."""
    net = create_model(NET, num_classes=10)
    prune_blocks(net, 0.5)
    net.set_train(False)
    path = tmp_path_factory.mktemp("pruned") / "pruned.ckpt"
    ms.save_checkpoint(net, str(path))
    return net, path


def test_a_pruned_checkpoint_is_rebuilt_from_its_shapes(pruned_ckpt):
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    pruned, path = pruned_ckpt
    rebuilt = network_from_checkpoint(NET, 10, str(path), compression="prune", convolutions="onednn")
    rebuilt.set_train(False)
    assert pruned_widths(create_model(NET, num_classes=10), {p.name: p for p in rebuilt.get_parameters()}) == HALF
    assert model_summary(rebuilt, image_size=32) == model_summary(pruned, image_size=32)
    x = ms.Tensor(np.random.default_rng(2).standard_normal((2, 3, 32, 32)).astype(np.float32))
    np.testing.assert_allclose(rebuilt(x).asnumpy(), pruned(x).asnumpy(), rtol=1e-4, atol=1e-5)
    cfg = load_config(["--config_path", CONFIG, "--net_name", NET, *PRUNE])
    twin = create_ema_twin(cfg, pruned)  # the network the EMA weights are evaluated in
    assert [(p.name, p.shape) for p in twin.get_parameters()] == [(p.name, p.shape) for p in pruned.get_parameters()]


@pytest.mark.parametrize("load, kind, compression, words", [
    ("eval", "pruned", "none", "is pruned (trained with compression prune); pass --compression prune"),
    ("eval", "pruned", "qat", "is pruned (trained with compression prune); pass --compression prune"),
    ("eval", "float", "prune", "is a float checkpoint (its blocks have the network's full widths); drop --compression "
                               "prune"),
    ("pre_trained", "pruned", "prune", "is already pruned (compression prune) and --pre_trained takes float weights"),
    ("pre_trained", "pruned", "qat", "is already pruned (compression prune) and --pre_trained takes float weights"),
    ("pre_trained", "pruned", "none", "is already pruned (compression prune)"),
    ("resnet18", "pruned", "prune", "does not fit resnet18 with class_num 10: missing"),
    ("class_num 100", "pruned", "prune", "does not fit resnet10 with class_num 100: shape mismatch 2 (fc.weight"),
])
def test_a_checkpoint_of_another_kind_is_one_line(pruned_ckpt, float_ckpt, load, kind, compression, words):
    path = str(pruned_ckpt[1] if kind == "pruned" else float_ckpt)
    with pytest.raises(UserInputError, match="^checkpoint ") as refused:
        if load == "pre_trained":
            load_pretrained(create_model(NET, num_classes=10), path, head=["fc.weight", "fc.bias"],
                            filter_weight=False, what=NET, compression=compression)
        else:
            net_name, class_num = ("resnet18", 10) if load == "resnet18" else (NET, 100 if "100" in load else 10)
            network_from_checkpoint(net_name, class_num, path, compression=compression)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_the_kind_of_checkpoint_follows_its_widths():
    with pytest.raises(UserInputError, match="is pruned .*; pass --compression prune"):
        check_checkpoint_compression(["conv1.weight"], "p.ckpt", "none", pruned=True)
    check_checkpoint_compression(["conv1.weight"], "p.ckpt", "prune", pruned=True)
    # a checkpoint without the network's blocks: the name checks that follow say what it is
    check_checkpoint_compression(["conv1.weight"], "x.ckpt", "prune", pruned=None)
    quantized = ["conv1.weight", "conv1._input_quantizer._float_min"]
    with pytest.raises(UserInputError, match="is quantization-aware .*; pass --compression qat"):
        check_checkpoint_compression(quantized, "q.ckpt", "prune", pruned=False)


@pytest.mark.parametrize("extra, words", [
    (["--optimizer", "Thor"], "compression prune does not combine with optimizer Thor"),
    (["--freeze_backbone", "True"], "compression prune fine-tunes the whole pruned network; drop --freeze_backbone"),
    (["--pre_trained", ""], "compression prune fine-tunes a trained float network; pass --pre_trained CKPT"),
    (["--prune_ratio", "0"], "prune_ratio must be between 0 and 1 (exclusive), got 0.0"),
    (["--prune_ratio", "1"], "prune_ratio must be between 0 and 1 (exclusive), got 1.0"),
    (["--prune_ratio", "-0.5"], "prune_ratio must be between 0 and 1"),
    (["--prune_criterion", "taylor"], "unknown prune_criterion 'taylor'; choose one of l1, scop"),
    (["--compression", "qat", *SCOP], "prune_criterion scop chooses the channels compression prune removes; add "
                                      "--compression prune (this run has compression qat)"),
    ([*SCOP, "--knockoff_epochs", "0"], "knockoff_epochs and knockoff_lr must be positive, got 0 and 0.1"),
    ([*SCOP, "--knockoff_lr", "-1"], "knockoff_epochs and knockoff_lr must be positive, got 1 and -1"),
])
def test_prune_requests_that_cannot_work_are_refused_first(extra, words):
    """train.py's first check (check_step_keys), before any device, data or file is touched."""
    cfg = load_config(["--config_path", CONFIG, *PRUNE, "--pre_trained", "float.ckpt", *extra])
    with pytest.raises(UserInputError) as refused:
        check_step_keys(cfg)
    assert words in str(refused.value)


def test_a_prune_ratio_that_removes_nothing_is_refused():
    net = create_model(NET, num_classes=10)
    with pytest.raises(UserInputError, match="prune_ratio 0.01 removes no channel"):
        prune(net, 0.01, image_size=32)
    assert prune(net, 0.5, image_size=32) == HALF


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory, cifar_dir, float_ckpt):
    """Half an epoch of SCOP's knockoff stage, then one epoch of pruning fine-tuning (checkpoints at
    steps 6 and 12): its run folder and stdout."""
    out = tmp_path_factory.mktemp("prune")
    # Without the suite's AVX2 cap, and with oneDNN's log of every primitive it runs: what the run
    # itself caps (test_the_knockoff_stage_runs_mindspores_convolutions_capped_and_logs_its_steps).
    env = {key: value for key, value in os.environ.items() if key != "ONEDNN_MAX_CPU_ISA"}
    env["ONEDNN_VERBOSE"] = "1"
    result = run(train_args(TRAIN, cifar_dir, out, *PRUNE, *SCOP_RUN, "--pre_trained", str(float_ckpt),
                            "--save_checkpoint_steps", "6", "--log_interval", "4"), env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out / RUN, result.stdout


def inner_widths(path: Path) -> list:
    """The inner widths of a pruned resnet10 checkpoint (None for a float one)."""
    return pruned_widths(create_model(NET, num_classes=10), weights(path))


@pytest.mark.slow
def test_a_pruned_run_trains_evaluates_and_exports(pruned_run, cifar_dir, float_ckpt, tmp_path):
    folder, stdout = pruned_run
    assert stdout.count("compression prune: removed 0.5 of each residual block's inner channels") == 1
    ckpt = folder / f"{NET}-1_12.ckpt"
    assert inner_widths(ckpt) == HALF

    common = ["--config_path", CONFIG, "--net_name", NET, "--checkpoint_file_path", str(ckpt), *PRUNE]
    evaluated = run([PYTHON, "eval.py", *common, "--data_path", str(cifar_dir)])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert last_json(evaluated.stdout)["samples"] == 101

    for file_format, extra in (("MINDIR", []), ("ONNX", ["--batch_size", "4", "--verify"])):
        exported = run([PYTHON, "export.py", *common, "--eval_image_size", "32", "--file_format", file_format,
                        "--file_name", str(tmp_path / "pruned"), *extra])
        assert exported.returncode == 0, exported.stderr[-3000:]
        report = last_json(exported.stdout)
        assert report["file_format"] == file_format
        assert Path(report["path"]).stat().st_size < 0.6 * float_ckpt.stat().st_size  # about half the float weights
    assert report["verified"] and report["max_abs_diff"] <= 1e-4 and report["top1_agreement"] == 1.0


@pytest.mark.slow
def test_the_knockoff_stage_runs_mindspores_convolutions_capped_and_logs_its_steps(pruned_run):
    """SCOP's knockoff stage trains Golden Stick's cells on MindSpore's convolutions while the run's
    layers are ours: the run caps MindSpore's oneDNN itself (uncapped, an AVX-512 CPU runs them in
    oneDNN's reference kernel, 17x slower), and logs the stage's steps as training's."""
    stdout = pruned_run[1]
    theirs = conv_implementations(stdout, kernel="")
    assert theirs and not [name for name in theirs if "ref" in name or "avx512" in name], theirs
    assert our_conv_implementations(stdout)  # the fine-tune's
    steps = [line.split()[2] for line in stdout.splitlines() if line.startswith("knockoff step ")]
    assert steps == ["4/6", "6/6"]


def test_mindspores_onednn_is_capped_wherever_its_convolutions_run():
    """The decision on any host (on an AVX2-only CPU the cap changes no kernel, so the run above
    cannot tell): capped for MindSpore's convolutions or a stage on them, uncapped for ours alone."""
    stages = mindspore_convolution_stages("prune", "scop")
    assert stages and not mindspore_convolution_stages("prune", "l1") + mindspore_convolution_stages("none", "scop")
    assert caps_mindspore_isa("CPU", "mindspore") and caps_mindspore_isa("CPU", "onednn", stages)
    assert not caps_mindspore_isa("CPU", "onednn") and not caps_mindspore_isa("CPU", "onednn-bf16")
    assert not caps_mindspore_isa("Ascend", "mindspore", stages)


@pytest.mark.slow
def test_a_relaunched_pruned_run_equals_the_uninterrupted_one(pruned_run, cifar_dir, float_ckpt, tmp_path):
    """A relaunch rebuilds the pruned widths from the float checkpoint, loads the step-6 checkpoint of
    the run (so the knockoff stage does not run again) and trains on to the very weights of the
    uninterrupted run."""
    folder = pruned_run[0]
    resumed = run(train_args(TRAIN, cifar_dir, tmp_path, *PRUNE, *SCOP_RUN, "--pre_trained", str(float_ckpt),
                             "--resume_ckpt", str(folder / f"{NET}-1_6.ckpt")))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    expected, got = weights(folder / f"{NET}-1_12.ckpt"), weights(tmp_path / RUN / f"{NET}-1_12.ckpt")
    assert expected.keys() == got.keys()
    assert max(float(np.abs(expected[name] - got[name]).max()) for name in expected) < 1e-5


@pytest.mark.slow
def test_two_ranks_train_a_pruned_network_to_identical_weights(cifar_dir, float_ckpt, tmp_path):
    """Data-parallel pruning by SCOP (2 CPU ranks, the fused allreduce buckets): each rank trains the
    knockoff stage on its own batches, the scales' gradients averaged, so both keep the same channels
    and end with the same weights. (That data-parallel training computes what one process computes,
    our layers included, is test_distributed's.)"""
    train_two_ranks(cifar_dir, tmp_path, 8172, *PRUNE, *SCOP_RUN, "--pre_trained", str(float_ckpt))
    assert inner_widths(tmp_path / RUN / f"{NET}-1_12.ckpt") == HALF


@pytest.mark.slow
def test_bad_prune_inputs_are_one_line_and_write_nothing(pruned_run, cifar_dir, float_ckpt, tmp_path):
    pruned = str(pruned_run[0] / f"{NET}-1_12.ckpt")
    out = tmp_path / "out"
    cases = [
        (train_args(TRAIN, cifar_dir, out, *PRUNE, "--pre_trained", pruned), "is already pruned"),
        ([PYTHON, "eval.py", "--config_path", CONFIG, "--net_name", NET, "--data_path", str(cifar_dir),
          "--checkpoint_file_path", pruned], "pass --compression prune"),
        ([PYTHON, "export.py", "--config_path", CONFIG, "--net_name", NET, "--file_name", str(out / "x"),
          "--checkpoint_file_path", str(float_ckpt), *PRUNE], "is a float checkpoint"),
    ]
    for args, words in cases:
        line = one_line_error(run(args), alone=False)
        assert words in line, line
    assert not out.exists()
