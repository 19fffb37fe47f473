"""One worker's peer set-up thread: the one-time work of learning a peer, run off the engine's step path.

Learning a destination (NIXL ``add_remote_agent`` of each of its ranks, mapping its CUDA IPC exports) can
take long on a loaded host or against a peer that is slow to answer; vLLM's NixlConnector runs its
handshakes on a background thread for the same reason. Reconnects after a lost connection (removing a
remote agent and adding it again) run here too. :class:`PeerSetup` runs such jobs one at a time, in
submission order, on its own daemon thread: the caller (the worker's ``start_load_kv``, under the worker
lock) only submits and returns. A job takes the worker lock itself, briefly, to record what it did.

Invariant: a job never runs on the thread that submitted it, and a failing job is logged and never stops
the thread (the next one runs).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["PeerSetup"]


class PeerSetup:
    """A FIFO of set-up jobs run on one daemon thread (started at the first :meth:`submit`).

    ``name``: the thread's name (logs, ``py-spy``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[str, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._busy = 0  # jobs submitted and not finished
        self._idle = threading.Condition()
        self._stopped = False

    def submit(self, what: str, job: Callable[[], None]) -> None:
        """Run ``job`` on the set-up thread after the jobs before it; ``what`` names it in logs."""
        if self._stopped:
            logger.warning("%s: stopped; set-up of %s not run", self.name, what)
            return
        with self._idle:
            self._busy += 1
        self._jobs.put((what, job))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
            self._thread.start()

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished yet."""
        return self._busy

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every submitted job finished (at most ``timeout_s``); whether it did. Never called
        on a step: for tests, benches and shutdown."""
        end = time.monotonic() + timeout_s
        with self._idle:
            while self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            what, job = item
            try:
                if not self._stopped:
                    job()
            except Exception:  # noqa: BLE001 - one peer's set-up never stops the others'
                logger.exception("%s: set-up of %s failed", self.name, what)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Run no more jobs; wait up to ``timeout_s`` for the one running (a daemon thread: never blocks
        the process's exit)."""
        self._stopped = True
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
