"""NIXL's Python API (`nixl._api`) over kvxfer.

    import kvxfer.nixl as nixl_api      # or, with the shim, `import nixl._api`
    agent = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=["UCX"]))

NIXL's names, signatures, return values (`"DONE"` / `"PROC"` / `"ERR"`),
validation and exception classes (`kvxfer.nixl_bindings`, which is
`nixl._bindings` under the shim): descriptor lists from tuples, Nx3 arrays
or tensors (`None` and a logged error for a shape NIXL refuses),
registration, `prep_xfer_dlist` / `make_prepped_xfer` (descriptors adjacent
on both sides merge unless `skip_desc_merge`) / `initialize_xfer`,
`transfer` / `check_xfer_state` / `release_xfer_handle`, telemetry (switched
by `NIXL_TELEMETRY_ENABLE` when set, else `capture_telemetry`),
notifications, metadata bytes, `create_backend` and the plugin queries.

The plugins: `"UCX"` is kvxfer's transport selection (shared memory on
one host, RDMA where both sides have a device, TCP otherwise;
`KVXFER_NIXL_BACKEND` picks one); `"LIBFABRIC"` is kvxfer's libfabric
transport (EFA and the other fabrics libfabric drives; provider in
`KVXFER_FABRIC_PROVIDER`), for the agent's transfers when it is among the
configured backends; `"POSIX"`, `"GDS"` and `"GDS_MT"` are kvxfer's file
storage (FILE descriptors as NIXL gives them, the file descriptor as the
device and offsets as addresses; GPU memory staged through host memory),
`"OBJ"` its object storage (S3; NIXL's parameters `bucket`,
`endpoint_override`, `scheme`, `region`, `access_key`, `secret_key`,
`session_token`, `use_virtual_addressing`, else the AWS environment; the
key is the descriptor's meta, else its device id). Storage transfers are
posted to the agent itself, as in NIXL. `query_xfer_transport` says which
transport carried a transfer (`storage` for these).

Where kvxfer is stricter than NIXL:
- a transfer whose peer died ends in `"ERR"` within the agent's I/O
  timeout (30 s) instead of staying `"PROC"` forever;
- `release_xfer_handle` of a transfer in flight aborts it and returns only
  once nothing of it can touch either side's memory;
- a notification is delivered only after all data of its transfer landed;
- serialized descriptor lists are a plain, checked format, not pickle;
- memory deregistered under a finished transfer handle (which NIXL allows)
  is no longer reached by that handle: its next post fails.

The metadata exchange through NIXL's listener thread
(`enable_listen_thread`: `send_local_metadata`, `fetch_remote_metadata`,
partial metadata, `check_remote_metadata`, `invalidate_local_metadata`)
is `kvxfer.nixl_listen`; a send or fetch returns once the peer has loaded
or handed over the metadata (NIXL queues it and returns at once). The
same calls without a peer address, with `NIXL_ETCD_ENDPOINTS` set, go
through etcd with NIXL's keys and are queued as NIXL queues them
(`kvxfer.nixl_etcd`); without either they are refused
(`nixlInvalidParamError`).

Not offered (each raises `nixlNotSupportedError`): loopback transfers of
memory (an agent to itself; storage is), GPU memory views
(`prep_mem_view`), cost estimates.
"""

import enum
import json
import logging

from . import nixl_bindings as _b
# NIXL's `_api` imports its bindings as `nixlBind`, and frameworks take
# them from there (SGLang's HiCacheNixl: `from nixl._api import nixlBind`).
from . import nixl_bindings as nixlBind  # noqa: F401,N812
from .nixl_bindings import (  # noqa: F401  (NIXL_INIT_AGENT, nixlNoTelemetryError: kept for callers)
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    nixlNoTelemetryError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDList,
    nixlXferDList,
)

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]

logger = logging.getLogger("kvxfer.nixl")

nixl_backend_handle = int

_MEMS = {
    "DRAM": _b.DRAM_SEG,
    "VRAM": _b.VRAM_SEG,
    "FILE": _b.FILE_SEG,
    "BLOCK": _b.BLK_SEG,
    "OBJ": _b.OBJ_SEG,
    "cpu": _b.DRAM_SEG,
    "cuda": _b.VRAM_SEG,
}
_OPS = {"WRITE": _b.NIXL_WRITE, "READ": _b.NIXL_READ}
_STATES = {_b.NIXL_SUCCESS: "DONE", _b.NIXL_IN_PROG: "PROC"}


class nixl_thread_sync_t(enum.Enum):
    """Thread synchronisation modes; `.value` is the bindings' enum."""

    NIXL_THREAD_SYNC_NONE = _b.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = _b.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = _b.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = _b.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:
    """NIXL's agent configuration (the same fields and defaults)."""

    def __init__(
        self,
        enable_prog_thread=True,
        enable_listen_thread=False,
        listen_port=DEFAULT_COMM_PORT,
        capture_telemetry=False,
        num_threads=0,
        backends=["UCX"],  # noqa: B006  (NIXL's default, never mutated)
        sync_mode=None,
    ):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})"
            )
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


def _is_tensor(obj):
    return hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous")


class nixl_prepped_dlist_handle:
    """A descriptor list prepared for one side of later transfers."""

    def __init__(self, agent, value):
        self.agent = agent
        self._handle = value

    @property
    def agent_name(self):
        """The side it was prepared for (`NIXL_INIT_AGENT` or a peer)."""
        return self._handle.agent_name

    def release(self):
        """Lets the list go."""
        if self._handle is not None and self._handle.dlist is not None:
            self.agent.releasedDlistH(self._handle)

    def __repr__(self):
        return f"nixl_prepped_dlist_handle({self.agent_name!r})"


class nixl_xfer_handle:
    """A transfer request: made once (descriptors selected and merged in
    Rust), posted by `transfer` (again once it ended), checked by
    `check_xfer_state`."""

    __slots__ = ("agent", "_handle", "__weakref__")

    def __init__(self, agent, value):
        self.agent = agent
        self._handle = value

    def release(self):
        """Releases the request; one in flight is aborted first, and this
        returns once nothing of it can touch either side's memory."""
        self.agent.releaseXferReq(self._handle)

    def __repr__(self):
        return f"nixl_xfer_handle({self._handle.request!r})"


class nixl_agent:
    """NIXL's agent, over a kvxfer agent."""

    def __init__(self, agent_name, nixl_conf=None, instantiate_all=False):
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        default_sync = (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            if nixl_conf.enable_listen
            else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        config = _b.nixlAgentConfig()
        config.useProgThread = nixl_conf.enable_pthread
        config.useListenThread = nixl_conf.enable_listen
        config.listenPort = nixl_conf.port
        config.syncMode = (nixl_conf.sync_mode or default_sync).value
        config.captureTelemetry = nixl_conf.capture_telemetry
        # Looked up at each call, as NIXL's `_api` does.
        self.agent = _b.nixlAgent(agent_name, config)
        self.name = agent_name
        self.notifs = {}
        self.backends = {}
        self.backend_mems = {}
        self.backend_options = {}
        self.plugin_list = self.agent.getAvailPlugins()
        self.plugin_b_options = {}
        self.plugin_mem_types = {}
        self.nixl_mems = dict(_MEMS)
        self.nixl_ops = dict(_OPS)
        backends = self.plugin_list if instantiate_all else nixl_conf.backends
        for b in backends:
            if b not in self.plugin_list:
                logger.warning("Skipping backend registration %s due to the missing plugin.", b)
                continue
            init = {}
            if nixl_conf.num_threads > 0:
                init["num_threads"] = str(nixl_conf.num_threads)
            self.create_backend(b, init)
        logger.info("Initialized NIXL agent: %s", agent_name)

    # -- plugins and backends --------------------------------------------

    def get_plugin_list(self):
        """The plugins kvxfer offers (`["UCX", "LIBFABRIC", "POSIX", "GDS",
        "GDS_MT", "OBJ"]`)."""
        return self.plugin_list

    def _load_plugin_params(self, plugin):
        if plugin not in self.plugin_list:
            return
        opts, mems = self.agent.getPluginParams(plugin)
        self.plugin_b_options[plugin] = opts
        self.plugin_mem_types[plugin] = mems

    def get_plugin_mem_types(self, backend):
        """A plugin's memory types; `[]` for an unknown plugin."""
        if backend not in self.plugin_mem_types:
            self._load_plugin_params(backend)
        if backend not in self.plugin_mem_types:
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend):
        """A plugin's options and defaults; `{}` for an unknown plugin."""
        if backend not in self.plugin_b_options:
            self._load_plugin_params(backend)
        if backend not in self.plugin_b_options:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend):
        """An instantiated backend's memory types; `[]` if not instantiated."""
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend):
        """An instantiated backend's options; `{}` if not instantiated."""
        if backend in self.backend_options:
            return self.backend_options[backend]
        logger.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend, initParams={}):  # noqa: B006,N803
        """Instantiates a plugin (`nixlNotFoundError` for one kvxfer does
        not offer)."""
        self.backends[backend] = self.agent.createBackend(backend, initParams)
        opts, mems = self.agent.getBackendParams(self.backends[backend])
        self.backend_mems[backend] = mems
        self.backend_options[backend] = opts
        logger.info("Backend %s was instantiated", backend)

    def _handles(self, backends):
        return [self.backends[b] for b in backends]

    def _tensor_list(self, cls, descs, width):
        tensors = [descs] if _is_tensor(descs) else list(descs)
        dev = tensors[0].device
        rows = []
        for t in tensors:
            if t.device != dev:
                logger.error("Please use a list of tensors of the same device type")
                return None
            if not t.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            gpu = t.get_device()
            row = (int(t.data_ptr()), int(t.numel() * t.element_size()), 0 if gpu == -1 else gpu)
            rows.append(row + ((b"",) if width == 4 else ()))
        mem = _b.DRAM_SEG if tensors[0].get_device() == -1 else _b.VRAM_SEG
        return cls(mem, rows)

    def _dlist(self, cls, other, width, descs, mem_type):
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, other):
            logger.error(
                "%s type detected, please use %s", type(descs).__name__, cls.__name__
            )
            return None
        if hasattr(descs, "__array_interface__"):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            mem = self.nixl_mems[mem_type]
            if len(descs.shape) != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for descriptor list from numpy array")
                return None
            return cls(mem, descs)
        if _is_tensor(descs) or (isinstance(descs, (list, tuple)) and descs and _is_tensor(descs[0])):
            return self._tensor_list(cls, descs, width)
        if isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            mem = self.nixl_mems[mem_type]
            if len(descs[0]) != width:
                logger.error("%d-tuple list needed", width)
                return None
            try:
                return cls(mem, descs)
            except TypeError as e:
                logger.error("%s", e)
                return None
        logger.error("Unsupported descriptor list type %s", type(descs).__name__)
        return None

    def get_xfer_descs(self, descs, mem_type=None):
        """A `nixlXferDList` from `(address, length, device)` tuples (with
        `mem_type`), an Nx3 array (with `mem_type`), contiguous tensors, or
        a `nixlXferDList`; `None` (and a logged error) otherwise."""
        return self._dlist(nixlXferDList, nixlRegDList, 3, descs, mem_type)

    def get_reg_descs(self, descs, mem_type=None):
        """A `nixlRegDList` from `(address, length, device, meta)` tuples
        (with `mem_type`), an Nx3 array (with `mem_type`), contiguous
        tensors, or a `nixlRegDList`; `None` (and a logged error) otherwise."""
        return self._dlist(nixlRegDList, nixlXferDList, 4, descs, mem_type)

    def get_remote_descs(self, descs, mem_type=None):
        """A `nixlRemoteDList` from `(address, length, device, agent)`
        tuples (only memory views take one; kvxfer has none)."""
        if isinstance(descs, nixlRemoteDList):
            return descs
        if mem_type is None:
            logger.error("Please specify a mem type")
            return None
        return nixlRemoteDList(self.nixl_mems[mem_type], descs)

    def register_memory(self, reg_list, mem_type=None, backends=[]):  # noqa: B006
        """Registers the regions; returns their `nixlRegDList` (for
        `deregister_memory`). A region registered again is counted, not
        registered twice."""
        descs = self.get_reg_descs(reg_list, mem_type)
        self.agent.registerMem(descs, self._handles(backends))
        return descs

    def deregister_memory(self, dereg_list, backends=[]):  # noqa: B006
        """Deregisters regions `register_memory` registered, also while a
        finished transfer handle still names them (its next post fails);
        refused while a transfer of them is in flight."""
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(self, reg_list, backend, mem_type=None):
        """For each descriptor's meta (a path, an object key), what the
        storage backend holds: a file's `{"size", "mode", "mtime"}`, `{}`
        for an object that exists, `None` where there is none."""
        descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(
                f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}"
            )
        return self.agent.queryMem(descs, self.backends[backend])

    def get_serialized_descs(self, descs):
        """A descriptor list as bytes (a checked format, not pickle)."""
        reg = isinstance(descs, nixlRegDList)
        rows = [list(d[:3]) + ([d[3].decode("latin-1")] if reg else []) for d in
                (descs[i] for i in range(descs.descCount()))]
        body = {"mem": int(descs.getType()), "reg": reg, "descs": rows}
        return b"KVXD1" + json.dumps(body, separators=(",", ":")).encode()

    def deserialize_descs(self, serialized_descs):
        """The descriptor list `get_serialized_descs` made."""
        b = bytes(serialized_descs)
        if not b.startswith(b"KVXD1"):
            raise _b.nixlInvalidParamError("not a serialized kvxfer descriptor list")
        try:
            body = json.loads(b[5:])
            mem = _b.nixl_mem_t(int(body["mem"]))
            if body["reg"]:
                return nixlRegDList(mem, [(int(a), int(n), int(d), m.encode("latin-1"))
                                          for a, n, d, m in body["descs"]])
            return nixlXferDList(mem, [(int(a), int(n), int(d)) for a, n, d in body["descs"]])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise _b.nixlInvalidParamError(f"malformed descriptor list: {e}") from e

    # -- agents -----------------------------------------------------------

    def get_agent_metadata(self):
        """This agent's metadata, for a peer's `add_remote_agent`."""
        return self.agent.getLocalMD()

    def add_remote_agent(self, metadata):
        """Loads a peer from its metadata; returns its name as bytes."""
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent):
        """Forgets a peer (its transfers in flight fail); an unknown name
        is not an error."""
        self.agent.invalidateRemoteMD(agent)

    def make_connection(self, remote_agent, backends=[]):  # noqa: B006
        """Connects ahead of the first transfer (kvxfer connects when the
        peer is added; this checks the peer is known)."""
        self.agent.makeConnection(remote_agent, self._handles(backends))

    def get_partial_agent_metadata(self, descs, inc_conn_info=False, backends=[]):  # noqa: B006
        """Metadata announcing `descs` alone (a peer that loads it may name
        only those in transfers)."""
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def send_local_metadata(self, ip_addr="", port=DEFAULT_COMM_PORT):
        """Sends this agent's metadata to the listener of the agent at
        `ip_addr:port` (its `enable_listen_thread`), which loads it; returns
        once it has. Without an address: to etcd (`NIXL_ETCD_ENDPOINTS`),
        queued as NIXL does; `nixlInvalidParamError` without etcd."""
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(self, descs, inc_conn_info=False, backends=[],  # noqa: B006
                                    ip_addr="", port=DEFAULT_COMM_PORT, label=""):
        """Sends partial metadata (`get_partial_agent_metadata`) to the
        listener at `ip_addr:port`."""
        self.agent.sendLocalPartialMD(descs, inc_conn_info, self._handles(backends), ip_addr, port, label)

    def fetch_remote_metadata(self, remote_agent, ip_addr="", port=DEFAULT_COMM_PORT, label=""):
        """Fetches the metadata of `remote_agent` from its listener at
        `ip_addr:port` and loads it (retrying while the listener is not up
        yet, `KVXFER_NIXL_EXCHANGE_TIMEOUT` seconds, 30 by default).
        Without an address: from etcd (`NIXL_ETCD_ENDPOINTS`, entry
        `label`), waiting for it up to the watch timeout, in the
        background as NIXL does (`check_remote_metadata` sees it)."""
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr="", port=DEFAULT_COMM_PORT):
        """Tells the agent listening at `ip_addr:port` to forget this one
        (as NIXL, it does not fail: one gone holds nothing of this agent)."""
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent, descs=None):
        """Whether `agent` is loaded and, when `descs` is given, each of
        them is exported there (and announced, for partial metadata)."""
        if descs is None:
            descs = nixlXferDList(_b.DRAM_SEG)
        return self.agent.checkRemoteMD(agent, descs) == _b.NIXL_SUCCESS

    # -- transfers --------------------------------------------------------

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=[]):  # noqa: B006
        """Prepares one side of later transfers: `"NIXL_INIT_AGENT"` (or
        `""`) for the local side, the peer's name for the remote side.
        Memory not registered there raises `nixlNotFoundError`."""
        if hasattr(xfer_list, "shape") and len(xfer_list.shape) == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            raise nixlNotSupportedError("strided (Nx5) descriptor lists: not offered by kvxfer")
        handles = self._handles(backends)
        descs = self.get_xfer_descs(xfer_list, mem_type)
        return nixl_prepped_dlist_handle(self.agent, self.agent.prepXferDlist(agent_name, descs, handles))

    def make_prepped_xfer(
        self,
        operation,
        local_xfer_side,
        local_indices,
        remote_xfer_side,
        remote_indices,
        notif_msg=b"",
        backends=[],  # noqa: B006
        skip_desc_merge=False,
    ):
        """A transfer of the selected descriptors (ids as lists or numpy int
        arrays, any order) of two prepared lists; pairs adjacent on both
        sides merge unless `skip_desc_merge`."""
        op = self.nixl_ops[operation]
        return nixl_xfer_handle(self.agent, self.agent.makeXferReq(
            op, local_xfer_side._handle, local_indices, remote_xfer_side._handle, remote_indices,
            notif_msg, self._handles(backends) if backends else (), skip_desc_merge,
        ))

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"", backends=[]):  # noqa: B006,E501
        """A transfer of every descriptor of two lists, pair by pair (not
        merged, as NIXL's combined call does not merge). Memory not
        registered on either side raises `nixlNotFoundError` here."""
        op = self.nixl_ops[operation]
        return nixl_xfer_handle(self.agent, self.agent.createXferReq(
            op, local_descs, remote_descs, remote_agent, notif_msg, self._handles(backends),
        ))

    def estimate_xfer_cost(self, req_handle):
        """Not offered by kvxfer."""
        return self.agent.estimateXferCost(req_handle._handle)

    def transfer(self, handle, notif_msg=b""):
        """Posts the transfer: `"DONE"` when it completed inline, `"PROC"`
        while in flight, `"ERR"` when it could not start (or is still in
        flight from an earlier post)."""
        return _STATES.get(self.agent.postXferReq(handle._handle, notif_msg), "ERR")

    def check_xfer_state(self, handle):
        """`"DONE"`, `"PROC"` or `"ERR"`. Waits up to 20 µs (the GIL
        released) for a transfer in flight to end, so that a caller polling
        in a loop leaves the CPU to the threads moving its data."""
        return _STATES.get(self.agent.getXferStatus(handle._handle), "ERR")

    def get_xfer_telemetry(self, handle):
        """The last post's `nixlXferTelemetry` (see
        `nixlAgent.getXferTelemetry`); `nixlNoTelemetryError` unless
        telemetry is on."""
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle):
        """The backend (plugin) that carried the transfer: `"UCX"`, or
        `"LIBFABRIC"` when it was created."""
        b = self.agent.queryXferBackend(handle._handle)
        return next((name for name, h in self.backends.items() if h == b), "")

    def query_xfer_transport(self, handle):
        """kvxfer's transport that carried it: `tcp`, `shm`, `rdma`, `fabric`."""
        return self.agent.query_transport(handle._handle)

    def release_xfer_handle(self, handle):
        """Releases a transfer; one in flight is aborted first."""
        handle.release()

    def release_dlist_handle(self, handle):
        """Releases a prepared list."""
        handle.release()

    def prep_mem_view(self, *args, **kwargs):
        """GPU memory views: not offered by kvxfer."""
        return self.agent.prepMemView(*args)

    def release_mem_view(self, mvh):
        """GPU memory views: not offered by kvxfer."""
        return self.agent.releaseMemView(mvh)

    # -- notifications ----------------------------------------------------

    def get_new_notifs(self, backends=[]):  # noqa: B006
        """`{peer name: [bytes, ...]}` that arrived since the last call."""
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends=[]):  # noqa: B006
        """Adds the new notifications to `self.notifs` and returns it."""
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name, lookup_tag, backends=[], tag_is_prefix=True):  # noqa: B006,E501
        """Whether a notification from the peer starts with (or, with
        `tag_is_prefix=False`, contains) `lookup_tag`; the one found is
        removed (an empty message is matched and kept, as in NIXL)."""
        self.update_notifs(backends)
        msgs = self.notifs.get(remote_agent_name, [])
        for i, m in enumerate(msgs):
            if (tag_is_prefix and m.startswith(lookup_tag)) or (
                not tag_is_prefix and lookup_tag in m
            ):
                if m:
                    del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        """Sends a notification alone (no data)."""
        if backend is None:
            self.agent.genNotif(remote_agent_name, notif_msg)
        else:
            self.agent.genNotif(remote_agent_name, notif_msg, self.backends[backend])
