"""export.py --quantize int8 and eval.py --model_file: a resnet10 trained on the sample data,
quantized, and its deployed files evaluated on the test split like its checkpoint."""
import json
import sys
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
from test_export import CONFIG, SIZE

from conftest import NO_CURVES, PYTHON, last_json, one_line_error, run
from src.cpu import cpu_flags, is_x86
from src.deploy.quantize import reduces_range

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier

# Four epochs reach ~0.75 top-1 on the 101 test images (one epoch stays near chance, where an
# accuracy cost would mean nothing); about 15 s of training.
TRAIN = ["--epoch_size", "4", "--batch_size", "16", "--warmup_epochs", "0", "--lr_max", "0.01",
         "--train_image_size", str(SIZE), "--eval_image_size", str(SIZE), "--run_eval", "False", *NO_CURVES]
NET = "resnet10"  # the smallest of the family
COMMON = ["--config_path", str(CONFIG), "--net_name", NET, "--eval_image_size", str(SIZE)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quantize")


@pytest.fixture(scope="module")
def checkpoint(workdir, cifar_dir) -> Path:
    result = run([PYTHON, "train.py", *COMMON, "--data_path", str(cifar_dir), "--output_dir", str(workdir)] + TRAIN)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return sorted((workdir / NET / "cifar10").glob(f"{NET}-4_*.ckpt"))[-1]


def export(checkpoint: Path, name: Path, *extra: str):
    return run([PYTHON, "export.py", *COMMON, "--checkpoint_file_path", str(checkpoint), "--file_name", str(name),
                "--batch_size", "16", *extra])


@pytest.fixture(scope="module")
def models(workdir, checkpoint, cifar_dir) -> Dict[str, dict]:
    """The checkpoint exported as float ONNX, int8 ONNX (64 calibration images, verified) and MINDIR:
    each export's JSON report."""
    reports = {}
    for kind, extra in (("float", ["--file_format", "ONNX"]),
                        ("int8", ["--file_format", "ONNX", "--quantize", "int8", "--calibration_data", str(cifar_dir),
                                  "--calibration_samples", "64", "--verify"]),
                        ("mindir", ["--file_format", "MINDIR"])):
        result = export(checkpoint, workdir / "models" / f"{NET}_{kind}", *extra)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        reports[kind] = last_json(result.stdout)
    return reports


def evaluate(cifar_dir: Path, *source: str) -> dict:
    result = run([PYTHON, "eval.py", *COMMON, "--data_path", str(cifar_dir), "--batch_size", "32", *source])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return last_json(result.stdout)


@pytest.mark.parametrize("target, x86, flags, reduced", [
    ("auto", True, {"avx2", "fma"}, True), ("auto", True, {"avx2", "avx512f", "avx512_vnni"}, False),
    ("auto", True, {"avx2", "avx_vnni"}, False), ("auto", False, set(), False),
    ("vnni", True, {"avx2"}, False), ("no_vnni", True, {"avx512_vnni"}, True), ("no_vnni", False, set(), True),
])
def test_int8_target_chooses_the_weight_bits_for_any_cpu(target, x86, flags, reduced):
    assert reduces_range(target, x86=x86, flags=flags) is reduced


def test_int8_file_holds_quantized_convolutions(models):
    import onnx
    report = models["int8"]
    path = Path(report["path"])
    assert path.name == f"{NET}_int8.onnx" and report["verified"] is True
    quantization = report["quantization"]
    assert quantization["calibration_samples"] == 64 and quantization["calibration_method"] == "minmax"
    assert quantization["int8_target"] == "auto"  # 7-bit weights where this CPU lacks VNNI
    assert quantization["weight_bits"] == (7 if reduces_range("auto", x86=is_x86(), flags=cpu_flags()) else 8)
    assert quantization["convolutions"] == quantization["quantized"] == 12  # resnet10: 9 + 3 shortcut convs
    assert quantization["top1_agreement"] >= 0.9 and 0 < quantization["max_abs_diff"] < 5
    # Read the file itself: every Conv takes its input and its weight from DequantizeLinear, the
    # weights are stored as int8 with one scale per output channel.
    graph = onnx.load(str(path)).graph
    producers = {output: node for node in graph.node for output in node.output}
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    convs = [node for node in graph.node if node.op_type == "Conv"]
    assert len(convs) == 12
    for conv in convs:
        data, weight = (producers[name] for name in conv.input[:2])
        assert data.op_type == weight.op_type == "DequantizeLinear"
        stored = initializers[weight.input[0]]
        assert stored.data_type == onnx.TensorProto.INT8
        assert len(onnx.numpy_helper.to_array(initializers[weight.input[1]])) == stored.dims[0]
    assert Path(models["float"]["path"]).stat().st_size > 3 * path.stat().st_size


def test_deployed_files_evaluate_like_the_checkpoint(models, checkpoint, cifar_dir):
    """eval.py --model_file: every test image once, the checkpoint's JSON line; float ONNX and MINDIR
    count exactly the checkpoint's hits, int8 stays within 2 points of top-1."""
    reference = evaluate(cifar_dir, "--checkpoint_file_path", str(checkpoint))
    assert reference["top_1_accuracy"] > 0.5  # a network worth quantizing
    for kind in ("float", "mindir", "int8"):
        result = evaluate(cifar_dir, "--model_file", models[kind]["path"])
        assert set(result) == set(reference) | {"model_file"}
        assert result["samples"] == reference["samples"] == 101
        assert result["model_file"] == models[kind]["path"] and result["checkpoint"] is None
        if kind == "int8":
            assert abs(result["top_1_accuracy"] - reference["top_1_accuracy"]) <= 0.02, (result, reference)
        else:
            assert result["top_1_accuracy"] == reference["top_1_accuracy"]
            assert result["loss"] == pytest.approx(reference["loss"], abs=1e-4)


def test_report_of_a_model_file_counts_like_the_checkpoint(models, checkpoint, cifar_dir, tmp_path):
    """eval.py --model_file --report_dir: the float ONNX file's report has the checkpoint report's
    confusion matrix (the same hits, counted by the same code) and its ECE to float precision."""
    reports = {}
    for name, source in (("checkpoint", ["--checkpoint_file_path", str(checkpoint)]),
                         ("onnx", ["--model_file", models["float"]["path"]])):
        folder = tmp_path / name
        result = run([PYTHON, "eval.py", *COMMON, "--data_path", str(cifar_dir), "--batch_size", "32", *source,
                      "--report_dir", str(folder)])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        line = next(json.loads(text) for text in result.stdout.splitlines() if text.startswith("{"))
        confusion = np.loadtxt(folder / "confusion.csv", delimiter=",", skiprows=1, usecols=range(1, 11))
        reports[name] = line, confusion
    (checkpoint_line, checkpoint_confusion), (onnx_line, onnx_confusion) = reports["checkpoint"], reports["onnx"]
    assert onnx_confusion.sum() == 101 and np.trace(onnx_confusion) == round(onnx_line["top_1_accuracy"] * 101)
    assert (onnx_confusion == checkpoint_confusion).all()
    assert onnx_line["ece"] == pytest.approx(checkpoint_line["ece"], abs=1e-4)


def test_predict_runs_the_int8_file(models, cifar_dir, tmp_path):
    """predict.py on the int8 file gives, image by image, the int8 model's own top-1 (101 images
    in fixed batches of 16, the last one padded)."""
    from PIL import Image

    from src.data.host_stage import host_normalize, normalization_of
    from src.data.sources import CifarBinarySource
    from src.deploy.inference import ExportedModel
    from src.deploy.quantize import compare_exports
    source = CifarBinarySource(str(cifar_dir), training=False)
    folder = tmp_path / "pngs"
    folder.mkdir()
    for index, image in enumerate(source.images):
        Image.fromarray(image).save(folder / f"{index:03d}.png")
    path = models["int8"]["path"]
    result = run([PYTHON, "predict.py", path, str(folder), "--dataset", "cifar10", "--top_k", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    predictions = last_json(result.stdout)["predictions"]
    assert len(predictions) == 101
    from src.dataset import load_pixels  # as predict.py reads them, normalized as the float file takes them
    pixels = np.stack([load_pixels(str(folder / f"{i:03d}.png"), "cifar10", SIZE) for i in range(101)])
    images = host_normalize(pixels, normalization_of("cifar10"))
    expected = ExportedModel(path).predict(images).argmax(1)
    assert [p["top_k"][0]["index"] for p in predictions] == expected.tolist()
    # The float file on the same images: int8 changes few answers.
    agreement = compare_exports(models["float"]["path"], path, [images[:96]])["top1_agreement"]
    assert agreement >= 0.9


@pytest.mark.parametrize("reduce_range, largest", [(False, 127), (True, 64)])
def test_weights_take_7_bits_for_cpus_without_vnni(models, tmp_path, reduce_range, largest):
    """onnxruntime's reduce_range: each output channel's largest weight lands on 64 instead of 127,
    which a CPU without VNNI multiplies with uint8 activations without saturating."""
    import onnx

    from src.deploy.inference import seeded_input
    from src.deploy.quantize import quantize_onnx
    target = tmp_path / "int8.onnx"
    quantize_onnx(models["float"]["path"], str(target), iter([seeded_input(16, SIZE, SIZE, seed=0)]), num_batches=1,
                  workdir=str(tmp_path), reduce_range=reduce_range)
    graph = onnx.load(str(target)).graph
    weights = [onnx.numpy_helper.to_array(tensor) for tensor in graph.initializer
               if tensor.data_type == onnx.TensorProto.INT8 and len(tensor.dims) == 4]
    assert len(weights) == 12
    assert max(int(np.abs(w.astype(np.int32)).max()) for w in weights) == largest
    # onnxruntime's symbolic shape inference is skipped: its package imports PyTorch (~2 CPU-s)
    assert "onnxruntime.tools" not in sys.modules


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_histogram_calibration_methods(models, method, tmp_path):
    """Entropy and percentile calibration (histograms, collected batch by batch) give a fully
    quantized file that still tells the float model's classes."""
    from src.deploy.inference import seeded_input
    from src.deploy.quantize import compare_exports, quantize_onnx, quantized_convolutions
    batches = [seeded_input(16, SIZE, SIZE, seed=i) for i in range(3)]
    target = str(tmp_path / f"{method}.onnx")
    quantize_onnx(models["float"]["path"], target, iter(batches), num_batches=3, method=method,
                  workdir=str(tmp_path))
    assert quantized_convolutions(target) == {"convolutions": 12, "quantized": 12}
    assert compare_exports(models["float"]["path"], target, batches)["top1_agreement"] >= 0.75


def test_quantize_errors_are_one_line_and_write_nothing(checkpoint, cifar_dir, tmp_path):
    """Through the command line: exit code 2, one line, no file."""
    result = export(checkpoint, tmp_path / "m", "--file_format", "MINDIR", "--quantize", "int8",
                    "--calibration_data", str(cifar_dir))
    assert result.returncode == 2
    assert "--file_format ONNX" in one_line_error(result)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (["--file_format", "ONNX", "--quantize", "int8"], "--calibration_data"),
    (["--file_format", "ONNX", "--quantize", "int8", "--calibration_data", "{empty}"], "no CIFAR-10 training file"),
    (["--file_format", "ONNX", "--quantize", "int8", "--calibration_data", "{missing}"], "not found"),
    (["--file_format", "ONNX", "--quantize", "int4", "--calibration_data", "{data}"], "--quantize"),
    (["--file_format", "ONNX", "--quantize", "int8", "--calibration_data", "{data}",
      "--calibration_method", "mse"], "--calibration_method"),
    (["--file_format", "ONNX", "--quantize", "int8", "--calibration_data", "{data}",
      "--calibration_samples", "0"], "--calibration_samples"),
    (["--file_format", "ONNX", "--quantize", "int8", "--calibration_data", "{data}", "--batch_size", "512"],
     "fewer than one batch"),
    (["--file_format", "ONNX", "--quantize", "int8", "--calibration_data", "{data}", "--int8_target", "avx512"],
     "unknown --int8_target 'avx512'; choose one of auto, vnni, no_vnni"),
])
def test_quantize_rejects_bad_requests_before_exporting(cifar_dir, tmp_path, args, message):
    """export.py's checks, in-process: these fail before MindSpore loads the checkpoint (which does not
    exist here)."""
    from src.config import load_config
    from src.deploy.exporting import check_export_request
    from src.errors import UserInputError
    (tmp_path / "empty").mkdir()
    values = {"empty": str(tmp_path / "empty"), "missing": str(tmp_path / "missing"), "data": str(cifar_dir)}
    argv = [*COMMON, "--checkpoint_file_path", str(tmp_path / "none.ckpt"), "--file_name", str(tmp_path / "m"),
            *[arg.format(**values) for arg in args]]
    with pytest.raises(UserInputError, match=message):
        check_export_request(load_config(argv, prog="export.py"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_quantize_without_onnx_says_how_to_install(cifar_dir, tmp_path, monkeypatch):
    from src.config import load_config
    from src.deploy.exporting import check_export_request
    from src.errors import UserInputError
    monkeypatch.setitem(sys.modules, "onnx", None)  # an import of onnx now fails as if it were not installed
    argv = [*COMMON, "--checkpoint_file_path", str(tmp_path / "none.ckpt"), "--file_format", "ONNX",
            "--quantize", "int8", "--calibration_data", str(cifar_dir)]
    with pytest.raises(UserInputError, match="pip install onnx onnxruntime"):
        check_export_request(load_config(argv, prog="export.py"))


def test_eval_takes_a_checkpoint_or_a_model_file_not_both(models, checkpoint):
    result = run([PYTHON, "eval.py", "--config_path", str(CONFIG), "--model_file", models["int8"]["path"],
                  "--checkpoint_file_path", str(checkpoint)])
    assert "not both" in one_line_error(result)


@pytest.mark.parametrize("kind, extra, message", [
    ("int8", ["--eval_image_size", "64"], "--eval_image_size 32"),
    ("float", ["--class_num", "12"], "--class_num 10"),
])
def test_eval_model_file_that_does_not_fit_is_one_line(models, cifar_dir, kind, extra, message):
    result = run([PYTHON, "eval.py", "--config_path", str(CONFIG), "--data_path", str(cifar_dir),
                  "--model_file", models[kind]["path"], *extra])
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in one_line_error(result)
