"""The loopback guard (:mod:`netguard`) sees what it must and nothing else. It is tried inside a
network namespace made for the test, so the deliberately wrong sockets it must catch (a TCP
listener and a UDP socket on every interface, a listener on a non-loopback address and a
connection to it) are on no interface of the machine's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ANY = "0.0.0.0"  # every interface, as the guard reports it: of the test's namespace only

# Run inside the namespace: sockets of every kind, held by children of this script, then the
# guard's findings as JSON lines.
INSIDE = textwrap.dedent(
    """
    import json, socket, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    import netguard

    hold = '''
    import socket, sys, time
    kind, host = sys.argv[1], sys.argv[2]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if kind == "udp" else socket.SOCK_STREAM)
    s.bind((host, 0))
    if kind == "tcp":
        s.listen()
    if kind == "dial":
        s = socket.create_connection((host, int(sys.argv[3])))
    print(s.getsockname()[1], flush=True)
    time.sleep(60)
    '''

    def start(*args):
        p = subprocess.Popen([sys.executable, "-c", hold, *args], stdout=subprocess.PIPE, text=True)
        return p, int(p.stdout.readline())

    children = []  # every address below is in the test's own namespace
    for args in [("tcp", "0.0.0.0"), ("udp", "0.0.0.0"), ("tcp", "127.0.0.1"),  # namespace
                 ("udp", "127.0.0.1"), ("tcp", "10.77.0.1")]:
        children.append(start(*args))
    # A client of the 10.77.0.1 listener: a connection to a non-loopback peer.
    children.append(start("dial", "10.77.0.1", str(children[-1][1])))
    # The guard's own look, from this process down.
    for b in netguard.breaches():
        print(json.dumps([b.pid, b.proto, b.local, b.remote, b.what]), flush=True)
    for p, _ in children:
        p.kill()
    """
)


def ip(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True).returncode == 0


@pytest.fixture
def namespace() -> Iterator[str]:
    """A network namespace of the test's own, with loopback up and a veth pair inside it, one
    end at 10.77.0.1 (reachable from inside only); removed afterwards, with the pair."""
    ns = f"sy-guard-{os.getpid()}"
    if not ip("netns", "add", ns):
        pytest.skip("cannot make a network namespace here (needs root)")
    try:
        for args in [
            ("-n", ns, "link", "set", "lo", "up"),
            ("-n", ns, "link", "add", "sy-ga", "type", "veth", "peer", "name", "sy-gb"),
            ("-n", ns, "addr", "add", "10.77.0.1/24", "dev", "sy-ga"),
            ("-n", ns, "link", "set", "sy-ga", "up"),
            ("-n", ns, "link", "set", "sy-gb", "up"),
        ]:
            if not ip(*args):
                pytest.skip(f"`ip {' '.join(args)}` failed here")
        yield ns
    finally:
        ip("netns", "del", ns)


def test_the_guard_reports_listeners_and_connections_outside_loopback(namespace: str) -> None:
    here = str(Path(__file__).parent)
    cmd = ["ip", "netns", "exec", namespace, sys.executable, "-c", INSIDE, here]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = [json.loads(line) for line in out.stdout.splitlines()]
    seen = sorted((proto, what, local.rsplit(":", 1)[0]) for _, proto, local, _, what in found)
    # The wildcard listener and socket, the 10.77.0.1 listener and the client connected to it
    # (the other end, never accepted, is no process's); never a socket on loopback.
    assert seen == [  # in the test's namespace
        ("tcp", "connected", "10.77.0.1"),
        ("tcp", "listening", ANY),
        ("tcp", "listening", "10.77.0.1"),
        ("udp", "bound", ANY),
    ], found
