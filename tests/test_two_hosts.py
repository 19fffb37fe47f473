"""P and D on two "hosts": Linux network namespaces joined by a veth pair, with faults on the link.

:func:`vllm_dsa_dev.harness.netns.two_hosts` makes P's and D's namespaces, the wire between them
(``10.213.N.1`` P, ``10.213.N.2`` D) and a link from the root namespace into each (the engines' HTTP ports;
the proxies and this test run in the root namespace). Every engine runs inside its namespace
(``ip netns exec``), its side channel bound to its wire address and signed (``auth_secret``), NIXL over UCX
``tcp`` on the wire's device only (``UCX_TLS=tcp``, ``UCX_NET_DEVICES``; UCX's shared-memory transports,
CMA included, cross network namespaces, so with UCX's defaults the KV bytes would not touch the veth) and
``bounce_mode=never``. One set of engines for the module (engine starts dominate): P, D ``recompute`` and D
``fail`` (both with the KV probe), one proxy per D. The tests run in file order:

1. clean link: a 3-turn chat through the proxy, every reply equal to P's own plain reply, and the bytes on
   D's veth (``rx_bytes`` inside its namespace) at least the KV bytes D counted;
2. ``tc netem`` 20 ms delay, then 1% loss (skipped with the reason where the kernel has no netem), and a slow
   link (``tbf`` 8 Mbit/s) that runs everywhere: same replies, latency printed;
3. the link taken down in the middle of a WRITE (bytes flowing on P's veth): with ``recompute`` (link back
   after 9 s) D answers the right reply within the bounds; with ``fail`` the link stays down past D's give-up
   and write bound: D keeps the given-up request's blocks (no fence from P yet) while it serves a second
   request on its own, the link comes back, P's fence arrives and the request fails cleanly, a third request
   reuses the blocks, and D's whole KV cache stays byte-identical while TCP delivers what P still had queued
   (no WRITE lands in blocks D gave back); both pairs then serve the next request with P's KV;
4. the link down ~45 s while idle (UCX fails P's endpoints to D): P re-adds D's remote agents on its next post
   (``vllm:dsa_kv_peer_reconnects_total``) and the next requests on both pairs are served with P's KV.

Skipped with the reason where namespaces or veth pairs cannot be made (not root, no iproute2, the kernel
refuses).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from vllm_dsa_dev.harness import netns
from vllm_dsa_dev.harness.client import chat, metric, scrape
from vllm_dsa_dev.harness.engines import (
    Engine,
    check_backend,
    choose_backend,
    connector_config,
    engine_env,
    proxy_cmd,
    start_engine,
)
from vllm_dsa_dev.harness.procs import Cluster, cluster, wait_healthy

pytestmark = pytest.mark.slow

BASE = 25400  # HTTP: P, D recompute, D fail; proxies BASE+3, BASE+4; side channels BASE+10..12
SECRET = "two-hosts-secret-0123456789"
TIMEOUTS = {"handshake_timeout_s": 3.0, "transfer_timeout_s": 6.0, "peer_setup_timeout_s": 0.0, "kv_lease_duration": 30.0}
# D hands given-up blocks back after its timeout + P's write timeout + 1 s; the request ends about then
HOLD_BOUND_S = 2 * TIMEOUTS["transfer_timeout_s"] + 1.0
PROBE = ["--worker-extension-cls", "vllm_dsa_dev.kv_probe.KVProbe"]
TBF = ("tbf", "rate", "8mbit", "burst", "32kbit", "latency", "400ms")
RESULTS: dict[str, Any] = {}  # what each fault measured (printed; the closing note quotes them)


@dataclass
class Hosts:
    """The started set: namespaces, engines, proxies, and P's plain replies by prompt."""

    th: netns.TwoHosts
    c: Cluster
    p: Engine
    dr: Engine
    df: Engine
    xr: str
    xf: str
    model: str
    reference: dict[str, str] = field(default_factory=dict)


def _cfg(role: str, host: str, side_port: int, engine_id: str, policy: str = "fail") -> dict[str, Any]:
    cfg = connector_config(role, True, {**TIMEOUTS, "bounce_mode": "never"}, side_port, side_host=host,
                           auth_secret=SECRET)
    return {**cfg, "kv_load_failure_policy": policy, "engine_id": engine_id}


@pytest.fixture(scope="module")
def hosts(tiny_mla_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    why = netns.unavailable()
    if why:
        pytest.skip(f"two hosts need network namespaces: {why}")
    backend = choose_backend(tiny_mla_dir, "float32")
    with netns.two_hosts() as th, cluster(tmp_path_factory.mktemp("two-hosts")) as c:
        def env(host: netns.Host, core: str, probe: bool) -> dict[str, str]:
            return {**engine_env(core), **host.ucx_env(), **({"VLLM_SERVER_DEV_MODE": "1"} if probe else {})}

        p = start_engine(c, "prefill", tiny_mla_dir, BASE, "float32",
                         _cfg("kv_producer", th.p.addr, BASE + 10, "two-hosts-prefill"), backend,
                         env(th.p, "0", False), host=th.p.http_addr, prefix=th.p.prefix)
        dr = start_engine(c, "decode-recompute", tiny_mla_dir, BASE + 1, "float32",
                          _cfg("kv_consumer", th.d.addr, BASE + 11, "two-hosts-decode-r", "recompute"), backend,
                          env(th.d, "1", True), extra=PROBE, host=th.d.http_addr, prefix=th.d.prefix)
        df = start_engine(c, "decode-fail", tiny_mla_dir, BASE + 2, "float32",
                          _cfg("kv_consumer", th.d.addr, BASE + 12, "two-hosts-decode-f", "fail"), backend,
                          env(th.d, "1", True), extra=PROBE, host=th.d.http_addr, prefix=th.d.prefix)
        xr = c.start("proxy-recompute", proxy_cmd(p.url, dr.url, BASE + 3))
        xf = c.start("proxy-fail", proxy_cmd(p.url, df.url, BASE + 4))
        for e in (p, dr, df):
            e.ready(900, watch=[p.proc, dr.proc, df.proc, xr, xf], poll_s=2.0)
        for i, x in ((3, xr), (4, xf)):
            wait_healthy(f"http://127.0.0.1:{BASE + i}", [x], 60)
        for e in (p, dr, df):
            check_backend(e.proc, backend)
        yield Hosts(th, c, p, dr, df, f"http://127.0.0.1:{BASE + 3}", f"http://127.0.0.1:{BASE + 4}",
                    str(tiny_mla_dir))
    print(f"two hosts results: {json.dumps(RESULTS, indent=1)}")


def _post(url: str, body: dict[str, Any], path: str = "/v1/completions", timeout: float = 180) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


def _prompt(i: int) -> str:
    return f"Story {i}: the dragon painted the sky in colours nobody had seen before, and the river sang " * 6


def _complete(h: Hosts, url: str, prompt: str) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    status, out = _post(url, {"model": h.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                              "ignore_eos": True})
    return status, out, time.monotonic() - t0


def _reference(h: Hosts, prompt: str) -> str:
    if prompt not in h.reference:
        status, out, _ = _complete(h, h.p.url, prompt)  # P's own plain request: no connector involved
        assert status == 200, out
        h.reference[prompt] = out["choices"][0]["text"]
    return h.reference[prompt]


def _recv(url: str, outcome: str = "ok") -> float:
    return metric(scrape(url), "vllm:dsa_kv_requests_total", side="recv", outcome=outcome)


def _recv_bytes(url: str) -> float:
    return metric(scrape(url), "vllm:dsa_kv_bytes_total", side="recv")


def _served_with_p_kv(h: Hosts, x: str, d: Engine, prompt: str, label: str) -> float:
    """One request through proxy ``x``; its reply equals P's plain one and D loaded P's KV. Its latency."""
    want = _reference(h, prompt)
    ok0 = _recv(d.url)
    status, out, dt = _complete(h, x, prompt)
    assert status == 200 and out["choices"][0]["text"] == want, (label, status, out)
    assert _recv(d.url) == ok0 + 1, f"{label}: D did not load P's KV"
    return dt


def _kv_digest(e: Engine) -> list[int]:
    status, out = _post(e.url, {"method": "dsa_probe_digest_all"}, path="/collective_rpc")
    assert status == 200, out
    return out["results"][0]


def test_clean_link_multi_turn_chat_crosses_the_veth(hosts: Hosts) -> None:
    h = hosts
    _served_with_p_kv(h, h.xf, h.df, _prompt(0), "warm-up fail pair")  # handshakes done before measuring
    messages: list[dict[str, str]] = []
    ref_messages: list[dict[str, str]] = []
    rx0, kv0 = h.th.d.wire.stat("rx_bytes"), _recv_bytes(h.dr.url)
    ok0 = _recv(h.dr.url)
    latencies = []
    for turn, question in enumerate(["Tell me about dragons.", "Why do they paint the sky?", "And the river?"]):
        messages.append({"role": "user", "content": question})
        ref_messages.append({"role": "user", "content": question})
        got = chat(h.xr, h.model, messages, 12, timeout_s=180)
        want = chat(h.p.url, h.model, ref_messages, 12, timeout_s=180)
        assert got.text == want.text, (turn, got.text, want.text)
        latencies.append(round(got.total_s, 3))
        messages.append({"role": "assistant", "content": got.text})
        ref_messages.append({"role": "assistant", "content": want.text})
    kv = _recv_bytes(h.dr.url) - kv0
    rx = h.th.d.wire.stat("rx_bytes") - rx0
    assert _recv(h.dr.url) == ok0 + 3, "every turn must load P's KV"
    assert kv > 0 and rx >= kv, f"D received {kv:.0f} KV bytes but only {rx} bytes crossed its veth"
    RESULTS["clean"] = {"latency_s": latencies, "kv_bytes": kv, "veth_rx_bytes": rx}
    print(f"clean link: 3 turns {latencies} s, {kv:.0f} KV bytes, {rx} B on D's veth")


def _with_qdisc(h: Hosts, spec: tuple[str, ...], label: str) -> None:
    for end in (h.th.p.wire, h.th.d.wire):
        end.qdisc(*spec)
    try:
        latencies = [round(_served_with_p_kv(h, h.xr, h.dr, _prompt(10 + i), label), 3) for i in range(3)]
    finally:
        for end in (h.th.p.wire, h.th.d.wire):
            end.clear_qdisc()
    RESULTS[label] = {"latency_s": latencies}
    print(f"{label}: {latencies} s per request")


@pytest.mark.parametrize("label,spec", [("netem delay 20ms", ("netem", "delay", "20ms")),
                                        ("netem loss 1%", ("netem", "loss", "1%"))])
def test_netem(hosts: Hosts, label: str, spec: tuple[str, ...]) -> None:
    why = netns.netem_unavailable()
    if why:
        RESULTS[label] = f"skipped: {why}"
        pytest.skip(why)
    _with_qdisc(hosts, spec, label)


def test_slow_link_tbf(hosts: Hosts) -> None:
    _with_qdisc(hosts, TBF, "tbf 8mbit")


def _start_down_mid_write(h: Hosts, x: str, prompt: str) -> tuple[threading.Thread, dict[str, Any], float]:
    """Send ``prompt`` through ``x`` on a slow link (``TBF``, the caller clears it) and take the wire down once
    KV bytes flow on P's veth. (the request's thread, its result holder ``["r"]``, when the wire went down)."""
    wire = h.th.p.wire
    for end in (h.th.p.wire, h.th.d.wire):
        end.qdisc(*TBF)
    result: dict[str, Any] = {}

    def send() -> None:
        result["r"] = _complete(h, x, prompt)

    tx0 = wire.stat("tx_bytes")
    t = threading.Thread(target=send, daemon=True)
    t0 = time.monotonic()
    t.start()
    down_at = None
    while time.monotonic() - t0 < 60 and t.is_alive():
        if wire.stat("tx_bytes") - tx0 > 96 * 1024:  # the WRITE is under way
            wire.down()
            down_at = time.monotonic() - t0
            break
        time.sleep(0.02)
    assert down_at is not None, "no KV bytes flowed before the request ended"
    result["t0"] = t0
    return t, result, down_at


def _down_mid_write(h: Hosts, x: str, prompt: str, down_s: float) -> tuple[int, dict, float, float]:
    """Send ``prompt`` through ``x`` on a slow link; take the wire down once KV bytes flow on P's veth; bring it
    up after ``down_s``. (status, body, latency, when it went down)."""
    wire = h.th.p.wire
    try:
        t, result, down_at = _start_down_mid_write(h, x, prompt)
        time.sleep(down_s)
        wire.up()
        t.join(180)
        assert not t.is_alive(), "the request hangs"
    except BaseException:
        wire.up()
        raise
    finally:
        for end in (h.th.p.wire, h.th.d.wire):
            end.clear_qdisc()
    status, out, dt = result["r"]
    return status, out, dt, down_at


def test_link_down_mid_write_recompute_answers(hosts: Hosts) -> None:
    h = hosts
    prompt = _prompt(20)
    want = _reference(h, prompt)
    failed0 = _recv(h.dr.url, "failed") + _recv(h.dr.url, "timeout")
    status, out, dt, down_at = _down_mid_write(h, h.xr, prompt, TIMEOUTS["transfer_timeout_s"] + 3.0)
    assert status == 200 and out["choices"][0]["text"] == want, (status, out)
    assert dt < HOLD_BOUND_S + 15, dt
    RESULTS["link down mid-WRITE, recompute"] = {"latency_s": round(dt, 2), "down_at_s": round(down_at, 2),
                                                  "loaded": _recv(h.dr.url, "failed") + _recv(h.dr.url, "timeout")
                                                  == failed0}
    print(f"link down mid-WRITE (recompute): answered correctly in {dt:.2f} s (down at {down_at:.2f} s)")
    RESULTS["next request after link down, recompute"] = round(
        _served_with_p_kv(h, h.xr, h.dr, _prompt(21), "next after link down (recompute)"), 3)


def _fenced(url: str, outcome: str) -> float:
    return metric(scrape(url), "vllm:dsa_kv_fenced_connections_total", outcome=outcome)


def test_link_down_mid_write_fail_fails_cleanly_and_no_late_write(hosts: Hosts) -> None:
    """The wire goes down in the middle of P's WRITE and stays down past D's give-up and write bound: D keeps
    the given-up request's blocks (it waits for P's fence: its failure notice, sent after the aborted WRITE
    and only after NIXL flushed the connection) and meanwhile serves a second request on its own. The wire
    comes back: the fence arrives, the request fails cleanly (HTTP error or finish_reason error), a third
    request reuses the freed blocks, and D's whole KV cache then stays byte-identical while TCP delivers
    whatever P still had queued (before the fence D handed the blocks back at its write bound and such bytes
    landed in blocks it had given back)."""
    h = hosts
    prompt, second, third = _prompt(30), _prompt(32), _prompt(33)
    for q in (prompt, second, third):
        _reference(h, q)
    wire = h.th.p.wire
    fenced0, resets0 = _fenced(h.df.url, "load_fenced"), _fenced(h.p.url, "reset") + _fenced(h.p.url, "fenced")
    try:
        t, result, down_at = _start_down_mid_write(h, h.xf, prompt)
        time.sleep(max(0.0, result["t0"] + HOLD_BOUND_S + 8.0 - time.monotonic()))
        held = t.is_alive()  # past D's write bound: still holding the blocks, waiting for P's fence
        status2, out2, _ = _complete(h, h.df.url, second)  # D serves another request meanwhile, on its own
    finally:
        wire.up()
        for end in (h.th.p.wire, h.th.d.wire):
            end.clear_qdisc()
    t.join(180)
    assert not t.is_alive(), "the given-up request never ended after the link came back"
    status, out, dt = result["r"]
    assert held, f"D handed the given-up request's blocks back after {dt:.1f} s without P's fence"
    assert status2 == 200 and out2["choices"][0]["text"] == h.reference[second], (status2, out2)
    assert status != 200 or out["choices"][0].get("finish_reason") == "error", (status, out)
    status3, out3, _ = _complete(h, h.df.url, third)  # reuses blocks the given-up request held
    assert status3 == 200 and out3["choices"][0]["text"] == h.reference[third], (status3, out3)
    before = _kv_digest(h.df)
    time.sleep(15.0)  # TCP retransmits whatever P's socket still held
    after = _kv_digest(h.df)
    fenced = _fenced(h.df.url, "load_fenced") - fenced0
    p_fences = _fenced(h.p.url, "reset") + _fenced(h.p.url, "fenced") - resets0
    RESULTS["link down mid-WRITE, fail"] = {"latency_s": round(dt, 2), "status": status,
                                             "down_at_s": round(down_at, 2), "held_past_bound": held,
                                             "kv_unchanged": after == before, "d_fenced_loads": fenced,
                                             "p_fences": p_fences}
    print(f"link down mid-WRITE (fail): HTTP {status} in {dt:.2f} s (down at {down_at:.2f} s, blocks held past "
          f"the write bound: {held}); D's KV unchanged after the link came back: {after == before}; "
          f"fenced loads {fenced:.0f}, P fences {p_fences:.0f}")
    assert after == before, "a WRITE landed in D's KV cache after D gave the blocks back"
    assert fenced == 1 and p_fences >= 1, (fenced, p_fences)
    RESULTS["next request after link down, fail"] = round(
        _served_with_p_kv(h, h.xf, h.df, _prompt(31), "next after link down (fail)"), 3)


def _reconnects(h: Hosts) -> float:
    return metric(scrape(h.p.url), "vllm:dsa_kv_peer_reconnects_total")


def test_link_down_while_idle_recovers(hosts: Hosts) -> None:
    """The wire down ~45 s while idle (long enough for UCX to fail P's endpoints to D): P's next post meets the
    lost connection, re-adds D's remote agents from the handshake metadata it holds and posts again, so the
    next request on each pair is served with P's KV (before the fix P never re-added them: D recomputed
    forever)."""
    h = hosts
    r0 = _reconnects(h)
    h.th.p.wire.down()
    time.sleep(45.0)
    h.th.p.wire.up()
    dt = [round(_served_with_p_kv(h, x, d, _prompt(40 + i), "after 45 s down while idle"), 3)
          for i, (x, d) in enumerate(((h.xr, h.dr), (h.xf, h.df)))]
    again = [round(_served_with_p_kv(h, x, d, _prompt(42 + i), "second after 45 s down"), 3)
             for i, (x, d) in enumerate(((h.xr, h.dr), (h.xf, h.df)))]
    reconnects = _reconnects(h) - r0
    # one per D where UCX failed the endpoints (both, on the kernels tried); never a reconnect per request
    assert reconnects <= 2, f"P reconnected {reconnects:.0f} times for two Ds"
    RESULTS["after 45 s idle link down"] = {"latency_s": dt, "then_s": again, "peer_reconnects": reconnects}
    print(f"after 45 s with the link down while idle: {dt} s, then {again} s; P reconnected {reconnects:.0f}x")


def test_engines_alive(hosts: Hosts) -> None:
    for e in (hosts.p, hosts.dr, hosts.df):
        assert e.proc.popen.poll() is None, f"{e.proc.name} exited; log {e.proc.log}"
    assert os.path.exists(f"/var/run/netns/{hosts.th.p.netns}")
