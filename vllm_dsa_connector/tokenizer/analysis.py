"""Where a HF ``tokenizers`` pipeline can be cut so that tokenizing the two halves equals tokenizing the whole.

A *cut* at character ``p`` of a text ``T`` is exact when ``encode(T) == encode(T[:p]) + encode(T[p:])`` and the
ids left of ``p`` depend only on a known, short prefix of ``T``. The prefix cache restarts tokenization only at
such cuts. Two kinds are proved here; anything this module cannot prove is simply not a cut (the cache then
re-tokenizes more, or everything; it never guesses).

**Anchor cuts** (``p`` = start of an added-token occurrence ``A``). HF splits the raw text on non-normalized
added tokens (Aho-Corasick, leftmost-longest) *before* normalization and pre-tokenization, and every later stage
works on one split at a time. ``A`` is an anchor only if it is non-normalized, has no lstrip/rstrip/single_word,
does not start or end with whitespace, and overlaps no non-normalized added token (itself included): no proper
suffix of one is a prefix of the other and neither contains the other. Then every occurrence of ``A`` is a
match (no other match can overlap it, no longer pattern can start at it), matches left of ``p`` never look past
``p`` (they would have to overlap ``A``), rstrip of an earlier token stops at ``A``'s first, non-space,
character, and the scan after ``A`` equals a fresh scan of ``T[p:]``. The condition on the text is local:
``T[p:p+len(A)] == A`` and ``T[:p]`` (shared with the cached text).

**Counted anchors.** Each match of ``A`` becomes exactly one token, ``A``'s id, and no two added tokens share
an id. When the model cannot emit ``A``'s id either (``model.id_to_token(id) is None``: BPE emits only ids of
its vocabulary, its unknown token included), the tokens equal to ``A``'s id are exactly ``A``'s occurrences in
text order, so the k-th occurrence of ``A`` in ``T`` starts at the k-th ``A`` id of ``encode(T)``:
:attr:`CutRules.counted`, anchor cuts located from the ids alone (no offsets). Since anchors overlap neither
each other nor themselves, one left-to-right regex scan for all of them finds every occurrence.

**Closing anchors.** The text left of an anchor occurrence, encoded on its own, gives exactly the ids left of
that cut: ``encode(T[:p] + A + X) == encode(T[:p]) + encode(A + X)``. The splits left of ``p`` are the same in
both (no match overlaps ``A``; an rstrip stops at ``A``'s non-space first character as it stops at the end of
``T[:p]``) and each split is encoded on its own. The one check that reads the character after a match is
``single_word``'s (``A``'s first character against the end of ``T[:p]``), so this holds when no added token
has ``single_word``: :attr:`CutRules.closing`. A cached text that a new text extends with an anchor then gives
all its ids to the new text, whatever its last characters are.

**Line cuts** (``T[p-1] == "\\n"`` and ``T[p]`` printable ASCII ``!``..``~``), for pipelines built only from parts
proved below:

- normalizer: none, NFC, NFD, NFKC, NFKD (or a Sequence of them). ``\\n`` and ASCII characters are starters
  (ccc 0) that never combine with what precedes them, so ``N(T) = N(T[:p]) + N(T[p:])``; the normalized
  character at ``p-1`` is ``\\n`` and the one at ``p`` is not whitespace (ASCII, or ASCII composed with the
  marks that follow it).
- pre-tokenizer: Split stages (Isolated, not inverted) whose regex is in :data:`SEPARATING_PATTERNS` or
  :data:`LOCAL_PATTERNS`, then an optional final ``ByteLevel(add_prefix_space=False)``; or a lone
  ``ByteLevel(add_prefix_space=False, use_regex=True)`` (the GPT-2 regex, a separating pattern).
  *Separating*: every alternative that can consume ``\\n`` consumes only whitespace/newlines after it, so the
  piece holding ``p-1`` ends exactly at ``p``, and it is decided by ``T[:p]`` plus "``T[p]`` is not
  whitespace" (greedy stops and the ``(?!\\S)`` lookahead test nothing else); no pattern looks behind, so the
  scan from ``p`` equals a fresh scan of ``T[p:]``. *Local*: a character class run (digits, CJK) that excludes
  ``\\n``; its pieces left of ``p`` end before ``p-1`` and its scan right of ``p`` restarts identically, so it
  changes nothing but (maybe) whether ``p`` is a boundary. Since every stage only splits the pieces of the
  previous one, one separating stage makes ``p`` a boundary of the final pieces and all other pieces agree.
- model: BPE without dropout (each piece is encoded on its own).
- offsets (used to find a cut's token index) untrimmed: no post-processor with ``trim_offsets``.
- added tokens: none with lstrip or single_word, none with a newline before its last character (so no match
  can span ``p-1..p``; a leftmost-longest choice left of ``p`` never depends on text right of ``p``).

Everything else (other normalizers, Metaspace, WordPiece/Unigram, dropout, ``encode_special_tokens``) turns
the corresponding kind of cut off; :class:`CutRules` records why.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# Split regexes proved "separating" at a line cut (see the module docstring), keyed by exact pattern text.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CL100K_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
DEEPSEEK_PATTERN = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
SEPARATING_PATTERNS: frozenset[str] = frozenset(
    {QWEN2_PATTERN, QWEN3_5_PATTERN, CL100K_PATTERN, GPT2_PATTERN, DEEPSEEK_PATTERN}
)
# Character-class runs that exclude "\n": they never decide a boundary at a line cut.
LOCAL_PATTERNS: frozenset[str] = frozenset(
    {r"\p{N}{1,3}", r"\p{N}", r"\p{N}+", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"}
)
_NORMALIZERS_OK = {"NFC", "NFD", "NFKC", "NFKD"}
# Built-in pre-tokenizers that work on one split at a time (Metaspace's "first" scheme looks only at a split's
# original offset 0, which lies in the shared prefix): anchor cuts need nothing else.
_PER_SPLIT_PRETOKENIZERS = {
    "Split", "ByteLevel", "Digits", "Metaspace", "Whitespace", "WhitespaceSplit", "Punctuation",
    "UnicodeScripts", "BertPreTokenizer", "CharDelimiterSplit", "FixedLength",
}

# A line cut: "\n" then a printable, non-space ASCII character.
LINE_CUT_RE = re.compile(r"\n(?=[!-~])")


def last_line_cut(text: str, bound: int) -> int:
    """The greatest line cut ``p <= bound`` of ``text`` (a position where :data:`LINE_CUT_RE` matches ends:
    ``text[p - 1] == "\\n"`` and ``"!" <= text[p] <= "~"``), or -1; scans backwards from ``bound`` only."""
    n = len(text)
    while bound > 0:  # (a negative end would count from the end of the text)
        j = text.rfind("\n", 0, bound)
        if j < 0:
            return -1
        if j + 1 < n and "!" <= text[j + 1] <= "~":
            return j + 1
        bound = j
    return -1


@dataclass(frozen=True)
class CutRules:
    """Which cuts are exact for one tokenizer pipeline, and why the others are off."""

    anchors: dict[str, int] = field(default_factory=dict)  # added-token content -> id
    line_cuts: bool = False
    # the model cannot emit an anchor's id: the k-th occurrence of an anchor in a text is its k-th id in the
    # ids (anchor cuts can then be located without offsets)
    counted: bool = False
    # an anchor that starts where a cached text ends is a cut of that text's whole encoding (no single_word)
    closing: bool = False
    usable: bool = False  # False: the cache must not be used at all (every encode is a full encode)
    reasons: tuple[str, ...] = ()


def _state(component: Any, full: dict[str, Any], key: str) -> Any:
    """The JSON description of a pipeline component (``None`` when absent)."""
    if component is None:
        return None
    raw = component.__getstate__()
    if raw is None:  # e.g. an empty normalizer Sequence: read it from the whole serialization
        return full.get(key)
    return json.loads(raw)


def _normalizer_ok(desc: Any) -> bool:
    if desc is None:
        return True
    if desc.get("type") == "Sequence":
        return all(_normalizer_ok(d) for d in desc.get("normalizers", []))
    return desc.get("type") in _NORMALIZERS_OK


def _flatten(desc: Any) -> list[dict[str, Any]]:
    if desc is None:
        return []
    if desc.get("type") == "Sequence":
        out: list[dict[str, Any]] = []
        for d in desc.get("pretokenizers", []):
            out.extend(_flatten(d))
        return out
    return [desc]


def _pretokenizer_line_cuts(desc: Any) -> tuple[bool, str]:
    """Whether line cuts are exact for this pre-tokenizer (see the module docstring)."""
    stages = _flatten(desc)
    if not stages:
        return False, "no pre-tokenizer: a line is not a piece boundary"
    separating = False
    seen_bytelevel = False
    for i, st in enumerate(stages):
        kind = st.get("type")
        if seen_bytelevel:
            return False, "a stage after ByteLevel sees byte-mapped text"
        if kind == "Split":
            pattern = (st.get("pattern") or {}).get("Regex")
            if st.get("behavior") != "Isolated" or st.get("invert"):
                return False, f"Split stage {i} is not Isolated/non-inverted"
            if pattern in SEPARATING_PATTERNS:
                separating = True
            elif pattern not in LOCAL_PATTERNS:
                return False, f"Split stage {i} uses a regex not proved here: {pattern!r}"
        elif kind == "ByteLevel":
            if st.get("add_prefix_space"):
                return False, "ByteLevel add_prefix_space=True"
            if st.get("use_regex"):
                separating = True  # the GPT-2 regex
            seen_bytelevel = True
        elif kind == "Digits":
            continue
        else:
            return False, f"pre-tokenizer {kind} not proved here"
    if not separating:
        return False, "no separating Split stage"
    return True, ""


def _anchor_candidates(added: list[Any]) -> tuple[list[str], list[str]]:
    """Added tokens that are exact anchors, and those refused because occurrences could overlap."""
    raw = [t.content for t in added if not t.normalized and t.content]
    contents = set(raw)
    prefixes: set[str] = set()  # every nonempty prefix (whole tokens included)
    proper_suffixes: set[str] = set()
    proper_substrings: set[str] = set()
    for c in raw:
        n = len(c)
        for i in range(n):
            prefixes.add(c[: i + 1])
            if i:
                proper_suffixes.add(c[i:])
            for j in range(i + 1, n + 1):
                if (i, j) != (0, n):
                    proper_substrings.add(c[i:j])
    anchors: list[str] = []
    refused: list[str] = []
    for t in added:
        c = t.content
        if t.normalized or not c:
            continue
        if t.lstrip or t.rstrip or t.single_word or c[0].isspace() or c[-1].isspace():
            continue
        n = len(c)
        bad = (
            c in proper_substrings  # inside another token
            or any(c[i:j] in contents for i in range(n) for j in range(i + 1, n + 1) if (i, j) != (0, n))
            or any(c[i:] in prefixes for i in range(1, n))  # a suffix of c starts a token
            or any(c[:j] in proper_suffixes for j in range(1, n + 1))  # a token's suffix starts c
        )
        (refused if bad else anchors).append(c)
    return anchors, refused


def analyze(backend: Any, encode_special_tokens: bool | None = None) -> CutRules:
    """Work out the exact cuts of a ``tokenizers.Tokenizer`` (reads only its component states and added
    tokens). ``encode_special_tokens`` overrides the backend's flag (transformers sets it on every call)."""
    full: dict[str, Any] = {}
    try:
        normalizer = _state(backend.normalizer, full, "normalizer")
        pre = _state(backend.pre_tokenizer, full, "pre_tokenizer")
    except (TypeError, ValueError):
        full = json.loads(backend.to_str())
        normalizer, pre = full.get("normalizer"), full.get("pre_tokenizer")
    reasons: list[str] = []
    model = backend.model
    if type(model).__name__ != "BPE":
        return CutRules(reasons=(f"model {type(model).__name__} is not BPE",))
    if getattr(model, "dropout", None):
        return CutRules(reasons=("BPE dropout makes tokenization random",))
    decoder = backend.get_added_tokens_decoder()
    added = list(decoder.values())
    ids = {tok.content: i for i, tok in decoder.items()}

    anchors: dict[str, int] = {}
    if encode_special_tokens is None:
        encode_special_tokens = backend.encode_special_tokens
    unknown = sorted({st.get("type", "?") for st in _flatten(pre)} - _PER_SPLIT_PRETOKENIZERS)
    if encode_special_tokens:
        reasons.append("encode_special_tokens=True: special tokens are not split out")
    elif unknown:
        reasons.append(f"pre-tokenizer {', '.join(unknown)} not known to work split by split: no anchors")
    else:
        cands, refused = _anchor_candidates(added)
        anchors = {c: ids[c] for c in cands}
        if refused:
            reasons.append(f"{len(refused)} added tokens refused as anchors (overlaps)")

    line_cuts = _normalizer_ok(normalizer)
    if not line_cuts:
        reasons.append(f"normalizer not proved for line cuts: {normalizer}")
    else:
        ok, why = _pretokenizer_line_cuts(pre)
        if not ok:
            line_cuts = False
            reasons.append(why)
    if line_cuts:
        post = _state(backend.post_processor, full, "post_processor")
        if post is not None and '"trim_offsets": true' in json.dumps(post):
            # trimmed offsets can give a whitespace token before a cut a start at the cut: cuts are located
            # through offsets, so they must be untrimmed
            line_cuts = False
            reasons.append("post-processor trims offsets")
    if line_cuts:
        for tok in added:
            if tok.lstrip or tok.single_word or "\n" in tok.content[:-1]:
                line_cuts = False
                reasons.append(f"added token {tok.content!r} can match across a line cut")
                break
    counted = bool(anchors) and all(model.id_to_token(i) is None for i in anchors.values())
    closing = bool(anchors) and not any(tok.single_word for tok in added)
    return CutRules(anchors=anchors, line_cuts=line_cuts, usable=True, reasons=tuple(reasons), counted=counted,
                    closing=closing)
