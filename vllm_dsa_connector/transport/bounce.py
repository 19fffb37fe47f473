"""The bounce transport's names in one place (kept for callers of ``transport.bounce``).

Gather scattered runs into one registered staging slot, write once, scatter on the target. The code lives in:

- :mod:`.slots` (:class:`SlotAllocator`, torch-free) and :mod:`.staging` (:class:`StagingArena` = a buffer
  and its allocator; :func:`gather` / :func:`scatter`);
- :mod:`.notices` (the ``dsa1:`` notifications), :mod:`.sends` (:class:`StagingSlot`, :class:`Send`);
- :mod:`.sender` (:class:`BounceSender`; its ``ipc`` path in :mod:`.ipc_send`);
- :mod:`.receiver` (the one :class:`Receiver`) and :mod:`.fan_in` (:class:`BounceReceiver`: slot
  reservation over it, :func:`check_fan_in`).
"""

from __future__ import annotations

from vllm_dsa_connector.transport.fan_in import BounceReceiver, LayoutError, check_fan_in
from vllm_dsa_connector.transport.ipc_send import IPC_SIGNALS
from vllm_dsa_connector.transport.notices import (
    decode_chunk_notif,
    decode_event_notif,
    decode_notif,
    encode_chunk_notif,
    encode_event_notif,
    encode_notif,
)
from vllm_dsa_connector.transport.sender import BounceSender
from vllm_dsa_connector.transport.sends import Send, StagingSlot
from vllm_dsa_connector.transport.slots import Reservation
from vllm_dsa_connector.transport.staging import MAX_INDEX_ROWS, StagingArena, gather, scatter

__all__ = [
    "IPC_SIGNALS",
    "MAX_INDEX_ROWS",
    "BounceReceiver",
    "BounceSender",
    "LayoutError",
    "Reservation",
    "Send",
    "StagingArena",
    "StagingSlot",
    "check_fan_in",
    "decode_chunk_notif",
    "decode_event_notif",
    "decode_notif",
    "encode_chunk_notif",
    "encode_event_notif",
    "encode_notif",
    "gather",
    "scatter",
]
