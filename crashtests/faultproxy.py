"""A TCP proxy on loopback that cuts its connections on demand: the network failing
mid-request, between a client and a server that both stay up.

    proxy = FaultProxy("127.0.0.1", server_port)      # listens on proxy.port
    ...  clients connect to 127.0.0.1:proxy.port  ...
    proxy.cut()             # every open connection reset (RST) now, both ways

A cut closes each connection with ``SO_LINGER`` 0, so the peer sees a reset, not a
clean end: a request being sent or an answer being read fails half-way, as when a
link or a NAT drops the flow. New connections are accepted at once; ``cut_for``
also refuses them (resets each on arrival) for a while, as a link down for seconds.
``FaultProxy(host, port, rate=bytes_per_second)`` also throttles it: a token bucket
per direction shared by every connection, as one host's link to an object store.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

_LINGER_RESET = struct.pack("ii", 1, 0)


def _reset(s: socket.socket, close: bool = True) -> None:
    """Make ``s`` end with a reset, and wake any thread blocked on it (closing alone would
    not: a recv in progress keeps the socket alive, and the peer would wait for ever)."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    if close:
        try:
            s.close()
        except OSError:
            pass


class TokenBucket:
    """At most ``rate`` bytes per second on average, bursts of up to ``burst`` bytes."""

    def __init__(self, rate: float, burst: float | None = None):
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 20, 1 << 16))
        self._tokens, self._at = self.burst, time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Wait until ``n`` bytes may pass (taken from the bucket, which may go negative:
        the next taker waits for it to refill)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to ``host``:``target_port``; see the module."""

    def __init__(self, host: str, target_port: int, rate: float | None = None):
        self.target = (host, target_port)
        # (client -> server, server -> client): each direction of the link its own rate
        self._buckets = (TokenBucket(rate), TokenBucket(rate)) if rate else (None, None)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._ended: dict = {}     # pair -> directions that ended
        self._down_until = 0.0
        self._closed = False
        self.cuts = 0              # cut() calls
        self.reset = 0             # connections reset by them
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if time.monotonic() < self._down_until:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            pair = (client, server)
            with self._lock:
                self._pairs.add(pair)
            threading.Thread(target=self._pipe, args=(client, server, pair, self._buckets[0]), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, pair, self._buckets[1]), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, pair, bucket: TokenBucket | None = None) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if bucket is not None:
                    bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)     # pass a clean end on as a clean end
        except OSError:
            pass
        with self._lock:
            self._ended[pair] = self._ended.get(pair, 0) + 1
            done = self._ended[pair] == 2
            if done:
                del self._ended[pair]
            self._pairs.discard(pair)      # half-closed: nothing left for a cut to break
        if done:
            for s in pair:
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> int:
        """Reset every open connection; returns how many."""
        with self._lock:
            pairs, self._pairs = self._pairs, set()
            self.cuts += 1
            self.reset += len(pairs)
        for client, server in pairs:     # their threads close them, once both have woken
            _reset(client, close=False)
            _reset(server, close=False)
        return len(pairs)

    def cut_for(self, seconds: float) -> int:
        """Reset every open connection and every new one for ``seconds``."""
        self._down_until = time.monotonic() + seconds
        return self.cut()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        self.cut()
