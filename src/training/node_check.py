"""What a multi-node launch needs from each node, checked before anything starts (used by
scripts/run_distribute_train.sh): node 0's address, the rank-table view of this server, and the
facts `--check` prints.

    python -m src.training.node_check address --master_addr A --node_rank R
    python -m src.training.node_check rank_table --file F --node_rank R
    python -m src.training.node_check report --master_addr A --master_port P --node_rank R ...
    python -m src.training.node_check explain --log_dir D --node_rank R ...   (after msrun failed)
"""
import glob
import json
import os
import platform
import re
import shutil
import socket
import sys
from importlib import metadata
from typing import List, Optional, Sequence, Tuple

from src.errors import OneLineParser, UserInputError, run_cli

CANN_VERSION_FILES = ("/usr/local/Ascend/ascend-toolkit/latest/version.cfg",
                      "/usr/local/Ascend/ascend-toolkit/latest/*/ascend_toolkit_install.info")


def resolve(address: str) -> str:
    """An IPv4 address for `address` (a host name or an address)."""
    try:
        return socket.gethostbyname(address)
    except OSError:
        raise UserInputError(f"--master_addr '{address}' is not an address or a known host name; give node 0's "
                             f"IP address") from None


def _udp_socket_can(address: str, connect: bool) -> bool:
    """Whether a UDP socket can connect to `address` (a route exists; nothing is sent) or bind to it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            if connect:
                sock.connect((address, 9))
            else:
                sock.bind((address, 0))
        except OSError:
            return False
    return True


def is_local_address(address: str) -> bool:
    """True when this machine owns `address`."""
    return _udp_socket_can(address, connect=False)


def has_route(address: str) -> bool:
    """True when this machine has a route to `address`."""
    return _udp_socket_can(address, connect=True)


def check_master_address(master_addr: str, node_rank: int) -> str:
    """Node 0 runs msrun's scheduler, so node 0 must own `master_addr`; every other node must have
    a route to it. Returns the resolved address; raises a one-line error otherwise."""
    address = resolve(master_addr)
    if node_rank == 0 and not is_local_address(address):
        raise UserInputError(f"--master_addr {master_addr} is not an address of this machine, but --node_rank 0 "
                             f"must run on node 0 at that address; give node 0's own address, or the right "
                             f"--node_rank")
    if node_rank > 0 and not has_route(address):
        raise UserInputError(f"--master_addr {master_addr} is unreachable from this node (no route); give node 0's "
                             f"address as this node sees it")
    return address


def port_answers(address: str, port: int, timeout: float = 2.0) -> bool:
    """True when something accepts TCP connections at address:port."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def read_rank_table(path: str) -> List[List[Tuple[int, int]]]:
    """The (rank id, device id) pairs of every server in a rank table (version 1.0: server_list,
    each server with its device list), servers in the table's order."""
    try:
        with open(path, encoding="utf-8") as handle:
            table = json.load(handle)
        servers = [[(int(device["rank_id"]), int(device["device_id"])) for device in server["device"]]
                   for server in table["server_list"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserInputError(f"rank table {path} is unreadable ({type(err).__name__}: {err}); expected a version 1.0 "
                             f"table with server_list[].device[].rank_id/device_id") from None
    ranks = sorted(rank for server in servers for rank, _ in server)
    if not servers or ranks != list(range(len(ranks))):
        raise UserInputError(f"rank table {path} must number its ranks 0..N-1 once each, found {ranks}")
    return servers


def server_ranks(path: str, node_rank: int) -> Tuple[int, List[Tuple[int, int]]]:
    """(ranks in the job, this server's (rank id, device id) pairs in rank order): the server at
    position `node_rank` in the table's server_list."""
    servers = read_rank_table(path)
    if not 0 <= node_rank < len(servers):
        raise UserInputError(f"--node_rank {node_rank} is outside rank table {path}, which lists {len(servers)} "
                             f"server(s): use 0..{len(servers) - 1}")
    return sum(len(server) for server in servers), sorted(servers[node_rank])


def cann_version() -> str:
    """The CANN toolkit's version line, or why there is none."""
    for pattern in CANN_VERSION_FILES:
        for path in glob.glob(pattern):
            try:
                with open(path, encoding="utf-8", errors="replace") as handle:
                    for line in handle:
                        if "version" in line.lower():
                            return line.strip()
            except OSError:
                continue  # an unreadable file: try the next one
    return "not found (needed on Ascend only)"


def visible_devices(device_target: str) -> str:
    """The devices this node shows the ranks, as the launcher counts them."""
    if device_target == "Ascend":
        found = sorted(glob.glob("/dev/davinci[0-9]*"))
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        return f"{len(found)} ({', '.join(os.path.basename(p) for p in found) or 'none'})" + (
            f"; ASCEND_RT_VISIBLE_DEVICES={visible}" if visible else "")
    if device_target == "GPU":
        found = shutil.which("nvidia-smi")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return ("nvidia-smi present" if found else "no nvidia-smi") + (
            f"; CUDA_VISIBLE_DEVICES={visible}" if visible else "")
    return "one process per rank on the cores"


def free_memory_gib() -> Optional[float]:
    """MemAvailable from /proc/meminfo, in GiB (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def free_disk_gib(folder: str) -> Tuple[str, float]:
    """Free space where `folder` will be (its nearest existing parent), in GiB."""
    existing = os.path.abspath(folder)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    return existing, shutil.disk_usage(existing).free / 2**30


def report(*, device_target: str, master_addr: str, master_port: int, node_rank: int, workers: int,
           local_workers: int, output_folder: str, ranks: Sequence[Tuple[int, int]]) -> List[str]:
    """The lines --check prints: what this node has and would start."""
    try:
        ms_version = metadata.version("mindspore")
    except metadata.PackageNotFoundError:
        ms_version = "not installed"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = free_memory_gib()
    where, disk = free_disk_gib(output_folder)
    answers = port_answers(master_addr, master_port)
    if node_rank == 0:
        master = (f"{master_addr}:{master_port} is this node's; the port is "
                  + ("in use (another job?)" if answers else "free for msrun's scheduler"))
    else:
        master = (f"{master_addr}:{master_port} " +
                  ("answers" if answers else "does not answer (node 0 not started yet, or a firewall)"))
    lines = [f"node: {platform.node()}, node_rank {node_rank} of {workers // local_workers}",
             f"python: {sys.version.split()[0]} ({sys.executable})",
             f"mindspore: {ms_version}"]
    if device_target == "Ascend":
        lines.append(f"cann: {cann_version()}")
    lines += [f"devices: {device_target}, {visible_devices(device_target)}",
              f"cores: {cores}",
              "free memory: " + (f"{memory:.1f} GiB" if memory is not None else "unknown"),
              f"free disk: {disk:.1f} GiB in {where} (run folder {output_folder})",
              f"node 0: {master}",
              f"ranks: {', '.join(f'{rank} (device {device})' for rank, device in ranks)} of {workers}"]
    return lines


# What msrun and MindSpore write when a job fails (their wording, 2.10).
NOT_FORMED = "Failed to initialize distributed job cluster"
TIMED_OUT_RANK = re.compile(r"worker (\d+) is the first one timed out")
WORKER_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
LOST_CONTACT = re.compile(r"AllReduce|ReduceScatter|AllGather|Broadcast|heartbeat|timed out", re.I)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def _last_error(text: str) -> str:
    """The last 'error: ...' or exception line a rank wrote."""
    lines = [line.strip() for line in text.splitlines()
             if line.startswith("error: ") or re.match(r"^[A-Za-z]*(Error|Exception): ", line)]
    return lines[-1][:300] if lines else ""


def explain_failure(log_dir: str, *, node_rank: int, nodes: int, master: str, cluster_time_out: int) -> str:
    """One line saying why a failed msrun job failed, from this node's logs: a node that never
    joined, a rank of this node that failed (and how), or a rank another node lost."""
    logs = {int(m.group(1)): _read(path) for path in glob.glob(os.path.join(log_dir, "worker_*.log"))
            if (m := re.search(r"worker_(\d+)\.log$", path))}
    others = [str(n) for n in range(nodes) if n != node_rank]
    if any(NOT_FORMED in text for text in logs.values()):
        who = (f"node {', '.join(others)} never joined" if node_rank == 0
               else f"node 0 at {master} or another node never joined")
        return (f"the cluster did not form within --cluster_time_out {cluster_time_out} s: {who}; start the same "
                f"command on every node (--node_rank 0..{nodes - 1}) and check --master_addr/--master_port")
    lost = TIMED_OUT_RANK.search(_read(os.path.join(log_dir, "scheduler.log")))
    if lost and int(lost.group(1)) not in logs:
        return (f"rank {lost.group(1)} on another node stopped answering (it failed or its node was lost), so this "
                f"node's ranks stopped; see that node's logs")
    pids = {pid: int(rank) for pid, rank in (line.split() for line in
                                               _read(os.path.join(log_dir, "rank_pids.txt")).splitlines()
                                               if len(line.split()) == 2 and line.split()[1].isdigit())}
    exited = WORKER_EXIT.search(_read(os.path.join(log_dir, "msrun.log")))
    rank = pids.get(exited.group(1)) if exited else None
    if rank is None and nodes <= 1:
        return f"msrun failed without naming a rank that exited; see {log_dir}/msrun.log"
    if rank is None:
        return (f"this node's ranks (node {node_rank}) stopped without one of them failing: a rank on another node "
                f"failed or its node was lost; see the other nodes' logs (this node's: {log_dir})")
    tail = "\n".join(logs.get(rank, "").splitlines()[-50:])  # the end of the log, not every INFO line
    reason = _last_error(tail)
    if nodes <= 1 or not LOST_CONTACT.search(tail):
        code = int(exited.group(2))
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return (f"rank {rank} on this node (node {node_rank}) {how}" + (f": {reason}" if reason else "")
                + f"; msrun stopped this node's other ranks; see {log_dir}")
    return (f"rank {rank} on this node (node {node_rank}) lost contact with the others: a rank on another node "
            f"failed or its node was lost; see the other nodes' logs (this node's: {log_dir})")


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m src.training.node_check")
    parser.add_argument("what", choices=("address", "rank_table", "report", "explain"))
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, default=8118)
    parser.add_argument("--node_rank", type=int, default=0)
    parser.add_argument("--file", default="")
    parser.add_argument("--device_target", default="CPU")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--local_workers", type=int, default=1)
    parser.add_argument("--output_folder", default=".")
    parser.add_argument("--log_dir", default=".")
    parser.add_argument("--cluster_time_out", type=int, default=600)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """address: exit 0 or one error line; rank_table: 'RANK_SIZE n' then 'RANK_ID DEVICE_ID' per local
    rank; report: the --check lines; explain: why a failed job failed."""
    args = _parser().parse_args(argv)
    if args.what == "address":
        check_master_address(args.master_addr, args.node_rank)
    elif args.what == "explain":
        print(explain_failure(args.log_dir, node_rank=args.node_rank, nodes=args.workers // args.local_workers,
                              master=f"{args.master_addr}:{args.master_port}", cluster_time_out=args.cluster_time_out))
    elif args.what == "rank_table":
        size, ranks = server_ranks(args.file, args.node_rank)
        print(f"RANK_SIZE {size}")
        for rank, device in ranks:
            print(rank, device)
    else:
        first = args.node_rank * args.local_workers
        ranks = [(first + i, i) for i in range(args.local_workers)]
        if args.file:
            ranks = server_ranks(args.file, args.node_rank)[1]
        for line in report(device_target=args.device_target, master_addr=resolve(args.master_addr),
                           master_port=args.master_port, node_rank=args.node_rank, workers=args.workers,
                           local_workers=args.local_workers, output_folder=args.output_folder, ranks=ranks):
            print(line)
    return 0


if __name__ == "__main__":
    run_cli(main)
