"""The P/D proxy's request bodies and merged answers: pure functions over JSON objects (dicts).

What each leg is sent (:func:`prefill_body`, :func:`decode_body`; the ``kv_transfer_params`` themselves are
:mod:`vllm_dsa_connector.core.handoff.params`'s), which requests skip
P (:func:`needs_local_prefill`), how a prompt list is split (:func:`prompt_list`) and D's answers merged back
(:func:`merge_completions`), and the per-pair request id in vllm-router's form (:func:`pair_request_id`).
The rules are :mod:`vllm_dsa_connector.proxy.app`'s docstring ("Fields", the prompt-list split); they are kept
here, apart from the app's HTTP, timeouts and errors, so they can be read and tested without a server or
vLLM.
"""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlsplit

from vllm_dsa_connector.core.handoff.params import PrefillParams

__all__ = ["decode_body", "merge_completions", "needs_local_prefill", "pair_request_id", "prefill_body",
           "prompt_list"]

_PREFILL_DROP = frozenset({"best_of", "use_beam_search", "min_tokens", "min_completion_tokens",
                           "stream_options", "logprobs", "top_logprobs", "logprob_token_ids",
                           "prompt_logprobs", "echo"})


def _client_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body without the P/D-internal fields only the proxy may set."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if isinstance(xargs := out.get("vllm_xargs"), dict) and "kv_transfer_params" in xargs:
        out["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
    return out


def prefill_body(body: dict[str, Any], transfer_id: str = "") -> dict[str, Any]:
    """The prefill leg's body: one token, ``n=1``, no stream, the proxy's ``kv_transfer_params``
    (:class:`~vllm_dsa_connector.core.handoff.params.PrefillParams`; ``transfer_id``: early registration's)."""
    out = {k: v for k, v in _client_fields(body).items() if k not in _PREFILL_DROP}
    out.update(max_tokens=1, n=1, stream=False, kv_transfer_params=PrefillParams(transfer_id=transfer_id).to_dict())
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg's body: the client's request with exactly P's ``kv_transfer_params`` (or none)."""
    out = _client_fields(body)
    return {**out, "kv_transfer_params": params} if params else out


def _addr(url: str) -> str:
    """``host:port`` of a base URL (as vllm-router names an engine in its request ids)."""
    netloc = urlsplit(url).netloc
    return netloc.rsplit("@", 1)[-1] or url


def pair_request_id(prefill_url: str, decode_url: str) -> str:
    """A fresh request id for one P/D pair, in vllm-router's form:
    ``___prefill_addr_<P host:port>___decode_addr_<D host:port>_<32 hex digits>``."""
    return f"___prefill_addr_{_addr(prefill_url)}___decode_addr_{_addr(decode_url)}_{uuid.uuid4().hex}"


def needs_local_prefill(body: dict[str, Any], chat: bool) -> bool:
    """Whether the request asks for prompt logprobs (then D must compute the prompt itself)."""
    echo_lp = body.get("top_logprobs", 0) if chat else body.get("logprobs")
    return body.get("prompt_logprobs") is not None or (bool(body.get("echo")) and echo_lp is not None)


def prompt_list(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a ``/v1/completions`` body that holds several (strings or token lists), else ``None``
    (one string, one token list, or a list of one prompt: one P/D pair serves it)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2 or all(isinstance(t, int) for t in prompt):
        return None
    return prompt


def _sum_usage(a: Any, b: Any) -> Any:
    """Two ``usage`` objects added field by field (nested objects too; a field one lacks is the other's)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _sum_usage(a.get(k), b.get(k)) if k in a and k in b else a.get(k, b.get(k))
                for k in {**a, **b}}
    numbers = [x for x in (a, b) if isinstance(x, int | float) and not isinstance(x, bool)]
    if len(numbers) == 2:
        return a + b
    return a if a is not None else b


def merge_completions(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """D's answers to the prompts of one split request as one completion: prompt ``i``'s choice ``j`` has
    index ``i * n + j``, ``usage`` summed, every other field from the first answer."""
    out = dict(answers[0])
    choices = []
    usage: Any = None
    for i, answer in enumerate(answers):
        for choice in answer.get("choices") or []:
            c = dict(choice)
            c["index"] = i * n + int(c.get("index") or 0)
            choices.append(c)
        if answer.get("usage") is not None:
            usage = answer["usage"] if usage is None else _sum_usage(usage, answer["usage"])
    out["choices"] = sorted(choices, key=lambda c: c["index"])
    if usage is not None:
        out["usage"] = usage
    return out
