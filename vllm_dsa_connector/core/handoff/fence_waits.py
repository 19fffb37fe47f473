"""D's given-up loads that wait for P's fence, and when that wait is moot because P's start is gone.

After a give-up D's workers keep the load's blocks until every writer that had not reported sent its notice,
which P sends after an aborted WRITE only as a fence (:mod:`vllm_dsa_connector.core.transfer.fence`), at most
``fence_timeout_s``. A P whose process is gone sends nothing, but nothing of it can land any more either (its
kernel closed its sockets; what already sat in D's receive buffer D's next progress applies, while it still
holds the blocks). :class:`FenceWaits` tells the workers to stop waiting for such a P: when its side channel
refuses connections (nothing listens on its port: the process that held the lease is gone; a partitioned or
stopped P does not refuse, it times out or answers) or when P answers from another start (it restarted).

Invariant: a wait ends only by P's own notice (the workers'), P's death or new start (here), or the timeout.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["FenceWaits", "refused"]


def refused(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether ``host:port`` refuses a TCP connection (the host answers, nothing listens there)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable, timed out: cannot tell
        return False


@dataclass
class _Wait:
    engine: str
    host: str
    port: int
    epoch: int


class FenceWaits:
    """The given-up loads whose workers wait for P's fence, by D request id (see the module docstring).

    ``probe_every_s``: how often P's side channel is probed while a load of it waits; ``probe``: the probe
    (:func:`refused`), run on a thread of its own.
    """

    def __init__(self, probe_every_s: float = 1.0, *, clock: Callable[[], float] = time.monotonic,
                 probe: Callable[[str, int], bool] = refused) -> None:
        self.probe_every_s = probe_every_s
        self.clock = clock
        self.probe = probe
        self._waits: dict[str, _Wait] = {}
        self._probes: dict[tuple[str, int], tuple[float, Future | None]] = {}  # (host, port) -> last, in flight
        self._pool: ThreadPoolExecutor | None = None

    def add(self, req_id: str, engine: str, host: str, port: int, epoch: int) -> None:
        """The workers wait for P ``engine`` (its side channel ``host:port``, start ``epoch``) to fence
        ``req_id``."""
        self._waits[req_id] = _Wait(engine, host, port, epoch)

    def done(self, req_id: str) -> None:
        """The workers reported ``req_id``: nothing waits for it any more."""
        self._waits.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._waits)

    def step(self, epoch_of: Callable[[str], int | None]) -> set[str]:
        """The waits that are moot now (P gone, or another start of it known: ``epoch_of(engine)``); probes
        the side channels of the P engines still waited for (at most one probe per side channel in flight)."""
        now = self.clock()
        gone: set[tuple[str, int]] = set()
        for addr, (_, fut) in list(self._probes.items()):
            if fut is not None and fut.done():
                if not fut.exception() and fut.result():
                    gone.add(addr)
                self._probes[addr] = (self._probes[addr][0], None)
        void = set()
        for req_id, w in list(self._waits.items()):
            epoch = epoch_of(w.engine)
            if (w.host, w.port) in gone or (w.epoch and epoch and epoch != w.epoch):
                void.add(req_id)
                del self._waits[req_id]
        wanted = {(w.host, w.port) for w in self._waits.values()}
        for addr in wanted:
            last, fut = self._probes.get(addr, (float("-inf"), None))
            if fut is None and now - last >= self.probe_every_s:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsa-fence-probe")
                self._probes[addr] = (now, self._pool.submit(self.probe, *addr))
        for addr in set(self._probes) - wanted:
            if self._probes[addr][1] is None:
                del self._probes[addr]
        return void

    def shutdown(self) -> None:
        """Stop the probe thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
