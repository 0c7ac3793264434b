"""tests/work_table.py: the suite's work summed per module and its costliest tests, from the
records tests/conftest.py writes (one per test; older files hold one per module and worker)."""
import json

from work_table import costliest, read, runs_per_entry


def write_records(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return str(path)


def test_per_test_records_sum_per_module_and_name_the_costliest(tmp_path):
    def record(test, cpu, runs=0, trainings=0):
        return {"module": test.split("::")[0].split("/")[-1][:-3], "test": test, "tests": 1, "cpu_s": cpu,
                "wall_s": cpu + 1, "start": 0.0, "worker": "gw0", "runs": runs, "trainings": trainings}

    path = write_records(tmp_path / "work.jsonl", [
        record("tests/test_a.py::test_one", 2.0, runs=1), record("tests/test_a.py::test_two", 7.5, runs=2, trainings=1),
        record("tests/test_b.py::test_three", 4.0)])
    totals = read(path)
    assert totals["test_a"] == {"tests": 2, "cpu_s": 9.5, "wall_s": 11.5, "runs": 3, "trainings": 1}
    assert totals["all"]["tests"] == 3 and totals["all"]["cpu_s"] == 13.5
    rows = costliest(path, 2).splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == ["| tests/test_a.py::test_two", "| tests/test_b.py::test_three"]


def test_per_module_records_of_older_runs_still_sum(tmp_path):
    path = write_records(tmp_path / "old.jsonl", [
        {"module": "test_a", "tests": 3, "cpu_s": 5.0, "wall_s": 6.0, "runs": 1, "trainings": 0},
        {"module": "test_a", "tests": 1, "cpu_s": 1.0, "wall_s": 1.0, "runs": 0, "trainings": 0}])
    assert read(path)["test_a"]["tests"] == 4 and read(path)["all"]["cpu_s"] == 6.0
    assert costliest(path, 5).splitlines()[2:] == []  # no per-test records to rank


def test_runs_sum_per_entry_point_finished_and_refused_apart(tmp_path):
    runs = [{"entry": "train.py", "cpu_s": 4.0, "returncode": 0}, {"entry": "train.py", "cpu_s": 1.5, "returncode": 2},
            {"entry": "eval.py", "cpu_s": 2.0, "returncode": 0}, {"entry": "train.py", "cpu_s": 5.0, "returncode": 0}]
    path = write_records(tmp_path / "work.jsonl", [
        {"module": "test_a", "test": "tests/test_a.py::test_one", "run_list": runs[:2]},
        {"module": "test_b", "test": "tests/test_b.py::test_two", "run_list": runs[2:]},
        {"module": "test_b", "test": "tests/test_b.py::test_three"}])
    rows = [row.strip("| ").split(" | ") for row in runs_per_entry(path).splitlines()[2:]]
    assert rows == [["train.py", "2", "9", "1", "2"], ["eval.py", "1", "2", "0", "0"]]
