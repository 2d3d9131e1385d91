"""Which local addresses listen on a TCP port, read from /proc (nothing is sent to any address)."""

from __future__ import annotations

import socket
from pathlib import Path


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on TCP ``port`` (from /proc/net/tcp and tcp6)."""
    found: set[str] = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            rows = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)  # each 32-bit word in host (little-endian) order
                found.add(socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))
    return found
