"""The server harness (``vllm_dsa_dev.harness.procs``) on real process trees, no engine needed.

A small Python server stands in for ``api_server``: it answers ``/health`` and forks a grandchild in its
own process group (as vLLM's EngineCore is); the tests prove the whole group is gone after ``stop``,
also when the grandchild ignores SIGTERM, and that readiness failures show the log tail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import free_port
from vllm_dsa_dev.harness.procs import (
    Cluster,
    NotReady,
    cluster,
    group_alive,
    group_pids,
    kill_group,
    wait_healthy,
)

SERVER = r"""
import http.server, os, subprocess, sys
port, pidfile, ignore_term = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
grand = "import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "") \
    + "time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", grand])
open(pidfile, "w").write(f"{os.getpid()} {child.pid}")
print("fake engine core started", flush=True)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(pidfile: Path, timeout: float = 30.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = pidfile.read_text() if pidfile.exists() else ""
        if len(text.split()) == 2:
            a, b = text.split()
            return int(a), int(b)
        time.sleep(0.05)
    raise AssertionError("the fake server never wrote its pids")


@pytest.mark.parametrize("ignore_term", [False, True], ids=["term", "term-ignored"])
def test_stop_kills_the_whole_group(tmp_path: Path, ignore_term: bool) -> None:
    port = free_port()
    pidfile = tmp_path / "pids"
    c = Cluster(tmp_path, grace_s=1.0)
    proc = c.start("fake", [sys.executable, "-c", SERVER, str(port), str(pidfile), "1" if ignore_term else "0"])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc], 30, poll_s=0.1)
        leader, grandchild = _pids(pidfile)
        assert leader == proc.pid and os.getpgid(grandchild) == proc.pid  # one group, led by the server
        assert sorted(group_pids(proc.pid)) == sorted([leader, grandchild])
        assert os.getpgid(proc.pid) != os.getpgid(os.getpid())  # not ours: Ctrl-C at a terminal spares it
        t0 = time.monotonic()
        c.stop(proc)
        assert not group_alive(proc.pid), "the process group survived stop()"
        assert not _exists(leader) and not _exists(grandchild)
        assert c.procs == [] and group_pids(proc.pid) == []
        if ignore_term:
            assert time.monotonic() - t0 >= 1.0  # the grace period passed before SIGKILL
    finally:
        c.close()
        kill_group(proc.pid, signal.SIGKILL)


def test_leader_gone_grandchild_left_is_still_killed(tmp_path: Path) -> None:
    """The leader exits on SIGTERM, its grandchild ignores it: the group is still swept with SIGKILL."""
    port = free_port()
    pidfile = tmp_path / "pids"
    with cluster(tmp_path) as c:
        c.grace_s = 0.5
        proc = c.start("fake", [sys.executable, "-c", SERVER, str(port), str(pidfile), "1"])
        _, grandchild = _pids(pidfile)
        os.kill(proc.pid, signal.SIGKILL)  # the leader dies alone, as a crashed api_server does
        proc.popen.wait(10)
        assert _exists(grandchild) and group_alive(proc.pid)
    assert not group_alive(proc.pid) and not _exists(grandchild)


def _ignore_sigint() -> None:  # what bash does to a background job (`cmd &`) when job control is off
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _block_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


@pytest.mark.parametrize(("sig", "preexec"), [
    (signal.SIGTERM, None),
    (signal.SIGINT, None),
    (signal.SIGINT, _ignore_sigint),  # the sharded CI: a pytest started by `... &` hands SIG_IGN down
    (signal.SIGINT, _block_stop_signals),
    (signal.SIGTERM, _block_stop_signals),
], ids=["sigterm", "sigint", "sigint-inherited-ignored", "sigint-inherited-blocked", "sigterm-inherited-blocked"])
def test_cluster_context_stops_on_signal(tmp_path: Path, sig: signal.Signals,
                                         preexec: Callable[[], None] | None) -> None:
    """``cluster()`` turns SIGINT and SIGTERM into KeyboardInterrupt and stops every group on the way out,
    also when the process started with SIGINT ignored or the signals blocked; its handlers are its own
    only while the block runs."""
    code = (
        "import signal, sys, time\n"
        "from pathlib import Path\n"
        "from vllm_dsa_dev.harness.procs import cluster\n"
        "before = signal.getsignal(signal.SIGINT)\n"
        "try:\n"
        "    with cluster(Path(sys.argv[1]), grace_s=2.0) as c:\n"
        "        p = c.start('sleeper', [sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "        print(p.pid, flush=True)\n"
        "        time.sleep(600)\n"
        "except KeyboardInterrupt as e:\n"
        "    print(f'interrupted: {e}; handler restored: {signal.getsignal(signal.SIGINT) == before}', flush=True)\n"
        "    sys.exit(130)\n"
    )
    runner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=preexec)
    child = 0
    try:
        assert runner.stdout is not None
        child = int(runner.stdout.readline())
        assert _exists(child)
        runner.send_signal(sig)
        assert runner.wait(30) == 130
        assert runner.stdout.read().strip() == f"interrupted: signal {sig.name}; handler restored: True"
        deadline = time.monotonic() + 10
        while group_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_alive(child), f"the child outlived the runner's {sig.name}"
    finally:
        if runner.poll() is None:
            runner.kill()
        if child:
            kill_group(child, signal.SIGKILL)


def test_not_ready_shows_the_log_tail(tmp_path: Path) -> None:
    with cluster(tmp_path, grace_s=1.0) as c:
        dead = c.start("crashing", [sys.executable, "-c", "print('boom: no GPU here', flush=True); raise SystemExit(3)"])
        with pytest.raises(NotReady, match=r"(?s)crashing exited with code 3.*boom: no GPU here"):
            wait_healthy(f"http://127.0.0.1:{free_port()}", [dead], 30, poll_s=0.1)
        slow = c.start("silent", [sys.executable, "-c", "print('still loading weights', flush=True); "
                                  "import time; time.sleep(600)"])
        time.sleep(0.5)
        t = iter([0.0, 0.0, 5.0])  # injected clock: the deadline passes on the second check
        with pytest.raises(NotReady, match=r"(?s)not ready after 1 s.*silent.*still loading weights"):
            wait_healthy(f"http://127.0.0.1:{free_port()}", [slow], 1.0, poll_s=0.01, clock=lambda: next(t))
