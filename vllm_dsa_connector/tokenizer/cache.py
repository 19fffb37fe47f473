"""PrefixTokenCache: re-tokenize only the new tail of a prompt that shares a prefix with an earlier one.

Exactness: a cached prompt keeps, besides its ids, a sparse list of *cuts* (char position, token index) proved
exact by :mod:`.analysis` (added-token anchors and line starts). For a new text the cache finds the cached text
with the longest common prefix ``L``, takes the last cut ``p`` whose deciding characters lie inside the common
prefix (``p + width <= L``), and returns ``cached_ids[:k] + encode(text[p:])``. Both texts agree on every
character the proof looks at, so the cut is exact in both; no cut, no reuse (full encode). Each cut recorded
from a fresh encode is also checked against that encode's offsets (a failed check only drops the cut).

Lookup: texts are hashed in chained fixed-size chunks; a dict maps each chunk-prefix hash to the entries that
have it, so finding the longest shared prefix costs one pass over the new text, independent of the number of
entries. The winner is verified by string comparison (hashes only propose).
"""

from __future__ import annotations

import copy
import threading
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from vllm.logger import init_logger

from .analysis import LINE_CUT_RE, CutRules, analyze
from .options import CacheOptions

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

_MAX_BLOCKS = 48  # compact an entry's id blocks into one list beyond this many

_CLONE_LOCK = threading.Lock()
_CLONES: OrderedDict[tuple[Any, ...], tuple[Any, Any, CutRules]] = OrderedDict()


def _fingerprint(tokenizer: Any) -> tuple[Any, ...]:
    """What must not change under a cache: the added vocabulary and the special-token splitting flag."""
    backend = tokenizer.backend_tokenizer
    return (
        id(backend),
        backend.get_vocab_size(with_added_tokens=True),
        bool(getattr(tokenizer, "split_special_tokens", False)),
    )


def _shared_state(tokenizer: Any, need_clone: bool) -> tuple[Any, CutRules]:
    """The cut rules of the tokenizer's pipeline and, when asked, a private copy of its Rust tokenizer.

    transformers mutates its backend on every call (truncation, padding, special-token splitting), so the
    cache encodes with a copy that nobody mutates (safe to share between threads). The copy is made on first
    use (processes that never encode a prompt, like vLLM's engine core, never pay for it) and shared between
    caches of the same tokenizer state.
    """
    backend = tokenizer.backend_tokenizer
    key = _fingerprint(tokenizer)
    with _CLONE_LOCK:
        hit = _CLONES.get(key)
        if hit is not None and hit[0] is backend and (hit[1] is not None or not need_clone):
            _CLONES.move_to_end(key)
            return hit[1], hit[2]
    rules = hit[2] if hit is not None and hit[0] is backend else analyze(backend, encode_special_tokens=key[2])
    clone = None
    if need_clone:
        clone = copy.deepcopy(backend)
        clone.no_truncation()
        clone.no_padding()
        clone.encode_special_tokens = key[2]
    with _CLONE_LOCK:
        _CLONES[key] = (backend, clone, rules)  # holds the backend so its id cannot be reused
        _CLONES.move_to_end(key)
        while len(_CLONES) > 8:
            _CLONES.popitem(last=False)
    return clone, rules


class _Entry:
    """One cached text. Immutable after construction (shared with readers outside the lock)."""

    __slots__ = ("text", "blocks", "ends", "n_ids", "cut_pos", "cut_tok", "cut_w", "hashes", "uid")

    def __init__(self, text: str, blocks: tuple[list[int], ...], cuts: tuple[list[int], list[int], list[int]],
                 hashes: list[int], uid: int) -> None:
        if len(blocks) > _MAX_BLOCKS:
            merged: list[int] = []
            for b in blocks:
                merged.extend(b)
            blocks = (merged,)
        self.text = text
        self.blocks = blocks
        ends: list[int] = []
        total = 0
        for b in blocks:
            total += len(b)
            ends.append(total)
        self.ends = ends
        self.n_ids = total
        self.cut_pos, self.cut_tok, self.cut_w = cuts
        self.hashes = hashes
        self.uid = uid

    def prefix_blocks(self, k: int) -> tuple[list[int], ...]:
        """The first ``k`` ids as blocks (shares every whole block; copies at most one)."""
        if k >= self.n_ids:
            return self.blocks
        b = bisect_right(self.ends, k)
        start = self.ends[b - 1] if b else 0
        head = self.blocks[:b]
        return head + (self.blocks[b][: k - start],) if k > start else head

    def ids(self) -> list[int]:
        out: list[int] = []
        for b in self.blocks:
            out.extend(b)
        return out


class PrefixTokenCache:
    """Exact prefix-reusing tokenization for a transformers fast tokenizer.

    ``cache.encode(text)`` returns exactly ``tokenizer(text, add_special_tokens=False)["input_ids"]`` (a new
    list each call). Thread-safe: a lock guards only the index and the LRU; tokenization runs outside it.
    Options (see :class:`CacheOptions`): ``max_entries``, ``max_chars``, ``min_chars``, ``chunk_chars``,
    ``cut_spacing``, ``anchors``, ``line_cuts``, ``verify_every``, ``log_interval_s``; a bad value raises
    ``ValueError`` naming it.
    """

    def __init__(self, tokenizer: Any, *, environ: Mapping[str, str] | None = None, **options: Any) -> None:
        self.options = CacheOptions.resolve(options, environ if environ is not None else {})
        if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
            raise ValueError(f"PrefixTokenCache needs a transformers fast tokenizer, got {type(tokenizer)!r}")
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(
            ("hits", "misses", "fallbacks", "bypassed", "verified", "mismatches", "cut_rejects",
             "reused_tokens", "tail_tokens"), 0)
        self._disabled_reason = ""
        self._uid = 0
        self._last_log = time.monotonic()
        self._load()

    # ------------------------------------------------------------------ set-up
    def _load(self) -> None:
        self._generation = getattr(self, "_generation", 0) + 1  # entries computed before a reload are dropped
        self._fp = _fingerprint(self.tokenizer)
        self._backend: Any = None  # private Rust tokenizer, made on first encode
        _, rules = _shared_state(self.tokenizer, need_clone=False)
        anchors = rules.anchors if self.options.anchors else {}
        self.rules = CutRules(anchors=anchors, line_cuts=rules.line_cuts and self.options.line_cuts,
                              usable=rules.usable, reasons=rules.reasons)
        self._anchor_of_id = {i: c for c, i in anchors.items()}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[int, dict[int, None]] = {}
        self._chars = 0
        if not rules.usable:
            logger.warning("prefix token cache off for this tokenizer: %s", "; ".join(rules.reasons))

    def _encoder(self) -> Any:
        backend = self._backend
        if backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend, _ = _shared_state(self.tokenizer, need_clone=True)
                backend = self._backend
        return backend

    def __copy__(self) -> PrefixTokenCache:  # tokenizer copies share one cache
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> PrefixTokenCache:
        return self

    # ------------------------------------------------------------------ public
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens, identical to a full encode."""
        if not isinstance(text, str):
            raise TypeError(f"PrefixTokenCache.encode takes a str, got {type(text).__name__}")
        if _fingerprint(self.tokenizer) != self._fp:
            with self._lock:
                if _fingerprint(self.tokenizer) != self._fp:
                    logger.info("tokenizer vocabulary changed: prefix token cache rebuilt")
                    self._load()
        if (self._disabled_reason or not self.rules.usable or len(text) < self.options.min_chars
                or not (self.rules.anchors or self.rules.line_cuts)):
            self._count("bypassed")
            return self._encoder().encode(text, add_special_tokens=False).ids
        return self._encode_cached(text)

    def stats(self) -> dict[str, Any]:
        """Counters: hits, misses, fallbacks (a shared prefix without a usable cut), bypassed (short text or
        cache off), entries, chars, reused/tail tokens, verified, mismatches, cut_rejects, enabled."""
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
            out["entries"] = len(self._entries)
            out["chars"] = self._chars
        out["enabled"] = not self._disabled_reason and self.rules.usable
        out["anchors"] = len(self.rules.anchors)
        out["line_cuts"] = self.rules.line_cuts
        if self._disabled_reason:
            out["disabled_reason"] = self._disabled_reason
        return out

    def log_if_due(self) -> None:
        """Log one stats line if ``log_interval_s`` passed since the last one (0: never)."""
        interval = self.options.log_interval_s
        now = time.monotonic()
        if not interval or now - self._last_log < interval:
            return
        with self._lock:
            if now - self._last_log < interval:
                return
            self._last_log = now
        s = self.stats()
        logger.info(
            "DSA prefix token cache: hits=%d misses=%d fallbacks=%d bypassed=%d entries=%d chars=%d "
            "reused_tokens=%d tail_tokens=%d verified=%d mismatches=%d enabled=%s",
            s["hits"], s["misses"], s["fallbacks"], s["bypassed"], s["entries"], s["chars"],
            s["reused_tokens"], s["tail_tokens"], s["verified"], s["mismatches"], s["enabled"],
        )

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self._chars = 0

    # ------------------------------------------------------------------ internals
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _chain(self, text: str) -> list[int]:
        c = self.options.chunk_chars
        out: list[int] = []
        h = 0
        for start in range(0, len(text) - c + 1, c):
            h = hash((h, text[start : start + c]))
            out.append(h)
        return out

    def _lookup(self, chain: list[int]) -> tuple[_Entry | None, int]:
        """The most recent entry sharing the most leading chunks, and how many (under the lock)."""
        # An entry that has chunk hash k has all hashes before it, so "chunk k is indexed" is monotone in k:
        # binary search for the deepest indexed chunk (O(log chunks) probes; a collision only proposes an
        # entry, which the caller verifies by comparing text).
        index = self._index
        lo, hi = 0, len(chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in index:
                lo = mid
            else:
                hi = mid - 1
        depth = lo
        best = self._entries[next(reversed(index[chain[depth - 1]]))] if depth else None
        if best is not None:
            self._entries.move_to_end(best.uid)
        return best, depth

    def _common_prefix(self, text: str, entry: _Entry, depth: int) -> int:
        old = entry.text
        if len(old) <= len(text) and text.startswith(old):
            return len(old)
        c = self.options.chunk_chars
        lo = depth * c
        if not text.startswith(old[:lo]):
            return 0  # a hash collision: treat as no match
        hi = min(len(text), len(old), lo + c)
        while lo < hi:  # invariant: text[:lo] == old[:lo]
            mid = (lo + hi + 1) // 2
            if text[lo:mid] == old[lo:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _cuts_of(self, text: str, offset: int, enc: Any, base_tok: int) -> tuple[list[int], list[int], list[int]]:
        """Exact cuts found in a freshly encoded ``text`` (positions shifted by ``offset``), thinned."""
        ids = enc.ids
        offsets = enc.offsets
        cands: list[tuple[int, int, int]] = []  # (pos, token index, width)
        if self._anchor_of_id:
            anchor_of = self._anchor_of_id
            for i, t in enumerate(ids):
                a = anchor_of.get(t)
                if a is None:
                    continue
                s = offsets[i][0]
                if i and text.startswith(a, s) and offsets[i - 1][1] <= s:
                    cands.append((s, i, len(a)))
        if self.rules.line_cuts:
            for m in LINE_CUT_RE.finditer(text):
                p = m.end()
                i = bisect_left(offsets, (p, -1))
                if 0 < i < len(offsets) and offsets[i][0] == p and offsets[i - 1][1] <= p:
                    cands.append((p, i, 1))
                else:
                    self._count("cut_rejects")
            cands.sort()
        pos: list[int] = []
        tok: list[int] = []
        wid: list[int] = []
        last = None
        spacing = self.options.cut_spacing
        for p, i, w in reversed(cands):  # keep the last cut, then one per `spacing` chars going left
            if last is None or last - p >= spacing:
                pos.append(p + offset)
                tok.append(i + base_tok)
                wid.append(w)
                last = p
        pos.reverse()
        tok.reverse()
        wid.reverse()
        return pos, tok, wid

    def _encode_cached(self, text: str) -> list[int]:
        generation = self._generation
        backend = self._encoder()
        chain = self._chain(text)
        with self._lock:
            entry, depth = self._lookup(chain)
        if entry is None:
            enc = backend.encode(text, add_special_tokens=False)
            ids = enc.ids
            self._insert(text, (ids,), self._cuts_of(text, 0, enc, 0), chain, None, generation)
            self._count("misses")
            return list(ids)

        common = self._common_prefix(text, entry, depth)
        if common == len(text) == len(entry.text):
            self._count("hits")
            self._count("reused_tokens", entry.n_ids)
            return entry.ids()
        # The last cut whose deciding characters lie in the common prefix.
        j = bisect_right(entry.cut_pos, common - 1) - 1
        while j >= 0 and entry.cut_pos[j] + entry.cut_w[j] > common:
            j -= 1
        if j < 0:
            self._count("fallbacks")
            enc = backend.encode(text, add_special_tokens=False)
            self._insert(text, (enc.ids,), self._cuts_of(text, 0, enc, 0), chain, None, generation)
            return list(enc.ids)

        p, k = entry.cut_pos[j], entry.cut_tok[j]
        tail_text = text[p:]
        enc = backend.encode(tail_text, add_special_tokens=False)
        tail = enc.ids
        blocks = entry.prefix_blocks(k) + (tail,)
        t_pos, t_tok, t_wid = self._cuts_of(tail_text, p, enc, k)  # never includes p itself
        cuts = (entry.cut_pos[: j + 1] + t_pos, entry.cut_tok[: j + 1] + t_tok, entry.cut_w[: j + 1] + t_wid)
        replace = entry if common == len(entry.text) else None
        new = self._insert(text, blocks, cuts, chain, replace, generation)
        out = new.ids() if new is not None else _join(blocks)
        n_hits = 0
        with self._lock:
            self._stats["hits"] += 1
            self._stats["reused_tokens"] += k
            self._stats["tail_tokens"] += len(tail)
            n_hits = self._stats["hits"]
        every = self.options.verify_every
        if every and n_hits % every == 0:
            self._verify(text, out)
        return out

    def _verify(self, text: str, got: list[int]) -> None:
        full = self._encoder().encode(text, add_special_tokens=False).ids
        self._count("verified")
        if full != got:
            self._count("mismatches")
            self._disabled_reason = "a cached result differed from a full encode"
            self.clear()
            logger.error("prefix token cache: cached ids differ from a full encode (%d chars); cache disabled",
                         len(text))
            got[:] = full

    def _insert(self, text: str, blocks: tuple[list[int], ...], cuts: tuple[list[int], list[int], list[int]],
                chain: list[int], replace: _Entry | None, generation: int) -> _Entry | None:
        if len(text) > self.options.max_chars:
            return None
        with self._lock:
            if generation != self._generation:  # the tokenizer changed while this text was encoded
                return None
            self._uid += 1
            entry = _Entry(text, blocks, cuts, chain, self._uid)
            if replace is not None and replace.uid in self._entries:
                self._remove(replace)
            self._entries[entry.uid] = entry
            self._chars += len(text)
            for h in chain:
                self._index.setdefault(h, {})[entry.uid] = None
            while len(self._entries) > self.options.max_entries or self._chars > self.options.max_chars:
                _, victim = next(iter(self._entries.items()))
                self._remove(victim)
        return entry

    def _remove(self, entry: _Entry) -> None:
        """Drop ``entry`` (caller holds the lock)."""
        del self._entries[entry.uid]
        self._chars -= len(entry.text)
        for h in entry.hashes:
            owners = self._index.get(h)
            if owners is not None:
                owners.pop(entry.uid, None)
                if not owners:
                    del self._index[h]


def _join(blocks: tuple[list[int], ...]) -> list[int]:
    out: list[int] = []
    for b in blocks:
        out.extend(b)
    return out


__all__ = ["PrefixTokenCache", "CacheOptions"]
