"""Multi-node launches without training: the launcher's checks before launch, --check, rank tables
of several servers, a node that never joins, node-local run folders and the resume agreement.
(Training on two nodes: tests/test_distributed.py.)"""
import json
import os
import re
import signal
import socket
import subprocess
from importlib import metadata

import pytest

from conftest import PYTHON, REPO, one_line_error, run, wait_for_step
from netns import free_port, two_nodes, unavailable
from src.errors import UserInputError
from src.training.distributed import check_output_storage, check_resume_agreement, writes_run_folder

CONFIG = str(REPO / "config" / "sample_resnet18.yaml")
DIST_SH = str(REPO / "scripts" / "run_distribute_train.sh")


def launch(cifar_dir, out, *options, cwd=None):
    return run(["bash", DIST_SH, str(cifar_dir), CONFIG, "--device_target", "CPU", "--output_dir", str(out),
                *options], cwd=cwd)


@pytest.mark.parametrize("options, names", [
    (["--workers", "3", "--local_workers", "2"], "not a multiple of --local_workers 2"),
    (["--workers", "4", "--local_workers", "2", "--node_rank", "2"], "--node_rank 2 is outside the job"),
    (["--workers", str(len(os.sched_getaffinity(0)) + 1)], "CPU cores"),
    (["--workers", "2", "--local_workers", "1", "--master_addr", "192.0.2.1"], "not an address of this machine"),
    (["--workers", "2", "--local_workers", "1", "--node_rank", "1", "--master_addr", "no-such-host.invalid"],
     "not an address or a known host name"),
    (["--workers", "2", "--cluster_time_out", "soon"], "--cluster_time_out"),
])
def test_bad_multi_node_options_give_one_line_before_anything_is_written(cifar_dir, tmp_path, options, names):
    result = launch(cifar_dir, tmp_path / "out", *options)
    assert result.returncode == 2
    assert names in one_line_error(result)
    assert not (tmp_path / "out").exists()


def test_unreachable_master_addr_on_another_node(cifar_dir, tmp_path):
    """Node 1 inside a namespace that has no route to the address given as node 0's."""
    if unavailable():
        pytest.skip(unavailable())
    with two_nodes() as nodes:
        result = run(nodes.command(1, ["bash", DIST_SH, str(cifar_dir), CONFIG, "--device_target", "CPU",
                                       "--output_dir", str(tmp_path / "out"), "--workers", "2", "--local_workers",
                                       "1", "--node_rank", "1", "--master_addr", "10.213.99.1"]))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --master_addr 10.213.99.1 is unreachable from this node (no route); give node 0's address as this "
        "node sees it"]
    assert not (tmp_path / "out").exists()


def check_lines(result) -> dict:
    assert result.returncode == 0, result.stderr
    return dict(line.split(": ", 1) for line in result.stdout.strip().splitlines())


def test_check_prints_what_this_node_has_and_would_start(cifar_dir, tmp_path):
    port = free_port()
    shown = check_lines(launch(cifar_dir, tmp_path / "out", "--workers", "4", "--local_workers", "2",
                               "--node_rank", "1", "--master_port", str(port), "--check"))
    assert set(shown) == {"node", "python", "mindspore", "devices", "cores", "free memory", "free disk", "node 0",
                          "ranks"}
    assert shown["node"].endswith("node_rank 1 of 2")
    assert shown["mindspore"] == metadata.version("mindspore")
    assert int(shown["cores"]) == len(os.sched_getaffinity(0))
    assert shown["ranks"] == "2 (device 0), 3 (device 1) of 4"
    assert shown["node 0"].startswith(f"127.0.0.1:{port} does not answer")
    with socket.socket() as listening:  # now something answers at node 0's address
        listening.bind(("127.0.0.1", port))
        listening.listen()
        shown = check_lines(launch(cifar_dir, tmp_path / "out", "--workers", "2", "--local_workers", "1",
                                   "--node_rank", "1", "--master_port", str(port), "--check"))
    assert shown["node 0"] == f"127.0.0.1:{port} answers"
    assert not (tmp_path / "out").exists()  # it trains nothing and writes nothing


def rank_table(path, servers) -> str:
    """A version 1.0 rank table of `servers` lists of (rank, device)."""
    table = {"version": "1.0", "server_count": str(len(servers)), "status": "completed",
             "server_list": [{"server_id": f"10.0.0.{i + 1}", "host_nic_ip": "reserve",
                              "device": [{"device_id": str(d), "device_ip": f"192.168.{i}.{d}", "rank_id": str(r)}
                                         for r, d in devices]} for i, devices in enumerate(servers)]}
    path.write_text(json.dumps(table))
    return str(path)


def test_a_rank_table_of_two_servers_gives_each_server_its_ranks(tmp_path):
    table = rank_table(tmp_path / "rank_table_16p.json", [[(r, r) for r in range(8)],
                                                         [(8 + r, 7 - r) for r in range(8)]])
    views = []
    for node in (0, 1):
        result = run(["bash", DIST_SH, table, "/data/imagenet", "config/resnet50_imagenet2012.yaml",
                      "--node_rank", str(node), "--dry_run"])
        assert result.returncode == 0, result.stderr
        lines = result.stdout.strip().splitlines()
        assert all("RANK_SIZE=16 " in line and line.endswith("--device_num 16") for line in lines)
        views.append([tuple(int(v) for v in re.search(r"RANK_ID=(\d+) DEVICE_ID=(\d+)", line).groups())
                      for line in lines])
    assert views[0] == [(r, r) for r in range(8)]
    assert views[1] == [(8 + r, 7 - r) for r in range(8)]
    interleaved = rank_table(tmp_path / "rank_table_interleaved.json", [[(2 * r, r) for r in range(8)],
                                                                       [(2 * r + 1, r) for r in range(8)]])
    for path, options, names in ((table, ["--node_rank", "2"], "outside rank table"),
                                 (table, ["--workers", "8"], "differs from the 16"),
                                 (table, ["--local_workers", "4"], "differs from the 8 ranks of server 0"),
                                 (interleaved, [], "number each server's ranks consecutively")):
        result = run(["bash", DIST_SH, path, "/data/imagenet", "config/resnet50_imagenet2012.yaml", *options,
                      "--dry_run"])
        assert result.returncode == 2 and names in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_node_that_never_joins_is_named_within_the_cluster_timeout(cifar_dir, tmp_path):
    """Node 0 of two started alone, with a short cluster timeout: it fails, naming node 1, rather
    than wait (the subprocess timeout would catch a hang)."""
    result = subprocess.run(["bash", DIST_SH, str(cifar_dir), CONFIG, "--device_target", "CPU", "--output_dir",
                             str(tmp_path), "--workers", "2", "--local_workers", "1", "--master_port",
                             str(free_port()), "--cluster_time_out", "5"],
                            cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the cluster did not form within --cluster_time_out 5 s: node 1 never joined"), last


def test_a_failure_that_a_thread_would_outlive_ends_the_process_at_once():
    """What a rank does when its cluster does not form (src/training/distributed.py): a thread the
    interpreter's exit would wait for (as it waits for MindSpore's heartbeat) does not hold it; the
    traceback is written as an uncaught exception's would be."""
    code = ("import threading, time\n"
            "from src.errors import end_process_now\n"
            "threading.Thread(target=time.sleep, args=(600,)).start()\n"
            "try:\n"
            "    raise RuntimeError('the cluster did not form')\n"
            "except RuntimeError:\n"
            "    end_process_now(3)\n")
    result = run([PYTHON, "-c", code], timeout=60)  # a lingering process is a timeout here
    assert result.returncode == 3
    assert result.stderr.strip().splitlines()[-1] == "RuntimeError: the cluster did not form"


def test_node_local_storage_makes_each_nodes_first_rank_a_writer():
    assert [writes_run_folder(rank, 8, "shared") for rank in (0, 1, 8, 9)] == [True, False, False, False]
    assert [writes_run_folder(rank, 8, "node_local") for rank in (0, 1, 8, 9)] == [True, False, True, False]
    with pytest.raises(UserInputError, match="output_storage"):
        check_output_storage("nfs")


def test_a_resume_that_finds_no_checkpoint_on_one_node_says_so():
    check_resume_agreement([4, 4, 4, 4], 2, "out/run")  # all agree
    check_resume_agreement([-1, -1], 1, "out/run")      # a fresh run everywhere
    with pytest.raises(UserInputError) as missing:
        check_resume_agreement([4, 4, -1, -1], 2, "out/run")
    assert str(missing.value).startswith("resume: rank(s) 2, 3 on node(s) 1 found no checkpoint in out/run while "
                                         "rank 0 resumes from global step 4")
    with pytest.raises(UserInputError, match="different checkpoints"):
        check_resume_agreement([4, 2], 1, "out/run")


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_named_by_the_launcher(cifar_dir, tmp_path):
    """msrun reports a dead worker by process id only; the launcher names its rank."""
    launcher = subprocess.Popen(["bash", DIST_SH, str(cifar_dir), CONFIG, "--device_target", "CPU", "--output_dir",
                                 str(tmp_path), "--workers", "2", "--master_port", str(free_port()),
                                 "--net_name", "resnet10", "--epoch_size", "1", "--log_interval", "1",
                                 "--run_eval", "False"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                # MindSpore's heartbeat timeout (30 s by default): how long msrun's
                                # scheduler waits for the dead rank before everything exits
                                env=dict(os.environ, MS_NODE_TIMEOUT="8"))
    try:
        wait_for_step(tmp_path / "resnet10" / "cifar10", 1, launcher)
        (pids,) = (tmp_path / "resnet10" / "cifar10" / "logs").glob("*/rank_pids.txt")
        victim = next(pid for pid, rank in (line.split() for line in pids.read_text().splitlines()) if rank == "1")
        os.kill(int(victim), signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode != 0
    assert stderr.strip().splitlines()[-1].startswith(
        "error: rank 1 on this node (node 0) was killed by signal 9; msrun stopped this node's other ranks")
