"""D's KV pages of one P/D request against P's pages of the prefill request itself (the exact check on GPU).

Invariant: P's pages are read from the blocks its prefill request's ``kv_transfer_params`` name, right after
the prefill and before D loads them (held for D under the lease), never from a second run of the prompt on
P: a second run may recompute a block (vLLM recomputes the last prefix-hit block under speculative
decoding) and bf16 recomputation need not be bitwise equal.

Both engines need the KV probe (``--worker-extension-cls vllm_dsa_dev.kv_probe.KVProbe``) and
``VLLM_SERVER_DEV_MODE=1``. Works for every connector whose P answers with ``remote_block_ids``
(DSAConnector, vLLM's NixlConnector).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from vllm_dsa_dev.harness.client import post_json, probe_running

#: (prompt, P's per-layer digests) of an earlier request: what D may serve from its own prefix cache
Earlier = tuple[list[int], dict[str, list[int]]]


def one_block_list(ids: list[Any]) -> list[Any]:
    """P's block ids from ``remote_block_ids``: DSAConnector hands out one list, vLLM's NixlConnector one per
    KV cache group (the probe reads every layer through one list, so the groups must agree)."""
    if not ids or not isinstance(ids[0], list):
        return ids
    if any(group != ids[0] for group in ids[1:]):
        raise RuntimeError(f"remote_block_ids differ between KV cache groups: {ids}")
    return ids[0]


def pd_pages(p_url: str, d_url: str, model: str, ids: list[int], block: int,
             earlier: Sequence[Earlier] = (), timeout_s: float = 120.0) -> dict[str, Any]:
    """Prefill ``ids`` on P (``do_remote_decode``), read P's pages of that request's blocks, start the decode
    on D with P's ``kv_transfer_params`` and read D's pages while it runs; compare every full prompt block on
    every layer.

    D's block ``j`` must equal P's block ``j`` of this request or, where D served it from its own prefix
    cache, P's block ``j`` of an ``earlier`` request with the same tokens up to it (what D received then).
    Returns ``pages_equal``, the differing ``(layer, block)`` as ``differing``, ``equal_to_earlier``, the
    block lists, ``p_prefill_s`` and ``p_layers`` (P's per-layer digests, for later requests' ``earlier``).
    """
    t0 = time.perf_counter()
    res = post_json(p_url + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1,
                                                "kv_transfer_params": {"do_remote_decode": True}}, timeout_s)
    prefill_s = time.perf_counter() - t0
    params = res["kv_transfer_params"]
    full = (len(ids) - 1) // block
    p_blocks = [int(b) for b in one_block_list(params["remote_block_ids"])][:full]
    rpc = post_json(p_url + "/collective_rpc", {"method": "dsa_probe_blocks", "args": [json.dumps(p_blocks)]},
                    timeout_s)
    p_layers: dict[str, list[int]] = rpc["results"][0]["layer_digests"]
    (d,) = probe_running(d_url, model, ids, params, timeout_s)
    d_layers = d["layer_digests"]
    bad: dict[str, list[int]] = {}
    from_earlier = 0
    for name, digests in p_layers.items():
        got = d_layers.get(name, [None] * full)
        for j in range(full):
            if got[j] == digests[j]:
                continue
            prefix = ids[: (j + 1) * block]
            if any(pi[: (j + 1) * block] == prefix and pd[name][j] == got[j] for pi, pd in earlier):
                from_earlier += 1
                continue
            bad.setdefault(name, []).append(j)
    return {"prompt_tokens": len(ids), "p_prefill_s": round(prefill_s, 4), "full_blocks": full,
            "layers": len(p_layers), "p_blocks": p_blocks, "d_blocks": d["block_ids"],
            "pages_equal": not bad and len(d["digests"]) == full, "equal_to_earlier": from_earlier,
            "differing": bad, "p_layers": p_layers}
