"""``--tokenizer-mode dsa-prefix-cache`` keeps the model's own tokenizer mode: its chat encoding, its renderer.

Fast tests: the base mode is what vLLM's ModelConfig resolves ``auto`` to (or ``VLLM_DSA_TOKCACHE_BASE_MODE``);
modes and tokenizers that cannot be wrapped are refused with a message naming them; for each wrappable DeepSeek
mode and ``hf`` the wrapped tokenizer's chat encoding (tools, thinking turns, growing conversations) gives the
stock mode's text and ids while the cache hits.

Slow tests (real servers, ``--load-format dummy``, one stock and one ``dsa-prefix-cache`` server per model): a
tiny ``DeepseekV32ForCausalLM`` (auto -> ``deepseek_v32``; its directory also has a Jinja template that V3.2's
encoding must ignore) and a tiny ``GlmMoeDsaForCausalLM`` (auto -> ``hf``, Qwen3 tokenizer, tool/thinking
template). A multi-turn conversation with tools and thinking turns goes to both servers: ``/tokenize`` (chat and
completion forms) and the prompt ids the engine reports for chat and completion requests must be identical.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_dsa_dev.tokenizer.tiny_models import make_tiny_glm_qwen, make_tiny_v32

from vllm_dsa_connector.tokenizer.modes import (
    BASE_MODE_ENV,
    MODE,
    BaseMode,
    ModeError,
    check_tokenizer,
    prefix_cache_renderer,
    resolve_base_mode,
)

CACHE_ENV = {"VLLM_DSA_TOKCACHE_MIN_CHARS": "0", "VLLM_DSA_TOKCACHE_CHUNK_CHARS": "16",
             "VLLM_DSA_TOKCACHE_CUT_SPACING": "1"}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the documentation.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]
SYSTEM = ("You are a terse assistant for a Python code base.\n\n```python\ndef f(x):\n    return x  # ok\n```\n"
          "Unicode: e\u0301\u0323 vs \u00e9, 中文, 👨\u200d👩\u200d👧.\n")


def _call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# (messages added, thinking) per request; each request sends the whole conversation so far.
STEPS: list[tuple[list[dict[str, Any]], bool]] = [
    ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello! What can you do?\n"}], False),
    ([{"role": "assistant", "content": "I read code and call tools.\n\n"},
      {"role": "user", "content": "What is the weather in Paris for   3 days?\t(use the tool)"}], True),
    ([{"role": "assistant", "content": "", "reasoning": "The user wants weather: call get_weather.",
       "tool_calls": [_call(1, "get_weather", {"city": "Paris", "days": 3})]},
      {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "temp_c": 21}'}], True),
    ([{"role": "assistant", "content": "Sunny, 21 °C.", "reasoning": "The tool says sunny and 21 C."},
      {"role": "user", "content": "Search the docs for a partial special string: <|im_end| and <｜User then ｜>."}],
     True),
    ([{"role": "assistant", "content": "",
       "tool_calls": [_call(2, "search_docs", {"query": "<|im_end| ｜>"})]},
      {"role": "tool", "tool_call_id": "call_2", "content": "base64: SGVsbG8gd29ybGQ/IQ==\n1234567 3.14\r\n"}],
     False),
    ([{"role": "assistant", "content": "Found it.\n"}, {"role": "user", "content": "Last question: same ids?\n"}],
     False),
]


def conversations() -> Iterator[tuple[list[dict[str, Any]], bool]]:
    messages: list[dict[str, Any]] = []
    for added, thinking in STEPS:
        messages = messages + copy.deepcopy(added)
        yield messages, thinking


def template_kwargs(thinking: bool) -> dict[str, Any]:
    return {"thinking": thinking, "enable_thinking": thinking}


@pytest.fixture(scope="module")
def v32_dir() -> Path:
    return make_tiny_v32()


@pytest.fixture(scope="module")
def glm_dir() -> Path:
    return make_tiny_glm_qwen()


@pytest.fixture(autouse=True)
def _offline_and_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_dsa_connector.tokenizer.registration import register_tokenizer_mode

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(BASE_MODE_ENV, raising=False)
    register_tokenizer_mode()


def _load(path: Path, mode: str) -> Any:
    from vllm.tokenizers.registry import get_tokenizer  # uncached: every call loads afresh

    return get_tokenizer(str(path), tokenizer_mode=mode)


# ---------------------------------------------------------------------------- base mode
def test_registered_renderer_is_the_base_modes(v32_dir: Path) -> None:
    from vllm.renderers.registry import RENDERER_REGISTRY

    assert RENDERER_REGISTRY.load_renderer_cls(MODE) is prefix_cache_renderer


def test_auto_resolves_like_vllm(v32_dir: Path, glm_dir: Path, tiny_mla_dir: Path) -> None:
    assert resolve_base_mode(v32_dir) == BaseMode("deepseek_v32", "auto", "DeepseekV32ForCausalLM")
    assert resolve_base_mode(glm_dir) == BaseMode("hf", "auto", "GlmMoeDsaForCausalLM")
    assert resolve_base_mode(tiny_mla_dir) == BaseMode("hf", "auto", "DeepseekV2ForCausalLM")
    assert resolve_base_mode(v32_dir, environ={BASE_MODE_ENV: "HF"}) == BaseMode("hf", "hf", None)


@pytest.mark.parametrize("value", ["mistral", "kimi_audio", "terratorch", MODE, "no_such_mode"])
def test_refused_base_modes_are_named(value: str, v32_dir: Path) -> None:
    with pytest.raises(ModeError, match=re.escape(f"{BASE_MODE_ENV}={value!r}")) as err:
        resolve_base_mode(v32_dir, environ={BASE_MODE_ENV: value})
    assert value in str(err.value)


def test_loading_refuses_before_serving(v32_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BASE_MODE_ENV, "mistral")
    with pytest.raises(ModeError, match="cannot wrap tokenizer mode 'mistral'"):
        _load(v32_dir, MODE)
    # a tokenizer directory without a model config: 'auto' cannot be told, so the mode must be named
    monkeypatch.delenv(BASE_MODE_ENV)
    tok_only = tmp_path / "tok"
    tok_only.mkdir()
    for f in v32_dir.iterdir():
        if f.name != "config.json" and f.is_file():
            (tok_only / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModeError, match=BASE_MODE_ENV):
        _load(tok_only, MODE)
    monkeypatch.setenv(BASE_MODE_ENV, "deepseek_v32")
    assert _load(tok_only, MODE)._dsa_base == BaseMode("deepseek_v32", "deepseek_v32", None)


def test_refuses_tokenizers_it_cannot_wrap(v32_dir: Path) -> None:
    base = BaseMode("hf", "auto", "X")
    tok = _load(v32_dir, "hf")

    class Lowercasing(type(tok)):  # text -> ids changed in Python: the cache would bypass it
        def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
            return super().encode(text.lower(), *args, **kwargs)

    bad = copy.copy(tok)
    bad.__class__ = Lowercasing
    with pytest.raises(ModeError, match="Lowercasing overrides encode"):
        check_tokenizer(bad, base)
    with pytest.raises(ModeError, match="not a transformers fast tokenizer"):
        check_tokenizer(SimpleNamespace(is_fast=False), base)
    check_tokenizer(tok, base)  # vLLM's own cached-tokenizer class passes


def test_renderer_refuses_other_architectures_and_foreign_tokenizers(v32_dir: Path) -> None:
    tok = _load(v32_dir, MODE)
    config = SimpleNamespace(model_config=SimpleNamespace(architecture="GlmMoeDsaForCausalLM"))
    with pytest.raises(ModeError, match="resolved to 'deepseek_v32' for DeepseekV32ForCausalLM"):
        prefix_cache_renderer(config, tok)
    with pytest.raises(ModeError, match="did not load"):
        prefix_cache_renderer(config, _load(v32_dir, "hf"))


@pytest.mark.compat
def test_vllm_mode_registries_and_loaders() -> None:
    """What the wrapper builds on, on each supported vLLM release (ci/compat.sh runs it against 0.33)."""
    import inspect

    from vllm.config import ModelConfig
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry, get_tokenizer, resolve_tokenizer_args

    for mode in ("hf", "deepseek_v32", "deepseek_v4", "deepseek_v41"):
        assert mode in TokenizerRegistry.tokenizers and mode in RENDERER_REGISTRY.renderers, mode
    assert "tokenizer_mode" in inspect.signature(resolve_tokenizer_args).parameters
    assert {"trust_remote_code", "revision"} <= set(inspect.signature(get_tokenizer).parameters)
    assert {"config", "tokenizer"} <= set(inspect.signature(RENDERER_REGISTRY.load_renderer).parameters)
    assert {"tokenizer_mode", "hf_overrides"} <= set(inspect.signature(ModelConfig).parameters)
    assert isinstance(getattr(ModelConfig, "architecture", None), property)
    assert RENDERER_REGISTRY.renderers[MODE] == ("vllm_dsa_connector.tokenizer.modes", "prefix_cache_renderer")


# ---------------------------------------------------------------------------- tokenizer level, per mode
@pytest.mark.parametrize("mode", ["auto", "deepseek_v32", "deepseek_v4", "deepseek_v41", "hf"])
def test_wrapped_chat_encoding_equals_stock(mode: str, v32_dir: Path, glm_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in CACHE_ENV.items():
        monkeypatch.setenv(key, value)
    if mode != "auto":
        monkeypatch.setenv(BASE_MODE_ENV, mode)
    for path in ([v32_dir, glm_dir] if mode in ("auto", "hf") else [v32_dir]):
        stock_mode = mode if mode != "auto" else resolve_base_mode(path).mode
        stock, wrapped = _load(path, stock_mode), _load(path, MODE)
        # the same class chain as the stock tokenizer (vLLM makes new classes per load), plus the wrapper
        assert [c.__name__ for c in type(wrapped).__mro__[1:]] == [c.__name__ for c in type(stock).__mro__]
        assert wrapped._dsa_base.mode == stock_mode
        for messages, thinking in conversations():
            kw = dict(tools=TOOLS, add_generation_prompt=True, **template_kwargs(thinking))
            text = stock.apply_chat_template(messages, tokenize=False, **kw)
            assert wrapped.apply_chat_template(messages, tokenize=False, **kw) == text
            ids = stock.apply_chat_template(messages, **kw)
            if not isinstance(ids, list):  # transformers' Jinja path returns a BatchEncoding
                ids = ids["input_ids"]
            got = wrapped.apply_chat_template(messages, **kw)
            assert (got if isinstance(got, list) else got["input_ids"]) == ids, (path.name, stock_mode)
            for special in (False, True):  # the renderer's text -> ids step
                assert wrapped(text, add_special_tokens=special)["input_ids"] == \
                    stock(text, add_special_tokens=special)["input_ids"]
        assert wrapped.prefix_cache.stats()["hits"] > 0, (path.name, stock_mode)


# ---------------------------------------------------------------------------- real servers
def _free_ports(n: int) -> list[int]:
    ports: list[int] = []
    for port in range(25100, 25200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError("not enough free ports in 25100-25199")


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{url}: HTTP {e.code}: {e.read()[:2000]!r}") from e


@pytest.fixture(scope="module", params=["v32", "glm"])
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A stock server and a ``dsa-prefix-cache`` server of one tiny model, started side by side."""
    from vllm_dsa_dev.harness.engines import (
        check_backend,
        choose_backend,
        engine_cmd,
        engine_env,
    )
    from vllm_dsa_dev.harness.procs import cluster, wait_healthy

    model = make_tiny_v32() if request.param == "v32" else make_tiny_glm_qwen()
    backend = choose_backend(model, "bfloat16")
    extra = ["--load-format", "dummy", "--max-num-seqs", "4"]
    ports = _free_ports(2)
    with cluster(tmp_path_factory.mktemp(f"modes-{request.param}")) as c:
        procs = {}
        for (name, mode_args, env_extra), port, bind in zip(
                (("stock", [], {}),
                 ("cache", ["--tokenizer-mode", MODE], {**CACHE_ENV, "VLLM_DSA_TOKCACHE_LOG_INTERVAL_S": "1"})),
                ports, ("0", "1"), strict=True):
            env = {**engine_env(bind), "HF_HUB_OFFLINE": "1", **env_extra}
            env.pop(BASE_MODE_ENV, None)
            cmd = engine_cmd(model, port, "bfloat16", None, max_model_len=4096, backend=backend,
                             extra=extra + mode_args)
            procs[name] = (c.start(f"{request.param}-{name}", cmd, env), f"http://127.0.0.1:{port}")
        for proc, url in procs.values():
            wait_healthy(url, [p for p, _ in procs.values()], 600)
            check_backend(proc, backend)
        yield {"model": str(model), "kind": request.param, "stock": procs["stock"][1],
               "cache": procs["cache"][1], "cache_log": procs["cache"][0].log}


@pytest.mark.slow
def test_served_prompt_ids_equal_stock_mode(servers: dict[str, Any]) -> None:
    model, stock, cache = servers["model"], servers["stock"], servers["cache"]
    for turn, (messages, thinking) in enumerate(conversations()):
        chat = {"model": model, "messages": messages, "tools": TOOLS,
                "chat_template_kwargs": template_kwargs(thinking)}
        ids = {name: _post(url + "/tokenize", chat)["tokens"] for name, url in (("stock", stock), ("cache", cache))}
        assert ids["cache"] == ids["stock"], (servers["kind"], turn)
        if servers["kind"] == "v32" and turn == 0:  # DeepSeek-V3.2's own encoding, not the directory's Jinja
            # BOS, ..., <｜User｜>...<｜Assistant｜></think> (the Jinja template would end at <｜Assistant｜>)
            assert ids["stock"][0] == 0 and 128803 in ids["stock"] and ids["stock"][-2:] == [128804, 128822]
        engine = {}
        for name, url in (("stock", stock), ("cache", cache)):
            out = _post(url + "/v1/chat/completions",
                        {**chat, "tool_choice": "none", "max_tokens": 1, "return_token_ids": True})
            engine[name] = out["prompt_token_ids"]
        assert engine["cache"] == engine["stock"] == ids["stock"], (servers["kind"], turn)
        # completion form: the rendered chat as raw text (special tokens spelled out)
        text = _post(stock + "/detokenize", {"model": model, "tokens": ids["stock"]})["prompt"]
        for special in (True, False):
            got = [_post(url + "/tokenize", {"model": model, "prompt": text, "add_special_tokens": special})["tokens"]
                   for url in (stock, cache)]
            assert got[1] == got[0], (servers["kind"], turn, special)
        got = [_post(url + "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1,
                                               "return_token_ids": True})["choices"][0]["prompt_token_ids"]
               for url in (stock, cache)]
        assert got[1] == got[0], (servers["kind"], turn)
    time.sleep(1.2)
    _post(cache + "/tokenize", {"model": model, "prompt": text + "x"})  # triggers the periodic stats line
    log = Path(servers["cache_log"]).read_text(errors="replace")
    base, renderer = {"v32": ("deepseek_v32", "DeepseekV32Renderer"), "glm": ("hf", "HfRenderer")}[servers["kind"]]
    assert f"wraps tokenizer mode '{base}' (auto for" in log
    assert f"renderer {renderer} of tokenizer mode '{base}'" in log
    hits = re.findall(r"DSA prefix token cache: hits=(\d+)", log)
    assert hits and int(hits[-1]) > 0
