"""Quantization-aware training with Golden Stick (compression: qat): a float checkpoint fine-tuned
quantization-aware, stopped and resumed to the same weights, evaluated and exported; every bad input
one line with nothing written; and commands that do not compress never import Golden Stick."""
import json
import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import NO_CURVES, PYTHON, REPO, last_json, one_line_error, run, train_args, wait_for_step
from src.compression import (
    check_checkpoint_compression,
    check_compression,
    compression_convolutions,
    quantizer_names,
)
from src.deploy.export import check_export_compression
from src.errors import UserInputError
from src.training.checkpoint import read_checkpoint

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
NET = "resnet10"  # the smallest of the family: what is checked here does not depend on depth
RUN = Path(NET) / "cifar10"
# 12 steps of 16 (the sample's 200 training images), every step logged, a constant lr (resume-exact).
TRAIN = ["--config_path", CONFIG, "--net_name", NET, "--batch_size", "16", "--log_interval", "1", "--run_eval", "False",
         "--lr_max", "0.01", "--lr_decay_mode", "constant", "--warmup_epochs", "0", "--epoch_size", "1", *NO_CURVES]
QAT = ["--compression", "qat"]
ONE_LINE = "error: "


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory, cifar_dir, float_ckpt):
    """One epoch of QAT fine-tuning: its run folder and stdout."""
    out = tmp_path_factory.mktemp("qat")
    result = run(train_args(TRAIN, cifar_dir, out, *QAT, "--pre_trained", str(float_ckpt)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out / RUN, result.stdout


def weights(path: Path) -> dict:
    return {name: value.asnumpy() for name, value in read_checkpoint(str(path)).items() if name != "learning_rate"}


@pytest.mark.slow
def test_qat_trains_evaluates_and_exports(qat_run, cifar_dir, tmp_path):
    folder, stdout = qat_run
    assert stdout.count("compression qat: MindSpore's CPU convolutions") == 1  # cpu_convolution auto, overridden
    assert stdout.count("compression qat: Golden Stick's SimQAT cells") == 1
    ckpt = folder / f"{NET}-1_12.ckpt"
    names = weights(ckpt)
    # 12 convolutions + fc, each with input, output and weight ranges (min and max)
    assert len(quantizer_names(names)) == 13 * 3 * 2
    assert not (REPO / "rewritten_network").exists()

    evaluated = run([PYTHON, "eval.py", "--config_path", CONFIG, "--net_name", NET, "--data_path", str(cifar_dir),
                     "--checkpoint_file_path", str(ckpt), *QAT])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert last_json(evaluated.stdout)["samples"] == 101

    exported = run([PYTHON, "export.py", "--config_path", CONFIG, "--net_name", NET, "--checkpoint_file_path",
                    str(ckpt), "--eval_image_size", "32", "--file_name", str(tmp_path / "qat"), *QAT])
    assert exported.returncode == 0, exported.stderr[-3000:]
    report = last_json(exported.stdout)
    assert report["file_format"] == "MINDIR" and Path(report["path"]).stat().st_size > 1e6


@pytest.mark.slow
def test_stopped_and_resumed_qat_run_equals_the_uninterrupted_one(qat_run, cifar_dir, float_ckpt, tmp_path):
    args = train_args(TRAIN, cifar_dir, tmp_path, *QAT, "--pre_trained", str(float_ckpt))
    process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path / RUN, 4, process)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    resumed = run(args + ["--resume", "True"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    expected, got = weights(qat_run[0] / f"{NET}-1_12.ckpt"), weights(tmp_path / RUN / f"{NET}-1_12.ckpt")
    assert expected.keys() == got.keys() and quantizer_names(got)
    assert max(float(np.abs(expected[name] - got[name]).max()) for name in expected) < 1e-5


def fake_quant_reference(x: np.ndarray, low: float, high: float, levels: int = 255) -> np.ndarray:
    """TensorFlow's FakeQuantWithMinMaxVars (the model of MindSpore's FakeQuantPerLayer): the range
    nudged so that 0 is a level, x clipped to it and rounded onto its levels."""
    scale = (high - low) / levels
    zero_point = np.clip(np.round(-low / scale), 0, levels)
    nudged_min, nudged_max = -zero_point * scale, (levels - zero_point) * scale
    return np.round((np.clip(x, nudged_min, nudged_max) - nudged_min) / scale) * scale + nudged_min


def test_the_cpu_fake_quantizer_rounds_as_the_kernels_and_passes_gradients_inside_the_range():
    import mindspore as ms

    from src.compression.qat import CpuFakeQuant, CpuMinMaxUpdate
    x = np.random.default_rng(0).uniform(-1.5, 2.5, (4, 3, 5, 5)).astype(np.float32)
    low, high = np.array([-1.0], np.float32), np.array([2.0], np.float32)
    quant = CpuFakeQuant()
    got = quant(ms.Tensor(x), ms.Tensor(low), ms.Tensor(high)).asnumpy()
    np.testing.assert_allclose(got, fake_quant_reference(x, -1.0, 2.0), atol=1e-6)
    assert len(np.unique(got)) <= 256
    gradient = ms.grad(lambda t: quant(t, ms.Tensor(low), ms.Tensor(high)).sum())(ms.Tensor(x)).asnumpy()
    inside = (x >= got.min()) & (x <= got.max())
    assert set(np.unique(gradient[inside])) == {1.0} and set(np.unique(gradient[~inside])) == {0.0}
    per_channel = CpuMinMaxUpdate(channel_axis=1)(ms.Tensor(x), ms.Tensor(np.zeros(3, np.float32)),
                                                  ms.Tensor(np.zeros(3, np.float32)))
    np.testing.assert_allclose(per_channel[0].asnumpy(), np.minimum(x.min(axis=(0, 2, 3)), 0))
    np.testing.assert_allclose(per_channel[1].asnumpy(), np.maximum(x.max(axis=(0, 2, 3)), 0))


def train_two_ranks(cifar_dir: Path, out: Path, port: int, *extra: str) -> str:
    """TRAIN through msrun on 2 CPU ranks of batch 8 (the same 12 steps), with `extra` options: both
    ranks end at step 12 with the same trainable weights, BatchNorm statistics and quantization
    ranges (src/training/rank_statistics.py). Returns the launcher's stdout."""
    launched = run(["bash", str(REPO / "scripts" / "run_distribute_train.sh"), str(cifar_dir), CONFIG, "--workers", "2",
                    "--device_target", "CPU", "--master_port", str(port), "--output_dir", str(out),
                    *TRAIN[2:4], "--batch_size", "8", *TRAIN[6:], *extra])
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    states = [json.loads((out / RUN / f"final_state_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert states[0]["step"] == states[1]["step"] == 12
    assert states[0]["trainable_sha256"] == states[1]["trainable_sha256"]
    assert states[0]["statistics_sha256"] == states[1]["statistics_sha256"]
    return launched.stdout


@pytest.mark.slow
def test_two_ranks_train_qat_to_identical_weights(cifar_dir, float_ckpt, tmp_path):
    """Data-parallel QAT through msrun (2 CPU ranks): the ranks end with the same network, weights,
    statistics and ranges (each range the widest the ranks saw, at every checkpoint)."""
    train_two_ranks(cifar_dir, tmp_path, 8171, *QAT, "--pre_trained", str(float_ckpt))
    assert quantizer_names(weights(tmp_path / RUN / f"{NET}-1_12.ckpt"))


@pytest.mark.parametrize("kwargs, words", [
    ({"compression": "int4"}, "unknown compression 'int4'; choose one of none, qat, prune"),
    ({"compression": "qat", "optimizer": "Thor", "pre_trained": "a.ckpt"}, "optimizer Thor"),
    ({"compression": "qat", "freeze_backbone": True, "pre_trained": "a.ckpt"}, "drop --freeze_backbone True"),
    ({"compression": "qat", "pre_trained": ""}, "pass --pre_trained CKPT"),
])
def test_compression_requests_that_cannot_work_are_refused(kwargs, words):
    with pytest.raises(UserInputError, match=words):
        check_compression(**kwargs)


def test_the_kind_of_checkpoint_must_fit_the_run():
    quantized = ["conv1.weight", "conv1._input_quantizer._float_min"]
    with pytest.raises(UserInputError, match="is quantization-aware .*; pass --compression qat"):
        check_checkpoint_compression(quantized, "q.ckpt", "none")
    with pytest.raises(UserInputError, match="is a float checkpoint .*drop --compression qat"):
        check_checkpoint_compression(["conv1.weight"], "f.ckpt", "qat")
    for compression in ("none", "qat"):
        with pytest.raises(UserInputError, match="already quantization-aware .*--pre_trained takes float weights"):
            check_checkpoint_compression(quantized, "q.ckpt", compression, pre_trained=True)
    check_checkpoint_compression(["conv1.weight"], "f.ckpt", "qat", pre_trained=True)
    check_checkpoint_compression(quantized, "q.ckpt", "qat")


def test_qat_runs_mindspores_convolutions_and_exports_mindir_only():
    assert compression_convolutions("none", "auto", "CPU") == ("auto", None)
    assert compression_convolutions("qat", "auto", "GPU") == ("auto", None)
    assert compression_convolutions("qat", "auto", "CPU")[0] == "mindspore"
    cfg = SimpleNamespace(compression="qat", verify=False)
    with pytest.raises(UserInputError, match="exports MINDIR only"):
        check_export_compression(cfg, "ONNX")
    with pytest.raises(UserInputError, match="drop --verify"):
        check_export_compression(SimpleNamespace(compression="qat", verify=True), "MINDIR")
    check_export_compression(cfg, "MINDIR")


@pytest.mark.slow
def test_bad_qat_inputs_are_one_line_and_write_nothing(qat_run, cifar_dir, float_ckpt, tmp_path):
    qat_ckpt = qat_run[0] / f"{NET}-1_12.ckpt"
    out = tmp_path / "out"
    evaluate = [PYTHON, "eval.py", "--config_path", CONFIG, "--net_name", NET, "--data_path", str(cifar_dir)]
    export = [PYTHON, "export.py", "--config_path", CONFIG, "--net_name", NET, "--file_name", str(out / "x")]
    cases = [
        (train_args(TRAIN, cifar_dir, out, *QAT), "pass --pre_trained CKPT"),
        (train_args(TRAIN, cifar_dir, out, *QAT, "--pre_trained", str(qat_ckpt)), "already quantization-aware"),
        (train_args(TRAIN, cifar_dir, out, "--pre_trained", str(qat_ckpt)), "already quantization-aware"),
        (evaluate + ["--checkpoint_file_path", str(qat_ckpt)], "pass --compression qat"),
        (export + ["--checkpoint_file_path", str(float_ckpt), *QAT], "is a float checkpoint"),
        (export + ["--checkpoint_file_path", str(qat_ckpt), *QAT, "--file_format", "ONNX"], "MINDIR only"),
        (evaluate + ["--model_file", str(out / "x.onnx"), *QAT], "drop --compression"),
    ]
    for args, words in cases:
        line = one_line_error(run(args), alone=False)
        assert words in line, line
    assert not out.exists()


@pytest.mark.slow
def test_a_missing_golden_stick_is_one_line_naming_the_install(cifar_dir, float_ckpt, tmp_path):
    shadow = tmp_path / "shadow" / "mindspore_gs"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named tqdm')\n")
    env = dict(os.environ, PYTHONPATH=str(shadow.parent))
    result = run(train_args(TRAIN, cifar_dir, tmp_path / "out", *QAT, "--pre_trained", str(float_ckpt)), env=env)
    line = one_line_error(result, alone=False)
    assert "needs mindspore_gs" in line and "pip install mindspore-gs==1.3.0 tqdm" in line, line
    assert not (tmp_path / "out").exists()


def test_commands_that_do_not_compress_never_import_golden_stick():
    helped = run([PYTHON, "-X", "importtime", "train.py", "--help"])
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "mindspore_gs" not in helped.stderr and "src.compression" in helped.stderr
    imported = run([PYTHON, "-c", "import importlib, sys\n"
                    "for name in ('train', 'eval', 'export'): importlib.import_module(name)\n"
                    "assert 'mindspore_gs' not in sys.modules, 'mindspore_gs imported'"])
    assert imported.returncode == 0, imported.stderr[-2000:]
