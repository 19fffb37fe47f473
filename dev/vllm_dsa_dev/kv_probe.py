"""A vLLM worker extension that reads back KV pages by token position (for placement checks).

Start an engine with ``--worker-extension-cls vllm_dsa_dev.kv_probe.KVProbe`` and call
:meth:`KVProbe.dsa_probe_running` (or :meth:`KVProbe.dsa_probe_blocks`, :meth:`KVProbe.dsa_probe_digest_all`,
:meth:`KVProbe.dsa_page_table`) through ``collective_rpc`` (in-process ``LLM.collective_rpc``, or the
api_server's ``POST /collective_rpc`` with ``VLLM_SERVER_DEV_MODE=1``). For every request the worker is
running it returns the prompt, vLLM's own block list (position order) and a CRC32 per *full* prompt
block over every KV cache layer's page of that block (MLA latent and indexer K alike).

Comparing the digests of block ``j`` on P and on D checks that D holds, at token positions
``[j*B, (j+1)*B)``, the bytes P computed for those positions: the block lists come from each engine's
scheduler, not from the connector, so a connector that pairs blocks wrongly cannot hide it (byte
checksums of a transfer only prove that the bytes arrived, not where). The last prompt token is
excluded (D recomputes it locally), and so is the partial last block. ``layer_digests`` gives the same per
layer (by vLLM's layer name), so engines with different TP/PP layouts, whose workers hold different layers,
can be compared layer by layer.

:meth:`KVProbe.dsa_span_marks` times the P/D span the same way for every connector (the GPU bench's "one
span"): the first call hooks this worker, later calls return what it saw since: when each forward with more
than one scheduled token (a prefill) finished on the device, and when the KV connector reported each
request's KV received (``get_transfer_results`` / ``get_finished``). Both are ``time.monotonic()``, CLOCK_MONOTONIC, one clock for every
process of a host: D's "KV ready" minus P's "prefill end" is the span from P's last layer to D's KV, whatever
the connector. Bounded: the last 256 marks of each kind.
"""

from __future__ import annotations

import queue
import threading
import time
import zlib
from collections import deque
from typing import Any

import torch

__all__ = ["KVProbe", "SpanMarks", "block_digests"]


def _layer_caches(worker: Any) -> dict[str, torch.Tensor]:
    """Layer name -> KV cache tensor (``[num_blocks, ...]``) of this worker, sorted by name."""
    ctx = worker.vllm_config.compilation_config.static_forward_context
    out: dict[str, torch.Tensor] = {}
    for name in sorted(ctx):
        cache = getattr(ctx[name], "kv_cache", None)
        if isinstance(cache, list | tuple):
            cache = cache[0] if cache else None
        if isinstance(cache, torch.Tensor) and cache.numel() > 0:
            out[name] = cache
    return out


def _host_pages(cache: torch.Tensor, block_ids: list[int]) -> memoryview:
    """The pages of ``block_ids`` of one layer's cache as host bytes, page after page: one index op and
    one copy for all of them (the cache may be device memory)."""
    index = torch.as_tensor(block_ids, dtype=torch.int64, device=cache.device)
    pages = cache.index_select(0, index).contiguous().view(torch.uint8)
    return pages.cpu().numpy().reshape(-1).data


def block_digests(caches: dict[str, torch.Tensor], block_ids: list[int]) -> tuple[list[int], dict[str, list[int]]]:
    """CRC32 per block over every layer's page of that block (layers in name order), and per layer (by name);
    each layer's pages are read once for both."""
    if not block_ids:
        return [], {name: [] for name in caches}
    digests = [0] * len(block_ids)
    per_layer: dict[str, list[int]] = {}
    for name, cache in caches.items():
        host = _host_pages(cache, block_ids)
        size = len(host) // len(block_ids)
        pages = [host[j * size:(j + 1) * size] for j in range(len(block_ids))]
        per_layer[name] = [zlib.crc32(page) for page in pages]
        digests = [zlib.crc32(page, crc) for page, crc in zip(pages, digests, strict=True)]
    return digests, per_layer


def _running_requests(runner: Any) -> list[tuple[str, list[int], list[int]]]:
    """(request id, prompt token ids, block ids of the first KV cache group) of every request the runner holds.

    vLLM's V1 runner (vLLM CPU's, 0.32 and 0.33) keeps a ``requests`` dict of per-request states; the V2
    runner (the GPU build's default, and every runner of vLLM 0.34, which deleted V1) keeps ``req_states``
    (request id -> row) and ``block_tables`` (per group, a device table and a block count per row)."""
    if hasattr(runner, "requests"):
        return [(str(r), list(st.prompt_token_ids or []), [int(b) for b in st.block_ids[0]])
                for r, st in list(runner.requests.items())]
    states, tables = runner.req_states, runner.block_tables
    out = []
    for req_id, row in list(states.req_id_to_index.items()):
        plen = int(states.prompt_len.np[row])
        prompt = [int(t) for t in states.all_token_ids.gpu[row, :plen].tolist()]
        nblocks = int(tables.num_blocks.np[0, row])
        out.append((str(req_id), prompt, [int(b) for b in tables.block_tables[0].gpu[row, :nblocks].tolist()]))
    return out


class SpanMarks:
    """This worker's span marks (see the module docstring): ``forward_ends`` (a prefill forward finished on
    the device) and ``kv_ready`` (``(time, request id)``: the connector reported its KV received)."""

    def __init__(self, worker: Any, keep: int = 256) -> None:
        self.forward_ends: deque[float] = deque(maxlen=keep)
        self.kv_ready: deque[tuple[float, str]] = deque(maxlen=keep)
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        runner = worker.model_runner
        execute = runner.execute_model

        def timed_execute(*args: Any, **kwargs: Any) -> Any:
            out = execute(*args, **kwargs)
            sched = args[0] if args else kwargs.get("scheduler_output")
            if int(getattr(sched, "total_num_scheduled_tokens", 0) or 0) > 1:
                if torch.cuda.is_available():
                    ev = torch.cuda.Event()
                    ev.record()
                    self._events.put(ev)  # its time is taken once the device reached it (no wait here)
                else:
                    self.forward_ends.append(time.monotonic())
            return out

        runner.execute_model = timed_execute
        threading.Thread(target=self._watch, name="dsa-span-marks", daemon=True).start()
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            conn = get_kv_transfer_group()
            # the runner asks get_transfer_results (vLLM >= 0.32: an object with finished_recving) or, before,
            # get_finished ((finished_sending, finished_recving))
            name = "get_transfer_results" if hasattr(conn, "get_transfer_results") else "get_finished"
            finished = getattr(conn, name)

            def timed_finished(*args: Any, **kwargs: Any) -> Any:
                out = finished(*args, **kwargs)
                recving = out[1] if isinstance(out, tuple) else getattr(out, "finished_recving", None)
                now = time.monotonic()
                for req in recving or ():
                    self.kv_ready.append((now, str(req)))
                return out

            setattr(conn, name, timed_finished)

    def _watch(self) -> None:
        while True:
            ev = self._events.get()
            ev.synchronize()
            self.forward_ends.append(time.monotonic())

    def snapshot(self) -> dict[str, Any]:
        """The marks so far and this worker's clock now."""
        return {"now": time.monotonic(), "forward_ends": list(self.forward_ends),
                "kv_ready": [list(x) for x in self.kv_ready]}


class KVProbe:
    """Mixed into vLLM's worker by ``--worker-extension-cls`` (methods run on every worker)."""

    def dsa_span_marks(self) -> dict[str, Any]:
        """The span marks of this worker (the first call hooks it and returns none yet; module docstring)."""
        marks = getattr(self, "_dsa_span_marks", None)
        if marks is None:
            marks = SpanMarks(self)
            self._dsa_span_marks = marks
        return marks.snapshot()

    def dsa_probe_running(self, prompt_ids: str = "") -> list[dict[str, Any]]:
        """Every running request (or, with ``prompt_ids``, a JSON list, only those with that prompt: an engine
        under load is not stalled digesting all of them): prompt ids, block ids, block size and digests of its
        full prompt blocks (positions ``< num_prompt_tokens - 1``), over all layers and per layer."""
        import json

        runner = self.model_runner  # type: ignore[attr-defined]
        caches = _layer_caches(self)
        block_size = int(self.vllm_config.cache_config.block_size)  # type: ignore[attr-defined]
        only = [int(t) for t in json.loads(prompt_ids)] if prompt_ids else None
        out = []
        for req_id, prompt, blocks in _running_requests(runner):
            if only is not None and prompt != only:
                continue
            full = max(len(prompt) - 1, 0) // block_size
            digests, per_layer = block_digests(caches, blocks[:full])
            out.append({"req_id": str(req_id), "prompt_token_ids": prompt, "block_ids": blocks,
                        "block_size": block_size, "digests": digests, "layer_digests": per_layer})
        return out

    def dsa_probe_blocks(self, block_ids: str) -> dict[str, Any]:
        """Digests of the blocks ``block_ids`` names (a JSON list, as ``POST /collective_rpc`` passes only
        strings), over all layers and per layer: e.g. P's blocks of a finished prefill, still held for D under
        its lease, read from the request that computed them (a second run of the prompt may recompute some)."""
        import json

        blocks = [int(b) for b in json.loads(block_ids)]
        digests, per_layer = block_digests(_layer_caches(self), blocks)
        return {"block_ids": blocks, "digests": digests, "layer_digests": per_layer}

    def dsa_page_table(self) -> dict[str, Any] | None:
        """This worker's page table as DSAConnector built it from the registered ``kv_caches``
        (``{"table": PageTable.to_dict(), "kv_cache_layout": vLLM's resolved layout name}``), or None when
        the engine runs another connector (or none)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return None
        table = getattr(get_kv_transfer_group(), "page_table", None)
        if table is None:
            return None
        layout = self.vllm_config.cache_config.kv_cache_layout  # type: ignore[attr-defined]
        return {"table": table.to_dict(), "kv_cache_layout": getattr(layout, "name", str(layout))}

    def dsa_probe_digest_all(self) -> list[int]:
        """CRC32 of every KV cache layer's whole tensor (layers in name order): a snapshot to compare."""
        return [zlib.crc32(cache.contiguous().view(torch.uint8).cpu().numpy().reshape(-1).data)
                for cache in _layer_caches(self).values()]
