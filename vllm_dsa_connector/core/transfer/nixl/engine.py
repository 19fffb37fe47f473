"""NIXL transfers: :class:`NixlEngine`, the one NIXL wrapper callers use (a :class:`~.agent.NixlAgent`).

A transfer is a list of byte runs WRITTEN from a local region to a remote one, posted through the two-step
API (``prep_xfer_dlist`` for both sides, then ``make_prepped_xfer``) and completed by a notification on the
target; descriptor lists prepared once (``prepare_local`` / ``prepare_remote``, :mod:`.prepared`) are
written with ``write_prepared``. ``wait`` never hangs: an ``ERR`` state, a NIXL exception or the timeout
becomes :class:`TransferError` naming the peer and the transfer.

The agent itself (registered memory, peers, reconnects and their backoff, notifications, ``close``) is
:class:`~.agent.NixlAgent`'s, in :mod:`.agent`; this module adds what uses a connection: posting (a peer
marked disconnected is reconnected first, a post refused because the connection is gone is retried once
after a reconnect; or, with ``reconnect_inline=False``, :class:`~.agent.PeerReconnecting` is raised and
nothing is posted: see :mod:`.agent`), the state of a posted transfer and waiting for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.nixl.agent import NixlAgent, PeerReconnecting
from vllm_dsa_connector.core.transfer.nixl.data import (
    PreparedList,
    Region,
    RegionDesc,
    Transfer,
    TransferError,
    TransferStats,
)
from vllm_dsa_connector.core.transfer.prepared import LOCAL_AGENT, descriptors

logger = logging.getLogger(__name__)

__all__ = ["NixlEngine"]


def _state(agent: Any, xfer: Any) -> str:
    return agent.check_xfer_state(xfer)


class NixlEngine(NixlAgent):
    """One NIXL agent (:class:`~.agent.NixlAgent`: ``register`` / ``metadata`` / ``add_peer`` / notifications)
    and its transfers: ``write`` / ``write_prepared`` / ``state`` / ``wait``."""

    def write(
        self,
        peer: str,
        local: Region,
        remote: RegionDesc | dict[str, Any],
        runs: Runs,
        notif: bytes = b"",
        *,
        deadline: float | None = None,
    ) -> Transfer:
        """Post a WRITE of ``runs`` (local offsets -> remote offsets); the peer gets ``notif`` after the data.

        An empty transfer posts no descriptor and sends ``notif`` alone, so the target still completes.
        Raises :class:`TransferError` when the peer is unknown or NIXL refuses the request. A peer marked
        disconnected is reconnected first; a post refused because the connection is gone is retried once
        after a reconnect (see :mod:`.agent`). ``deadline`` (``time.monotonic()``): checked immediately before
        every post attempt, i.e. after any reconnect, so nothing is posted at or after it (:class:`TransferError`
        saying so; nothing was posted).
        """
        remote = RegionDesc.from_dict(remote)
        tid = next(self._ids)
        name = f"{self.name}#{tid} notif={notif[:48]!r}"
        if peer not in self._peers:
            raise TransferError(f"transfer {name}: unknown peer {peer!r}", peer=peer, transfer=name)
        runs.check_bounds(local.size, remote.size, what=f"transfer {name}")

        def post(xfer_obj: Transfer) -> str:
            if runs.num_runs == 0:
                self._agent.send_notif(peer, notif)
                self.progress()  # untracked by NIXL: see send_notification
                self._sent_untracked(peer)
                xfer_obj.stats = TransferStats(0, 0, 0.0, 0 if self.telemetry else -1)
                return "DONE"
            n = runs.num_runs
            lh = self._agent.prep_xfer_dlist(
                LOCAL_AGENT,
                descriptors(local.addr, runs.src_offsets, runs.lengths, local.dev),
                local.mem,
            )
            xfer_obj._dlists = (lh,)
            rh = self._agent.prep_xfer_dlist(
                peer,
                descriptors(remote.addr, runs.dst_offsets, runs.lengths, remote.dev),
                remote.mem,
            )
            xfer_obj._dlists = (lh, rh)
            idx = np.arange(n, dtype=np.int32)
            xh = self._agent.make_prepped_xfer("WRITE", lh, idx, rh, idx, notif)
            xfer_obj._xfer = xh
            return self._agent.transfer(xh)

        return self._post(peer, tid, name, lambda: Transfer(name, peer, runs.num_runs, runs.total_bytes,
                                                             time.perf_counter()), post, deadline)

    def fence(self, peer: str, remote: RegionDesc | dict[str, Any], notif: bytes) -> Transfer:
        """Fence the connection to ``peer``: a 1-byte READ of ``remote``'s first byte (nothing of the peer is
        written) carrying ``notif``.

        NIXL flushes the connection before it sends a transfer's notification, so ``notif`` arriving at the
        peer, and this transfer's DONE here, prove that every operation posted earlier on this connection,
        aborted WRITEs included, is over there: none of their bytes can land later, and none of the local
        memory they read is read any more. Posted like :meth:`write` (reconnects first; no deadline: the
        fence writes nothing). Tracked: poll :meth:`state` / :meth:`wait`."""
        remote = RegionDesc.from_dict(remote)
        if self._scratch is None:
            import torch

            self._scratch = self.register(torch.zeros(64, dtype=torch.uint8))
        scratch = self._scratch
        tid = next(self._ids)
        name = f"{self.name}#{tid} fence notif={notif[:48]!r}"
        if peer not in self._peers:
            raise TransferError(f"fence {name}: unknown peer {peer!r}", peer=peer, transfer=name)
        zero, one = np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64)

        def post(xfer_obj: Transfer) -> str:
            lh = self._agent.prep_xfer_dlist(LOCAL_AGENT, descriptors(scratch.addr, zero, one, scratch.dev),
                                             scratch.mem)
            xfer_obj._dlists = (lh,)
            rh = self._agent.prep_xfer_dlist(peer, descriptors(remote.addr, zero, one, remote.dev), remote.mem)
            xfer_obj._dlists = (lh, rh)
            idx = np.zeros(1, dtype=np.int32)
            xh = self._agent.make_prepped_xfer("READ", lh, idx, rh, idx, notif)
            xfer_obj._xfer = xh
            return self._agent.transfer(xh)

        return self._post(peer, tid, name, lambda: Transfer(name, peer, 1, 1, time.perf_counter()), post)

    def _post(self, peer: str, tid: int, name: str, make: Callable[[], Transfer],
              post: Callable[[Transfer], str], deadline: float | None = None) -> Transfer:
        """Reconnect ``peer`` if it is marked disconnected, then ``post`` a fresh ``make()``; a post that fails
        because the connection is gone reconnects and posts once more. Tracks the posted transfer.
        ``deadline`` is checked immediately before each post attempt (a reconnect can take seconds)."""
        try:
            self._ensure_connected(peer)
        except PeerReconnecting:
            raise
        except TransferError as e:
            raise TransferError(f"transfer {name} to peer {peer!r} not posted: {e}", peer=peer,
                                transfer=name) from e
        for attempt in (0, 1):
            if deadline is not None and (now := time.monotonic()) >= deadline:
                raise TransferError(f"transfer {name} to peer {peer!r}: post deadline passed {now - deadline:.3f} s "
                                    "ago; not writing", peer=peer, transfer=name)
            xfer_obj = make()
            xfer_obj._conn = self._conn.get(peer, 0)
            try:
                state = post(xfer_obj)
            except Exception as e:
                self._release(xfer_obj)
                if self._note_failure(peer, e) and attempt == 0 and not self._backoff.refusal(peer):
                    if not self.reconnect_inline:  # the caller reconnects off its thread, then posts again
                        raise PeerReconnecting(f"transfer {name} to peer {peer!r} not posted: its connection is "
                                               f"gone ({e}); it is being reconnected off this thread", peer=peer,
                                               transfer=name) from e
                    logger.info("transfer %s: connection to peer %r gone (%s); reconnecting and posting again",
                                name, peer, e)
                    try:
                        self.reconnect(peer, f"{type(e).__name__}: {e}")
                    except TransferError as e2:
                        raise TransferError(f"transfer {name} to peer {peer!r} could not be posted: {e}; {e2}",
                                            peer=peer, transfer=name) from e2
                    continue
                refused = self._backoff.refusal(peer)
                raise TransferError(
                    f"transfer {name} to peer {peer!r} could not be posted: {e}" + (f"; {refused}" if refused else ""),
                    peer=peer,
                    transfer=name,
                ) from e
            if xfer_obj.stats is not None:  # notification only: nothing in flight
                return xfer_obj
            if state == "ERR":
                self._release(xfer_obj)
                raise TransferError(
                    f"transfer {name} to peer {peer!r} failed at post (ERR)", peer=peer, transfer=name
                )
            self._inflight[tid] = xfer_obj
            return xfer_obj
        raise AssertionError("unreachable: the second attempt returns or raises")

    def prepare_local(self, region: Region, offsets: Any, lengths: Any) -> PreparedList:
        """Prepare a local descriptor list once (e.g. one entry per block of a KV pool)."""
        return self._lists.prepare(LOCAL_AGENT, region.addr, region.size, region.mem, region.dev, offsets, lengths)

    def prepare_remote(self, peer: str, remote: RegionDesc | dict[str, Any], offsets: Any,
                       lengths: Any) -> PreparedList:
        """Prepare a peer's descriptor list once (after :meth:`add_peer`); prepared again by
        :meth:`reconnect` (its handle belongs to one connection to the peer)."""
        if peer not in self._peers:
            raise TransferError(f"prepare_remote: unknown peer {peer!r}", peer=peer)
        self._ensure_connected(peer)
        r = RegionDesc.from_dict(remote)
        return self._lists.prepare(peer, r.addr, r.size, r.mem, r.dev, offsets, lengths)

    def release_prepared(self, plist: PreparedList) -> None:
        """Free a prepared list (no transfer may still use it)."""
        self._lists.release(plist)

    def write_prepared(self, peer: str, local: PreparedList, local_idx: Any, remote: PreparedList,
                       remote_idx: Any, notif: bytes = b"", *, deadline: float | None = None) -> Transfer:
        """WRITE entries ``local_idx`` of ``local`` to entries ``remote_idx`` of ``remote`` (same lengths).

        Reconnects and retries as :meth:`write` does (``remote`` is prepared again by the reconnect);
        ``deadline`` as for :meth:`write`."""
        li = np.ascontiguousarray(local_idx, dtype=np.int32).reshape(-1)
        ri = np.ascontiguousarray(remote_idx, dtype=np.int32).reshape(-1)
        tid = next(self._ids)
        name = f"{self.name}#{tid} notif={notif[:48]!r}"
        if peer not in self._peers or remote.agent != peer:
            raise TransferError(f"transfer {name}: unknown peer {peer!r} or list of another peer",
                                peer=peer, transfer=name)
        if li.shape != ri.shape:
            raise ValueError(f"transfer {name}: {li.size} local vs {ri.size} remote entries")
        if li.size and not np.array_equal(local.lengths[li], remote.lengths[ri]):
            raise ValueError(f"transfer {name}: local and remote entry lengths differ")
        total = int(local.lengths[li].sum()) if li.size else 0

        def post(xfer_obj: Transfer) -> str:
            if li.size == 0:
                self._agent.send_notif(peer, notif)
                self.progress()  # untracked by NIXL: see send_notification
                self._sent_untracked(peer)
                xfer_obj.stats = TransferStats(0, 0, 0.0, 0 if self.telemetry else -1)
                return "DONE"
            xh = self._agent.make_prepped_xfer("WRITE", local._handle, li, remote._handle, ri, notif)
            xfer_obj._xfer = xh
            return self._agent.transfer(xh)

        return self._post(peer, tid, name, lambda: Transfer(name, peer, int(li.size), total, time.perf_counter()),
                          post, deadline)

    def state(self, xfer: Transfer) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"`` (no exception)."""
        if xfer.stats is not None:
            return "DONE"
        if xfer._xfer is None:
            return "ERR"
        try:
            st = _state(self._agent, xfer._xfer)
        except Exception as e:  # noqa: BLE001 - an ERR state; a lost connection marks its peer disconnected
            xfer._error = f"{type(e).__name__}: {e}"
            if self._note_failure(xfer.peer, e, xfer._conn):
                xfer._error += "; the connection is gone: the next post reconnects"
            return "ERR"
        if st == "DONE" and xfer.peer in self._peers and xfer._conn == self._conn.get(xfer.peer, 0):
            self._backoff.works(xfer.peer)
            self._warmed(xfer.peer)  # untracked notifications on this connection leave at once now
        return st

    def wait(self, xfer: Transfer, timeout_s: float = 10.0) -> TransferStats:
        """Block until the WRITE is done; ``TransferError`` on ERR or after ``timeout_s`` (never hangs)."""
        if xfer.stats is not None:
            return xfer.stats
        deadline = xfer.started + timeout_s if timeout_s is not None else float("inf")
        deadline = max(deadline, time.perf_counter() + 1e-3)
        spins = 0
        while True:
            st = self.state(xfer)
            if st == "DONE":
                break
            if st == "ERR":
                self._release(xfer)
                raise TransferError(
                    f"transfer {xfer.name} to peer {xfer.peer!r} failed (ERR state; "
                    f"{xfer._error or 'peer gone or refused'})",
                    peer=xfer.peer,
                    transfer=xfer.name,
                )
            now = time.perf_counter()
            if now > deadline:
                self._release(xfer)
                raise TransferError(
                    f"transfer {xfer.name} to peer {xfer.peer!r} timed out after "
                    f"{now - xfer.started:.2f} s",
                    peer=xfer.peer,
                    transfer=xfer.name,
                )
            spins += 1
            time.sleep(0 if spins < 200 else 5e-5)
        secs = time.perf_counter() - xfer.started
        stats = TransferStats(xfer.num_runs, xfer.total_bytes, secs)
        if self.telemetry:
            try:
                tel = self._agent.get_xfer_telemetry(xfer._xfer)
                stats = TransferStats(
                    xfer.num_runs,
                    xfer.total_bytes,
                    secs,
                    int(tel.descCount),
                    int(tel.postDuration),
                    int(tel.xferDuration),
                )
            except Exception as e:  # telemetry is best effort
                logger.debug("telemetry for %s: %s", xfer.name, e)
        xfer.stats = stats
        self._release(xfer)
        return stats
