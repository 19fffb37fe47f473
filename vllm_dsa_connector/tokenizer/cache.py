"""PrefixTokenCache: re-tokenize only the new tail of a prompt that shares a prefix with an earlier one.

Exactness: a cached prompt keeps, besides its ids, a sparse list of *cuts* (char position, token index) proved
exact by :mod:`.analysis` (added-token anchors and line starts). For a new text the cache finds the cached text
with the longest common prefix ``L``, takes the last cut ``p`` whose deciding characters lie inside the common
prefix (``p + width <= L``), and returns ``cached_ids[:k] + encode(text[p:])``. Both texts agree on every
character the proof looks at, so the cut is exact in both; no cut, no reuse (full encode). A new text that
extends the cached one with an anchor (a prompt that ended inside a turn, then the turn's end) is cut where
the cached text ends: the cached ids are those of exactly the text left of that anchor
(:attr:`~.analysis.CutRules.closing`). Each cut recorded from a fresh encode is also checked against that
encode's offsets (a failed check only drops the cut).

Lookup (:mod:`.prefix_index`): O(log chunks) dict probes on sampled prefix keys, whatever the number of
entries; the winner is verified by string comparison (keys only propose).

Cost of a hit, besides encoding ``text[p:]`` (``p`` is usually the last anchor before the new text): one
strided slice and a few short hashes for the lookup, one memcmp of the shared prefix, and one list copy for
the result: an entry's ids are a shared ``head`` plus a short ``rest``, so the result is ``head + rest``
(the head is rebuilt only when ``rest`` grows past a sixteenth of it). Cuts of the new tail are located
through the tail encoding's offsets for the few candidates kept, not by converting all of them. A tail whose
last cut is an anchor (a chat prompt ending in its generation prompt) is encoded without offsets
(``encode_batch_fast``) when the analysis proves anchor ids countable: the k-th occurrence of an anchor is its
k-th id (:func:`~.idlists.pair_anchors`, counts and order checked); only line cuts between that tail's anchors
go unrecorded. An entry's head holds one int object per id value, shared by the conversation's entries
(:func:`~.idlists.interned`): a result's reference counts touch a few thousand objects, not one per token.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from tokenizers import Tokenizer
from vllm.logger import init_logger

from vllm_dsa_connector.tokenizer.analysis import LINE_CUT_RE, CutRules, analyze, last_line_cut
from vllm_dsa_connector.tokenizer.idlists import interned, pair_anchors
from vllm_dsa_connector.tokenizer.options import CacheOptions
from vllm_dsa_connector.tokenizer.prefix_index import Match, PrefixIndex

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

_REST_MIN = 4096  # an entry's ``rest`` is folded into its ``head`` beyond max(this, len(head) / 16) ids
_REST_KEEP = 1024  # ids kept in ``rest`` when folding (the next cut is usually among the last ones)
_POS = 40  # a packed cut: pos << 40 | token index << 8 | width
_LOW = (1 << _POS) - 1
_MAX_WIDTH = 255
_OFFSETS_FROM = 2048  # tokens from which an encoding's offsets are converted at once instead of per cut
_FAST_MAX_CHARS = 16384  # longer tails keep their line cuts (encoded with offsets)

_HAS_FAST = hasattr(Tokenizer, "encode_batch_fast")

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
             "reused_tokens", "tail_tokens", "lookup_probes", "probe_fallbacks", "fast_tails", "fast_rejects"), 0)
        self._disabled_reason = ""
        self._last_log = time.monotonic()
        self._load()

    # ------------------------------------------------------------------ set-up
    def _load(self) -> None:
        self._generation = getattr(self, "_generation", 0) + 1  # entries computed before a reload are dropped
        self._fp = _fingerprint(self.tokenizer)
        self._backend: Any = None  # private Rust tokenizer, made on first encode
        _, rules = _shared_state(self.tokenizer, need_clone=False)
        anchors = {a: i for a, i in rules.anchors.items() if len(a) <= _MAX_WIDTH} if self.options.anchors else {}
        self.rules = CutRules(anchors=anchors, line_cuts=rules.line_cuts and self.options.line_cuts,
                              usable=rules.usable, reasons=rules.reasons, counted=rules.counted,
                              closing=rules.closing and bool(anchors))
        # all anchors in one alternation, longest first (a match only proposes: each is checked per encoding)
        self._anchor_re = re.compile("|".join(re.escape(a) for a in sorted(anchors, key=len, reverse=True))
                                     ) if anchors else None
        self._index = PrefixIndex(self.options.chunk_chars)
        # tails of hits may be encoded without offsets (``encode_batch_fast``, tokenizers >= 0.21)
        self._counted = self.rules.counted and self._anchor_re is not None and _HAS_FAST
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
            self._count(bypassed=1)
            return self._encoder().encode(text, add_special_tokens=False).ids
        return self._encode_cached(text)

    def stats(self) -> dict[str, Any]:
        """Counters: hits, misses, fallbacks (a shared prefix without a usable cut), bypassed (short text or
        cache off), entries, chars, reused/tail tokens, verified, mismatches, cut_rejects, lookup_probes (index
        dict probes, flat in the number of entries), probe_fallbacks (lookups decided by content keys),
        fast_tails (hit tails encoded without offsets), fast_rejects (anchor counts that disagreed: never
        expected; the tail is then re-encoded with offsets), enabled."""
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
        out["entries"] = len(self._index)
        out["chars"] = self._index.chars
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
        self._index.clear()

    def lookup(self, text: str) -> Match:
        """The index lookup alone (what :meth:`encode` does before tokenizing; for benchmarks)."""
        return self._index.find(text)

    # ------------------------------------------------------------------ internals
    def _count(self, **counts: int) -> int:
        with self._lock:
            for key, n in counts.items():
                self._stats[key] += n
            return self._stats["hits"]

    def _encode_cached(self, text: str) -> list[int]:
        generation = self._generation
        backend = self._encoder()
        match = self._index.find(text)
        entry, common = match.entry, match.common
        looked = {"lookup_probes": match.probes, "probe_fallbacks": int(match.fell_back)}
        if entry is None:
            return self._encode_whole(text, backend, match, generation, misses=1, **looked)
        if common == len(text) == len(entry.text):
            self._count(hits=1, reused_tokens=entry.n_ids, **looked)
            return entry.ids()
        cuts = entry.cuts
        at_end = None
        if common == len(entry.text) and self.rules.closing and self._anchor_re is not None:
            at_end = self._anchor_re.match(text, common)
        if at_end is not None:  # an anchor starts where the cached text ends: cut there (all its ids kept)
            j, p, k = len(cuts) - 1, common, entry.n_ids
            first = [(p << _POS) | (k << 8) | len(at_end.group())]
        else:  # the last cut whose deciding characters lie in the common prefix
            j = bisect_right(cuts, ((common - 1) << _POS) | _LOW) - 1
            while j >= 0 and (cuts[j] >> _POS) + (cuts[j] & 0xFF) > common:
                j -= 1
            if j < 0:
                return self._encode_whole(text, backend, match, generation, fallbacks=1, **looked)
            p, k = cuts[j] >> _POS, (cuts[j] & _LOW) >> 8
            first = []
        tail_text = text[p:]
        located = None
        found = self._fast_plan(tail_text, closing=at_end is not None)
        if found is not None:  # ids only; anchor cuts paired by occurrence
            tail = backend.encode_batch_fast([tail_text], add_special_tokens=False)[0].ids
            located = pair_anchors(found, tail, self.rules.anchors)
            if located is None:  # cannot happen (analysis: counted anchors); kept as a check
                self._count(fast_rejects=1)
        if located is None:
            enc = backend.encode(tail_text, add_special_tokens=False)
            tail = enc.ids
        head = entry.head
        if k > len(head):
            rest = entry.rest[: k - len(head)]
            rest += tail
        elif k == len(head):
            rest = tail
        else:  # the cut lies in the shared head (a rewritten turn, a branch): one more copy
            head, rest = head[:k], tail
        if len(rest) > max(_REST_MIN, len(head) >> 4):  # fold rest into a new head, keeping its last ids
            keep = min(_REST_KEEP, len(rest))
            folded = interned(rest[: len(rest) - keep], entry.ints, fresh=False)
            head, rest = head + folded, rest[len(rest) - keep :]
        out = head + rest
        if located is None:
            new_cuts = cuts[: j + 1] + first + self._cuts_of(tail_text, enc, tail, p, k)
        else:
            new_cuts = cuts[: j + 1] + first + self._keep(tail_text, located, None, p, k)
        if len(text) <= self.options.max_chars and generation == self._generation:
            probe, content = self._index.keys_for(text, match)
            replace = entry if common == len(entry.text) else None
            self._index.insert(text, head, rest, new_cuts, probe, content, replace, self.options.max_entries,
                               self.options.max_chars, entry.ints)
        n_hits = self._count(hits=1, reused_tokens=k, tail_tokens=len(tail), fast_tails=int(located is not None),
                             **looked)
        every = self.options.verify_every
        if every and n_hits % every == 0:
            self._verify(text, out)
        return out

    def _encode_whole(self, text: str, backend: Any, match: Match, generation: int, **counts: int) -> list[int]:
        """Full encode of ``text``, cached as a new entry (keeps the keys it shares with ``match``)."""
        enc = backend.encode(text, add_special_tokens=False)
        ints: dict[int, int] = {}
        ids = interned(enc.ids, ints)
        if len(text) <= self.options.max_chars and generation == self._generation:
            cuts = self._cuts_of(text, enc, ids, 0, 0)
            probe, content = self._index.keys_for(text, match)
            self._index.insert(text, ids, [], cuts, probe, content, None, self.options.max_entries,
                               self.options.max_chars, ints)
        self._count(**counts)
        return ids[:]

    def _cuts_of(self, text: str, enc: Any, ids: list[int], offset: int, base_tok: int) -> list[int]:
        """Exact cuts in a freshly encoded ``text`` (positions shifted by ``offset``, token indexes by
        ``base_tok``), packed (see :meth:`_keep`). Anchor matches and line starts are located and checked
        through the encoding's offsets: a token starts there and the one before ends by then."""
        offsets = enc.offsets if len(ids) >= _OFFSETS_FROM else None

        def token_at(p: int) -> int:  # the token starting at ``p`` after one that ends by ``p`` (-1: none)
            if offsets is not None:
                i = bisect_left(offsets, (p, -1))
                ok = 0 < i < len(offsets) and offsets[i][0] == p and offsets[i - 1][1] <= p
            else:
                j = enc.char_to_token(p)
                i = -1 if j is None else j
                ok = i > 0 and enc.token_to_chars(i)[0] == p and enc.token_to_chars(i - 1)[1] <= p
            return i if ok else -1

        anchors: list[tuple[int, int, int]] = []  # (pos, width, token index), checked
        if self._anchor_re is not None:  # one scan of the text; each match checked against the encoding
            anchor_of = self.rules.anchors
            for m in self._anchor_re.finditer(text):
                a, p = m.group(), m.start()
                i = token_at(p)
                if i > 0 and ids[i] == anchor_of[a]:  # i == 0 is where this text starts: not a new cut
                    anchors.append((p, len(a), i))  # in ascending positions
        return self._keep(text, anchors, token_at if self.rules.line_cuts else None, offset, base_tok)

    def _keep(self, text: str, anchors: list[tuple[int, int, int]], token_at: Callable[[int], int] | None,
              offset: int, base_tok: int) -> list[int]:
        """The cuts kept among ``anchors`` ((pos, width, token index), ascending) and, with ``token_at``, line
        starts: the last one, then one per ``cut_spacing`` chars going left (at one position a line cut goes
        before an anchor: it needs fewer shared characters). Line starts are searched backwards from the end,
        only as far as the kept cuts reach. Without ``token_at`` (a tail encoded without offsets) an anchor
        that starts a line is still recorded as that line cut (same position and token)."""
        out: list[int] = []
        rejects = 0
        spacing = self.options.cut_spacing
        bound = len(text)  # the next cut kept lies at or before this position
        ai = len(anchors) - 1
        line = last_line_cut(text, bound) if token_at is not None else -1
        starts = self.rules.line_cuts and token_at is None
        while True:
            while ai >= 0 and anchors[ai][0] > bound:
                ai -= 1
            if line > bound:
                line = last_line_cut(text, bound)
            at = anchors[ai][0] if ai >= 0 else -1
            if line < 0 and at < 0:
                break
            if token_at is not None and line >= at:  # a line cut (width 1)
                p = line
                i = token_at(p)
                if i < 0:
                    rejects += 1
                    line = last_line_cut(text, p - 1)  # an anchor at ``p`` stays a candidate
                    continue
                w = 1
            else:
                p, w, i = anchors[ai]
                if i == 0:  # where this text starts: not a new cut
                    break
                if starts and p and text[p - 1] == "\n" and "!" <= text[p] <= "~":
                    w = 1
            out.append(((p + offset) << _POS) | ((i + base_tok) << 8) | w)
            bound = p - spacing
        if rejects:
            self._count(cut_rejects=rejects)
        out.reverse()
        return out

    def _fast_plan(self, text: str, closing: bool) -> list[tuple[int, str]] | None:
        """The anchor matches of a tail ``text`` when its ids alone are enough to place its cuts, else None.

        That takes counted anchors (:attr:`CutRules.counted`), a tail of at most ``_FAST_MAX_CHARS`` and no
        line cut after its last anchor: then the last cut, the one the next extending request uses, is the
        same as with offsets, and only line cuts between the tail's anchors are not recorded (a later request
        that diverges inside one re-encodes from the anchor before, at most this tail). With ``closing`` (this
        request closed the cached prompt with an anchor: its client sends prompts that end inside a turn) a
        line cut after the last anchor is not needed either: the next request most likely closes this text
        too, which cuts where it ends; one that extends the open turn instead re-encodes from the tail's last
        anchor, and its own tail keeps its line cuts."""
        if not self._counted or len(text) > _FAST_MAX_CHARS:
            return None
        found = [(m.start(), m.group()) for m in self._anchor_re.finditer(text)]  # type: ignore[union-attr]
        if not found or found[-1][0] == 0:
            return None
        if not closing and self.rules.line_cuts and LINE_CUT_RE.search(text, found[-1][0]) is not None:
            return None
        return found

    def _verify(self, text: str, got: list[int]) -> None:
        full = self._encoder().encode(text, add_special_tokens=False).ids
        self._count(verified=1)
        if full != got:
            self._count(mismatches=1)
            self._disabled_reason = "a cached result differed from a full encode"
            self.clear()
            logger.error("prefix token cache: cached ids differ from a full encode (%d chars); cache disabled",
                         len(text))
            got[:] = full


__all__ = ["PrefixTokenCache", "CacheOptions"]
