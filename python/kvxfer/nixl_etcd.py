"""NIXL's etcd metadata exchange (`NIXL_ETCD_ENDPOINTS`), for the NIXL front.

With `NIXL_ETCD_ENDPOINTS` set, NIXL's metadata calls without a peer
address go through etcd, with NIXL's keys: an agent's entries lie under
`<NIXL_ETCD_NAMESPACE>/<agent>/` (namespace `/nixl/agents/` by default,
joined with a `/` as NIXL joins it), its metadata at `.../metadata` and
partial metadata at `.../<label>`. As in NIXL, the calls return at once and
a worker thread carries them out in order: sending stores the blob;
fetching reads it, or watches for it until the watch timeout, loads it
and then watches the agent's entries, forgetting the agent when they are
deleted; invalidating deletes this agent's entries. Failures are logged
(NIXL's worker logs them too); an application sees a fetched agent with
`check_remote_metadata`.

etcd is spoken to through its v3 JSON gateway over HTTP (`/v3/kv/*`,
`/v3/watch`), as kvxfer's own agent does: no client library. Every call has
a deadline; a watch waits on etcd's stream, not by polling.
"""

import base64
import http.client
import json
import logging
import os
import queue
import threading
import time
import urllib.parse

_log = logging.getLogger("kvxfer.nixl")

DEFAULT_NAMESPACE = "/nixl/agents/"
# NIXL's default label for an agent's full metadata.
METADATA_LABEL = "metadata"
# Each request's deadline (a watch's is the fetch's watch timeout).
_CALL_TIMEOUT = 10.0
# Most bytes of one watch-stream line (an event carries one blob).
_LINE_MAX = 64 << 20


class EtcdError(Exception):
    """An etcd call failed (unreachable, refused, malformed answer)."""


def configured():
    """Whether NIXL's etcd exchange is asked for (`NIXL_ETCD_ENDPOINTS`)."""
    return bool(os.environ.get("NIXL_ETCD_ENDPOINTS", "").strip())


def _b64(b):
    return base64.b64encode(b).decode()


def _prefix_end(key):
    """The end of the range of every key that starts with `key`."""
    b = bytearray(key)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"
    b[-1] += 1
    return bytes(b)


class Client:
    """etcd's v3 JSON gateway at the first of `endpoints` that answers."""

    def __init__(self, endpoints):
        self.endpoints = []
        for e in endpoints.split(","):
            e = e.strip()
            if not e:
                continue
            u = urllib.parse.urlsplit(e if "://" in e else "http://" + e)
            if u.scheme != "http" or not u.hostname:
                raise EtcdError(f"etcd endpoint {e!r}: only http://host:port is supported")
            self.endpoints.append((u.hostname, u.port or 2379))
        if not self.endpoints:
            raise EtcdError("NIXL_ETCD_ENDPOINTS names no endpoint")

    def _open(self, path, body, timeout):
        """The response to `body` posted to `path`, from the first endpoint
        that answers."""
        errors = []
        for host, port in self.endpoints:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
            except OSError as e:
                conn.close()
                errors.append(f"{host}:{port}: {e}")
                continue
            if resp.status != 200:
                text = resp.read(4096).decode(errors="replace")
                conn.close()
                raise EtcdError(f"etcd {path} at {host}:{port}: HTTP {resp.status}: {text}")
            return conn, resp
        raise EtcdError("etcd unreachable: " + "; ".join(errors))

    def _call(self, path, body):
        conn, resp = self._open(path, body, _CALL_TIMEOUT)
        try:
            return json.loads(resp.read(_LINE_MAX))
        except ValueError as e:
            raise EtcdError(f"etcd {path}: malformed answer: {e}") from e
        finally:
            conn.close()

    def put(self, key, value):
        self._call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})

    def get(self, key):
        """`(value or None, the store's revision)`."""
        r = self._call("/v3/kv/range", {"key": _b64(key)})
        rev = int(r.get("header", {}).get("revision", 0))
        kvs = r.get("kvs") or []
        return (base64.b64decode(kvs[0].get("value", "")) if kvs else None), rev

    def delete_prefix(self, prefix):
        self._call("/v3/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})

    def watch(self, key, start_revision, timeout, prefix=False, opened=None):
        """The events on `key` (every key under it when `prefix`) from
        `start_revision`, as `(kind, value)` with kind "PUT" or "DELETE",
        until `timeout` seconds pass with none (None: until the stream
        ends), or the caller stops iterating. `opened(conn)` is told the
        stream's connection, which closing ends the watch."""
        req = {"key": _b64(key), "start_revision": str(start_revision)}
        if prefix:
            req["range_end"] = _b64(_prefix_end(key))
        conn, resp = self._open("/v3/watch", {"create_request": req}, timeout or _CALL_TIMEOUT)
        if timeout is None and conn.sock is not None:
            conn.sock.settimeout(None)
        if opened is not None:
            opened(conn)
        try:
            while True:
                try:
                    line = resp.readline(_LINE_MAX)
                except TimeoutError:
                    return
                except OSError as e:
                    raise EtcdError(f"etcd watch: {e}") from e
                if not line:
                    return
                try:
                    result = json.loads(line).get("result", {})
                except ValueError as e:
                    raise EtcdError(f"etcd watch: malformed event: {e}") from e
                for ev in result.get("events") or []:
                    kv = ev.get("kv", {})
                    yield ev.get("type", "PUT"), base64.b64decode(kv.get("value", ""))
        finally:
            conn.close()


class Exchange:
    """One NIXL agent's etcd exchange: its calls carried out in order by a
    worker thread; loaded agents watched for their deletion.

    `load(blob)` loads metadata and returns the agent's name; `forget(name)`
    forgets an agent. Drop order: `close` stops the worker (after what was
    queued) and the watchers."""

    def __init__(self, name, load, forget, watch_timeout):
        self.name = name
        self.client = Client(os.environ["NIXL_ETCD_ENDPOINTS"])
        self.namespace = os.environ.get("NIXL_ETCD_NAMESPACE", DEFAULT_NAMESPACE)
        self.watch_timeout = watch_timeout
        self._load, self._forget = load, forget
        self._jobs = queue.Queue()
        self._closed = threading.Event()
        self._watched = set()
        # The watchers' streams, shut down at close.
        self._streams = []
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name=f"kvxfer-nixl-etcd-{name}", daemon=True)
        self._worker.start()

    def key(self, agent, label):
        """NIXL's key of `agent`'s entry `label` (its prefix for "")."""
        return f"{self.namespace}/{agent}/{label}".encode()

    # -- what the agent's calls queue ------------------------------------

    def send(self, blob, label=METADATA_LABEL):
        self._jobs.put((self._send, (bytes(blob), label or METADATA_LABEL)))

    def fetch(self, agent, label=METADATA_LABEL):
        self._jobs.put((self._fetch, (agent, label or METADATA_LABEL)))

    def invalidate(self):
        self._jobs.put((self._invalidate, ()))

    def close(self):
        """Carries out what was queued, then stops (bounded by the calls'
        deadlines)."""
        self._jobs.put(None)
        self._worker.join(timeout=_CALL_TIMEOUT + self.watch_timeout)
        self._closed.set()
        with self._lock:
            streams, self._streams = self._streams, []
        for conn in streams:
            try:
                if conn.sock is not None:
                    conn.sock.shutdown(2)  # socket.SHUT_RDWR
            except OSError:
                pass

    # -- the worker --------------------------------------------------------

    def _run(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            # etcd's failures and a load that fails alike: logged, as NIXL
            # does.
            except Exception as e:
                _log.error("NIXL etcd exchange (%s): %s", fn.__name__.lstrip("_"), e)

    def _send(self, blob, label):
        # NIXL stores the agent's prefix key first: its deletion is what
        # watchers of the agent see.
        self.client.put(self.key(self.name, ""), b"")
        self.client.put(self.key(self.name, label), blob)

    def _invalidate(self):
        self.client.delete_prefix(self.key(self.name, ""))

    def _fetch(self, agent, label):
        key = self.key(agent, label)
        blob, rev = self.client.get(key)
        if not blob:
            deadline = time.monotonic() + self.watch_timeout
            for kind, value in self.client.watch(key, rev + 1, self.watch_timeout):
                if kind == "DELETE":
                    raise EtcdError(f"metadata of {agent!r} deleted while waiting for it")
                if value:
                    blob = value
                    break
                if time.monotonic() >= deadline:
                    break
            if not blob:
                raise EtcdError(f"no metadata of {agent!r} at {key.decode()} within {self.watch_timeout} s")
        loaded = self._load(blob)
        if loaded != agent:
            self._forget(loaded)
            raise EtcdError(f"{key.decode()} holds agent {loaded!r}'s metadata, not {agent!r}'s")
        self._watch(agent)

    def _watch(self, agent):
        """Forgets `agent` when its entries are deleted (once watched)."""
        with self._lock:
            if agent in self._watched:
                return
            self._watched.add(agent)
        _, rev = self.client.get(self.key(agent, ""))

        def opened(conn):
            with self._lock:
                self._streams.append(conn)
            if self._closed.is_set():
                conn.sock.shutdown(2)

        def run():
            try:
                for kind, _ in self.client.watch(self.key(agent, ""), rev + 1, None, True, opened):
                    if kind == "DELETE":
                        _log.debug("NIXL etcd: %s left; forgetting it", agent)
                        self._forget(agent)
                        return
            except (EtcdError, OSError) as e:
                if not self._closed.is_set():
                    _log.warning("NIXL etcd: watching %s ended: %s", agent, e)
            finally:
                with self._lock:
                    self._watched.discard(agent)

        threading.Thread(target=run, name=f"kvxfer-nixl-etcd-watch-{agent}", daemon=True).start()
