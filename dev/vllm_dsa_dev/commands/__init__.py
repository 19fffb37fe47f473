"""The dev commands of ``vllm-dsa`` (demo, make-model, bench ...): announced to the wheel's CLI through the
``vllm_dsa.dev`` entry point (dev/pyproject.toml), in the CLI's table format ``name -> (module, one-line help)``.
"""

from __future__ import annotations

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("vllm_dsa_dev.commands.demo", "run a prefill/decode pair with DSAConnector"),
    "make-model": ("vllm_dsa_dev.commands.make_model", "make a tiny random test model (mla or dsa)"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "transfer": ("vllm_dsa_dev.commands.bench_transfer", "NIXL scattered vs bounce vs gate"),
    "pd": ("vllm_dsa_dev.commands.bench_pd", "DSAConnector vs NixlConnector P/D pair"),
    "tokenizer": ("vllm_dsa_dev.commands.bench_tokenizer", "prefix token cache vs full encode"),
    "admission": ("vllm_dsa_dev.commands.bench_admission", "admission policies and overhead"),
    "serve": ("vllm_dsa_dev.commands.bench_serve", "vLLM's serving benchmark through the P/D proxy"),
    "report": ("vllm_dsa_dev.commands.bench_report", "docs/benchmarks.md tables and plots from dev/bench/results"),
}


def option_sections() -> list[tuple[str, type]]:
    """``(title, settings class)`` of the dev package's settings, after the wheel's in ``vllm-dsa options``."""
    from vllm_dsa_dev.tiny_models import ModelDirSettings
    from vllm_dsa_dev.tokenizer.assets import AssetSettings

    return [
        ("Tiny models (tests, demo, `vllm-dsa make-model`):", ModelDirSettings),
        ("Test tokenizers (`python -m vllm_dsa_dev.tokenizer.assets`):", AssetSettings),
    ]
