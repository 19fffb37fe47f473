"""Which cached text shares the longest prefix with a new one: the index of :class:`~.cache.PrefixTokenCache`.

A text is cut into chunks of ``chunk`` characters. Its first ``k`` chunks have two keys:

- a *probe key*: the hash of a sample of those chunks, 8 characters per chunk at a fixed stride (one strided
  slice of the text gives every sample); cheap to compute for a new text of any length;
- a *content key*: a chained hash of the chunks' full text. A cached text that extends (or shares a prefix
  with) another one inherits that one's keys up to the shared prefix and hashes only its own new chunks.

Each key maps to the entries that have it. Both kinds are prefix-closed (an entry holding the key of ``k``
chunks holds those of all shorter prefixes), so the deepest key a new text shares with any entry is found by
a binary search of O(log chunks) dict probes, whatever the number of entries. Keys only propose: the chosen
entry's text is compared with the new text. Texts that agree on every sample but differ between samples
(same-length edits inside a template) make the probe key propose a wrong entry; then the lookup falls back
to the content keys, which costs hashing the new text once (the only path that reads all of it but memcmp).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

SAMPLES_PER_CHUNK = 8


class Entry:
    """One cached text and its ids. Immutable after construction (shared with readers outside the lock).

    The ids are ``head + rest``: ``head`` is shared between the entries of one conversation (never mutated),
    ``rest`` is short, so the result list of a request is built by one ``head + rest`` concatenation.
    ``cuts`` are exact restart points packed as ``pos << 40 | token_index << 8 | width`` (sorted by ``pos``).
    ``ints`` holds the int objects the heads of one conversation's entries share (one per id value).
    """

    __slots__ = ("text", "head", "rest", "cuts", "probe", "content", "uid", "ints")

    def __init__(self, text: str, head: list[int], rest: list[int], cuts: list[int], probe: list[int],
                 content: list[int], uid: int, ints: dict[int, int] | None = None) -> None:
        self.text = text
        self.head = head
        self.rest = rest
        self.cuts = cuts
        self.probe = probe
        self.content = content
        self.uid = uid
        self.ints = ints if ints is not None else {}

    @property
    def n_ids(self) -> int:
        return len(self.head) + len(self.rest)

    def ids(self) -> list[int]:
        """A new list of all ids."""
        return self.head + self.rest


@dataclass(frozen=True)
class Match:
    """The result of a lookup: the entry (``None``: nothing shared), the common prefix length in characters,
    and the new text's keys for its first ``common // chunk`` chunks (inherited from the entry)."""

    entry: Entry | None
    common: int
    probe: list[int]
    content: list[int]
    probes: int  # dict probes spent (flat in the number of entries)
    fell_back: bool  # the probe key proposed a wrong entry; the content keys decided
    samples: str  # the new text's samples (its probe keys are hashes of their prefixes)


class PrefixIndex:
    """Entries (LRU) and the two key indexes. Thread-safe; text comparisons run outside the lock."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._stride = chunk // SAMPLES_PER_CHUNK if chunk % SAMPLES_PER_CHUNK == 0 else 1
        self._per_chunk = chunk // self._stride
        self._lock = threading.Lock()
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self._by_probe: dict[int, dict[int, None]] = {}
        self._by_content: dict[int, dict[int, None]] = {}
        self.chars = 0
        self._uid = 0

    # ------------------------------------------------------------------ keys
    def _samples(self, text: str) -> str:
        return text[self._stride - 1 :: self._stride]

    def probe_keys(self, samples: str, start: int, stop: int) -> list[int]:
        """Probe keys of the first ``start+1 .. stop`` chunks (``samples`` from :meth:`_samples`)."""
        n = self._per_chunk
        return [hash(samples[: k * n]) for k in range(start + 1, stop + 1)]

    def content_keys(self, text: str, start: int, stop: int, prev: int) -> list[int]:
        """Content keys of the first ``start+1 .. stop`` chunks, chained from ``prev`` (the key of ``start``)."""
        c = self.chunk
        out: list[int] = []
        h = prev
        for k in range(start, stop):
            h = hash((h, text[k * c : k * c + c]))
            out.append(h)
        return out

    def keys_for(self, text: str, match: Match) -> tuple[list[int], list[int]]:
        """All keys of ``text``: the inherited ones of ``match`` plus its own chunks after them."""
        have = len(match.probe)
        total = len(text) // self.chunk
        probe = match.probe + self.probe_keys(match.samples, have, total)
        content = match.content + self.content_keys(text, have, total, match.content[-1] if have else 0)
        return probe, content

    # ------------------------------------------------------------------ lookup
    def find(self, text: str) -> Match:
        """The most recently used entry sharing the longest prefix with ``text`` (within one chunk)."""
        c = self.chunk
        total = len(text) // c
        samples = self._samples(text)
        n = self._per_chunk
        probes = 0
        key = 0
        with self._lock:
            index = self._by_probe
            lo, hi = 0, total
            # Deepest k whose probe key is indexed (prefix-closed: monotone in k). A follow-up request usually
            # extends a cached text by less than a chunk or two: try the top first, then bisect.
            for top in (hi, hi - 1):
                if top <= lo:
                    break
                probes += 1
                h = hash(samples[: top * n])
                if h in index:
                    lo, key = top, h
                    break
                hi = top - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                probes += 1
                h = hash(samples[: mid * n])
                if h in index:
                    lo, key = mid, h
                else:
                    hi = mid - 1
            entry = self.entries[next(reversed(index[key]))] if lo else None
        if entry is None:
            return Match(None, 0, [], [], probes, False, samples)
        common = _common_prefix(text, entry.text, lo * c, c)
        if common >= 0:
            return self._match(entry, common, probes, False, samples)
        # the samples agreed, the text did not: decide by content keys (hashes all of the new text once)
        keys = self.content_keys(text, 0, total, 0)
        with self._lock:
            index = self._by_content
            lo, hi = 0, total
            while lo < hi:
                mid = (lo + hi + 1) // 2
                probes += 1
                if keys[mid - 1] in index:
                    lo = mid
                else:
                    hi = mid - 1
            entry = self.entries[next(reversed(index[keys[lo - 1]]))] if lo else None
        common = _common_prefix(text, entry.text, lo * c, c) if entry is not None else -1
        if entry is None or common < 0:  # nothing shared, or a 64-bit hash collision
            return Match(None, 0, [], [], probes, True, samples)
        return self._match(entry, common, probes, True, samples)

    def _match(self, entry: Entry, common: int, probes: int, fell_back: bool, samples: str) -> Match:
        with self._lock:
            if self.entries.get(entry.uid) is entry:
                self.entries.move_to_end(entry.uid)
        m = common // self.chunk
        return Match(entry, common, entry.probe[:m], entry.content[:m], probes, fell_back, samples)

    # ------------------------------------------------------------------ updates
    def insert(self, text: str, head: list[int], rest: list[int], cuts: list[int], probe: list[int],
               content: list[int], replace: Entry | None, max_entries: int, max_chars: int,
               ints: dict[int, int] | None = None) -> Entry:
        """Add an entry; with ``replace`` (an entry whose text ``text`` extends) take its place and its keys."""
        with self._lock:
            if replace is not None and self.entries.get(replace.uid) is replace:
                uid, have = replace.uid, len(replace.probe)
                self.chars -= len(replace.text)
            else:
                self._uid += 1
                uid, have = self._uid, 0
            entry = Entry(text, head, rest, cuts, probe, content, uid, ints)
            self.entries[uid] = entry
            self.entries.move_to_end(uid)
            self.chars += len(text)
            for h in probe[have:]:
                self._by_probe.setdefault(h, {})[uid] = None
            for h in content[have:]:
                self._by_content.setdefault(h, {})[uid] = None
            while len(self.entries) > max_entries or self.chars > max_chars:
                self._remove(next(iter(self.entries.values())))
        return entry

    def _remove(self, entry: Entry) -> None:
        del self.entries[entry.uid]
        self.chars -= len(entry.text)
        for index, keys in ((self._by_probe, entry.probe), (self._by_content, entry.content)):
            for h in keys:
                owners = index.get(h)
                if owners is not None:
                    owners.pop(entry.uid, None)
                    if not owners:
                        del index[h]

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self._by_probe.clear()
            self._by_content.clear()
            self.chars = 0

    def __len__(self) -> int:
        return len(self.entries)


def _common_prefix(text: str, old: str, known: int, chunk: int) -> int:
    """Length of the common prefix of ``text`` and ``old`` given that it is proposed to be at least ``known``
    and (no deeper key matched) less than ``known + chunk``; -1 when the first ``known`` characters differ."""
    if len(old) <= len(text) and text.startswith(old):
        return len(old)
    if known and not text.startswith(old[:known]):
        return -1
    lo = known
    hi = min(len(text), len(old), known + chunk)
    while lo < hi:  # invariant: text[:lo] == old[:lo]
        mid = (lo + hi + 1) // 2
        if text[lo:mid] == old[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
