"""A NIXL-compatible front end over kvxfer.

    import kvxfer.nixl as nixl_api      # instead of `import nixl._api as nixl_api`
    agent = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=["UCX"]))

The `nixl_agent` calls vLLM's NixlConnector and LMCache's NIXL channel make,
with NIXL's argument shapes, return values (`"DONE"` / `"PROC"` / `"ERR"`),
handle semantics and notification shapes: registration through
`get_reg_descs` + `register_memory`, descriptor lists prepared once
(`prep_xfer_dlist`) and transfers made from them by index
(`make_prepped_xfer`, ids as lists or numpy int arrays), `transfer` /
`check_xfer_state` / `release_xfer_handle`, `get_xfer_telemetry`,
`get_new_notifs` / `send_notif`, metadata bytes in and out.

Where kvxfer is stricter than NIXL:
- a transfer whose peer died ends in `"ERR"` within the agent's I/O
  timeout (30 s) instead of staying `"PROC"` forever;
- `release_xfer_handle` of a transfer in flight aborts it and returns only
  once nothing of it can touch either side's memory (raising if that takes
  longer than the I/O timeout);
- a notification is delivered only after all data of its transfer landed
  (NIXL promises the same on its UCX path);
- serialized descriptor lists are a plain, checked format, not pickle.
- `backends` arguments are accepted and ignored: kvxfer chooses shared
  memory on one host, RDMA where both sides have a device, TCP otherwise,
  and every status says which (`query_xfer_backend`).
- loopback transfers (an agent to itself) are not supported.
"""

import json
import os
import time

from . import Agent, KvxferError, _kvxfer

NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
# How long check_xfer_state waits for a transfer in flight (seconds).
_CHECK_WAIT = 20e-6


class nixlNoTelemetryError(KvxferError):
    """Telemetry asked of an agent made without `capture_telemetry`."""

DEFAULT_COMM_PORT = 8888

_MEM = {"DRAM": "dram", "VRAM": "vram", "BLK": "blk", "OBJ": "obj", "FILE": "file"}


def _mem(mem_type):
    if mem_type is None:
        return "DRAM"
    m = str(mem_type).upper()
    if m == "CPU":
        m = "DRAM"
    if m == "CUDA" or m == "GPU":
        m = "VRAM"
    if m not in _MEM:
        raise KeyError(f"unknown memory type {mem_type!r}")
    return m


def _name(agent):
    return agent.decode() if isinstance(agent, (bytes, bytearray)) else str(agent)


class nixl_agent_config:
    """NIXL's agent configuration. Every field is kept; kvxfer uses none of
    them (its agent has no progress-thread or listen-thread options)."""

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
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.backends = list(backends)
        self.sync_mode = sync_mode


class DescList:
    """A descriptor list (NIXL's `nixlRegDList` / `nixlXferDList`): a
    memory type and `(address, length, device)` descriptors, kept in Rust
    (`kvxfer._kvxfer.DescList`) so that transfers select from it by index
    without a Python object per descriptor."""

    def __init__(self, mem_type, descs, reg=False):
        self.mem_type = _mem(mem_type)
        self.reg = reg
        self.native = descs if isinstance(descs, _kvxfer.DescList) else _kvxfer.DescList(
            descs, _MEM[self.mem_type]
        )

    @property
    def descs(self):
        """The descriptors as `(address, length, device)` tuples."""
        return [self.native[i] for i in range(len(self.native))]

    def __len__(self):
        return len(self.native)

    def __getitem__(self, i):
        return self.native[i]

    def __iter__(self):
        return iter(self.descs)

    def __repr__(self):
        return f"DescList({self.mem_type}, {len(self)} descriptors)"


def _tensor_desc(t):
    dev = t.device
    mem = "VRAM" if getattr(dev, "type", "cpu") == "cuda" else "DRAM"
    return mem, (int(t.data_ptr()), int(t.numel() * t.element_size()), int(dev.index or 0))


def _triples(descs, mem_type):
    """(memory type, [(address, length, device)]) of any form NIXL takes:
    a DescList, a list of tuples, an Nx3 numpy array, tensors."""
    if isinstance(descs, DescList):
        return descs.mem_type, descs.native
    if hasattr(descs, "__array_interface__"):  # numpy N x 3, read in Rust
        return _mem(mem_type), _kvxfer.DescList(descs, _MEM[_mem(mem_type)])
    if hasattr(descs, "data_ptr"):  # one tensor
        mem, d = _tensor_desc(descs)
        return mem, [d]
    descs = list(descs)
    if descs and hasattr(descs[0], "data_ptr"):
        out = [_tensor_desc(t) for t in descs]
        return out[0][0], [d for _, d in out]
    out = []
    for d in descs:
        if len(d) < 3:
            raise ValueError(f"descriptor {d!r}: (address, length, device[, meta])")
        out.append((int(d[0]), int(d[1]), int(d[2])))
    return _mem(mem_type), out


class nixl_prepped_dlist_handle:
    """A descriptor list prepared for one side of later transfers."""

    def __init__(self, agent_name, dlist):
        self.agent_name = agent_name
        self.dlist = dlist

    def release(self):
        self.dlist = None


class _Telemetry:
    """NIXL's `nixlXferTelemetry`: times in microseconds."""

    def __init__(self, start, post, xfer, total, count):
        self.startTime = start
        self.postDuration = post
        self.xferDuration = xfer
        self.totalBytes = total
        self.descCount = count

    def __repr__(self):
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
            f"descCount={self.descCount})"
        )


class nixl_xfer_handle:
    """A transfer request: made once (descriptors selected and merged in
    Rust), posted by `transfer` (again once it ended), checked by
    `check_xfer_state`."""

    def __init__(self, agent, request):
        self._agent = agent
        self._request = request
        self._xfer = None
        self._failed = False
        self._start = self._post = self._t0 = 0
        self._end = None

    def _submit(self, notif):
        msg = notif.encode() if isinstance(notif, str) else notif
        self._start = time.time_ns() // 1000
        t0 = time.perf_counter_ns()
        self._failed = False
        self._end = None
        try:
            self._xfer = self._agent.post(self._request, msg or None)
        except KvxferError:
            self._xfer = None
            self._failed = True
        self._t0 = t0
        self._post = (time.perf_counter_ns() - t0) // 1000

    def _state(self, max_wait=0.0):
        if self._failed or self._xfer is None:
            return "ERR"
        s = self._xfer.check(max_wait) if max_wait else self._xfer.state
        if s != "PROC" and self._end is None:
            self._end = time.perf_counter_ns()
        return s

    def release(self):
        if self._xfer is not None and not self._xfer.done():
            self._xfer.abort()
            # Returns once nothing of it moves any more (or raises).
            try:
                self._xfer.wait()
            except KvxferError:
                pass
        self._xfer = None
        # The agent's preparation holds the local regions: let them go.
        self._request.release()


def _request(agent, operation, local, local_ids, remote, remote_ids, remote_agent, notif):
    if operation not in ("READ", "WRITE"):
        raise KeyError(f"operation {operation!r}: READ or WRITE")
    msg = notif.encode() if isinstance(notif, str) else notif
    return agent.make_request(
        operation, local, local_ids, remote, remote_ids, remote_agent, msg or None
    )


class nixl_agent:
    """NIXL's agent, over a kvxfer agent (backend `auto`)."""

    def __init__(self, agent_name, nixl_conf=None, instantiate_all=False):
        self.name = str(agent_name)
        self.config = nixl_conf or nixl_agent_config()
        # `auto`: shared memory on this host, RDMA where both sides have a
        # device, TCP otherwise; KVXFER_NIXL_BACKEND picks one.
        self._agent = Agent(self.name, backend=os.environ.get("KVXFER_NIXL_BACKEND", "auto"))
        self.backends = {b: b for b in self.config.backends}
        self.notifs = {}

    # -- descriptors and memory -----------------------------------------

    def get_reg_descs(self, descs, mem_type=None):
        """A registration descriptor list from tuples `(address, length,
        device, meta)`, an Nx3 array or tensors."""
        mem, d = _triples(descs, mem_type)
        return DescList(mem, d, reg=True)

    def get_xfer_descs(self, descs, mem_type=None):
        """A transfer descriptor list from tuples `(address, length,
        device)`, an Nx3 array or tensors."""
        mem, d = _triples(descs, mem_type)
        return DescList(mem, d)

    def register_memory(self, reg_list, mem_type=None, backends=[]):  # noqa: B006
        """Registers the regions; returns their descriptor list (for
        `deregister_memory`)."""
        descs = self.get_reg_descs(reg_list, mem_type)
        self._agent.register_raw(descs.descs, _MEM[descs.mem_type])
        return descs

    def deregister_memory(self, dereg_list, backends=[]):  # noqa: B006
        """Deregisters regions registered by `register_memory`."""
        descs = self.get_reg_descs(dereg_list)
        self._agent.deregister_raw(descs.descs, _MEM[descs.mem_type])

    def get_serialized_descs(self, descs):
        """A descriptor list as bytes (a checked format, not pickle)."""
        d = descs if isinstance(descs, DescList) else self.get_xfer_descs(descs)
        body = {"mem": d.mem_type, "reg": d.reg, "descs": [list(x) for x in d.descs]}
        return b"KVXD1" + json.dumps(body, separators=(",", ":")).encode()

    def deserialize_descs(self, serialized_descs):
        """The descriptor list `get_serialized_descs` made."""
        b = bytes(serialized_descs)
        if not b.startswith(b"KVXD1"):
            raise ValueError("not a serialized kvxfer descriptor list")
        body = json.loads(b[5:])
        triples = [(int(a), int(n), int(dv)) for a, n, dv in body["descs"]]
        return DescList(body["mem"], triples, reg=bool(body["reg"]))

    # -- agents -----------------------------------------------------------

    def get_agent_metadata(self):
        """This agent's metadata, for a peer's `add_remote_agent`."""
        return self._agent.metadata()

    def add_remote_agent(self, metadata):
        """Loads a peer from its metadata; returns its name (as bytes, as
        NIXL does)."""
        return self._agent.add_remote_agent(bytes(metadata)).encode()

    def remove_remote_agent(self, agent):
        """Forgets a peer; its transfers in flight fail."""
        self._agent.remove_remote_agent(_name(agent))

    def make_connection(self, remote_agent, backends=[]):  # noqa: B006
        """Connects ahead of the first transfer (kvxfer connects when the
        peer is added; kept for the call sequence)."""
        self._agent.remote_transport(_name(remote_agent))

    # -- transfers --------------------------------------------------------

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=[]):  # noqa: B006
        """Prepares one side of later transfers: `agent_name` is
        `"NIXL_INIT_AGENT"` (or `""`) for the local side, the peer's name
        for the remote side."""
        name = _name(agent_name)
        if name in ("", NIXL_INIT_AGENT):
            name = NIXL_INIT_AGENT
        elif name == self.name:
            raise NotImplementedError("loopback transfers are not supported by kvxfer.nixl")
        else:
            self._agent.remote_transport(name)  # raises UnknownAgentError
        return nixl_prepped_dlist_handle(name, self.get_xfer_descs(xfer_list, mem_type))

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
        arrays, any order) of two prepared lists."""
        if local_xfer_side.agent_name != NIXL_INIT_AGENT:
            raise ValueError("the local side must be prepared with NIXL_INIT_AGENT")
        req = _request(
            self._agent,
            operation,
            local_xfer_side.dlist.native,
            local_indices,
            remote_xfer_side.dlist.native,
            remote_indices,
            remote_xfer_side.agent_name,
            notif_msg,
        )
        return nixl_xfer_handle(self._agent, req)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"", backends=[]):  # noqa: B006,E501
        """A transfer from two descriptor lists (unprepared form)."""
        local = self.get_xfer_descs(local_descs)
        remote = self.get_xfer_descs(remote_descs)
        name = _name(remote_agent)
        self._agent.remote_transport(name)
        ids = list(range(len(local)))
        req = _request(
            self._agent, operation, local.native, ids, remote.native,
            list(range(len(remote))), name, notif_msg,
        )
        return nixl_xfer_handle(self._agent, req)

    def transfer(self, handle, notif_msg=b""):
        """Posts the transfer: `"DONE"` when it completed inline, `"PROC"`
        while in flight, `"ERR"` when it could not start (or is still in
        flight from an earlier post)."""
        if handle._xfer is not None and not handle._xfer.done():
            return "ERR"
        handle._submit(notif_msg)
        return handle._state()

    def check_xfer_state(self, handle):
        """`"DONE"`, `"PROC"` or `"ERR"`. Waits up to 20 µs (the GIL
        released) for a transfer in flight to end, so that a caller polling
        in a loop leaves the CPU to the threads moving its data."""
        return handle._state(_CHECK_WAIT)

    def get_xfer_telemetry(self, handle):
        """Start (µs since the epoch), post and transfer durations (µs),
        bytes and descriptors (after merging) of the last post. The
        transfer's end is when a check first saw it done."""
        if not self.config.capture_telemetry:
            raise nixlNoTelemetryError("telemetry needs nixl_agent_config(capture_telemetry=True)")
        end = handle._end if handle._end is not None else time.perf_counter_ns()
        return _Telemetry(
            handle._start,
            handle._post,
            max(0, (end - handle._t0) // 1000),
            handle._request.total_bytes,
            handle._request.desc_count,
        )

    def query_xfer_backend(self, handle):
        """The transport that carried the transfer (`tcp`, `shm`, `rdma`, `inproc`)."""
        return handle._xfer.transport if handle._xfer is not None else ""

    def release_xfer_handle(self, handle):
        """Releases a transfer; one in flight is aborted first."""
        handle.release()

    def release_dlist_handle(self, handle):
        """Releases a prepared list."""
        handle.release()

    # -- notifications ----------------------------------------------------

    def get_new_notifs(self, backends=[]):  # noqa: B006
        """`{peer name: [bytes, ...]}` that arrived since the last call."""
        return self._agent.get_new_notifs()

    def update_notifs(self, backends=[]):  # noqa: B006
        """Adds the new notifications to `self.notifs` and returns it."""
        for k, v in self._agent.get_new_notifs().items():
            self.notifs.setdefault(k, []).extend(v)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name, lookup_tag, backends=[], tag_is_prefix=True):  # noqa: B006,E501
        """Whether a notification from the peer starts with (or, with
        `tag_is_prefix=False`, contains) `lookup_tag`; removes the one found."""
        self.update_notifs()
        name = _name(remote_agent_name)
        msgs = self.notifs.get(name, [])
        for i, m in enumerate(msgs):
            if (tag_is_prefix and m.startswith(lookup_tag)) or (
                not tag_is_prefix and lookup_tag in m
            ):
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name, notif_msg, backends=[]):  # noqa: B006
        """Sends a notification alone (no data)."""
        msg = notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)
        self._agent.send_notif(_name(remote_agent_name), msg)
