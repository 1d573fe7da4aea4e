"""Real kvmesh-node processes for the Python client's tests.

The binaries come from the environment, as ctest sets it (clients/python/CMakeLists.txt):
KVMESH_NODE (kvmesh-node) and KVMESH_CTL (kvmeshctl) of the build under test, plain or with a
sanitizer. Each node listens on 127.0.0.1; a single node on a port the kernel picks, the nodes
of a cluster on ports reserved just before (they must know each other's at start-up). A node is
started with --drain-timeout-ms=0 (so stopping it does not drain into the other test nodes) and
is killed with the test process (setpriv --pdeathsig) if the test dies.
"""

from __future__ import annotations

import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from typing import Dict, List, Optional, Sequence

_LISTENING = re.compile(r"^kvmesh-node (\S+) listening on 127\.0\.0\.1:(\d+) backend=")


def node_binary() -> str:
    """The kvmesh-node under test (KVMESH_NODE)."""
    path = os.environ.get("KVMESH_NODE", "")
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(f"KVMESH_NODE={path!r} is not an executable kvmesh-node; ctest sets "
                           "it (clients/python/CMakeLists.txt)")
    return path


def ctl_binary() -> str:
    """The kvmeshctl under test (KVMESH_CTL)."""
    path = os.environ.get("KVMESH_CTL", "")
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(f"KVMESH_CTL={path!r} is not an executable kvmeshctl")
    return path


def _try_bind(port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return 0
        return s.getsockname()[1]


def reserve_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago.

    Chosen at random below the kernel's ephemeral range (as tests/testing's ReservePort): a
    port from that range may go to any socket that binds port 0 or connects, in another test
    running at the same time, before the node binds it.
    """
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    if low - 10000 >= 1000:
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        for _ in range(200):
            port = rng.randrange(10000, low)
            if _try_bind(port) == port:
                return port
    return _try_bind(0)


class Node:
    """One kvmesh-node process. ``address`` is its ``host:port`` once started."""

    def __init__(self, name: str, *, port: int = 0, peers: Optional[Dict[str, str]] = None,
                 args: Sequence[str] = (), start_timeout: float = 60.0) -> None:
        self.name = name
        self._log = tempfile.NamedTemporaryFile(prefix=f"kvmesh-node-{name}-", suffix=".log",
                                                delete=False)
        argv: List[str] = [node_binary(), f"--listen=127.0.0.1:{port}", f"--node-name={name}",
                           "--drain-timeout-ms=0", "--memory-budget=256MiB",
                           "--snapshot-budget=128MiB", "--executor-threads=2"]
        if peers:
            argv.append("--peers=" + ",".join(f"{n}={a}" for n, a in sorted(peers.items())))
        argv.extend(args)
        setpriv = shutil.which("setpriv")
        if setpriv:
            argv = [setpriv, "--pdeathsig", "KILL", "--"] + argv
        self._process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=self._log)
        self.returncode: Optional[int] = None
        self._reported_exit = False
        try:
            self.port = self._wait_listening(start_timeout)
        except Exception:
            self.stop()
            raise
        self.address = f"127.0.0.1:{self.port}"

    def _wait_listening(self, timeout: float) -> int:
        """Reads the node's first stdout line: "kvmesh-node NAME listening on HOST:PORT ..."."""
        assert self._process.stdout is not None
        fd = self._process.stdout.fileno()
        deadline = time.monotonic() + timeout
        text = b""
        while b"\n" not in text:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"node {self.name} did not listen within {timeout}s; "
                                   f"stderr:\n{self.log()}")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"node {self.name} exited before it listened "
                                   f"(status {self._process.wait()}); stderr:\n{self.log()}")
            text += chunk
        line = text.split(b"\n", 1)[0].decode(errors="replace")
        match = _LISTENING.match(line)
        if not match or match.group(1) != self.name:
            raise RuntimeError(f"node {self.name} printed an unexpected line: {line!r}")
        return int(match.group(2))

    def freeze(self, timeout: float = 10.0) -> None:
        """SIGSTOP, and waits until every thread of the node has stopped: the node then
        answers nothing until :meth:`thaw`."""
        self._process.send_signal(signal.SIGSTOP)
        tasks = f"/proc/{self._process.pid}/task"
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for tid in os.listdir(tasks):
                try:
                    with open(f"{tasks}/{tid}/stat") as f:
                        # "tid (comm) S ...": the state follows the last ')'.
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:
                    continue  # a thread that ended meanwhile
            if all(state in ("T", "t") for state in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {self.name} did not stop: thread states {states}")
            time.sleep(0.001)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        self._process.send_signal(signal.SIGCONT)

    def exited_unexpectedly(self) -> Optional[str]:
        """Once, when the node has exited without being stopped: a message with its status and
        its stderr (where a sanitizer report is); otherwise None."""
        if self.returncode is not None or self._reported_exit or self._process.poll() is None:
            return None
        self._reported_exit = True
        return (f"kvmesh-node {self.name} exited by itself with status "
                f"{self._process.returncode}; stderr:\n{self.log()}")

    def log(self) -> str:
        """The node's stderr so far."""
        with open(self._log.name, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` s; returns the exit status (0: clean)."""
        if self.returncode is None:
            if self._process.poll() is None:
                self._process.send_signal(signal.SIGTERM)
                try:
                    self._process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            self.returncode = self._process.returncode
            if self._process.stdout is not None:
                self._process.stdout.close()
        return self.returncode

    def stop_checked(self) -> None:
        """Stops the node; raises AssertionError with its log unless it exited cleanly (a
        sanitizer report makes a node exit non-zero)."""
        status = self.stop()
        log = self.log()
        os.unlink(self._log.name)
        if status != 0:
            raise AssertionError(f"kvmesh-node {self.name} exited with status {status}; "
                                 f"stderr:\n{log}")


class NodeTestCase(unittest.TestCase):
    """A test class whose nodes (``cls.node``, or the list ``cls.nodes``) live for the whole
    class. After each test, a node that died during it is reported at once, with its stderr,
    on stderr and as the test's error: otherwise the report (a sanitizer's, say) would come only
    from tearDownClass, after every later test had failed with UNAVAILABLE."""

    def tearDown(self) -> None:
        started = getattr(self, "nodes", None) or [getattr(self, "node", None)]
        messages = [m for m in (n.exited_unexpectedly() for n in started if n is not None) if m]
        if messages:
            text = "\n".join(messages)
            sys.stderr.write(f"\n{text}\n")
            sys.stderr.flush()
            self.fail(text)


def start_cluster(names: Sequence[str], args: Sequence[str] = ()) -> List[Node]:
    """Nodes that know each other (--peers), on reserved ports."""
    ports = {name: reserve_port() for name in names}
    nodes = []
    try:
        for name in names:
            peers = {n: f"127.0.0.1:{p}" for n, p in ports.items() if n != name}
            nodes.append(Node(name, port=ports[name], peers=peers, args=args))
    except Exception:
        for node in nodes:
            node.stop()
        raise
    return nodes


def run_ctl(address: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs kvmeshctl against ``address``; with ``check`` raises on a non-zero exit, with the
    output."""
    result = subprocess.run([ctl_binary(), f"--addr={address}", "--timeout=60s", *args],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"kvmeshctl {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout}{result.stderr}")
    return result
