"""benchmark.py in a tiny configuration writes a complete JSON report (no timing assertions)."""
import json
import shutil

import pytest

from conftest import PYTHON, needs_torch, run
from cpu_layers_marks import needs_library
from src.cpu_layers import library
from tools.benchmarking.cpu_paths import compute_paths

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier


@needs_torch
def test_benchmark_writes_every_field(tmp_path):
    report_path = tmp_path / "bench.json"
    result = run([PYTHON, "benchmark.py", "--net", "resnet10", "--batch_size", "2", "--image_size", "32",
                  "--steps", "1", "--repeats", "1", "--calls", "2", "--vs-torch", "--photos", "6",
                  "--ceiling_images", "12", "--photo_batch", "3", "--json", str(report_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads(report_path.read_text())
    (report,) = written["reports"]
    assert {report["net"], report["batch_size"], report["image_size"]} == {"resnet10", 2, 32}
    for framework in ("mindspore", "torch", "onnxruntime", "onnxruntime_hostnorm", "onnxruntime_pixels",
                      "onnxruntime_int8"):
        measured = report[framework]
        assert measured["compile_s"] >= 0
        assert framework.startswith("onnxruntime") == ("train_compute_img_per_s" not in measured)
        for label in ("eval_batch_1", "eval_batch_2"):
            assert measured[label]["img_per_s"] > 0
            latency = measured[label]["latency_ms"]
            assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"]
    assert report["mindspore"]["train_compute_img_per_s"] > 0 and report["torch"]["train_compute_img_per_s"] > 0
    assert set(report["mindspore"]["train_end_to_end_img_per_s"]) == {"cifar10", "imagenet2012"}
    assert all(v > 0 for v in report["mindspore"]["train_end_to_end_img_per_s"].values())
    assert set(report["pipeline_img_per_s"]) == {"cifar10", "imagenet2012"}
    # The CPU paths: MindSpore's convolutions, ours (bf16 too on AMX), PyTorch NCHW, channels_last
    # and bf16 autocast (where the CPU has bf16), each training step's breakdown, the CPU model.
    paths = compute_paths(vs_torch=True)
    assert paths[:2] == ["mindspore", "ours"]
    assert all(report[path]["train_compute_img_per_s"] > 0 for path in paths)
    cpu_ratios = {f"{measure}_{path}_over_{base}" for measure in ("train", "eval_batch_1", "eval_batch_2")
                  for base in ("torch", "torch_cl") for path in paths if path != base}
    if "ours_bf16" in paths and "torch_bf16" in paths:  # bfloat16 beside bfloat16
        cpu_ratios |= {f"{measure}_ours_bf16_over_torch_bf16" for measure in ("train", "eval_batch_1", "eval_batch_2")}
        assert report["ratios"]["eval_batch_2_ours_bf16_over_torch_bf16"] == round(
            report["ours_bf16"]["eval_batch_2"]["img_per_s"] / report["torch_bf16"]["eval_batch_2"]["img_per_s"], 3)
    assert report["ratios"]["train_ours_over_torch"] == round(
        report["ours"]["train_compute_img_per_s"] / report["torch"]["train_compute_img_per_s"], 3)
    assert set(report["breakdown_ms"]) == {path for path in paths if not path.startswith("torch")}
    for parts in report["breakdown_ms"].values():
        assert parts["step_ms"] > 0 and parts["convolutions"] > 0
        assert abs(sum(v for k, v in parts.items() if not k.endswith("step_ms")) - parts["step_ms"]) < 0.5
        assert parts["unprofiled_step_ms"] > 0  # a step without oneDNN's profile, outside the sum
    assert report["breakdown_ms"]["ours"]["normalization"] > 0  # BatchNorm runs in our oneDNN, blocked
    # The convolutions by pass, parsed from oneDNN's problem lines: MindSpore's forward convolves the
    # model's multiply-accumulates (all but the head's), and the passes add up to the convolutions' time
    assert set(report["convolution_passes"]) == set(report["breakdown_ms"])
    for path, passes in report["convolution_passes"].items():
        assert {"forward", "backward weights"} <= set(passes) <= {"forward", "backward data", "backward weights"}
        assert abs(sum(p["ms"] for p in passes.values()) - report["breakdown_ms"][path]["convolutions"]) < 0.5
        assert all(p["gmacs_per_s"] > 0 for p in passes.values())
    forward = report["convolution_passes"]["mindspore"]["forward"]["gmac"]
    assert abs(forward - report["batch_size"] * report["model"]["gflops"]) < 1e-3
    # Our layers' own loops, outside oneDNN's primitives (their timers): part of that path's rest
    assert set(report["own_loops_ms"]) == set(report["breakdown_ms"]) and report["own_loops_ms"]["mindspore"] == {}
    for path, own in report["own_loops_ms"].items():
        assert all(ms >= 0 for ms in own.values()) and sum(own.values()) <= report["breakdown_ms"][path]["the rest"]
    # oneDNN's blocked weight gradients leave through our copy: every 16x16 one (AVX-512); of the 8x8 ones
    # (AVX2), those of the last stage's 1x1 maps at 32 px, with the zeros of their other taps
    copied = library.channels_per_block("float32") in (8, 16)
    assert (report["own_loops_ms"]["ours"]["weight gradient copies"] > 0) == copied
    # The rest op by op: MindSpore's optimizer kernels on its path; with ours, one op of the step's own cell
    assert set(report["rest_of_step_ms"]) == set(report["breakdown_ms"])
    for rest in report["rest_of_step_ms"].values():
        assert "other operators" in rest and all(ms >= 0 for ms in rest.values())
    assert report["rest_of_step_ms"]["mindspore"]["ApplyMomentum"] > 0
    assert "ApplyMomentum" not in report["rest_of_step_ms"]["ours"]
    assert report["rest_of_step_ms"]["ours"]["Custom:top cell"] > 0
    assert report["cpu"] and report["cpu"] != "unknown"
    # progress while it runs: a line on stderr as each path's process starts and is measured
    started = [line for line in result.stderr.splitlines() if line.startswith("benchmark [") and "starting" in line]
    assert len(started) == len(paths)
    # The headline: what train.py runs here, the precision amp would choose, GMAC/s against this CPU's peak.
    assert report["default_path"] == "ours" and report["amp_choice"]["path"] in ("ours", "ours_bf16")
    assert report["peak_gmacs"]["float32"] > 0
    assert set(report["gmacs_per_s"]) == set(paths)
    assert report["gmacs_per_s"]["ours"]["train"] == round(
        report["model"]["gflops"] * 3 * report["ours"]["train_compute_img_per_s"], 1)
    assert set(report["ratios"]) == cpu_ratios | {"pipeline_cifar10_over_training",
                                                  "pipeline_imagenet2012_over_training",
                                     "eval_batch_1_onnxruntime_over_mindspore",
                                     "eval_batch_1_onnxruntime_over_torch", "eval_batch_2_onnxruntime_over_mindspore",
                                     "eval_batch_2_onnxruntime_over_torch"} | {
        f"eval_batch_{n}_onnxruntime_int8_over_{other}"
        for n in (1, 2) for other in ("mindspore", "torch", "onnxruntime")
    } | {f"eval_batch_{n}_onnxruntime_pixels_over_{other}" for n in (1, 2)
         for other in ("onnxruntime", "onnxruntime_hostnorm")}
    assert report["ratios"]["eval_batch_2_onnxruntime_int8_over_onnxruntime"] == round(
        report["onnxruntime_int8"]["eval_batch_2"]["img_per_s"] / report["onnxruntime"]["eval_batch_2"]["img_per_s"], 3)
    model, measured = report["model"], report["mindspore"]  # the model summary beside the speeds
    assert model["trainable_parameters"] == 4_910_922 and model["image_size"] == 32 and model["gflops"] > 0
    evals = {label: round(model["gflops"] * measured[label]["img_per_s"], 2)
             for label in ("eval_batch_1", "eval_batch_2")}
    assert model["achieved_gflop_per_s"] == {
        "train": round(model["gflops"] * 3 * measured["train_compute_img_per_s"], 2), **evals}
    pipelines = written["input_pipelines"]
    assert pipelines["batch_size"] == 3 and pipelines["image_size"] == 224
    assert {name: pipelines["files"][name]["files"] for name in ("tiny", "photos", "real")} == {
        "tiny": 12, "photos": 6, "real": 6}
    assert pipelines["files"]["photos"]["mean_file_kb"] > 20 and pipelines["files"]["real"]["pil_decode_ms"] > 0
    assert pipelines["decoder"] == "libjpeg-turbo partial"  # scripts/setup_env.sh built it
    rows = pipelines["rows"]
    assert [(row["cores"], row["workers"]) for row in rows][0] == (1, 1)  # the per-core row first
    expected = {"ceiling": {"ours", "v2", "native"}, "photos": {"ours_train", "no_aa_train", "v2_train", "native_train",
                                                                 "ours_eval", "native_eval"},
                "real": {"ours_train", "native_train", "ours_eval", "native_eval"}, "cifar": {"ours", "v2", "native"},
                "photos_shards": {"ours_train", "ours_eval"}, "real_shards": {"ours_train", "ours_eval"}}
    for row, ratios in zip(rows, pipelines["ratios"]):
        threads = {"ours_threads"} if row["workers"] > 1 else set()
        assert {case: set(row[case]) for case in expected} == {**expected, "ceiling": expected["ceiling"] | threads}
        assert all(m["img_per_s"] > 0 and m["main_cpu_us"] > 0 for case in expected for m in row[case].values())
        assert ratios["real_train"] == round(row["real"]["ours_train"]["img_per_s"] /
                                             row["real"]["native_train"]["img_per_s"], 3)
        ceiling = row["ceiling"]
        assert ratios["ceiling_v2"] == round(ceiling["v2"]["img_per_s"] / ceiling["native"]["img_per_s"], 3)
        assert ratios["real_shards_train"] == round(row["real_shards"]["ours_train"]["img_per_s"] /
                                                    row["real"]["ours_train"]["img_per_s"], 3)
    calls = pipelines["storage_calls"]
    assert set(calls) == {"photos", "photos_shards"}
    if shutil.which("strace"):  # Debian's strace: on this machine's image
        assert all(calls[name][kind] > 0 for name in calls for kind in ("files_opened", "read_calls"))
    else:
        assert calls == {"photos": None, "photos_shards": None}
    card = pipelines["cores_per_card"]
    assert card["card_img_per_s"] == 2170
    assert card["real_photos"] == round(2170 / rows[0]["real"]["ours_train"]["img_per_s"], 1)


@needs_library
@pytest.mark.parametrize("features, bf16_paths", [
    ({"avx512f", "avx512_bf16", "amx_bf16"}, ["ours_bf16", "torch_bf16"]),
    ({"avx512f", "avx512_bf16"}, ["ours_bf16", "torch_bf16"]),
    ({"avx2"}, []),
])
def test_the_measured_paths_follow_the_cpu(features, bf16_paths):
    paths = compute_paths(vs_torch=True, cpu_features=features)
    assert [path for path in paths if "bf16" in path] == bf16_paths
    assert {"mindspore", "ours", "torch", "torch_cl"} <= set(paths)
    assert "torch" not in compute_paths(vs_torch=False, cpu_features=features)
    capped = compute_paths(vs_torch=True, cpu_features=features, cpu_isa="avx2")
    assert not [path for path in capped if "bf16" in path]   # as on a CPU with AVX2 alone


def test_a_bad_argument_is_one_line_and_exit_2(tmp_path):
    report_path = tmp_path / "bench.json"
    result = run([PYTHON, "benchmark.py", "--net", "resnet99", "--json", str(report_path)])
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--net" in result.stderr
    assert not report_path.exists()


@pytest.mark.parametrize("args", [["--batch_size", "0"], ["--photo_batch", "64", "--photos", "8"],
                                  ["--compute_only", "--pipelines_only"]])
def test_bad_arguments_stop_before_measuring(tmp_path, args):
    report_path = tmp_path / "bench.json"
    result = run([PYTHON, "benchmark.py", *args, "--json", str(report_path)])
    assert result.returncode == 2  # a user error (run_cli), one line naming the argument
    assert len(result.stderr.strip().splitlines()) == 1 and args[0] in result.stderr
    assert not report_path.exists()


def test_enable_profiling_writes_a_trace_into_the_run_folder(sample_run):
    folder, _ = sample_run  # trained with --enable_profiling True --profile_steps 3
    traces = list((folder / "profiler" / "rank0").rglob("trace_view.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())
    assert isinstance(events, list) and events
