"""Two "servers" on one machine: Linux network namespaces joined by a veth pair, each with its own
address and (through `unshare --uts`) its own hostname, as msrun needs for a multi-node job.

The addresses form a private /24 that exists only inside the namespaces; nothing leaves them."""
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence

SUBNET = "10.213.7"


@functools.lru_cache(maxsize=None)
def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "two-node tests need root (ip netns, unshare --uts)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"two-node tests need the '{tool}' command"
    probe = f"probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns is not available here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Nodes:
    """Two namespaces on one veth pair; node i has address SUBNET.(i+1). `command(i, args)` runs
    `args` inside node i with hostname node<i>."""

    def __init__(self, tag: str):
        self.names = [f"r22n{i}-{tag}" for i in range(2)]
        self.links = [f"v22{i}-{tag}"[:15] for i in range(2)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(2)]

    def create(self) -> None:
        for name in self.names:
            _ip("netns", "add", name)
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for name, link, address in zip(self.names, self.links, self.addresses):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def delete(self) -> None:
        """Kill whatever still runs inside the namespaces, then remove them (and so the veth pair)."""
        for name in self.names:
            listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in listed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)

    def command(self, node: int, args: Sequence[str]) -> List[str]:
        """`args` run inside node `node`, with hostname node<node> (a UTS namespace of its own)."""
        inner = f"hostname node{node} && exec \"$@\""
        return ["ip", "netns", "exec", self.names[node], "unshare", "--uts", "sh", "-c", inner, "sh", *args]


@contextmanager
def two_nodes() -> Iterator[Nodes]:
    """Two fresh namespaces, removed afterwards even when the test fails."""
    nodes = Nodes(str(os.getpid()))
    nodes.delete()
    try:
        nodes.create()
        yield nodes
    finally:
        nodes.delete()


def free_port() -> int:
    """A port free on this host now (the namespaces have all ports free)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
