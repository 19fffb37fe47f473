"""`vllm serve --tokenizer-mode dsa-prefix-cache` gives the same prompt token ids as the stock HF tokenizer.

Starts a real vLLM OpenAI server (CPU, tiny MLA model with the real DeepSeek tokenizer; ~30-60 s) and sends a
growing multi-turn conversation through /tokenize (completion and chat forms) and /v1/completions, comparing
every prompt's ids with the HF tokenizer loaded from the same directory. The cache's periodic stats line must
reach the server log with hits > 0.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.slow  # starts a vLLM engine

TURNS = [
    "Hello! Please explain e\u0301\u0323 vs \u00e9, 中文 and 👨\u200d👩\u200d👧.\n",
    "Sure.\n\n```python\ndef f(x):\n    return x  # ok\n```\r\n",
    "What about   whitespace runs\t\t and numbers 1234567 3.14?\n",
    "A partial special string: <｜User and then ｜> closes it, <|im_end|\n",
    ">\nbase64: SGVsbG8gd29ybGQ/IQ==\n",
    "Last question: does it still match?\n",
]


def _port() -> int:
    for port in range(25100 + os.getpid() % 50, 25200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 25100-25199")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def server(tiny_mla_dir, tmp_path_factory):
    port = _port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0",
               VLLM_DSA_TOKCACHE_MIN_CHARS="0", VLLM_DSA_TOKCACHE_CHUNK_CHARS="16",
               VLLM_DSA_TOKCACHE_CUT_SPACING="1", VLLM_DSA_TOKCACHE_LOG_INTERVAL_S="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_mla_dir),
           "--tokenizer-mode", "dsa-prefix-cache", "--enforce-eager", "--max-model-len", "2048",
           "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
           "--attention-backend", "CPU_MLA"]  # pinned on every CPU (vLLM picks AMX_MLA where AMX exists)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm server not up in 300 s:\n{log_path.read_text()[-4000:]}")
                time.sleep(2)
        from vllm_dsa_dev.harness.engines import backends_in_log

        found = backends_in_log(log_path.read_text(errors="replace"))
        assert found == {"CPU_MLA"}, f"expected attention backend CPU_MLA, the server reported {found}"
        yield base, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_served_prompt_ids_equal_stock(server, tiny_mla_dir):
    from transformers import AutoTokenizer

    base, log_path = server
    hf = AutoTokenizer.from_pretrained(str(tiny_mla_dir))
    model = str(tiny_mla_dir)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse.\n"}]
    text = ""
    for i, turn in enumerate(TURNS):
        # completion-style prompt: a raw transcript that grows by one turn
        text += f"<｜User｜>{turn}<｜Assistant｜>reply {i}\n\n"
        for special in (True, False):
            got = _post(base + "/tokenize", {"model": model, "prompt": text, "add_special_tokens": special})
            assert got["tokens"] == hf(text, add_special_tokens=special)["input_ids"], (i, special)
        out = _post(base + "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1,
                                               "return_token_ids": True})
        assert out["choices"][0]["prompt_token_ids"] == hf(text)["input_ids"], i
        # chat form: the server renders the template, then tokenizes through the cache
        messages.append({"role": "user", "content": turn})
        got = _post(base + "/tokenize", {"model": model, "messages": messages, "add_generation_prompt": True})
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert got["tokens"] == hf(rendered, add_special_tokens=False)["input_ids"], i
        messages.append({"role": "assistant", "content": f"reply {i}"})
    time.sleep(1.2)
    _post(base + "/tokenize", {"model": model, "prompt": text + "x"})  # triggers the periodic stats line
    lines = re.findall(r"DSA prefix token cache: hits=(\d+) misses=(\d+)", log_path.read_text())
    assert lines, "no stats line in the server log"
    assert int(lines[-1][0]) > 0
