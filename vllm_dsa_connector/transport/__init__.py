"""Transport: moving a request's KV bytes from P's pools into D's. No vLLM imports here.

A byte's way, in five modules (the connector's worker calls the first and the last):

1. :mod:`.routed` (P): :class:`RoutedTransport` posts one writer's parts (``[(local Region, remote region,
   Runs)]``, one per pool pair, the plan's runs of :mod:`.runs`) along the route D chose for the pair:
   one module per path in :mod:`.paths`, behind one contract (:class:`~.paths.base.Path`; the names
   :class:`PathName`, :data:`ROUTE_PATHS`): ``direct`` (one NIXL WRITE per part, :class:`DirectTransport`
   of :mod:`.transports`), ``bounce`` (every part gathered into one reservation of the local
   :class:`StagingArena` at :func:`packed_offsets`, one WRITE into D's slot) or ``ipc`` (one copy per part
   into this process's CUDA IPC mapping of D's pools, opened by :mod:`.ipc`). ``post(...) -> Post``; ``progress(post)`` from the engine's steps until DONE or FAILED;
   never raises; a route it cannot follow is a FAILED post naming why. Layer by layer (:mod:`.layered`):
   ``open(...)`` the whole request's parts, ``add(post, [(part, Runs)])`` each layer's runs as its attention
   ran (direct: its WRITEs; bounce: gathered at the one-shot packed positions, each part's newly complete
   prefix written into D's slot; ipc: its copies), ``close(post)``; the receiver sees the same one notice
   and the same packed slot as from ``post``.
2. :mod:`.local_copy`: every copy inside a process: :func:`gather`, :func:`scatter` (torch index ops on the
   widest view, :mod:`.widths`), :func:`copy_runs` (the Triton kernel of :mod:`.kernels`, its cached launch
   plans and CUDA-graph replays in :mod:`.launches`; ``VLLM_DSA_COPY_IMPL``).
3. :mod:`.engine`: :class:`NixlEngine`, the one NIXL agent wrapper: its transfers (``write``, prepared
   lists, ``wait``/``state``) there, the agent it subclasses (:class:`NixlAgent` of :mod:`.agent`:
   ``register``, ``add_peer``, notifications, reconnect after a lost connection and a bounded backoff while a
   peer stays unreachable: ``reconnect_backoff_s`` doubling up to ``reconnect_backoff_max_s``, posts in
   between fail at once naming the peer); its plain data (:class:`Region`, :class:`RegionDesc`,
   :class:`Transfer`, :class:`TransferStats`, :class:`TransferError`) in :mod:`.nixl_data`.
4. :mod:`.notices`: the ``dsa1:<path><writer>:<tag>`` notification codec (one per writer and request,
   whatever the path).
5. :mod:`.receiver` (D): :class:`Receiver`, the one target side: ``arm(key, {writer: WriterSpec})``,
   ``pump()`` (notifications; scatters a bounced writer's parts), ``collect()`` -> :class:`RecvResult`;
   :data:`COMPLETES` says which notification completes a writer of each route; the specs, states,
   results and hooks it names in :mod:`.receiver_data` (:meth:`WriterSpec.for_bounce`: a bounced writer's
   slot layout, :func:`packed_parts`, the one the sender packs).

Beside them: :mod:`.gate` (:class:`BounceGate`, the one cost model, bounce or direct; options
:mod:`.gate_options`, profiles :mod:`.profiles`), :mod:`.slots` (:class:`SlotAllocator`, torch-free: D's
scheduler plans slots with it), :mod:`.staging` (:class:`StagingArena`, :class:`StagingSlot`). The benches'
extra paths (pipelined bounce, the event-signalled ipc send, the link path chooser, the fan-in receiver) live
in :mod:`vllm_dsa_connector.harness.paths`.

Every name below is importable from ``vllm_dsa_connector.transport`` (lazily: torch loads on first use).
"""

from vllm_dsa_connector.transport.gate import BounceGate, Decision
from vllm_dsa_connector.transport.gate_options import BOUNCE_OPTION_KEYS, BounceSettings
from vllm_dsa_connector.transport.profiles import PROFILES, CostModel, detect_profile
from vllm_dsa_connector.transport.runs import (
    PACK_ALIGN,
    Chunk,
    Runs,
    merge_adjacent,
    merge_runs,
    packed_offsets,
    packed_parts,
    plan_chunks,
    runs_from_blocks,
)

_LAZY = {
    "DISCONNECT_ERRORS": "agent",
    "NixlAgent": "agent",
    "NixlEngine": "engine",
    "is_disconnect": "agent",
    "PreparedList": "nixl_data",
    "Region": "nixl_data",
    "RegionDesc": "nixl_data",
    "Transfer": "nixl_data",
    "TransferError": "nixl_data",
    "TransferStats": "nixl_data",
    "Reservation": "slots",
    "SlotAllocator": "slots",
    "StagingArena": "staging",
    "StagingSlot": "staging",
    "MAX_INDEX_ROWS": "local_copy",
    "CopyConfig": "local_copy",
    "ce_available": "local_copy",
    "copy_runs": "local_copy",
    "gather": "local_copy",
    "plan_pieces": "local_copy",
    "plan_stats": "local_copy",
    "scatter": "local_copy",
    "trace_launches": "local_copy",
    "Notif": "notices",
    "decode_chunk_notif": "notices",
    "decode_event_notif": "notices",
    "decode_notif": "notices",
    "encode_chunk_notif": "notices",
    "encode_event_notif": "notices",
    "encode_notif": "notices",
    "parse_notif": "notices",
    "COMPLETES": "receiver_data",
    "PlainTags": "receiver_data",
    "ReceiveHooks": "receiver_data",
    "Receiver": "receiver",
    "RecvResult": "receiver_data",
    "RecvState": "receiver_data",
    "Verdict": "receiver_data",
    "WriterSpec": "receiver_data",
    "WriterState": "receiver_data",
    "DirectTransport": "transports",
    "Part": "transports",
    "Post": "transports",
    "PostState": "transports",
    "Transport": "transports",
    "check_deadline": "transports",
    "RoutedTransport": "routed",
    "LayeredPost": "paths.base",
    "PathName": "paths.base",
    "ROUTE_PATHS": "paths.base",
    "IpcDesc": "ipc_desc",
    "IpcUnavailable": "ipc",
    "device_uuid": "ipc",
    "enable_peer_access": "ipc",
    "export_region": "ipc",
    "host_id": "ipc",
    "open_region": "ipc",
}

__all__ = [
    "BOUNCE_OPTION_KEYS",
    "BounceGate",
    "BounceSettings",
    "COMPLETES",
    "Chunk",
    "CopyConfig",
    "CostModel",
    "DISCONNECT_ERRORS",
    "Decision",
    "DirectTransport",
    "IpcDesc",
    "IpcUnavailable",
    "LayeredPost",
    "MAX_INDEX_ROWS",
    "NixlAgent",
    "NixlEngine",
    "Notif",
    "PACK_ALIGN",
    "PROFILES",
    "PathName",
    "Part",
    "PlainTags",
    "Post",
    "PostState",
    "PreparedList",
    "ReceiveHooks",
    "Receiver",
    "RecvResult",
    "RecvState",
    "ROUTE_PATHS",
    "Region",
    "RegionDesc",
    "Reservation",
    "RoutedTransport",
    "Runs",
    "SlotAllocator",
    "StagingArena",
    "StagingSlot",
    "Transfer",
    "TransferError",
    "TransferStats",
    "Transport",
    "Verdict",
    "WriterSpec",
    "WriterState",
    "ce_available",
    "check_deadline",
    "copy_runs",
    "decode_chunk_notif",
    "decode_event_notif",
    "decode_notif",
    "detect_profile",
    "device_uuid",
    "enable_peer_access",
    "encode_chunk_notif",
    "encode_event_notif",
    "encode_notif",
    "export_region",
    "gather",
    "host_id",
    "is_disconnect",
    "merge_adjacent",
    "merge_runs",
    "open_region",
    "packed_offsets",
    "packed_parts",
    "parse_notif",
    "plan_chunks",
    "plan_pieces",
    "plan_stats",
    "runs_from_blocks",
    "scatter",
    "trace_launches",
]


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy import (torch only when needed)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value
