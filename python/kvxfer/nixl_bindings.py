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
import os

from . import Agent, KvxferError, _kvxfer

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


globals().update(nixl_status_t.__members__)


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
_PLUGIN_MEMS = ["DRAM_SEG", "VRAM_SEG"]


def _telemetry_enabled(config):
    """NIXL_TELEMETRY_ENABLE, when set, decides; otherwise the config."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if env is not None:
        return env.strip().lower() in ("y", "yes", "1", "true", "on")
    return bool(config.captureTelemetry)


class nixlAgent:
    """The agent object NIXL's `_api` holds as `nixl_agent.agent`: a kvxfer
    agent and its plugin bookkeeping."""

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

    def getAvailPlugins(self):  # noqa: N802
        """The plugins kvxfer offers."""
        return [_PLUGIN]

    def getPluginParams(self, plugin):  # noqa: N802
        """`(options, memory types)` of a plugin."""
        if plugin != _PLUGIN:
            raise nixlNotFoundError(f"plugin {plugin!r} not found (kvxfer offers {_PLUGIN!r})")
        return {"kvxfer_transport": self.transport}, list(_PLUGIN_MEMS)

    def createBackend(self, plugin, params):  # noqa: N802
        """Instantiates a plugin; returns its handle."""
        if plugin != _PLUGIN:
            raise nixlNotFoundError(f"plugin {plugin!r} not found (kvxfer offers {_PLUGIN!r})")
        if plugin in self._backends:
            raise nixlInvalidParamError(f"backend already created for type {plugin!r}")
        handle = id(self) ^ 0x5543_5800
        self._backends[plugin] = (handle, dict(params or {}))
        return handle

    def getBackendParams(self, handle):  # noqa: N802
        """`(options, memory types)` of an instantiated backend."""
        for plugin, (h, params) in self._backends.items():
            if h == handle:
                opts = {"kvxfer_transport": self.transport}
                opts.update({k: str(v) for k, v in params.items()})
                return opts, list(_PLUGIN_MEMS)
        raise nixlNotFoundError(f"no backend with handle {handle}")

    def has_backend(self):
        """Whether a backend was instantiated (without one nothing moves)."""
        return bool(self._backends)
