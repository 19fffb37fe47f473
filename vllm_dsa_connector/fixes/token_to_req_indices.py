"""Device-side token -> request map, in plain torch (no vLLM import).

This is the computation the runtime fix installs into vLLM's
``CommonAttentionMetadata.token_to_req_indices`` and the one ``dev/bench/gpu_mtp_graph.py``
captures in a CUDA graph. It has the contract of vLLM 0.32's Triton
``vllm.v1.attention.ops.metadata.compute_token_to_req_indices``:

* token ``t < num_mapped_tokens`` maps to the request ``r`` with
  ``query_start_loc[r] <= t < query_start_loc[r + 1]``; zero-length rows (padding requests)
  own no token; the result is clamped to ``num_reqs - 1``;
* tokens ``num_mapped_tokens <= t < num_tokens`` map to 0;
* only ``out[:num_tokens]`` is written, and the returned tensor is that view of ``out``.

It is one ``searchsorted`` of ``arange(num_tokens)`` over the inclusive cumulative query
lengths (``query_start_loc[1:]``) on the tensors' device: no host synchronisation, static
shapes for a given ``num_tokens``, so it can be recorded in a CUDA graph and replayed after
``query_start_loc`` changes in place. With ``num_mapped_tokens=None`` the mapped-token count
is read on device from ``query_start_loc[-1]`` as well, so a replay also follows a changed
total.
"""

from __future__ import annotations

import torch

__all__ = ["compute_token_to_req_indices", "token_to_req_indices_from_lens"]


def compute_token_to_req_indices(
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    num_mapped_tokens: int | None,
    num_tokens: int,
) -> torch.Tensor:
    """Write the request index of each of the first ``num_tokens`` tokens into ``out``.

    Args:
        query_start_loc: ``(num_reqs + 1,)`` int32/int64 exclusive prefix sum of the query
            lengths, on the device where the map is wanted.
        out: int32 buffer with at least ``num_tokens`` elements on the same device.
        num_mapped_tokens: tokens at or past this index map to 0; ``None`` reads the bound
            from ``query_start_loc[-1]`` on device (no host sync either way).
        num_tokens: how many entries of ``out`` to write (may include padding tokens).

    Returns:
        ``out[:num_tokens]``, filled in place.
    """
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(
            f"query_start_loc must be 1-D with num_reqs + 1 >= 1 entries, got shape "
            f"{tuple(query_start_loc.shape)}"
        )
    if out.dtype != torch.int32:
        raise ValueError(f"out must be int32, got {out.dtype}")
    if out.device != query_start_loc.device:
        raise ValueError(
            f"out is on {out.device} but query_start_loc is on {query_start_loc.device}"
        )
    if out.shape[0] < num_tokens:
        raise ValueError(f"out has {out.shape[0]} entries, fewer than num_tokens={num_tokens}")
    result = out[:num_tokens]
    num_reqs = query_start_loc.shape[0] - 1
    if num_tokens == 0:
        return result
    if num_reqs == 0:
        return result.zero_()
    tokens = torch.arange(num_tokens, device=out.device, dtype=query_start_loc.dtype)
    # ends[r] = query_start_loc[r + 1]; #ends <= t is the index of the request holding t.
    ends = query_start_loc[1:]
    req = torch.searchsorted(ends, tokens, right=True, out_int32=True)
    req.clamp_(max=num_reqs - 1)
    bound: torch.Tensor | int = (
        query_start_loc[num_reqs] if num_mapped_tokens is None else num_mapped_tokens
    )
    torch.where(tokens < bound, req, torch.zeros_like(req), out=result)
    return result


def token_to_req_indices_from_lens(query_lens: torch.Tensor) -> torch.Tensor:
    """The map for a batch given per-request query lengths (zero-length rows allowed).

    Equals ``repeat_interleave(arange(num_reqs), query_lens)`` but stays on device with no
    host sync except for sizing the output (``query_lens.sum()``), so use it for checks and
    eager code, and :func:`compute_token_to_req_indices` inside graphs.
    """
    qsl = torch.zeros(query_lens.shape[0] + 1, dtype=torch.int32, device=query_lens.device)
    qsl[1:] = torch.cumsum(query_lens, 0)
    num_tokens = int(qsl[-1])
    out = torch.empty(num_tokens, dtype=torch.int32, device=query_lens.device)
    return compute_token_to_req_indices(qsl, out, num_tokens, num_tokens)
