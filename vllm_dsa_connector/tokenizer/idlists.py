"""Lists of token ids in :class:`~.cache.PrefixTokenCache`: shared int objects, and anchors placed from ids alone."""

from __future__ import annotations


def interned(ids: list[int], ints: dict[int, int], fresh: bool = True) -> list[int]:
    """A list equal to ``ids`` whose items are the objects of ``ints``, one per id value (added as needed).

    An encoding gives every id its own int object, so a 128k-token head would point at 128k objects (4 MB)
    that building each result (one reference count per item) reads and writes. The entries of one
    conversation share one ``ints``: their heads point at its few thousand objects instead, so a result
    touches a few hundred KB. With ``fresh`` (a whole prompt) the new ids get new objects made one after the
    other in the order the text first uses them (``i + 0``), close together in memory and read in nearly
    that order; without it (ids added to a head, mostly known already) a new id keeps the object it has."""
    if not fresh:
        return list(map(ints.setdefault, ids, ids))  # atomic: threads that race keep the first object stored
    for i in [i for i in dict.fromkeys(ids) if i not in ints]:
        ints.setdefault(i, i + 0)
    return list(map(ints.__getitem__, ids))


def pair_anchors(found: list[tuple[int, str]], ids: list[int],
                 anchor_of: dict[str, int]) -> list[tuple[int, int, int]] | None:
    """(pos, width, token index) of each anchor match in ``found`` (ascending): the k-th occurrence of an
    anchor is its k-th id in ``ids`` (analysis, counted anchors). None when the counts or the order disagree."""
    where: dict[str, list[int]] = {}
    for _, a in found:
        where.setdefault(a, [])
    for a, idx in where.items():
        aid, i = anchor_of[a], -1
        try:
            while True:
                i = ids.index(aid, i + 1)
                idx.append(i)
        except ValueError:
            pass
    seen = dict.fromkeys(where, 0)
    out: list[tuple[int, int, int]] = []
    last = -1
    for p, a in found:
        n = seen[a]
        idx = where[a]
        if n >= len(idx) or idx[n] <= last:
            return None
        last = idx[n]
        seen[a] = n + 1
        out.append((p, len(a), last))
    if any(len(where[a]) != n for a, n in seen.items()):
        return None
    return out


__all__ = ["interned", "pair_anchors"]
