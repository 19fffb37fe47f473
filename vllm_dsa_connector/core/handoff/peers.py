"""The producer engines one D knows: each learnt by a handshake, retried, redone on a restart, forgotten idle.

A :class:`Peer` is what the handshake learnt of one P engine (its payloads, the transfer plan, its clock
and epoch) plus the control thread that carries D's cancels and heartbeats to it. :class:`Peers` holds
them by engine id and runs the handshakes; the :class:`~.consumer.Consumer` owns one and asks it for a
peer whenever a request needs one.

A handshake that fails transiently (unanswered, P still starting, or an answer that is not P's signed reply
to this request: an unsigned refusal, e.g. of a clock skew over the replay window or a secret P cannot
check) is tried again while a request waits for it inside its transfer budget (``transfer_timeout_s`` from
when it was queued); a refused peer (layout, engine id) fails its requests at once.

Producer restarts (epochs). The handshake records the epoch of the P start that answered
(``PeerMeta.epoch``); P's ``kv_transfer_params`` name the start that holds the lease (``remote_epoch``).
D redoes the handshake (a fresh :class:`Peer`, the same control thread) when a request names another
epoch than the handshake's (once per epoch it names), or when any reply of P (registration, heartbeat)
comes from another epoch (:meth:`Peers.check_sender`). When the new handshake settles on a new epoch,
``on_epoch`` tells the consumer, which fails the loads of the old start
(:meth:`~.consumer.Consumer._restarted`): queued ones at allocation, registered ones by the give-up rule of
:mod:`.loads` (P's new start never writes them; D still keeps their blocks until the write bound unless
the start that took the registration confirms a cancel); a request naming an epoch that is not P's
current one fails its load (its lease died with that start). D's payloads reach the new start with its
first registration (P asks for them), and the workers get the new start's :class:`~.wire.PeerInfo`
(scheduler's job).

Nothing grows without bound: a peer no load has used for ``peer_idle_s`` is forgotten
(:meth:`Peers.forget_idle`: its control thread stops, the workers drop it; its next request handshakes
again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_dsa_connector.core.handoff.messages import Authenticator, Origin
from vllm_dsa_connector.core.handoff.settings import HandoffSettings
from vllm_dsa_connector.core.handoff.side_channel import HandshakeError, PeerMeta, fetch_payloads
from vllm_dsa_connector.core.handoff.wire import RankPayload, encode, max_block_id

if TYPE_CHECKING:
    from vllm_dsa_connector.core.plan.peer_plan import PeerPlan

logger = logging.getLogger(__name__)

#: ``check(src_payloads, dst_payloads) -> plan``: refuses an incompatible peer, plans the transfer
PeerCheck = Callable[[Sequence[RankPayload], Sequence[RankPayload]], "PeerPlan"]

# A request inside its transfer budget tries an unanswered handshake again this soon (one attempt in flight per
# peer): on a loaded host a P's side channel can stay unanswered past handshake_timeout_s (2 cores, CI: P's
# engine starved), and one slow answer must not fail every request that was waiting for it.
_RETRY_S = 0.5
_EPOCHS = 64  # epochs a peer's requests named that already caused a fresh handshake (remembered per peer)


@dataclass
class Peer:
    """One producer engine, as learnt by the handshake."""

    host: str
    port: int
    future: Future | None = None
    meta: PeerMeta | None = None
    plan: PeerPlan | None = None  # the transfer plan the handshake built (validate_peer)
    payloads: list[bytes] = field(default_factory=list)
    expected: dict[int, list[int]] = field(default_factory=dict)
    max_block: int = 0
    error: str | None = None
    failed_at: float = 0.0  # when a transient handshake failure happened (0: refused, never retried)
    control: ThreadPoolExecutor | None = None  # cancels and heartbeats to this peer only
    started_at: float = 0.0  # the current handshake attempt
    attempt: int = 1
    stale: str = ""  # a reply came from another start of P than the handshake's: redo it (why)
    epochs_asked: set[int] = field(default_factory=set)  # request epochs that already caused a fresh handshake
    last_used: float = 0.0  # the last step a request used this peer (idle peers are forgotten)
    warned: set[str] = field(default_factory=set)  # caps already logged for this peer (once each)
    staging_full: bool = False  # P's last accept said its staging arena is (nearly) full: route direct

    @property
    def retryable(self) -> bool:
        """The last handshake failed transiently (no answer, or P still starting): another may succeed."""
        return bool(self.error and self.failed_at)


class Peers:
    """The P engines one D engine knows (:attr:`by_engine`), and the handshakes that learn them.

    ``origin`` names D in every handshake; ``local_payloads`` are D's own (the plan is built against them);
    ``notifying`` wraps a background future so the engine wakes when it is done; ``on_epoch(engine, epoch)``
    runs when a handshake settles on P ``engine``'s start ``epoch`` (the consumer fails the loads another
    start holds). All calls come from the engine's scheduler thread.
    """

    def __init__(self, engine_id: str, settings: HandoffSettings, auth: Authenticator, origin: Origin,
                 local_payloads: Callable[[], list[RankPayload]], clock: Callable[[], float],
                 check_peer: PeerCheck, notifying: Callable[[Future], Future],
                 on_epoch: Callable[[str, int], None]) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.auth = auth
        self.origin = origin
        self.check_peer = check_peer
        self.clock = clock
        self._local = local_payloads
        self._notifying = notifying
        self._on_epoch = on_epoch
        self.by_engine: dict[str, Peer] = {}
        self._handshakes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsa-handshake")

    def _handshake(self, peer: Peer) -> tuple[PeerMeta, PeerPlan]:
        meta = fetch_payloads(peer.host, peer.port, self.settings.handshake_timeout_s, self.auth, self.origin)
        return meta, self.check_peer(meta.payloads, self._local())

    def peer(self, engine: str, host: str, port: int, waiting_since: float | None = None, epoch: int = 0) -> Peer:
        """The peer (its handshake started on first use). After a transient failure (no answer, or P still
        starting) the handshake is tried again ``_RETRY_S`` later for a request queued at ``waiting_since``
        whose transfer budget is not spent (:meth:`patient`). A fresh handshake also starts when a reply came
        from another start of P (``stale``) or a request names a P start (``epoch``) the handshake did not
        answer from, once per such epoch."""
        now = self.clock()
        peer = self.by_engine.get(engine)
        attempt = 1
        asked: set[int] = set()
        if peer is not None and peer.retryable and self.patient(waiting_since) and now - peer.failed_at >= _RETRY_S:
            attempt, peer = peer.attempt + 1, None
        elif peer is not None and peer.future is None and peer.meta is not None and (
                peer.stale or (epoch and epoch != peer.meta.epoch and epoch not in peer.epochs_asked)):
            why = peer.stale or f"a request names its epoch {epoch:016x}, the handshake's is {peer.meta.epoch:016x}"
            logger.warning("DSAConnector %s: P %s at %s:%d restarted? %s; redoing the handshake", self.engine_id,
                           engine, host, port, why)
            asked = set(peer.epochs_asked) if len(peer.epochs_asked) < _EPOCHS else set()
            if epoch:
                asked.add(epoch)
            peer = None
        if peer is None:
            peer = Peer(host, port, started_at=now, attempt=attempt, epochs_asked=asked)
            peer.control = (self.by_engine[engine].control if engine in self.by_engine else
                            ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsa-control"))
            peer.future = self._notifying(self._handshakes.submit(self._handshake, peer))
            self.by_engine[engine] = peer
        if peer.future is not None and peer.future.done():
            self._settle_handshake(engine, peer, peer.future, now)
        peer.last_used = now
        return peer

    def get(self, engine: str) -> Peer | None:
        """P ``engine``'s record as it stands, without starting or redoing its handshake (:meth:`peer` does)."""
        return self.by_engine.get(engine)

    def forget_idle(self, busy: set[str]) -> list[str]:
        """Forget the peers not in ``busy`` (the engines a load or heartbeat is in flight to) and not
        handshaking that no load used for ``peer_idle_s``: their control thread stops once its queued
        cancels went out, and the returned engines are the ones the workers must drop (their plan)."""
        now = self.clock()
        gone = []
        for engine, peer in list(self.by_engine.items()):
            if engine in busy or peer.future is not None:
                peer.last_used = now
            elif now - peer.last_used >= self.settings.peer_idle_s:
                del self.by_engine[engine]
                if peer.control is not None:
                    peer.control.shutdown(wait=False)
                gone.append(engine)
                logger.info("DSAConnector %s: peer %s (%s:%d) idle for %.0f s: forgotten", self.engine_id, engine,
                            peer.host, peer.port, now - peer.last_used)
        return gone

    def patient(self, waiting_since: float | None) -> bool:
        """Whether a request queued at ``waiting_since`` may still wait for a handshake to be retried."""
        return waiting_since is not None and self.clock() - waiting_since < self.settings.transfer_timeout_s

    def waits_for(self, peer: Peer, waiting_since: float) -> bool:
        """Whether a request queued at ``waiting_since`` should ask again later: the handshake is in flight,
        or it went unanswered and will be retried inside the request's transfer budget."""
        return peer.future is not None or (peer.retryable and self.patient(waiting_since))

    def _settle_handshake(self, engine: str, peer: Peer, done: Future, now: float) -> None:
        host, port = peer.host, peer.port
        took = now - peer.started_at
        try:
            peer.meta, peer.plan = done.result()
            if peer.meta.engine_id != engine:
                raise HandshakeError(f"DSAConnector peer {host}:{port} is engine {peer.meta.engine_id!r}, "
                                     f"kv_transfer_params name {engine!r}")
            peer.payloads = [encode(p) for p in peer.meta.payloads]
            peer.expected = {p.rank: list(peer.plan.senders_for(p.rank)) for p in self._local()}
            peer.max_block = max_block_id(peer.meta.payloads)
            logger.info("DSAConnector %s: handshake with %s (epoch %016x) done in %.2f s (attempt %d; %d workers, "
                        "plan %s)", self.engine_id, engine, peer.meta.epoch, took, peer.attempt, len(peer.payloads),
                        peer.expected)
            self._on_epoch(engine, peer.meta.epoch)
        except HandshakeError as e:
            peer.error = str(e)
            # an unreachable or starting peer may come back; a refused layout will not
            peer.failed_at = now if e.transient else 0.0
            logger.error("%s (attempt %d, after %.2f s%s)", e, peer.attempt, took,
                         "; waiting requests retry within their transfer budget" if e.transient else "")
        except Exception as e:  # noqa: BLE001 - any handshake bug becomes a load failure, not a crash
            peer.error = f"DSAConnector handshake with {engine} failed: {e!r}"
            peer.failed_at = now
            logger.exception("DSAConnector handshake with %s failed", engine)
        peer.future = None

    def check_sender(self, engine: str, sender: Origin) -> None:
        """A reply of ``engine`` from another start than the handshake's: the next :meth:`peer` redoes it."""
        peer = self.by_engine.get(engine)
        if (peer is not None and peer.meta is not None and not peer.stale and sender.engine_id == engine
                and sender.epoch != peer.meta.epoch):
            peer.stale = (f"a reply came from its epoch {sender.epoch:016x}, the handshake's is "
                          f"{peer.meta.epoch:016x}")
            logger.warning("DSAConnector %s: P %s: %s (restarted?)", self.engine_id, engine, peer.stale)

    def shutdown(self) -> None:
        """Stop the handshake threads and every peer's control thread."""
        for pool in [self._handshakes] + [p.control for p in self.by_engine.values() if p.control]:
            pool.shutdown(wait=False, cancel_futures=True)
