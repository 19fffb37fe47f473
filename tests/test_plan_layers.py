"""``PeerPlan.runs(..., layers=)``: one layer's pages of a request, for a layer-by-layer push.

For reshard layouts (pp2 -> pp1, tp2 -> tp1, pp2 tp2 -> pp3, the masked GLM-DSA layouts whose non-owning
layers have no indexer page) and block-size pairs (equal, P64 -> D16, P16 -> D64), with shuffled blocks and
a D prefix hit (``first_token > 0``): the runs of every layer of :meth:`PeerPlan.layers_of`, applied to byte
arrays, write exactly the bytes the whole request's runs write, from the same source bytes, each once; and
each layer's runs read and write only that layer's pages (every role).
"""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest
from vllm_dsa_dev.tiny_models import glm_dsa_config

from vllm_dsa_connector.connector.page_tables import build_offline
from vllm_dsa_connector.core.plan.pages import PageTable
from vllm_dsa_connector.core.plan.peer_plan import PeerPlan

MODELS = {
    "freq2_mtp": dict(num_layers=9, index_topk_freq=2, index_skip_topk_offset=1, num_nextn_predict_layers=1),
    "pattern": dict(num_layers=9, index_topk_pattern="FFFSSSFFF"),
}
NARROW = dict(kv_lora_rank=64, qk_rope_head_dim=16)
PROMPT = 293
SPARE = 3
PADDING = -1


@cache
def tables(model: str, pp: int, tp: int, block_size: int) -> tuple[PageTable, ...]:
    kw = dict(MODELS[model])
    cfg = glm_dsa_config(kw.pop("num_layers"), **kw, **NARROW)
    return tuple(build_offline(cfg, pp_size=pp, tp_size=tp, block_size=block_size,
                               num_blocks=-(-PROMPT // block_size) + SPARE))


def layer_labels(table: PageTable) -> list[np.ndarray]:
    """Per pool, the global layer each byte's page belongs to (any role), ``PADDING`` between pages."""
    out = []
    for p in table.pools:
        lab = np.full(p.nbytes, PADDING, np.int64)
        out.append(lab)
    for v in table.views:
        pool = table.pools[v.pool]
        for e in v.entries:
            for blk in range(pool.num_blocks):
                out[v.pool][blk * pool.block_stride + e.offset:][:e.nbytes] = e.global_layer
    return out


def pairs_of(runs) -> tuple[np.ndarray, np.ndarray]:
    """Every (source byte, destination byte) a run list moves, as two int64 arrays (vectorised)."""
    lens = runs.lengths
    if not lens.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.repeat(runs.staging_offsets(), lens)
    k = np.arange(int(lens.sum()), dtype=np.int64) - starts
    return np.repeat(runs.src_offsets, lens) + k, np.repeat(runs.dst_offsets, lens) + k


def requests(bp: int, bd: int, seed: int):
    rng = np.random.default_rng(seed)
    pool_s, pool_d = -(-PROMPT // bp) + SPARE, -(-PROMPT // bd) + SPARE
    hit = bd * (3 if bd < 64 else 1)
    out = []
    for first, num, shuffled in ((0, PROMPT, False), (hit, PROMPT - hit, True), (hit, None, True)):
        n_src, n_dst = -(-PROMPT // bp) - first // bp, -(-PROMPT // bd) - first // bd
        if shuffled:
            src, dst = rng.permutation(pool_s)[:n_src], rng.permutation(pool_d)[:n_dst]
        else:
            src, dst = np.arange(1, n_src + 1), np.arange(2, n_dst + 2)
        out.append((src.astype(np.int64), dst.astype(np.int64), first, num))
    return out


RESHARDS = [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 2), (1, 1)), ((2, 2), (3, 1))]
BLOCKS = [(64, 64), (64, 16), (16, 64)]
CASES = [(m, p, d, bp, bd) for m in MODELS for p, d in RESHARDS for bp, bd in BLOCKS]


def _id(case) -> str:
    m, p, d, bp, bd = case
    return f"{m}-P{bp}pp{p[0]}tp{p[1]}-D{bd}pp{d[0]}tp{d[1]}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_per_layer_runs_are_exactly_the_whole_requests_runs(case) -> None:
    model, p, d, bp, bd = case
    peer = PeerPlan.build(tables(model, *p, bp), tables(model, *d, bd))
    src_lab = {t.rank: layer_labels(t) for t in peer.src_tables}
    dst_lab = {t.rank: layer_labels(t) for t in peer.dst_tables}
    for s, dt in itertools.product(peer.src_tables, peer.dst_tables):
        layers = peer.layers_of(s.rank, dt.rank)
        segs = peer.for_pair(s.rank, dt.rank)
        assert layers == tuple(sorted({la for g in segs for _, la in g.layers}))
        assert list(layers) == sorted(layers)
        for src_blocks, dst_blocks, first, num in requests(bp, bd, seed=bp + bd + s.rank):
            kw = dict(first_token=first, num_tokens=num)
            whole: dict[tuple[int, int], np.ndarray] = {}  # (pools) -> sorted src byte << 32 | dst byte
            for sp, dp, runs in peer.runs(s.rank, dt.rank, src_blocks, dst_blocks, **kw):
                sa, da = pairs_of(runs)
                whole[(sp, dp)] = np.sort(np.concatenate([whole.get((sp, dp), sa[:0]), sa << 32 | da]))
            got: dict[tuple[int, int], list[np.ndarray]] = {}
            for layer in layers:
                parts = peer.runs(s.rank, dt.rank, src_blocks, dst_blocks, layers=[layer], **kw)
                for sp, dp, runs in parts:
                    assert runs.num_runs, "parts with no runs are left out"
                    sa, da = pairs_of(runs)
                    assert (src_lab[s.rank][sp][sa] == layer).all(), f"layer {layer} reads another layer's bytes"
                    assert (dst_lab[dt.rank][dp][da] == layer).all(), f"layer {layer} writes another layer's bytes"
                    got.setdefault((sp, dp), []).append(np.stack([sa, da]))
            assert set(got) == {k for k, v in whole.items() if v.size}
            for key, chunks in got.items():
                both = np.concatenate(chunks, axis=1)
                # no destination byte written twice (across layers and within one), and the same pairs
                assert np.unique(both[1]).size == both.shape[1], f"{key}: a byte written twice"
                assert np.array_equal(np.sort(both[0] << 32 | both[1]), whole[key]), f"{key}: other bytes"

            # a set of layers is the union of its layers' runs too
            two = layers[:2]
            if len(two) == 2:
                a = peer.runs(s.rank, dt.rank, src_blocks, dst_blocks, layers=two, **kw)
                b = [peer.runs(s.rank, dt.rank, src_blocks, dst_blocks, layers=[x], **kw) for x in two]
                assert sum(r.total_bytes for _, _, r in a) == sum(r.total_bytes for x in b for _, _, r in x)


def test_layers_outside_the_pair_give_no_runs_and_results_are_cached() -> None:
    peer = PeerPlan.build(tables("freq2_mtp", 2, 1, 64), tables("freq2_mtp", 1, 1, 64))
    first, second = peer.layers_of(0, 0), peer.layers_of(1, 0)
    assert first and second and not set(first) & set(second)
    assert set(first) | set(second) == set(peer.dst_tables[0].layers)
    blocks = np.arange(3)
    assert peer.runs(0, 0, blocks, blocks, layers=[second[0]]) == []
    assert peer.runs(0, 0, blocks, blocks, layers=[]) == []
    assert peer.layers_of(5, 0) == ()
    peer.runs(0, 0, blocks, blocks, layers=[first[0]])
    peer.runs(0, 0, blocks, blocks, layers={first[0]})
    assert sum(k[:2] == (0, 0) and k[2] == {first[0]} for k in peer._layer_segs) == 1  # cached per (pair, layers)
