"""A thin, strict wrapper over one NIXL agent (UCX backend by default).

Memory is registered once (:meth:`NixlEngine.register`, DRAM for CPU tensors, VRAM for CUDA tensors);
peers are added from their metadata bytes; a transfer is a list of byte runs WRITTEN from a local region
to a remote one, posted through the two-step API (``prep_xfer_dlist`` for both sides, then
``make_prepped_xfer``) and completed by a notification on the target. ``wait`` never hangs: an ``ERR``
state, a NIXL exception or the timeout becomes :class:`TransferError` naming the peer and the transfer.

Reconnects: once the connection to a peer is gone (:func:`is_disconnect`: ``NIXL_ERR_REMOTE_DISCONNECT``, e.g.
the link was down long enough for UCX to fail the endpoint; NIXL then drops the remote agent itself, so a
later prep names an unknown agent) the peer is marked disconnected. Its next post (``write``,
``write_prepared``, ``send_notification``) first removes the remote agent and adds it again from the metadata
:meth:`NixlEngine.add_peer` was given (:meth:`NixlEngine.reconnect`; the peer's prepared lists are prepared
again), and a post that fails with a disconnect is retried once after such a reconnect. Without this a peer
that became reachable again would never be written to again. ``on_reconnect(peer, reason)`` is called after
each reconnect (the connector counts and logs them); :attr:`NixlEngine.reconnects` counts them too.

A peer that stays unreachable backs off (:mod:`.backoff`): posts to it fail at once, naming the peer and
when the next reconnect attempt is, until that attempt; :meth:`NixlEngine.backoff` reports it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_dsa_connector.transport.backoff import ReconnectBackoff
from vllm_dsa_connector.transport.nixl_data import (
    PreparedList,
    Region,
    RegionDesc,
    Transfer,
    TransferError,
    TransferStats,
)
from vllm_dsa_connector.transport.prepared import LOCAL_AGENT, PreparedLists, descriptors
from vllm_dsa_connector.transport.runs import Runs

logger = logging.getLogger(__name__)

__all__ = [
    "DISCONNECT_ERRORS",
    "NixlEngine",
    "PreparedList",
    "Region",
    "RegionDesc",
    "Transfer",
    "TransferError",
    "TransferStats",
    "is_disconnect",
]

#: NIXL's exception class names and status names that mean the connection to the peer is gone (the peer
#: process died, or the link was down long enough for UCX to fail the endpoint): only a new connection helps.
DISCONNECT_ERRORS = ("nixlRemoteDisconnectError", "NIXL_ERR_REMOTE_DISCONNECT")


def is_disconnect(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by NIXL) says the connection to the remote agent is gone."""
    text = f"{type(exc).__name__} {exc}"
    return any(name in text for name in DISCONNECT_ERRORS)


def _state(agent: Any, xfer: Any) -> str:
    return agent.check_xfer_state(xfer)


class NixlEngine:
    """One NIXL agent: ``register`` / ``metadata`` / ``add_peer`` / ``write`` / ``wait`` / notifications."""

    def __init__(
        self,
        name: str,
        backends: tuple[str, ...] = ("UCX",),
        telemetry: bool = False,
        progress_thread: bool = False,
        on_reconnect: Callable[[str, str], None] | None = None,
        reconnect_backoff_s: float = 0.5,
        reconnect_backoff_max_s: float = 30.0,
    ) -> None:
        """``on_reconnect(peer, reason)``: called after each :meth:`reconnect` (under the caller's lock).
        ``reconnect_backoff_s`` / ``reconnect_backoff_max_s``: the first and the longest wait between reconnect
        attempts to a peer that stays unreachable (see the module docstring); ``ValueError`` unless
        ``0 < reconnect_backoff_s <= reconnect_backoff_max_s`` (finite): a peer that is gone must cost little
        per post, and one that comes back must be tried again within a bounded time."""
        self._backoff = ReconnectBackoff(name, reconnect_backoff_s, reconnect_backoff_max_s)
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "NIXL is not installed: pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"
            ) from e
        self.name = name
        self.telemetry = telemetry
        self._agent = nixl_agent(
            name,
            nixl_agent_config(
                backends=list(backends),
                capture_telemetry=telemetry,
                enable_prog_thread=progress_thread,
            ),
        )
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(
                f"NIXL agent {name!r}: backend(s) {missing} unavailable "
                f"(plugins: {self._agent.get_plugin_list()})"
            )
        self._regions: list[Region] = []
        self._peers: set[str] = set()
        self._meta: dict[str, bytes] = {}  # peer -> the metadata it was added from (for reconnects)
        self._disconnected: dict[str, str] = {}  # peer -> why its connection is gone (reconnect before posting)
        self._lists = PreparedLists(self._agent)  # lists prepared once (prepare_local/prepare_remote)
        self._conn: dict[str, int] = {}  # peer -> how many times it was reconnected (tags transfers)
        self.on_reconnect = on_reconnect
        self.reconnects = 0  # remote agents removed and added again after a disconnect
        self._ids = itertools.count()
        self._inflight: dict[int, Transfer] = {}
        self._backlog: list[tuple[str, bytes]] = []  # notifications drained by progress()
        self._closed = False

    # -- memory and peers -------------------------------------------------------------------------

    def register(self, tensor: Any) -> Region:
        """Register a contiguous torch tensor once (DRAM for CPU, VRAM for CUDA)."""
        if not tensor.is_contiguous():
            raise ValueError("register: tensor must be contiguous")
        mem = "VRAM" if tensor.is_cuda else "DRAM"
        dev = int(tensor.device.index or 0) if tensor.is_cuda else 0
        size = tensor.numel() * tensor.element_size()
        if size == 0:
            raise ValueError("register: tensor is empty")
        reg = self._agent.register_memory(tensor)
        region = Region(tensor, int(tensor.data_ptr()), size, mem, dev, self.name, reg)
        self._regions.append(region)
        return region

    def deregister(self, region: Region) -> None:
        """Deregister a region (no transfer may be using it)."""
        if region in self._regions:
            self._agent.deregister_memory(region._reg)
            self._regions.remove(region)

    def metadata(self) -> bytes:
        """This agent's metadata (send it to peers out of band). Call after registering memory."""
        return self._agent.get_agent_metadata()

    def add_peer(self, meta: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""
        peer = self._agent.add_remote_agent(meta)
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self._peers.add(peer)
        self._meta[peer] = bytes(meta)
        self._disconnected.pop(peer, None)
        self._backoff.reset(peer, proven=True)
        return peer

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (its in-flight transfers should be waited for or abandoned first)."""
        if peer in self._peers:
            self._peers.discard(peer)
            self._meta.pop(peer, None)
            self._disconnected.pop(peer, None)
            self._lists.forget(peer)
            self._backoff.reset(peer, proven=False)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as e:  # NIXL raises if already gone; nothing to undo
                logger.debug("remove_peer %s: %s", peer, e)

    def disconnected(self, peer: str) -> str:
        """Why the connection to ``peer`` is gone (its next post reconnects first), or ``""``."""
        return self._disconnected.get(peer, "")

    def backoff(self, peer: str) -> tuple[int, float]:
        """``(failed reconnect attempts in a row, seconds until the next attempt may be made)`` for ``peer``;
        ``(0, 0.0)`` when it is not backing off. Posts fail at once while the seconds are > 0."""
        return self._backoff.state(peer)

    def reconnect(self, peer: str, reason: str = "") -> None:
        """Remove ``peer``'s remote agent and add it again from the metadata :meth:`add_peer` got: NIXL makes
        a new connection on the next post. The peer's prepared lists are prepared again (their handles
        belonged to the old connection). :class:`TransferError` naming the peer when its metadata is not
        held or NIXL refuses it (the peer then stays marked disconnected)."""
        meta = self._meta.get(peer)
        if peer not in self._peers or meta is None:
            raise TransferError(f"reconnect: unknown peer {peer!r} (no metadata held)", peer=peer)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as e:  # NIXL drops a disconnected remote agent itself: already gone
            logger.debug("reconnect %s: remove_remote_agent: %s", peer, e)
        try:
            name = self._agent.add_remote_agent(meta)
        except Exception as e:
            self._disconnected[peer] = reason or self._disconnected.get(peer, "") or "reconnect failed"
            delay = self._backoff.failed(peer, f"adding its metadata again: {e}")
            raise TransferError(f"reconnect to peer {peer!r} failed: adding its metadata again: {e} (attempt "
                                f"{self._backoff.attempts(peer)}; next attempt in {delay:.2f} s)", peer=peer) from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != peer:  # the metadata names its agent: this would be a bug of this class
            raise TransferError(f"reconnect to peer {peer!r}: its metadata names agent {name!r}", peer=peer)
        self._conn[peer] = self._conn.get(peer, 0) + 1
        self._backoff.reconnected(peer)
        self._lists.reprepare(peer)
        why = self._disconnected.pop(peer, "") or reason
        self.reconnects += 1
        logger.info("NIXL agent %s: remote agent %s removed and added again (%s)", self.name, peer, why)
        if self.on_reconnect is not None:
            self.on_reconnect(peer, why)

    def _note_failure(self, peer: str, exc: BaseException, conn: int | None = None) -> bool:
        """Mark ``peer`` disconnected when ``exc`` says its connection is gone, or when NIXL no longer holds
        the remote agent although this engine does (NIXL drops it after a disconnect). True when marked.
        ``conn``: the connection a failed transfer was posted on; a failure on one already replaced by a
        reconnect marks nothing (reconnecting again would drop the new, working connection)."""
        if peer not in self._peers or (conn is not None and conn != self._conn.get(peer, 0)):
            return False
        if not is_disconnect(exc):
            try:
                known = bool(self._agent.check_remote_metadata(peer))
            except Exception:  # noqa: BLE001 - cannot tell: not a disconnect
                known = True
            if known:
                return False
        self._disconnected[peer] = why = f"{type(exc).__name__}: {exc}"
        self._backoff.lost(peer, why)  # a failed attempt when nothing completed on the new connection
        return True

    def _ensure_connected(self, peer: str) -> None:
        if peer in self._disconnected:
            refused = self._backoff.refusal(peer)
            if refused:
                raise TransferError(refused, peer=peer)
            self.reconnect(peer, self._disconnected[peer])

    @property
    def peers(self) -> frozenset[str]:
        """Names of known peers."""
        return frozenset(self._peers)

    # -- transfers ----------------------------------------------------------------------------------

    def write(
        self,
        peer: str,
        local: Region,
        remote: RegionDesc | dict[str, Any],
        runs: Runs,
        notif: bytes = b"",
    ) -> Transfer:
        """Post a WRITE of ``runs`` (local offsets -> remote offsets); the peer gets ``notif`` after the data.

        An empty transfer posts no descriptor and sends ``notif`` alone, so the target still completes.
        Raises :class:`TransferError` when the peer is unknown or NIXL refuses the request. A peer marked
        disconnected is reconnected first; a post refused because the connection is gone is retried once
        after a reconnect (see the module docstring).
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
                                                             time.perf_counter()), post)

    def _post(self, peer: str, tid: int, name: str, make: Callable[[], Transfer],
              post: Callable[[Transfer], str]) -> Transfer:
        """Reconnect ``peer`` if it is marked disconnected, then ``post`` a fresh ``make()``; a post that fails
        because the connection is gone reconnects and posts once more. Tracks the posted transfer."""
        try:
            self._ensure_connected(peer)
        except TransferError as e:
            raise TransferError(f"transfer {name} to peer {peer!r} not posted: {e}", peer=peer,
                                transfer=name) from e
        for attempt in (0, 1):
            xfer_obj = make()
            xfer_obj._conn = self._conn.get(peer, 0)
            try:
                state = post(xfer_obj)
            except Exception as e:
                self._release(xfer_obj)
                if self._note_failure(peer, e) and attempt == 0 and not self._backoff.refusal(peer):
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
                       remote_idx: Any, notif: bytes = b"") -> Transfer:
        """WRITE entries ``local_idx`` of ``local`` to entries ``remote_idx`` of ``remote`` (same lengths).

        Reconnects and retries as :meth:`write` does (``remote`` is prepared again by the reconnect)."""
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
                xfer_obj.stats = TransferStats(0, 0, 0.0, 0 if self.telemetry else -1)
                return "DONE"
            xh = self._agent.make_prepped_xfer("WRITE", local._handle, li, remote._handle, ri, notif)
            xfer_obj._xfer = xh
            return self._agent.transfer(xh)

        return self._post(peer, tid, name, lambda: Transfer(name, peer, int(li.size), total, time.perf_counter()),
                          post)

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

    def _release(self, xfer: Transfer) -> None:
        for tid, t in list(self._inflight.items()):
            if t is xfer:
                del self._inflight[tid]
        if xfer._xfer is not None:
            try:
                self._agent.release_xfer_handle(xfer._xfer)
            except Exception as e:  # cannot cancel: NIXL keeps it; leak the handle, never hang
                logger.warning("could not release %s: %s", xfer.name, e)
            xfer._xfer = None
        for h in xfer._dlists:
            try:
                self._agent.release_dlist_handle(h)
            except Exception as e:
                logger.debug("release dlist of %s: %s", xfer.name, e)
        xfer._dlists = ()

    # -- notifications ------------------------------------------------------------------------------

    def send_notification(self, peer: str, msg: bytes) -> None:
        """A notification not bound to a transfer.

        NIXL does not track it: when UCX cannot send it at once (the first message to a peer waits
        for the connection's wire-up, or the send queue is full) it leaves only while this agent
        progresses. The sender must keep calling :meth:`progress` (or ``wait``/``state``/
        :meth:`poll_notifications`) until the peer saw it; this call progresses once.
        """
        self._ensure_connected(peer)
        try:
            self._agent.send_notif(peer, msg)
        except Exception as e:
            if not self._note_failure(peer, e):
                raise TransferError(f"notification to peer {peer!r} failed: {e}", peer=peer) from e
            refused = self._backoff.refusal(peer)
            if refused:
                raise TransferError(f"notification to peer {peer!r} failed: {e}; {refused}", peer=peer) from e
            self.reconnect(peer, f"{type(e).__name__}: {e}")  # once: a second failure raises
            try:
                self._agent.send_notif(peer, msg)
            except Exception as e2:
                self._note_failure(peer, e2)
                raise TransferError(f"notification to peer {peer!r} failed after a reconnect: {e2}",
                                    peer=peer) from e2
        self.progress()

    def progress(self) -> None:
        """Progress the agent (pending sends, connection wire-up) without losing notifications: the
        ones that arrived meanwhile are kept for the next :meth:`poll_notifications`."""
        self._backlog.extend(self._drain())

    def _drain(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for peer, msgs in self._agent.get_new_notifs().items():
            p = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend((p, bytes(m)) for m in msgs)
        return out

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as ``(peer, message)`` pairs, in arrival order per peer."""
        out, self._backlog = self._backlog, []
        out.extend(self._drain())
        return out

    # -- teardown -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Release in-flight handles, forget peers, deregister memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for xfer in list(self._inflight.values()):
            self._release(xfer)
        for peer in list(self._peers):
            self.remove_peer(peer)
        for region in list(self._regions):
            try:
                self.deregister(region)
            except Exception as e:
                logger.debug("deregister: %s", e)
        self._regions.clear()

    def __enter__(self) -> NixlEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
