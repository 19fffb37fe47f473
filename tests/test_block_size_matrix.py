"""P and D with different KV block sizes: ``PeerPlan.runs`` proven byte for byte (issue 19, item 1).

The simulation is independent of the planner's arithmetic. Page tables come from vLLM's own spec and
allocation code (``connector.page_tables.build_offline``, as in ``tests/test_matching.py``); every byte of every source
pool is labelled with what it means, computed here from the page-table model alone::

    label = (role, global layer, token position, page part, byte within the token's row of that part)

(rank-independent: TP replicas and PP stages hold the same labels for the same KV). MLA latent pages are
token rows (``[B x bytes_per_token]``); indexer pages are block-split (``[B x values][B x scales]``, values
``index_head_dim`` bytes per token), so values and scales carry different part labels. The runs a plan
gives for a request are applied with numpy copies between those labelled pools, every source rank to
every destination rank, counting the writes of every destination byte. Then every byte of every
destination pool is checked: each (role, layer, token) the destination rank holds and the request copies
is written exactly once with the right label, nothing else is written (bytes of D's prefix-cache hits
before ``first_token``, of tokens past the span, of blocks not listed, padding: untouched).

The matrix: every pair of 16/32/64/128 tokens per block on P and D, for the masked GLM-DSA layouts
(``index_topk_freq`` 2 + MTP, freq 4, an ``index_topk_pattern`` with a fully masked PP stage), each with
three requests (no D hit and blocks in order; a D prefix hit that is not a multiple of P's block size,
blocks shuffled; the same with ``num_tokens=None``), on a prompt that is a multiple of neither block size;
and PP/TP reshard on top (P tp2 -> D tp1, P pp2 -> D pp1, P tp1 -> D tp2, P pp1 -> D pp3, P pp2 tp2 -> D
pp3) for every block-size pair of one layout and the unequal pairs of the others.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import numpy as np
import pytest
from vllm_dsa_dev.tiny_models import glm_dsa_config

from vllm_dsa_connector.connector.page_tables import build_offline
from vllm_dsa_connector.core.plan.pages import PageFormat, PageTable, Role
from vllm_dsa_connector.core.plan.pairing import pair_blocks_by_position
from vllm_dsa_connector.core.plan.peer_plan import PeerPlan, expand_runs

MODELS = {
    "freq2_mtp": dict(num_layers=9, index_topk_freq=2, index_skip_topk_offset=1, num_nextn_predict_layers=1),
    "freq4": dict(num_layers=9, index_topk_freq=4, index_skip_topk_offset=1),
    "pattern": dict(num_layers=9, index_topk_pattern="FFFSSSFFF"),  # pp3: the middle stage owns none
}
SIZES = (16, 32, 64, 128)
PROMPT = 293  # 18 * 16 + 5: a multiple of no block size
SPARE_BLOCKS = 3  # more blocks than the request needs: unlisted blocks must stay untouched
UNTOUCHED = -7  # a destination byte nobody wrote
PADDING = -1  # a source byte that is no token's (between pages)
ROLE_ID = {Role.MLA: 0, Role.INDEXER_K: 1}
LABEL = np.int32  # 1 + 4 + 10 + 1 + 10 bits: layers < 16, tokens < 1024, row bytes < 1024
# Narrow MLA rows (kv_lora_rank 64 + rope 16: 160 B/token, like the indexer's 132) keep the simulation fast;
# the indexer keeps GLM's 128 fp8 values + one fp32 scale per token.
NARROW = dict(kv_lora_rank=64, qk_rope_head_dim=16)


@cache
def tables(model: str, pp: int, tp: int, block_size: int) -> tuple[PageTable, ...]:
    kw = dict(MODELS[model])
    cfg = glm_dsa_config(kw.pop("num_layers"), **kw, **NARROW)
    num_blocks = -(-PROMPT // block_size) + SPARE_BLOCKS
    return tuple(build_offline(cfg, pp_size=pp, tp_size=tp, block_size=block_size, num_blocks=num_blocks))


@cache
def peer_plan(model: str, p: tuple[int, int], d: tuple[int, int], bp: int, bd: int) -> PeerPlan:
    return PeerPlan.build(tables(model, *p, bp), tables(model, *d, bd))


# -- the oracle: what a byte means, from the page-table model alone ------------------------------------


def label(role: int, layer: int, pos: np.ndarray, part: int, k: np.ndarray) -> np.ndarray:
    """One label per (role, layer, token, page part, byte of the part's row); unique, never negative."""
    return ((((role * 16 + layer) * 1024 + pos[:, None]) * 2 + part) * 1024 + k[None, :]).astype(LABEL)


def token_bytes(table: PageTable, blocks: np.ndarray, first_pos: int, positions: np.ndarray):
    """Yield ``(pool, addresses, labels)`` of every byte of ``positions`` in ``table``'s pages, where
    ``blocks[i]`` holds tokens ``[first_pos + i * B, +B)`` (``first_pos`` a multiple of ``B``)."""
    b = table.block_size
    blk = blocks[(positions - first_pos) // b]
    slot = positions % b
    for v in table.views:
        stride = table.pools[v.pool].block_stride
        if v.page_format is PageFormat.TOKEN_ROWS:
            parts = [(0, 0, v.bytes_per_token)]  # (part, offset of the part in the page, row bytes)
        else:
            values = table.model.index_head_dim
            parts = [(0, 0, values), (1, b * values, v.bytes_per_token - values)]
        for e in v.entries:
            assert e.nbytes == b * v.bytes_per_token, (table.rank, v.role, e)
            for part, part_off, row in parts:
                k = np.arange(row, dtype=np.int64)
                addr = (blk * stride + e.offset + part_off + slot * row)[:, None] + k[None, :]
                yield v.pool, addr.ravel(), label(ROLE_ID[v.role], e.global_layer, positions, part, k).ravel()


def source_memory(table: PageTable, blocks: np.ndarray, first_pos: int) -> list[np.ndarray]:
    """P's pools: listed blocks labelled by token, other blocks by a negative per-block label, padding -1."""
    mem = []
    for p in table.pools:
        m = np.full(p.nbytes, PADDING, LABEL)
        for blk in range(p.num_blocks):
            m[blk * p.block_stride:(blk + 1) * p.block_stride] = -100 - blk
        mem.append(m)
    for v in table.views:  # page bytes of unlisted blocks: negative, but not "padding"
        pool = table.pools[v.pool]
        for e in v.entries:
            for blk in range(pool.num_blocks):
                if blk not in blocks:
                    mem[v.pool][blk * pool.block_stride + e.offset:][:e.nbytes] = -1000 - blk
    positions = np.arange(first_pos, first_pos + blocks.size * table.block_size, dtype=np.int64)
    for pool, addr, lab in token_bytes(table, blocks, first_pos, positions):
        mem[pool][addr] = lab
    return mem


def expected_memory(table: PageTable, blocks: np.ndarray, first_pos: int, start: int, end: int) -> list[np.ndarray]:
    """D's pools after the request: tokens ``[start, end)`` labelled, every other byte untouched."""
    mem = [np.full(p.nbytes, UNTOUCHED, LABEL) for p in table.pools]
    for pool, addr, lab in token_bytes(table, blocks, first_pos, np.arange(start, end, dtype=np.int64)):
        mem[pool][addr] = lab
    return mem


# -- the simulation ---------------------------------------------------------------------------------------


def simulate(peer: PeerPlan, src_blocks, dst_blocks, first_token: int, num_tokens: int | None):
    """Apply ``peer.runs`` of every (source rank, destination rank) pair; (D memories, write counts, runs)."""
    bp = peer.src_tables[0].block_size
    src_mem = {t.rank: source_memory(t, src_blocks, first_token // bp * bp) for t in peer.src_tables}
    dst_mem = {t.rank: [np.full(p.nbytes, UNTOUCHED, LABEL) for p in t.pools] for t in peer.dst_tables}
    writes = {t.rank: [np.zeros(p.nbytes, np.int8) for p in t.pools] for t in peer.dst_tables}
    num_runs = 0
    for s, d in itertools.product(peer.src_tables, peer.dst_tables):
        for sp, dp, runs in peer.runs(s.rank, d.rank, src_blocks, dst_blocks, first_token=first_token,
                                      num_tokens=num_tokens):
            num_runs += runs.num_runs
            sm, dm, wm = src_mem[s.rank][sp], dst_mem[d.rank][dp], writes[d.rank][dp]
            for so, do, n in zip(runs.src_offsets.tolist(), runs.dst_offsets.tolist(), runs.lengths.tolist(),
                                 strict=True):
                assert n > 0 and 0 <= so and so + n <= sm.size and 0 <= do and do + n <= dm.size, (so, do, n)
                dm[do:do + n] = sm[so:so + n]
                wm[do:do + n] += 1
    return dst_mem, writes, num_runs


def _describe(table: PageTable, pool: int, byte: int, blocks: np.ndarray, first_pos: int) -> str:
    """Where a destination byte is: block, role, layer, token (for failure messages)."""
    p = table.pools[pool]
    blk, off = divmod(byte, p.block_stride)
    where = f"block {blk} (not listed)" if blk not in blocks else \
        f"block {blk} (tokens {first_pos + int(np.where(blocks == blk)[0][0]) * table.block_size}+)"
    for v in table.views:
        for e in v.entries:
            if v.pool == pool and e.offset <= off < e.offset + e.nbytes:
                return f"rank {table.rank} pool {pool} {where} {v.role.value} layer {e.global_layer} byte {off - e.offset}"
    return f"rank {table.rank} pool {pool} {where} padding byte {off}"


def check_request(peer: PeerPlan, src_blocks, dst_blocks, first_token: int, num_tokens: int | None) -> int:
    """Simulate one request and check every destination byte; the number of runs."""
    bp, bd = peer.src_tables[0].block_size, peer.dst_tables[0].block_size
    g = math.gcd(bp, bd)
    if num_tokens is None:
        end = min((first_token // bp + len(src_blocks)) * bp, (first_token // bd + len(dst_blocks)) * bd)
    else:
        end = first_token + -(-num_tokens // g) * g
    got, writes, num_runs = simulate(peer, src_blocks, dst_blocks, first_token, num_tokens)
    for d in peer.dst_tables:
        want = expected_memory(d, dst_blocks, first_token // bd * bd, first_token, end)
        for pool, (w, m, n) in enumerate(zip(want, got[d.rank], writes[d.rank], strict=True)):
            should = (w != UNTOUCHED).astype(np.int8)
            bad = np.flatnonzero((n != should) | (m != w))
            if bad.size:
                i = int(bad[0])
                raise AssertionError(
                    f"P{bp}->D{bd} first_token={first_token} num_tokens={num_tokens}: {bad.size} wrong bytes, "
                    f"first at {_describe(d, pool, i, dst_blocks, first_token // bd * bd)}: written {int(n[i])}x "
                    f"(want {int(should[i])}x), label {int(m[i])} (want {int(w[i])})")
    return num_runs


def requests(bp: int, bd: int, seed: int):
    """(src_blocks, dst_blocks, first_token, num_tokens) of three requests on a PROMPT-token prompt."""
    rng = np.random.default_rng(seed)
    n_src_pool, n_dst_pool = -(-PROMPT // bp) + SPARE_BLOCKS, -(-PROMPT // bd) + SPARE_BLOCKS
    hit = bd * (3 if bd < 64 else 1)  # D's prefix-cache hit: whole D blocks, not whole P blocks if bp > bd
    out = []
    for first, num, shuffled in ((0, PROMPT, False), (hit, PROMPT - hit, True), (hit, None, True)):
        n_src = -(-PROMPT // bp) - first // bp
        n_dst = -(-PROMPT // bd) - first // bd
        if shuffled:
            src = rng.permutation(n_src_pool)[:n_src]
            dst = rng.permutation(n_dst_pool)[:n_dst]
        else:
            src, dst = np.arange(1, n_src + 1), np.arange(2, n_dst + 2)
        out.append((src.astype(np.int64), dst.astype(np.int64), first, num))
    return out


PAIRS = list(itertools.product(SIZES, SIZES))
ODD_PAIRS = [(48, 64), (64, 48), (48, 16), (96, 64)]  # not multiples of each other (g = 16, 16, 16, 32)
RESHARDS = [((1, 2), (1, 1)), ((2, 1), (1, 1)), ((1, 1), (1, 2)), ((1, 1), (3, 1)), ((2, 2), (3, 1))]
CASES = (
    [(m, (1, 1), (1, 1), bp, bd) for m in MODELS for bp, bd in PAIRS]
    + [("freq2_mtp", p, d, bp, bd) for p, d in [((1, 1), (1, 1)), ((2, 2), (3, 1))] for bp, bd in ODD_PAIRS]
    + [("freq2_mtp", p, d, bp, bd) for p, d in RESHARDS for bp, bd in PAIRS]
    + [(m, p, d, bp, bd) for m in ("freq4", "pattern") for p, d in RESHARDS for bp, bd in PAIRS if bp != bd
       and (bp, bd) in ((16, 128), (128, 16), (32, 64), (64, 32))]
)


def _id(case) -> str:
    m, p, d, bp, bd = case
    return f"{m}-P{bp}pp{p[0]}tp{p[1]}-D{bd}pp{d[0]}tp{d[1]}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_runs_write_every_destination_byte_exactly_once(case) -> None:
    model, p, d, bp, bd = case
    peer = peer_plan(model, p, d, bp, bd)
    for src, dst, first, num in requests(bp, bd, seed=bp * 1000 + bd):
        check_request(peer, src, dst, first, num)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_layer_arrives_from_one_sender(model) -> None:
    """Under PP/TP reshard with different block sizes each (destination, role, layer) has one sender."""
    peer = peer_plan(model, (2, 2), (3, 1), 64, 32)
    seen: dict[tuple[int, str, int], set[int]] = {}
    for s in peer.plan.segments:
        for role, layer in s.layers:
            seen.setdefault((s.dst_rank, role, layer), set()).add(s.src_rank)
    want = {(t.rank, v.role.value, e.global_layer) for t in peer.dst_tables for v in t.views for e in v.entries}
    assert set(seen) == want and all(len(x) == 1 for x in seen.values())


@pytest.mark.parametrize("bs", SIZES)
def test_equal_block_sizes_keep_page_for_page_runs(bs) -> None:
    """``Bp == Bd`` with a D hit of k blocks: exactly the page-for-page runs of the blocks after the hit."""
    from vllm_dsa_connector.core.plan.runs import merge_runs

    peer = peer_plan("freq2_mtp", (1, 1), (1, 1), bs, bs)
    (s,), (d,) = peer.src_tables, peer.dst_tables
    n = -(-PROMPT // bs)
    src, dst = np.arange(n)[::-1].copy(), np.arange(1, n + 1)
    got = peer.runs(s.rank, d.rank, src[1:], dst[1:], first_token=bs, num_tokens=PROMPT - bs)
    want = expand_runs(peer.plan.for_pair(s.rank, d.rank), s, d, src[1:], dst[1:])
    assert len(got) == len(want)
    for (sp, dp, runs), w in zip(got, want, strict=True):
        ref = merge_runs(w.src_offsets, w.dst_offsets, w.lengths)
        assert (sp, dp) == (w.src_pool, w.dst_pool)
        assert np.array_equal(runs.src_offsets, ref.src_offsets) and np.array_equal(runs.lengths, ref.lengths)
        assert np.array_equal(runs.dst_offsets, ref.dst_offsets)


@pytest.mark.parametrize("bp,bd", PAIRS + ODD_PAIRS)
def test_pairing_by_position_feeds_runs(bp, bd) -> None:
    """``pair_blocks_by_position`` with two block sizes gives the lists and span :meth:`PeerPlan.runs`
    expects: P's blocks from the one holding ``first_token``, D's new blocks, the tokens after D's hit."""
    hit = bd * (3 if bd < 64 else 1)
    remote = list(range(100, 100 + -(-PROMPT // bp)))
    local_new = list(range(200, 200 + -(-PROMPT // bd) - hit // bd + 2))  # vLLM may allocate more
    pairing = pair_blocks_by_position(prompt_tokens=PROMPT, local_computed_tokens=hit, local_new_blocks=local_new,
                                      remote_block_ids=remote, remote_num_tokens=PROMPT, src_block_size=bp,
                                      dst_block_size=bd)
    assert (pairing.first_token, pairing.num_tokens) == (hit, PROMPT - hit)
    assert list(pairing.src_blocks) == remote[hit // bp:]
    assert list(pairing.dst_blocks) == local_new[:-(-PROMPT // bd) - hit // bd]
    if bp in SIZES and bd in SIZES:
        n_p, n_d = -(-PROMPT // bp) + SPARE_BLOCKS, -(-PROMPT // bd) + SPARE_BLOCKS
        src = np.array(pairing.src_blocks) - 100 + SPARE_BLOCKS - 1  # into range, order kept
        dst = (np.array(pairing.dst_blocks) - 200) % n_d
        assert src.max() < n_p
        check_request(peer_plan("freq2_mtp", (1, 1), (1, 1), bp, bd), src, dst, pairing.first_token,
                      pairing.num_tokens)


@pytest.mark.parametrize("bp,bd", [(16, 64), (64, 16), (32, 128), (48, 64), (128, 16)])
def test_spans_off_block_boundaries(bp, bd) -> None:
    """Spans starting on any chunk (not only on a D block) and short or odd ``num_tokens``: still exactly
    the tokens asked, rounded up to whole chunks of ``gcd(Bp, Bd)``; nothing before ``first_token``."""
    peer = peer_plan("freq2_mtp", (1, 1), (1, 1), bp, bd)
    g = math.gcd(bp, bd)
    for first in (g, 3 * g, bd + g):
        for num in (PROMPT - first, 1, g, None):
            n_src, n_dst = -(-PROMPT // bp) - first // bp, -(-PROMPT // bd) - first // bd
            check_request(peer, np.arange(n_src)[::-1].copy(), np.arange(1, n_dst + 1), first, num)


def test_simulation_catches_a_wrong_run() -> None:
    """The oracle is not vacuous: a plan whose runs are shifted by one token row fails the check."""
    peer = peer_plan("freq2_mtp", (1, 1), (1, 1), 64, 32)
    src, dst, first, num = requests(64, 32, seed=1)[1]

    class Shifted:
        src_tables, dst_tables = peer.src_tables, peer.dst_tables

        def runs(self, *a, **kw):
            from vllm_dsa_connector.core.plan.runs import Runs

            return [(sp, dp, Runs(r.src_offsets + 160, r.dst_offsets, r.lengths))
                    for sp, dp, r in peer.runs(*a, **kw)]

    with pytest.raises(AssertionError, match="wrong bytes"):
        check_request(Shifted(), src, dst, first, num)  # type: ignore[arg-type]


def test_bench_transfer_block_sizes_cli_json() -> None:
    """``vllm-dsa bench transfer --src-block-size 64 --dst-block-size 32 --json``: the GLM-5.2-shaped request
    in two NIXL processes (bytes verified every rep), side by side with the equal-size cases."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dsa_connector.cli", "bench", "transfer", "--src-block-size", "64",
         "--dst-block-size", "32", "--tokens", "96", "--reps", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = {(c["src_block_size"], c["dst_block_size"]): c for c in out["cases"]}
    assert list(cases) == [(64, 32), (64, 64), (32, 32)]
    per_token = 78 * 1152 + 21 * 132  # GLM-5.2 shape, bf16 latent on CPU
    # 96 tokens: P64 -> D32 copies 3 chunks of 32 (every layer: one MLA run, indexer values + scales runs);
    # the equal-size cases copy whole blocks (the last one rounded up to its block)
    assert cases[(64, 32)]["bytes"] == 96 * per_token and cases[(32, 32)]["bytes"] == 96 * per_token
    assert cases[(64, 64)]["bytes"] == 128 * per_token
    assert cases[(64, 32)]["descriptors"] <= 3 * (78 + 2 * 21)
    for c in cases.values():
        assert c["bounce_writes"] == 1 and c["direct_ms"] > 0 and c["bounce_ms"] > 0 and c["gather_ms"] > 0
