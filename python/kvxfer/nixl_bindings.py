"""NIXL's `nixl._bindings` names, over kvxfer.

The constants, enums, descriptor lists, configuration, telemetry record and
exception classes that NIXL's pybind module gives and that frameworks import
directly (`nixlXferTelemetry`, `nixlRemoteDisconnectError`, ...), with
NIXL's names, values and shapes. `kvxfer.nixl` (NIXL's `nixl._api`) is
written against this module and looks `nixlAgent` up here at each agent
made, as NIXL's `_api` does.

The plugins: `"UCX"` is kvxfer's transport selection (shared memory on
one host, RDMA where both sides have a device, TCP otherwise;
`KVXFER_NIXL_BACKEND` picks one), which is the role UCX has in NIXL;
`"LIBFABRIC"` is kvxfer's libfabric transport; `"POSIX"`, `"GDS"` and
`"GDS_MT"` are kvxfer's storage (FILE descriptors as NIXL gives them: the
file descriptor as the device, offsets as addresses; GPU memory staged
through host memory, no GPUDirect Storage), `"OBJ"` kvxfer's object
storage (an S3-compatible store; the object key is the descriptor's meta,
else its device id). Storage transfers are requests of an agent to itself
(NIXL's loopback). Any other plugin name is refused as NIXL refuses a
plugin it did not find (`nixlNotFoundError`).
"""

import enum
import json
import logging
import os
import threading
import time
import weakref

from . import Agent, KvxferError, _kvxfer
from . import nixl_etcd as _etcd
from . import nixl_listen as _listen
from . import nixl_telemetry as _telemetry

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
# Storage: files through kvxfer's storage (GPU memory staged through host
# memory; kvxfer has no GPUDirect Storage), objects in an S3-compatible store.
_POSIX_PLUGIN, _GDS_PLUGIN, _GDS_MT_PLUGIN, _OBJ_PLUGIN = "POSIX", "GDS", "GDS_MT", "OBJ"
_FILE_PLUGINS = (_POSIX_PLUGIN, _GDS_PLUGIN, _GDS_MT_PLUGIN)
_NET_PLUGINS = (_PLUGIN, _FABRIC_PLUGIN)
_PLUGINS = _NET_PLUGINS + _FILE_PLUGINS + (_OBJ_PLUGIN,)
_PLUGIN_MEMS = ["DRAM_SEG", "VRAM_SEG"]
# NIXL's parameters and memory types for the storage plugins, as NIXL's
# plugins list them (`getPluginParams`); the backends' memory types as
# NIXL's backends list them (`getBackendParams`).
_STORAGE_PARAMS = {
    _POSIX_PLUGIN: (
        {"use_posix_aio": "false", "use_uring": "false", "use_aio": "false",
         "kernel_queue_size": "256", "ios_pool_size": "65536"},
        ["DRAM_SEG", "FILE_SEG"],
        ["FILE_SEG", "DRAM_SEG"],
    ),
    _GDS_PLUGIN: ({}, ["DRAM_SEG", "VRAM_SEG", "FILE_SEG"], ["DRAM_SEG", "VRAM_SEG", "FILE_SEG"]),
    _GDS_MT_PLUGIN: ({}, ["DRAM_SEG", "VRAM_SEG", "FILE_SEG"], ["DRAM_SEG", "VRAM_SEG", "FILE_SEG"]),
    _OBJ_PLUGIN: ({}, ["DRAM_SEG", "OBJ_SEG"], ["DRAM_SEG", "OBJ_SEG"]),
}
# Each plugin's backend handle differs (xor-ed with the agent's id).
_HANDLE_SALT = {
    _PLUGIN: 0x5543_5800, _FABRIC_PLUGIN: 0x4F46_4900, _POSIX_PLUGIN: 0x504F_5300,
    _GDS_PLUGIN: 0x4744_5300, _GDS_MT_PLUGIN: 0x474D_5400, _OBJ_PLUGIN: 0x4F42_4A00,
}
_STORAGE_MEMS = (nixl_mem_t.FILE_SEG, nixl_mem_t.OBJ_SEG)
# NIXL's path-mode FILE registration: a meta `<access>[,<flag>]*:<path>`
# names the file to open (and close at deregistration) instead of an fd in
# the device id.
_PATH_ACCESS = {"ro": os.O_RDONLY, "rw": os.O_RDWR}
_PATH_FLAGS = {"direct": os.O_DIRECT, "sync": os.O_SYNC, "noatime": os.O_NOATIME,
               "create": os.O_CREAT}


def _path_mode(meta):
    """`(open flags, path)` of a path-mode meta, or None (fd mode)."""
    text = meta.decode(errors="replace") if isinstance(meta, (bytes, bytearray)) else str(meta)
    modes, sep, path = text.partition(":")
    tokens = modes.split(",")
    if not sep or not path or tokens[0] not in _PATH_ACCESS:
        return None
    flags = _PATH_ACCESS[tokens[0]] | os.O_CLOEXEC
    for t in tokens[1:]:
        if t not in _PATH_FLAGS:
            return None
        flags |= _PATH_FLAGS[t]
    return flags, path


def _obj_options(params):
    """The OBJ plugin's parameters (NIXL's names) as `open_object`'s
    keywords; the bucket from `bucket`, else `AWS_DEFAULT_BUCKET`."""
    p = {k: str(v) for k, v in (params or {}).items()}
    bucket = p.get("bucket") or os.environ.get("AWS_DEFAULT_BUCKET")
    if not bucket:
        raise nixlInvalidParamError("OBJ: no bucket (parameter 'bucket' or AWS_DEFAULT_BUCKET)")
    opts = {}
    endpoint = p.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_OVERRIDE")
    if endpoint:
        if "://" not in endpoint:
            endpoint = f"{p.get('scheme', 'https')}://{endpoint}"
        opts["endpoint"] = endpoint
    if p.get("region"):
        opts["region"] = p["region"]
    if p.get("access_key") and p.get("secret_key"):
        opts["access_key"], opts["secret_key"] = p["access_key"], p["secret_key"]
        if p.get("session_token"):
            opts["session_token"] = p["session_token"]
    if "use_virtual_addressing" in p:
        opts["virtual_hosted"] = p["use_virtual_addressing"].strip().lower() == "true"
    return bucket, opts


# Partial metadata (`getLocalPartialMD`): this prefix, the agent
# description's length (4 bytes) and bytes, then the announced descriptors.
_PARTIAL = b"KVXPMD1"
# How long a metadata exchange keeps trying to reach the peer's listener.
_EXCHANGE_TIMEOUT = float(os.environ.get("KVXFER_NIXL_EXCHANGE_TIMEOUT", "30"))


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
    """A descriptor list prepared for one side (`prepXferDlist`); for this
    agent's storage, `native` holds kvxfer's storage handles where the
    list has NIXL's devices (file descriptors, object ids)."""

    __slots__ = ("agent_name", "dlist", "native")

    def __init__(self, agent_name, dlist, native=None):
        self.agent_name = agent_name
        self.dlist = dlist
        self.native = dlist.native() if native is None else native


class _XferReq:
    """A transfer request (`makeXferReq` / `createXferReq`): made once
    (descriptors selected and merged in Rust), posted again once ended."""

    __slots__ = ("request", "xfer", "failed", "released", "start", "post", "t0", "end",
                 "plugin", "write", "__weakref__")

    def __init__(self, request, plugin=None, write=False):
        self.request = request
        self.write = write
        self.xfer = None
        self.failed = False
        self.released = False
        self.start = self.post = self.t0 = 0
        self.end = None
        # The storage plugin carrying it (None: the network's).
        self.plugin = plugin


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
        # NIXL's telemetry file (NIXL_TELEMETRY_DIR), when telemetry is on.
        try:
            self._tfile = _telemetry.open_for(self.name, self.telemetry)
        except ValueError as e:
            raise nixlInvalidParamError(str(e)) from e
        except OSError as e:
            _log.warning("telemetry file for %s: %s; running without one", self.name, e)
            self._tfile = None
        self.transport = os.environ.get("KVXFER_NIXL_BACKEND", "auto")
        try:
            self.kvxfer = Agent(self.name, backend=self.transport)
        except KvxferError as e:
            raise nixl_error(e) from e
        self._backends = {}
        # A region registered again is counted, not registered twice.
        self._regs = {}
        # Storage: NIXL's device (a file descriptor, an object id) to
        # [kvxfer's storage handle, regions registered on it].
        self._files = {}
        self._objs = {}
        # The OBJ backend's bucket and store options.
        self._obj_store = None
        # Requests not released: a deregistration lets finished ones' holds
        # go (NIXL lets memory be deregistered under a finished handle).
        self._reqs = weakref.WeakSet()
        # Peers loaded from partial metadata: the descriptors they announced
        # (`(mem, address, length, device)`), the only ones transfers may name.
        self._announced = {}
        # Held while a peer is loaded and its announcement recorded, and
        # while they are checked: a load on the etcd worker's thread is
        # never seen half done.
        self._md_lock = threading.RLock()
        # Whether memory was registered or a peer loaded (the agent can no
        # longer be replaced by the LIBFABRIC plugin's).
        self._used = False
        # NIXL's etcd exchange (NIXL_ETCD_ENDPOINTS), for the metadata
        # calls without a peer address.
        self._etcd = None
        if _etcd.configured():
            me = weakref.ref(self)

            def load(blob):
                return me().loadRemoteMD(blob).decode()

            def forget(name):
                agent = me()
                if agent is not None:
                    agent.invalidateRemoteMD(name)

            try:
                self._etcd = _etcd.Exchange(self.name, load, forget,
                                            int(getattr(config, "etcdWatchTimeout", 5000000)) / 1e6)
            except _etcd.EtcdError as e:
                raise nixlInvalidParamError(str(e)) from e
        # NIXL's listener thread, for the metadata exchange.
        self._listener = None
        if config.useListenThread:
            me = weakref.WeakMethod(self._on_exchange)
            host = os.environ.get("KVXFER_NIXL_LISTEN_HOST", "0.0.0.0")
            try:
                self._listener = _listen.Listener(
                    host, int(config.listenPort), lambda op, payload: me()(op, payload))
            except OSError as e:
                raise nixlBackendError(f"listener on {host}:{config.listenPort}: {e}") from e

    def __del__(self):
        etcd = getattr(self, "_etcd", None)
        if etcd is not None:
            etcd.close()
        listener = getattr(self, "_listener", None)
        if listener is not None:
            listener.close()
        tfile = getattr(self, "_tfile", None)
        if tfile is not None:
            tfile.close()

    def _count(self, kind, descs):
        """Telemetry: memory registered or deregistered."""
        if self._tfile is not None:
            self._tfile.events((kind, sum(n for _, n, _ in descs.triples())))

    # -- plugins and backends --------------------------------------------

    def getAvailPlugins(self):  # noqa: N802
        """The plugins kvxfer offers."""
        return list(_PLUGINS)

    def getPluginParams(self, plugin):  # noqa: N802
        """`(options, memory types)` of a plugin."""
        if plugin not in _PLUGINS:
            raise nixlNotFoundError(f"plugin {plugin!r} not found (kvxfer offers {list(_PLUGINS)!r})")
        if plugin in _STORAGE_PARAMS:
            opts, mems, _ = _STORAGE_PARAMS[plugin]
            return dict(opts), list(mems)
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
        if plugin == _OBJ_PLUGIN:
            self._obj_store = _obj_options(params)
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
        for plugin, (h, params) in self._backends.items():
            if h == handle:
                if plugin in _STORAGE_PARAMS:
                    return {k: str(v) for k, v in params.items()}, list(_STORAGE_PARAMS[plugin][2])
                opts = {"kvxfer_transport": self.transport}
                opts.update({k: str(v) for k, v in params.items()})
                return opts, list(_PLUGIN_MEMS)
        raise nixlNotFoundError(f"no backend with handle {handle}")

    def _plugin_of(self, handle):
        for plugin, (h, _) in self._backends.items():
            if h == handle:
                return plugin
        raise nixlNotFoundError(f"no backend with handle {handle}")

    def _storage_plugin(self, mem):
        """The created plugin that moves memory type `mem` to storage (FILE:
        POSIX, GDS_MT, GDS; OBJ: OBJ), or None."""
        plugins = (_OBJ_PLUGIN,) if mem == nixl_mem_t.OBJ_SEG else _FILE_PLUGINS
        return next((p for p in plugins if p in self._backends), None)

    def _need_backend(self, what, mem):
        if mem in _STORAGE_MEMS:
            ok = self._storage_plugin(mem) is not None
        elif mem == nixl_mem_t.BLK_SEG:
            ok = False
        else:
            ok = bool(self._backends)
        if not ok:
            raise nixlNotFoundError(f"{what}: no available backends for mem type {mem.name!r}")

    def _backend_handle(self, plugin=None):
        if plugin is not None:
            return self._backends[plugin][0]
        if self.transport == "fabric" and _FABRIC_PLUGIN in self._backends:
            return self._backends[_FABRIC_PLUGIN][0]
        net = [h for p, (h, _) in self._backends.items() if p in _NET_PLUGINS]
        return net[0] if net else 0

    # -- storage -----------------------------------------------------------

    def _storage_handle(self, mem, device, meta=b"", create=False):
        """kvxfer's storage handle for NIXL's `device` of memory `mem` (a
        file descriptor, an object id); opened when `create`: the file
        descriptor adopted (a duplicate, growing as WRITEs reach past its
        end), or with a path-mode meta (`rw,create:/path`) the file opened
        here with those flags; the object by its key: the meta, else the
        id."""
        table = self._files if mem == nixl_mem_t.FILE_SEG else self._objs
        ent = table.get(device)
        if ent is not None:
            return ent[0]
        if not create:
            raise nixlNotFoundError(
                f"{mem.name} device {device} is not registered (no storage backend has it)"
            )
        path_mode = _path_mode(meta) if mem == nixl_mem_t.FILE_SEG else None
        try:
            if path_mode is not None:
                flags, path = path_mode
                try:
                    fd = os.open(path, flags, 0o644)
                except OSError as e:
                    raise nixlBackendError(f"registerMem: {path}: {e}") from e
                try:
                    handle = self.kvxfer.adopt_storage(fd)
                finally:
                    os.close(fd)
            elif mem == nixl_mem_t.FILE_SEG:
                handle = self.kvxfer.adopt_storage(device)
            else:
                bucket, opts = self._obj_store
                key = meta.decode() if meta else str(device)
                handle = self.kvxfer.open_object(bucket, key, **opts)
        except KvxferError as e:
            raise nixl_error(e) from e
        table[device] = [handle, 0]
        return handle

    def _native_storage(self, descs):
        """`descs` with kvxfer's storage handles as devices."""
        mem = descs.getType()
        rows = [(a, n, self._storage_handle(mem, d)) for a, n, d in descs.triples()]
        return _kvxfer.DescList(rows, _NATIVE_MEM[mem])

    def _loosen(self):
        """Lets the holds of every finished, unreleased request go (each
        later post checks it in full), so that its memory may be
        deregistered as NIXL allows."""
        for r in list(self._reqs):
            if not r.released and (r.xfer is None or r.xfer.done()):
                r.request.release()

    # -- memory ------------------------------------------------------------

    def registerMem(self, descs, backends=()):  # noqa: N802
        """Registers a `nixlRegDList`; returns NIXL_SUCCESS. FILE: the
        device is an open file descriptor, addresses are offsets (the
        range may reach past the file's end: a WRITE extends it); OBJ: the
        object's key is the meta, else the device id."""
        mem = descs.getType()
        self._need_backend("registerMem", mem)
        triples = descs.triples()
        new = [d for d in triples if (mem, d) not in self._regs]
        if mem in _STORAGE_MEMS:
            self._register_storage(descs, mem, triples, new)
        else:
            try:
                if new:
                    self.kvxfer.register_raw(new, _NATIVE_MEM[mem])
            except KvxferError as e:
                raise nixl_error(e) from e
            for d in triples:
                self._regs[(mem, d)] = self._regs.get((mem, d), 0) + 1
            self._used = True
        self._count(_telemetry.MEMORY_REGISTERED, descs)
        return NIXL_SUCCESS

    def _register_storage(self, descs, mem, triples, new):
        table = self._files if mem == nixl_mem_t.FILE_SEG else self._objs
        metas = {d: descs[i][3] for i, d in enumerate(triples)}
        done = []
        try:
            for d in new:
                if (mem, d) in self._regs or d in done:
                    continue
                opened = d[2] not in table
                h = self._storage_handle(mem, d[2], metas[d], create=True)
                try:
                    self.kvxfer.register_raw([(d[0], d[1], h)], _NATIVE_MEM[mem])
                except KvxferError:
                    if opened:
                        del table[d[2]]
                        self.kvxfer.close_storage(h)
                    raise
                table[d[2]][1] += 1
                done.append(d)
        except KvxferError as e:
            self._unregister_storage(mem, done)
            raise nixl_error(e) from e
        except nixlNotFoundError:
            self._unregister_storage(mem, done)
            raise
        for d in triples:
            self._regs[(mem, d)] = self._regs.get((mem, d), 0) + 1
        return NIXL_SUCCESS

    def _unregister_storage(self, mem, triples):
        """Deregisters storage regions this agent registered; closes a
        file or object once none of its regions is left."""
        table = self._files if mem == nixl_mem_t.FILE_SEG else self._objs
        for a, n, dev in triples:
            ent = table[dev]
            self.kvxfer.deregister_raw([(a, n, ent[0])], _NATIVE_MEM[mem])
            ent[1] -= 1
            if not ent[1]:
                del table[dev]
                self.kvxfer.close_storage(ent[0])

    def deregisterMem(self, descs, backends=()):  # noqa: N802
        """Deregisters what `registerMem` registered; returns NIXL_SUCCESS."""
        mem = descs.getType()
        triples = descs.triples()
        missing = [d for d in triples if (mem, d) not in self._regs]
        if missing:
            raise nixlNotFoundError(f"deregisterMem: {len(missing)} regions are not registered")
        last = list(dict.fromkeys(d for d in triples if self._regs[(mem, d)] == 1))
        if last:
            self._loosen()
        try:
            if last and mem in _STORAGE_MEMS:
                self._unregister_storage(mem, last)
            elif last:
                self.kvxfer.deregister_raw(last, _NATIVE_MEM[mem])
        except KvxferError as e:
            raise nixl_error(e) from e
        for d in triples:
            self._regs[(mem, d)] -= 1
            if not self._regs[(mem, d)]:
                del self._regs[(mem, d)]
        self._count(_telemetry.MEMORY_DEREGISTERED, descs)
        return NIXL_SUCCESS

    def queryMem(self, descs, backend):  # noqa: N802
        """What storage holds for each descriptor's meta: a file's
        `{"size", "mode", "mtime"}` (strings, as NIXL's POSIX plugin gives
        them) for a file plugin, `{}` for an object that exists for OBJ;
        `None` where there is none. The network plugins answer no query."""
        plugin = self._plugin_of(backend)
        out = []
        for i in range(descs.descCount()):
            meta = descs[i][3]
            name = meta.decode() if isinstance(meta, (bytes, bytearray)) else str(meta)
            if plugin in _FILE_PLUGINS:
                try:
                    st = os.stat(name)
                except OSError:
                    out.append(None)
                    continue
                out.append({"size": str(st.st_size), "mode": str(st.st_mode),
                            "mtime": str(int(st.st_mtime))})
            elif plugin == _OBJ_PLUGIN:
                bucket, opts = self._obj_store
                try:
                    size = self.kvxfer.object_size(bucket, name, **opts)
                except KvxferError as e:
                    raise nixlBackendError(f"queryMem: {e}") from e
                out.append(None if size is None else {})
            else:
                raise nixlNotSupportedError(f"queryMem: kvxfer's {plugin} plugin answers no queries")
        return out

    # -- metadata and peers ----------------------------------------------

    def getLocalMD(self):  # noqa: N802
        """This agent's metadata."""
        if not any(p in self._backends for p in _NET_PLUGINS):
            raise nixlInvalidParamError("getLocalMD: no backends support remote operations")
        return self.kvxfer.metadata()

    def loadRemoteMD(self, metadata):  # noqa: N802
        """Loads a peer from its metadata (full, or partial: see
        `getLocalPartialMD`); its name as bytes."""
        metadata = bytes(metadata)
        announced = None
        if metadata.startswith(_PARTIAL):
            try:
                n = int.from_bytes(metadata[len(_PARTIAL):len(_PARTIAL) + 4], "big")
                start = len(_PARTIAL) + 4
                md, body = metadata[start:start + n], json.loads(metadata[start + n:])
                mem = int(body["mem"])
                announced = [(mem, int(a), int(ln), int(d)) for a, ln, d in body["descs"]]
            except (ValueError, TypeError, KeyError) as e:
                raise nixlMismatchError(f"malformed partial metadata: {e}") from e
            metadata = md
        with self._md_lock:
            try:
                name = self.kvxfer.add_remote_agent(metadata)
            except KvxferError as e:
                raise nixl_error(e) from e
            if announced is None:
                self._announced.pop(name, None)
            else:
                self._announced.setdefault(name, set()).update(announced)
        self._used = True
        return name.encode()

    def invalidateRemoteMD(self, name):  # noqa: N802
        """Forgets a peer (its transfers in flight fail); an unknown name is
        not an error."""
        with self._md_lock:
            self._announced.pop(_name(name), None)
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

    # -- the metadata exchange (NIXL's listener thread) ---------------------

    def getLocalPartialMD(self, descs, inc_conn_info=False, backends=()):  # noqa: N802
        """Metadata that announces `descs` alone: a peer that loads it may
        name only those (and those of earlier announcements) in transfers.
        kvxfer's agent description goes with it whole (it is how the peer
        connects); the restriction is this front's."""
        if not any(p in self._backends for p in _NET_PLUGINS):
            raise nixlInvalidParamError("getLocalPartialMD: no backends support remote operations")
        mem = int(descs.getType())
        body = json.dumps({"mem": mem, "conn": bool(inc_conn_info),
                           "descs": [list(d) for d in descs.triples()]}).encode()
        md = self.kvxfer.metadata()
        return _PARTIAL + len(md).to_bytes(4, "big") + md + body

    def _exchange(self, ip, port, op, payload):
        if not ip:
            raise nixlInvalidParamError(
                "no peer address provided and no centralized store configured (set NIXL_ETCD_ENDPOINTS)"
            )
        try:
            return _listen.exchange(ip, int(port), op, payload, _EXCHANGE_TIMEOUT)
        except _listen.ExchangeError as e:
            raise nixlBackendError(str(e)) from e

    def sendLocalMD(self, ip_addr="", port=DEFAULT_COMM_PORT):  # noqa: N802
        """Sends this agent's metadata to the listener at `ip_addr:port`,
        which loads it; returns once it has (or raises). Without an address,
        with NIXL_ETCD_ENDPOINTS: stored in etcd (queued, as NIXL does)."""
        if not ip_addr and self._etcd is not None:
            self._etcd.send(self.getLocalMD())
            return NIXL_SUCCESS
        self._exchange(ip_addr, port, _listen.SEND, self.getLocalMD())
        return NIXL_SUCCESS

    def sendLocalPartialMD(self, descs, inc_conn_info=False, backends=(),  # noqa: N802
                           ip_addr="", port=DEFAULT_COMM_PORT, label=""):
        """Sends `getLocalPartialMD(descs, ...)` to the listener at
        `ip_addr:port`; without an address, with NIXL_ETCD_ENDPOINTS, to
        etcd under `label` (NIXL's entry name; "metadata" when empty)."""
        md = self.getLocalPartialMD(descs, inc_conn_info, backends)
        if not ip_addr and self._etcd is not None:
            self._etcd.send(md, (_name(label) if label else ""))
            return NIXL_SUCCESS
        self._exchange(ip_addr, port, _listen.SEND, md)
        return NIXL_SUCCESS

    def fetchRemoteMD(self, remote_name, ip_addr="", port=DEFAULT_COMM_PORT, label=""):  # noqa: N802
        """Fetches the metadata of the agent listening at `ip_addr:port`
        and loads it; it must be `remote_name`'s. Without an address, with
        NIXL_ETCD_ENDPOINTS: from etcd (entry `label`, "metadata" when
        empty), waiting for it up to the watch timeout, in the background
        as NIXL does (`checkRemoteMD` sees it loaded)."""
        if not ip_addr and self._etcd is not None:
            self._etcd.fetch(_name(remote_name), (_name(label) if label else ""))
            return NIXL_SUCCESS
        md = self._exchange(ip_addr, port, _listen.FETCH, _bytes(label))
        name = self.loadRemoteMD(md).decode()
        if name != _name(remote_name):
            self.invalidateRemoteMD(name)
            raise nixlMismatchError(f"{ip_addr}:{port} is agent {name!r}, not {_name(remote_name)!r}")
        return NIXL_SUCCESS

    def invalidateLocalMD(self, ip_addr="", port=DEFAULT_COMM_PORT):  # noqa: N802
        """Tells the listener at `ip_addr:port` to forget this agent. As
        NIXL (which queues it and returns), it never fails: a listener that
        is gone (connection refused, not tried again) holds nothing of this
        agent; another failure is logged, and the peer's later transfers to
        this agent fail typed on its stale metadata."""
        if not ip_addr and self._etcd is not None:
            self._etcd.invalidate()
            return NIXL_SUCCESS
        if not ip_addr:
            self._exchange(ip_addr, port, _listen.INVALIDATE, self.name.encode())
        try:
            _listen.exchange(ip_addr, int(port), _listen.INVALIDATE, self.name.encode(),
                             _EXCHANGE_TIMEOUT, retry=False)
        except _listen.ExchangeError as e:
            if isinstance(e.__cause__, ConnectionRefusedError):
                _log.debug("invalidate_local_metadata: nothing listens at %s:%s", ip_addr, port)
            else:
                _log.warning("invalidate_local_metadata at %s:%s failed: %s", ip_addr, port, e)
        return NIXL_SUCCESS

    def checkRemoteMD(self, remote_name, descs):  # noqa: N802
        """NIXL_SUCCESS when `remote_name` is loaded and every descriptor of
        `descs` is exported there (and announced, for partial metadata);
        NIXL_ERR_NOT_FOUND otherwise."""
        name = _name(remote_name)
        try:
            with self._md_lock:
                self.kvxfer.remote_transport(name)
                if descs is not None and descs.descCount():
                    self.kvxfer.check_descs(descs.native(), name)
                    self._check_announced(name, descs)
        except (KvxferError, nixlNotFoundError):
            return NIXL_ERR_NOT_FOUND
        return NIXL_SUCCESS

    def _check_announced(self, name, descs):
        with self._md_lock:
            ranges = self._announced.get(name)
            ranges = None if ranges is None else tuple(ranges)
        if ranges is None:
            return
        mem = int(descs.getType())
        for a, n, d in descs.triples():
            if not any(m == mem and dv == d and ra <= a and a + n <= ra + rn for m, ra, rn, dv in ranges):
                raise nixlNotFoundError(
                    f"agent {name!r} has not announced ({a:#x}, {n}, {d}) in its partial metadata"
                )

    def _on_exchange(self, op, payload):
        """An exchange the listener took: the answer's payload."""
        if op == _listen.SEND:
            self.loadRemoteMD(payload)
            return b""
        if op == _listen.FETCH:
            return self.getLocalMD()
        if op == _listen.INVALIDATE:
            self.invalidateRemoteMD(payload.decode(errors="replace"))
            return b""
        raise nixlInvalidParamError(f"unknown operation {op!r}")

    # -- transfers ---------------------------------------------------------

    def _check(self, dlist, remote=None):
        self._check_native(dlist.native(), remote)

    def _check_native(self, native, remote=None):
        try:
            self.kvxfer.check_descs(native, remote)
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
            # NIXL's loopback: this agent's storage.
            if descs.getType() not in _STORAGE_MEMS:
                raise nixlNotSupportedError(
                    "loopback transfers of memory (an agent to itself): not offered by kvxfer; "
                    "storage (FILE, OBJ) is"
                )
            native = self._native_storage(descs)
            self._check_native(native)
            return _Prepped(name, descs, native)
        else:
            self._remote(name)
            self._check(descs, name)
            self._check_announced(name, descs)
        return _Prepped(name, descs)

    def releasedDlistH(self, handle):  # noqa: N802
        """Releases a prepared list."""
        handle.dlist = handle.native = None
        return NIXL_SUCCESS

    def _make(self, op, local, li, remote, ri, remote_name, notif, merge, plugin=None):
        try:
            req = self.kvxfer.make_request(
                op, local, li, remote, ri, remote_name, _bytes(notif) or None, merge
            )
        except (ValueError, IndexError) as e:
            raise nixlInvalidParamError(str(e)) from e
        except KvxferError as e:
            raise nixl_error(e) from e
        x = _XferReq(req, plugin, op == "WRITE")
        self._reqs.add(x)
        return x

    def makeXferReq(self, op, local, local_indices, remote, remote_indices, notif=b"",  # noqa: N802
                    backends=(), skip_desc_merge=False):
        """A request of the selected descriptors (ids as lists or numpy int
        arrays, any order) of two prepared lists; pairs adjacent on both
        sides merge unless `skip_desc_merge`."""
        # The hot call of a serving loop: kept to a few steps, as it runs
        # with caches cold from the previous transfer.
        if local.agent_name != NIXL_INIT_AGENT:
            raise nixlInvalidParamError("the local side must be prepared with NIXL_INIT_AGENT")
        plugin = None
        if remote.agent_name == self.name:
            plugin = self._storage_plugin(remote.dlist.getType())
        return self._make(_OPS[op], local.native, local_indices, remote.native, remote_indices,
                          remote.agent_name, notif, not skip_desc_merge, plugin)

    def createXferReq(self, op, local, remote, remote_agent, notif=b"", backends=()):  # noqa: N802
        """A request of every descriptor of two lists, pair by pair (never
        merged); memory not registered on either side raises
        `nixlNotFoundError` here."""
        for d in (local, remote):
            if not isinstance(d, nixlXferDList):
                raise TypeError("createXferReq takes nixlXferDList descriptor lists")
        name = _name(remote_agent)
        if name == self.name:
            return self._create_storage_req(op, local, remote, notif)
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
        self._check_announced(name, remote)
        return req

    def _create_storage_req(self, op, local, remote, notif):
        """NIXL's loopback: between this agent's memory and its storage."""
        mem = remote.getType()
        if mem not in _STORAGE_MEMS:
            raise nixlNotSupportedError(
                "loopback transfers of memory (an agent to itself): not offered by kvxfer; "
                "storage (FILE, OBJ) is"
            )
        self._need_backend("createXferReq", mem)
        n, m = local.descCount(), remote.descCount()
        if n != m:
            raise nixlInvalidParamError(f"{n} local descriptors for {m} remote ones")
        native = self._native_storage(remote)
        ids = list(range(n))
        req = self._make(_OPS[op], local.native(), ids, native, ids, self.name, notif, False,
                         self._storage_plugin(mem))
        self._check(local)
        self._check_native(native)
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
            if self._tfile is not None:
                self._tfile.error(NIXL_ERR_BACKEND)
        req.t0 = t0
        req.post = -(-(time.perf_counter_ns() - t0) // 1000)
        return self._status(req, 0.0)

    def _status(self, req, max_wait):
        if req.failed or req.xfer is None:
            return NIXL_ERR_BACKEND
        s = req.xfer.check(max_wait) if max_wait else req.xfer.state
        if s != "PROC" and req.end is None:
            req.end = time.perf_counter_ns()
            if self._tfile is not None:
                if s == "DONE":
                    xfer = max(req.post, -(-(req.end - req.t0) // 1000))
                    self._tfile.transfer(req.write, req.request.total_bytes, req.post, xfer)
                else:
                    self._tfile.error(NIXL_ERR_BACKEND)
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
        return self._backend_handle(req.plugin)

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
