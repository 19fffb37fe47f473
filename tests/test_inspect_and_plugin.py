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


def _check_block_map(out: dict, src_tables, dst_tables) -> None:
    """Every piece ``inspect`` shows is a part of one of ``PeerPlan.runs``' runs (same shift on both sides),
    stays in its view and layer, and each view's pieces cover the layer's part for the whole span once."""
    import math

    import numpy as np

    from vllm_dsa_connector.core.plan.peer_plan import PeerPlan

    peer = PeerPlan.build(src_tables, dst_tables)
    bp, bd = peer.src_block_size, peer.dst_block_size
    span = math.lcm(bp, bd)
    assert (out["src_block_size"], out["dst_block_size"], out["span_tokens"]) == (bp, bd, span)
    src, dst = {t.rank: t for t in src_tables}, {t.rank: t for t in dst_tables}
    runs = {(s, d): peer.runs(s, d, np.arange(span // bp), np.arange(span // bd), first_token=0, num_tokens=span)
            for s in src for d in dst}
    assert out["descriptors"] == sum(r.num_runs for v in runs.values() for _, _, r in v)
    layer = out["layer"]
    rows = {"mla": None, "indexer_k values": 128, "indexer_k scales": 4}
    assert set(out["views"]) == {"mla", "indexer_k values", "indexer_k scales"}
    for view, pieces in out["views"].items():
        covered: dict[int, list[tuple[int, int]]] = {}
        for p in pieces:
            assert (p["dst_view"], p["dst_layer"]) == (view, layer), p
            s, d = src[p["src_rank"]], dst[p["dst_rank"]]
            role = view.split()[0]
            se, de = s.view(role).entry(layer), d.view(role).entry(layer)
            (sp, dp, r), = [x for x in runs[(s.rank, d.rank)] if x[0] == s.view(role).pool]
            a = p["src_block"] * s.pools[sp].block_stride + se.offset + p["src_offset"]
            b = p["dst_block"] * d.pools[dp].block_stride + de.offset + p["dst_offset"]
            i = int(np.searchsorted(r.src_offsets, a, side="right")) - 1
            assert r.src_offsets[i] <= a and a + p["length"] <= r.src_offsets[i] + r.lengths[i], p
            assert b - r.dst_offsets[i] == a - r.src_offsets[i], p  # the same shift as the run's
            row = rows[view] or s.view(role).bytes_per_token
            assert p["length"] == (p["tokens"][1] - p["tokens"][0]) * row, p
            covered.setdefault(d.rank, []).append(tuple(p["tokens"]))
        for d_rank, spans in covered.items():
            spans.sort()
            assert spans[0][0] == 0 and spans[-1][1] == span, (view, d_rank, spans)
            assert all(x[1] == y[0] for x, y in zip(spans, spans[1:], strict=False)), (view, d_rank, spans)


def test_inspect_block_map_p64_d32_matches_peer_plan_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``inspect --src-block-size 64 --dst-block-size 32`` as a user runs it; the shown mapping is the plan's."""
    from vllm_dsa_connector.connector.page_tables import build_offline

    r = _vllm_dsa("inspect", str(EXAMPLE), "--src-block-size", "64", "--dst-block-size", "32", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["layer"] == 0
    # the block-split indexer page: D's scales start at 32 * 128, P's at 64 * 128
    assert [(p["src_offset"], p["dst_block"], p["dst_offset"]) for p in out["views"]["indexer_k scales"]] == [
        (8192, 0, 4096), (8192 + 128, 1, 4096)]
    _check_block_map(out, build_offline(EXAMPLE, block_size=64, num_blocks=3),
                     build_offline(EXAMPLE, block_size=32, num_blocks=4))
    from vllm_dsa_connector.cli import main

    assert main(["inspect", str(EXAMPLE), "--src-block-size", "64", "--dst-block-size", "32"]) == 0  # in process
    human = capsys.readouterr().out
    assert "P block 0 +8,320     -> D block 1 +4,096" in human and "!!" not in human


@pytest.mark.parametrize("bp,bd,p_tp,d_pp,layer", [(32, 64, 2, 1, 5), (16, 128, 1, 2, 77), (128, 48, 1, 1, 2)])
def test_block_map_matches_peer_plan_runs(bp, bd, p_tp, d_pp, layer) -> None:
    """``block_map`` (what ``inspect`` prints) under TP/PP reshard and a non-multiple pair, in process."""
    from vllm_dsa_connector.commands.inspect import block_map
    from vllm_dsa_connector.connector.page_tables import build_offline

    span = __import__("math").lcm(bp, bd)
    src = build_offline(EXAMPLE, tp_size=p_tp, block_size=bp, num_blocks=span // bp + 2)
    dst = build_offline(EXAMPLE, pp_size=d_pp, block_size=bd, num_blocks=span // bd + 2)
    out = block_map(src, dst, layer)
    if layer == 2:  # no indexer on layer 2 (freq 4, offset 2): MLA rows only
        assert set(out["views"]) == {"mla"}
        return
    _check_block_map(out, src, dst)
