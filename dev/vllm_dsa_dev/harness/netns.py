"""Two "hosts" on one machine: Linux network namespaces joined by veth pairs (needs root: ``ip netns``).

:func:`two_hosts` makes a namespace for P and one for D, joined by a veth pair (the "wire" between the hosts,
``10.213.N.0/30``), plus one veth pair from the root namespace into each of them (``10.213.N.4/30`` to P,
``10.213.N.8/30`` to D) so that a client or router in the root namespace reaches the engines' HTTP ports.
P and D talk only over the wire: the side channel binds to the wire address and NIXL/UCX is told to use the
wire's device (:meth:`Host.ucx_env`: ``UCX_TLS=tcp``; UCX's shared-memory transports, CMA included, cross
network namespaces, so without it the KV bytes would not go over the veth at all).

Every name carries a per-run tag (unique: pid and a counter), the addresses are a private test range
(``10.213.0.0/16``) that exists only while the namespaces do, and :func:`two_hosts` removes everything it made
on exit, exception or failure half-way through set-up. :func:`unavailable` says why namespaces cannot be made
here (not root, no ``ip``, or the kernel refuses namespaces or veth pairs), for a test's skip reason. Faults: :meth:`Link.down`,
:meth:`Link.up`, :meth:`Link.qdisc` (``tc``; :func:`netem_unavailable` says why the kernel has no ``netem``, if so).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)  # stdlib only, like procs: the harness runs without vLLM

#: The private test range the namespaces' addresses come from (10.213.N.0/28 per pair of hosts).
NET_PREFIX = "10.213"
_COUNTER = itertools.count()


class NetnsError(RuntimeError):
    """A namespace, link or qdisc command failed (the message has the command and its stderr)."""


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out


def unavailable() -> str:
    """Why network namespaces cannot be made on this machine, or ``""`` when they can (probed by making and
    removing one)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no 'ip' command (iproute2) on this machine"
    name = f"dsaprobe{os.getpid()}"
    out = _run(["ip", "netns", "add", name], check=False)
    if out.returncode != 0:
        return f"the kernel refuses network namespaces: ip netns add: {out.stderr.strip()}"
    _run(["ip", "netns", "del", name], check=False)
    a, b = f"dvp{os.getpid() % 100000}"[:15], f"dvq{os.getpid() % 100000}"[:15]
    out = _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b], check=False)
    if out.returncode != 0:
        return f"the kernel refuses veth pairs: ip link add {a} type veth: {out.stderr.strip()}"
    _run(["ip", "link", "del", a], check=False)
    return ""


@dataclass(frozen=True)
class Link:
    """One end of a veth pair: its device name, the namespace it lives in (``""``: the root one) and address."""

    dev: str
    netns: str
    addr: str

    @property
    def _prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    def down(self) -> None:
        """Take this end down (the pair carries nothing until :meth:`up`)."""
        _run([*self._prefix, "ip", "link", "set", self.dev, "down"])

    def up(self) -> None:
        """Bring this end up again."""
        _run([*self._prefix, "ip", "link", "set", self.dev, "up"])

    def qdisc(self, *spec: str) -> None:
        """Replace the root qdisc of this end's egress, e.g. ``qdisc("netem", "delay", "20ms")`` or
        ``qdisc("tbf", "rate", "8mbit", "burst", "32kbit", "latency", "400ms")``."""
        _run([*self._prefix, "tc", "qdisc", "replace", "dev", self.dev, "root", *spec])

    def clear_qdisc(self) -> None:
        """Back to the default qdisc (no error when none was set)."""
        _run([*self._prefix, "tc", "qdisc", "del", "dev", self.dev, "root"], check=False)

    def stat(self, name: str) -> int:
        """A counter of this end (``rx_bytes``, ``tx_bytes``, ...), read inside its namespace: sysfs shows the
        devices of the namespace of the process that mounted it, so the read runs there."""
        path = f"/sys/class/net/{self.dev}/statistics/{name}"
        if not self.netns:
            return int(Path(path).read_text())
        return int(_run([*self._prefix, "cat", path]).stdout.strip())


@dataclass(frozen=True)
class Host:
    """One namespace: its name, the end of the P-D wire in it and the end of its link to the root namespace."""

    netns: str
    wire: Link
    root_side: Link  # this namespace's end of its link from the root namespace

    @property
    def prefix(self) -> list[str]:
        """Command prefix that runs a command inside this namespace."""
        return ["ip", "netns", "exec", self.netns]

    @property
    def addr(self) -> str:
        """The wire address (the side channel binds here; the peer reaches this host here)."""
        return self.wire.addr

    @property
    def http_addr(self) -> str:
        """The address the root namespace reaches this host at (HTTP servers bind here)."""
        return self.root_side.addr

    def ucx_env(self) -> dict[str, str]:
        """UCX over tcp on the wire's device only: NIXL's bytes to the peer cross the veth."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.wire.dev}


@dataclass(frozen=True)
class TwoHosts:
    """P's and D's namespaces and the root namespace's ends of the links to them."""

    p: Host
    d: Host
    root_to_p: Link
    root_to_d: Link
    tag: str

    def namespaces(self) -> list[str]:
        """Both namespaces' names."""
        return [self.p.netns, self.d.netns]


def _subnet() -> int:
    """A third octet for this run (pid and a counter: concurrent runs get different ones, mostly)."""
    return (os.getpid() * 7 + next(_COUNTER)) % 250 + 1


@contextmanager
def two_hosts(tag: str | None = None) -> Iterator[TwoHosts]:
    """Make P's and D's namespaces with the wire between them and a link from the root namespace to each;
    remove everything on exit (also when set-up fails half-way). Raises :class:`NetnsError` when a step fails."""
    tag = tag or f"{os.getpid() % 100000}{next(_COUNTER)}"
    n = _subnet()
    net = f"{NET_PREFIX}.{n}"
    p_ns, d_ns = f"dsa-p-{tag}", f"dsa-d-{tag}"
    made_ns: list[str] = []
    made_links: list[str] = []  # root-namespace ends (deleting one end deletes the pair)
    try:
        for ns in (p_ns, d_ns):
            _run(["ip", "netns", "add", ns])
            made_ns.append(ns)
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
        # the wire P <-> D (made in the root namespace, each end moved into its host)
        wp, wd = f"dwp{tag}"[:15], f"dwd{tag}"[:15]
        _run(["ip", "link", "add", wp, "type", "veth", "peer", "name", wd])
        made_links.append(wp)
        _run(["ip", "link", "set", wp, "netns", p_ns])
        made_links.remove(wp)  # now inside p_ns: goes with the namespace
        _run(["ip", "link", "set", wd, "netns", d_ns])
        hosts: list[tuple[Link, Link, Link]] = []  # (wire end, root end, namespace's end of its root link)
        for i, (ns, wire_dev) in enumerate(((p_ns, wp), (d_ns, wd))):
            wire = Link(wire_dev, ns, f"{net}.{1 + i}")
            root_dev, ns_dev = f"drr{i}{tag}"[:15], f"drn{i}{tag}"[:15]
            _run(["ip", "link", "add", root_dev, "type", "veth", "peer", "name", ns_dev])
            made_links.append(root_dev)
            _run(["ip", "link", "set", ns_dev, "netns", ns])
            root = Link(root_dev, "", f"{net}.{5 + 4 * i}")
            inner = Link(ns_dev, ns, f"{net}.{6 + 4 * i}")
            for link in (wire, root, inner):
                pre = ["ip", "netns", "exec", link.netns] if link.netns else []
                _run([*pre, "ip", "addr", "add", f"{link.addr}/30", "dev", link.dev])
                _run([*pre, "ip", "link", "set", link.dev, "up"])
            hosts.append((wire, root, inner))
        th = TwoHosts(Host(p_ns, hosts[0][0], hosts[0][2]), Host(d_ns, hosts[1][0], hosts[1][2]),
                      hosts[0][1], hosts[1][1], tag)
        logger.info("two hosts %s: P %s (wire %s %s, http %s), D %s (wire %s %s, http %s)", tag, p_ns, wp,
                    th.p.addr, th.p.http_addr, d_ns, wd, th.d.addr, th.d.http_addr)
        yield th
    finally:
        for dev in made_links:
            _run(["ip", "link", "del", dev], check=False)
        for ns in reversed(made_ns):
            # processes still inside keep a namespace alive only as long as they live; the name goes now
            _run(["ip", "netns", "del", ns], check=False)


def netem_unavailable() -> str:
    """``""`` when the kernel has the ``netem`` qdisc, else why not (probed on a throw-away veth pair)."""
    tag = f"{os.getpid() % 100000}{next(_COUNTER)}"
    a, b = f"dnm{tag}"[:15], f"dnn{tag}"[:15]
    try:
        _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
    except NetnsError as e:
        return str(e)
    try:
        out = _run(["tc", "qdisc", "add", "dev", a, "root", "netem", "delay", "20ms"], check=False)
        if out.returncode != 0:
            return f"this kernel has no netem qdisc (tc qdisc add ... netem delay 20ms: {out.stderr.strip()})"
        return ""
    finally:
        _run(["ip", "link", "del", a], check=False)
