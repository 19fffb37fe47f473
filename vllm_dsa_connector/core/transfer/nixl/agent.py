"""One NIXL agent and everything it holds: registered memory, peers and their connections, notifications.

:class:`NixlAgent` owns the NIXL agent (UCX backend by default) and the lifetime of every handle made on it:
memory is registered once (:meth:`~NixlAgent.register`, DRAM for CPU tensors, VRAM for CUDA tensors), peers
are added from their metadata bytes, notifications are sent and drained here, and :meth:`~NixlAgent.close`
releases the in-flight transfers' handles, forgets the peers and deregisters the memory. Posting and waiting
for transfers is :class:`~.engine.NixlEngine`'s (the one class callers use, a subclass of this one): this
module is the agent and connection half of it, that one the transfer half.

Reconnects: once the connection to a peer is gone (:func:`is_disconnect`: ``NIXL_ERR_REMOTE_DISCONNECT``, e.g.
the link was down long enough for UCX to fail the endpoint; NIXL then drops the remote agent itself, so a
later prep names an unknown agent) the peer is marked disconnected, and it is reconnected: its remote agent is
removed and added again from the metadata :meth:`NixlAgent.add_peer` was given (the peer's prepared lists are
prepared again). Without this a peer that became reachable again would never be written to again.
``on_reconnect(peer, reason)`` is called after each reconnect (the connector counts and logs them);
:attr:`NixlAgent.reconnects` counts them too. Two modes (``reconnect_inline``):

* inline (the default, for single-threaded users): the next post (``write``, ``write_prepared``,
  ``send_notification``) reconnects first (:meth:`NixlAgent.reconnect`), and a post that fails with a
  disconnect is retried once after such a reconnect;
* off the caller's thread (``reconnect_inline=False``, the connector's workers): a post to a peer marked
  disconnected, or one that fails with a disconnect, posts nothing and raises :class:`PeerReconnecting`; the
  caller runs the reconnect elsewhere in three steps: :meth:`NixlAgent.begin_reconnect` (under its lock: claims
  it, once), :meth:`NixlAgent.reload_peer` (the NIXL calls, ``remove_remote_agent`` + ``add_remote_agent``,
  with no lock of the caller held) and :meth:`NixlAgent.end_reconnect` (under its lock: the bookkeeping), then
  posts again. :meth:`NixlAgent.reconnect_pending` says whether a post to the peer would wait for one.

A peer that stays unreachable backs off (:mod:`.backoff`): posts to it fail at once, naming the peer and
when the next reconnect attempt is, until that attempt; :meth:`NixlAgent.backoff` reports it.

Untracked notifications (:meth:`NixlAgent.send_notification`, and the notification of an empty WRITE) on a
cold connection: NIXL does not track them, and on a connection that has not carried a message yet one waits
in this agent for UCX's wire-up and leaves only while this agent progresses (CUDA IPC pairs showed it: no
WRITE was polled to DONE, P went idle, and the first request's notice stayed in P's worker). A connection is
warm once a tracked transfer on it completed, or once an untracked notification on it was progressed for
:data:`NOTIFY_FLUSH_S`; until then :meth:`NixlAgent.notification_pending` is true after such a send and the
sender keeps calling it (each call progresses the agent). :meth:`NixlAgent.reconnect` makes the connection
cold again.

Threads: the NIXL agent is made with NIXL's read/write synchronisation (``NIXL_THREAD_SYNC_RW``: NIXL's
default without a listener thread is ``NONE``, no locking at all): loading a peer's metadata
(:meth:`NixlAgent.load_peer`, NIXL's ``loadRemoteMD``, which releases the GIL) takes NIXL's lock exclusively,
posts, state checks and notifications take it shared. So a set-up thread may load a peer while another thread
posts or progresses, with no lock of the caller held; everything else of this class (its own records: peers,
metadata, backoff, connection counts) is kept by one thread at a time (the caller's lock), and
:meth:`NixlAgent.adopt_peer` records a loaded peer under it.

UCX connection timeouts: :func:`ucx_fail_fast_defaults` (called before the agent is made) sets UCX's TCP
connect and keepalive knobs (:data:`UCX_FAIL_FAST`) unless the environment sets them already, so a connection
to a dead peer fails in seconds, not after the kernel's two minutes of SYN retries.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Self

from vllm_dsa_connector.core.transfer.nixl.backoff import ReconnectBackoff
from vllm_dsa_connector.core.transfer.nixl.data import Region, Transfer, TransferError
from vllm_dsa_connector.core.transfer.prepared import PreparedLists

logger = logging.getLogger(__name__)

__all__ = ["DISCONNECT_ERRORS", "NOTIFY_FLUSH_S", "UCX_FAIL_FAST", "NixlAgent", "PeerReconnecting",
           "is_disconnect", "ucx_fail_fast_defaults"]

#: UCX settings that make a connection to a dead or unreachable peer fail fast, each applied only when the
#: environment does not set it (UCX reads them when the agent's UCX worker is made): TCP connect attempts
#: give up after 3 SYN retransmits (about 15 s; the kernel's default of 6 takes about 127 s), and an idle
#: TCP connection whose peer died is found by keepalive probes within about 10 s.
UCX_FAIL_FAST = {
    "UCX_TCP_SYN_CNT": "3",
    "UCX_TCP_KEEPIDLE": "5s",
    "UCX_TCP_KEEPINTVL": "2s",
    "UCX_TCP_KEEPCNT": "3",
}


def ucx_fail_fast_defaults(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set each :data:`UCX_FAIL_FAST` knob the environment does not set; returns the ones set here."""
    env = os.environ if environ is None else environ
    added = {k: v for k, v in UCX_FAIL_FAST.items() if k not in env}
    env.update(added)
    return added

#: How long a sender keeps progressing its agent after an untracked notification went out on a cold
#: connection before it presumes the notification delivered (NIXL sends no acknowledgement). Wire-up between
#: live peers that progress takes milliseconds; the window costs a fresh connection's first notice this
#: much, later ones nothing (the connection is warm then).
NOTIFY_FLUSH_S = 0.2

#: NIXL's exception class names and status names that mean the connection to the peer is gone (the peer
#: process died, or the link was down long enough for UCX to fail the endpoint): only a new connection helps.
DISCONNECT_ERRORS = ("nixlRemoteDisconnectError", "NIXL_ERR_REMOTE_DISCONNECT")


def is_disconnect(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by NIXL) says the connection to the remote agent is gone."""
    text = f"{type(exc).__name__} {exc}"
    return any(name in text for name in DISCONNECT_ERRORS)


class PeerReconnecting(TransferError):
    """Nothing was posted: the connection to the peer is gone and (``reconnect_inline=False``) its reconnect
    is the caller's to run off its thread (see the module docstring); post again once it is over."""


class NixlAgent:
    """One NIXL agent: ``register`` / ``metadata`` / ``add_peer`` / ``reconnect`` / notifications / ``close``.

    What :class:`~.engine.NixlEngine` builds its transfers on: ``_agent`` (the raw ``nixl_agent``),
    ``_peers``, ``_conn`` (the connection count of each peer, tagging transfers), ``_backoff``, ``_lists``,
    ``_ids`` / ``_inflight`` (transfer ids, the posted transfers :meth:`close` releases),
    :meth:`_ensure_connected`, :meth:`_note_failure`, :meth:`_release`, and :meth:`_sent_untracked` /
    :meth:`_warmed` (an untracked notification sent, a transfer on the current connection completed).
    """

    def __init__(
        self,
        name: str,
        backends: tuple[str, ...] = ("UCX",),
        telemetry: bool = False,
        progress_thread: bool = False,
        on_reconnect: Callable[[str, str], None] | None = None,
        reconnect_backoff_s: float = 0.5,
        reconnect_backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.perf_counter,
        reconnect_inline: bool = True,
    ) -> None:
        """``on_reconnect(peer, reason)``: called after each :meth:`reconnect` (under the caller's lock).
        ``reconnect_backoff_s`` / ``reconnect_backoff_max_s``: the first and the longest wait between reconnect
        attempts to a peer that stays unreachable (see the module docstring); ``ValueError`` unless
        ``0 < reconnect_backoff_s <= reconnect_backoff_max_s`` (finite): a peer that is gone must cost little
        per post, and one that comes back must be tried again within a bounded time. ``clock``: times the
        flush window of untracked notifications (:data:`NOTIFY_FLUSH_S`). ``reconnect_inline``: reconnect in
        the post that needs it (True) or raise :class:`PeerReconnecting` and leave it to the caller (False;
        see the module docstring)."""
        self._backoff = ReconnectBackoff(name, reconnect_backoff_s, reconnect_backoff_max_s)
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "NIXL is not installed: pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"
            ) from e
        self.name = name
        self.telemetry = telemetry
        ucx_fail_fast_defaults()
        self._agent = nixl_agent(
            name,
            nixl_agent_config(
                backends=list(backends),
                capture_telemetry=telemetry,
                enable_prog_thread=progress_thread,
                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,  # a set-up thread loads peers (docstring)
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
        self.reconnect_inline = reconnect_inline
        self._reconnecting: set[str] = set()  # peers whose reconnect runs off the caller's thread now
        self.reconnects = 0  # remote agents removed and added again after a disconnect
        self._ids = itertools.count()
        self._inflight: dict[int, Transfer] = {}
        self._backlog: list[tuple[str, bytes]] = []  # notifications drained by progress()
        self.clock = clock
        self._warm: set[str] = set()  # peers whose current connection is warm (see the module docstring)
        self._unflushed: dict[str, float] = {}  # peer -> first untracked notification sent on its cold connection
        self._closed = False
        self._scratch: Region | None = None  # the local byte a fence READs into (engine.NixlEngine.fence)

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
        """Load a peer's metadata and record it (:meth:`load_peer` then :meth:`adopt_peer`); returns the
        peer's agent name."""
        return self.adopt_peer(self.load_peer(meta), meta)

    def load_peer(self, meta: bytes) -> str:
        """Load a peer's metadata into NIXL (``add_remote_agent``) and return its agent name, recording
        nothing here: safe on a set-up thread while another thread posts (NIXL's own lock serialises it, see
        the module docstring). :meth:`adopt_peer` records it (under the caller's lock)."""
        peer = self._agent.add_remote_agent(meta)
        return peer.decode() if isinstance(peer, bytes) else str(peer)

    def adopt_peer(self, peer: str, meta: bytes) -> str:
        """Record ``peer``, whose metadata ``meta`` :meth:`load_peer` loaded: posts to it may go now."""
        self._peers.add(peer)
        self._meta[peer] = bytes(meta)
        self._disconnected.pop(peer, None)
        self._backoff.reset(peer, proven=True)
        self._cold(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (its in-flight transfers should be waited for or abandoned first)."""
        if peer in self._peers:
            self._peers.discard(peer)
            self._meta.pop(peer, None)
            self._disconnected.pop(peer, None)
            self._lists.forget(peer)
            self._backoff.reset(peer, proven=False)
            self._cold(peer)
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

    def connection(self, peer: str) -> int:
        """How many times ``peer`` was reconnected (changes with each new connection)."""
        return self._conn.get(peer, 0)

    def reconnect_pending(self, peer: str) -> bool:
        """Whether a post to ``peer`` would wait for a reconnect now: it is marked disconnected and its
        reconnect runs or may run (not waiting out a backoff: such posts fail at once)."""
        if peer not in self._disconnected:
            return False
        return peer in self._reconnecting or not self._backoff.refusal(peer)

    def begin_reconnect(self, peer: str) -> bytes | None:
        """Claim ``peer``'s reconnect (under the caller's lock): its metadata when it is marked disconnected,
        no reconnect of it runs and it is not backing off; else None. Follow with :meth:`reload_peer` (off the
        lock) and :meth:`end_reconnect` (under it)."""
        meta = self._meta.get(peer)
        if (peer not in self._disconnected or peer in self._reconnecting or meta is None
                or self._backoff.refusal(peer)):
            return None
        self._reconnecting.add(peer)
        return meta

    def reload_peer(self, peer: str, meta: bytes) -> None:
        """The NIXL calls of a reconnect: remove ``peer``'s remote agent and add it again from ``meta``
        (NIXL's own lock serialises them with other threads' posts; safe with no lock of the caller held).
        Records nothing: :meth:`end_reconnect` does. Raises what NIXL raises."""
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as e:  # NIXL drops a disconnected remote agent itself: already gone
            logger.debug("reconnect %s: remove_remote_agent: %s", peer, e)
        name = self._agent.add_remote_agent(meta)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != peer:  # the metadata names its agent: this would be a bug of this class
            raise TransferError(f"reconnect to peer {peer!r}: its metadata names agent {name!r}", peer=peer)

    def end_reconnect(self, peer: str, error: BaseException | None, reason: str = "") -> None:
        """Record the outcome of :meth:`reload_peer` (under the caller's lock): the new connection (prepared
        lists prepared again, ``on_reconnect`` called), or the failed attempt (backoff; the peer stays marked
        disconnected). :class:`TransferError` naming the peer and the next attempt when it failed."""
        self._reconnecting.discard(peer)
        if peer not in self._peers:  # removed meanwhile: drop what was added again
            if error is None:
                try:
                    self._agent.remove_remote_agent(peer)
                except Exception as e:  # noqa: BLE001 - already gone
                    logger.debug("reconnect %s: removed meanwhile: %s", peer, e)
            return
        if error is not None:
            self._disconnected[peer] = reason or self._disconnected.get(peer, "") or "reconnect failed"
            delay = self._backoff.failed(peer, f"adding its metadata again: {error}")
            raise TransferError(f"reconnect to peer {peer!r} failed: adding its metadata again: {error} (attempt "
                                f"{self._backoff.attempts(peer)}; next attempt in {delay:.2f} s)",
                                peer=peer) from error
        self._conn[peer] = self._conn.get(peer, 0) + 1
        self._backoff.reconnected(peer)
        self._cold(peer)
        self._lists.reprepare(peer)
        why = self._disconnected.pop(peer, "") or reason
        self.reconnects += 1
        logger.info("NIXL agent %s: remote agent %s removed and added again (%s)", self.name, peer, why)
        if self.on_reconnect is not None:
            self.on_reconnect(peer, why)

    def reconnect(self, peer: str, reason: str = "") -> None:
        """Remove ``peer``'s remote agent and add it again from the metadata :meth:`add_peer` got, here and now
        (:meth:`reload_peer` + :meth:`end_reconnect`): NIXL makes a new connection on the next post. The peer's
        prepared lists are prepared again (their handles belonged to the old connection). :class:`TransferError`
        naming the peer when its metadata is not held or NIXL refuses it (the peer then stays marked
        disconnected)."""
        meta = self._meta.get(peer)
        if peer not in self._peers or meta is None:
            raise TransferError(f"reconnect: unknown peer {peer!r} (no metadata held)", peer=peer)
        error: BaseException | None = None
        try:
            self.reload_peer(peer, meta)
        except Exception as e:  # noqa: BLE001 - recorded (backoff) and raised by end_reconnect
            error = e
        self.end_reconnect(peer, error, reason)

    def close_connection(self, peer: str, reason: str) -> None:
        """Drop ``peer``'s connection with whatever it still has queued: reconnect now (inline mode), or mark
        it disconnected so its reconnect runs off the caller's thread (:meth:`connection` changes once it did).
        :class:`TransferError` when an inline reconnect failed."""
        if self.reconnect_inline:
            self.reconnect(peer, reason)
        elif peer in self._peers:
            self._disconnected.setdefault(peer, reason)

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
            if not self.reconnect_inline:
                raise PeerReconnecting(f"the connection to peer {peer!r} is gone ({self._disconnected[peer]}); "
                                       "it is being reconnected off this thread; nothing posted", peer=peer)
            self.reconnect(peer, self._disconnected[peer])

    @property
    def peers(self) -> frozenset[str]:
        """Names of known peers."""
        return frozenset(self._peers)

    # -- transfer handles -----------------------------------------------------------------------------

    def _release(self, xfer: Transfer) -> None:
        """Forget ``xfer`` and free its NIXL handles (never raises: a handle NIXL keeps is leaked)."""
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

    def send_notification(self, peer: str, msg: bytes) -> bool:
        """A notification not bound to a transfer; ``True`` when the sender must keep progressing.

        NIXL does not track it: when UCX cannot send it at once (the first message to a peer waits
        for the connection's wire-up, or the send queue is full) it leaves only while this agent
        progresses. This call progresses once; on a cold connection (see the module docstring) it returns
        ``True`` and the sender calls :meth:`notification_pending` until it is false.
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
            if not self.reconnect_inline:
                raise PeerReconnecting(f"notification to peer {peer!r} not sent: its connection is gone ({e}); "
                                       "it is being reconnected off this thread", peer=peer) from e
            self.reconnect(peer, f"{type(e).__name__}: {e}")  # once: a second failure raises
            try:
                self._agent.send_notif(peer, msg)
            except Exception as e2:
                self._note_failure(peer, e2)
                raise TransferError(f"notification to peer {peer!r} failed after a reconnect: {e2}",
                                    peer=peer) from e2
        self.progress()
        return self._sent_untracked(peer)

    def notification_pending(self, peer: str) -> bool:
        """Whether an untracked notification to ``peer`` may still wait in this agent: the first one on its
        cold connection went out less than :data:`NOTIFY_FLUSH_S` ago (later ones queue behind it and leave
        with it once the wire-up is done, so they do not extend the window: a stream of notices closer than the
        window would otherwise keep every post in flight). Progresses the agent once while so; the sender
        calls it until it is false (the connection is warm then)."""
        sent = self._unflushed.get(peer)
        if sent is None:
            return False
        self.progress()
        if self.clock() - sent < NOTIFY_FLUSH_S:
            return True
        self._warmed(peer)
        return False

    def flush_notifications(self, peer: str) -> None:
        """Progress until :meth:`notification_pending` is false, at most :data:`NOTIFY_FLUSH_S` (of real
        time): for a notification no later call of the sender will progress (a failure notice)."""
        end = time.perf_counter() + NOTIFY_FLUSH_S
        while self.notification_pending(peer) and time.perf_counter() < end:
            time.sleep(1e-4)

    def _sent_untracked(self, peer: str) -> bool:
        """Note an untracked notification just sent to ``peer``; whether the sender must keep progressing."""
        if peer in self._warm or peer not in self._peers:
            return False
        self._unflushed.setdefault(peer, self.clock())  # the window runs from the first (see notification_pending)
        return True

    def _warmed(self, peer: str) -> None:
        """``peer``'s current connection carried a completed message: notifications on it leave at once."""
        if peer in self._peers:
            self._warm.add(peer)
        self._unflushed.pop(peer, None)

    def _cold(self, peer: str) -> None:
        """``peer``'s connection is new (added, reconnected) or gone: nothing has crossed it yet."""
        self._warm.discard(peer)
        self._unflushed.pop(peer, None)

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
