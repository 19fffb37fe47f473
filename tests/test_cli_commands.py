"""Every ``vllm-dsa`` command listed in the CLI has its module, and ``--help`` works, run as a user would."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dsa_connector.cli import BENCHES, COMMANDS, build_parser


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_dsa_connector.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("table", [COMMANDS, BENCHES], ids=["commands", "benches"])
def test_every_listed_command_has_its_module(table: dict[str, tuple[str, str]]) -> None:
    missing = {name: mod for name, (mod, _) in table.items() if importlib.util.find_spec(mod) is None}
    assert not missing, f"CLI lists commands whose module does not exist: {missing}"
    for mod, _ in table.values():
        module = importlib.import_module(mod)
        assert callable(module.add_arguments) and callable(module.run), mod


def test_help_of_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` of every command and bench (one parser, as ``main`` builds it), and the top level for real."""
    top = _cli("--help")
    assert top.returncode == 0, top.stderr[-2000:]
    parser = build_parser()
    argvs = [[name] for name in COMMANDS] + [["bench", name] for name in BENCHES]
    for argv in argvs:
        assert argv[-1] in top.stdout or argv[0] == "bench", argv
        with pytest.raises(SystemExit) as done:
            parser.parse_args([*argv, "--help"])
        assert done.value.code == 0, argv
        assert f"usage: vllm-dsa {' '.join(argv)}" in capsys.readouterr().out, argv


def test_make_model_writes_a_loadable_model(tmp_path) -> None:
    """``make-model --kind mla`` writes a config vLLM's layout reader takes (``inspect`` prints its pools)."""
    out = _cli("make-model", "--kind", "mla", "--num-layers", "1", "--out", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr[-2000:]
    path = out.stdout.strip().splitlines()[-1]
    assert path == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").exists() and (tmp_path / "m" / ".complete").exists()
    again = _cli("make-model", "--kind", "mla", "--num-layers", "1", "--out", str(tmp_path / "m"))
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == path  # reused, not rewritten
    info = _cli("inspect", path, "--json")
    assert info.returncode == 0, info.stderr[-2000:]
    assert json.loads(info.stdout)["stages"][0]["layers"] == [0]
    bad = _cli("make-model", "--num-layers", "0")
    assert bad.returncode == 2 and "--num-layers" in bad.stdout


def test_make_model_dsa_with_an_mtp_layer(tmp_path) -> None:
    """``make-model --kind dsa --mtp-layers 1``: the MTP layer follows the backbone (global id 2 of a 2-layer
    model), owns its indexer, and its weights carry the names vLLM's DeepSeek MTP loader reads."""
    from safetensors import safe_open

    out = _cli("make-model", "--kind", "dsa", "--num-layers", "2", "--mtp-layers", "1", "--out", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr[-2000:]
    path = Path(out.stdout.strip().splitlines()[-1])
    info = _cli("inspect", str(path), "--json")
    assert info.returncode == 0, info.stderr[-2000:]
    model = json.loads(info.stdout)
    assert model["stages"][0]["layers"] == [0, 1, 2] and model["num_mtp_layers"] == 1, model
    assert 2 in model["owning_layers"], model
    with safe_open(str(path / "mtp.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.indexer.wk.weight"} <= names
    assert all(n.startswith("model.layers.2.") for n in names), names
    bad = _cli("make-model", "--kind", "mla", "--mtp-layers", "1")
    assert bad.returncode == 2 and "--mtp-layers" in bad.stdout


def test_make_model_deepseek_v32_width_slice(tmp_path) -> None:
    """``make-model --kind dsa --width deepseek-v3.2``: DeepSeek-V3.2's per-layer widths, dense MLPs, every layer
    owning its indexer, a config and tokenizer without weights (``--load-format dummy``)."""
    out = _cli("make-model", "--kind", "dsa", "--width", "deepseek-v3.2", "--out", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr[-2000:]
    path = Path(out.stdout.strip().splitlines()[-1])
    cfg = json.loads((path / "config.json").read_text())
    assert {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_n_heads",
                                "index_head_dim", "index_topk", "num_hidden_layers", "first_k_dense_replace")} == {
        "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "index_n_heads": 64,
        "index_head_dim": 128, "index_topk": 2048, "num_hidden_layers": 4, "first_k_dense_replace": 4}
    assert not list(path.glob("*.safetensors")) and (path / "tokenizer.json").exists()
    assert cfg["index_topk_freq"] == 1  # every layer owns its indexer, as in DeepSeek-V3.2
    bad = _cli("make-model", "--kind", "mla", "--width", "deepseek-v3.2")
    assert bad.returncode == 2 and "--width" in bad.stdout


def test_make_model_glm5_width_slice_with_its_mtp_layer(tmp_path) -> None:
    """``make-model --kind dsa --width glm-5 --mtp-layers 1``: GLM-5's per-layer widths (32 indexer heads, v 256,
    nope 192) and one MTP layer after the backbone, what vLLM serves with MTP speculative decoding."""
    out = _cli("make-model", "--kind", "dsa", "--width", "glm-5", "--num-layers", "2", "--mtp-layers", "1",
               "--out", str(tmp_path / "g"))
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = json.loads((Path(out.stdout.strip().splitlines()[-1]) / "config.json").read_text())
    assert {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "qk_nope_head_dim",
                                "v_head_dim", "index_n_heads", "index_topk", "intermediate_size", "vocab_size",
                                "num_hidden_layers", "num_nextn_predict_layers", "index_topk_freq")} == {
        "hidden_size": 6144, "num_attention_heads": 64, "q_lora_rank": 2048, "qk_nope_head_dim": 192,
        "v_head_dim": 256, "index_n_heads": 32, "index_topk": 2048, "intermediate_size": 12288,
        "vocab_size": 154880, "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "index_topk_freq": 1}
    v32 = _cli("make-model", "--kind", "dsa", "--width", "deepseek-v3.2", "--mtp-layers", "1", "--out",
               str(tmp_path / "v"))
    assert v32.returncode == 0, v32.stderr[-2000:]
    assert json.loads((tmp_path / "v" / "config.json").read_text())["num_nextn_predict_layers"] == 1
