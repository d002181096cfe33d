"""A server of Mooncake's HTTP metadata protocol, for tests and small
deployments (Mooncake's own `mooncake_http_metadata_server` speaks the
same): one path, `/metadata?key=K`; `GET` gives the value (404 if none),
`PUT` stores the body (an `rpc_meta` key already held is refused with
400), `DELETE` removes it (404 if none).

    python -m kvxfer.mooncake_metadata --port 8080 [--host 0.0.0.0]

Bounded: keys up to 4 KiB, values up to 16 MiB, 65,536 keys.
"""

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

MAX_KEY = 4096
MAX_VALUE = 16 << 20
MAX_KEYS = 65536


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

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

    def do_GET(self):  # noqa: N802
        key = self._key()
        if key is None:
            return
        with self.server.lock:
            value = self.server.store.get(key)
        if value is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, value, "application/json")

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
        with self.server.lock:
            if "rpc_meta" in key and key in self.server.store:
                self._reply(400, b"Duplicate rpc_meta key not allowed")
                return
            if key not in self.server.store and len(self.server.store) >= MAX_KEYS:
                self._reply(507, b"too many keys")
                return
            self.server.store[key] = body
        self._reply(200, b"metadata updated")

    def do_DELETE(self):  # noqa: N802
        key = self._key()
        if key is None:
            return
        with self.server.lock:
            found = self.server.store.pop(key, None) is not None
        self._reply(200 if found else 404, b"metadata deleted" if found else b"metadata not found")


class MetadataServer(ThreadingHTTPServer):
    """The server; `serve_forever()` runs it, `shutdown()` stops it."""

    daemon_threads = True

    def __init__(self, host="127.0.0.1", port=8080):
        super().__init__((host, port), _Handler)
        self.store = {}
        self.lock = threading.Lock()

    @property
    def url(self):
        """The metadata URL engines are given."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/metadata"


def main(argv=None):
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m kvxfer.mooncake_metadata")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    a = p.parse_args(argv)
    MetadataServer(a.host, a.port).serve_forever()


if __name__ == "__main__":
    main()
