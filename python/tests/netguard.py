"""The loopback guard: no process of the test run may listen on an address outside loopback, or
have a connection to one, unless it runs in a network namespace other than the run's own (one
that a test made for itself, as the partition drills do).

The run's processes are the pytest process (or, run as a script, the process named by
``--root``: ``scripts/test.sh`` watches itself, so the Rust tests are covered too) and its
descendants: the clusters' binaries, the
worker scripts, and Ray's raylets, actors and workers. A socket is theirs if one of their file
descriptors is it. What is looked at (``/proc/net/{tcp,udp}{,6}`` of the run's namespace):

- a TCP socket listening on an address that is not loopback (the unspecified addresses of
  IPv4 and IPv6 included: they listen on every interface);
- a bound UDP socket whose local address is not loopback (UDP has no listening state: a bound
  socket receives what is sent to it);
- a TCP or UDP socket connected to a peer that is not loopback.

:class:`Watch` samples in a thread of its own, so sockets that live for a few seconds are seen
too; each sample reads the four tables and looks for owners only among sockets not seen before.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Breach", "Watch", "breaches", "descendants"]

_TABLES = ("tcp", "tcp6", "udp", "udp6")
_TCP_LISTEN = "0A"


@dataclass(frozen=True)
class Breach:
    """A socket of the run that reaches outside loopback."""

    pid: int
    command: str
    proto: str
    local: str
    remote: str
    what: str

    def __str__(self) -> str:
        peer = f" to {self.remote}" if self.what == "connected" else ""
        return f"pid {self.pid} ({self.command}): {self.proto} {self.what} at {self.local}{peer}"


def descendants(root: int) -> set[int]:
    """``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command in parentheses may hold spaces: the fields after it are fixed.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


def _address(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of ``/proc/net/*``: hex host-order words, then the port."""
    host, port = field.split(":")
    raw = bytes.fromhex(host)
    # Each 32-bit word is in the host's byte order (little-endian here).
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(swapped)
    return ip, int(port, 16)


def _outside(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_loopback


def _show(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _suspects(net: Path) -> dict[int, tuple[str, str, str, str]]:
    """Sockets of the tables under ``net`` that reach outside loopback, by inode: (protocol,
    local, remote, what)."""
    out: dict[int, tuple[str, str, str, str]] = {}
    for table in _TABLES:
        try:
            lines = (net / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            (lip, lport), (rip, rport) = _address(f[1]), _address(f[2])
            state, inode = f[3], int(f[9])
            if inode == 0:
                continue  # a TCP socket in TIME_WAIT: closed, owned by no one
            connected = rport != 0 and not rip.is_unspecified
            if connected and _outside(rip):
                what = "connected"
            elif table.startswith("tcp") and state == _TCP_LISTEN and _outside(lip):
                what = "listening"
            elif table.startswith("udp") and not connected and _outside(lip):
                what = "bound"
            else:
                continue
            out[inode] = (table, _show(lip, lport), _show(rip, rport), what)
    return out


def _owners(pids: set[int], inodes: set[int]) -> dict[int, int]:
    """Which of ``pids`` holds each of ``inodes`` (a socket's file descriptor)."""
    want = {f"socket:[{i}]": i for i in inodes}
    found: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link in want:
                found[want[link]] = pid
    return found


def _command(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return " ".join(c.decode(errors="replace") for c in cmd[:4] if c)[:200]


def breaches(root: int | None = None, ignore: set[int] | None = None) -> list[Breach]:
    """The sockets of ``root`` (default: this process) and its descendants, in this process's
    network namespace, that reach outside loopback. Sockets whose inode is in ``ignore`` are
    skipped; those found to belong to no process of the run are added to it."""
    ignore = set() if ignore is None else ignore
    suspects = {i: s for i, s in _suspects(Path("/proc/self/net")).items() if i not in ignore}
    if not suspects:
        return []
    ns = os.stat("/proc/self/ns/net").st_ino
    pids = set()
    for pid in descendants(os.getpid() if root is None else root):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino == ns:
                pids.add(pid)
        except OSError:
            continue
    owners = _owners(pids, set(suspects))
    # Another program's socket (the machine's own services) stays another's.
    ignore.update(i for i in suspects if i not in owners)
    return [Breach(pid, _command(pid), *suspects[i]) for i, pid in owners.items()]


class Watch(threading.Thread):
    """Samples :func:`breaches` of this process's tree every ``every`` seconds until
    :meth:`stop`; :meth:`seen` lists what was found, without repeats."""

    def __init__(self, every: float = 0.25, root: int | None = None) -> None:
        super().__init__(name="netguard", daemon=True)
        self.every = every
        self.root = root
        self._found: list[Breach] = []
        self._keys: set[tuple[int, str, str, str]] = set()
        self._ignore: set[int] = set()
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def sample(self) -> None:
        """Looks once, now."""
        found = breaches(self.root, ignore=self._ignore)
        with self._lock:
            for b in found:
                key = (b.pid, b.proto, b.local, b.remote)
                if key not in self._keys:
                    self._keys.add(key)
                    self._found.append(b)

    def run(self) -> None:
        while not self._halt.wait(self.every):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 (a process that ended mid-read; the next look retries)
                time.sleep(self.every)

    def seen(self) -> list[Breach]:
        """Everything found so far, in the order found."""
        with self._lock:
            return list(self._found)

    def stop(self) -> None:
        """Ends the thread."""
        self._halt.set()
        self.join(timeout=5)


def main() -> int:
    """``netguard.py --root PID``: watches PID's tree until SIGTERM or SIGINT, then lists what
    it saw and exits with 1 if anything, else 0."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--root", type=int, required=True, help="the process whose tree to watch")
    ap.add_argument("--every", type=float, default=0.25, help="seconds between looks")
    args = ap.parse_args()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    watch = Watch(args.every, root=args.root)
    watch.start()
    while not done.wait(1.0):
        pass
    watch.stop()
    watch.sample()
    seen = watch.seen()
    for b in seen:
        print(f"loopback guard: {b}", file=sys.stderr)
    return 1 if seen else 0


if __name__ == "__main__":
    sys.exit(main())
