"""The transfer core end to end, without vLLM: a producer and a consumer process push KV through NIXL.

What runs is the core an adapter reuses (:mod:`vllm_dsa_connector.core.handoff`, the planner
``core.plan.peer_plan.PeerPlan``, :mod:`vllm_dsa_connector.core.transfer`), with nothing from vLLM imported:

- P and D each allocate KV pools with torch, laid out as vLLM lays out a GLM-5.2-shaped model's KV cache
  (the page table built offline by :mod:`vllm_dsa_connector.core.plan` from ``examples/glm5_2_shape.json``:
  78 MLA pages of 41,984 B + 21 indexer pages of 8,448 B per block), register them with a NIXL agent and
  publish a :class:`~vllm_dsa_connector.core.handoff.wire.RankPayload`. P fills its pools with seeded bytes, D
  starts from zeros.
- P keeps each finished "prefill" under a lease (:class:`~vllm_dsa_connector.core.handoff.producer.Producer`) and
  serves the side channel and hands its ``kv_transfer_params`` to D (the proxy's part) on the control
  channel of :func:`~vllm_dsa_dev.harness.pair.run_two`, which runs both processes.
- D handshakes over the side channel (:class:`~vllm_dsa_connector.core.handoff.consumer.Consumer`: payloads,
  compatibility check, plan), registers its blocks (scattered, out of order; one request with a prefix
  already on D, so P sends from its second block), and arms the transport's receiver.
- D chooses each pair's route as the connector's scheduler does (``core.handoff.routes.plan_routes``; ``--path``:
  direct, bounce with the gate forced, or ipc between two processes on one CUDA host), P dispatches each
  registration and follows the route (``core.transfer.routed.RoutedTransport``) and reports the lease finished;
  D's receiver settles the request (a bounced writer's parts scattered from its slot).
- D then checks EVERY byte of its pools: the paired blocks hold P's bytes (P's seeded pools regenerated on
  D, copied with torch index ops along the plan's runs), every other byte is still zero.

Timed per request: ``post_ms`` (P: post -> all WRITEs DONE) and ``e2e_ms`` (D: registration sent ->
request settled, through the side channel, P's step, the WRITEs and the notification).

    PYTHONPATH=. python dev/bench/core_pd.py                                   # CPU, small pools (the suite)
    PYTHONPATH=. python dev/bench/core_pd.py --blocks 1200 --save-table t.json  # build a table (needs vLLM)
    PYTHONPATH=. python dev/bench/core_pd.py --device cuda --table t.json --requests 594,300,64,8 --blocks 1200 \\
        --path ipc    # or direct / bounce: the three routes, every byte of D's pools checked
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_dsa_dev.harness.channel import Channel, Kind, run_two  # noqa: E402

from vllm_dsa_connector.core.handoff.consumer import Consumer  # noqa: E402
from vllm_dsa_connector.core.handoff.messages import Authenticator, Origin, new_epoch  # noqa: E402
from vllm_dsa_connector.core.handoff.params import RemoteParams  # noqa: E402
from vllm_dsa_connector.core.handoff.producer import Producer  # noqa: E402
from vllm_dsa_connector.core.handoff.routes import plan_routes  # noqa: E402
from vllm_dsa_connector.core.handoff.settings import HandoffSettings  # noqa: E402
from vllm_dsa_connector.core.handoff.side_channel import SideChannelServer, validate_peer  # noqa: E402
from vllm_dsa_connector.core.handoff.wire import (  # noqa: E402
    RankPayload,
    decode_payload,
    encode,
    route_of,
)
from vllm_dsa_connector.core.plan.pages import PageTable  # noqa: E402
from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs  # noqa: E402
from vllm_dsa_connector.core.transfer.gate import BounceGate  # noqa: E402
from vllm_dsa_connector.core.transfer.gate_options import BounceSettings  # noqa: E402
from vllm_dsa_connector.core.transfer.ipc import device_uuid, export_region, host_id  # noqa: E402
from vllm_dsa_connector.core.transfer.nixl.data import Region  # noqa: E402
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine  # noqa: E402
from vllm_dsa_connector.core.transfer.receiver import Receiver  # noqa: E402
from vllm_dsa_connector.core.transfer.receiver_data import RecvState, WriterSpec  # noqa: E402
from vllm_dsa_connector.core.transfer.routed import RoutedTransport  # noqa: E402
from vllm_dsa_connector.core.transfer.slots import SlotAllocator  # noqa: E402
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot  # noqa: E402
from vllm_dsa_connector.core.transfer.transports import PostState  # noqa: E402

SHAPE = ROOT / "vllm_dsa_connector" / "examples" / "glm5_2_shape.json"
FILL_CHUNK = 1 << 28  # seeded bytes are generated per 256 MiB chunk (same chunks on P and on D)
BLOCK = 64  # tokens per KV block on both sides (build_offline's default)


def build_table(blocks: int) -> dict[str, Any]:
    """GLM-5.2's page table for ``blocks`` KV blocks, as vLLM lays it out (needs vLLM: run where it is)."""
    from vllm_dsa_connector.connector.page_tables import build_offline

    (table,) = build_offline(SHAPE, kv_cache_dtype="fp8_ds_mla", num_blocks=blocks)
    return table.to_dict()


@dataclass(frozen=True)
class RequestSpec:
    """One request: P's blocks (the lease), D's new blocks, and how many leading blocks D already holds."""

    req_id: str
    p_blocks: tuple[int, ...]
    d_blocks: tuple[int, ...]
    first_block: int

    @property
    def src_blocks(self) -> tuple[int, ...]:
        """P's blocks that go to ``d_blocks`` (same token positions)."""
        return self.p_blocks[self.first_block : self.first_block + len(self.d_blocks)]

    @property
    def first_token(self) -> int:
        """The first token D loads (it holds the blocks before ``first_block``)."""
        return self.first_block * BLOCK

    @property
    def num_tokens(self) -> int:
        """Tokens D loads."""
        return len(self.d_blocks) * BLOCK


def plan_requests(sizes: list[int], pool_blocks: int, seed: int) -> list[RequestSpec]:
    """Disjoint, scattered, out-of-order block ids on both sides; request 1 has a one-block prefix on D."""
    if sum(sizes) > pool_blocks:
        raise ValueError(f"requests need {sum(sizes)} blocks, the pools hold {pool_blocks}")
    rng = np.random.default_rng(seed)
    p_perm, d_perm = rng.permutation(pool_blocks).tolist(), rng.permutation(pool_blocks).tolist()
    specs, at = [], 0
    for i, n in enumerate(sizes):
        first = 1 if i == 1 and n > 1 else 0
        p, d = p_perm[at : at + n], d_perm[at : at + n - first]
        specs.append(RequestSpec(f"req-{i}", tuple(p), tuple(d), first))
        at += n
    return specs


def fill(tensors: list[torch.Tensor], seed: int) -> None:
    """Seeded bytes, reproducible on any process of the same device type."""
    for i, t in enumerate(tensors):
        gen = torch.Generator(device=t.device)
        for j, start in enumerate(range(0, t.numel(), FILL_CHUNK)):
            gen.manual_seed(seed * 1_000_003 + i * 10_007 + j)
            part = t[start : start + FILL_CHUNK]
            part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device=t.device, generator=gen))


@dataclass
class Side:
    """One engine's single worker: its pools, NIXL agent, registered regions and handshake payload."""

    tensors: list[torch.Tensor]
    engine: NixlEngine
    regions: list[Region]
    payload: RankPayload
    arena: StagingArena | None = None  # P: where bounced parts are gathered; D: where they land (bounce path)


def open_side(engine_id: str, table_dict: dict[str, Any], device: str, seed: int | None,
              path: str = "direct", arena_bytes: int = 0) -> Side:
    """Allocate the table's pools on ``device`` (seeded bytes, or zeros), register them, build the payload:
    with ``path`` bounce a staging arena of ``arena_bytes`` (D registers it as its receive arena), with ipc
    (D) the pools' CUDA IPC exports and, on CUDA, the host and GPU identity the route planner compares."""
    table = PageTable.from_dict(table_dict)
    tensors = [torch.zeros(p.nbytes, dtype=torch.uint8, device=device) for p in table.pools]
    if seed is not None:
        fill(tensors, seed)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    pools = tuple(msgspec.structs.replace(p, base_ptr=t.data_ptr(), device=str(t.device))
                  for p, t in zip(table.pools, tensors, strict=True))
    engine = NixlEngine(f"{engine_id}-{os.getpid()}")
    regions = [engine.register(t) for t in tensors]
    compat = {"architecture": table.model.architecture, "kv_cache_dtype": table.kv_cache_dtype,
              "block_size": str(table.block_size)}
    arena = StagingArena(arena_bytes, device=device) if path == "bounce" else None  # registered by its user
    gpu, reach, ipc = "", [], None
    if device.startswith("cuda"):
        gpu = device_uuid(tensors[0].device)
        reach = [gpu]
        if path == "ipc" and seed is None:
            ipc = [export_region(t) for t in tensors]
    payload = RankPayload(engine_id, table.rank, table.pp_rank, table.tp_rank, engine.name, engine.metadata(),
                          msgspec.structs.replace(table, pools=pools),
                          [r.desc() for r in regions], compat,
                          host=host_id(), gpu=gpu, reach=reach, ipc=ipc)
    return Side(tensors, engine, regions, payload, arena)


def _vllm_loaded() -> bool:
    return any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)


def _settings(args: argparse.Namespace) -> HandoffSettings:
    return HandoffSettings(lease_s=120.0, transfer_timeout_s=args.timeout, handshake_timeout_s=10.0,
                           heartbeat_s=2.0)


# ------------------------------------------------------------------------------------------ P


Job = tuple[argparse.Namespace, dict[str, Any], list[RequestSpec]]


def run_producer(ch: Channel, work: Job) -> dict[str, Any]:
    """P: leases, the side channel, dispatch and posts, until D says stop; P's result."""
    args, table, specs = work
    side = open_side("P", table, args.device, args.seed, args.path, args.arena_bytes)
    settings = _settings(args)
    producer = Producer("P", settings, block_size=BLOCK, epoch=new_epoch())
    payloads = [encode(side.payload)]
    server = SideChannelServer("127.0.0.1", 0, lambda req, sender: producer.handle(req, payloads, sender),
                               Authenticator(args.secret), origin=Origin("P", producer.epoch))
    transport = RoutedTransport(side.engine, settings.transfer_timeout_s, arena=side.arena)
    params = [dict(do_remote_prefill=True, remote_engine_id="P", remote_request_id=s.req_id,
                   remote_token=producer.add_lease(s.req_id, list(s.p_blocks)), remote_host=server.host,
                   remote_port=server.port, remote_block_ids=list(s.p_blocks),
                   remote_num_tokens=BLOCK * len(s.p_blocks)) for s in specs]
    ch.send(Kind.DATA, params=params)
    peers: dict[str, tuple[list[tuple[str, RankPayload]], Any]] = {}
    posts: dict[str, tuple[list[Any], float]] = {}
    post_ms: dict[str, float] = {}
    paths: dict[str, int] = {}  # posts per path followed
    errors: list[str] = []
    stop_by = None  # once D said stop: the posts still in flight (an ipc notice's flush window) get this long
    while True:
        if stop_by is None and ch.poll():
            stop_by = time.monotonic() + 5.0
        if stop_by is not None and (not posts or time.monotonic() > stop_by):
            break
        out = producer.step()
        for info in out.peers:  # D's layout, once: its agents and the plan P -> D
            d_payloads = [decode_payload(b) for b in info.payloads]
            agents = [(side.engine.add_peer(p.agent_metadata), p) for p in d_payloads]
            peers[info.engine_id] = (agents, validate_peer([side.payload], d_payloads))
        for job in out.push:
            agents, plan = peers[job.dst_engine]
            started, mine = time.perf_counter(), []
            for agent, d in agents:
                triples = plan.runs(side.payload.rank, d.rank, job.src_blocks, job.dst_blocks,
                                    first_token=job.first_token, num_tokens=job.num_tokens)
                parts = [(side.regions[sp], d.regions[dp], runs)
                         for sp, dp, runs in triples]
                route = route_of(job.routes, d.rank, side.payload.rank)  # D's choice; P follows it
                path = route.path if route is not None else "direct"
                slot = None
                if route is not None and route.path == "bounce" and d.staging is not None:
                    slot = StagingSlot(d.staging, route.offset, route.size)
                if path == "ipc" and not transport.mapped(agent) and d.ipc:
                    transport.map_peer(agent, d.ipc, side.tensors[0].device)
                mine.append(transport.post(agent, parts, writer=side.payload.rank, tag=job.dst_req_id.encode(),
                                           path=path, slot=slot, pools=[dp for _, dp, _ in triples]))
                paths[path] = paths.get(path, 0) + 1
            posts[job.req_id] = (mine, started)
        if out.release:
            errors += [f"lease {r} released without a push" for r in out.release]
            producer.finished_sending(set(out.release))
        for req_id, (mine, started) in list(posts.items()):
            if all(transport.progress(p) for p in mine):
                post_ms[req_id] = 1000 * (time.perf_counter() - started)
                errors += [f"{req_id}: {p.error}" for p in mine if p.state is PostState.FAILED]
                producer.finished_sending({req_id})
                del posts[req_id]
        if not posts:
            time.sleep(0.0005)
    ch.recv(Kind.STOP)
    server.close()
    side.engine.close()
    return {"post_ms": post_ms, "errors": errors, "pending": producer.pending(), "vllm_loaded": _vllm_loaded(),
            "paths": paths}


# ------------------------------------------------------------------------------------------ D


def run_consumer(ch: Channel, work: Job) -> dict[str, Any]:
    """D: handshake, registrations, the receiver, then the byte-for-byte check of every pool; D's result."""
    args, table, specs = work
    side = open_side("D", table, args.device, None, args.path, args.arena_bytes)
    receiver = Receiver(side.engine)
    slots: SlotAllocator | None = None
    if side.arena is not None:  # the receive arena the bounce routes' slots lie in
        region = receiver.attach(side.arena)
        # the agent's metadata names its registered memory: taken again now that the arena is registered
        side.payload = msgspec.structs.replace(side.payload, staging=region.desc(),
                                               agent_metadata=side.engine.metadata())
        slots = SlotAllocator(side.arena.size)
    consumer = Consumer("D", _settings(args), Authenticator(args.secret), lambda: [side.payload],
                        lambda: [encode(side.payload)])
    gate = BounceGate(BounceSettings(mode="always"), device=args.device) if args.path == "bounce" else None
    params = ch.recv(Kind.DATA).body["params"]
    first = RemoteParams.from_dict(params[0])
    deadline = time.monotonic() + 30
    while (peer := consumer.peer("P", first.remote_host, first.remote_port)).future is not None:
        if time.monotonic() > deadline:
            raise TimeoutError("handshake with P did not finish in 30 s")
        time.sleep(0.005)
    if peer.error or peer.meta is None:
        raise RuntimeError(f"handshake with P failed: {peer.error}")
    agents = {p.rank: p.agent_name for p in peer.meta.payloads}
    e2e_ms: dict[str, float] = {}
    for spec, param in zip(specs, params, strict=True):
        rp = RemoteParams.from_dict(param)
        consumer.queue(spec.req_id, rp)
        started = time.perf_counter()
        assert peer.plan is not None
        routes, held = plan_routes(peer.plan, peer.meta.payloads, [side.payload], list(spec.src_blocks),
                                   list(spec.d_blocks), gate, {side.payload.rank: slots} if slots else {},
                                   first_token=spec.first_token, num_tokens=spec.num_tokens, ipc=args.path == "ipc")
        job = consumer.register(spec.req_id, rp, peer, spec.first_token, spec.num_tokens, list(spec.src_blocks),
                                list(spec.d_blocks), routes, held)
        writers = {w: _writer(side, peer.plan, job, w, agents[w]) for w in job.expected[side.payload.rank]}
        receiver.arm(spec.req_id.encode(), writers, timeout_s=args.timeout)
        result = None
        while result is None:
            fail: dict[str, str] = {}
            consumer.step(fail)
            if fail:
                raise RuntimeError(f"{spec.req_id}: the consumer gave up: {fail}")
            receiver.pump()
            result = next(iter(receiver.collect()), None)
            if result is None:
                time.sleep(0.0002)
        if result.state is not RecvState.DONE:
            raise RuntimeError(f"{spec.req_id}: receive ended {result.state.value}: {result.reason}")
        e2e_ms[spec.req_id] = 1000 * (time.perf_counter() - started)
        for _, res in held:
            assert slots is not None
            slots.release(res)
        consumer.finished(spec.req_id)
    out = {"e2e_ms": e2e_ms, "vllm_loaded": _vllm_loaded(), **verify(side, peer.plan, specs, args)}
    ch.send(Kind.STOP)  # P may close its side channel now
    consumer.shutdown()
    side.engine.close()
    return out


def _writer(side: Side, plan: Any, job: Any, w: int, agent: str) -> WriterSpec:
    """What D expects from writer ``w`` along the route D chose (as the connector's receive side builds it)."""
    route = route_of(job.routes, side.payload.rank, w)
    if route is None or route.path == "ipc":
        return WriterSpec(peer=agent, path=route.path if route else "direct")
    parts = plan.runs(w, side.payload.rank, job.src_blocks, job.blocks, first_token=job.first_token,
                      num_tokens=job.num_tokens)
    return WriterSpec.for_bounce(agent, (route.offset, route.size), [(side.tensors[dp], runs) for _, dp, runs in parts])


def verify(side: Side, plan: Any, specs: list[RequestSpec], args: argparse.Namespace) -> dict[str, Any]:
    """Every byte of D's pools: P's bytes along the plan's runs (index ops, not NIXL), zero elsewhere."""
    p_pools = [torch.empty_like(t) for t in side.tensors]
    fill(p_pools, args.seed)  # P's pools, regenerated
    expected = [torch.zeros_like(t) for t in side.tensors]
    moved = 0
    for spec in specs:
        for src_rank in plan.senders_for(side.payload.rank):
            for sp, dp, runs in plan.runs(src_rank, side.payload.rank, spec.src_blocks, spec.d_blocks):
                copy_runs(p_pools[sp], expected[dp], runs, impl="index")
                moved += runs.total_bytes
    if side.tensors[0].is_cuda:
        torch.cuda.synchronize()
    bad = [i for i, (got, want) in enumerate(zip(side.tensors, expected, strict=True)) if not torch.equal(got, want)]
    return {"bytes_moved": moved, "bytes_checked": sum(t.numel() for t in side.tensors), "mismatched_pools": bad}


# ------------------------------------------------------------------------------------------ parent


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both processes (:func:`run_two`: a failure raises with the failing side's traceback first); the result."""
    table = json.loads(Path(args.table).read_text()) if args.table else build_table(args.blocks)
    if args.save_table:
        Path(args.save_table).write_text(json.dumps(table))
    pool_blocks = min(int(p["num_blocks"]) for p in table["pools"])
    specs = plan_requests([int(x) for x in args.requests.split(",")], pool_blocks, args.seed)
    job = (args, table, specs)
    p_res, d_res = run_two(run_producer, run_consumer, job, job, timeout_s=args.timeout * len(specs) + 660)
    block_bytes = PageTable.from_dict(table).bytes_per_block
    reqs = [{"req": s.req_id, "blocks": len(s.d_blocks), "bytes": len(s.d_blocks) * block_bytes,
             "post_ms": round(p_res["post_ms"].get(s.req_id, -1.0), 3), "e2e_ms": round(d_res["e2e_ms"][s.req_id], 3)}
            for s in specs]
    return {"device": args.device, "pool_blocks": pool_blocks, "requests": reqs,
            "bytes_moved": d_res["bytes_moved"], "bytes_checked": d_res["bytes_checked"],
            "ok": not (d_res["mismatched_pools"] or p_res["errors"] or p_res["pending"]),
            "mismatched_pools": d_res["mismatched_pools"], "p_errors": p_res["errors"], "path": args.path,
            "posts_per_path": p_res["paths"],
            "vllm_in_p_or_d": p_res["vllm_loaded"] or d_res["vllm_loaded"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both processes on it)")
    ap.add_argument("--table", help="page table JSON (from --save-table); default: build it (needs vLLM)")
    ap.add_argument("--save-table", help="write the page table used to this JSON file")
    ap.add_argument("--blocks", type=int, default=24, help="KV blocks per pool when building the table")
    ap.add_argument("--requests", default="8,5,3,1", help="blocks per request (P side)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=60.0, help="transfer timeout per request (s)")
    ap.add_argument("--secret", default="core-pd-secret-0123456789", help="side-channel auth secret")
    ap.add_argument("--path", choices=("direct", "bounce", "ipc"), default="direct",
                    help="the route D chooses for every pair (ipc: CUDA on one host; bounce: forced by the gate)")
    ap.add_argument("--arena-bytes", type=int, default=256 << 20, help="staging arena per side (bounce)")
    ap.add_argument("--out", help="write the result JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run, print the result as JSON; exit status 1 unless every byte matched."""
    args = parse_args(argv)
    res = run(args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
