"""Mooncake's `TransferEngine` (`mooncake.engine`) over kvxfer.

    from kvxfer.mooncake import TransferEngine   # or, with the shim, mooncake.engine

Mooncake's calls, argument shapes and integer return codes (0 success;
Mooncake's negative codes for failures: -1 invalid argument or failed
transfer, -3 address not registered, -7 overlap, -101 unknown host, -102
unreachable, -200 metadata): `initialize` with a metadata server of
`"P2PHANDSHAKE"` (the session id is `"host:rpc_port"`), an etcd cluster
(`"etcd://host:port"` or a bare `"host:port"`; kvxfer's etcd membership)
or Mooncake's HTTP metadata protocol (`"http://host:port/metadata"`;
`kvxfer.mooncake_metadata` serves it); registration and managed buffers;
sync, async and batch writes and reads with their status calls;
`send_probe`; `get_first_buffer_address`; byte access to local buffers.

Protocol `"efa"` runs on kvxfer's libfabric transport (provider `efa`, on
the RDM domain of each device named: several devices are several rails,
every transfer spread over them). Protocols `"rdma"` and `"efa"` where
the host has no such device fall back to TCP with a warning, as Mooncake
does (`get_transport()` says which path is used);
`TransferEngine(require_protocol=True)` or `KVXFER_REQUIRE_PROTOCOL=1`
refuses instead.

Where kvxfer is stricter than Mooncake: both sides of a transfer must lie
in memory registered with the engines (Mooncake's TCP path does not check
the local side); `write_bytes_to_buffer` / `read_bytes_from_buffer` only
touch memory registered with this engine (never a wild address); every
transfer has a deadline (`io_timeout`, default 30 s); `get_last_error()`
gives the typed reason of the last failure. A cluster secret comes from
`KVXFER_SECRET_FILE` / `KVXFER_SECRET` (a non-loopback `local_hostname`
requires one).

Out of scope: Mooncake Store (`mooncake.store`, its master and the
HiCache/LMCache store backends built on it), Mooncake EP
(`mooncake.ep`), its process group and its own vLLM connector; under the
shim, importing them raises an `ImportError` that says so. SGLang's
`KVBootstrapServer` is SGLang's and runs unchanged over this engine.
`get_engine()` / `get_engine_ptr()` hand out Mooncake's C++ engine, which
only those components take: here they raise `MooncakeUnsupportedError`
(the kvxfer agent underneath is `kvxfer_agent`).
"""

import bisect
import ctypes
import enum
import itertools
import json
import logging
import mmap
import os
import socket
import urllib.error
import urllib.parse
import urllib.request

from . import Agent, KvxferError, RemoteRangeNotExportedError, mooncake_metadata

_log = logging.getLogger("kvxfer.mooncake")


class MooncakeUnsupportedError(KvxferError, NotImplementedError):
    """A part of Mooncake that kvxfer's stand-in does not offer."""

_ids = itertools.count(1)

# Mooncake's error codes (its `error.h`).
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_DNS = -101
ERR_SOCKET = -102
ERR_METADATA = -200

_PROTOCOLS = {"tcp": "tcp", "rdma": "rdma", "shm": "shm", "auto": "auto", "efa": "efa"}


def _efa(device):
    """The libfabric settings of protocol `"efa"`: provider `efa` (or
    `KVXFER_FABRIC_PROVIDER`, to stand another provider in), on the RDM
    domain of each device named (`rdmap16s27` -> `rdmap16s27-rdm`; several,
    comma-separated as Mooncake takes them: one rail each, every transfer
    spread over them), else libfabric's choice."""
    provider = os.environ.get("KVXFER_FABRIC_PROVIDER", "efa")
    devs = [d.strip() for d in device.split(",") if d.strip()]
    domain = ",".join(f"{d}-rdm" for d in devs) if devs and provider == "efa" else None
    return {"fabric_provider": provider, "fabric_domain": domain}

_CODES = {
    "NotRegisteredError": ERR_ADDRESS_NOT_REGISTERED,
    "OverlapError": ERR_ADDRESS_OVERLAPPED,
    "RegionBusyError": ERR_ADDRESS_OVERLAPPED,
    "MetadataStoreError": ERR_METADATA,
}


class TransferOpcode(enum.Enum):
    """A transfer's direction."""

    Read = 0
    Write = 1


class TransferNotify:
    """Mooncake's notification argument (not offered by kvxfer's front:
    a transfer given one fails with -1)."""

    def __init__(self, name="", msg=""):
        self.name = name
        self.msg = msg


class _Metadata:
    """Where segment names are published and looked up."""

    def __init__(self, server):
        self.server = server
        self.http = server.startswith(("http://", "https://"))
        self.etcd = None
        if not self.http and server != "P2PHANDSHAKE":
            self.etcd = server[len("etcd://"):] if server.startswith("etcd://") else server

    def _url(self, key):
        sep = "&" if "?" in self.server else "?"
        return f"{self.server}{sep}key={urllib.parse.quote(key, safe='')}"

    def _call(self, method, key, body=None, timeout=5.0):
        req = urllib.request.Request(self._url(key), data=body, method=method)
        secret = mooncake_metadata.secret_from_env()
        if secret is not None and method in ("PUT", "DELETE"):
            # Writes prove the cluster secret to a server that holds it.
            req.add_header(
                mooncake_metadata.AUTH_HEADER,
                mooncake_metadata.auth_header(secret, method, key, body),
            )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def publish(self, name, connection_info, host, port):
        """Publishes this engine's segment (HTTP only; etcd is kvxfer's)."""
        if not self.http:
            return
        body = {"ip_or_host_name": host, "rpc_port": port, "kvxfer": connection_info}
        self._call("PUT", f"mooncake/rpc_meta/{name}", json.dumps(body).encode())

    def withdraw(self, name):
        """Removes what `publish` put (HTTP only)."""
        if self.http:
            try:
                self._call("DELETE", f"mooncake/rpc_meta/{name}")
            except (OSError, urllib.error.URLError):
                pass

    def lookup(self, name):
        """The connection info of segment `name` (HTTP), or raises."""
        body = json.loads(self._call("GET", f"mooncake/rpc_meta/{name}"))
        return body.get("kvxfer") or f"{body['ip_or_host_name']}:{body['rpc_port']}"


class TransferEngine:
    """One local engine: a kvxfer agent and the sessions it opened."""

    TransferOpcode = TransferOpcode

    def __init__(self, io_timeout=30.0, require_protocol=None):
        self._agent = None
        self._io_timeout = io_timeout
        self._require = (
            os.environ.get("KVXFER_REQUIRE_PROTOCOL") == "1"
            if require_protocol is None else bool(require_protocol)
        )
        self._sessions = {}
        self._registered = {}  # address -> length, in registration order
        self._starts = []  # sorted addresses of registered regions
        self._managed = {}
        self._pending = {}
        self._last_error = None
        self._meta = None
        self._name = ""
        self._transport = ""

    # -- set-up --------------------------------------------------------

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Starts the engine on `local_hostname` (`host` or `host:port`,
        the segment name). Returns 0, or a negative code. A second call
        leaves the running engine as it is and returns 0."""
        if self._agent is not None:
            _log.warning("kvxfer.mooncake: initialize called again; the engine keeps running")
            return 0
        backend = _PROTOCOLS.get(str(protocol).lower())
        if backend is None:
            return self._fail(f"protocol {protocol!r}: tcp, rdma, efa, shm or auto")
        host, _, port = str(local_hostname).partition(":")
        try:
            addr = socket.gethostbyname(host or "127.0.0.1")
        except OSError as e:
            return self._fail(f"local hostname {local_hostname!r}: {e}", ERR_DNS)
        if device_name and backend == "rdma":
            os.environ.setdefault("KVXFER_RDMA_DEVICE", str(device_name).split(",")[0])
        meta = _Metadata(str(metadata_server))
        p2p = metadata_server == "P2PHANDSHAKE"
        name = f"mooncake-{socket.gethostname()}-{os.getpid()}-{next(_ids)}" if p2p else str(
            local_hostname
        )
        kw = {"listen": f"{addr}:{port or 0}", "io_timeout": self._io_timeout}
        if meta.etcd:
            kw["etcd"] = meta.etcd
            kw["etcd_prefix"] = "/kvxfer/mooncake"
        try:
            agent = self._start(name, backend, kw, str(device_name or ""))
        except (KvxferError, ValueError) as e:
            return self._fail(e, _CODES.get(type(e).__name__, ERR_INVALID_ARGUMENT))
        if meta.http:
            try:
                info = agent.connection_info()
                meta.publish(name, info, addr, int(info.rpartition(":")[2]))
            except (OSError, urllib.error.URLError, ValueError) as e:
                return self._fail(f"metadata server {metadata_server!r}: {e}", ERR_METADATA)
        self._agent, self._meta, self._name = agent, meta, name
        return 0

    def _start(self, name, backend, kw, device=""):
        try:
            if backend == "efa":
                agent = Agent(name, backend="fabric", **kw, **_efa(device))
            else:
                agent = Agent(name, backend=backend, **kw)
        except (KvxferError, ValueError) as e:
            if backend not in ("rdma", "efa") or self._require:
                raise
            _log.warning(
                "kvxfer.mooncake: protocol %r is not available here (%s); "
                "falling back to tcp (KVXFER_REQUIRE_PROTOCOL=1 refuses instead)", backend, e
            )
            agent = Agent(name, backend="tcp", **kw)
            backend = "tcp"
        self._transport = backend
        return agent

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type=""):
        """`initialize`; the metadata type is read from the server string."""
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_rpc_port(self):
        """The port peers reach this engine on."""
        if self._agent is None:
            return -1
        return int(self._agent.connection_info().rpartition(":")[2])

    def get_local_session_id(self):
        """This engine's session id: `"host:port"` (P2P) or its segment name."""
        if self._agent is None:
            return ""
        return self._agent.connection_info() if self._p2p() else self._name

    def get_transport(self):
        """The path transfers take: `tcp`, `rdma`, `shm` or `auto`."""
        return self._transport

    def get_last_error(self):
        """The typed reason of the last call that failed (a kvxfer
        exception or a message), or None."""
        return self._last_error

    def get_engine(self):
        """Mooncake's C++ engine, which Mooncake Store and Mooncake EP take:
        kvxfer has none, so this raises `MooncakeUnsupportedError` (those
        components are out of scope; every transfer goes through this
        object's own methods, and the kvxfer agent is `kvxfer_agent`)."""
        raise MooncakeUnsupportedError(
            "get_engine(): the C++ engine handle Mooncake Store and Mooncake EP take; kvxfer's "
            "stand-in has none (they are out of scope): use this TransferEngine's methods"
        )

    def get_engine_ptr(self):
        """As `get_engine`: raises `MooncakeUnsupportedError`."""
        raise MooncakeUnsupportedError(
            "get_engine_ptr(): the C++ engine's address; kvxfer's stand-in has none"
        )

    @property
    def kvxfer_agent(self):
        """The kvxfer agent underneath (None once closed)."""
        return self._agent

    def close(self):
        """Withdraws the segment from the metadata server and stops."""
        if self._meta is not None:
            self._meta.withdraw(self._name)
            self._meta = None
        for addr in list(self._managed):
            self.free_managed_buffer(addr, self._managed[addr][1])
        self._agent = None

    def __del__(self):
        try:
            if self._meta is not None:
                self._meta.withdraw(self._name)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def _p2p(self):
        return self._meta is None or (not self._meta.http and not self._meta.etcd)

    # -- memory --------------------------------------------------------

    def register_memory(self, ptr, length, location="*"):
        """Registers `length` bytes at address `ptr`. Returns 0 or a code."""
        return self.batch_register_memory([ptr], [length])

    def unregister_memory(self, ptr):
        """Deregisters the region registered at `ptr`. Returns 0 or a code."""
        return self.batch_unregister_memory([ptr])

    def batch_register_memory(self, ptrs, lengths, location="*"):
        """Registers each `(ptr, length)`. Returns 0 or a code (then none
        is)."""
        if self._agent is None:
            return self._fail("not initialized")
        if len(ptrs) != len(lengths):
            return self._fail("ptrs and lengths differ in length")
        descs = [(int(p), int(n), 0) for p, n in zip(ptrs, lengths)]
        if not descs:
            return 0
        try:
            self._agent.register_raw(descs, "dram")
        except KvxferError as e:
            return self._fail(e, _CODES.get(type(e).__name__, ERR_INVALID_ARGUMENT))
        for p, n, _ in descs:
            self._registered[p] = n
            bisect.insort(self._starts, p)
        return 0

    def batch_unregister_memory(self, ptrs):
        """Deregisters the regions registered at each of `ptrs`. Returns 0
        or a code."""
        if self._agent is None:
            return self._fail("not initialized")
        try:
            descs = [(int(p), self._registered[int(p)], 0) for p in ptrs]
        except KeyError as e:
            return self._fail(f"no region registered at {e.args[0]:#x}", ERR_ADDRESS_NOT_REGISTERED)
        if not descs:
            return 0
        try:
            self._agent.deregister_raw(descs, "dram")
        except KvxferError as e:
            return self._fail(e, _CODES.get(type(e).__name__, ERR_INVALID_ARGUMENT))
        for p, _, _ in descs:
            del self._registered[p]
            self._starts.remove(p)
        return 0

    def allocate_managed_buffer(self, length):
        """A registered, zeroed buffer of `length` bytes owned by the
        engine: its address, or 0."""
        if self._agent is None or int(length) <= 0:
            self._fail("not initialized" if self._agent is None else "length must be positive")
            return 0
        m = mmap.mmap(-1, int(length))
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if self.register_memory(addr, int(length)) != 0:
            m.close()
            return 0
        self._managed[addr] = (m, int(length))
        return addr

    def free_managed_buffer(self, addr, length):
        """Deregisters and frees a buffer `allocate_managed_buffer` gave.
        Returns 0 or a code."""
        entry = self._managed.get(int(addr))
        if entry is None:
            return self._fail(f"no managed buffer at {int(addr):#x}", ERR_ADDRESS_NOT_REGISTERED)
        rc = self.unregister_memory(int(addr))
        if rc != 0:
            return rc
        del self._managed[int(addr)]
        # The ctypes view pins the map; collected with it.
        try:
            entry[0].close()
        except BufferError:
            pass
        return 0

    def _inside(self, addr, length):
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return False
        start = self._starts[i]
        return addr + length <= start + self._registered[start]

    def write_bytes_to_buffer(self, dest_address, src, length):
        """Copies `length` bytes of `src` to local registered memory at
        `dest_address`. Returns 0 or a code."""
        data = bytes(src)[: int(length)]
        if len(data) < int(length):
            return self._fail("src is shorter than length")
        if not self._inside(int(dest_address), len(data)):
            return self._fail(f"{int(dest_address):#x}+{len(data)} is not in a registered buffer",
                              ERR_ADDRESS_NOT_REGISTERED)
        ctypes.memmove(int(dest_address), data, len(data))
        return 0

    def read_bytes_from_buffer(self, source_address, length):
        """`length` bytes of local registered memory at `source_address`
        (`b""` if it is not registered)."""
        if not self._inside(int(source_address), int(length)):
            self._fail(f"{int(source_address):#x}+{int(length)} is not in a registered buffer",
                       ERR_ADDRESS_NOT_REGISTERED)
            return b""
        return ctypes.string_at(int(source_address), int(length))

    def get_first_buffer_address(self, segment_name):
        """The address of the first buffer registered in a segment (this
        engine's, or a peer's), or 0 if it has none or cannot be reached."""
        if self._agent is None:
            return 0
        if segment_name in (self._name, self.get_local_session_id()):
            return next(iter(self._registered), 0)
        try:
            name = self._session(segment_name, reload=True)
            regions = [r for r in self._agent.remote_regions(name) if r[3] == "dram"]
        except (KvxferError, OSError, ValueError, KeyError, urllib.error.URLError) as e:
            self._fail(e)
            return 0
        return regions[0][0] if regions else 0

    # -- transfers -----------------------------------------------------

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """Writes `length` bytes at local `buffer` to `peer_buffer_address`
        of `target_hostname`; returns once they landed: 0 or a code."""
        return self._sync("write", target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """Reads `length` bytes at the peer's `peer_buffer_address` into
        local `buffer`: 0 or a code."""
        return self._sync("read", target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode,
                      notify=None, transport_hint=""):
        """A read or write (`TransferOpcode`), returning once done."""
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address],
                                        [length], opcode, notify)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint=""):
        """Writes every `(buffer, peer address, length)` as one request: 0
        once all landed, or a code."""
        return self._sync("write", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                 transport_hint=""):
        """Reads every `(buffer, peer address, length)` as one request."""
        return self._sync("read", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode,
                            notify=None, transport_hint=""):
        """A batch read or write (`TransferOpcode`), returning once done."""
        if notify is not None:
            return self._fail("TransferNotify: not offered by kvxfer.mooncake")
        try:
            op = _op(opcode)
        except ValueError as e:
            return self._fail(e)
        return self._sync(op, target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                   transport_hint=""):
        """Starts a batch write; its id (non-zero), or 0 if it could not
        start. `get_batch_transfer_status` waits for it."""
        return self._async("write", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint=""):
        """Starts a batch read; its id, or 0."""
        return self._async("read", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode,
                             transport_hint=""):
        """Starts a batch read or write (`TransferOpcode`); its id, or 0."""
        try:
            op = _op(opcode)
        except ValueError as e:
            self._fail(e)
            return 0
        return self._async(op, target_hostname, buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length,
                              transport_hint=""):
        """Starts one write; its id, or 0. `transfer_check_status` polls it."""
        return self._async("write", target_hostname, [buffer], [peer_buffer_address], [length])

    def get_batch_transfer_status(self, batch_ids):
        """Waits for each batch (each within the I/O deadline) and forgets
        them: 0 if all completed, -1 if any failed or is unknown."""
        rc = 0
        for b in batch_ids:
            t = self._pending.pop(int(b), None)
            if t is None:
                rc = self._fail(f"unknown batch id {b}")
                continue
            if t is _DONE:
                continue
            if isinstance(t, _Failed):
                rc = -1
                continue
            try:
                t.wait(self._io_timeout)
            except KvxferError as e:
                rc = self._fail(e)
        return rc

    def transfer_check_status(self, batch_id):
        """1 once the transfer completed, 0 while in flight, -1 if it
        failed (or the id is unknown); a finished id is forgotten."""
        t = self._pending.get(int(batch_id))
        if t is None:
            return self._fail(f"unknown batch id {batch_id}")
        if t is _DONE:
            del self._pending[int(batch_id)]
            return 1
        if isinstance(t, _Failed):
            del self._pending[int(batch_id)]
            return -1
        state = t.state
        if state == "PROC":
            return 0
        del self._pending[int(batch_id)]
        if state == "DONE":
            return 1
        try:
            t.wait(0)
        except KvxferError as e:
            self._fail(e)
        return -1

    def send_probe(self, peer_server_name):
        """Checks that a peer is reachable (a fresh connection and
        metadata exchange): 0, or -101 (unknown host), -102 (unreachable),
        -200 (unknown to the metadata server)."""
        if self._agent is None:
            return self._fail("not initialized")
        host = str(peer_server_name).rpartition(":")[0] if self._p2p() else None
        if host:
            try:
                socket.getaddrinfo(host, None)
            except OSError as e:
                return self._fail(f"{peer_server_name}: {e}", ERR_DNS)
        try:
            self._session(peer_server_name, reload=True)
        except (OSError, urllib.error.URLError, ValueError, KeyError) as e:
            return self._fail(e, ERR_METADATA)
        except KvxferError as e:
            return self._fail(e, ERR_SOCKET)
        return 0

    def get_notifies(self):
        """Notifications from peers (Mooncake's TransferNotify: not
        offered; always empty)."""
        return []

    def _requests(self, local, remote, lengths):
        if not (len(local) == len(remote) == len(lengths)):
            raise ValueError("buffers, peer addresses and lengths differ in length")
        keep = [(int(a), int(b), int(n)) for a, b, n in zip(local, remote, lengths) if int(n) > 0]
        return [(a, n) for a, _, n in keep], [(b, n) for _, b, n in keep]

    def _sync(self, op, session, local, remote, lengths):
        if self._agent is None:
            return self._fail("not initialized")
        try:
            loc, rem = self._requests(local, remote, lengths)
        except ValueError as e:
            return self._fail(e)
        if not loc:
            return 0
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
                return self._fail(e, -1 if type(e).__name__ != "NotRegisteredError"
                                  else ERR_ADDRESS_NOT_REGISTERED)
            except (OSError, urllib.error.URLError, KeyError) as e:
                return self._fail(e)
        return -1

    def _async(self, op, session, local, remote, lengths):
        if self._agent is None:
            self._fail("not initialized")
            return 0
        try:
            loc, rem = self._requests(local, remote, lengths)
            name = self._session(session)
        except (KvxferError, OSError, urllib.error.URLError, ValueError, KeyError) as e:
            self._fail(e)
            return 0
        bid = next(_ids)
        if not loc:
            self._pending[bid] = _DONE
            return bid
        # The peer was reached: a transfer refused now still gets an id, and
        # its status says it failed (as Mooncake's does).
        try:
            try:
                self._pending[bid] = self._agent.transfer(op, loc, rem, name)
            except RemoteRangeNotExportedError:
                name = self._session(session, reload=True)
                self._pending[bid] = self._agent.transfer(op, loc, rem, name)
        except (KvxferError, OSError, urllib.error.URLError, KeyError) as e:
            self._fail(e)
            self._pending[bid] = _Failed(e)
        return bid

    def _session(self, session, reload=False):
        name = self._sessions.get(session)
        if name is None or reload:
            if self._meta is not None and self._meta.etcd:
                self._agent.connect_by_name(session)
                name = session
            elif self._meta is not None and self._meta.http:
                name = self._agent.connect(self._meta.lookup(session))
            else:
                name = self._agent.connect(session)
            self._sessions[session] = name
        return name

    def _fail(self, why, code=ERR_INVALID_ARGUMENT):
        self._last_error = why
        _log.warning("kvxfer.mooncake: %s", why)
        return code


_DONE = object()


class _Failed:
    """A transfer refused when it was submitted."""

    def __init__(self, why):
        self.why = why


def _op(opcode):
    if opcode in (TransferOpcode.Read, "read", "Read", 0):
        return "read"
    if opcode in (TransferOpcode.Write, "write", "Write", 1):
        return "write"
    name = getattr(opcode, "name", str(opcode))
    if name in ("Read", "Write"):
        return name.lower()
    raise ValueError(f"opcode {opcode!r}: TransferOpcode.Read or .Write")
