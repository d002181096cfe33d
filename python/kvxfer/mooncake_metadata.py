"""A server of Mooncake's HTTP metadata protocol, for tests and small
deployments (Mooncake's own `mooncake_http_metadata_server` speaks the
same): one path, `/metadata?key=K`; `GET` gives the value (404 if none),
`PUT` stores the body (an `rpc_meta` key already held is refused with
400), `DELETE` removes it (404 if none).

    python -m kvxfer.mooncake_metadata --port 8080 [--host 127.0.0.1]

What it is for: engines publishing their segments and RPC addresses to
each other inside one trusted cluster. It listens on 127.0.0.1 unless told
otherwise, and an entry is replaced or deleted only from the address that
wrote it (engines on one host share theirs). Given the cluster secret
(`--secret-file`, else `KVXFER_SECRET_FILE` / `KVXFER_SECRET`), it takes a
`PUT` or `DELETE` only from a writer that holds it too: the request carries
`X-Kvxfer-Auth: t=<unix seconds>;m=<hex HMAC-SHA256>` over the method, key,
time and the body's SHA-256, within 60 s of the server's clock and never
twice (kvxfer's Mooncake front sends it; Mooncake's own clients do not, so
they can only read then). Reads stay open: entries are addresses, not
secrets.

Bounded: keys up to 4 KiB, values up to 16 MiB, 65,536 keys and 256 MiB of
values in all; 64 connections at once (more are closed at once); each
request must arrive whole within 10 s of its first byte, and a connection
idle for 10 s is closed.
"""

import argparse
import hashlib
import hmac
import os
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
# How far a writer's clock may be from the server's; proofs seen within it
# are remembered (at most MAX_SEEN) so that none is taken twice.
AUTH_WINDOW = 60.0
MAX_SEEN = 65536
AUTH_HEADER = "X-Kvxfer-Auth"


def auth_mac(secret, method, key, stamp, body):
    """The MAC a writer sends for `method` on `key` with `body` at `stamp`."""
    msg = b"\n".join(
        [b"kvxfer-metadata-v1", method.encode(), key.encode(), str(stamp).encode(),
         hashlib.sha256(body or b"").hexdigest().encode()]
    )
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def auth_header(secret, method, key, body, now=None):
    """The `X-Kvxfer-Auth` value for a write (`now`: unix seconds)."""
    stamp = int(time.time() if now is None else now)
    return f"t={stamp};m={auth_mac(secret, method, key, stamp, body)}"


def secret_from_env():
    """The cluster secret as kvxfer's agents read it, or None."""
    path = os.environ.get("KVXFER_SECRET_FILE")
    if path:
        with open(path, "rb") as f:
            return f.read().rstrip()
    value = os.environ.get("KVXFER_SECRET")
    return value.encode() if value else None


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

    def _authentic(self, method, key, body):
        """Whether the write is proved by the cluster secret (always, when
        the server holds none); answers 401 when not."""
        secret = self.server.secret
        if secret is None:
            return True
        fields = dict(
            f.split("=", 1) for f in self.headers.get(AUTH_HEADER, "").split(";") if "=" in f
        )
        try:
            stamp = int(fields.get("t", ""))
        except ValueError:
            stamp = None
        mac = fields.get("m", "")
        ok = (
            stamp is not None
            and abs(time.time() - stamp) <= AUTH_WINDOW
            and hmac.compare_digest(mac, auth_mac(secret, method, key, stamp, body))
            and self.server.first_sight(mac)
        )
        if not ok:
            self.close_connection = True
            self._reply(401, b"a write needs the cluster secret's proof (X-Kvxfer-Auth)")
        return ok

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
        if not self._authentic("PUT", key, body):
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
        if not self._authentic("DELETE", key, b""):
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

    def __init__(self, host="127.0.0.1", port=8080, secret=None):
        super().__init__((host, port), _Handler)
        # bytes: writes need its proof (see the module docs).
        self.secret = secret
        self._seen = {}  # MAC -> when it may be forgotten
        self.store = {}  # key -> (value, writer's address)
        self.total = 0
        self.lock = threading.Lock()
        self._armed = threading.Condition(self.lock)
        # Told when a connection's thread has ended (see `wait_idle`).
        self._ended = threading.Condition(self.lock)
        self._open = 0
        self._deadlines = {}  # socket -> when its request must be in
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()

    def first_sight(self, mac):
        """Whether a write's proof is new (then remembered for the window);
        false for a replay, and when too many are remembered."""
        now = time.monotonic()
        with self.lock:
            if len(self._seen) >= MAX_SEEN:
                self._seen = {m: t for m, t in self._seen.items() if t > now}
            if mac in self._seen or len(self._seen) >= MAX_SEEN:
                return False
            self._seen[mac] = now + 2 * AUTH_WINDOW
            return True

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
                self._ended.notify_all()

    def wait_idle(self, timeout):
        """Whether every connection's thread has ended (its place free for
        a new one) within `timeout` seconds. A client sees its connection
        closed a moment before its thread lets the place go."""
        with self.lock:
            return self._ended.wait_for(lambda: self._open == 0, timeout)

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
    p.add_argument(
        "--secret-file",
        help="the cluster secret: writes need its proof (default: KVXFER_SECRET_FILE, KVXFER_SECRET)",
    )
    a = p.parse_args(argv)
    if a.secret_file:
        with open(a.secret_file, "rb") as f:
            secret = f.read().rstrip()
    else:
        secret = secret_from_env()
    MetadataServer(a.host, a.port, secret).serve_forever()


if __name__ == "__main__":
    main()
