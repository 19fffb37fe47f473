"""P's early prefills: requests the proxy sent to D together with P (early registration, ``transfer_id``).

D may register such a request before P finished, or even before P scheduled it (:mod:`~vllm_dsa_connector.
handoff.producer` holds such a registration). This module is the vLLM side of it on P:

- when vLLM first allocates the request's blocks (``update_state_after_alloc``) the lease opens
  (:meth:`EarlyPrefills.open`);
- every step it follows the request's blocks in the scheduler output (chunked prefill allocates per chunk,
  a preemption hands out new ones) and, with ``layer_push``, hands the workers the registration of a request
  whose prefill this step finishes as a layer-by-layer job (:meth:`EarlyPrefills.track`);
- when vLLM finishes the request (``request_finished``) the lease's blocks are final (:meth:`EarlyPrefills.
  finished`): the registration is dispatched now if it was not, and an aborted prefill fails D's load.

vLLM frees a request's blocks as soon as a worker reports it ``finished_sending``, which for a finished
request is what P wants, but a layer-by-layer (or failure) job can be over before vLLM finished the
request. :meth:`EarlyPrefills.hold_back` keeps such reports until ``request_finished`` kept the blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm_dsa_connector.core.handoff.ids import check_transfer_id, prompt_digest
from vllm_dsa_connector.core.handoff.producer import Producer

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request as VllmRequest

    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

__all__ = ["EarlyPrefills"]


class EarlyPrefills:
    """The early prefills running on one P engine and their blocks (see the module docstring)."""

    def __init__(self, producer: Producer, layer_push: bool) -> None:
        self.producer = producer
        self.layer_push = layer_push
        self._running: dict[str, tuple[VllmRequest, list[int]]] = {}  # request id -> (request, blocks now)
        self._sent: set[str] = set()  # finished_sending of requests vLLM has not finished, held back
        self._release: set[str] = set()  # ... whose request finished since: to report now

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._running

    def __bool__(self) -> bool:
        return bool(self._running) or bool(self._release)

    def open(self, request: VllmRequest, blocks: KVCacheBlocks | None) -> None:
        """vLLM allocated the blocks of an early prefill: open its lease, so D's registration (which may come
        first) is attached. An unusable transfer id is logged and dropped: the request then hands out its
        params after the prefill as usual (a D that registered by it fails its load)."""
        params = request.kv_transfer_params
        assert params is not None
        try:
            tid = check_transfer_id(params.get("transfer_id"))
        except ValueError as e:
            logger.error("DSAConnector: request %s: %s; its KV is leased after the prefill instead",
                         request.request_id, e)
            params.pop("transfer_id", None)
            return
        ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        self.producer.add_early(request.request_id, tid, ids, prompt_tokens=request.num_prompt_tokens,
                                digest=prompt_digest(request.prompt_token_ids))
        self._running[request.request_id] = (request, ids)

    def track(self, scheduler_output: SchedulerOutput, meta: DSAConnectorMetadata) -> None:
        """Follow the blocks of the early prefills this step schedules; with ``layer_push`` the step that
        finishes a registered one's prefill carries its job (``PushJob.layered``) in ``meta``."""
        running = self._running
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            if new.req_id in running and new.block_ids:
                running[new.req_id] = (running[new.req_id][0], list(new.block_ids[0]))
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(getattr(cached, "req_ids", None) or ()):
            added = cached.new_block_ids[i] if rid in running else None  # type: ignore[union-attr]
            if added is not None:
                request, ids = running[rid]
                running[rid] = (request, list(added[0]) if rid in resumed else ids + list(added[0]))
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for rid, (request, ids) in running.items():
            n = scheduled.get(rid)
            if n is None:
                continue
            self.producer.update_blocks(rid, ids)
            if self.layer_push and request.num_computed_tokens + n >= request.num_prompt_tokens:
                d = self.producer.dispatch_layered(rid, ids)
                meta.peers.extend(d.peers)
                meta.push.extend(d.push)

    def finished(self, request: VllmRequest, blocks: list[int], ok: bool) -> bool:
        """vLLM finished an early prefill (``ok``: with its token, else aborted or failed); whether P keeps
        its blocks until the workers report it finished_sending."""
        req_id = request.request_id
        if self._running.pop(req_id, None) is None:
            return False
        if req_id in self._sent:  # the workers are done already: report it on this step's output
            self._sent.discard(req_id)
            self._release.add(req_id)
            return True
        return self.producer.finish_early(req_id, blocks, ok, why=request.status.name)

    def hold_back(self, sending: set[str]) -> set[str]:
        """``finished_sending`` as vLLM may see it: reports of early prefills vLLM has not finished are kept
        back, those of requests finished since are added."""
        early = {r for r in sending if r in self._running}
        self._sent |= early
        out = (sending - early) | self._release
        self._release = set()
        return out
