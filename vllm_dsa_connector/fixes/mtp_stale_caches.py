"""Runtime fix: stale metadata caches (token->request map, computed tokens) in vLLM's MTP/EAGLE draft loop.

vLLM 0.32's (and 0.33's) ``CommonAttentionMetadata.token_to_req_indices`` caches the map in
``_token_to_req_indices_cache``. The V1 proposer (``v1/spec_decode/llm_base_proposer.py``)
rewrites the target forward's metadata in place to one token per request for draft steps
>= 1 without clearing it, and ``dataclasses.replace`` copies it, so draft token ``j`` is
routed to request ``j // (num_draft_tokens + 1)``: sparse MLA (DSA) converts the indexer's
top-k through the wrong block table. ``compute_num_computed_tokens`` has the same stale
cache. ``patches/0001-*.patch`` is the upstream fix; this module installs the equivalent
at run time:

* ``token_to_req_indices`` reuses its cache only for the query layout it was built for.
  The layout key (device, data_ptr, length, stride and version counter of
  ``query_start_loc`` and the CPU token total) is host metadata, so checking it reads no
  device memory; the key is stored on the cached tensor, so it travels with the cache
  through ``replace()``/``copy()`` and is compared against the copy's own fields. A miss
  rebuilds the map with :func:`~vllm_dsa_connector.fixes.token_to_req_indices.compute_token_to_req_indices`
  (one device ``searchsorted``, CUDA-graph safe). For the target forward the key always
  matches, and the map has the same values as vLLM's kernel.
* ``compute_num_computed_tokens`` is recomputed on every call: the drafter also advances
  ``seq_lens`` in place with a Triton kernel, which torch's version counter does not see.

Per release: the class-level caches are the same in 0.32, 0.33 and 0.34, but only a V1 draft loop
(:data:`V1_DRAFT_LOOP_MODULES`) rewrites a built ``CommonAttentionMetadata`` in place. vLLM 0.32 and 0.33
have it (the fix applies); vLLM 0.34 deleted the V1 runner and its proposers, and its V2 speculators build
a new ``CommonAttentionMetadata`` for every draft step (``vllm.v1.worker.gpu.attn_utils.build_attn_metadata``),
so where none of those modules exists the fix reports ``"not-needed"``
(``tests/test_mtp_fix.py::test_retired_where_no_draft_loop_rewrites_metadata`` proves it on 0.34's sources).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

from vllm_dsa_connector.fixes.token_to_req_indices import compute_token_to_req_indices

FIX_NAME = "mtp-draft-token-map"
# Fields of CommonAttentionMetadata the fixed methods read or write. A class without one of
# them is a layout this fix does not know: it is left alone even if the probe sees stale maps.
REQUIRED_FIELDS: tuple[str, ...] = (
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "num_actual_tokens",
    "_token_to_req_indices_cache",
)
# vLLM's V1 draft loops: each rewrites the target forward's CommonAttentionMetadata in place
# (num_actual_tokens, query_start_loc) for draft steps >= 1, the path that hits the stale caches.
V1_DRAFT_LOOP_MODULES: tuple[str, ...] = (
    "vllm.v1.spec_decode.llm_base_proposer",
    "vllm.v1.spec_decode.step3p5",
)
NO_DRAFT_LOOP = (
    "vLLM has no V1 draft loop that rewrites CommonAttentionMetadata in place "
    f"({', '.join(V1_DRAFT_LOOP_MODULES)}); its speculators build it afresh for each draft step"
)
_KEY_ATTR = "_vllm_dsa_layout_key"
_MARK_ATTR = "_vllm_dsa_fix"

__all__ = [
    "FIX_NAME",
    "NO_DRAFT_LOOP",
    "REQUIRED_FIELDS",
    "V1_DRAFT_LOOP_MODULES",
    "draft_loop_modules",
    "ProbeResult",
    "install",
    "is_installed",
    "missing_fields",
    "probe",
    "uninstall",
]


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the behaviour probe saw on the installed ``CommonAttentionMetadata``."""

    token_map_stale: bool
    num_computed_stale: bool
    detail: str

    @property
    def buggy(self) -> bool:
        """True if either cache survives a draft-loop layout rewrite."""
        return self.token_map_stale or self.num_computed_stale


def draft_loop_modules() -> tuple[str, ...]:
    """The :data:`V1_DRAFT_LOOP_MODULES` this vLLM has (found, not imported)."""
    found = []
    for name in V1_DRAFT_LOOP_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                found.append(name)
        except ImportError:  # a parent package is missing
            pass
    return tuple(found)


def missing_fields(cls: type) -> tuple[str, ...]:
    """The :data:`REQUIRED_FIELDS` that the dataclass ``cls`` does not declare."""
    if not dataclasses.is_dataclass(cls):
        return REQUIRED_FIELDS
    names = {f.name for f in dataclasses.fields(cls)}
    return tuple(name for name in REQUIRED_FIELDS if name not in names)


def _layout_key(cm: Any, num_mapped_tokens: int) -> tuple:
    qsl = cm.query_start_loc
    return (
        qsl.device,
        qsl.data_ptr(),
        qsl.shape[0],
        qsl.stride(0),
        qsl._version,
        num_mapped_tokens,
    )


def _fixed_token_to_req_indices(self: Any, buffer: torch.Tensor) -> torch.Tensor:
    """Build or reuse the per-token request map, for the current query layout only."""
    num_tokens = self.num_actual_tokens
    num_mapped_tokens = int(self.query_start_loc_cpu[-1])  # CPU tensor: no device sync
    key = _layout_key(self, num_mapped_tokens)
    cache = self._token_to_req_indices_cache
    if (
        cache is not None
        and getattr(cache, _KEY_ATTR, None) == key
        and cache.device == buffer.device
        and cache.shape[0] >= num_tokens
    ):
        return cache[:num_tokens]
    num_output_tokens = max(num_mapped_tokens, num_tokens)
    if buffer.shape[0] < num_output_tokens:
        raise ValueError(
            f"token_to_req_indices buffer has {buffer.shape[0]} entries, needs {num_output_tokens}"
        )
    cache = compute_token_to_req_indices(
        self.query_start_loc, buffer, num_mapped_tokens, num_output_tokens
    )
    setattr(cache, _KEY_ATTR, key)
    self._token_to_req_indices_cache = cache
    return cache[:num_tokens]


def _fixed_compute_num_computed_tokens(self: Any) -> torch.Tensor:
    """``seq_lens - query_lens`` on device, recomputed on every call (never stale)."""
    query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
    return self.seq_lens - query_lens


setattr(_fixed_token_to_req_indices, _MARK_ATTR, FIX_NAME)
setattr(_fixed_compute_num_computed_tokens, _MARK_ATTR, FIX_NAME)

_FIXED_METHODS = {
    "token_to_req_indices": _fixed_token_to_req_indices,
    "compute_num_computed_tokens": _fixed_compute_num_computed_tokens,
}
_ORIGINALS: dict[str, Any] = {}


def _probe_metadata(cls: type, **extra: Any) -> Any:
    """A 3-request x 3-token target batch (2 draft tokens each), built on CPU."""
    qsl = torch.tensor([0, 3, 6, 9], dtype=torch.int32)
    return cls(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([10, 10, 10], dtype=torch.int32),
        num_reqs=3,
        num_actual_tokens=9,
        max_query_len=3,
        max_seq_len=10,
        block_table_tensor=torch.zeros((3, 1), dtype=torch.int32),
        slot_mapping=torch.zeros(9, dtype=torch.int64),
        **extra,
    )


def _to_draft_layout(cm: Any) -> None:
    """What ``llm_base_proposer.propose`` does to the metadata before draft step 1."""
    cm.num_actual_tokens = 3
    cm.max_query_len = 1
    cm.query_start_loc = torch.arange(4, dtype=torch.int32)
    cm.query_start_loc_cpu = cm.query_start_loc.clone()


def probe(cls: type) -> ProbeResult:
    """Check whether ``cls`` (vLLM's ``CommonAttentionMetadata``) returns stale caches.

    Runs on CPU with tiny tensors. The token map cache is seeded the way vLLM's V2 runner
    seeds it (constructor field), because vLLM's Triton kernel cannot run on CPU; a
    class that rebuilds instead of returning the stale cache is not buggy, whether the
    rebuild succeeds or fails for lack of a kernel.
    """
    notes = []
    token_map_stale = False
    if any(f.name == "_token_to_req_indices_cache" for f in dataclasses.fields(cls)):
        target_map = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2], dtype=torch.int32)
        cm = _probe_metadata(cls, _token_to_req_indices_cache=target_map)
        _to_draft_layout(cm)
        buffer = torch.zeros(16, dtype=torch.int32)
        try:
            got = cm.token_to_req_indices(buffer)
        except Exception as exc:  # a rebuild attempt: not the stale path
            notes.append(f"token map rebuilt (kernel unavailable here: {type(exc).__name__})")
        else:
            token_map_stale = got.tolist() != [0, 1, 2]
            notes.append(f"draft-step token map {got.tolist()} (want [0, 1, 2])")
    else:
        notes.append("no _token_to_req_indices_cache field")
    num_computed_stale = False
    if hasattr(cls, "compute_num_computed_tokens"):
        cm = _probe_metadata(cls)
        cm.compute_num_computed_tokens()
        _to_draft_layout(cm)
        got = cm.compute_num_computed_tokens()
        num_computed_stale = got.tolist() != [9, 9, 9]
        notes.append(f"draft-step num_computed_tokens {got.tolist()} (want [9, 9, 9])")
    return ProbeResult(token_map_stale, num_computed_stale, "; ".join(notes))


def is_installed(cls: type) -> bool:
    """True if this fix is currently installed on ``cls``."""
    return all(
        getattr(getattr(cls, name, None), _MARK_ATTR, None) == FIX_NAME for name in _FIXED_METHODS
    )


def install(cls: type) -> bool:
    """Install the fixed methods on ``cls``; returns False if they already were."""
    if is_installed(cls):
        return False
    for name, func in _FIXED_METHODS.items():
        current = cls.__dict__.get(name)
        if getattr(current, _MARK_ATTR, None) != FIX_NAME:
            _ORIGINALS[name] = current
        setattr(cls, name, func)
    return True


def uninstall(cls: type) -> bool:
    """Restore the methods saved by :func:`install`; returns False if nothing was installed."""
    if not _ORIGINALS:
        return False
    for name, func in _ORIGINALS.items():
        setattr(cls, name, func)
    _ORIGINALS.clear()
    return True
