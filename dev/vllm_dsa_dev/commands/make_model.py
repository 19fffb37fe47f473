"""``vllm-dsa make-model``: write a tiny random test model (made locally and deterministically).

``--kind mla``: a DeepSeek-V2-architecture MLA model; ``--kind dsa``: a GLM-MoE-DSA model with the
indexer (IndexCache masking by ``--index-topk-freq``; ``--mtp-layers 1`` adds a DeepSeek MTP layer for
``--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'``). Both carry the DeepSeek tokenizer and a chat
template, and vLLM's CPU build runs them (DSA through the plugin's CPU backends). ``--kind dsa --width
deepseek-v3.2`` (or ``glm-5``) writes a slice at that model's per-layer widths instead, with ``--mtp-layers``
its MTP layer: config and tokenizer, no weights (``--load-format dummy``). Without ``--out`` the
model goes where the demo and tests look for it (``$VLLM_DSA_MODEL_DIR`` or ``~/.cache/vllm-dsa-connector``).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("--kind", choices=("mla", "dsa"), default="mla", help="model family (default mla)")
    p.add_argument("--out", type=Path, default=None, help="directory to write (default: the shared cache)")
    p.add_argument("--num-layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--index-topk-freq", type=int, default=2,
                   help="dsa: a layer computes its own top-k every N layers, the others reuse it (default 2)")
    p.add_argument("--index-topk", type=int, default=16, help="dsa: tokens each query attends to (default 16)")
    p.add_argument("--index-n-heads", type=int, default=16,
                   help="dsa: indexer heads (default 16; DeepGEMM's fp8 prefill MQA-logits kernel takes 32 or 64)")
    p.add_argument("--mtp-layers", type=int, default=0,
                   help="dsa: MTP (nextn) layers after the backbone, for MTP speculative decoding (default 0)")
    p.add_argument("--width", choices=("tiny", "deepseek-v3.2", "glm-5"), default="tiny",
                   help="dsa: layer widths; deepseek-v3.2 writes DeepSeek-V3.2's per-layer widths (hidden 7168, "
                        "128 heads, 64 indexer heads, top-k 2048, dense MLP), glm-5 GLM-5's (hidden 6144, 64 heads, "
                        "32 indexer heads, top-k 2048), as a config and tokenizer only: serve it with --load-format "
                        "dummy; --mtp-layers 1 adds their MTP layer (default tiny: random weights)")
    p.add_argument("--force", action="store_true", help="rewrite a complete existing model")


def run(args: argparse.Namespace) -> int:
    """Make the model and print its directory."""
    if args.num_layers < 1:
        print(f"vllm-dsa make-model: --num-layers must be >= 1, got {args.num_layers}")
        return 2
    if args.mtp_layers < 0 or (args.mtp_layers and args.kind != "dsa"):
        print(f"vllm-dsa make-model: --mtp-layers must be >= 0 and needs --kind dsa, got {args.mtp_layers} "
              f"with --kind {args.kind}")
        return 2
    if args.width != "tiny" and args.kind != "dsa":
        print(f"vllm-dsa make-model: --width {args.width} needs --kind dsa, got --kind {args.kind}")
        return 2
    if args.width != "tiny":
        from vllm_dsa_dev.tiny_models import default_model_root, make_config_model, slice_config

        mtp = f"-mtp{args.mtp_layers}" if args.mtp_layers else ""
        out = args.out or default_model_root() / f"{args.width}-slice-{args.num_layers}l{mtp}"
        print(make_config_model(out, slice_config(args.width, args.num_layers, args.mtp_layers), force=args.force))
        return 0
    if args.kind == "dsa":
        from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

        path = make_tiny_glm_dsa(args.out, num_layers=args.num_layers, index_topk_freq=args.index_topk_freq,
                                 index_topk=args.index_topk, index_n_heads=args.index_n_heads,
                                 num_mtp_layers=args.mtp_layers, force=args.force)
    else:
        from vllm_dsa_dev.tiny_models import make_tiny_mla

        path = make_tiny_mla(args.out, num_layers=args.num_layers, force=args.force)
    print(path)
    return 0
