"""What travels: handshake payloads, the jobs a scheduler hands its workers, completion notices.

msgspec structs (compact, typed, versioned), shared by both roles and free of any serving engine. Every
list, dict, string and bytes field is bounded (``msgspec.Meta``), the page table, regions and CUDA IPC
exports of a payload included: peer input over a bound, or of another shape, is refused while it is
decoded, before it costs memory:

- :class:`RankPayload`: what one worker publishes at the handshake (page table, NIXL agent metadata,
  registered regions, compatibility facts). The adapter collects every worker's payload on its scheduler,
  which serves them on the side channel (:mod:`.side_channel`). Its page table (``core.plan.PageTable``),
  regions and staging arena (``core.transfer.RegionDesc``) and CUDA IPC exports (``core.transfer.ipc_desc.IpcDesc``)
  are those structs themselves: one msgspec struct per concept, in memory and on the wire (the same keys
  and values as the former wire mirrors, so the same bytes: the protocol is unchanged).
- :class:`PeerInfo`, :class:`PushJob` (producer), :class:`RecvJob` (consumer): what a scheduler tells its
  workers (the vLLM adapter carries them in its ``KVConnectorMetadata``).
- :class:`Notice`: the NIXL notification a sender attaches to its WRITE (or sends alone on failure).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from vllm_dsa_connector.core.plan.pages import PageTable
from vllm_dsa_connector.core.transfer.ipc_desc import IpcDesc
from vllm_dsa_connector.core.transfer.nixl.data import RegionDesc
from vllm_dsa_connector.core.transfer.paths import PathName

#: Bump on any incompatible change of the structs below or of the transfer protocol.
#: 3: completion/failure notices travel as transport notifications (``dsa1:<path><rank>:<Notice>``) on
#: every path, the direct one included (2 sent a bare ``NOTICE_PREFIX`` message there).
#: 4: registrations and jobs carry the token span (``first_token``, ``num_tokens``) instead of P's first block
#: index, so P and D may use different block sizes (3 sent ``first_block``).
#: 5: side-channel replies name the request they answer (``Envelope.reply_to``, inside the MAC), the MAC input
#: is length-prefixed, refusals of unread messages are unsigned (``Reply.unread``), and every list, dict and
#: string of the structs is bounded (4 had no ``reply_to``).
#: 6: every envelope names its sender's engine id and epoch (one random id per engine start, inside the MAC);
#: the handshake result, the workers' :class:`PeerInfo` and every job name the epoch of the peer they belong to,
#: so a restarted engine (same id, new epoch) replaces the old record everywhere (5 had no epoch).
#: 7: D names each (destination rank, source rank) pair's path in the registration (:class:`Route`: bounce with
#: its slot, or ipc; absent: direct) and P follows it; payloads name their host and GPU and may carry CUDA IPC
#: exports of the pools (6 sent bare ``[offset, size]`` staging slots and P's gate could go direct).
#: 8: P's answer to a registration says when its staging arena is (nearly) full (``Reply.staging_full``): D
#: routes that P's next requests direct; a P fences the connection of an aborted WRITE before its failure
#: notice and D keeps a given-up load's blocks until it arrives (``core/transfer/fence.py``).
PROTOCOL_VERSION = 8
#: The ``transfer_mode`` DSAConnector's P hands out in its ``kv_transfer_params`` (they travel through the
#: router, not the side channel: no protocol bump). Not ``"push"`` (what 0.1.0 handed out; issue 31): vllm-router takes
#: a returned ``"push"`` for its own push mode and changes the P/D exchange for it.
TRANSFER_MODE = "dsa-push"
#: What earlier releases' P handed out; D still takes it together with ``kv_connector`` ``"DSAConnector"``
#: (so an older P keeps working with a newer D); a bare ``"push"`` is another producer's.
LEGACY_TRANSFER_MODE = "push"

#: Largest side-channel message accepted (checked before decoding; the ZMQ socket drops bigger ones unread).
MAX_MESSAGE_BYTES = 16 << 20
#: Largest encoded :class:`RankPayload` (page table, NIXL agent metadata, regions of one worker)
MAX_PAYLOAD_BYTES = 4 << 20
#: Most workers (pp x tp) of one engine, and most ranks a staging-slot map names
MAX_WORKERS = 1024
MAX_ID_CHARS = 512
MAX_ERROR_CHARS = 4096
#: Most entries of a list or map in a handshake payload (a page table's pools, views, layers; regions, compat facts)
MAX_ENTRIES = 4096
#: Most blocks (or checksum runs) one job or notice names
MAX_BLOCKS = 1 << 20

#: A request, engine or agent id (bounded while decoding)
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
#: An engine start's instance id (``messages.new_epoch``; 0: not known)
Epoch = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # msgspec bounds fit an int64
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORKERS)]
_Str = Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)]
_Blocks = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS)]


class RankPayload(msgspec.Struct, frozen=True):
    """One worker's handshake payload."""

    engine_id: Id
    rank: int
    pp_rank: int
    tp_rank: int
    agent_name: Id
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_PAYLOAD_BYTES)]
    page_table: PageTable
    regions: Annotated[list[RegionDesc], msgspec.Meta(max_length=MAX_ENTRIES)]  # one per pool, in pool order
    compat: Annotated[dict[_Str, _Str], msgspec.Meta(max_length=MAX_ENTRIES)]
    staging: RegionDesc | None = None  # receive staging arena for bounced writes
    protocol: int = PROTOCOL_VERSION
    host: Id = ""  # this machine (``core.transfer.ipc.host_id``): same host is the first condition of the ipc path
    gpu: Id = ""  # the pools' GPU UUID ("" for CPU pools)
    reach: Annotated[list[Id], msgspec.Meta(max_length=MAX_WORKERS)] = []  # GPU UUIDs this rank's kernels can write
    # CUDA IPC export of each pool, in pool order; None: this rank offers no ipc path
    ipc: Annotated[list[IpcDesc], msgspec.Meta(max_length=MAX_ENTRIES)] | None = None


class PeerInfo(msgspec.Struct, frozen=True):
    """Every worker payload of one engine (encoded :class:`RankPayload`).

    ``as_source``: the peer writes to us (we are D); otherwise we write to it (we are P). ``epoch``: the
    start of the peer engine these payloads belong to; a worker that knows the engine at another epoch
    replaces its record (and the NIXL remote agents it added for it).
    """

    engine_id: Id
    payloads: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=MAX_PAYLOAD_BYTES)]],
                        msgspec.Meta(max_length=MAX_WORKERS)]
    as_source: bool = False
    epoch: Epoch = 0


class Route(msgspec.Struct, frozen=True, array_like=True):
    """How the bytes of one (destination rank, source rank) pair of a request travel, chosen once by D.

    ``bounce``: P gathers every part of the pair into its staging arena and WRITEs them once into
    ``[offset, offset + size)`` of the destination rank's staging arena (the parts back to back in pool-pair
    order, each packed in its merged run order); D scatters them. ``ipc``: P copies the runs into its CUDA IPC
    mapping of the destination rank's pools (one kernel per part, same host) and notifies once they are done.
    A P that cannot follow its route fails that transfer with the reason; it never picks another path.
    """

    path: PathName  # bounce or ipc (a pair written directly has no route)
    offset: int = 0
    size: int = 0

    def __post_init__(self) -> None:
        if self.path == PathName.DIRECT:
            raise ValueError("a route names bounce or ipc; a pair written directly has no route")


#: dst rank -> src rank -> its :class:`Route` (a pair not named is written directly)
Routes = Annotated[dict[_Rank, Annotated[dict[_Rank, Route], msgspec.Meta(max_length=MAX_WORKERS)]],
                   msgspec.Meta(max_length=MAX_WORKERS)]


def route_of(routes: Routes, dst_rank: int, src_rank: int) -> Route | None:
    """The route of one pair (``None``: direct)."""
    return routes.get(dst_rank, {}).get(src_rank)


class PushJob(msgspec.Struct, frozen=True):
    """P side: write ``src_blocks`` of request ``req_id`` into ``dst_blocks`` of ``dst_engine``.

    The blocks hold tokens ``[first_token, first_token + num_tokens)`` (``core.plan.peer_plan.PeerPlan.runs``'
    convention: each list starts at the block of its own size holding ``first_token``).
    """

    req_id: Id
    dst_engine: Id
    dst_req_id: Id
    src_blocks: _Blocks
    dst_blocks: _Blocks
    verify: bool = False
    routes: Routes = {}
    post_deadline: float = math.inf  # monotonic clock of this host: never post a WRITE after it
    first_token: int = 0
    num_tokens: int | None = None  # None: every token both block lists cover
    dst_epoch: Epoch = 0  # the start of dst_engine that registered: a worker knowing another one never writes
    # posted layer by layer from save_kv_layer during the step that finishes P's prefill (else all at once)
    layered: bool = False
    # not a WRITE: P will never write this registration (its request failed or does not match D's); the workers
    # send this reason as each destination rank's failure notice
    error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)] = ""


class RecvJob(msgspec.Struct, frozen=True):
    """D side: expect notices for ``req_id`` from the listed source ranks, per local rank."""

    req_id: Id
    src_engine: Id
    blocks: _Blocks
    # local (dst) rank -> source ranks that write to it
    expected: Annotated[dict[_Rank, Annotated[list[_Rank], msgspec.Meta(max_length=MAX_WORKERS)]],
                        msgspec.Meta(max_length=MAX_WORKERS)]
    timeout_s: float  # safety net only: the scheduler decides when D gives up (fail_recv)
    verify: bool = False
    src_blocks: _Blocks = []  # the producer's blocks (to recompute bounced runs for the scatter)
    routes: Routes = {}
    first_token: int = 0  # the token span both block lists hold (as in PushJob)
    num_tokens: int | None = None
    src_epoch: Epoch = 0  # the start of src_engine this load was registered with
    early: bool = False  # an early registration: ``src_blocks`` stand in for P's, which D does not know


class Notice(msgspec.Struct, frozen=True):
    """Completion notice of one (source rank -> destination rank) transfer of one request."""

    req_id: Id  # D's request id
    src_rank: int
    ok: bool
    nbytes: int = 0
    runs: int = 0
    error: _Str = ""
    # verify_transfers: (pool, dst_offset, length, crc32) per run, offsets in the destination region
    checks: Annotated[list[tuple[int, int, int, int]], msgspec.Meta(max_length=MAX_BLOCKS)] = []


NOTICE_PREFIX = b"DSA1:"

_enc = msgspec.msgpack.Encoder()
_dec_payload = msgspec.msgpack.Decoder(RankPayload)


class _Versioned(msgspec.Struct):
    """Only the protocol of a payload: read first, so a peer of another protocol is named as such, whatever
    shape its payload has."""

    protocol: int = PROTOCOL_VERSION


_dec_version = msgspec.msgpack.Decoder(_Versioned)
_dec_notice = msgspec.msgpack.Decoder(Notice)


def encode(obj: Any) -> bytes:
    """msgpack-encode a struct or plain data."""
    return _enc.encode(obj)


def decode_payload(data: bytes) -> RankPayload:
    """Decode a :class:`RankPayload`; ``ValueError`` naming the problem on bad input."""
    try:
        version = _dec_version.decode(data).protocol
        if version != PROTOCOL_VERSION:
            raise ValueError(f"DSAConnector protocol mismatch: peer speaks {version}, this side {PROTOCOL_VERSION}")
        return _dec_payload.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed DSAConnector handshake payload: {e}") from None


def encode_notice(n: Notice) -> bytes:
    """A notice as NIXL notification bytes."""
    return NOTICE_PREFIX + _enc.encode(n)


def decode_notice(data: bytes) -> Notice | None:
    """The notice in a NIXL notification, or None if it is not ours / malformed."""
    if not data.startswith(NOTICE_PREFIX):
        return None
    try:
        return _dec_notice.decode(data[len(NOTICE_PREFIX) :])
    except msgspec.DecodeError:
        return None


def max_block_id(payloads: Sequence[RankPayload]) -> int:
    """Blocks ``0 .. n-1`` exist in every pool of every worker of an engine; returns ``n``."""
    return min((p.num_blocks for pl in payloads for p in pl.page_table.pools), default=0)
