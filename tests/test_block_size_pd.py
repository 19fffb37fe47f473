"""Issue 19 item 3: P and D with different KV block sizes, real vLLM CPU engines, DSAConnector.

Real servers (slow), one module-scoped pair per model kind, both ``kv_both`` so each engine is P for one
direction and D for the other:

- ``dsa``: the tiny GLM-MoE-DSA model (``index_topk_freq=2``: indexer pages of layers 0, 1, 3 travel) on the
  plugin's CPU_DSA_SPARSE_MLA backend, which accepts any block size (``MultipleOf(1)``), float32, prefix
  caching on: engine ``b64`` runs ``--block-size 64``, engine ``b16`` ``--block-size 16``. Directions
  P64 -> D16 and P16 -> D64. The engines register MLA latent and indexer K in two pools, so a writer's runs
  are two (source pool, destination pool) parts; D16 runs ``bounce_mode=always``, so D routes every load into
  it through one staging slot holding both parts (``core.handoff.routes``), which P gathers and writes once and
  D16 scatters part by part; D64 never bounces. A request goes one path, whole. The reference ("one
  engine") is P's own plain request, made before P's prefill leg: so each direction also compares the two
  block sizes' engines.
- ``amx_mla``: the tiny MLA model, bf16, AMX_MLA at ``--block-size 32`` as P, CPU_MLA (block 16) as D;
  the reference is D's own plain request (vLLM CPU turns prefix caching off for CPU_MLA, so it does not
  see the transferred KV). Needs AMX tiles (``amx_tile`` in /proc/cpuinfo): skipped elsewhere.

Each direction is a 3-turn conversation of token ids (turn k+1 = turn k's prompt + D's reply + new
tokens): D's greedy tokens must equal the reference's every turn; from turn 2 the DSA decode engine serves
the first blocks from its own prefix cache and loads only the rest. D's received bytes must be exactly the
loaded token span (whole chunks of gcd(Bp, Bd) = 16 tokens) times the bytes per token of every page (4 MLA
latent rows + 3 indexer rows): a wrong mapping of P's pages onto D's would either change the decode or
these counts. ``verify_transfers`` checksums every run on D; no load may fail.
Run under the engine lock: ``flock /tmp/vllm-dsa-engine.lock pytest -m slow tests/test_block_size_pd.py``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from vllm_dsa_dev.harness.client import complete, metric, scrape
from vllm_dsa_dev.harness.engines import (
    Engine,
    choose_backend,
    connector_config,
    engine_env,
    start_engine,
)
from vllm_dsa_dev.harness.procs import cluster

pytestmark = pytest.mark.slow

TURNS = 3
MAX_TOKENS = 8
CHUNK = 16  # gcd of the block sizes of every pair below
LEAN = {"prefault_kv_cache": False, "bounce_arena_bytes": 32 << 20}


@dataclass(frozen=True)
class Side:
    """One engine of a kind: its block size, attention backend request and bounce options."""

    label: str
    block: int
    backend: str
    bounce: dict[str, Any]


@dataclass(frozen=True)
class Kind:
    """One tiny model, its two engines, the directions run and how the reference is taken."""

    name: str
    dtype: str
    sides: tuple[Side, Side]
    directions: tuple[tuple[str, str], ...]
    token_bytes: int  # KV bytes per token over every transferred page (all layers, both roles)
    reference_on_p: bool  # the reference is P's plain request (else D's)
    prefix_hits: bool  # D has prefix caching (CPU_MLA runs without it)


KINDS = {
    "dsa": Kind("dsa", "float32",
                (Side("b64", 64, "auto", {"bounce_mode": "auto", "bounce_min_runs": 1 << 40}),
                 Side("b16", 16, "auto", {"bounce_mode": "always"})),
                (("b64", "b16"), ("b16", "b64")), 4 * 576 * 4 + 3 * (128 + 4), True, True),
    "amx_mla": Kind("amx_mla", "bfloat16",
                    (Side("amx32", 32, "AMX_MLA", {}), Side("cpu16", 16, "CPU_MLA", {})),
                    (("amx32", "cpu16"),), 4 * 576 * 2, False, False),
}


@dataclass
class Pair:
    """The started engines of one kind."""

    kind: Kind
    model: str
    engines: dict[str, Engine]
    start_s: float


def _has_amx_tiles() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module", params=list(KINDS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    kind = KINDS[request.param]
    if kind.name == "dsa":
        from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

        model = make_tiny_glm_dsa(index_topk_freq=2, index_topk=16)
    else:
        if not _has_amx_tiles():
            pytest.skip("no amx_tile in /proc/cpuinfo: vLLM runs AMX_MLA only on CPUs with AMX tiles, so the "
                        "AMX_MLA (block 32) / CPU_MLA (block 16) pair runs on AMX machines only")
        from vllm_dsa_dev.tiny_models import make_tiny_mla

        model = make_tiny_mla()
    with cluster(tmp_path_factory.mktemp(f"block-size-{kind.name}")) as c:
        t0 = time.monotonic()
        started = {}
        for core, side in enumerate(kind.sides):
            cfg = connector_config("kv_both", True, {**LEAN, **side.bounce}, free_port())
            cfg["kv_load_failure_policy"] = "fail"
            started[side.label] = start_engine(c, side.label, model, free_port(), kind.dtype, cfg,
                                               choose_backend(model, kind.dtype, side.backend),
                                               engine_env(str(core)), extra=["--block-size", str(side.block)])
        for e in started.values():
            e.ready(900, watch=[x.proc for x in started.values()])
        out = Pair(kind, str(model), started, time.monotonic() - t0)
        print(f"[block-size] {kind.name}: engines {list(started)} up in {out.start_s:.0f} s")
        yield out


def _counters(url: str) -> dict[str, float]:
    m = scrape(url)
    return {"recv_bytes": metric(m, "vllm:dsa_kv_bytes_total", side="recv"),
            "send_bytes": metric(m, "vllm:dsa_kv_bytes_total", side="send"),
            "bounce": metric(m, "vllm:dsa_kv_bounce_bytes_total"),
            "recv_ok": metric(m, "vllm:dsa_kv_requests_total", side="recv", outcome="ok"),
            "send_ok": metric(m, "vllm:dsa_kv_requests_total", side="send", outcome="ok")}


def _wait(url: str, key: str, at_least: float, what: str) -> dict[str, float]:
    deadline = time.monotonic() + 15  # stats reach /metrics with the engine's next step
    while (now := _counters(url))[key] < at_least:
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return now


DIRECTIONS = [("b64", "b16"), ("b16", "b64"), ("amx32", "cpu16")]


@pytest.mark.parametrize(("p_label", "d_label"), DIRECTIONS, ids=["P64-D16", "P16-D64", "AMX32-CPU16"])
def test_decode_identical_across_block_sizes(pair: Pair, p_label: str, d_label: str) -> None:
    kind = pair.kind
    if (p_label, d_label) not in kind.directions:
        pytest.skip(f"{kind.name}: not a direction of this pair ({', '.join(map('->'.join, kind.directions))})")
    p, d = pair.engines[p_label], pair.engines[d_label]
    bp = next(s.block for s in kind.sides if s.label == p_label)
    bd = next(s.block for s in kind.sides if s.label == d_label)
    rng = random.Random(DIRECTIONS.index((p_label, d_label)) + 19)
    new = lambda n: [rng.randrange(1000, 60000) for _ in range(n)]  # noqa: E731
    ids = new(2 * max(bp, bd) + 10)
    lines, hits, t0 = [], 0, time.monotonic()
    for turn in range(1, TURNS + 1):
        ref_url = p.url if kind.reference_on_p else d.url
        want = complete(ref_url, pair.model, ids, MAX_TOKENS)["choices"][0]["token_ids"]
        p0, d0 = _counters(p.url), _counters(d.url)
        first = complete(p.url, pair.model, ids, 1, {"do_remote_decode": True})
        params = first.get("kv_transfer_params")
        assert params and params.get("remote_block_ids"), first
        assert len(params["remote_block_ids"]) >= -(-len(ids) // bp), (params, bp)  # P's own block size
        got = complete(d.url, pair.model, ids, MAX_TOKENS, params)["choices"][0]["token_ids"]
        d1 = _wait(d.url, "recv_ok", d0["recv_ok"] + 1, f"{p_label}->{d_label} turn {turn}: D counted no load")
        p1 = _wait(p.url, "send_ok", p0["send_ok"] + 1, f"{p_label}->{d_label} turn {turn}: P counted no send")
        assert got == want, f"{p_label}->{d_label} turn {turn}: D decoded {got}, one engine {want}"
        moved = int(d1["recv_bytes"] - d0["recv_bytes"])
        assert moved == int(p1["send_bytes"] - p0["send_bytes"]) and moved % kind.token_bytes == 0, moved
        tokens = moved // kind.token_bytes
        end = -(-len(ids) // CHUNK) * CHUNK  # the span is copied in whole 16-token chunks
        hit = end - tokens  # D's own prefix-cache hit: whole D blocks
        assert 0 <= hit < len(ids) and hit % bd == 0, (turn, len(ids), tokens, bd)
        hits += hit > 0
        bounce = int(p1["bounce"] - p0["bounce"])
        routed = next(s.bounce for s in kind.sides if s.label == d_label).get("bounce_mode") == "always"
        assert bounce == (moved if routed else 0), (turn, bounce, moved)  # D's route, whole: both pools in one slot
        lines.append(f"turn {turn}: prompt {len(ids)} tok, D hit {hit} tok, loaded {tokens} tok = {moved:,} B "
                     f"({'bounce' if bounce else 'direct'})")
        ids = ids + got + new(max(bp, bd) // 2 + 3)
    if kind.prefix_hits:
        assert hits >= TURNS - 1, lines
    print(f"[block-size] {kind.name} P{bp}->D{bd} in {time.monotonic() - t0:.1f} s:\n  " + "\n  ".join(lines))


def test_no_load_failed_and_every_checksum_matched(pair: Pair) -> None:
    for label, eng in pair.engines.items():
        m = scrape(eng.url)
        assert metric(m, "vllm:dsa_kv_checksum_mismatches_total") == 0, label
        assert metric(m, "vllm:dsa_kv_requests_total", outcome="failed") == 0, label
        assert metric(m, "vllm:dsa_kv_requests_total", outcome="timeout") == 0, label
