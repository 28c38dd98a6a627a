"""Keepalive pings: how a tandem server finds out that a peer with calls open is gone although its
connection was never closed."""

from __future__ import annotations

# A server pings each peer that has calls open this often, and closes the connection when a ping
# goes unanswered as long: a client, a router or a worker that vanished without closing its
# connection (its node died, the network split, the process was stopped) otherwise holds its
# calls open until TCP gives up, about 15 minutes, and a worker generates their tokens meanwhile
# (a router that cannot write to a client holds the worker's writes back, worker/output_streams.py).
DEFAULT_KEEPALIVE_SECONDS = 15.0
# Shorter pings would cut a healthy peer's connection over a scheduling hiccup or a GC pause.
MIN_KEEPALIVE_SECONDS = 1.0
MAX_KEEPALIVE_SECONDS = 3600.0


def keepalive_options(seconds: float) -> list[tuple[str, int]]:
    """A server's options for pings every `seconds` with calls open (none for 0). Pings go on
    while the peer reads nothing (no data frame between them), which is when they matter. The
    wait for the answer is grpc.http2.ping_timeout_ms's in this gRPC (1.84; a minute by default):
    with keepalive_timeout_ms alone, a stopped client of a 1 s setting was cut after 5-15 s or
    not at all, with both after 2.1 s (tests/test_keepalive.py)."""
    check_keepalive(seconds)
    if seconds == 0:
        return []
    ms = int(seconds * 1000)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", ms),
    ]


def check_keepalive(seconds: float) -> None:
    if not (seconds == 0 or MIN_KEEPALIVE_SECONDS <= seconds <= MAX_KEEPALIVE_SECONDS):
        raise ValueError(
            f"keepalive_seconds must be 0 (no pings) or in [{MIN_KEEPALIVE_SECONDS:g}, "
            f"{MAX_KEEPALIVE_SECONDS:g}], got {seconds}"
        )
