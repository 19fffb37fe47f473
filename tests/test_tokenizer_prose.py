"""PrefixTokenCache on prose-shaped prompts (few newlines, NFC-composed accents), Qwen3 NFC tokenizer.

Every cached result is compared with a full encode. The shared prefix of two requests is made to end at every
character of a window: inside words, inside whitespace runs, between a letter and the combining mark NFC
composes it with; continuations then complete, extend or rewrite the text there. Lookup flatness is asserted
by dict-probe counts (never by time).
"""

from __future__ import annotations

import pytest
from conftest import check_conversation_exact
from vllm_dsa_dev.tokenizer import assets
from vllm_dsa_dev.tokenizer.workloads import NFC_WORDS, ProseSource, render

from vllm_dsa_connector.tokenizer import PrefixTokenCache


@pytest.fixture(scope="module")
def qwen():
    return assets.qwen_tokenizer()


def ref(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_prose_workload_is_prose():
    text = ProseSource().take(20_000)
    assert text.count("\n") < 20  # few newlines: line cuts are rare, anchors carry the reuse
    assert any(w in text for w in NFC_WORDS)


@pytest.mark.parametrize("options", [{}, {"chunk_chars": 64, "cut_spacing": 1, "min_chars": 0}])
def test_prose_conversation_every_request_exact(qwen, options):
    def check(req) -> None:
        assert len(req.delta) > 1000 and req.delta.count("\n") < 12

    check_conversation_exact(qwen, "prose", options, 3, check)


def _window() -> tuple[str, int, int]:
    """A chat prompt whose last user turn holds prose with NFC words and whitespace runs; a window of it."""
    prose = ProseSource(11).take(1500)
    words = prose.split(" ")
    for i in range(5, len(words), 9):  # whitespace runs and decomposed accents inside the turn
        words[i] = words[i] + ("   " if i % 2 else "\t ") + NFC_WORDS[i % len(NFC_WORDS)]
    user = " ".join(words)
    text = render([("system", "You edit prose.\n" + ProseSource(5).take(600)), ("user", user)])
    start = text.index(user) + len(user) // 3
    return text, start, start + 160


CONTINUATIONS = ("\u0301", "\u0308 and more", "\u0323\u0301x", " ", "   \n", "\n\nNew paragraph.", "s",
                 "<|im_end|>\n", "<|im_end|>\n<|im_start|>assistant\n", "\u00e9t\u00e9")


def test_common_prefix_ends_anywhere_in_prose(qwen):
    """Old text cached up to every position q of the window; the new text continues (or rewrites) at q."""
    text, lo, hi = _window()
    assert any(w in text[lo:hi] for w in NFC_WORDS) and "   " in text[lo:hi]
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=16, cut_spacing=1)
    for q in range(lo, hi):
        old = text[:q]
        for cont in (text[q:], *CONTINUATIONS):
            cache.clear()
            assert cache.encode(old) == ref(qwen, old)
            new = old + cont
            assert cache.encode(new) == ref(qwen, new), (q, text[q - 8 : q], cont)
        # rewritten after q (a template edit): both texts share exactly text[:q]
        cache.clear()
        cache.encode(old + "zq\u0301 tail<|im_end|>\n")
        new = old + "rewritten\u0301<|im_end|>\n"
        assert cache.encode(new) == ref(qwen, new), (q, "rewrite")
    s = cache.stats()
    assert s["hits"] > 0 and s["mismatches"] == 0


def test_prose_without_cut_points_falls_back_exactly(qwen):
    """Pure prose, no template and no newline: no exact cut exists, every request is a full encode."""
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64)
    text = ProseSource(2).take(3000).replace("\n", " ")
    for q in (1000, 2000, 3000):
        assert cache.encode(text[:q]) == ref(qwen, text[:q])
    s = cache.stats()
    assert s["hits"] == 0 and s["fallbacks"] == 2


def _probes(cache: PrefixTokenCache, text: str) -> int:
    m = cache.lookup(text)
    assert m.entry is not None
    return m.probes


def test_lookup_probes_flat_in_entries(qwen):
    """The same lookup costs the same dict probes with 1 and with 1,000 cached entries sharing its start."""
    base = render([("system", "You edit prose.\n" + ProseSource(1).take(3000))])
    target = base + "<|im_start|>user\n" + ProseSource(9).take(3000)
    counts = {}
    for n in (1, 1000):
        cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=256, max_entries=1024)
        cache.encode(target)
        other = ProseSource(4)
        for i in range(n - 1):
            cache.encode(f"{base}<|im_start|>user\n{i} {other.take(60)}")
        assert cache.stats()["entries"] == n
        counts[n] = _probes(cache, target + " more")
        assert cache.lookup(target + " more").entry.text == target
    assert counts[1] == counts[1000] <= 2


def test_same_length_edits_between_samples_find_their_conversation(qwen):
    """Conversations that differ only in a same-length field agree on every probe sample; the content keys
    still pick each one's own entry (re-tokenizing a few tokens, not the conversation)."""
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=256, max_entries=64)
    body = ProseSource(6).take(4000)
    convs = []
    for i in range(40):
        system = f"Ticket {i:04d}. " + body  # differs only in four digits near the start
        text = render([("system", system), ("user", ProseSource(8).take(1200))])
        convs.append(text)
        cache.encode(text)
    before = cache.stats()
    for i in (0, 17, 39):
        follow = convs[i] + "A reply.<|im_end|>\n<|im_start|>user\nThanks.<|im_end|>\n"
        assert cache.encode(follow) == ref(qwen, follow)
    s = cache.stats()
    assert s["hits"] - before["hits"] == 3
    assert s["probe_fallbacks"] > before["probe_fallbacks"]
    assert s["tail_tokens"] - before["tail_tokens"] < 3 * 30
