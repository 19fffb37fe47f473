"""PrefixTokenCache on code-shaped prompts (Python source in user turns), Qwen3 NFC tokenizer.

Every cached result is compared with a full encode. Code-specific seams: the shared prefix of two requests ends
at every character around a string literal spanning lines (line starts inside the literal are cuts), CRLF
source, tab and mixed tab/space indentation, and a user turn that ends inside an identifier; continuations
complete, extend or rewrite the text there. Every cut the cache records is checked to split its text's ids
exactly. A prompt that ends anywhere (inside an identifier, a partial anchor, a CR, combining marks) and is
then extended by an anchor reuses all its ids; a tokenizer with ``single_word`` added tokens, where that
splice would be wrong, never does. The ``code`` and ``code-open`` workloads of ``vllm-dsa bench tokenizer``
are exact on every request.
"""

from __future__ import annotations

import pytest
from conftest import check_conversation_exact
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from vllm_dsa_dev.tokenizer import assets
from vllm_dsa_dev.tokenizer.workloads import TextSource, render, requests

from vllm_dsa_connector.tokenizer import PrefixTokenCache
from vllm_dsa_connector.tokenizer import cache as cache_mod
from vllm_dsa_connector.tokenizer.analysis import QWEN2_PATTERN, analyze

STRING_LITERAL = (
    'QUERY = """\nSELECT name,\n  value\nFROM t\nWHERE x = \'a\\nb\'\n"""\n'
    "def f(s):\n    return s.replace('\\n', '\\\\n') + '''\nmulti\n  line\n'''\n"
)
CRLF = "import os\r\n\r\ndef g(path):\r\n    if path:\r\n        return os.sep\r\n    return ''\r\n#end\r\n"
TABS = (
    "class A:\n\tdef f(self):\n\t\treturn 1\n\t\n    def g(self):\n\t    return 2  \t\n \tx = 3\n"
    "\t\n\n\tpass\t\n"
)
IDENTIFIER = "def _encode_cached(self, text):\n    return self._encod"
SEAMS = {"string_literal": STRING_LITERAL, "crlf": CRLF, "tabs": TABS, "identifier": IDENTIFIER}
CONTINUATIONS = (
    '"""\n', "'''", "\r\n", "\n", "\t", "    ", "_name", "er(x)\n", "\nX", "\r\nY", "\\\n", "#", '"', "\t\n",
    "<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>\n",
)


@pytest.fixture(scope="module")
def qwen():
    return assets.qwen_tokenizer()


def ref(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _exact_cuts(cache: PrefixTokenCache, tok, since: int = 0) -> int:
    """Assert every recorded cut (at ``since`` or after) splits its text's ids exactly; the number checked."""
    n = 0
    for entry in list(cache._index.entries.values()):
        ids = ref(tok, entry.text)
        for c in entry.cuts:
            p, k = c >> cache_mod._POS, (c & cache_mod._LOW) >> 8
            if p < since:
                continue
            t = entry.text
            assert ref(tok, t[:p]) == ids[:k] and ref(tok, t[p:]) == ids[k:], (p, k, t[max(0, p - 20) : p + 20])
            n += 1
    return n


def _prompt(seam: str) -> tuple[str, int, int]:
    """A chat prompt whose last user turn holds ``seam`` inside real code; the seam's span in it."""
    code = TextSource(4, code=True).take(400)
    user = f"{code}\n{seam}"
    text = render([("system", "Review the code.\n" + TextSource(9, code=True).take(300)), ("user", user)])
    start = text.index(seam)
    return text, start - 4, start + len(seam) + 2


def test_code_workload_is_code():
    code = TextSource(code=True).take(6000)
    lines = code.splitlines()
    assert len(lines) > 80 and sum(ln.startswith((" ", "\t")) for ln in lines) > len(lines) // 4
    reqs = list(requests("code", 6000, 3, lambda text: len(text) // 4))
    for r in reqs:
        user = r.text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        assert 1100 <= len(user) <= 3700 and user.count("\n") > 15


@pytest.mark.parametrize("seam", sorted(SEAMS))
def test_common_prefix_ends_anywhere_in_a_code_seam(qwen, seam):
    """Old text cached up to every position q around the seam; the new text continues (or rewrites) at q."""
    text, lo, hi = _prompt(SEAMS[seam])
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=16, cut_spacing=1)
    for q in range(lo, min(hi, len(text)) + 1):
        old = text[:q]
        for cont in (text[q:], *CONTINUATIONS):
            cache.clear()
            assert cache.encode(old) == ref(qwen, old)
            new = old + cont
            assert cache.encode(new) == ref(qwen, new), (seam, q, text[q - 8 : q], cont)
        cache.clear()  # rewritten after q (a template edit): both texts share exactly text[:q]
        cache.encode(old + "zq tail\n<|im_end|>\n")
        new = old + "rewritten(\r\n\tx)<|im_end|>\n"
        assert cache.encode(new) == ref(qwen, new), (seam, q, "rewrite")
    s = cache.stats()
    assert s["hits"] > 0 and s["mismatches"] == 0 and s["cut_rejects"] == 0


def test_growing_code_conversation_records_exact_cuts(qwen):
    """A conversation whose requests end inside identifiers, inside a string literal, after CRLF or tab
    indentation, or at the generation prompt: each result equals a full encode and every recorded cut (line
    starts inside literals, CRLF lines, tab-indented code) splits its text's ids exactly."""
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64, cut_spacing=1, max_entries=64)
    src = TextSource(2, code=True)
    messages = [("system", "You review code.\n" + src.take(500))]
    text = render(messages)
    assert cache.encode(text) == ref(qwen, text)
    for i in range(12):
        seam = SEAMS[sorted(SEAMS)[i % len(SEAMS)]]
        user = src.take(300) + "\n" + seam
        messages.append(("user", user))
        full = render(messages)
        for cut in (len(full) - 40, len(full) - 23, len(full)):  # inside the seam, before the prompt, whole
            part = full[:cut] if cut < len(full) else full
            assert cache.encode(part) == ref(qwen, part), (i, cut)
        messages.append(("assistant", f"Reply {i}: the loop in\tline {i} should use `self._encod`.\r\nOk."))
    s = cache.stats()
    assert s["hits"] > 20 and s["mismatches"] == 0
    assert _exact_cuts(cache, qwen) > 60


ENDINGS = ("self._encod", "<|im_end|", "<|im_", "<", "   ", "\t", "\r", "\n", "x = '''doc\n  ", "e", "\\",
           "a\u0301\u0323", "<|im_end|>")
OPENERS = ("<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>\u0301x\n", "<|im_start|>user\n", "<|endoftext|>\n")


def test_a_prompt_extended_by_an_anchor_reuses_all_its_ids(qwen):
    """The cached prompt ends anywhere; the new one adds an anchor right there: the result is exact, the
    cut lies where the cached prompt ends (all its ids kept, only the new text encoded) and is recorded."""
    base = render([("system", "Review.\n" + TextSource(3, code=True).take(800)), ("user", IDENTIFIER)])
    base = base[: base.rindex("<|im_end|>")]
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=64)
    for end in ENDINGS:
        for opener in OPENERS:
            old = base + end
            new = old + opener + "def more():\n\treturn 1\n"
            cache.clear()
            assert cache.encode(old) == ref(qwen, old)
            before = cache.stats()["tail_tokens"]
            assert cache.encode(new) == ref(qwen, new), (end, opener)
            assert cache.stats()["tail_tokens"] - before == len(ref(qwen, new[len(old) :])), (end, opener)
            entry = next(reversed(cache._index.entries.values()))
            assert any(c >> cache_mod._POS == len(old) for c in entry.cuts)
    assert cache.stats()["mismatches"] == 0 and _exact_cuts(cache, qwen) > 0


def test_single_word_tokens_keep_the_closing_splice_off():
    """With a ``single_word`` added token the text before an anchor tokenizes differently on its own (the
    token is a whole word at the end of the text, not before the anchor's first letter): the rules say so,
    and the cache stays exact."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(bytes_to_unicode().values())}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    raw.add_tokens([AddedToken("Zq>", special=True, normalized=False), AddedToken("ab", single_word=True, normalized=False)])
    rules = analyze(raw)
    assert rules.anchors == {"Zq>": 256} and not rules.closing
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    old, new = "hello ab", "hello abZq> more"
    assert ref(tok, old) + ref(tok, new[len(old) :]) != ref(tok, new)  # the splice would be wrong here
    cache = PrefixTokenCache(tok, min_chars=0, chunk_chars=4)
    assert cache.encode(old) == ref(tok, old) and cache.encode(new) == ref(tok, new)
    assert analyze(assets.qwen_tokenizer().backend_tokenizer).closing


@pytest.mark.parametrize("kind", ["code", "code-open"])
@pytest.mark.parametrize("options", [{}, {"chunk_chars": 64, "cut_spacing": 1, "min_chars": 0}])
def test_code_conversation_every_request_exact(qwen, options, kind):
    def check(req) -> None:
        assert len(req.delta) > 1000 and req.delta.count("\n") > 15
        assert req.text.endswith("<|im_start|>assistant\n") == (kind == "code")

    check_conversation_exact(qwen, kind, options, 5, check)


def test_heads_share_one_int_object_per_id(qwen):
    """The entries of one conversation keep one int object per id value (results stay fresh, equal lists)."""
    cache = PrefixTokenCache(qwen, min_chars=0, chunk_chars=256)
    results = []
    for req in requests("code", 30_000, 4, lambda text: len(cache.encode(text))):
        got = cache.encode(req.text)
        assert got == ref(qwen, req.text)
        assert all(got is not r for r in results)
        results.append(got)
    entry = next(reversed(cache._index.entries.values()))
    assert len(entry.head) > 5000
    assert len({id(x) for x in entry.head}) == len(set(entry.head))
    assert all(entry.ints[x] is x for x in entry.head)


def test_prompts_that_end_inside_turns_take_the_ids_only_path(qwen):
    """A client whose prompts end inside the user's code: each request closes the cached prompt with an
    anchor, so its tail needs no offsets (fast_tails); a request that extends the open turn instead (no anchor
    where the cached prompt ends) is exact too, re-encoded from the turn's anchor with its line cuts kept."""
    cache = PrefixTokenCache(qwen)
    last = None
    for req in requests("code-open", 12_000, 6, lambda text: len(cache.encode(text)), seed=1):
        assert cache.encode(req.text) == ref(qwen, req.text)
        last = req.text
    s = cache.stats()
    assert s["fast_tails"] >= 6 and s["fast_rejects"] == 0 and s["mismatches"] == 0
    assert last is not None
    since = len(last) - 4000
    for more in ("\n    more = self._encod", "ed(x)\nprint(1)\n", "\r\n\tx = '''\nlit\n'''\n"):
        last += more
        fast = cache.stats()["fast_tails"]
        assert cache.encode(last) == ref(qwen, last)
        assert cache.stats()["fast_tails"] == fast  # extended inside the turn: the tail keeps its offsets
    closed = last + "<|im_end|>\n<|im_start|>assistant\n"
    assert cache.encode(closed) == ref(qwen, closed)
    assert _exact_cuts(cache, qwen, since) > 3


def test_bench_profile_cli_json_smoke(capsys):
    import json

    from vllm_dsa_connector.cli import main

    argv = ["bench", "tokenizer", "--profile", "--json", "--targets", "3000", "--turns", "3",
            "--workloads", "code", "code-open"]
    assert main(argv) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["workload"] for r in last["results"]] == ["code", "code-open"]
    for r in last["results"]:
        assert r["profiled_hits"] == 3 and r["mismatches"] == 0 and r["delta_only_us"] > 0
        assert any("encode" in label for label in r["own_us_per_hit"]), r["own_us_per_hit"]
