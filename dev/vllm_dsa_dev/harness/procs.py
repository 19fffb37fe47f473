"""Server processes for demos, benches and tests: each in its own process group, killed as a group.

A vLLM ``api_server`` forks an ``EngineCore`` (and workers) that outlive a signal sent to the server
alone; every process started here therefore leads its own session (``start_new_session``), and
:meth:`Cluster.stop` signals the whole group (SIGTERM, then SIGKILL after a grace period) and waits
until no process of the group is left. :func:`cluster` does that for every process on exit, on an
exception, on Ctrl-C and on SIGTERM (its own handlers: an inherited SIG_IGN for SIGINT does not stop it). :func:`wait_healthy` polls an HTTP readiness URL and fails with
the log tails of the processes when one dies or time runs out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass
class Proc:
    """A started process (leader of its own process group) and the file its output goes to."""

    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        """Process id of the leader, which is also the process group id."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the leader still runs (its group may outlive it: see :func:`group_alive`)."""
        return self.popen.poll() is None

    def tail(self, n: int = 25) -> str:
        """The last ``n`` lines of the log ("" when it cannot be read)."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` still exists (zombies included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True


def kill_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to group ``pgid``; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


_CLUSTERS: weakref.WeakValueDictionary[int, Cluster] = weakref.WeakValueDictionary()


def running_procs() -> list[Proc]:
    """Every process some live :class:`Cluster` of this Python process started and has not stopped (a test
    run's failure report reads their logs)."""
    return [p for c in list(_CLUSTERS.values()) for p in c.procs]


@dataclass
class Cluster:
    """Every process a command starts; :meth:`close` stops them all, whole process groups.

    ``grace_s`` is how long a group gets between SIGTERM and SIGKILL; ``kill_wait_s`` how long
    :meth:`stop` then waits for the group to vanish before it gives up with a warning.
    """

    workdir: Path
    grace_s: float = 10.0
    kill_wait_s: float = 10.0
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        _CLUSTERS[id(self)] = self

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        """Start ``cmd`` as the leader of a new session; stdout and stderr go to ``<workdir>/<name>.log``."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as fh:  # the child holds its own copy of the descriptor
            popen = subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT,
                                     env=dict(os.environ) if env is None else env, start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        logger.debug("started %s (pid %d): %s", name, popen.pid, " ".join(cmd))
        return proc

    def stop(self, proc: Proc, grace_s: float | None = None) -> None:
        """SIGTERM the process group of ``proc``, SIGKILL it after ``grace_s``, wait until it is gone."""
        self._stop_groups([proc], self.grace_s if grace_s is None else grace_s)

    def close(self) -> None:
        """Stop every process still listed, all at once (one shared grace period, then one shared kill
        wait). One by one, a Ctrl-C during start-up took over a minute on a loaded host: up to grace + kill
        wait per server."""
        self._stop_groups(list(reversed(self.procs)), self.grace_s)

    def _stop_groups(self, procs: list[Proc], grace_s: float) -> None:
        """SIGTERM every group of ``procs``, wait up to ``grace_s`` for all, SIGKILL the groups left, wait up
        to ``kill_wait_s``; reap the leaders and forget them. A group may outlive its leader (engine core,
        workers), so the group, not the leader, decides."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, self.kill_wait_s)):
            alive = [p for p in procs if group_alive(p.pid)]
            for p in alive:
                kill_group(p.pid, sig)
            deadline = time.monotonic() + wait_s
            for p in alive:
                _wait_group(p, max(0.0, deadline - time.monotonic()))
        for p in procs:
            if group_alive(p.pid):
                logger.warning("process group %d of %s still exists %.0f s after SIGKILL", p.pid, p.name,
                               self.kill_wait_s)
            if p.popen.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(1.0)
            if p in self.procs:
                self.procs.remove(p)


def group_pids(pgid: int) -> list[int]:
    """Pids of every process of group ``pgid`` (from /proc; empty when the group is gone)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.getpgid(int(name)) == pgid:
                out.append(int(name))
        except OSError:  # gone meanwhile
            continue
    return out


def _wait_group(proc: Proc, timeout_s: float) -> bool:
    """Reap the leader and wait until its group is empty; True when it is."""
    deadline = time.monotonic() + timeout_s
    while True:
        proc.popen.poll()  # reap the leader, else it stays a zombie member of the group
        if not group_alive(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


#: Signals :func:`cluster` turns into KeyboardInterrupt while its processes live.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def cluster(workdir: Path, grace_s: float = 10.0) -> Iterator[Cluster]:
    """A :class:`Cluster` whose processes are stopped on exit, exception, Ctrl-C and SIGTERM.

    Its servers lead their own sessions, so a Ctrl-C at the terminal reaches only this process: while the
    block runs, SIGINT and SIGTERM raise KeyboardInterrupt here whatever this process inherited. A process
    started as a background job of a non-interactive shell (``cmd &`` in a script, e.g. a CI shard) begins
    with SIGINT set to SIG_IGN, which Python keeps (it then installs no KeyboardInterrupt handler): without
    its own handler, a SIGINT would leave every server running. Both signals are also unblocked. While the
    processes are being stopped a further SIGINT/SIGTERM is ignored (stopping is bounded by ``grace_s`` plus
    the kill wait), so an impatient second Ctrl-C cannot abandon the clean-up half-way. The previous handlers
    are restored on the way out. Call it from the main thread (Python runs signal handlers only there).
    """
    c = Cluster(workdir, grace_s=grace_s)

    def on_stop_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    old = {sig: signal.signal(sig, on_stop_signal) for sig in STOP_SIGNALS}
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        yield c
    finally:
        try:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            if c.procs:
                logger.info("stopping %d process group(s) (SIGINT/SIGTERM ignored until they are gone)",
                            len(c.procs))
            c.close()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


class NotReady(RuntimeError):
    """A server did not become ready: a process exited, or the timeout passed (message has log tails)."""


def _tails(procs: Sequence[Proc], n: int) -> str:
    return "\n".join(f"--- {p.name} (pid {p.pid}, log {p.log}) last {n} lines:\n{p.tail(n)}" for p in procs)


def wait_healthy(url: str, procs: Sequence[Proc], timeout_s: float, *, path: str = "/health",
                 poll_s: float = 1.0, tail_lines: int = 25, clock: Clock = time.monotonic) -> None:
    """Poll ``url + path`` until it answers 200.

    Raises :class:`NotReady` naming the URL and showing the log tails as soon as one of ``procs``
    exits, or when ``timeout_s`` passed (measured with ``clock``).
    """
    deadline = clock() + timeout_s
    while True:
        for p in procs:
            if not p.alive():
                raise NotReady(f"{p.name} exited with code {p.popen.returncode} while waiting for "
                               f"{url}{path}; log tail:\n{p.tail(tail_lines)}")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if clock() >= deadline:
            raise NotReady(f"{url}{path} not ready after {timeout_s:.0f} s\n{_tails(procs, tail_lines)}")
        time.sleep(poll_s)
