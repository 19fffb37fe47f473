"""The ``vllm-dsa inspect`` command and the general-plugin entry point, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent / "vllm_dsa_connector" / "examples" / "glm5_2_shape.json"


def _vllm_dsa(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_dsa_connector.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_inspect_json_glm5_2_shape_pp2() -> None:
    r = _vllm_dsa("inspect", str(EXAMPLE), "--pp-size", "2", "--kv-cache-dtype", "fp8_ds_mla", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["owning_layers"] == [0, 1] + list(range(5, 78, 4))
    stages = out["stages"]
    assert [s["pp_rank"] for s in stages] == [0, 1]
    assert stages[0]["layers"] == list(range(39)) and stages[1]["layers"] == list(range(39, 78))
    for s in stages:
        pools = {p["role"]: p for p in s["pools"]}
        assert pools["mla"]["mapper"] == pools["indexer_k"]["mapper"] == "replicated"
        assert pools["indexer_k"]["rows"] == list(range(len(pools["indexer_k"]["layers"])))
        assert pools["mla"]["bytes_per_token"] == 656 * len(s["layers"])
        assert pools["indexer_k"]["bytes_per_token"] == 132 * len(pools["indexer_k"]["layers"])
    assert stages[1]["pools"][1]["layers"][0] == 41


def test_inspect_human_table() -> None:
    r = _vllm_dsa("inspect", str(EXAMPLE))
    assert r.returncode == 0, r.stderr
    assert "21 own an indexer" in r.stdout and "total bytes per token: 92,628" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["/does/not/exist"], "no such file"),
    (["{tmp}/llama.json"], "not an MLA/DSA model"),
    ([str(EXAMPLE), "--pp-size", "100"], "pp size 100"),
])
def test_inspect_bad_input_exits_2(tmp_path, args, message) -> None:
    (tmp_path / "llama.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
        "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 100, "intermediate_size": 128}))
    r = _vllm_dsa("inspect", *[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2
    assert message in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


def test_plugin_registers_connector_by_name_and_is_idempotent() -> None:
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "import vllm_dsa_connector\n"
        "load_general_plugins(); vllm_dsa_connector.register(); vllm_dsa_connector.register()\n"
        "from vllm_dsa_connector import plugin\n"
        "print(sorted(plugin._DONE) == sorted(name for name, _ in plugin.STEPS))\n"
        "print('DSAConnector' in KVConnectorFactory._registry)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    has_connector = (Path(__file__).parent.parent / "vllm_dsa_connector" / "connector").is_dir()
    every_step_ran, registered = r.stdout.strip().splitlines()[-2:]
    assert every_step_ran == "True", r.stderr[-3000:]  # a step that raised is logged and not marked done
    assert "registering" not in r.stderr, r.stderr[-3000:]
    assert registered == str(has_connector)
