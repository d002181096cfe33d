"""A Mooncake-`TransferEngine`-compatible front end over kvxfer.

    from kvxfer.mooncake import TransferEngine   # instead of mooncake.engine

The calls SGLang and vLLM make, with Mooncake's argument shapes and integer
return codes (0 = success, -1 = failure): `initialize`, `get_rpc_port`,
`(batch_)register_memory`, `(batch_)unregister_memory`,
`transfer_sync_write`, `transfer_sync_read`, `batch_transfer_sync_write`
(and `batch_transfer_sync_read`). A session id is the peer's
`"host:rpc_port"`, as with Mooncake's P2P handshake.

Where kvxfer is stricter than Mooncake: a write or read must fall inside
memory the peer registered (Mooncake checks this too, on its TCP path);
every transfer has a deadline (`io_timeout`, default 30 s) instead of
waiting forever on a dead peer; `get_last_error()` gives the typed reason
of the last failure, which Mooncake's integer codes do not carry. A
cluster secret comes from `KVXFER_SECRET_FILE` / `KVXFER_SECRET` (a
non-loopback `local_hostname` requires one).
"""

import itertools
import logging
import os
import socket

from . import Agent, KvxferError, RemoteRangeNotExportedError

_log = logging.getLogger("kvxfer.mooncake")
_ids = itertools.count()

_PROTOCOLS = {"tcp": "tcp", "rdma": "rdma", "shm": "shm", "auto": "auto"}


class TransferEngine:
    """One local engine: a kvxfer agent and the sessions it opened."""

    def __init__(self, io_timeout=30.0):
        self._agent = None
        self._io_timeout = io_timeout
        self._sessions = {}
        self._registered = {}
        self._last_error = None

    # -- set-up --------------------------------------------------------

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Starts the engine on `local_hostname` (`host` or `host:port`).
        `metadata_server` must be `"P2PHANDSHAKE"` (peers exchange
        metadata directly); `protocol` is `"tcp"` or `"rdma"`
        (`device_name`: the RDMA device, empty for any). Returns 0, or -1."""
        if self._agent is not None:
            return self._fail("already initialized")
        if metadata_server != "P2PHANDSHAKE":
            return self._fail(
                f"metadata server {metadata_server!r}: only P2PHANDSHAKE is supported"
            )
        backend = _PROTOCOLS.get(str(protocol).lower())
        if backend is None:
            return self._fail(f"protocol {protocol!r}: tcp, rdma, shm or auto")
        host, _, port = str(local_hostname).partition(":")
        try:
            addr = socket.gethostbyname(host or "127.0.0.1")
        except OSError as e:
            return self._fail(f"local hostname {local_hostname!r}: {e}")
        if device_name and backend == "rdma":
            os.environ.setdefault("KVXFER_RDMA_DEVICE", str(device_name).split(",")[0])
        name = f"mooncake-{socket.gethostname()}-{os.getpid()}-{next(_ids)}"
        try:
            self._agent = Agent(
                name,
                backend=backend,
                listen=f"{addr}:{port or 0}",
                io_timeout=self._io_timeout,
            )
        except (KvxferError, ValueError) as e:
            return self._fail(e)
        return 0

    def get_rpc_port(self):
        """The port peers reach this engine on (the session id is
        `"host:port"`)."""
        if self._agent is None:
            return -1
        return int(self._agent.connection_info().rpartition(":")[2])

    def get_local_session_id(self):
        """This engine's session id, `"host:port"`."""
        return self._agent.connection_info() if self._agent else ""

    def get_last_error(self):
        """The typed reason of the last call that returned -1 (a kvxfer
        exception or a message), or None."""
        return self._last_error

    # -- memory --------------------------------------------------------

    def register_memory(self, ptr, length):
        """Registers `length` bytes at address `ptr`. Returns 0, or -1."""
        return self.batch_register_memory([ptr], [length])

    def unregister_memory(self, ptr):
        """Deregisters the region registered at `ptr`. Returns 0, or -1."""
        return self.batch_unregister_memory([ptr])

    def batch_register_memory(self, ptrs, lengths):
        """Registers each `(ptr, length)`. Returns 0, or -1 (then none is)."""
        if self._agent is None:
            return self._fail("not initialized")
        if len(ptrs) != len(lengths):
            return self._fail("ptrs and lengths differ in length")
        descs = [(int(p), int(n), 0) for p, n in zip(ptrs, lengths)]
        try:
            self._agent.register_raw(descs, "dram")
        except KvxferError as e:
            return self._fail(e)
        for p, n, _ in descs:
            self._registered[p] = n
        return 0

    def batch_unregister_memory(self, ptrs):
        """Deregisters the regions registered at each of `ptrs`. Returns 0,
        or -1."""
        if self._agent is None:
            return self._fail("not initialized")
        try:
            descs = [(int(p), self._registered[int(p)], 0) for p in ptrs]
        except KeyError as e:
            return self._fail(f"no region registered at {e.args[0]:#x}")
        try:
            self._agent.deregister_raw(descs, "dram")
        except KvxferError as e:
            return self._fail(e)
        for p, _, _ in descs:
            del self._registered[p]
        return 0

    # -- transfers -----------------------------------------------------

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length):
        """Writes `length` bytes at local `buffer` to `peer_buffer_address`
        of session `target_hostname`; returns once they landed: 0, or -1."""
        return self._sync("write", target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length):
        """Reads `length` bytes at the peer's `peer_buffer_address` into
        local `buffer`: 0, or -1."""
        return self._sync("read", target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        """Writes every `(buffer, peer address, length)` as one request: 0
        once all landed, or -1."""
        return self._sync("write", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        """Reads every `(buffer, peer address, length)` as one request."""
        return self._sync("read", target_hostname, buffers, peer_buffer_addresses, lengths)

    def _sync(self, op, session, local, remote, lengths):
        if self._agent is None:
            return self._fail("not initialized")
        if not (len(local) == len(remote) == len(lengths)):
            return self._fail("buffers, peer addresses and lengths differ in length")
        if len(lengths) == 0:
            return 0
        loc = [(int(a), int(n)) for a, n in zip(local, lengths)]
        rem = [(int(a), int(n)) for a, n in zip(remote, lengths)]
        for attempt in (0, 1):
            try:
                name = self._session(session, reload=attempt == 1)
                self._agent.transfer(op, loc, rem, name).wait(self._io_timeout)
                return 0
            except RemoteRangeNotExportedError as e:
                # The peer may have registered memory since its descriptor
                # was loaded: load it again, once.
                if attempt == 1:
                    return self._fail(e)
            except KvxferError as e:
                return self._fail(e)
        return -1

    def _session(self, session, reload=False):
        name = self._sessions.get(session)
        if name is None or reload:
            name = self._agent.connect(session)
            self._sessions[session] = name
        return name

    def _fail(self, why):
        self._last_error = why
        _log.warning("kvxfer.mooncake: %s", why)
        return -1
