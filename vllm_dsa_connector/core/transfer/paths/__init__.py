"""The transfer paths a writer's post follows: their names here, one module each behind one contract.

:class:`PathName` names the paths once (:data:`ROUTE_PATHS`: every one a post can follow); :mod:`.base`
states the contract (:class:`~.base.Path`: ``post``, ``progress``, and ``open``/``add``/``close`` layer by
layer; the one ``dsa1:`` notice named after the path completes a writer of it) and :mod:`.direct`,
:mod:`.bounce`, :mod:`.ipc` implement it. :class:`~vllm_dsa_connector.core.transfer.routed.RoutedTransport`
dispatches to them by the path the receiver chose (``core.handoff.routes`` chooses it); :mod:`~vllm_dsa_connector.
transport.layered` drives a layered post through the same objects.

Invariant: a path is named by :class:`PathName` and implemented once; nothing else spells a path's name
(this module imports nothing heavy: the side channel's wire types name routes by it).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ROUTE_PATHS", "PathName"]


class PathName(StrEnum):
    """A transfer path (its value is what the wire and the notices carry)."""

    DIRECT = "direct"  #: one NIXL WRITE per part, then the notice
    BOUNCE = "bounce"  #: every part gathered into one staging slot of the receiver, one WRITE carrying the notice
    IPC = "ipc"  #: same host, CUDA pools: copies into the receiver's mapped pools, the notice once they are done


#: Every path a post can follow (a receiver's route names bounce or ipc; a pair without one goes direct).
ROUTE_PATHS: tuple[PathName, ...] = tuple(PathName)
