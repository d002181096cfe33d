"""The NIXL front's metadata exchange between agents: NIXL's listener
thread (`nixl_agent_config(enable_listen_thread=True, listen_port=...)`)
and the calls that reach another agent's (`send_local_metadata`,
`send_partial_agent_metadata`, `fetch_remote_metadata`,
`invalidate_local_metadata`).

One exchange is one TCP connection: a frame out, a frame back. A frame is
an operation byte, a 4-byte big-endian length and that many bytes:

    S <metadata>   load this agent's metadata (full or partial)  -> A | R <why>
    F <label>      send me your metadata                         -> A <metadata> | R <why>
    I <name>       forget agent <name>                           -> A | R <why>

The listener is bounded, as everything a peer controls: at most
`MAX_CONNS` exchanges at once (a connection beyond is closed unanswered),
frames of at most `MAX_FRAME` bytes, `DEADLINE` seconds for a whole
exchange however slowly the bytes come. Like NIXL's, it takes metadata from
whoever reaches the port; with a cluster secret a forged agent cannot
complete a connection (docs/security.md).
"""

import logging
import socket
import struct
import threading
import time

_log = logging.getLogger("kvxfer.nixl")

MAX_FRAME = 16 << 20
MAX_CONNS = 16
DEADLINE = 5.0
SEND, FETCH, INVALIDATE, ANSWER, REFUSED = b"S", b"F", b"I", b"A", b"R"
_HDR = struct.Struct("!cI")


class ExchangeError(Exception):
    """An exchange that failed: the peer refused (its reason) or could not
    be reached in time."""


def _recv_exact(sock, n, deadline):
    parts = []
    while n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("metadata exchange: deadline passed")
        sock.settimeout(left)
        b = sock.recv(min(n, 1 << 20))
        if not b:
            raise ConnectionError("metadata exchange: the peer closed the connection")
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


def read_frame(sock, deadline):
    """One frame: `(operation, payload)`; a length over `MAX_FRAME` is
    refused before anything is read of it."""
    op, n = _HDR.unpack(_recv_exact(sock, _HDR.size, deadline))
    if n > MAX_FRAME:
        raise ValueError(f"metadata exchange: a frame of {n} bytes (at most {MAX_FRAME})")
    return op, _recv_exact(sock, n, deadline)


def write_frame(sock, op, payload, deadline):
    if len(payload) > MAX_FRAME:
        raise ValueError(f"metadata exchange: a frame of {len(payload)} bytes (at most {MAX_FRAME})")
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("metadata exchange: deadline passed")
    sock.settimeout(left)
    sock.sendall(_HDR.pack(op, len(payload)) + payload)


class Listener:
    """NIXL's listener thread: answers exchanges with `handle(op, payload)
    -> payload` (an exception becomes a refusal naming it)."""

    def __init__(self, host, port, handle):
        self._handle = handle
        self._sock = socket.create_server((host, port), backlog=64)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNS)
        self._thread = threading.Thread(target=self._accept, daemon=True,
                                        name=f"kvxfer-nixl-listen-{self.port}")
        self._thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                _log.warning("metadata listener: %d exchanges at once; a connection refused", MAX_CONNS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        deadline = time.monotonic() + DEADLINE
        try:
            with conn:
                op, payload = read_frame(conn, deadline)
                try:
                    out = ANSWER, self._handle(op, payload)
                except Exception as e:  # noqa: BLE001  (the reason goes back to the peer)
                    out = REFUSED, f"{type(e).__name__}: {e}".encode()
                write_frame(conn, *out, deadline)
        except (OSError, ValueError, struct.error) as e:
            _log.debug("metadata listener: an exchange failed: %s", e)
        finally:
            self._slots.release()

    def close(self):
        """Stops listening (exchanges under way finish)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(DEADLINE)


def exchange(host, port, op, payload, timeout, retry=True):
    """Sends one frame to the listener at `host:port` and returns the
    answer's payload; a refused connection is tried again (backing off, the
    listener may not be up yet) until `timeout` seconds have passed, or,
    without `retry`, raises at once. Raises `ExchangeError` (its cause the
    `OSError`)."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            left = deadline - time.monotonic()
            with socket.create_connection((host, port), timeout=max(left, 0.001)) as s:
                # One exchange: the listener's deadline, or what is left.
                end = min(deadline, time.monotonic() + DEADLINE)
                write_frame(s, op, payload, end)
                rop, answer = read_frame(s, end)
        except (ConnectionRefusedError, ConnectionResetError, ConnectionError) as e:
            if not retry or time.monotonic() + delay >= deadline:
                raise ExchangeError(f"metadata exchange with {host}:{port}: {e}") from e
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            continue
        except (OSError, ValueError, struct.error) as e:
            raise ExchangeError(f"metadata exchange with {host}:{port}: {e}") from e
        if rop == ANSWER:
            return answer
        raise ExchangeError(f"{host}:{port} refused: {answer.decode(errors='replace')}")
