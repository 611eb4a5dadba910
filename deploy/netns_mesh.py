"""Hosts simulated by Linux network namespaces, every pair joined by its own shaped link.

Each host is a namespace with one address (10.77.<net>.<i>/32, on every one of its links);
the client host is the root namespace itself (the test or benchmark process). Every pair of
hosts (i, j) gets a link: a veth pair from each host to a hub namespace, joined there by a
bridge of their own. A host's side of a link is shaped with `tc tbf` to the link's
bandwidth (what a NIC and a switch port give); `netem` is not needed.

Cutting a link sets its hub-side veths down: both hosts see their link lose carrier but keep
their address and route, so packets go out and vanish, as in a partition between racks (not
an instant "no route", which a host whose own interface went down would see). Restoring sets
them up again.

Names carry the owning process's id (`pk<pid base 36>`), so a run that was killed leaves
namespaces the next run recognises and removes (`remove_leftovers`), with the processes
still inside them. Root is required (`unavailable_reason` says why a machine cannot).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence

NAME_PREFIX = "pk"
NAME_RE = re.compile(rf"^{NAME_PREFIX}([0-9a-z]+)-")
SUBNET_FIRST_OCTETS = "10.77"
DEFAULT_RATE = "1gbit"


def base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def rate_bits(rate: str) -> int:
    """tc's rate syntax ("100mbit", "1gbit", "800kbit", "5000bit") in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g|)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: expected e.g. 800kbit, 100mbit, 1gbit")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def run_ip(args: Sequence[str], stdin: str | None = None, check: bool = True
           ) -> subprocess.CompletedProcess[str]:
    """`ip ...` (or `tc ...`: args[0] names the tool); a failure raises with its stderr."""
    proc = subprocess.run(list(args), input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} failed: {proc.stderr.strip()[:500]}")
    return proc


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{NAME_PREFIX}{base36(os.getpid())}-probe"
    made = run_ip(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()[:200]}"
    run_ip(["ip", "netns", "del", probe], check=False)
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace(name: str) -> None:
    """SIGKILL every process inside namespace `name` (by id), then delete it."""
    pids = run_ip(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    run_ip(["ip", "netns", "del", name], check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone; their names."""
    removed = []
    for line in run_ip(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = NAME_RE.match(name)
        if m and not pid_alive(int(m.group(1), 36)):
            kill_namespace(name)
            removed.append(name)
    return removed


def free_subnet_octet() -> int:
    """A third octet no address of the root namespace uses under 10.77."""
    used = set(re.findall(rf"{re.escape(SUBNET_FIRST_OCTETS)}\.(\d+)\.",
                          run_ip(["ip", "-4", "addr"], check=False).stdout))
    for octet in range(1, 255):
        if str(octet) not in used:
            return octet
    raise RuntimeError("no free 10.77.x.0/24 subnet left in the root namespace")


class NetnsMesh:
    """`hosts[0]` is the root namespace (the calling process); every other host is a
    namespace. `rate`: every link's bandwidth (tc rate syntax, e.g. "100mbit"); `rates`
    overrides it for a pair of host names."""

    def __init__(self, hosts: Sequence[str], rate: str = DEFAULT_RATE,
                 rates: dict[frozenset[str], str] | None = None) -> None:
        if len(hosts) < 2 or len(set(hosts)) != len(hosts):
            raise ValueError("a mesh needs two or more distinct host names")
        self.tag = f"{NAME_PREFIX}{base36(os.getpid())}"
        self.hosts = list(hosts)
        self.rate = rate
        self.rates = dict(rates or {})
        self.octet = 0
        self.hub = f"{self.tag}-hub"
        self.cut_links: set[frozenset[str]] = set()
        self.made: list[str] = []  # namespaces created, for clean-up

    # names -------------------------------------------------------------------------
    def index(self, host: str) -> int:
        return self.hosts.index(host)

    def namespace(self, host: str) -> str | None:
        """The host's namespace name; None for the root namespace (the client)."""
        i = self.index(host)
        return None if i == 0 else f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET_FIRST_OCTETS}.{self.octet}.{self.index(host) + 1}"

    def host_dev(self, a: str, b: str) -> str:
        """a's side of the link to b (unique in the root namespace: the tag is in it)."""
        return f"{self.tag}v{self.index(a):x}{self.index(b):x}"

    @staticmethod
    def hub_dev(i: int, j: int) -> str:
        return f"h{i:x}{j:x}"

    def pair_key(self, a: str, b: str) -> tuple[int, int]:
        i, j = sorted((self.index(a), self.index(b)))
        return i, j

    def ip_in(self, host: str | None) -> list[str]:
        ns = None if host is None else self.namespace(host)
        return ["ip"] if ns is None else ["ip", "-n", ns]

    def tc_in(self, host: str) -> list[str]:
        ns = self.namespace(host)
        return ["tc"] if ns is None else ["tc", "-n", ns]

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """argv run inside the host's namespace (unchanged for the client)."""
        ns = self.namespace(host)
        return list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]

    # lifecycle -------------------------------------------------------------------
    def create(self) -> NetnsMesh:
        remove_leftovers()
        self.octet = free_subnet_octet()
        try:
            self._add_namespace(self.hub)
            for host in self.hosts[1:]:
                ns = self.namespace(host)
                assert ns is not None
                self._add_namespace(ns)
            for a, b in itertools.combinations(self.hosts, 2):
                self._add_link(a, b)
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        run_ip(["ip", "netns", "add", name])
        self.made.append(name)
        run_ip(["ip", "-n", name, "link", "set", "lo", "up"])
        # A packet from a host's address arrives on whichever link it was routed over.
        for conf in ("all", "default"):
            run_ip(["ip", "netns", "exec", name, "sysctl", "-qw",
                    f"net.ipv4.conf.{conf}.rp_filter=0"], check=False)

    def _add_link(self, a: str, b: str) -> None:
        i, j = self.pair_key(a, b)
        bridge = f"b{i:x}{j:x}"
        hub = ["ip", "-n", self.hub]
        run_ip([*hub, "link", "add", bridge, "type", "bridge"])
        run_ip([*hub, "link", "set", bridge, "up"])
        rate = self.rates.get(frozenset((a, b)), self.rate)
        for near, far in ((a, b), (b, a)):
            dev = self.host_dev(near, far)
            hub_dev = self.hub_dev(self.index(near), self.index(far))
            # Made in the hub, its host end moved into the host (or left in root).
            run_ip([*hub, "link", "add", hub_dev, "type", "veth", "peer", "name", dev])
            ns = self.namespace(near)
            run_ip([*hub, "link", "set", dev, "netns", ns if ns is not None else "1"])
            run_ip([*hub, "link", "set", hub_dev, "master", bridge])
            run_ip([*hub, "link", "set", hub_dev, "up"])
            inside = self.ip_in(near)
            run_ip([*inside, "addr", "add", f"{self.address(near)}/32", "dev", dev])
            run_ip([*inside, "link", "set", dev, "up"])
            run_ip([*inside, "route", "add", f"{self.address(far)}/32", "dev", dev, "src",
                    self.address(near)])
            self._shape(near, dev, rate)

    def _shape(self, host: str, dev: str, rate: str, burst_ms: float = 10.0) -> None:
        # burst: burst_ms at this rate (10: the tokens a timer tick needs), never under a few
        # frames: a larger bucket would let the first burst through at the veth's speed.
        # latency bounds the queue (packets waiting longer are dropped, as a switch's).
        burst = max(int(rate_bits(rate) / 8 * burst_ms / 1000), 16 * 1024)
        run_ip([*self.tc_in(host), "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", str(burst), "latency", "200ms"])

    def set_rate(self, a: str, b: str, rate: str, burst_ms: float = 10.0) -> None:
        """Reshape the link between a and b (both directions). `burst_ms`: the bucket, in
        time at the rate (10 ms lets a 12.5 MB burst through a 10 Gbit/s link unshaped:
        measuring a transfer of tens of MB, 1 ms is closer to the rate; tbf still reaches
        it on a veth with that)."""
        self.rates[frozenset((a, b))] = rate
        for near, far in ((a, b), (b, a)):
            self._shape(near, self.host_dev(near, far), rate, burst_ms)

    def cut(self, a: str, b: str) -> None:
        """Packets between a and b vanish from now on (both keep their links up)."""
        self._set_hub_ports(a, b, "down")
        self.cut_links.add(frozenset((a, b)))

    def restore(self, a: str, b: str) -> None:
        self._set_hub_ports(a, b, "up")
        self.cut_links.discard(frozenset((a, b)))

    def _set_hub_ports(self, a: str, b: str, state: str) -> None:
        for near, far in ((a, b), (b, a)):
            run_ip(["ip", "-n", self.hub, "link", "set",
                    self.hub_dev(self.index(near), self.index(far)), state])

    def destroy(self) -> None:
        """Kill what runs inside, delete every namespace (their veths go with them)."""
        for name in reversed(self.made):
            kill_namespace(name)
        self.made.clear()
        # A root-side veth whose hub end is gone is gone too; one left by a failed create:
        for line in run_ip(["ip", "-o", "link"], check=False).stdout.splitlines():
            m = re.match(rf"\d+: ({re.escape(self.tag)}v[0-9a-f]+)[@:]", line)
            if m:
                run_ip(["ip", "link", "del", m.group(1)], check=False)
