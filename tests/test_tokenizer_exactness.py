"""PrefixTokenCache is exact on real tokenizers (Qwen3 NFC, DeepSeek-V4, GPT-2), loaded offline.

Exhaustive cut sweeps: a prompt is cached up to every character position of an adversarial region, then a
continuation (the true one, or one that completes a special token / adds combining marks / whitespace / ...)
is encoded through the cache and compared with a full encode. Hypothesis drives random conversations.
A control test shows the snippets do break a naive splice, so the sweeps can fail.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from vllm_dsa_dev.tokenizer import assets

from vllm_dsa_connector.tokenizer import PrefixTokenCache
from vllm_dsa_connector.tokenizer.analysis import SEPARATING_PATTERNS

SNIPPETS = {
    "combining_noncanonical": "caf\u0065\u0301 e\u0323\u0301 a\u0301\u0323\u0302b \u1100\u1161\u11a8 A\u030a\nx\u0301y\n\u0301z\n",
    "cjk": "中文测试，日本語のテキスト。한국어 텍스트\n漢字かなカナ123\n",
    "emoji_zwj": "👨\u200d👩\u200d👧\u200d👦 family 🏳\ufe0f\u200d🌈 flag 👍🏽\n✨x\n",
    "whitespace": "a    b\t\t \n\n   \n  c   \n\n\n    def f():\n\treturn  1 \n",
    "numbers": "1234567890 3.14159 1e10 0x1F 1,000,000 -42\n2024-01-01\n",
    "crlf": "line1\r\nline2\r\n\r\nline3\r\n  indented\r\n",
    "special_seam": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok</think><|im_end|>\n"
                    "<｜User｜>q<｜Assistant｜>a<｜end▁of▁sentence｜><|endoftext|>\n",
    "base64": "SGVsbG8gd29ybGQ/IQ==+/abc\nQUJDREVGR0hJSktMTU5PUA==\n",
    "code": "def f(x):\n    return x  # ok\n\nclass A:\n    '''doc'''\n    pass\n",
    "punct_lines": "!!\n??\n...\n#include <x>\n@decorator\n'quoted'\n\"dq\"\n",
}
CONTINUATIONS = (
    ">\n", "|>", "\u0301", "\u0323\u0301x", " ", "\n", "\nX", "<|im_end|>\n", "im_end|>", "<｜Assistant｜>",
    "end▁of▁sentence｜>", "==\n", "0", "中", "\r\n", "'s", "  \n",
)
PREAMBLE = "<|im_start|>system\nYou are helpful.<|im_end|>\n<｜User｜>Hi there\n"


@functools.cache
def _load(name: str):
    if name == "qwen":
        return assets.qwen_tokenizer()
    if name == "deepseek_v4":
        return assets.deepseek_v4_tokenizer()
    try:
        return assets.gpt2_tokenizer()
    except FileNotFoundError:
        try:
            assets.fetch_gpt2_ranks()
        except Exception as exc:  # noqa: BLE001 - any download failure means the asset is unavailable
            pytest.skip(f"GPT-2 ranks unavailable offline and not downloadable: {exc}")
        return assets.gpt2_tokenizer()


@pytest.fixture(scope="module", params=["qwen", "deepseek_v4", "gpt2"])
def tok(request):
    return _load(request.param)


@pytest.fixture(scope="module")
def cache(tok):
    # Small chunks and every cut kept: the most reuse, so the most chances to be wrong.
    return PrefixTokenCache(tok, min_chars=0, chunk_chars=4, cut_spacing=1)


def ref(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_tokenizers_are_the_real_ones(tok, cache):
    vocab = len(tok)
    assert vocab in (151669, 129280, 50257)
    s = cache.stats()
    assert s["enabled"] and s["line_cuts"], cache.rules.reasons
    if vocab == 151669:  # Qwen: NFC normalizer and its 26 added tokens, all usable as anchors
        assert tok.backend_tokenizer.normalizer is not None
        assert ref(tok, "e\u0301") == ref(tok, "\u00e9")
        assert s["anchors"] == 26
    if vocab == 129280:
        assert s["anchors"] > 1000


@pytest.mark.parametrize("snippet", sorted(SNIPPETS))
def test_cut_sweep(tok, cache, snippet):
    base = PREAMBLE + SNIPPETS[snippet] + "tail text\n"
    start = len(PREAMBLE)
    checked = 0
    for cut in range(start, len(base) + 1):
        old = base[:cut]
        for cont in (base[cut:], *CONTINUATIONS):
            cache.clear()
            assert cache.encode(old) == ref(tok, old)
            new = old + cont
            assert cache.encode(new) == ref(tok, new), (snippet, cut, cont)
            checked += 1
        # the new prompt is a strict prefix of the cached one (a template dropped its tail)
        cache.clear()
        cache.encode(base)
        assert cache.encode(old) == ref(tok, old), (snippet, cut, "prefix")
    assert checked > 0
    assert cache.stats()["hits"] > 0
    assert cache.stats()["cut_rejects"] == 0  # every proved line cut also passed its offsets check


def test_naive_splice_breaks_on_these_snippets(tok):
    """Control: restarting at an arbitrary character (keeping the cached ids before it) is wrong here."""
    wrong = 0
    for text in SNIPPETS.values():
        full = ref(tok, text)
        for cut in range(1, len(text)):
            if ref(tok, text[:cut]) + ref(tok, text[cut:]) != full:
                wrong += 1
    assert wrong > 50


FRAGMENTS = sorted(set(SNIPPETS.values()) | set(CONTINUATIONS) | {
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<｜User｜>", "<｜Assistant｜>", "<|endoftext|>",
    "\n", "\n\n", " ", "  ", "\t", "word", " words", "Ünïcödé", "x\u0301\u0327", "\u0327", "123", "۱۲۳",
    "<|im_", "end|>", "<｜", "｜>",
})
text_pieces = st.one_of(
    st.sampled_from(FRAGMENTS),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.lists(text_pieces, min_size=1, max_size=6), st.integers(0, 40)),
                      min_size=2, max_size=6))
def test_property_conversations(tok, cache, steps):
    """Each request = the previous one, cut back by a few characters (template edits), plus new text."""
    cache.clear()
    text = PREAMBLE
    for pieces, drop in steps:
        text = text[: max(0, len(text) - drop)] + "".join(pieces)
        assert cache.encode(text) == ref(tok, text)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60),
       b=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_property_arbitrary_unicode(tok, cache, a, b):
    cache.clear()
    assert cache.encode(a) == ref(tok, a)
    assert cache.encode(a + b) == ref(tok, a + b)
    assert cache.encode(b + a) == ref(tok, b + a)


MIXED = ("x = 1\n<|im_start|>u\ne\u0301\u0323 b\n  \n\t12345 中文\n'll \U0001F44D\r\n!!\n...\n\u0301y\n"
         "a  \n\nb<|im_end|>\n")


@pytest.mark.parametrize("pattern", sorted(SEPARATING_PATTERNS))
def test_every_proved_split_pattern(pattern):
    """Line cuts alone, for each regex in the proved table, behind the 'local' digit and CJK stages."""
    # real merges (GPT-2's: small and quick to copy) plus NFC and the Qwen-style added tokens
    _load("gpt2")  # skips when the GPT-2 ranks cannot be had
    raw = Tokenizer.from_file(str(assets.gpt2_tokenizer_file()))
    raw.normalizer = normalizers.NFC()
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.Split(Regex("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"), behavior="isolated"),
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    cache = PrefixTokenCache(tok, min_chars=0, chunk_chars=4, cut_spacing=1, anchors=False)
    assert cache.rules.line_cuts, cache.rules.reasons
    for cut in range(len(MIXED) + 1):
        old = MIXED[:cut]
        for cont in (MIXED[cut:], ">\n", "\u0301", "  \n", "\nX", "9"):
            cache.clear()
            cache.encode(old)
            assert cache.encode(old + cont) == ref(tok, old + cont), (pattern, cut, cont)
    assert cache.stats()["hits"] > 0


@pytest.mark.parametrize("mode", [{"line_cuts": False}, {"anchors": False}])
def test_each_cut_kind_alone(mode):
    tok = _load("qwen")
    cache = PrefixTokenCache(tok, min_chars=0, chunk_chars=4, cut_spacing=1, **mode)
    base = PREAMBLE + SNIPPETS["special_seam"] + SNIPPETS["combining_noncanonical"] + SNIPPETS["whitespace"]
    for cut in range(len(PREAMBLE), len(base) + 1):
        old = base[:cut]
        for cont in (base[cut:], ">\n", "im_end|>", "\u0301", " \n"):
            cache.clear()
            cache.encode(old)
            assert cache.encode(old + cont) == ref(tok, old + cont), (mode, cut, cont)
    assert cache.stats()["hits"] > 0
