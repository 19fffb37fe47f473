"""PrefixTokenCache behaviour: options, LRU by entries and chars, extend-replaces, threads, cut rules, wrapper."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from vllm_dsa_dev.tokenizer import assets

from vllm_dsa_connector.tokenizer import PrefixTokenCache
from vllm_dsa_connector.tokenizer.analysis import QWEN2_PATTERN, analyze

LINES = [f"line {i}: the quick brown fox {i * 7} jumps\n" for i in range(400)]


@pytest.fixture(scope="module")
def qwen():
    return assets.qwen_tokenizer()


def ref(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def chat(turns: int, user: str = "u") -> str:
    parts = ["<|im_start|>system\nshared preamble " + "".join(LINES[:50]) + "<|im_end|>\n"]
    for i in range(turns):
        parts.append(f"<|im_start|>{user}\n{LINES[(i * 13) % 400]}<|im_end|>\n")
        parts.append(f"<|im_start|>assistant\n{LINES[(i * 29) % 400]}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "key,value",
    [("max_entries", 0), ("max_entries", "many"), ("max_chars", -5), ("min_chars", -1), ("chunk_chars", 0),
     ("cut_spacing", 1.5), ("anchors", "maybe"), ("line_cuts", 3), ("verify_every", -1),
     ("log_interval_s", "x")],
)
def test_invalid_option_names_the_key(qwen, key, value):
    with pytest.raises(ValueError, match=key):
        PrefixTokenCache(qwen, **{key: value})


def test_unknown_option_and_wrong_tokenizer(qwen):
    with pytest.raises(ValueError, match="max_entrys"):
        PrefixTokenCache(qwen, max_entrys=3)
    with pytest.raises(ValueError, match="fast tokenizer"):
        PrefixTokenCache(object())
    with pytest.raises(TypeError):
        PrefixTokenCache(qwen).encode(["not", "a", "str"])


def test_options_from_environment(qwen):
    cache = PrefixTokenCache(qwen, environ={"VLLM_DSA_TOKCACHE_MAX_ENTRIES": "7"}, max_chars="1k")
    assert cache.options.max_entries == 7 and cache.options.max_chars == 1024
    with pytest.raises(ValueError, match="VLLM_DSA_TOKCACHE_CHUNK_CHARS"):
        PrefixTokenCache(qwen, environ={"VLLM_DSA_TOKCACHE_CHUNK_CHARS": "zero"})


# ---------------------------------------------------------------------------- LRU, replace, stats
def test_extend_replaces_and_divergence_adds(qwen):
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64)
    a = chat(3)
    assert cache.encode(a) == ref(qwen, a)
    b = a + "reply\n"
    assert cache.encode(b) == ref(qwen, b)
    s = cache.stats()
    assert (s["entries"], s["misses"], s["hits"]) == (1, 1, 1) and s["chars"] == len(b)
    c = a + "a different reply\n"  # diverges from b: both kept
    assert cache.encode(c) == ref(qwen, c)
    assert cache.stats()["entries"] == 2
    assert cache.encode(c) == ref(qwen, c)  # identical text: a hit, nothing added
    assert cache.stats()["entries"] == 2 and cache.stats()["hits"] == 3


HOSTILE = [
    "<|im_start|><|im_end|>\n", "<<|im_end|>>\n", "<|im_end|\n<|im_end|>x\n", "e\u0301<|im_end|>\u0301\n",
    "\n<|im_start|>\n\n \n\tX\r\nY\n", "<think></think><tool_call>\n</tool_call>", "a\n<|endoftext|>b\n",
    "caf\u00e9\n\u00e9t\u00e9\nZ", "<|im_start|>", "\n\n\n<|im_end|><|im_end|>\n<", "x" * 300 + "\n!",
]


def _recorded_cuts(cache):
    """(text, cut position, token index) of every cut the cache recorded."""
    from vllm_dsa_connector.tokenizer import cache as cache_mod

    for entry in list(cache._index.entries.values()):
        for c in entry.cuts:
            yield entry.text, c >> cache_mod._POS, (c & cache_mod._LOW) >> 8


def _exact_cuts(cache, qwen) -> int:
    """Assert every recorded cut splits its text's ids exactly; the number of cuts."""
    n = 0
    for t, p, k in _recorded_cuts(cache):
        ids = ref(qwen, t)
        assert ref(qwen, t[:p]) == ids[:k] and ref(qwen, t[p:]) == ids[k:], (p, k, t[max(0, p - 20) : p + 20])
        n += 1
    return n


@pytest.mark.parametrize("spacing", [1, 64])
def test_every_recorded_cut_is_exact_on_hostile_texts(qwen, spacing):
    """Anchor look-alikes, adjacent and partial anchors, anchors at the start, combining marks, CR/LF and
    blank lines, in growing prompts: each result equals a full encode and every recorded cut splits the
    text's ids exactly (ids(text[:p]) == ids[:k] and ids(text[p:]) == ids[k:])."""
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64, cut_spacing=spacing, max_entries=64)
    text = chat(2)
    for i in range(3 * len(HOSTILE)):
        text += HOSTILE[(i * 7) % len(HOSTILE)] + LINES[i % 400]
        assert cache.encode(text) == ref(qwen, text), i
    assert _exact_cuts(cache, qwen) > 20


def test_tails_encoded_without_offsets_record_exact_cuts(qwen):
    """Chat-shaped growth (every request ends with the generation prompt) takes the ids-only path: anchor cuts
    placed by counting occurrences. Hostile turns (anchor look-alikes, adjacent anchors, combining marks next
    to anchors, an anchor at a line start and mid-line, CR/LF) give exact results and every recorded cut
    splits its text's ids exactly; a tail with a line cut after its last anchor, or a long tail, keeps offsets."""
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64, cut_spacing=1, max_entries=64)
    text = chat(2)
    for i in range(2 * len(HOSTILE)):
        a, b = HOSTILE[(i * 5) % len(HOSTILE)], HOSTILE[(i * 3 + 1) % len(HOSTILE)]
        text += f"{a}reply {i} caf\u00e9<|im_end|>\n<|im_start|>user\n{b}{LINES[i]}<|im_end|>x<|im_end|>\n"
        text += "<|im_start|>assistant\n"
        assert cache.encode(text) == ref(qwen, text), i
    s = cache.stats()
    assert s["fast_tails"] >= len(HOSTILE) and s["fast_rejects"] == 0 and s["mismatches"] == 0
    assert _exact_cuts(cache, qwen) > 50
    fast = s["fast_tails"]
    text += "an open user turn\nwith a line cut after the last anchor\n"
    assert cache.encode(text) == ref(qwen, text) and cache.stats()["fast_tails"] == fast
    text += "<|im_end|>\n<|im_start|>user\n" + ("".join(LINES) * 2)[:20000] + "<|im_end|>\n<|im_start|>assistant\n"
    assert cache.encode(text) == ref(qwen, text) and cache.stats()["fast_tails"] == fast  # > 16,384 chars
    # a divergence inside a tail encoded without offsets re-encodes from the anchor before it
    edited = text[: len(text) - 300] + "Q" + text[len(text) - 299 :]
    assert cache.encode(edited) == ref(qwen, edited)


def test_anchor_pairing_refuses_disagreeing_counts():
    from vllm_dsa_connector.tokenizer.idlists import pair_anchors as _pair

    anchors = {"<a>": 7, "<b>": 8}
    found = [(0, "<a>"), (5, "<b>"), (9, "<a>")]
    assert _pair(found, [7, 1, 8, 2, 7, 3], anchors) == [(0, 3, 0), (5, 3, 2), (9, 3, 4)]
    assert _pair(found, [7, 1, 8, 2, 3], anchors) is None  # an occurrence without its id
    assert _pair(found, [7, 1, 8, 2, 7, 7], anchors) is None  # an id without its occurrence
    assert _pair(found, [7, 7, 1, 8, 2], anchors) is None  # ids out of the occurrences' order


def test_anchors_the_model_can_emit_are_not_counted():
    rules = analyze(_toy([AddedToken("<ok>", special=True, normalized=False)]))
    assert rules.counted
    in_vocab = _toy([AddedToken("<ok>", special=True, normalized=False), AddedToken("\u0100", normalized=False)])
    rules = analyze(in_vocab)  # "\u0100" is a byte-level vocabulary token: its id can come from the model
    assert "\u0100" in rules.anchors and not rules.counted


def test_one_character_changed_deep_inside_the_cached_prefix(qwen):
    """A prompt equal to a cached one except for one character deep inside (replaced, inserted, deleted,
    a combining mark that NFC composes with its neighbour) is encoded exactly, not spliced from the cache."""
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64, max_entries=256)
    base = chat(40)
    assert cache.encode(base) == ref(qwen, base)
    for pos in (37, len(base) // 3, len(base) // 2 + 1, len(base) - 200):
        for text in (base[:pos] + ("Q" if base[pos] != "Q" else "R") + base[pos + 1 :],
                     base[:pos] + "\u0301" + base[pos:], base[:pos] + base[pos + 1 :],
                     base[:pos] + "<|im_end|>" + base[pos:]):
            for follow in ("", "next turn\n"):
                assert cache.encode(text + follow) == ref(qwen, text + follow), pos
    assert cache.stats()["mismatches"] == 0


def test_eviction_by_entries_is_lru(qwen):
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64, max_entries=3)
    texts = [chat(2, user=f"user{i}") for i in range(5)]
    for t in texts[:3]:
        cache.encode(t)
    cache.encode(texts[0] + "more")  # touches (and replaces) entry 0: entry 1 is now the oldest
    cache.encode(texts[3])
    assert cache.stats()["entries"] == 3
    before = cache.stats()["hits"]
    cache.encode(texts[0] + "more and more")  # still cached
    assert cache.stats()["hits"] == before + 1
    misses = cache.stats()["misses"]
    cache.encode(texts[1] + "x")  # evicted: the shared preamble is all that can match (other entries)
    assert cache.stats()["misses"] + cache.stats()["hits"] > misses
    assert cache.stats()["entries"] == 3


def test_eviction_by_chars(qwen):
    one = chat(2)
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64, max_chars=int(len(one) * 2.5))
    for i in range(6):
        t = chat(2, user=f"u{i}")
        assert cache.encode(t) == ref(qwen, t)
        s = cache.stats()
        assert s["chars"] <= cache.options.max_chars
    assert cache.stats()["entries"] == 2
    huge = PrefixTokenCache(qwen, min_chars=0, max_chars=100)
    assert huge.encode(one) == ref(qwen, one) and huge.stats()["entries"] == 0  # larger than the cap


def test_short_texts_bypass_and_results_are_fresh_lists(qwen):
    cache = PrefixTokenCache(qwen, min_chars=1000)
    assert cache.encode("short") == ref(qwen, "short")
    assert cache.stats()["bypassed"] == 1 and cache.stats()["entries"] == 0
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64)
    t = chat(4)
    first = cache.encode(t)
    first.clear()  # the caller owns the list
    assert cache.encode(t) == ref(qwen, t)
    assert cache.encode(t + "x") == ref(qwen, t + "x")


def test_many_entries_sharing_a_preamble(qwen):
    """200 conversations share a long preamble; each extension still finds its own conversation."""
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=256, max_entries=512)
    convs = [chat(2, user=f"user-{i}") for i in range(200)]
    for t in convs:
        cache.encode(t)
    hits, tail = cache.stats()["hits"], cache.stats()["tail_tokens"]
    for i in (0, 57, 199):
        t = convs[i] + f"follow-up {i}\n"
        assert cache.encode(t) == ref(qwen, t)
    s = cache.stats()
    # each follow-up re-tokenizes only from its own conversation's last anchor ("<|im_start|>assistant\n...")
    assert s["hits"] == hits + 3 and s["tail_tokens"] - tail < 3 * 20


def test_verify_every(qwen):
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64, verify_every=1)
    t = chat(2)
    cache.encode(t)
    for i in range(3):
        t += f"more {i}\n"
        assert cache.encode(t) == ref(qwen, t)
    s = cache.stats()
    assert s["verified"] == 3 and s["mismatches"] == 0 and s["enabled"]


def test_verify_mismatch_disables_the_cache(qwen):
    """Fault injection (a corrupted cached id cannot happen through the API): the shadow check catches it,
    returns the full encode and turns the cache off."""
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64, verify_every=1)
    t = chat(2)
    cache.encode(t)
    entry = next(iter(cache._index.entries.values()))
    entry.head[3] = 0  # corrupt one cached id
    assert cache.encode(t + "more\n") == ref(qwen, t + "more\n")
    s = cache.stats()
    assert s["mismatches"] == 1 and not s["enabled"] and s["entries"] == 0
    assert cache.encode(t + "again\n") == ref(qwen, t + "again\n") and cache.stats()["bypassed"] == 1


def test_empty_and_tiny_texts(qwen):
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=1)
    for text in ("", "a", "", "\n", "\na", "<|im_end|>", "<|im_end|>\nb"):
        assert cache.encode(text) == ref(qwen, text)


def test_bench_cli_json_smoke(capsys):
    import json

    from vllm_dsa_connector.cli import main

    assert main(["bench", "tokenizer", "--json", "--targets", "3000", "--turns", "3", "--lookup-entries", "1", "20"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["workload"] for r in last["results"]] == ["chat", "prose", "code", "code-open"]
    for r in last["results"]:
        assert r["mismatches"] == 0 and r["requests_measured"] == 3 and r["hits"] >= 3
        for key in ("full_ms", "cache_ms", "delta_only_ms", "speedup", "cache_over_delta"):
            assert r[key] > 0, key
    lookup = last["lookup"]
    assert lookup["entries_1"] == 1 and lookup["entries_20"] == 20
    assert lookup["lookup_probes_1"] == lookup["lookup_probes_20"]


def test_threads_share_one_cache(qwen):
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64, max_entries=16)
    results: list[tuple[str, list[int]]] = []
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            text = chat(1, user=f"thread{n % 4}")
            for step in range(25):
                text += LINES[(n * 31 + step * 7) % 400] + ("<|im_end|>\n" if step % 3 == 0 else "")
                results.append((text, cache.encode(text)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(results) == 200
    for text, ids in results:
        assert ids == ref(qwen, text)
    assert cache.stats()["hits"] > 100


def test_added_token_after_creation_rebuilds():
    tok = assets.gpt2_tokenizer() if assets.gpt2_tokenizer_file().exists() else assets.qwen_tokenizer()
    cache = PrefixTokenCache(tok, min_chars=0, chunk_chars=8)
    text = "hello <NEWTOKEN> world\nline two\n"
    assert cache.encode(text) == ref(tok, text)
    tok.add_special_tokens({"additional_special_tokens": ["<NEWTOKEN>"]})
    assert cache.encode(text + "x") == ref(tok, text + "x")
    assert ref(tok, text).count(tok.convert_tokens_to_ids("<NEWTOKEN>")) == 1


# ---------------------------------------------------------------------------- cut rules
def _toy(added=(), pre=None, normalizer=None, model=None) -> Tokenizer:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(model or models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre or pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    if normalizer is not None:
        tok.normalizer = normalizer
    if added:
        tok.add_tokens(list(added))
    return tok


def test_rules_accept_the_proved_pipeline():
    rules = analyze(_toy([AddedToken("<ok>", special=True, normalized=False)], normalizer=normalizers.NFC()))
    assert rules.usable and rules.line_cuts and rules.anchors == {"<ok>": 256}


def test_rules_refuse_overlapping_anchors():
    rules = analyze(_toy([AddedToken(t, special=True, normalized=False) for t in ("<a>", "a><b", "<ok>", "xx")]))
    assert set(rules.anchors) == {"<ok>"}  # "<a>"/"a><b" overlap; "xx" overlaps itself
    rules = analyze(_toy([AddedToken(t, special=True, normalized=False) for t in ("<a>", "<a>b")]))
    assert rules.anchors == {}  # one contains the other


def test_rules_refuse_unproved_parts():
    assert not analyze(_toy(pre=pre_tokenizers.Metaspace())).line_cuts
    assert not analyze(_toy(normalizer=normalizers.Lowercase())).line_cuts
    assert not analyze(_toy(pre=pre_tokenizers.Split(Regex(r"\w+|\s+"), behavior="isolated"))).line_cuts
    assert not analyze(_toy([AddedToken("<l>", lstrip=True, normalized=False)])).line_cuts
    assert not analyze(_toy([AddedToken("a\nb", normalized=False)])).line_cuts
    assert not analyze(_toy(model=models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))).usable
    trimmed = _toy()
    trimmed.post_processor = processors.ByteLevel(trim_offsets=True)
    assert not analyze(trimmed).line_cuts
    tok = _toy([AddedToken("<s>", special=True, normalized=False)])
    tok.encode_special_tokens = True
    assert analyze(tok).anchors == {}


def test_unproved_pipeline_falls_back_exactly():
    raw = _toy(pre=pre_tokenizers.Metaspace())  # no line cuts, no anchors: the cache stays out of the way
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    cache = PrefixTokenCache(tok, min_chars=0, chunk_chars=4)
    text = "some words here\nand a second line\n"
    cache.encode(text)
    assert cache.encode(text + "more") == ref(tok, text + "more")
    assert cache.stats()["bypassed"] == 2 and cache.stats()["entries"] == 0
    # with an anchor but no line cuts: plain text falls back, text after an anchor hits
    raw = _toy([AddedToken("<s>", special=True, normalized=False)], pre=pre_tokenizers.Metaspace())
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    cache = PrefixTokenCache(tok, min_chars=0, chunk_chars=4)
    cache.encode(text)
    assert cache.encode(text + "more") == ref(tok, text + "more")
    assert cache.stats()["fallbacks"] == 1 and cache.stats()["hits"] == 0
    cache.encode(text + "<s> next")
    assert cache.encode(text + "<s> next turn") == ref(tok, text + "<s> next turn")
    assert cache.stats()["hits"] == 1


# ---------------------------------------------------------------------------- wrapper + registration
def test_wrapper_matches_the_tokenizer(qwen):
    from vllm_dsa_connector.tokenizer.wrapper import wrap_tokenizer

    w = wrap_tokenizer(qwen, min_chars=0, chunk_chars=16)
    assert isinstance(w, type(qwen))
    t = chat(3)
    for text in (t, t + "more\n", "short"):
        for special in (True, False):
            assert w(text, add_special_tokens=special)["input_ids"] == qwen(text, add_special_tokens=special)["input_ids"]
            assert w.encode(text, add_special_tokens=special) == qwen.encode(text, add_special_tokens=special)
        assert dict(w(text)) == dict(qwen(text))
        assert w(text, truncation=True, max_length=5)["input_ids"] == qwen(text, truncation=True, max_length=5)["input_ids"]
        assert w(text, return_offsets_mapping=True)["offset_mapping"] == qwen(text, return_offsets_mapping=True)["offset_mapping"]
    assert w([t, "b"])["input_ids"] == qwen([t, "b"])["input_ids"]
    assert w.prefix_cache.stats()["hits"] > 0
    d = copy.deepcopy(w)
    assert d.prefix_cache is w.prefix_cache
    p = pickle.loads(pickle.dumps(w))
    assert type(p).__name__ == type(w).__name__ and p(t)["input_ids"] == qwen(t)["input_ids"]


def test_wrapper_adds_constant_special_tokens_and_falls_back():
    from vllm_dsa_connector.tokenizer.wrapper import wrap_tokenizer

    if not assets.gpt2_ranks_file().exists():
        pytest.skip("GPT-2 ranks not fetched (python -m vllm_dsa_dev.tokenizer.assets fetch)")
    tok = assets.gpt2_tokenizer()
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", eot)])
    w = wrap_tokenizer(tok, min_chars=0, chunk_chars=16)
    assert w._dsa_affixes == ([eot], [eot])
    text = "".join(LINES[:20])
    for t in (text, text + "more\n", text + "<|endoftext|>x"):
        n = len(tok(t)["input_ids"])
        assert w(t)["input_ids"] == tok(t)["input_ids"] and w(t)["input_ids"][0] == eot
        for limit in (5, n, n + 1):  # truncating (falls back) and not truncating
            assert w(t, truncation=True, max_length=limit)["input_ids"] == tok(t, truncation=True, max_length=limit)["input_ids"]
        assert w(t, None, None, None, False)["input_ids"] == tok(t, None, None, None, False)["input_ids"]
        assert w.encode(t, None, False) == tok.encode(t, None, False)
    assert w.prefix_cache.stats()["hits"] > 0


def test_wrapper_stays_out_when_python_preprocesses_text(qwen):
    from vllm_dsa_connector.tokenizer.wrapper import wrap_tokenizer

    class Lowercasing(type(qwen)):  # a tokenizer class that changes the text before its Rust backend
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.lower() if isinstance(text, str) else text, *args, **kwargs)

    tok = copy.copy(qwen)
    tok.__class__ = Lowercasing
    w = wrap_tokenizer(tok, min_chars=0)
    assert not w._dsa_agrees
    text = "CAPS Text\nMore CAPS\n" * 20
    assert w(text)["input_ids"] == tok(text)["input_ids"] != qwen(text)["input_ids"]
    assert w.prefix_cache.stats()["misses"] == 0


def test_registration_is_idempotent():
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    from vllm_dsa_connector.tokenizer.registration import register_tokenizer_mode

    register_tokenizer_mode()
    register_tokenizer_mode()
    assert TokenizerRegistry.tokenizers["dsa-prefix-cache"][1] == "DSAPrefixCacheTokenizer"
    # the base mode's own renderer (tests/test_tokenizer_modes.py)
    assert RENDERER_REGISTRY.renderers["dsa-prefix-cache"] == (
        "vllm_dsa_connector.tokenizer.modes", "prefix_cache_renderer")
    cls = TokenizerRegistry.load_tokenizer_cls("dsa-prefix-cache")
    assert callable(cls.from_pretrained)  # loading through it is covered by test_tokenizer_serve
