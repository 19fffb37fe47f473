"""What P may still write after a give-up, with two real NIXL agents in this process over UCX TCP.

- The post deadline holds through a reconnect: the connection between the agents is aborted (``ss -K``),
  so the next post meets a dead connection and reconnects (remove + add the remote agent, post again). The
  reconnect is slowed past the deadline (``add_remote_agent`` wrapped to sleep: the one mock, a slow
  metadata load cannot be caused otherwise); the WRITE is refused, not posted after its deadline.
- P's staging arena does not leak on failed bounces: bounced WRITEs to a receiver that never progresses
  (UCX TCP: the bytes wait for the target) time out, more of them than the arena holds; every one's space
  comes back once its connection is fenced, and the next bounce finds room.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

from tests.test_transport_nixl import _kill_connections, _kill_unavailable
from vllm_dsa_connector.transport import NixlEngine, PostState
from vllm_dsa_connector.transport.routed import RoutedTransport
from vllm_dsa_connector.transport.runs import runs_from_blocks

PAGE = 4096


@pytest.fixture
def tcp(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Agents made inside use UCX over TCP only (as between hosts): a WRITE waits for the target to progress."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    yield


def _pair(tag: str) -> tuple[NixlEngine, NixlEngine]:
    stamp = time.monotonic_ns()
    return NixlEngine(f"{tag}-p-{stamp}"), NixlEngine(f"{tag}-d-{stamp}")


def _until_done(p: NixlEngine, d: NixlEngine, xfer, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while p.state(xfer) == "PROC":
        d.progress()
        assert time.monotonic() < end, "the WRITE did not complete"
    p.wait(xfer)


def test_post_deadline_is_checked_after_a_reconnect_right_before_the_post(tcp: None,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    why = _kill_unavailable()
    if why:
        pytest.skip(why)
    p, d = _pair("dl")
    try:
        src = torch.full((4 * PAGE,), 7, dtype=torch.uint8)
        dst = torch.zeros(4 * PAGE, dtype=torch.uint8)
        rs, rd = p.register(src), d.register(dst)
        peer = p.add_peer(d.metadata())
        _until_done(p, d, p.write(peer, rs, rd.desc(), runs_from_blocks([0], [0], PAGE)))
        assert _kill_connections(os.getpid(), os.getpid()) > 0
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # both agents see the reset
            p.progress()
            d.progress()
        slow = p._agent.add_remote_agent

        def slow_add(meta: bytes):  # a reconnect that takes 1.5 s (a slow metadata load)
            time.sleep(1.5)
            return slow(meta)

        monkeypatch.setattr(p._agent, "add_remote_agent", slow_add)
        transport = RoutedTransport(p, 5.0)
        started = time.monotonic()
        post = transport.post(peer, [(rs, rd.desc(), runs_from_blocks([0], [1], PAGE))], writer=0, tag=b"late",
                              deadline=started + 0.5)
        took = time.monotonic() - started
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # anything posted lands meanwhile
            transport.progress(post)
            d.progress()
        assert p.reconnects == 1 and took >= 1.5, (p.reconnects, took)  # the reconnect did run past the deadline
        assert post.state is PostState.FAILED and "post deadline passed" in post.error, post.error
        assert not bool(dst[PAGE:2 * PAGE].any()), "a WRITE was posted after its deadline (during a reconnect)"
        # a post before its deadline goes through on the reconnected connection
        _until_done(p, d, p.write(peer, rs, rd.desc(), runs_from_blocks([0], [2], PAGE),
                                  deadline=time.monotonic() + 10))
        assert bool((dst[2 * PAGE:3 * PAGE] == 7).all())
    finally:
        p.close()
        d.close()
