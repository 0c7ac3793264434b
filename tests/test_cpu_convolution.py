"""CPU training must not fall into oneDNN's reference convolution (see src/device.py)."""
import os

import pytest

from conftest import PYTHON, run
from src.data.sample_data import write_sample_data

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier


def conv_implementations(verbose_output: str, kernel: str = "kh3"):
    """oneDNN implementation names of the executed convolutions with the given kernel height."""
    names = set()
    for line in verbose_output.splitlines():
        fields = line.split(",")
        if len(fields) > 6 and fields[:3] == ["onednn_verbose", "v1", "primitive"] \
                and fields[3] == "exec" and fields[5] == "convolution" and kernel in line:
            names.add(fields[6])
    return names


def test_training_run_uses_fast_3x3_convolutions(tmp_path):
    write_sample_data(str(tmp_path / "data"), train_per_class=2, test_per_class=1, formats=("cifar10",))
    env = {key: value for key, value in os.environ.items() if key != "ONEDNN_MAX_CPU_ISA"}
    env["ONEDNN_VERBOSE"] = "1"
    result = run([PYTHON, "train.py", "--config_path", "config/sample_resnet18.yaml",
                  "--data_path", str(tmp_path / "data" / "cifar10"), "--output_dir", str(tmp_path / "out"),
                  "--epoch_size", "1", "--batch_size", "8", "--save_checkpoint", "False"], env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    implementations = conv_implementations(result.stdout)
    assert implementations, "no 3x3 convolution was reported by oneDNN"
    assert not [name for name in implementations if "ref" in name], implementations


@pytest.mark.parametrize("value, threads", [("3", 3), ("1", 1), ("", 0), ("0", 0), ("-2", 0), ("many", 0)])
def test_omp_num_threads_sets_the_cpu_kernel_threads(monkeypatch, value, threads):
    from src.device import threads_from_environment
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert threads_from_environment() == threads
