"""Data-parallel training and evaluation through real msrun ranks on CPU."""
import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import NO_CURVES, PYTHON, REPO, read_metrics, run, wait_for_step
from netns import free_port, two_nodes, unavailable
from src.errors import UserInputError
from src.resnet import create_model
from src.training.checkpoint import ema_part, network_part, read_checkpoint, training_position
from src.training.distributed import check_fusion_points, fusion_split_points
from src.training.precision import create_loss_scale_manager, resolve_amp_level

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
DIST_SH = str(REPO / "scripts" / "run_distribute_train.sh")
# Frozen BatchNorm: per-rank batch statistics legitimately differ from one batch of 2b.
# The optimization recipe is on: 2 micro-batches per step (gradients cross ranks once per step),
# clipping of the averaged gradients, and an EMA updated every step; 6 steps of 32 images.
# lr 0.002: the CPU layers (src/cpu_layers) sum a batch in blocked order, so halving it moves
# gradients by float32 rounding (~1e-6), which these 6 steps at lr 0.02 amplified to 1.7e-5 in
# the weights (MindSpore's own convolutions happen to be split-invariant bit for bit); at 0.002 the
# difference stays at 1.2e-7, and an error in the averaging still moves weights by ~1e-3.
NET = "resnet10"  # the smallest of the family: what is checked here does not depend on depth
COMMON = ["--net_name", NET, "--epoch_size", "1", "--log_interval", "1", "--run_eval", "False", "--freeze_bn", "True",
          "--lr_max", "0.002", "--warmup_epochs", "0", "--grad_accumulation_steps", "2", "--clip_grad_norm", "1.0",
          "--model_ema", "True", "--model_ema_decay", "0.99", "--model_ema_steps", "1"]
STEPS = 6
RUN = Path(NET) / "cifar10"


def trainable(path: Path, part=network_part) -> dict:
    """The trainable weights of a checkpoint, or their EMA with `part=ema_part` (no BatchNorm moving
    statistics, no optimizer state)."""
    return {name: value.asnumpy() for name, value in part(read_checkpoint(str(path))).items()
            if "moving_" not in name}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cifar_dir):
    """2 ranks at batch 8 through the launcher (sink mode on), and 1 process at batch 16."""
    out = tmp_path_factory.mktemp("dist")
    launched = run(["bash", DIST_SH, str(cifar_dir), CONFIG, "--workers", "2", "--device_target", "CPU",
                    "--master_port", "8161", "--output_dir", str(out / "dp"), "--batch_size", "8",
                    "--dataset_sink_mode", "True"] + COMMON)
    single = run([PYTHON, "train.py", "--config_path", CONFIG, "--data_path", str(cifar_dir),
                  "--output_dir", str(out / "single"), "--batch_size", "16", *NO_CURVES] + COMMON)
    return out, launched, single


@pytest.mark.slow
def test_two_ranks_finish_with_identical_weights(runs):
    out, launched, _ = runs
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    folder = out / "dp" / RUN
    states = [json.loads((folder / f"final_state_rank{r}.json").read_text()) for r in (0, 1)]
    assert states[0]["step"] == states[1]["step"] == STEPS
    assert states[0]["trainable_sha256"] == states[1]["trainable_sha256"]
    assert states[0]["ema_sha256"] == states[1]["ema_sha256"]
    launch_logs = list((folder / "logs").iterdir())
    assert len(launch_logs) == 1
    assert (launch_logs[0] / "worker_0.log").stat().st_size > 0
    assert (launch_logs[0] / "worker_1.log").stat().st_size > 0
    # Only rank 0 writes into the run folder; rank 1 writes nothing but its own final state.
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == [
        "config.yaml", "curves.png", "final_state_rank0.json", "final_state_rank1.json", "finished.json",
        "metrics.csv", f"{NET}-1_{STEPS}.ckpt"]
    steps = [row["step"] for row in read_metrics(folder)]
    assert steps == [str(s) for s in range(1, STEPS + 1)]  # sink mode on CPU still logs every step


@pytest.mark.parametrize("part", [network_part, ema_part])
@pytest.mark.slow
def test_two_ranks_at_batch_b_equal_one_process_at_batch_2b(runs, part):
    out, launched, single = runs
    assert launched.returncode == 0 and single.returncode == 0, single.stderr[-2000:]
    parallel = trainable(out / "dp" / RUN / f"{NET}-1_{STEPS}.ckpt", part)
    alone = trainable(out / "single" / RUN / f"{NET}-1_{STEPS}.ckpt", part)
    assert len(alone) == 38  # resnet10: every trainable tensor compared
    worst = max(float(np.abs(parallel[name] - alone[name]).max()) for name in alone)
    print(f"2 ranks x 8 x 2 micro-batches vs 1 process x 16 x 2, {part.__name__}: max abs difference {worst:.2e}")
    assert worst < 1e-5, worst


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_and_leaves_a_resumable_checkpoint(runs, cifar_dir, tmp_path):
    out, launched, _ = runs
    assert launched.returncode == 0
    args = ["bash", DIST_SH, str(cifar_dir), CONFIG, "--workers", "2", "--device_target", "CPU", "--master_port",
            "8163", "--output_dir", str(tmp_path), "--batch_size", "8", "--dataset_sink_mode", "True"] + COMMON
    launcher = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        wait_for_step(tmp_path / RUN, 2, launcher)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr.strip().splitlines()[-1]
    folder = tmp_path / RUN
    (saved,) = folder.glob(f"{NET}-1_*.ckpt")
    step = int(saved.stem.split("_")[1])
    assert 2 <= step < STEPS
    logs = next((folder / "logs").iterdir())
    # The stopped ranks exit 0 under msrun: a rank that exits otherwise is a failure to msrun, whose
    # scheduler then waits out its node heartbeat (~30 s) for the rank still saving.
    assert "exit with exception" not in (logs / "msrun.log").read_text()
    for rank in (0, 1):  # every rank stopped after the same step
        text = (logs / f"worker_{rank}.log").read_text()
        assert f"step {step}/{STEPS}" in text and f"step {step + 1}/{STEPS}" not in text
    # Resumable: the whole training state of a complete run's checkpoint, at a mid-epoch position
    # (test_resume.py resumes such a checkpoint and matches the uninterrupted run).
    stopped, complete = read_checkpoint(str(saved)), read_checkpoint(str(out / "dp" / RUN / f"{NET}-1_{STEPS}.ckpt"))
    assert training_position(stopped, str(saved)) == (0, step)
    assert {k: v.shape for k, v in stopped.items()} == {k: v.shape for k, v in complete.items()}


def start_node(nodes, node: int, port: int, cifar_dir, out: Path, extra=()) -> subprocess.Popen:
    """One node's launcher, inside its namespace, as a user runs it on one of two servers (one rank
    each), with a run folder on the node's own disk."""
    args = ["bash", DIST_SH, str(cifar_dir), CONFIG, "--workers", "2", "--local_workers", "1", "--node_rank", str(node),
            "--master_addr", nodes.addresses[0], "--master_port", str(port), "--device_target", "CPU",
            "--cluster_time_out", "60", "--output_dir", str(out / f"node{node}"), "--output_storage", "node_local",
            "--batch_size", "8", "--dataset_sink_mode", "True", *COMMON, *extra]
    return subprocess.Popen(nodes.command(node, args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def kill_all(launchers) -> None:
    for launcher in launchers:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)  # msrun and its ranks: two_nodes() kills what runs inside
            launcher.wait()


def finish(launchers, timeout: int = 300) -> list:
    """(exit code, stdout, stderr) of each launcher; none is left running."""
    results = []
    try:
        for launcher in launchers:
            stdout, stderr = launcher.communicate(timeout=timeout)
            results.append((launcher.returncode, stdout, stderr))
    finally:
        kill_all(launchers)
    return results


@pytest.fixture
def namespaces_allowed():
    reason = unavailable()
    if reason:
        pytest.skip(reason)


@pytest.mark.slow
@pytest.mark.usefixtures("namespaces_allowed")
def test_two_nodes_stop_together_resume_exactly_and_train_the_weights_of_one_node(runs, cifar_dir, tmp_path):
    """Two network namespaces as two servers (own address, own hostname), one rank each. A SIGTERM
    to node 1's launcher stops both nodes after the same step; resumed on both, each node's own
    checkpoint (node-local storage) holds the weights of the uninterrupted one-node two-rank run.
    Both launches are the same command, --resume True from the first (a requeued job's way: the
    first finds no checkpoint on any node and starts from the beginning). (One two-node job covers
    all of it, for the suite's time.)"""
    out, launched, _ = runs
    assert launched.returncode == 0
    with two_nodes() as nodes:
        port = free_port()
        launchers = [start_node(nodes, node, port, cifar_dir, tmp_path, ["--resume", "True"]) for node in (0, 1)]
        try:
            wait_for_step(tmp_path / "node1" / RUN, 2, launchers[1])
        except BaseException:
            kill_all(launchers)
            raise
        launchers[1].send_signal(signal.SIGTERM)  # node 1's launcher itself: `ip netns exec` and unshare exec it
        stopped = finish(launchers)
        steps = []
        for node, (code, _, stderr) in enumerate(stopped):
            assert code == 128 + signal.SIGTERM, stderr[-3000:]
            assert "stopped by SIGTERM" in stderr.strip().splitlines()[-1]
            (saved,) = (tmp_path / f"node{node}" / RUN).glob(f"{NET}-1_*.ckpt")
            steps.append(int(saved.stem.split("_")[1]))
        assert steps[0] == steps[1] and 2 <= steps[0] < STEPS  # every rank stopped after the same step
        port = free_port()
        resumed = finish([start_node(nodes, node, port, cifar_dir, tmp_path, ["--resume", "True"]) for node in (0, 1)])
    for code, _, stderr in resumed:
        assert code == 0, stderr[-3000:]
    one_node = trainable(out / "dp" / RUN / f"{NET}-1_{STEPS}.ckpt")
    for node in (0, 1):
        folder = tmp_path / f"node{node}" / RUN
        again = trainable(folder / f"{NET}-1_{STEPS}.ckpt")
        worst = max(float(np.abs(again[name] - one_node[name]).max()) for name in one_node)
        print(f"node {node}: stopped at step {steps[0]}, resumed on two nodes, vs the uninterrupted one-node "
              f"two-rank run: max abs difference {worst:.2e}")
        assert worst < 1e-5, worst
        logs = sorted((folder / "logs").glob(f"*/worker_{node}.log"))  # a folder per launch
        assert logs and f"step {STEPS}/{STEPS}" in logs[-1].read_text()
    states = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("node*/" + str(RUN) + "/final_state_rank*.json"))]
    assert [s["rank"] for s in states] == [0, 1]
    assert states[0]["trainable_sha256"] == states[1]["trainable_sha256"]


def documented_dry_runs():
    """(command, expected output lines) for each dry run shown in docs/distributed.md."""
    text = (REPO / "docs" / "distributed.md").read_text()
    blocks = re.findall(r"```text\n\$ (bash scripts/run_distribute_train\.sh [^\n]*--dry_run[^\n]*)\n(.*?)```",
                        text, re.S)
    return [(shlex.split(command), output.strip().splitlines()) for command, output in blocks]


def test_dry_runs_match_docs():
    cases = documented_dry_runs()
    assert len(cases) >= 2  # msrun and rank table
    for args, expected in cases:
        result = run(args)
        assert result.returncode == 0, result.stderr
        shown = re.sub(r"/logs/\d{8}_\d{6}", "/logs/<time>", result.stdout.replace(str(REPO), "/path/to/repo"))
        assert shown.strip().splitlines() == expected
    assert any(line.startswith("msrun --worker_num=8") for _, lines in cases for line in lines)
    assert any(line.startswith("RANK_TABLE_FILE=") for _, lines in cases for line in lines)


def test_launcher_refuses_more_devices_than_exist(tmp_path, cifar_dir):
    out = tmp_path / "out"
    for extra in (["--device_target", "Ascend"], ["--device_target", "GPU", "--workers", "2"]):
        result = run(["bash", DIST_SH, str(cifar_dir), CONFIG, "--output_dir", str(out)] + extra)
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1 and "devices" in result.stderr
    result = run(["bash", DIST_SH, str(tmp_path / "missing.json"), str(cifar_dir), CONFIG, "--device_target", "CPU"])
    assert result.returncode == 2 and "rank table not found" in result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_train_py_alone_refuses_run_distribute(cifar_dir, tmp_path):
    result = run([PYTHON, "train.py", "--config_path", CONFIG, "--data_path", str(cifar_dir),
                  "--output_dir", str(tmp_path), "--run_distribute", "True", "--device_num", "2"])
    assert result.returncode == 2 and "launcher" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("net_name", ["resnet10", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"])
def test_fusion_split_points_fit_every_depth(net_name):
    sizes = [int(np.prod(p.shape)) for p in create_model(net_name, num_classes=10, initialize=False).trainable_params()]
    points = fusion_split_points(sizes)
    assert points == sorted(set(points)) and 1 <= points[0] and points[-1] == len(sizes) - 1
    assert check_fusion_points(points, len(sizes)) == points
    if net_name == "resnet50":
        assert len(sizes) == 161 and points[-1] == 160


@pytest.mark.parametrize("points", [[160, 85], [85, 161], [0, 85], [85, 85], [1.5]])
def test_bad_fusion_config_is_rejected(points):
    with pytest.raises(UserInputError):
        check_fusion_points(points, 161)


def test_precision_defaults_and_cpu_limits():
    assert resolve_amp_level("auto", "CPU") == "O0"
    assert resolve_amp_level("auto", "Ascend") == "O2"
    assert create_loss_scale_manager("none", 1024.0) is None
    assert create_loss_scale_manager("fixed", 1024.0).get_loss_scale() == 1024.0
    # the train step detects overflow itself, so a dynamic scale works on CPU too
    assert create_loss_scale_manager("dynamic", 1024.0).get_update_cell() is not None
    with pytest.raises(UserInputError, match="loss_scale_type"):
        create_loss_scale_manager("adaptive", 1024.0)
    with pytest.raises(UserInputError):
        resolve_amp_level("O4", "CPU")
