"""export.py (MINDIR/ONNX, --verify, AIR refusal, --export_input_stage) and predict.py on exports of networks trained on
the sample data, checked image by image against the checkpoint network and eval.py."""
import os
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
from PIL import Image

from conftest import NO_CURVES, PYTHON, REPO, last_json, one_line_error, run

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier

CONFIG = REPO / "config" / "sample_resnet18.yaml"
SIZE = 32
# A low learning rate keeps one epoch's logits in a sane range (and its predictions varied).
TRAIN = ["--epoch_size", "1", "--batch_size", "16", "--warmup_epochs", "0", "--lr_max", "0.002",
         "--train_image_size", str(SIZE), "--eval_image_size", str(SIZE), "--run_eval", "False", *NO_CURVES]
TOLERANCE = 1e-4


def train(out: Path, net_name: str, dataset: str, data: Path) -> Path:
    result = run([PYTHON, "train.py", "--config_path", str(CONFIG), "--net_name", net_name,
                  "--dataset", dataset, "--data_path", str(data), "--output_dir", str(out)] + TRAIN)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return sorted((out / net_name / dataset).glob(f"{net_name}-1_*.ckpt"))[-1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def checkpoints(workdir, cifar_dir, folder_dir) -> Dict[str, Tuple[Path, List[str]]]:
    """One epoch of training each: resnet10 (the smallest basic-block network) on the JPEG class folders,
    resnet14 (the smallest bottleneck network) on CIFAR-10 files.
    Maps net name to (checkpoint, the config overrides that describe it)."""
    return {
        "resnet10": (train(workdir / "train", "resnet10", "imagenet2012", folder_dir),
                     ["--net_name", "resnet10", "--dataset", "imagenet2012", "--eval_image_size", str(SIZE)]),
        "resnet14": (train(workdir / "train", "resnet14", "cifar10", cifar_dir),
                     ["--net_name", "resnet14", "--dataset", "cifar10", "--eval_image_size", str(SIZE)]),
    }


def export_args(checkpoints, net_name: str, file_format: str, file_name: Path, *extra: str) -> List[str]:
    ckpt, overrides = checkpoints[net_name]
    return [PYTHON, "export.py", "--config_path", str(CONFIG), "--checkpoint_file_path", str(ckpt),
            "--file_format", file_format, "--file_name", str(file_name), "--batch_size", "16"] \
        + overrides + list(extra)


@pytest.fixture(scope="module")
def exported(workdir, checkpoints):
    """export(net, format, pixels=False) -> the verified export's JSON report (each exported once
    per module); pixels: with the input stage (--export_input_stage True)."""
    done = {}

    def export(net_name: str, file_format: str, pixels: bool = False) -> dict:
        key = (net_name, file_format, pixels)
        if key not in done:
            name = workdir / "models" / f"{net_name}-{file_format.lower()}{'-pixels' if pixels else ''}"
            result = run(export_args(checkpoints, net_name, file_format, name, "--verify",
                                     "--export_input_stage", str(pixels)))
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            report = last_json(result.stdout)
            assert "max abs difference" in result.stdout and "top-1 agreement" in result.stdout
            done[key] = report
        return done[key]
    return export


def reference_logits(net_name: str, ckpt: Path, dataset: str, data: Path) -> Tuple[np.ndarray, np.ndarray]:
    """The checkpoint network on the evaluation pipeline of src/dataset.py: (logits, labels)."""
    import mindspore as ms

    from src.dataset import create_dataset, host_normalize
    from src.resnet import create_model
    from src.training.checkpoint import load_into_network
    net = create_model(net_name, num_classes=10)
    load_into_network(net, str(ckpt))
    net.set_train(False)
    logits, labels = [], []
    data = create_dataset(dataset, str(data), training=False, batch_size=32, image_size=SIZE)
    for images, batch_labels in data.create_tuple_iterator(output_numpy=True):  # uint8 NHWC batches
        logits.append(net(ms.Tensor(host_normalize(images, data.normalization))).asnumpy())
        labels.append(batch_labels)
    return np.concatenate(logits), np.concatenate(labels)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("file_format", ["MINDIR", "ONNX"])
@pytest.mark.parametrize("net_name", ["resnet10", "resnet14"])
def test_export_verifies_against_checkpoint(exported, net_name, file_format):
    report = exported(net_name, file_format)
    path = Path(report["path"])
    assert path.is_file() and path.suffix == f".{file_format.lower()}"
    assert report["file_format"] == file_format and report["verified"] is True
    assert report["max_abs_diff"] <= TOLERANCE and report["top1_agreement"] == 1.0
    # MINDIR keeps the batch dynamic; MindSpore's ONNX export fixes it to --batch_size.
    batch = None if file_format == "MINDIR" else 16
    assert report["input_shape"] == [batch, 3, SIZE, SIZE] and report["input"] == "float32 NCHW"
    assert not list(path.parent.glob(".export-*"))  # the staging folder is gone


@pytest.mark.parametrize("file_format", ["MINDIR", "ONNX"])
def test_export_with_input_stage_takes_pixels_like_the_float_file(exported, file_format):
    """--export_input_stage True: verified, uint8 NHWC input, and on the same pixels its logits are
    the float file's on the host-normalized pixels."""
    from src.data.host_stage import host_normalize, normalization_of
    from src.deploy.inference import ExportedModel, seeded_pixels
    report = exported("resnet10", file_format, pixels=True)
    batch = None if file_format == "MINDIR" else 16
    assert report["verified"] is True and report["max_abs_diff"] <= TOLERANCE
    assert report["input"] == "uint8 NHWC" and report["input_shape"] == [batch, SIZE, SIZE, 3]
    assert exported("resnet10", file_format)["input"] == "float32 NCHW"
    pixels_file, float_file = ExportedModel(report["path"]), ExportedModel(exported("resnet10", file_format)["path"])
    assert pixels_file.takes_pixels and not float_file.takes_pixels
    assert pixels_file.image_size == float_file.image_size == (SIZE, SIZE)
    pixels = seeded_pixels(16, SIZE, SIZE, seed=1)
    normalized = host_normalize(pixels, normalization_of("imagenet2012"))
    assert np.abs(pixels_file.run(pixels) - float_file.run(normalized)).max() <= TOLERANCE


def test_pixels_file_predicts_and_evaluates_like_the_float_file(exported, checkpoints, folder_dir):
    """predict.py and eval.py --model_file on the ONNX file with the input stage: the float ONNX
    file's top classes per JPEG and its top-1 accuracy."""
    val = folder_dir / "val"
    _, overrides = checkpoints["resnet10"]
    top, accuracy = {}, {}
    for kind, pixels in (("float", False), ("pixels", True)):
        model = exported("resnet10", "ONNX", pixels=pixels)["path"]
        result = run([PYTHON, "predict.py", model, str(val), "--dataset", "imagenet2012", "--top_k", "3"])
        assert result.returncode == 0, result.stderr[-3000:]
        top[kind] = [[t["index"] for t in p["top_k"]] for p in last_json(result.stdout)["predictions"]]
        evaluated = run([PYTHON, "eval.py", "--config_path", str(CONFIG), "--data_path", str(folder_dir),
                         "--model_file", model, "--batch_size", "32"] + overrides)
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        accuracy[kind] = last_json(evaluated.stdout)
    assert len(top["pixels"]) == 101 and top["pixels"] == top["float"]
    assert accuracy["pixels"]["samples"] == accuracy["float"]["samples"] == 101
    assert accuracy["pixels"]["top_1_accuracy"] == accuracy["float"]["top_1_accuracy"]


def test_input_stage_with_int8_is_one_line_error(workdir, checkpoints):
    name = workdir / "int8-pixels" / "resnet10"
    result = run(export_args(checkpoints, "resnet10", "ONNX", name, "--export_input_stage", "True",
                             "--quantize", "int8", "--calibration_data", str(workdir)))
    assert result.returncode == 2
    assert "--export_input_stage" in one_line_error(result) and "--quantize" in one_line_error(result)
    assert not (workdir / "int8-pixels").exists()


def test_failed_verification_exits_1_and_writes_nothing(workdir, checkpoints):
    name = workdir / "strict" / "resnet10"
    result = run(export_args(checkpoints, "resnet10", "ONNX", name, "--verify", "--verify_tolerance", "0"))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tolerance" in one_line_error(result, returncode=1)
    report = last_json(result.stdout)
    assert report["verified"] is False and report["max_abs_diff"] > 0 and report["path"] is None
    assert not (workdir / "strict" / "resnet10.onnx").exists()


def test_air_on_cpu_is_one_line_error_before_any_work(workdir, checkpoints):
    name = workdir / "air" / "resnet10"
    result = run(export_args(checkpoints, "resnet10", "AIR", name))
    assert result.returncode == 2
    assert "Ascend" in one_line_error(result)
    assert not (workdir / "air").exists()


def test_onnx_verify_without_onnxruntime_says_how_to_install(workdir, checkpoints, tmp_path):
    blocker = tmp_path / "onnxruntime"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('onnxruntime is hidden for this test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    name = workdir / "no-ort" / "resnet10"
    result = run(export_args(checkpoints, "resnet10", "ONNX", name, "--verify"), env=env)
    assert result.returncode == 2
    assert "pip install onnxruntime" in one_line_error(result)
    assert not (workdir / "no-ort").exists()


def test_checkpoint_of_another_network_is_one_line_error(workdir, checkpoints):
    name = workdir / "mismatch" / "resnet10"
    result = run(export_args(checkpoints, "resnet10", "MINDIR", name, "--class_num", "12"))
    assert result.returncode == 2
    assert "fc.weight" in one_line_error(result)
    assert not (workdir / "mismatch" / "resnet10.mindir").exists()


def test_export_help_lists_the_batch_and_verify_flags():
    result = run([PYTHON, "export.py", "--config_path", str(CONFIG), "--help"])
    assert result.returncode == 0
    assert "--verify " in result.stdout and "--dynamic_batch " in result.stdout


@pytest.mark.parametrize("file_format", ["ONNX", "MINDIR"])
def test_predict_on_jpegs_matches_checkpoint_and_eval(exported, checkpoints, folder_dir, file_format):
    """Top-1 per JPEG of the val split equals the checkpoint network's on the eval pipeline; the
    number of correct top-1 equals eval.py's accuracy. ONNX has a fixed batch of 16 for 101 images
    (the last batch padded); the MINDIR's dynamic batch runs batches of 32 then 5."""
    model = exported("resnet10", file_format)["path"]
    val = folder_dir / "val"
    result = run([PYTHON, "predict.py", model, str(val), "--dataset", "imagenet2012", "--labels", str(val)])
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result.stdout)
    predictions = report["predictions"]
    assert report["image_size"] == SIZE and len(predictions) == 101
    assert all(len(p["top_k"]) == 5 for p in predictions)
    assert sum(".jpg: " in line for line in result.stdout.splitlines()) == 101  # one readable line each

    ckpt, overrides = checkpoints["resnet10"]
    logits, labels = reference_logits("resnet10", ckpt, "imagenet2012", folder_dir)
    probabilities = softmax(logits.astype(np.float64))
    class_names = sorted(p.name for p in val.iterdir() if p.is_dir())
    # The pipeline reads sorted class folders, sorted files: the order predict.py lists a folder in.
    assert [Path(p["path"]).parent.name for p in predictions] == [class_names[i] for i in labels]
    top1 = [p["top_k"][0] for p in predictions]
    assert [t["index"] for t in top1] == logits.argmax(1).tolist()
    assert [t["label"] for t in top1] == [class_names[i] for i in logits.argmax(1)]
    assert np.allclose([t["probability"] for t in top1], probabilities.max(1), atol=1e-4)
    assert len(set(t["index"] for t in top1)) > 1  # a network that tells images apart

    if file_format == "ONNX":  # once is enough: eval.py on the same images counts the same hits
        evaluated = run([PYTHON, "eval.py", "--config_path", str(CONFIG), "--data_path", str(folder_dir),
                         "--checkpoint_file_path", str(ckpt), "--batch_size", "32"] + overrides)
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        accuracy = last_json(evaluated.stdout)
        correct = sum(t["label"] == Path(p["path"]).parent.name for t, p in zip(top1, predictions))
        assert accuracy["samples"] == 101
        assert correct == round(accuracy["top_1_accuracy"] * 101)


def test_predict_cifar_model_on_png_files(exported, checkpoints, cifar_dir, tmp_path):
    """A CIFAR-10 network's ONNX export on the test split written as lossless PNG files gives the
    checkpoint network's top-1 on the CIFAR binary pipeline, named by batches.meta.txt."""
    from src.data.sources import CifarBinarySource
    source = CifarBinarySource(str(cifar_dir), training=False)
    folder = tmp_path / "pngs"
    folder.mkdir()
    for index, image in enumerate(source.images):
        Image.fromarray(image).save(folder / f"{index:03d}.png")
    model = exported("resnet14", "ONNX")["path"]
    result = run([PYTHON, "predict.py", model, str(folder), "--dataset", "cifar10",
                  "--labels", str(cifar_dir), "--top_k", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    predictions = last_json(result.stdout)["predictions"]
    logits, _ = reference_logits("resnet14", checkpoints["resnet14"][0], "cifar10", cifar_dir)
    names = (cifar_dir / "batches.meta.txt").read_text().split()
    assert [p["top_k"][0]["index"] for p in predictions] == logits.argmax(1).tolist()
    assert [p["top_k"][0]["label"] for p in predictions] == [names[i] for i in logits.argmax(1)]
    assert all(len(p["top_k"]) == 3 for p in predictions)


def test_predict_user_errors_are_one_line(exported, tmp_path):
    model = exported("resnet10", "MINDIR")["path"]
    labels = tmp_path / "labels.txt"
    labels.write_text("a\nb\nc\n")
    image = tmp_path / "x.jpg"
    Image.new("RGB", (40, 30), (200, 10, 10)).save(image)
    # As a user meets them: exit code 2 and one line, after the model is loaded.
    # 3 class names for 10 outputs; an image size the model (32 px) does not take.
    for args in ([model, str(image), "--dataset", "imagenet2012", "--labels", str(labels)],
                 [model, str(image), "--dataset", "imagenet2012", "--image_size", "48"]):
        result = run([PYTHON, "predict.py"] + args)
        assert result.returncode == 2, (args, result.stderr[-2000:])
        one_line_error(result)


@pytest.mark.parametrize("args, message", [
    (["{model}", "{image}"], "--dataset"),
    (["{model}", "{missing}", "--dataset", "cifar10"], "image not found"),
    (["{model}", "{image}", "--dataset", "cifar10", "--top_k", "0"], "--top_k"),
    (["{model}", "{image}", "--dataset", "imagenet2012", "--resize_size", "-1"], "--resize_size"),
    (["{model}", "{image}", "--dataset", "cifar10", "--threads", "-1"], "--threads"),
    (["{model}", "{image}", "--dataset", "cifar10", "--labels", "{missing}"], "labels not found"),
    (["{air}", "{image}", "--dataset", "cifar10"], "Ascend"),
])
def test_predict_rejects_bad_arguments_before_loading(tmp_path, args, message):
    """These fail before MindSpore or onnxruntime is touched."""
    values = {"model": str(tmp_path / "m.mindir"), "air": str(tmp_path / "m.air"),
              "image": str(tmp_path / "x.jpg"), "missing": str(tmp_path / "missing.jpg")}
    Image.new("RGB", (8, 8)).save(values["image"])
    result = run([PYTHON, "predict.py", *[arg.format(**values) for arg in args]])
    assert message in one_line_error(result)
