"""NIXL's `nixl._bindings` names, over kvxfer.

The constants, enums, descriptor lists, configuration, telemetry record and
exception classes that NIXL's pybind module gives and that frameworks import
directly (`nixlXferTelemetry`, `nixlRemoteDisconnectError`, ...), with
NIXL's names, values and shapes. `kvxfer.nixl` (NIXL's `nixl._api`) is
written against this module and looks `nixlAgent` up here at each agent
made, as NIXL's `_api` does.

The one plugin kvxfer offers is named `"UCX"`: it is kvxfer's transport
selection (shared memory on one host, RDMA where both sides have a device,
TCP otherwise; `KVXFER_NIXL_BACKEND` picks one), which is the role UCX has
in NIXL. Any other plugin name is refused as NIXL refuses a plugin it did
not find (`nixlNotFoundError`).
"""

import enum
import logging
import os
import time

from . import Agent, KvxferError, _kvxfer

_log = logging.getLogger("kvxfer.nixl")

DEFAULT_COMM_PORT = 8888
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
# NIXL's GPU-initiated (device API) transfers: not in kvxfer.
HAVE_UCX_GPU_DEVICE_API = False


class nixl_mem_t(enum.IntEnum):
    """Memory segment types."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG


class nixl_xfer_op_t(enum.IntEnum):
    """Transfer operations."""

    NIXL_READ = 0
    NIXL_WRITE = 1


NIXL_READ = nixl_xfer_op_t.NIXL_READ
NIXL_WRITE = nixl_xfer_op_t.NIXL_WRITE
_OPS = {NIXL_READ: "READ", NIXL_WRITE: "WRITE"}


class nixl_status_t(enum.IntEnum):
    """Status codes."""

    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


NIXL_IN_PROG = nixl_status_t.NIXL_IN_PROG
NIXL_SUCCESS = nixl_status_t.NIXL_SUCCESS
NIXL_ERR_NOT_POSTED = nixl_status_t.NIXL_ERR_NOT_POSTED
NIXL_ERR_INVALID_PARAM = nixl_status_t.NIXL_ERR_INVALID_PARAM
NIXL_ERR_BACKEND = nixl_status_t.NIXL_ERR_BACKEND
NIXL_ERR_NOT_FOUND = nixl_status_t.NIXL_ERR_NOT_FOUND
NIXL_ERR_MISMATCH = nixl_status_t.NIXL_ERR_MISMATCH
NIXL_ERR_NOT_ALLOWED = nixl_status_t.NIXL_ERR_NOT_ALLOWED
NIXL_ERR_REPOST_ACTIVE = nixl_status_t.NIXL_ERR_REPOST_ACTIVE
NIXL_ERR_UNKNOWN = nixl_status_t.NIXL_ERR_UNKNOWN
NIXL_ERR_NOT_SUPPORTED = nixl_status_t.NIXL_ERR_NOT_SUPPORTED


class nixl_thread_sync_t(enum.IntEnum):
    """Thread synchronisation modes (kvxfer's agent is thread-safe in
    every mode; the mode is kept and reported)."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT


class nixl_cost_t(enum.IntEnum):
    """How a cost estimate was made."""

    NIXL_COST_ANALYTICAL_BACKEND = 0


NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND


# -- exceptions ------------------------------------------------------------
# NIXL raises one class per error status. Each is also a `KvxferError`, and
# one raised for a kvxfer error keeps it as `__cause__`.


class nixlNotPostedError(KvxferError):
    """NIXL_ERR_NOT_POSTED."""


class nixlInvalidParamError(KvxferError):
    """NIXL_ERR_INVALID_PARAM: a bad argument."""


class nixlBackendError(KvxferError):
    """NIXL_ERR_BACKEND: the transport failed."""


class nixlNotFoundError(KvxferError):
    """NIXL_ERR_NOT_FOUND: an unknown agent, plugin or memory."""


class nixlMismatchError(KvxferError):
    """NIXL_ERR_MISMATCH: metadata that does not parse."""


class nixlNotAllowedError(KvxferError):
    """NIXL_ERR_NOT_ALLOWED."""


class nixlRepostActiveError(KvxferError):
    """NIXL_ERR_REPOST_ACTIVE: a transfer posted again while in flight."""


class nixlUnknownError(KvxferError):
    """NIXL_ERR_UNKNOWN."""


class nixlNotSupportedError(KvxferError):
    """NIXL_ERR_NOT_SUPPORTED: a feature kvxfer does not have."""


class nixlRemoteDisconnectError(KvxferError):
    """The peer went away."""


class nixlCancelledError(KvxferError):
    """The transfer was cancelled."""


class nixlNoTelemetryError(KvxferError):
    """Telemetry asked of an agent that does not capture it."""


# kvxfer's error classes, by name, to NIXL's.
_ERRORS = {
    "UnknownAgentError": nixlNotFoundError,
    "NotRegisteredError": nixlNotFoundError,
    "RemoteRangeNotExportedError": nixlNotFoundError,
    "NotARegistrationError": nixlNotFoundError,
    "InvalidDescriptorError": nixlInvalidParamError,
    "InvalidRequestError": nixlInvalidParamError,
    "OverlapError": nixlInvalidParamError,
    "InvalidConfigError": nixlInvalidParamError,
    "InvalidConnectionInfoError": nixlInvalidParamError,
    "InvalidAgentDescError": nixlMismatchError,
    "StaleAgentError": nixlMismatchError,
    "UnsupportedMemoryTypeError": nixlNotSupportedError,
    "BackendUnavailableError": nixlNotSupportedError,
    "RegionBusyError": nixlNotAllowedError,
    "AbortedError": nixlCancelledError,
    "ConnectionLostError": nixlRemoteDisconnectError,
    "ConnectError": nixlRemoteDisconnectError,
    "PeerGoneError": nixlRemoteDisconnectError,
    "PeerTimedOutError": nixlRemoteDisconnectError,
    "ClosedError": nixlRemoteDisconnectError,
}


def nixl_error(e):
    """The NIXL exception for a kvxfer one (raise it `from e`)."""
    cls = _ERRORS.get(type(e).__name__, nixlBackendError)
    return cls(str(e))


# -- descriptor lists ------------------------------------------------------

_NATIVE_MEM = {
    nixl_mem_t.DRAM_SEG: "dram",
    nixl_mem_t.VRAM_SEG: "vram",
    nixl_mem_t.BLK_SEG: "blk",
    nixl_mem_t.OBJ_SEG: "obj",
    nixl_mem_t.FILE_SEG: "file",
}


class _DList:
    """Descriptors of one memory type. The `(address, length, device)`
    part is kept in Rust (`kvxfer.DescList`, made when the list is made or
    edited), so that transfers select from it by index without a Python
    object per descriptor; a registration list also keeps each
    descriptor's meta."""

    _width = 3

    def __init__(self, type, descs=None, sorted=False):  # noqa: A002  (NIXL's names)
        self._type = nixl_mem_t(type)
        self._rows = None
        if descs is not None and hasattr(descs, "__array_interface__"):
            self._native = self._make(descs)
            if self._width == 4:
                self._rows = [(int(a), int(n), int(d), b"") for a, n, d in self.triples()]
            return
        rows = []
        for d in descs or ():
            d = tuple(d)
            if len(d) != self._width:
                raise TypeError(f"descriptor {d!r}: a {self._width}-tuple is needed")
            rows.append(self._row(d))
        self._set(rows)

    def _row(self, d):
        return d

    def _make(self, descs):
        try:
            return _kvxfer.DescList(descs, _NATIVE_MEM[self._type])
        except (OverflowError, ValueError) as e:
            raise TypeError(f"descriptors: {e}") from e

    def _set(self, rows):
        self._native = self._make([(d[0], d[1], d[2]) for d in rows])
        self._rows = rows if self._width == 4 else None

    def _all(self):
        return self._rows if self._rows is not None else self.triples()

    def native(self):
        """The list as `kvxfer.DescList`."""
        return self._native

    def triples(self):
        """The descriptors as `(address, length, device)` tuples."""
        n = self._native
        return [n[i] for i in range(len(n))]

    def getType(self):  # noqa: N802  (NIXL's names)
        """The memory type."""
        return self._type

    def descCount(self):  # noqa: N802
        """The number of descriptors."""
        return len(self._native)

    def isEmpty(self):  # noqa: N802
        """Whether there are none."""
        return len(self._native) == 0

    def __getitem__(self, i):
        return self._rows[i] if self._rows is not None else self._native[i]

    def addDesc(self, desc):  # noqa: N802
        """Appends one descriptor."""
        d = tuple(desc)
        if len(d) != self._width:
            raise TypeError(f"descriptor {d!r}: a {self._width}-tuple is needed")
        self._set(list(self._all()) + [self._row(d)])

    append = addDesc

    def remDesc(self, index):  # noqa: N802
        """Removes the descriptor at `index`."""
        rows = list(self._all())
        del rows[index]
        self._set(rows)

    def clear(self):
        """Removes every descriptor."""
        self._set([])

    def index(self, desc):
        """The position of `desc`."""
        return list(self._all()).index(self._row(tuple(desc)))

    def print(self):
        """Prints the list (NIXL's debugging aid)."""
        print(repr(self))  # noqa: T201

    def __repr__(self):
        return f"{type(self).__name__}({self._type.name}, {self.descCount()} descriptors)"

    def __eq__(self, other):
        return (
            type(other) is type(self)
            and other._type == self._type
            and list(other._all()) == list(self._all())
        )

    __hash__ = None

    def __reduce__(self):
        # Pickled as its type and rows (NIXL's lists pickle; LMCache ships
        # them so between kvxfer agents too).
        return (type(self), (int(self._type), list(self._all())))


class nixlXferDList(_DList):
    """A transfer descriptor list: `(address, length, device)`."""


class nixlRegDList(_DList):
    """A registration descriptor list: `(address, length, device, meta)`;
    the meta is kept as bytes."""

    _width = 4

    def _row(self, d):
        a, n, dv, m = d
        return (a, n, dv, m.encode() if isinstance(m, str) else bytes(m))

    def trim(self):
        """A transfer list of the same descriptors, without metas."""
        return nixlXferDList(self._type, self.triples())


class nixlRemoteDList(_DList):
    """Descriptors of another agent's memory: `(address, length, device,
    agent name)` (NIXL's memory views, which kvxfer does not have)."""

    _width = 4


# -- telemetry, configuration, agent ---------------------------------------


class nixlXferTelemetry:
    """One post's telemetry: `startTime` (µs on the monotonic clock, as
    NIXL's steady clock), `postDuration` and `xferDuration` (µs),
    `totalBytes`, `descCount` (after merging)."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):  # noqa: N803,E501
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self):
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
            f"descCount={self.descCount})"
        )


class nixlAgentConfig:
    """The agent's configuration, with NIXL's field names and defaults."""

    def __init__(
        self,
        useProgThread=False,  # noqa: N803
        useListenThread=False,  # noqa: N803
        listenPort=DEFAULT_COMM_PORT,  # noqa: N803
        syncMode=NIXL_THREAD_SYNC_DEFAULT,  # noqa: N803
        numWorkers=1,  # noqa: N803
        pthrDelay=0,  # noqa: N803
        lthrDelay=100000,  # noqa: N803
        captureTelemetry=False,  # noqa: N803
    ):
        self.useProgThread = useProgThread
        self.useListenThread = useListenThread
        self.listenPort = listenPort
        self.syncMode = nixl_thread_sync_t(syncMode)
        self.pthrDelay = pthrDelay
        self.lthrDelay = lthrDelay
        self.captureTelemetry = captureTelemetry
        self.etcdWatchTimeout = 5000000


_PLUGIN = "UCX"
# NIXL's libfabric plugin (EFA and the other fabrics libfabric drives):
# kvxfer's `fabric` transport.
_FABRIC_PLUGIN = "LIBFABRIC"
_PLUGINS = (_PLUGIN, _FABRIC_PLUGIN)
_PLUGIN_MEMS = ["DRAM_SEG", "VRAM_SEG"]
# Each plugin's backend handle differs (xor-ed with the agent's id).
_HANDLE_SALT = {_PLUGIN: 0x5543_5800, _FABRIC_PLUGIN: 0x4F46_4900}


def _telemetry_enabled(config):
    """NIXL_TELEMETRY_ENABLE, when set, decides; otherwise the config."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if env is not None:
        return env.strip().lower() in ("y", "yes", "1", "true", "on")
    return bool(config.captureTelemetry)


def _bytes(msg):
    if type(msg) is bytes:
        return msg
    if isinstance(msg, str):
        return msg.encode()
    return bytes(msg) if msg else b""


def _name(agent):
    return agent.decode() if isinstance(agent, (bytes, bytearray)) else str(agent)


class _Prepped:
    """A descriptor list prepared for one side (`prepXferDlist`)."""

    __slots__ = ("agent_name", "dlist", "native")

    def __init__(self, agent_name, dlist):
        self.agent_name = agent_name
        self.dlist = dlist
        self.native = dlist.native()


class _XferReq:
    """A transfer request (`makeXferReq` / `createXferReq`): made once
    (descriptors selected and merged in Rust), posted again once ended."""

    __slots__ = ("request", "xfer", "failed", "released", "start", "post", "t0", "end")

    def __init__(self, request):
        self.request = request
        self.xfer = None
        self.failed = False
        self.released = False
        self.start = self.post = self.t0 = 0
        self.end = None


# How long getXferStatus waits for a transfer in flight (seconds): a caller
# polling in a loop leaves the CPU to the threads moving its data.
_CHECK_WAIT = 20e-6
_STATUS = {"DONE": NIXL_SUCCESS, "PROC": NIXL_IN_PROG}


class nixlAgent:
    """NIXL's agent (the C++ `nixlAgent` as NIXL's pybind module gives it)
    over a kvxfer agent: plugins and backends, registration, metadata,
    descriptor lists prepared per side, transfer requests and their
    status and telemetry, notifications. Failures raise the NIXL exception
    of their status; `postXferReq` and `getXferStatus` return statuses."""

    def __init__(self, name, config):
        if not name:
            raise ValueError("an agent needs a name")
        self.name = str(name)
        self.config = config
        self.telemetry = _telemetry_enabled(config)
        self.transport = os.environ.get("KVXFER_NIXL_BACKEND", "auto")
        try:
            self.kvxfer = Agent(self.name, backend=self.transport)
        except KvxferError as e:
            raise nixl_error(e) from e
        self._backends = {}
        # A region registered again is counted, not registered twice.
        self._regs = {}
        # Whether memory was registered or a peer loaded (the agent can no
        # longer be replaced by the LIBFABRIC plugin's).
        self._used = False

    # -- plugins and backends --------------------------------------------

    def getAvailPlugins(self):  # noqa: N802
        """The plugins kvxfer offers."""
        return list(_PLUGINS)

    def getPluginParams(self, plugin):  # noqa: N802
        """`(options, memory types)` of a plugin."""
        if plugin not in _PLUGINS:
            raise nixlNotFoundError(f"plugin {plugin!r} not found (kvxfer offers {list(_PLUGINS)!r})")
        transport = "fabric" if plugin == _FABRIC_PLUGIN else self.transport
        return {"kvxfer_transport": transport}, list(_PLUGIN_MEMS)

    def createBackend(self, plugin, params):  # noqa: N802
        """Instantiates a plugin; returns its handle. `LIBFABRIC` moves
        this agent's transfers over kvxfer's libfabric transport (unless
        `KVXFER_NIXL_BACKEND` names one): it must come before memory is
        registered or a peer loaded, as NIXL's agent creates its backends."""
        if plugin not in _PLUGINS:
            raise nixlNotFoundError(f"plugin {plugin!r} not found (kvxfer offers {list(_PLUGINS)!r})")
        if plugin in self._backends:
            raise nixlInvalidParamError(f"backend already created for type {plugin!r}")
        if plugin == _FABRIC_PLUGIN and self.transport != "fabric" and "KVXFER_NIXL_BACKEND" not in os.environ:
            if self._used:
                raise nixlNotAllowedError(
                    "createBackend: LIBFABRIC must be created before memory is registered or a peer loaded"
                )
            try:
                agent = Agent(self.name, backend="fabric")
            except KvxferError as e:
                raise nixl_error(e) from e
            self.kvxfer, self.transport = agent, "fabric"
        handle = id(self) ^ _HANDLE_SALT[plugin]
        self._backends[plugin] = (handle, dict(params or {}))
        return handle

    def getBackendParams(self, handle):  # noqa: N802
        """`(options, memory types)` of an instantiated backend."""
        for h, params in self._backends.values():
            if h == handle:
                opts = {"kvxfer_transport": self.transport}
                opts.update({k: str(v) for k, v in params.items()})
                return opts, list(_PLUGIN_MEMS)
        raise nixlNotFoundError(f"no backend with handle {handle}")

    def _need_backend(self, what, mem):
        if not self._backends:
            raise nixlNotFoundError(f"{what}: no available backends for mem type {mem.name!r}")

    def _backend_handle(self):
        if self.transport == "fabric" and _FABRIC_PLUGIN in self._backends:
            return self._backends[_FABRIC_PLUGIN][0]
        return next(iter(self._backends.values()))[0] if self._backends else 0

    # -- memory ------------------------------------------------------------

    def registerMem(self, descs, backends=()):  # noqa: N802
        """Registers a `nixlRegDList`; returns NIXL_SUCCESS."""
        mem = descs.getType()
        self._need_backend("registerMem", mem)
        triples = descs.triples()
        new = [d for d in triples if (mem, d) not in self._regs]
        try:
            if new:
                self.kvxfer.register_raw(new, _NATIVE_MEM[mem])
        except KvxferError as e:
            raise nixl_error(e) from e
        for d in triples:
            self._regs[(mem, d)] = self._regs.get((mem, d), 0) + 1
        self._used = True
        return NIXL_SUCCESS

    def deregisterMem(self, descs, backends=()):  # noqa: N802
        """Deregisters what `registerMem` registered; returns NIXL_SUCCESS."""
        mem = descs.getType()
        triples = descs.triples()
        missing = [d for d in triples if (mem, d) not in self._regs]
        if missing:
            raise nixlNotFoundError(f"deregisterMem: {len(missing)} regions are not registered")
        last = [d for d in triples if self._regs[(mem, d)] == 1]
        try:
            if last:
                self.kvxfer.deregister_raw(last, _NATIVE_MEM[mem])
        except KvxferError as e:
            raise nixl_error(e) from e
        for d in triples:
            self._regs[(mem, d)] -= 1
            if not self._regs[(mem, d)]:
                del self._regs[(mem, d)]
        return NIXL_SUCCESS

    def queryMem(self, descs, backend):  # noqa: N802
        """Not offered by kvxfer (NIXL answers it for storage plugins)."""
        raise nixlNotSupportedError("queryMem: kvxfer's UCX plugin answers no queries")

    # -- metadata and peers ----------------------------------------------

    def getLocalMD(self):  # noqa: N802
        """This agent's metadata."""
        if not self._backends:
            raise nixlInvalidParamError("getLocalMD: no backends support remote operations")
        return self.kvxfer.metadata()

    def loadRemoteMD(self, metadata):  # noqa: N802
        """Loads a peer from its metadata; its name as bytes."""
        try:
            name = self.kvxfer.add_remote_agent(bytes(metadata)).encode()
        except KvxferError as e:
            raise nixl_error(e) from e
        self._used = True
        return name

    def invalidateRemoteMD(self, name):  # noqa: N802
        """Forgets a peer (its transfers in flight fail); an unknown name is
        not an error."""
        try:
            self.kvxfer.remove_remote_agent(_name(name))
        except KvxferError as e:
            if type(e).__name__ != "UnknownAgentError":
                raise nixl_error(e) from e
        return NIXL_SUCCESS

    def makeConnection(self, name, backends=()):  # noqa: N802
        """Checks the peer is loaded (kvxfer connects when it is loaded)."""
        self._remote(_name(name))
        return NIXL_SUCCESS

    def _remote(self, name):
        try:
            return self.kvxfer.remote_transport(name)
        except KvxferError as e:
            raise nixl_error(e) from e

    def _unsupported(self, *args, **kwargs):
        raise nixlNotSupportedError(
            "the listener/etcd metadata exchange and partial metadata are not offered by kvxfer"
        )

    getLocalPartialMD = sendLocalMD = sendLocalPartialMD = _unsupported  # noqa: N815
    fetchRemoteMD = checkRemoteMD = invalidateLocalMD = _unsupported  # noqa: N815

    # -- transfers ---------------------------------------------------------

    def _check(self, dlist, remote=None):
        try:
            self.kvxfer.check_descs(dlist.native(), remote)
        except KvxferError as e:
            raise nixl_error(e) from e

    def prepXferDlist(self, agent_name, descs, backends=()):  # noqa: N802
        """Prepares one side of later transfers: `NIXL_INIT_AGENT` for the
        local side, the peer's name for the remote side; memory not
        registered there raises `nixlNotFoundError`."""
        name = _name(agent_name)
        self._need_backend("prepXferDlist", descs.getType())
        if name in ("", NIXL_INIT_AGENT):
            name = NIXL_INIT_AGENT
            self._check(descs)
        elif name == self.name:
            raise nixlNotSupportedError("loopback transfers (an agent to itself): not offered by kvxfer")
        else:
            self._remote(name)
            self._check(descs, name)
        return _Prepped(name, descs)

    def releasedDlistH(self, handle):  # noqa: N802
        """Releases a prepared list."""
        handle.dlist = handle.native = None
        return NIXL_SUCCESS

    def _make(self, op, local, li, remote, ri, remote_name, notif, merge):
        try:
            req = self.kvxfer.make_request(
                op, local, li, remote, ri, remote_name, _bytes(notif) or None, merge
            )
        except (ValueError, IndexError) as e:
            raise nixlInvalidParamError(str(e)) from e
        except KvxferError as e:
            raise nixl_error(e) from e
        return _XferReq(req)

    def makeXferReq(self, op, local, local_indices, remote, remote_indices, notif=b"",  # noqa: N802
                    backends=(), skip_desc_merge=False):
        """A request of the selected descriptors (ids as lists or numpy int
        arrays, any order) of two prepared lists; pairs adjacent on both
        sides merge unless `skip_desc_merge`."""
        # The hot call of a serving loop: kept to a few steps, as it runs
        # with caches cold from the previous transfer.
        if local.agent_name != NIXL_INIT_AGENT:
            raise nixlInvalidParamError("the local side must be prepared with NIXL_INIT_AGENT")
        return self._make(_OPS[op], local.native, local_indices, remote.native, remote_indices,
                          remote.agent_name, notif, not skip_desc_merge)

    def createXferReq(self, op, local, remote, remote_agent, notif=b"", backends=()):  # noqa: N802
        """A request of every descriptor of two lists, pair by pair (never
        merged); memory not registered on either side raises
        `nixlNotFoundError` here."""
        for d in (local, remote):
            if not isinstance(d, nixlXferDList):
                raise TypeError("createXferReq takes nixlXferDList descriptor lists")
        name = _name(remote_agent)
        if name == self.name:
            raise nixlNotSupportedError("loopback transfers (an agent to itself): not offered by kvxfer")
        self._remote(name)
        n, m = local.descCount(), remote.descCount()
        if n != m:
            raise nixlInvalidParamError(f"{n} local descriptors for {m} remote ones")
        ids = list(range(n))
        # Made first: a pair whose sides differ in length is refused there,
        # before the registration checks (as NIXL orders them).
        req = self._make(_OPS[op], local.native(), ids, remote.native(), ids, name, notif, False)
        self._check(local)
        self._check(remote, name)
        return req

    def postXferReq(self, req, notif=b""):  # noqa: N802
        """Posts a request: NIXL_SUCCESS when it completed inline,
        NIXL_IN_PROG while in flight, NIXL_ERR_REPOST_ACTIVE while an
        earlier post is in flight, an error status when it could not
        start."""
        if req.released:
            return NIXL_ERR_NOT_FOUND
        if req.xfer is not None and not req.xfer.done():
            return NIXL_ERR_REPOST_ACTIVE
        req.start = time.monotonic_ns() // 1000
        t0 = time.perf_counter_ns()
        req.failed = False
        req.end = None
        try:
            req.xfer = self.kvxfer.post(req.request, _bytes(notif) or None)
        except KvxferError as e:
            _log.error("postXferReq: %s", e)
            req.xfer = None
            req.failed = True
        req.t0 = t0
        req.post = -(-(time.perf_counter_ns() - t0) // 1000)
        return self._status(req, 0.0)

    def _status(self, req, max_wait):
        if req.failed or req.xfer is None:
            return NIXL_ERR_BACKEND
        s = req.xfer.check(max_wait) if max_wait else req.xfer.state
        if s != "PROC" and req.end is None:
            req.end = time.perf_counter_ns()
        return _STATUS.get(s, NIXL_ERR_BACKEND)

    def getXferStatus(self, req):  # noqa: N802
        """NIXL_SUCCESS, NIXL_IN_PROG or an error status. Waits up to
        20 µs (the GIL released) for a transfer in flight to end."""
        if req.released:
            return NIXL_ERR_NOT_FOUND
        return self._status(req, _CHECK_WAIT)

    def getXferTelemetry(self, req):  # noqa: N802
        """The last post's `nixlXferTelemetry`: start (µs, monotonic clock),
        post and transfer durations (µs, rounded up; the transfer's end is
        when a status check first saw it end), bytes and descriptors (after
        merging). `nixlNoTelemetryError` unless telemetry is on."""
        if not self.telemetry:
            raise nixlNoTelemetryError("telemetry is not enabled for this agent")
        end = req.end if req.end is not None else time.perf_counter_ns()
        return nixlXferTelemetry(
            req.start,
            req.post,
            max(req.post, -(-(end - req.t0) // 1000)),
            req.request.total_bytes,
            req.request.desc_count,
        )

    def queryXferBackend(self, req):  # noqa: N802
        """The handle of the backend that carries the request."""
        return self._backend_handle()

    def query_transport(self, req):
        """kvxfer's transport that carried the last post (`tcp`, `shm`,
        `rdma`), or `""`."""
        return req.xfer.transport if req.xfer is not None else ""

    def releaseXferReq(self, req):  # noqa: N802
        """Releases a request; one in flight is aborted first, and this
        returns once nothing of it can touch either side's memory."""
        if req.released:
            return NIXL_SUCCESS
        if req.xfer is not None and not req.xfer.done():
            req.xfer.abort()
            try:
                req.xfer.wait()
            except KvxferError:
                pass
        req.xfer = None
        req.released = True
        req.request.release()
        return NIXL_SUCCESS

    def estimateXferCost(self, req):  # noqa: N802
        """Not offered by kvxfer."""
        raise nixlNotSupportedError("estimateXferCost: not offered by kvxfer")

    def prepMemView(self, *args):  # noqa: N802
        """GPU memory views: not offered by kvxfer."""
        raise nixlNotSupportedError("prepMemView: NIXL's GPU device API is not offered by kvxfer")

    releaseMemView = prepMemView  # noqa: N815

    # -- notifications -----------------------------------------------------

    def getNotifs(self, notifs, backends=()):  # noqa: N802
        """Adds the notifications that arrived to `notifs` (`{peer name:
        [bytes, ...]}`) and returns it."""
        for k, v in self.kvxfer.get_new_notifs().items():
            notifs.setdefault(k, []).extend(v)
        return notifs

    def genNotif(self, remote, msg, backend=None):  # noqa: N802
        """Sends a notification alone (no data)."""
        try:
            self.kvxfer.send_notif(_name(remote), _bytes(msg))
        except KvxferError as e:
            raise nixl_error(e) from e
        return NIXL_SUCCESS
