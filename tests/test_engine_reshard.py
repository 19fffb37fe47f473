"""Issue 21 items 1 and 3: P and D with different TP/PP layouts, real vLLM CPU engines, DSAConnector.

Every engine is ``kv_both``, so one engine acts as P for one conversation and as D for another. The engines
of one model run together (a module-scoped engine set: every direction between them, then the counter check,
then the next set), the reference ("one engine") is P's own plain request made before its prefill leg:

- ``dsa`` (tiny GLM-MoE-DSA, ``index_topk_freq=2``: indexer layers 0, 1, 3 own their top-k, layer 2 shares;
  CPU_DSA_SPARSE_MLA, float32, block 64, prefix caching on): engines tp1, tp2 and pp2 (stages of 3 and 1
  layers, ``VLLM_PP_LAYER_PARTITION=3,1``: a top-k-sharing layer cannot start a stage); directions tp2->tp1,
  tp1->tp2, pp2->pp1, pp1->pp2.
- ``dsa_mtp``: the same backbone plus one MTP layer (layer 4, owns its indexer), run as the draft model of
  speculative decoding (``--speculative-config '{"method": "mtp", ...}'``, one token): engines tp1 and tp2;
  directions tp2->tp1, tp1->tp2. Not pp2: vLLM 0.32's V1 model runner (vLLM CPU's) cannot run MTP with
  pipeline parallelism (``patches/README.md``, "Not patched: MTP ... with pipeline parallelism"); the MTP layer under PP reshard is
  proven at worker level (``tests/test_connector_reshard.py``).
- ``mla`` (tiny DeepSeek-V2 MLA, CPU_MLA, float32, block 16): engines tp1 and tp2; directions tp2->tp1 and
  tp1->tp2. vLLM CPU turns prefix caching off for MLA unless AMX_MLA runs ("MLA is enabled on a non-GPU
  platform; forcing chunked prefill and prefix caching to be disabled."): there D recomputes nothing but
  gets every block from P each turn.

Two cores host each engine set (see the comment above ``DIRECTIONS``): ranks placed by the kernel. The ``dsa``
set runs cold (no warm-up request): its first directions are the first requests of a fresh tp2 D and a fresh
pp2 D (issue 29 item 9); the other sets warm each engine up with one plain request first. Every set has a 60 s
transfer timeout: with the other CI shard on the same two cores a fresh P engine was seen stalled for 30 s,
past the default give-up.

Each conversation has 3 turns (prompt token ids; turn k+1 = turn k's prompt + D's reply + new tokens), so
from turn 2 a DSA decode engine serves the first blocks from its own prefix cache and only the rest comes
from P. Per turn D's greedy tokens must equal the reference, and D's per-(P rank, D rank) byte counters
(``vllm:dsa_kv_pair_bytes_total``) must show every page moved exactly once by the expected rank:

- tp2 -> tp1: MLA latent and indexer pages are replicated over TP ranks: only the elected sender (P rank 0,
  ``core.plan.segments.elected_sender``) writes, rank 1 writes nothing; D gets ``blocks x (4 MLA + 3 indexer pages)``.
- tp1 -> tp2: P rank 0 writes a whole copy into each D rank.
- pp2 -> pp1 / pp1 -> pp2: stage 0 (layers 0-2) moves 3 MLA + 2 indexer pages per block, stage 1 (layer 3)
  1 MLA + 1 indexer page (with MTP: layers 3-4, 2 + 2): each owning layer's indexer page once.

On the DSA sets the KV probe (:mod:`vllm_dsa_dev.kv_probe`, ``collective_rpc``) then reads the last
turn's prompt blocks on every rank of P and D (block lists from each engine's own scheduler): every layer's
page, MTP layer included, must be the same bytes on D as on P. Byte checksums of a transfer prove only that
bytes arrived; this proves D holds what P computed, at the same positions, after P's MTP draft step wrote
its layer (vLLM runs the drafter after the target forward of the same step).

At the end P's send-side counters must equal D's receive-side ones per pair, with no failure or mismatch.
Run under the engine lock: ``flock /tmp/vllm-dsa-engine.lock pytest -m slow tests/test_engine_reshard.py``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import free_port
from vllm_dsa_dev.harness.client import complete, metric, probe_running, scrape
from vllm_dsa_dev.harness.engines import (
    Engine,
    Layout,
    choose_backend,
    connector_config,
    start_engine,
)
from vllm_dsa_dev.harness.procs import cluster, group_pids

from vllm_dsa_connector.connector.stats import DSAKVConnectorStats
from vllm_dsa_connector.core.worker.counters import pair_bytes, pair_key

TURNS = 3
MAX_TOKENS = 8
ROW = 576 * 4  # one float32 MLA latent row (kv_lora_rank 512 + rope 64)
INDEXER_ROW = 128 + 4  # fp8 indexer K + fp32 scale per token
PAIR = "vllm:dsa_kv_pair_bytes_total"
# Up to 3 worker processes on a 24 GB machine: no pre-faulted KV pools (2.3 GB resident per worker otherwise),
# a small bounce arena; a generous transfer time (a TP2 producer took 55 s to hand a push to its workers under
# load, past D's default 30 s give-up).
LEAN = {"prefault_kv_cache": False, "bounce_arena_bytes": 32 << 20, "transfer_timeout_s": 60.0}
COLD = LEAN  # "dsa" set: the same options, no warm-up request


@dataclass(frozen=True)
class Kind:
    """One tiny model and its engines (an engine set: started together, every direction between them)."""

    name: str
    block: int
    layouts: tuple[Layout, ...]
    layers: tuple[int, ...]  # global layer ids with KV pages (MTP layers after the backbone)
    owning: tuple[int, ...]  # layers whose indexer pages travel
    stages: tuple[tuple[int, ...], ...]  # layers per pipeline stage of a pp2 engine
    mtp: bool = False  # one MTP layer, run as the draft model of speculative decoding

    @property
    def prefix_caching(self) -> bool:
        """vLLM CPU keeps prefix caching on for DSA (our backend) only, not for MLA (see module docstring)."""
        return self.name.startswith("dsa")

    def page_bytes(self, layers: tuple[int, ...]) -> int:
        """Bytes per block of these layers' MLA pages plus their owning layers' indexer pages."""
        return self.block * (len(layers) * ROW + sum(x in self.owning for x in layers) * INDEXER_ROW)


# One engine set at a time (memory: ~4 GB per tp1 engine, ~5-6 GB per two-rank engine): every set starts its
# engines, runs every direction between them, checks the counters, and stops them before the next set.
KINDS = {
    "dsa": Kind("dsa", 64, (Layout(1, 1), Layout(2, 1), Layout(1, 2)), (0, 1, 2, 3), (0, 1, 3), ((0, 1, 2), (3,))),
    # the same backbone plus MTP layer 4 (owns its indexer; on the last PP stage), speculative decoding on;
    # TP only: vLLM 0.32's V1 runner cannot run MTP with pipeline parallelism (module docstring)
    "dsa_mtp": Kind("dsa_mtp", 64, (Layout(1, 1), Layout(2, 1)), (0, 1, 2, 3, 4), (0, 1, 3, 4),
                    ((0, 1, 2), (3, 4)), mtp=True),
    "mla": Kind("mla", 16, (Layout(1, 1), Layout(2, 1)), (0, 1, 2, 3), (), ((0, 1), (2, 3))),
}
PROBE = ["--worker-extension-cls", "vllm_dsa_dev.kv_probe.KVProbe"]
SPEC = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1})]


# Every engine process dumps all its threads' stacks to <stacks>/<pid>.txt on SIGUSR1 (diagnosing stalls).
SITECUSTOMIZE = """import faulthandler, os, signal
_f = open(os.path.join({out!r}, f"{{os.getpid()}}.txt"), "w")
faulthandler.register(signal.SIGUSR1, file=_f, all_threads=True)
"""
STALL_S = 25.0  # a D request still waiting after this: dump P's and D's stacks once


def _log_excerpt(eng: Engine, scan: int = 3000, keep: int = 35) -> str:
    """The last ``keep`` lines of the engine's log that are errors, warnings or DSAConnector lines."""
    lines = eng.proc.tail(scan).splitlines()
    hits = [x for x in lines if any(w in x for w in ("ERROR", "WARNING", "DSAConnector", "Traceback", "Error"))]
    return "\n".join(hits[-keep:])


def _dump_stacks(e: Engines, labels: tuple[str, ...]) -> str:
    """SIGUSR1 every process of these engines; a digest of where each process's threads are."""
    names = {}
    for label in labels:
        for pid in group_pids(e.by_label[label].proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60]
                os.kill(pid, signal.SIGUSR1)
                names[pid] = f"{label} {cmd}"
            except OSError:
                continue
    time.sleep(3)
    lines = []
    for pid, name in names.items():
        f = e.stacks / f"{pid}.txt"
        text = f.read_text(errors="replace") if f.exists() else ""
        lines.append(f"--- {name} (pid {pid}), {text.count('Thread 0x')} threads:")
        for block in text.split("\n\n"):
            frames = [x.strip() for x in block.splitlines() if x.strip().startswith("File")]
            if frames:
                lines.append("    " + " <- ".join(f.split("/")[-1] for f in frames[:4]))
    return "\n".join(lines)


def _rss_mb(pgid: int) -> float:
    """Resident memory of every process of group ``pgid`` (MiB)."""
    total = 0
    for pid in group_pids(pgid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # gone meanwhile
            continue
        total += next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")), 0)
    return total / 1024


@dataclass
class Engines:
    """The started engines of one set, all ``kv_both``."""

    name: str
    kind: Kind
    model: str
    by_label: dict[str, Engine]
    start_s: float
    stacks: Path
    rss_mb: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module", params=list(KINDS))
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    kind = KINDS[request.param]
    layouts = kind.layouts
    if kind.prefix_caching:
        from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

        model = make_tiny_glm_dsa(index_topk_freq=2, index_topk=16, num_mtp_layers=int(kind.mtp))
    else:
        from vllm_dsa_dev.tiny_models import make_tiny_mla

        model = make_tiny_mla()
    backend = choose_backend(model, "float32")
    work = tmp_path_factory.mktemp(f"reshard-{request.param}")
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(out=str(work / "stacks")))
    (work / "stacks").mkdir()
    ncpu = os.cpu_count() or 1
    with cluster(work) as c:
        t0 = time.monotonic()
        started = {}
        first_core = 0
        host_ranks = sum(x.world for x in layouts)  # more ranks than cores: placed by the kernel (Layout.bind)
        for layout in layouts:
            cfg = connector_config("kv_both", True, COLD if kind.name == "dsa" else LEAN, free_port())
            cfg["kv_load_failure_policy"] = "fail"
            env = {**layout.env(model, first_core, host_ranks), "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_SERVER_DEV_MODE": "1",  # POST /collective_rpc for the KV probe
                   "PYTHONPATH": os.pathsep.join(x for x in (str(site), os.environ.get("PYTHONPATH")) if x)}
            extra = layout.args() + PROBE + (SPEC if kind.mtp else [])
            started[layout.label] = start_engine(c, layout.label, model, free_port(), "float32", cfg, backend,
                                                 env, extra=extra)
            first_core = (first_core + layout.world) % ncpu
        for e in started.values():
            e.ready(900, watch=[x.proc for x in started.values()])
        out = Engines(request.param, kind, str(model), started, time.monotonic() - t0, stacks=work / "stacks")
        out.rss_mb = {k: round(_rss_mb(e.proc.pid)) for k, e in started.items()}
        print(f"[reshard] {request.param}: engines {list(started)} up in {out.start_s:.0f} s, RSS MiB {out.rss_mb}")
        # An engine's first forward with TP > 1 would compile vLLM's vocab-parallel embedding (torch.compile,
        # inductor: tens of seconds on 2 cores; harness.engine_env turns that off). The "dsa" set runs cold
        # (issue 29 item 9): its first direction, tp1 -> tp2, is the first request of a fresh tp2 D
        # (P tp1's first forward is the reference request), pp1 -> pp2 the first of a fresh pp2 D. The other
        # sets warm every engine up with one plain request, so that a compile never runs inside a transfer.
        if kind.name != "dsa":
            t1 = time.monotonic()
            for e in started.values():
                complete(e.url, str(model), list(range(1000, 1000 + kind.block)), 1)
            print(f"[reshard] {request.param}: first forward of each engine (warm-up) {time.monotonic() - t1:.0f} s")
        yield out


def _pairs(url: str, side: str) -> dict[tuple[int, int], float]:
    """``{(src_rank, dst_rank): bytes}`` of one side's pair counters on ``url``."""
    m = scrape(url)
    out: dict[tuple[int, int], float] = {}
    for key, val in m.items():
        if key.startswith(PAIR + "{") and f'side="{side}"' in key:
            src = int(key.split('src_rank="')[1].split('"')[0])
            dst = int(key.split('dst_rank="')[1].split('"')[0])
            out[(src, dst)] = out.get((src, dst), 0.0) + val
    return out


def _delta(after: dict[tuple[int, int], float], before: dict[tuple[int, int], float]) -> dict[tuple[int, int], int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v - before.get(k, 0.0)}


def _expected(kind: Kind, p: Layout, d: Layout, blocks: int) -> dict[tuple[int, int], int]:
    """Bytes per (P rank, D rank) for ``blocks`` blocks: replicated TP ranks send through the elected
    rank (``dst_rank % tp`` of P: D rank 0 -> P rank 0); PP stages send their own layers."""
    if p.world == 1 and d.world == 1:
        return {(0, 0): blocks * kind.page_bytes(kind.layers)}
    if p.tp == 2:  # D tp1 rank 0 is fed by P's elected rank 0 only
        return {(0, 0): blocks * kind.page_bytes(kind.layers)}
    if d.tp == 2:  # every D rank holds all layers: a whole copy each, from P's only rank
        return {(0, r): blocks * kind.page_bytes(kind.layers) for r in range(2)}
    if p.pp == 2:
        return {(s, 0): blocks * kind.page_bytes(kind.stages[s]) for s in range(2)}
    return {(0, s): blocks * kind.page_bytes(kind.stages[s]) for s in range(2)}


def _run_direction(e: Engines, p_label: str, d_label: str, seed: int) -> list[str]:
    """The 3-turn conversation P -> D; returns one line per turn (asserts inside)."""
    kind = e.kind
    p, d = e.by_label[p_label], e.by_label[d_label]
    p_layout = next(x for x in kind.layouts if x.label == p_label)
    d_layout = next(x for x in kind.layouts if x.label == d_label)
    ref_engine = p  # "one engine": P's own plain request, made before its prefill leg
    rng = random.Random(seed)
    new = lambda n: [rng.randrange(1000, 60000) for _ in range(n)]  # noqa: E731
    ids = new(2 * kind.block + 10)
    lines = []
    hits = 0
    drafts0 = metric(scrape(d.url), "vllm:spec_decode_num_drafts_total")
    for turn in range(1, TURNS + 1):
        want = complete(ref_engine.url, e.model, ids, MAX_TOKENS)["choices"][0]["token_ids"]
        before = _pairs(d.url, "recv")
        ok0 = metric(scrape(d.url), "vllm:dsa_kv_requests_total", side="recv", outcome="ok")
        first = complete(p.url, e.model, ids, 1, {"do_remote_decode": True})
        params = first.get("kv_transfer_params")
        assert params and params.get("remote_block_ids"), first
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, d.url, e.model, ids, MAX_TOKENS, params)
            try:
                got = fut.result(timeout=STALL_S)["choices"][0]["token_ids"]
            except FutureTimeout:
                digest = _dump_stacks(e, (p_label, d_label))
                print(f"[reshard] {p_label}->{d_label} turn {turn}: D still waiting after {STALL_S} s; stacks:\n"
                      + digest, flush=True)
                got = fut.result()["choices"][0]["token_ids"]
        deadline = time.monotonic() + 30  # a starved engine went 25 s without a step in CI (two shards, 2 cores)
        # every D rank counts its own load, possibly in different engine steps
        while metric(scrape(d.url), "vllm:dsa_kv_requests_total", side="recv", outcome="ok") < ok0 + d_layout.world:
            assert time.monotonic() < deadline, f"{p_label}->{d_label} turn {turn}: D ranks did not all count a load"
            time.sleep(0.2)
        moved = _delta(_pairs(d.url, "recv"), before)
        assert got == want, f"{p_label}->{d_label} turn {turn}: D decoded {got}, one engine {want}"
        per_block = sum(_expected(kind, p_layout, d_layout, 1).values())
        total = sum(moved.values())
        assert total > 0 and total % per_block == 0, (turn, moved, per_block)
        blocks = total // per_block
        assert moved == _expected(kind, p_layout, d_layout, blocks), (
            f"{p_label}->{d_label} turn {turn}: bytes per (P rank, D rank) {moved}, expected "
            f"{_expected(kind, p_layout, d_layout, blocks)} ({blocks} block(s))")
        prompt_blocks = -(-len(ids) // kind.block)
        assert blocks <= prompt_blocks, (blocks, prompt_blocks)
        hits += blocks < prompt_blocks
        lines.append(f"turn {turn}: prompt {len(ids)} tok, {blocks}/{prompt_blocks} block(s) moved {moved}")
        last, ids = ids, ids + got + new(kind.block // 2 + 3)
    if kind.prefix_caching:  # D served the first blocks itself from turn 2; D's cache holds what P computed
        assert hits >= TURNS - 1, lines
        lines.append(_check_pages_equal(e, p, d, last))
    if kind.mtp:  # D ran the MTP draft layer on the pages it got (draft tokens of a random MTP layer: rejected)
        drafts = metric(scrape(d.url), "vllm:spec_decode_num_drafts_total") - drafts0
        assert drafts > 0, f"{p_label}->{d_label}: D made no MTP drafts"
        lines.append(f"D made {drafts:.0f} MTP drafts")
    return lines


def _check_pages_equal(e: Engines, p: Engine, d: Engine, ids: list[int]) -> str:
    """Every layer's page of every full block of ``ids`` (a prompt D got from P, whole or after its own
    prefix-cache hit) is the same bytes on every D rank holding that layer as on every P rank holding it,
    read through ``collective_rpc`` by the KV probe (block lists from each engine's own scheduler).

    With MTP (an EAGLE-type drafter) vLLM drops the last block of a prefix-cache hit ("EAGLE groups ... match and
    drop back", ``kv_cache_coordinator.replay_boundaries``): each probe request recomputes that block locally
    (TP numerics differ from layer 1 on), so only the blocks before it are compared there."""
    full = (len(ids) - 1) // e.kind.block
    checked = full - 1 if e.kind.mtp else full
    assert checked >= 1, (len(ids), full)

    def by_layer(entries: list[dict]) -> dict[str, list[tuple[int, list[int]]]]:
        out: dict[str, list[tuple[int, list[int]]]] = {}
        for rank, entry in enumerate(entries):
            for name, digests in entry["layer_digests"].items():
                out.setdefault(name, []).append((rank, digests))
        return out

    on_p = by_layer(probe_running(p.url, e.model, ids))
    on_d = by_layer(probe_running(d.url, e.model, ids))
    assert set(on_p) == set(on_d), (sorted(on_p), sorted(on_d))
    for name in sorted(on_p):
        ref_rank, ref = on_p[name][0]
        assert len(ref) == full, (name, len(ref), full)
        for side, ranks in (("P", on_p[name][1:]), ("D", on_d[name])):
            for rank, digests in ranks:
                bad = [j for j in range(checked) if digests[j] != ref[j]]
                assert not bad, (f"layer {name}: blocks {bad} on {side} rank {rank} differ from P rank {ref_rank}'s "
                                 f"(positions {[(j * e.kind.block, (j + 1) * e.kind.block) for j in bad]})")
    layers = sorted({int(n.split("layers.")[1].split(".")[0]) for n in on_p})
    assert tuple(layers) == e.kind.layers, (layers, sorted(on_p))
    return f"pages equal on P and D: {len(on_p)} KV layers (layers {layers}) x {checked} full block(s)"


# Two cores (2026-12-02). Three causes made the first P/D request of a fresh pair fail (a side channel unanswered
# for 10-120 s, a WRITE timed out, a lease expired), each fixed where it lives:
# - the D worker's receiver progressed NIXL every 0.2 ms, i.e. burnt a core per waiting worker (now growing to
#   2 ms: core/worker/receiving.py);
# - idle engines stepped every 1 ms while only waiting on the peer, each step a round trip through every worker
#   (now paced, 1 -> 2/20 ms, woken by side-channel messages: connector/pacing.py);
# - three ranks bound to two cores put two workers on one core while the kernel could not move them to the
#   other; P's processes waited there for tens of seconds (Layout.bind: unbound when the host's ranks outnumber
#   its cores);
# and a tp2 engine compiles vLLM's vocab-parallel embedding on its first forward (the warm-up above).
DIRECTIONS = [
    pytest.param("tp1", "tp2", id="tp1-tp2"),
    pytest.param("tp1", "pp2", id="pp1-pp2"),
    pytest.param("tp2", "tp1", id="tp2-tp1"),
    pytest.param("pp2", "tp1", id="pp2-pp1"),
]
_FAILED: set[tuple[str, str, str]] = set()  # directions that failed (their load failures are expected)
SEEDS = {("tp1", "tp2"): 12, ("tp1", "pp2"): 14, ("tp2", "tp1"): 11, ("pp2", "tp1"): 13}


@pytest.mark.slow
@pytest.mark.parametrize(("p_label", "d_label"), DIRECTIONS)
def test_reshard_decode_identical_and_pages_moved_once(engines: Engines, p_label: str, d_label: str) -> None:
    if p_label not in engines.by_label or d_label not in engines.by_label:
        pytest.skip(f"{engines.kind.name}: no {p_label}/{d_label} engine in this set (pp2 only in set 'dsa': "
                    "vLLM 0.32 runs no MTP with PP, and MLA's tp pair covers its layout)")
    seed = SEEDS[(p_label, d_label)]
    t0 = time.monotonic()
    try:
        lines = _run_direction(engines, p_label, d_label, seed)
    except Exception:
        _FAILED.add((engines.name, p_label, d_label))
        for label in (p_label, d_label):  # what the engines said: a 500 from D names its reason only there
            print(f"[reshard] {label} log, connector/error lines:\n{_log_excerpt(engines.by_label[label])}")
        raise
    print(f"[reshard] {engines.name} {p_label}->{d_label} in {time.monotonic() - t0:.1f} s:\n  "
          + "\n  ".join(lines))


@pytest.mark.slow
def test_send_and_receive_counters_agree(engines: Engines) -> None:
    """After every direction ran: per pair, what P ranks sent equals what D ranks received; nothing failed."""
    deadline = time.monotonic() + 30
    while True:  # P's send stats reach /metrics with P's next engine step
        sent: dict[tuple[int, int], float] = {}
        recv: dict[tuple[int, int], float] = {}
        for eng in engines.by_label.values():
            for k, v in _pairs(eng.url, "send").items():
                sent[k] = sent.get(k, 0) + v
            for k, v in _pairs(eng.url, "recv").items():
                recv[k] = recv.get(k, 0) + v
        if sent == recv or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert recv and sent == recv, (sent, recv)
    failed = sorted(x for x in _FAILED if x[0] == engines.name)
    for eng in engines.by_label.values():
        m = scrape(eng.url)
        assert metric(m, "vllm:dsa_kv_checksum_mismatches_total") == 0
        if not failed:
            assert metric(m, "vllm:dsa_kv_requests_total", outcome="failed") == 0
            assert metric(m, "vllm:dsa_kv_requests_total", outcome="timeout") == 0
    print(f"[reshard] {engines.name}: engine start {engines.start_s:.0f} s, RSS MiB {engines.rss_mb}, "
          f"pairs {json.dumps({f'{s}->{d}': int(v) for (s, d), v in sorted(recv.items())})}, failed {failed}")


def test_pair_bytes_counters_aggregate_across_workers() -> None:
    a, b = DSAKVConnectorStats(), DSAKVConnectorStats()
    a.add_pair_bytes("send", 0, 0, 100)
    b.add_pair_bytes("send", 0, 0, 50)
    b.add_pair_bytes("send", 1, 0, 7)
    a.aggregate(b)
    assert pair_bytes(a.data) == {("send", 0, 0): 150, ("send", 1, 0): 7}
    assert pair_key("recv", 1, 2) == "pair_bytes:recv:1:2"
    with pytest.raises(ValueError, match="'sideways'.*send"):
        pair_key("sideways", 0, 0)
    assert pair_bytes(a.clone_and_reset().data) and not pair_bytes(a.data)


def test_expected_bytes_per_pair() -> None:
    dsa = KINDS["dsa"]
    per = dsa.page_bytes(dsa.layers)
    assert per == 64 * (4 * ROW + 3 * INDEXER_ROW)
    assert _expected(dsa, Layout(2, 1), Layout(1, 1), 2) == {(0, 0): 2 * per}
    assert _expected(dsa, Layout(1, 1), Layout(2, 1), 1) == {(0, 0): per, (0, 1): per}
    pp = _expected(dsa, Layout(1, 2), Layout(1, 1), 1)
    assert pp == {(0, 0): 64 * (3 * ROW + 2 * INDEXER_ROW), (1, 0): 64 * (ROW + INDEXER_ROW)}
    assert sum(pp.values()) == per  # each owning layer's indexer page once
    assert _expected(dsa, Layout(1, 1), Layout(1, 2), 1) == {(0, 0): pp[(0, 0)], (0, 1): pp[(1, 0)]}
    mtp = KINDS["dsa_mtp"]  # MTP layer 4 rides on the last stage with its own indexer page
    pp = _expected(mtp, Layout(1, 2), Layout(1, 1), 1)
    assert pp == {(0, 0): 64 * (3 * ROW + 2 * INDEXER_ROW), (1, 0): 64 * (2 * ROW + 2 * INDEXER_ROW)}
    assert sum(pp.values()) == mtp.page_bytes(mtp.layers) == 64 * (5 * ROW + 4 * INDEXER_ROW)
