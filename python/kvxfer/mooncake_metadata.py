"""A server of Mooncake's HTTP metadata protocol, for tests and small
deployments (Mooncake's own `mooncake_http_metadata_server` speaks the
same): one path, `/metadata?key=K`; `GET` gives the value (404 if none),
`PUT` stores the body (an `rpc_meta` key already held is refused with
400), `DELETE` removes it (404 if none).

    python -m kvxfer.mooncake_metadata --port 8080 [--host 127.0.0.1]

What it is for: engines publishing their segments and RPC addresses to
each other inside one trusted cluster. It authenticates no one: it listens
on 127.0.0.1 unless told otherwise, and an entry is replaced or deleted
only from the address that wrote it (engines on one host share theirs).

Bounded: keys up to 4 KiB, values up to 16 MiB, 65,536 keys and 256 MiB of
values in all; 64 connections at once (more are closed at once); each
request must arrive whole within 10 s of its first byte, and a connection
idle for 10 s is closed.
"""

import argparse
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

MAX_KEY = 4096
MAX_VALUE = 16 << 20
MAX_KEYS = 65536
MAX_TOTAL = 256 << 20
MAX_CONNECTIONS = 64
DEADLINE = 10.0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Each read or write on the socket (an idle keep-alive connection too).
    timeout = DEADLINE

    def log_message(self, *args):  # quiet
        pass

    def handle_one_request(self):
        # A request must be in whole within the deadline, however slowly
        # its bytes come: the reaper closes the socket past it.
        self.server.arm(self.connection, time.monotonic() + DEADLINE)
        try:
            super().handle_one_request()
        finally:
            self.server.arm(self.connection, None)

    def _reply(self, status, body=b"", ctype="text/plain"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _key(self):
        url = urlparse(self.path)
        if url.path != "/metadata":
            self._reply(404, b"not found")
            return None
        key = parse_qs(url.query).get("key", [""])[0].strip()
        if not key or len(key) > MAX_KEY:
            self._reply(400, b"metadata key is required")
            return None
        return key

    def _writer(self):
        return self.client_address[0]

    def do_GET(self):  # noqa: N802
        key = self._key()
        if key is None:
            return
        with self.server.lock:
            entry = self.server.store.get(key)
        if entry is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, entry[0], "application/json")

    def do_PUT(self):  # noqa: N802
        key = self._key()
        if key is None:
            return
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if n < 0 or n > MAX_VALUE:
            self.close_connection = True
            self._reply(413, b"value too large")
            return
        body = self.rfile.read(n)
        if len(body) != n:
            self.close_connection = True
            return
        s = self.server
        with s.lock:
            old = s.store.get(key)
            if old is not None and "rpc_meta" in key:
                self._reply(400, b"Duplicate rpc_meta key not allowed")
                return
            if old is not None and old[1] != self._writer():
                self._reply(403, b"the entry belongs to another writer")
                return
            if old is None and len(s.store) >= MAX_KEYS:
                self._reply(507, b"too many keys")
                return
            freed = len(old[0]) if old is not None else 0
            if s.total - freed + n > MAX_TOTAL:
                self._reply(507, b"metadata store full")
                return
            s.store[key] = (body, self._writer())
            s.total += n - freed
        self._reply(200, b"metadata updated")

    def do_DELETE(self):  # noqa: N802
        key = self._key()
        if key is None:
            return
        s = self.server
        with s.lock:
            old = s.store.get(key)
            if old is not None and old[1] != self._writer():
                self._reply(403, b"the entry belongs to another writer")
                return
            if old is not None:
                del s.store[key]
                s.total -= len(old[0])
        found = old is not None
        self._reply(200 if found else 404, b"metadata deleted" if found else b"metadata not found")


class MetadataServer(ThreadingHTTPServer):
    """The server; `serve_forever()` runs it, `shutdown()` stops it."""

    daemon_threads = True

    def __init__(self, host="127.0.0.1", port=8080):
        super().__init__((host, port), _Handler)
        self.store = {}  # key -> (value, writer's address)
        self.total = 0
        self.lock = threading.Lock()
        self._armed = threading.Condition(self.lock)
        self._open = 0
        self._deadlines = {}  # socket -> when its request must be in
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()

    def arm(self, sock, deadline):
        """Sets (or, with None, clears) the deadline of `sock`'s request."""
        with self.lock:
            if deadline is None:
                self._deadlines.pop(sock, None)
            else:
                self._deadlines[sock] = deadline
                self._armed.notify()

    def _reap(self):
        # Sleeps until the next deadline (or a new one), then closes the
        # sockets whose request is late: their reads return at once.
        while True:
            with self.lock:
                while True:
                    now = time.monotonic()
                    late = [s for s, d in self._deadlines.items() if d <= now]
                    if late:
                        break
                    nxt = min(self._deadlines.values(), default=None)
                    self._armed.wait(None if nxt is None else nxt - now)
                for s in late:
                    del self._deadlines[s]
            for s in late:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def process_request(self, request, client_address):
        with self.lock:
            full = self._open >= MAX_CONNECTIONS
            if not full:
                self._open += 1
        if full:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self._open -= 1
                self._deadlines.pop(request, None)

    @property
    def url(self):
        """The metadata URL engines are given."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/metadata"


def main(argv=None):
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m kvxfer.mooncake_metadata")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    a = p.parse_args(argv)
    MetadataServer(a.host, a.port).serve_forever()


if __name__ == "__main__":
    main()
