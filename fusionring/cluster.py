"""An emulated cluster on one machine: one network namespace per rank, rate-limited links.

Each rank gets a namespace ``fr<rank>`` with one interface ``eth0`` (address ``10.77.0.<rank+1>/24``),
joined by a veth pair to the bridge ``frbr0`` in the root namespace. Both ends of every veth carry a
``tbf`` qdisc at the configured rate, so a rank's sends (namespace-side egress) and receives (bridge-side
egress) are each limited to that rate, as on a switch with one link per host. The bridge has no address and
the namespaces have no default route: traffic can only reach the lab's own addresses.

Only bandwidth is emulated, no latency: the lab does not use ``netem``. The command line::

    python -m fusionring.cluster up 4 --rate 1gbit
    python -m fusionring.cluster down

See ``docs/cluster.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, TextIO

NAMESPACE_PREFIX = "fr"
BRIDGE = "frbr0"
HOST_VETH_PREFIX = "frv"
RANK_INTERFACE = "eth0"
SUBNET_PREFIX = "10.77.0"
MAX_SIZE = 253  # addresses .1 .. .253 of the /24

# The time a tbf queue may hold a packet before dropping it. Long enough that TCP, which the kernel
# paces per socket, rarely sees drops at the rates the lab is used at; short enough to not bloat RTTs.
TBF_LATENCY_MS = 20


class ClusterError(RuntimeError):
    """The lab could not be built, torn down or measured; the message says why."""


# --------------------------------------------------------------------------------------------- rates

# tc(8) "RATES": a bare number and "bit" are bits per second; SI prefixes are powers of 1000, the
# IEC ones (kibit, ...) powers of 1024; "bps" means bytes per second. Units are case-insensitive.
_RATE_UNITS = {"": 1, "bit": 1, "bps": 8}
for _i, (_si, _iec) in enumerate((("k", "ki"), ("m", "mi"), ("g", "gi"), ("t", "ti")), start=1):
    _RATE_UNITS[_si + "bit"] = 1000 ** _i
    _RATE_UNITS[_iec + "bit"] = 1024 ** _i
    _RATE_UNITS[_si + "bps"] = 8 * 1000 ** _i
    _RATE_UNITS[_iec + "bps"] = 8 * 1024 ** _i
_RATE_RE = re.compile(r"^\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?)([a-z]*)\s*$", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """Parse a rate as tc spells it (``1gbit``, ``100mbit``, ``500kbit``, ``10mbps``) into bits per second.

    Raises ``ValueError`` naming the accepted units for anything else, or for a rate of zero.
    """
    match = _RATE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _RATE_UNITS:
        raise ValueError(
            f"invalid rate {text!r}: expected a number with a tc unit, e.g. 1gbit, 100mbit, 500kbit "
            f"(units: bit kbit mbit gbit tbit, kibit..tibit, bps kbps mbps gbps, kibps..tibps)")
    bits = int(round(float(match.group(1)) * _RATE_UNITS[unit]))
    if bits <= 0:
        raise ValueError(f"invalid rate {text!r}: must be above zero")
    return bits


def format_rate(bits_per_s: float) -> str:
    """Render bits per second the short way a person reads it (``1 Gbit/s``, ``94.1 Mbit/s``)."""
    for scale, name in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {name}"
    return f"{bits_per_s:.3g} bit/s"


def tbf_burst_bytes(rate_bits_per_s: int) -> int:
    """The tbf bucket size for a rate: 2 ms worth of traffic, and never below 64 KiB.

    tbf can only release as much as its bucket holds each time its timer fires; with a small bucket the
    achieved rate falls well short of the configured one at high rates (one TCP stream, measured on a
    2-core VM: at 10gbit a 64 KiB bucket gives 38%, 256 KiB 80%, 2 ms = 2.4 MiB 96%; at 1gbit 16 KiB
    gives 81%, 64 KiB and up 96%). 64 KiB keeps a whole GSO packet in one bucket at low rates, and 2 ms
    is far below any transfer the lab is meant to time, so the initial burst barely skews a timing.
    """
    return max(64 * 1024, int(rate_bits_per_s / 8 * 0.002))


# ---------------------------------------------------------------------------------------- commands

def _find_tool(name: str) -> Optional[str]:
    # root's PATH has the sbin folders, a sudo'd or cron shell may not: look there too.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def missing_prerequisites() -> Optional[str]:
    """Why the lab cannot run here (not Linux, not root, no iproute2), or ``None`` when it can."""
    if not sys.platform.startswith("linux"):
        return "the emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (it creates network namespaces, veth pairs and tc qdiscs)"
    for tool in ("ip", "tc"):
        if _find_tool(tool) is None:
            return f"the emulated cluster needs iproute2's `{tool}` (install the iproute2 package)"
    return None


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    # an inline probe script would drown the message: name it instead
    shown = " ".join(word if "\n" not in word else "<script>" for word in argv)
    try:
        done = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"`{shown}` failed: {exc}") from exc
    if check and done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or [""])[-1]
        raise ClusterError(f"`{shown}` failed (exit {done.returncode}): {last_line}")
    return done


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run([_find_tool("ip") or "ip", *args], check=check)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run([_find_tool("tc") or "tc", *args], check=check)


def existing_namespaces(prefix: str = NAMESPACE_PREFIX) -> List[str]:
    """Names of the lab's namespaces (``fr0``, ``fr1``, ...) that exist now, in rank order."""
    if _find_tool("ip") is None:
        return []
    listed = _ip("netns", "list", check=False).stdout
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    found = [name for name in (line.split()[0] for line in listed.splitlines() if line.strip())
             if pattern.match(name)]
    return sorted(found, key=lambda name: int(pattern.match(name).group(1)))


def _existing_links(bridge: str, veth_prefix: str) -> List[str]:
    listed = _ip("-o", "link", "show", check=False).stdout
    pattern = re.compile(rf"^(?:{re.escape(bridge)}|{re.escape(veth_prefix)}\d+)$")
    names = []
    for line in listed.splitlines():
        # "7: frv0@if2: <BROADCAST,...> ..." -> "frv0"
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@", 1)[0]
            if pattern.match(name):
                names.append(name)
    return names


def teardown(prefix: str = NAMESPACE_PREFIX, bridge: str = BRIDGE,
             veth_prefix: str = HOST_VETH_PREFIX) -> List[str]:
    """Remove every namespace, veth and bridge of the lab, whatever state an earlier ``up`` left.

    Idempotent; returns what it removed. Deleting a namespace deletes its veth end and so the pair.
    """
    removed = []
    for name in existing_namespaces(prefix):
        _ip("netns", "delete", name, check=False)
        removed.append(name)
    for name in _existing_links(bridge, veth_prefix):
        # a veth goes with its namespace above; the bridge and any half-built pair go here
        if _ip("link", "delete", name, check=False).returncode == 0:
            removed.append(name)
    # the kernel dismantles a deleted namespace's devices asynchronously: give it a moment
    deadline = time.monotonic() + 5.0
    while True:
        namespaces_left = existing_namespaces(prefix)
        links_left = _existing_links(bridge, veth_prefix)
        left = namespaces_left + links_left
        if not left or time.monotonic() > deadline:
            break
        for name in namespaces_left:
            _ip("netns", "delete", name, check=False)
        for name in links_left:
            _ip("link", "delete", name, check=False)
        time.sleep(0.05)
    if left:
        raise ClusterError(f"could not remove {', '.join(left)} (are you root?)")
    return removed


def netem_available() -> bool:
    """Whether the kernel offers the netem qdisc (latency emulation), tried on a scratch dummy link."""
    probe = "frnetemprobe"
    if _ip("link", "add", probe, "type", "dummy", check=False).returncode != 0:
        return False
    try:
        return _tc("qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _ip("link", "delete", probe, check=False)


# ------------------------------------------------------------------------------------- measurement

@dataclasses.dataclass(frozen=True)
class Measurement:
    """One timed TCP transfer between two namespaces of the lab."""

    source: str
    destination: str
    bytes_timed: int
    seconds: float
    configured_bits_per_s: int

    @property
    def bits_per_s(self) -> float:
        return self.bytes_timed * 8 / self.seconds if self.seconds > 0 else 0.0

    @property
    def fraction_of_configured(self) -> float:
        return self.bits_per_s / self.configured_bits_per_s

    def describe(self) -> str:
        return (f"measured {format_rate(self.bits_per_s)} from {self.source} to {self.destination} "
                f"({100 * self.fraction_of_configured:.0f}% of the configured "
                f"{format_rate(self.configured_bits_per_s)}; {self.bytes_timed / 2**20:.1f} MiB "
                f"in {self.seconds:.2f} s)")


# Run inside the receiving namespace: prints its port, then one JSON line after the sender closes.
# Timing starts once a quarter of the bytes have arrived, so the tbf bucket's initial burst and TCP's
# slow start do not inflate the rate.
_RECEIVER = r"""
import json, socket, sys, time
address, expected, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.bind((address, 0))
listener.listen(1)
listener.settimeout(timeout_s)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.settimeout(timeout_s)
buf = bytearray(1 << 20)
total, start, start_bytes, last = 0, None, 0, None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    now = time.perf_counter()
    total += n
    last = now
    if start is None and total >= expected // 4:
        start, start_bytes = now, total
print(json.dumps({"bytes": total - start_bytes, "seconds": (last - start) if start else 0.0}), flush=True)
"""

# Run inside the sending namespace: sends up to the byte count, stops early at the deadline.
_SENDER = r"""
import socket, sys, time
address, port, nbytes, deadline_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
sock = socket.create_connection((address, port), timeout=deadline_s)
chunk = bytes(1 << 20)
sent, end = 0, time.monotonic() + deadline_s
while sent < nbytes and time.monotonic() < end:
    sock.sendall(chunk[: min(len(chunk), nbytes - sent)])
    sent += min(len(chunk), nbytes - sent)
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
sock.close()
"""


# ------------------------------------------------------------------------------------------ the lab

class Cluster:
    """``size`` namespaces joined by a bridge, every link limited to ``rate`` in both directions.

    Use as a context manager (``with Cluster(4, "1gbit") as lab:``) so the lab is removed even when the
    body fails. Naming, addresses, ``rank_prefix`` and ``mpi_env`` need no root and work before ``up``.
    """

    def __init__(self, size: int, rate: str = "1gbit", *, prefix: str = NAMESPACE_PREFIX,
                 bridge: str = BRIDGE, veth_prefix: str = HOST_VETH_PREFIX,
                 subnet_prefix: str = SUBNET_PREFIX) -> None:
        if not 1 <= int(size) <= MAX_SIZE:
            raise ValueError(f"cluster size must be between 1 and {MAX_SIZE}, got {size}")
        self.size = int(size)
        self.rate = str(rate).strip()
        self.rate_bits_per_s = parse_rate(self.rate)
        self.prefix, self.bridge, self.veth_prefix = prefix, bridge, veth_prefix
        self.subnet_prefix = subnet_prefix

    # ----- naming (pure)
    def namespace(self, rank: int) -> str:
        """The namespace of ``rank``: ``fr<rank>``."""
        self._check_rank(rank)
        return f"{self.prefix}{rank}"

    def address(self, rank: int) -> str:
        """The IPv4 address of ``rank``'s interface inside its namespace."""
        self._check_rank(rank)
        return f"{self.subnet_prefix}.{rank + 1}"

    def rank_prefix(self, rank: int) -> List[str]:
        """The argv prefix that runs a program in ``rank``'s namespace: ``['ip', 'netns', 'exec', 'fr3']``."""
        return [_find_tool("ip") or "ip", "netns", "exec", self.namespace(rank)]

    def mpi_env(self) -> Dict[str, str]:
        """Environment that makes MPICH talk TCP over the lab's interface, never shared memory.

        MPICH only (Hydra's PMI reaches a rank in another namespace through an inherited fd). Open MPI
        5 starts ranks in the namespaces but its TCP transport never connects peers on one host.
        """
        return {
            # every peer is "remote": no shared-memory shortcut around the shaped links
            "MPIR_CVAR_NOLOCAL": "1",
            "MPIR_CVAR_CH4_NETMOD": "ofi",
            "FI_PROVIDER": "tcp",
            # pin libfabric to the namespace's veth; without it the tcp provider may pick loopback
            "FI_TCP_IFACE": RANK_INTERFACE,
            # nor fusionring's own shared-memory allreduce
            "FUSIONRING_SHARED_MEMORY": "off",
        }

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a cluster of {self.size}")

    def _host_veth(self, rank: int) -> str:
        return f"{self.veth_prefix}{rank}"

    # ----- lifecycle (root)
    def up(self, verify: bool = True, out: Optional[TextIO] = None) -> Optional[Measurement]:
        """Build the lab (tearing down any earlier one first) and, with ``verify``, time a transfer.

        Prints progress to ``out`` (stdout by default). On any failure the partial lab is removed and
        ``ClusterError`` is raised.
        """
        out = out if out is not None else sys.stdout
        reason = missing_prerequisites()
        if reason:
            raise ClusterError(reason)
        self.down()
        try:
            self._build()
            burst = tbf_burst_bytes(self.rate_bits_per_s)
            print(f"fusionring lab: {self.size} namespaces {self.namespace(0)}..{self.namespace(self.size - 1)} "
                  f"({self.address(0)}..{self.address(self.size - 1)}) on bridge {self.bridge}, every link "
                  f"shaped to {self.rate} each way (tbf, burst {burst // 1024} KiB, "
                  f"latency {TBF_LATENCY_MS} ms)", file=out)
            netem = "available but not used" if netem_available() else "not available on this kernel"
            print(f"fusionring lab: no latency is added (netem {netem}); only bandwidth is emulated", file=out)
            measurement = None
            if verify and self.size >= 2:
                measurement = self.measure(0, 1)
                print(f"fusionring lab: {measurement.describe()}", file=out)
            out.flush()
            return measurement
        except BaseException:
            self.down()
            raise

    def down(self) -> List[str]:
        """Remove the lab (namespaces, veths, bridge); safe to call any number of times."""
        return teardown(self.prefix, self.bridge, self.veth_prefix)

    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc_info) -> None:
        self.down()

    def _shape(self, device: str, namespace: Optional[str] = None) -> None:
        where = ["-n", namespace] if namespace else []
        _tc(*where, "qdisc", "replace", "dev", device, "root", "tbf", "rate", self.rate,
            "burst", str(tbf_burst_bytes(self.rate_bits_per_s)), "latency", f"{TBF_LATENCY_MS}ms")

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        # no IPv6 link-local addresses anywhere: nothing but the lab's IPv4 /24 for MPI to pick
        _ip("link", "set", self.bridge, "addrgenmode", "none")
        _ip("link", "set", self.bridge, "up")
        for rank in range(self.size):
            ns, veth = self.namespace(rank), self._host_veth(rank)
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", RANK_INTERFACE, "netns", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", RANK_INTERFACE, "addrgenmode", "none")
            _ip("-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", RANK_INTERFACE)
            _ip("-n", ns, "link", "set", RANK_INTERFACE, "up")
            _ip("link", "set", veth, "addrgenmode", "none")
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            self._shape(RANK_INTERFACE, ns)  # what the rank sends
            self._shape(veth)  # what the rank receives (the bridge sends it out of this port)

    def measure(self, source: int = 0, destination: int = 1, seconds: float = 1.0,
                max_bytes: int = 1 << 30) -> Measurement:
        """Time one TCP stream from ``source``'s namespace to ``destination``'s over the lab's links.

        Sends about ``seconds`` worth of traffic at the configured rate (at most ``max_bytes``) and gives
        up after ``seconds * 4 + 10`` seconds; the receiver times the transfer.
        """
        # at least 8 buckets, so the bucket's initial burst is a small part of what is timed
        burst = tbf_burst_bytes(self.rate_bits_per_s)
        nbytes = int(min(max_bytes, max(8 * burst, self.rate_bits_per_s / 8 * seconds)))
        deadline_s = seconds * 4 + 10
        receiver = subprocess.Popen(
            self.rank_prefix(destination) + [sys.executable, "-c", _RECEIVER, self.address(destination),
                                             str(nbytes), str(deadline_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            port = receiver.stdout.readline().strip()
            if not port.isdigit():
                receiver.kill()
                raise ClusterError(f"rate probe receiver in {self.namespace(destination)} did not start: "
                                   f"{receiver.communicate()[1].strip()}")
            self._send_probe(source, destination, port, nbytes, deadline_s)
            result_line, errors = receiver.communicate(timeout=deadline_s + 5)
        except subprocess.TimeoutExpired as exc:
            raise self._probe_failed(source, destination, exc) from exc
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        if receiver.returncode != 0 or not result_line.strip():
            raise ClusterError(f"rate probe receiver in {self.namespace(destination)} failed: "
                               f"{errors.strip()}")
        result = json.loads(result_line.strip().splitlines()[-1])
        if result["seconds"] <= 0:
            raise ClusterError(f"rate probe to {self.namespace(destination)} received too little to time")
        return Measurement(self.namespace(source), self.namespace(destination), int(result["bytes"]),
                           float(result["seconds"]), self.rate_bits_per_s)


    def _probe_failed(self, source: int, destination: int, why: Exception) -> ClusterError:
        return ClusterError(
            f"rate probe from {self.namespace(source)} to {self.namespace(destination)} failed: {why}. "
            f"If the host filters bridged traffic (br_netfilter with a FORWARD DROP policy, as Docker sets), "
            f"allow the lab's bridge: iptables -I FORWARD -i {self.bridge} -o {self.bridge} -j ACCEPT")

    def _send_probe(self, source: int, destination: int, port: str, nbytes: int, deadline_s: float) -> None:
        try:
            _run(self.rank_prefix(source) + [sys.executable, "-c", _SENDER, self.address(destination), port,
                                             str(nbytes), str(deadline_s)], timeout=deadline_s + 5)
        except ClusterError as exc:
            raise self._probe_failed(source, destination, exc) from exc


# --------------------------------------------------------------------------------------------- CLI

def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m fusionring.cluster up N --rate RATE | down | status``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m fusionring.cluster",
        description="Emulated cluster: one network namespace per rank, rate-limited veth links.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build the lab (tearing down an earlier one first)")
    up.add_argument("size", type=int, help="number of namespaces (ranks)")
    up.add_argument("--rate", default="1gbit", help="link rate each way, as tc spells it (default 1gbit)")
    up.add_argument("--no-verify", action="store_true", help="skip the timed transfer between fr0 and fr1")
    sub.add_parser("down", help="remove the lab; safe to repeat")
    sub.add_parser("status", help="list the lab's namespaces and their shaping")
    args = parser.parse_args(argv)

    try:
        if args.command == "status":
            names = existing_namespaces()
            if not names:
                print("fusionring lab: down")
            for name in names:
                qdisc = _tc("-n", name, "qdisc", "show", "dev", RANK_INTERFACE, check=False).stdout.strip()
                addr = _ip("-n", name, "-br", "-4", "addr", "show", RANK_INTERFACE, check=False).stdout.split()
                print(f"{name}: {' '.join(addr[2:]) or '-'}  {qdisc or '-'}")
            return 0
        lab = None
        if args.command == "up":
            try:
                lab = Cluster(args.size, args.rate)
            except ValueError as exc:
                print(f"fusionring lab: {exc}", file=sys.stderr)
                return 2
        reason = missing_prerequisites()
        if reason:
            print(f"fusionring lab: {reason}", file=sys.stderr)
            return 2
        if lab is None:
            removed = teardown()
            print(f"fusionring lab: removed {', '.join(removed)}" if removed
                  else "fusionring lab: nothing to remove")
            return 0
        lab.up(verify=not args.no_verify)
        return 0
    except ClusterError as exc:
        print(f"fusionring lab: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
