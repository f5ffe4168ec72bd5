"""Test hosts on this machine: Linux network namespaces joined to the root namespace by veth pairs.

The root namespace routes between them, so a partition is an ``ip rule ... blackhole`` in the
router: packets between two hosts vanish silently in both directions (no RST, no FIN, no ICMP),
which is what a real partition or a frozen link looks like to TCP.  Only addresses of these
namespaces are used.  Needs root and iproute2; :func:`unavailable` says why when not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"tpprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` was refused: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def netem_unavailable() -> str | None:
    """Why `tc netem` (delay and loss) cannot be used here, or None."""
    if shutil.which("tc") is None:
        return "tc is not installed"
    probe = f"tpq{os.getpid() % 100000}"
    made = _ip("link", "add", probe, "type", "veth", "peer", "name", probe + "p", check=False)
    if made.returncode != 0:
        return f"cannot make a link to probe tc on: {made.stderr.strip()}"
    try:
        r = subprocess.run(["tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
        return None if r.returncode == 0 else f"the kernel has no netem qdisc (tc: {r.stderr.strip()})"
    finally:
        _ip("link", "del", probe, check=False)


def _free_octet() -> int:
    """A second octet ``x`` with no ``10.x.*`` address on this machine (several test runs, or a
    leftover namespace, must not share subnets)."""
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    for x in [*range(200 + os.getpid() % 50, 250), *range(200, 250)]:
        if f"10.{x}." not in used:
            return x
    raise RuntimeError("no free 10.x.0.0/16 range (x in 200..249) for test hosts")


@dataclass
class Hosts:
    """Named hosts, each a namespace with one address; the root namespace is their router."""

    names: list[str]
    tag: str = field(default_factory=lambda: str(os.getpid() % 10000))
    octet: int = field(default_factory=lambda: _free_octet())
    _rules: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    _next_pref: int = 1000
    _forward: str = "0"

    def ns(self, name: str) -> str:
        return f"tp{self.tag}{name}"

    def addr(self, name: str) -> str:
        return f"10.{self.octet}.{self.names.index(name) + 1}.2"

    def router_addr(self, name: str) -> str:
        """The root namespace's address on ``name``'s link (what ``name`` reaches it by)."""
        return f"10.{self.octet}.{self.names.index(name) + 1}.1"

    def _subnet(self, name: str) -> str:
        return f"10.{self.octet}.{self.names.index(name) + 1}.0/24"

    def up(self) -> None:
        with open("/proc/sys/net/ipv4/ip_forward") as f:
            self._forward = f.read().strip()
        for i, name in enumerate(self.names, start=1):
            ns, root_end, ns_end = self.ns(name), f"tpr{self.tag}{i}", f"tpn{self.tag}{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", root_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", ns_end, "netns", ns)
            _ip("addr", "add", f"10.{self.octet}.{i}.1/24", "dev", root_end)
            _ip("link", "set", root_end, "up")
            _ip("-n", ns, "addr", "add", f"10.{self.octet}.{i}.2/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", f"10.{self.octet}.{i}.1")
        with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
            f.write("1")

    def down(self) -> None:
        for pair in list(self._rules):
            self.heal(*pair)
        for name in self.names:
            ns = self.ns(name)
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", ns, check=False)
        for i in range(1, len(self.names) + 1):  # gone with their namespace, unless something holds it
            _ip("link", "del", f"tpr{self.tag}{i}", check=False)
        with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
            f.write(self._forward)

    def run(self, name: str, cmd: list[str]) -> list[str]:
        """``cmd`` as run inside host ``name``."""
        return ["ip", "netns", "exec", self.ns(name), *cmd]

    def cut(self, a: str, b: str) -> None:
        """Partition ``a`` from ``b`` (both directions), silently."""
        prefs = []
        for src, dst in ((a, b), (b, a)):
            pref = self._next_pref
            self._next_pref += 1
            _ip("rule", "add", "pref", str(pref), "from", self._subnet(src), "to", self._subnet(dst), "blackhole")
            prefs.append(pref)
        self._rules[(a, b)] = prefs

    def heal(self, a: str, b: str) -> None:
        for pref in self._rules.pop((a, b), []):
            _ip("rule", "del", "pref", str(pref), check=False)

    def limit_rate(self, name: str, mbit: int) -> None:
        """Cap the traffic the router sends into host ``name`` at ``mbit`` Mbit/s (a token bucket on
        the root end of its link), so a large copy into it lasts seconds, not a blink.  Gone with
        the link in :meth:`down`."""
        dev = f"tpr{self.tag}{self.names.index(name) + 1}"
        subprocess.run(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                        "burst", "256kb", "latency", "500ms"],
                       capture_output=True, text=True, check=True, timeout=30)  # fmt: skip


@contextlib.contextmanager
def hosts(*names: str) -> Iterator[Hosts]:
    h = Hosts(list(names))
    try:
        h.up()
        yield h
    finally:
        h.down()
