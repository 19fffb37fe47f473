"""Deterministic multi-turn prompts for the tokenizer benches and tests: chat-, prose- and code-shaped.

Text is real and varied: Python standard-library sources and docstrings, in sorted module order.

- *chat* (``vllm-dsa bench tokenizer``'s original workload): a code-review chat; the conversation grows with
  pasted files (6,000 characters) and short replies to near the target, then continues with ordinary turns
  (user 150-1,500 characters, assistant 200-1,800), many lines.
- *prose*: running prose with few newlines (docstring paragraphs joined into single lines, a paragraph break
  now and then, and decomposed accents that NFC composes: ``cafe\\u0301``); user turns of 1,200-3,500
  characters and replies of ~300, the same shape all the way up.
- *code*: user turns of 1,200-3,500 characters of Python source (standard-library modules, whole lines: many
  short lines, indentation, operators, string literals spanning lines), replies of ~300 characters of prose
  (:class:`ProseSource`), the same shape all the way up.
- *code-open*: the *code* conversation, each prompt ending inside the user's code (no end token, no
  generation prompt: a completion-style client); the next prompt closes that turn and adds a reply and a turn.

Prompts use the Qwen chat format (``<|im_start|>role\\n...<|im_end|>\\n``, generation prompt at the end), so
each request extends the previous one; ``Request.delta`` is the text added since the previous request.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("chat", "prose", "code", "code-open")
# Decomposed (NFD) spellings that an NFC normalizer composes, and one non-canonical mark order.
NFC_WORDS = ("cafe\u0301", "nai\u0308ve", "re\u0301sume\u0301", "fac\u0327ade", "A\u030angstro\u0308m",
             "jalapen\u0303o", "e\u0301le\u0300ve", "x\u0323\u0301", "Zu\u0308rich", "pin\u0303ata")


def corpus(docstrings: bool = True) -> Iterator[str]:
    """Standard-library module docstrings (unless ``docstrings`` is false) and sources, in a fixed order (skips
    unreadable modules)."""
    import importlib.util

    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in {"antigravity", "this"}:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None) if spec else None
        if not origin or not origin.endswith(".py"):
            continue
        try:
            source = Path(origin).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        doc = inspect.cleandoc(source.split('"""')[1]) if source.count('"""') >= 2 else ""
        if doc and docstrings:
            yield doc
        yield source


def _cycle(factory: Callable[[], Iterator[str]]) -> Iterator[str]:
    while True:
        yield from factory()


class TextSource:
    """Deterministic chunks of real text (sources and docstrings; with ``code``, sources only), cut at line
    ends."""

    def __init__(self, skip: int = 0, code: bool = False) -> None:
        factory: Callable[[], Iterator[str]] = (lambda: corpus(docstrings=False)) if code else corpus
        self._lines: Iterator[str] = (line for text in _cycle(factory) for line in text.splitlines(True))
        for _ in range(skip):
            self.take(500)

    def take(self, chars: int) -> str:
        out: list[str] = []
        n = 0
        while n < chars:
            line = next(self._lines)
            out.append(line)
            n += len(line)
        return "".join(out).strip("\n") or "ok"


_CODEISH = re.compile(r"^\s*(>>>|\.\.\.|[-=*#+|]{3,}|\w+\(.*\)\s*$)")


_TRIPLE = re.compile(r'"""(.*?)"""', re.S)


def _docstrings() -> Iterator[str]:
    """Triple-quoted strings of standard-library sources (docstrings, mostly)."""
    for text in corpus():
        for m in _TRIPLE.finditer(text):
            yield inspect.cleandoc(m.group(1))


def _paragraphs() -> Iterator[str]:
    """Docstring paragraphs as single lines of prose (code examples, tables and rulers dropped)."""
    for text in _docstrings():
        for block in text.split("\n\n"):
            lines = [ln.strip() for ln in block.splitlines() if ln.strip() and not _CODEISH.match(ln)]
            para = " ".join(" ".join(lines).split())
            if len(para) >= 80 and sum(ch.isalpha() or ch == " " for ch in para) >= 0.9 * len(para):
                yield para


class ProseSource:
    """Running prose with few newlines: sentences cut at word ends, an NFC-changing word every ~600
    characters, a paragraph break ("\\n\\n") about every 2,500 characters."""

    def __init__(self, skip: int = 0) -> None:
        self._paras = _cycle(_paragraphs)
        self._n = 0
        for _ in range(skip):
            self.take(500)

    def take(self, chars: int) -> str:
        out: list[str] = []
        n = 0
        while n < chars:
            words = next(self._paras).split(" ")
            for w in words:
                self._n += 1
                if self._n % 97 == 0:
                    w = f"{w} {NFC_WORDS[(self._n // 97) % len(NFC_WORDS)]}"
                sep = "\n\n" if self._n % 401 == 0 and out else " "
                out.append((sep if out else "") + w)
                n += len(w) + 1
                if n >= chars:
                    break
        return "".join(out).strip() or "ok"


@dataclass(frozen=True)
class Request:
    """One measured request: the whole prompt and the text added since the previous request."""

    text: str
    delta: str


def render(messages: list[tuple[str, str]]) -> str:
    """Qwen chat format with the generation prompt."""
    parts = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def requests(kind: str, target_tokens: int, turns: int, count: Callable[[str], int],
             seed: int = 0) -> Iterator[Request]:
    """Grow a ``kind`` conversation to near ``target_tokens`` (``count(prompt)`` gives a prompt's tokens and
    is called on every growth request, e.g. through the cache being measured), then yield ``turns`` measured
    requests that straddle the target."""
    if kind not in WORKLOADS:
        raise ValueError(f"workload {kind!r} is not one of {', '.join(WORKLOADS)}")
    code = kind.startswith("code")
    same_shape = code or kind == "prose"  # ordinary turns all the way up (chat grows with pasted files)
    prose = ProseSource(seed) if same_shape else None
    src = TextSource(seed, code=True) if code else prose if kind == "prose" else TextSource(seed)
    close = len("<|im_end|>\n<|im_start|>assistant\n") if kind == "code-open" else 0

    def prompt(messages: list[tuple[str, str]]) -> str:
        text = render(messages)
        return text[: len(text) - close]
    replies = prose if prose is not None else src
    assert src is not None and replies is not None

    def size(i: int) -> tuple[int, int]:  # (user, assistant) characters of ordinary turn i
        if same_shape:
            return 1200 + (i * 1531) % 2301, 260 + (i * 37) % 80
        return 150 + (i * 577) % 1350, 200 + (i * 911) % 1600

    if kind == "prose":
        system = "You are a thoughtful editor. Answer in plain prose.\n" + src.take(1500)
    elif code:
        system = "You are a careful assistant for Python code review. Answer in plain prose.\n" + replies.take(1500)
    else:
        system = "You are a careful assistant for Python code review.\n" + src.take(3000)
    messages: list[tuple[str, str]] = [("system", system)]
    per_token = 4.6 if code else 4.4 if kind == "prose" else 4.0  # characters per token, roughly
    window = int(sum(sum(size(i)) for i in range(turns)) / per_token)
    build_to = max(0, target_tokens - window // 2)
    previous = prompt(messages)
    n = count(previous)
    i = 0
    while n < build_to:
        if same_shape:  # the same shape all the way up
            user, reply = size(turns + i)
            messages.append(("user", src.take(user)))
        else:  # pasted files
            reply = 600
            messages.append(("user", "Please review this file:\n" + src.take(6000)))
        previous = prompt(messages)
        n = count(previous)
        messages.append(("assistant", replies.take(reply)))
        i += 1
    for t in range(turns):
        user, reply = size(t)
        messages.append(("user", src.take(user)))
        text = prompt(messages)
        yield Request(text, text[len(previous):] if text.startswith(previous) else text)
        previous = text
        messages.append(("assistant", replies.take(reply)))
