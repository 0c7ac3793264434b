"""What an entry point does before MindSpore loads: OpenMP's settings (the kernel threads follow
OMP_NUM_THREADS, GOMP_SPINCOUNT is set, a user's own value kept: src/openmp.py, src/device.py), and the
collector kept off until run_cli (src/errors.py)."""
import ast
import os
import subprocess

import pytest

from conftest import PYTHON, REPO
from src.openmp import SPIN_COUNT, set_openmp_environment


@pytest.mark.parametrize("value, threads", [("3", 3), ("1", 1), ("", 0), ("0", 0), ("-2", 0), ("many", 0)])
def test_omp_num_threads_sets_the_cpu_kernel_threads(monkeypatch, value, threads):
    from src.device import threads_from_environment
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert threads_from_environment() == threads


LAUNCHED = ("train.py", "eval.py", "benchmark.py")  # what the launchers and benchmark.py start as fresh processes


def first_statements(entry_point: str) -> list:
    tree = ast.parse((REPO / entry_point).read_text())
    return tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body  # after the docstring


@pytest.mark.parametrize("entry_point", ["train.py", "eval.py", "train_parity.py"])
def test_entry_points_set_openmp_before_anything_imports_mindspore(entry_point):
    """GNU OpenMP reads GOMP_SPINCOUNT once, when `import mindspore` loads it: the call must come
    before every other import of the entry point (src/openmp.py), but the collector's switch."""
    body = first_statements(entry_point)
    if entry_point in LAUNCHED:
        body = body[2:]
    first_import, first_call = body[0], body[1]
    assert isinstance(first_import, ast.ImportFrom) and first_import.module == "src.openmp"
    assert ast.unparse(first_call) == "set_openmp_environment()"


@pytest.mark.parametrize("entry_point", LAUNCHED)
def test_launched_entry_points_import_with_the_collector_off(entry_point):
    """Their imports allocate what lives as long as the process: no collection before run_cli."""
    assert [ast.unparse(statement) for statement in first_statements(entry_point)[:2]] == ["import gc", "gc.disable()"]


def test_run_cli_freezes_the_loaded_heap_and_collects_again():
    probe = ("import gc, sys\ngc.disable()\nfrom src.errors import run_cli\n"
             "run_cli(lambda argv: print(gc.isenabled(), gc.get_freeze_count() > 0) or 3)")
    result = subprocess.run([PYTHON, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert (result.returncode, result.stdout.split()) == (3, ["True", "True"]), result.stderr


def test_openmp_spin_count_is_set_when_mindspore_loads_and_a_users_value_stays(tmp_path):
    # A sitecustomize.py on PYTHONPATH sees the environment when train.py, run as users run it, first
    # imports MindSpore (train.py --help stops right after).
    (tmp_path / "sitecustomize.py").write_text(
        "import builtins, os\n"
        "real_import = builtins.__import__\n"
        "def spy(name, *args, **kwargs):\n"
        "    if name.startswith('mindspore') and not os.environ.get('SEEN_SPIN_COUNT'):\n"
        "        os.environ['SEEN_SPIN_COUNT'] = os.environ.get('GOMP_SPINCOUNT', 'unset')\n"
        "        with open(os.environ['SPY_FILE'], 'w') as handle:\n"
        "            handle.write(os.environ['SEEN_SPIN_COUNT'])\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = spy\n")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env.update(PYTHONPATH=str(tmp_path), SPY_FILE=str(tmp_path / "seen.txt"))
    subprocess.run([PYTHON, "train.py", "--help"], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert (tmp_path / "seen.txt").read_text() == SPIN_COUNT
    mine = {"GOMP_SPINCOUNT": "5"}
    set_openmp_environment(mine)
    assert mine == {"GOMP_SPINCOUNT": "5"}
