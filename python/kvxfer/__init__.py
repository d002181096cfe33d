"""kvxfer: zero-copy KV-cache transfer between LLM serving executors.

The native API::

    import kvxfer
    target = kvxfer.Agent("gen-0")
    buf = bytearray(4096)
    reg = target.register(buf)            # registered while `reg` lives
    ...
    initiator = kvxfer.Agent("ctx-0")
    name = initiator.add_remote_agent(target.metadata())
    src = initiator.register(bytearray(b"x" * 4096))
    initiator.write(src.descs(), remote_descs, name, notif=b"ready").wait(5.0)

Every blocking call releases the GIL; every wait has a deadline and
honours Ctrl-C. Errors are typed: each is a subclass of `KvxferError`
named after the Rust error's variant (`UnknownAgentError`,
`RemoteRangeNotExportedError`, `TimeoutError`, ...).
"""

import ctypes

from . import _kvxfer
from ._kvxfer import *  # noqa: F401,F403  (the exception classes)
from ._kvxfer import (  # noqa: F401
    CacheReceiver,
    CacheSender,
    CacheState,
    CompletionQueue,
    DescList,
    KvxferError,
    Request,
    Transfer,
    block_bytes,
    pattern_check,
    pattern_fill,
)

__all__ = [
    "Agent",
    "Registration",
    "SharedPool",
    "PoolRegistration",
    "Transfer",
    "CompletionQueue",
    "KvxferError",
    "ReadOnlyBufferError",
    "DescList",
    "Request",
    "CacheState",
    "CacheSender",
    "CacheReceiver",
    "block_bytes",
    "pattern_fill",
    "pattern_check",
] + [
    n for n in dir(_kvxfer) if n.endswith("Error")
]
__version__ = _kvxfer.__version__


class ReadOnlyBufferError(KvxferError, ValueError):
    """A read-only buffer was given where peers may write (registration)."""


class _PyBuffer(ctypes.Structure):
    """CPython's `Py_buffer` (stable since 3.3)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
# PyBUF_SIMPLE: one contiguous block of bytes (a strided view is refused).
_PYBUF_SIMPLE = 0


def _range(addr, total, offset, length):
    """`[(address, length)]` of `length` bytes (default: to the end) from
    `offset` in `total` registered bytes at `addr`; `ValueError` outside."""
    if length is None:
        length = total - offset
    if offset < 0 or length <= 0 or offset + length > total:
        raise ValueError(f"range {offset}+{length} outside the registered {total} bytes")
    return [(addr + offset, length)]


class Registration:
    """Memory registered with an agent: a Python buffer, or a tensor.

    Holds what it registered (a buffer stays exported: a `bytearray` cannot
    be resized, the memory cannot move; a tensor stays referenced) until
    `deregister()`, the end of a `with` block, or garbage collection.
    Peers may write into it while it is registered.
    """

    def __init__(self, agent, obj):
        self._live = False
        self._agent = agent
        self._view = None
        self._obj = None
        self.mem_type = "dram"
        self.device = 0
        tensor = _tensor_range(obj)
        if tensor is not None:
            self.addr, self.len, self.mem_type, self.device = tensor
            self.readonly = False
            self._obj = obj
        else:
            self._view = _PyBuffer()
            _get_buffer(obj, ctypes.byref(self._view), _PYBUF_SIMPLE)
            self.addr = self._view.buf or 0
            self.len = self._view.len
            self.readonly = bool(self._view.readonly)
            if self.readonly:
                # Peers may write whatever is registered: an immutable
                # object (bytes) written behind Python's back would break it.
                self._release()
                raise ReadOnlyBufferError(
                    f"a read-only buffer ({type(obj).__name__}) cannot be registered: peers "
                    "may write registered memory; use a bytearray or a writable array"
                )
        try:
            agent.register_raw([(self.addr, self.len, self.device)], self.mem_type)
        except BaseException:
            self._release()
            raise
        self._live = True

    def _release(self):
        if self._view is not None:
            _release_buffer(ctypes.byref(self._view))
            self._view = None
        self._obj = None

    def descs(self, offset=0, length=None):
        """`[(address, length)]` for `length` bytes from `offset` (default:
        to the end), checked against the registration."""
        return _range(self.addr, self.len, offset, length)

    def deregister(self):
        """Deregisters (refused with `RegionBusyError` while transfers use
        it) and lets go of the buffer or tensor."""
        if not self._live:
            return
        self._agent.deregister_raw([(self.addr, self.len, self.device)], self.mem_type)
        self._live = False
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.deregister()

    def __del__(self):
        try:
            self.deregister()
        except Exception:
            # Still in use by a transfer: keep the buffer exported rather
            # than let a peer write into freed memory.
            pass


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    """DLPack's `DLTensor`, the first member of a `DLManagedTensor` (the
    legacy `"dltensor"` capsule's pointer)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_pointer.restype = ctypes.c_void_p
# DLPack device types: host memory, and host memory pinned by CUDA / ROCm.
_DL_HOST = {1: "cpu", 3: "cuda_host", 11: "rocm_host"}
_DL_CUDA = 2


def _dlpack_range(obj):
    """(address, length, memory type, device) of a contiguous DLPack tensor.
    The capsule is only looked at (not consumed: its own destructor hands
    it back to the producer); the registration keeps `obj` itself."""
    capsule = obj.__dlpack__()
    ptr = _capsule_pointer(capsule, b"dltensor")
    t = _DLTensor.from_address(ptr)
    dev = t.device.device_type
    if dev not in _DL_HOST and dev != _DL_CUDA:
        raise ValueError(f"a DLPack tensor on device type {dev} cannot be registered")
    shape = [t.shape[i] for i in range(t.ndim)]
    count = 1
    for d in shape:
        count *= d
    if t.strides and count:
        want = 1
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and t.strides[i] != want:
                raise ValueError("a strided DLPack tensor cannot be registered (make it contiguous)")
            want *= shape[i]
    item_bits = t.dtype.bits * t.dtype.lanes
    if item_bits % 8:
        raise ValueError(f"DLPack elements of {item_bits} bits are not whole bytes")
    addr = (t.data or 0) + t.byte_offset
    length = count * item_bits // 8
    if dev == _DL_CUDA:
        return addr, length, "vram", t.device.device_id
    return addr, length, "dram", 0


def _has_buffer(obj):
    try:
        memoryview(obj).release()
        return True
    except TypeError:
        return False


def _tensor_range(obj):
    """(address, length, memory type, device) of a contiguous tensor: one
    with `__cuda_array_interface__` (GPU memory), torch-like (`data_ptr()`,
    `numel()`, `element_size()`, `device`), or one that only speaks DLPack
    (`__dlpack__`); None for other objects (they go through the buffer
    protocol, which also tells a read-only buffer)."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") is not None:
            raise ValueError("a strided GPU array cannot be registered (make it contiguous)")
        ptr, _ = cai["data"]
        n = 1
        for d in cai["shape"]:
            n *= d
        itemsize = int(cai["typestr"][2:])
        # The interface does not name the device: the driver tells.
        return int(ptr), n * itemsize, "vram", _kvxfer.gpu_device_of(int(ptr)) if n else 0
    if all(hasattr(obj, a) for a in ("data_ptr", "numel", "element_size", "device")):
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise ValueError("a non-contiguous tensor cannot be registered (use .contiguous())")
        dev = obj.device
        kind = getattr(dev, "type", "cpu")
        mem = "vram" if kind == "cuda" else "dram"
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), mem, int(dev.index or 0) if kind == "cuda" else 0
    if hasattr(obj, "__dlpack__") and not _has_buffer(obj):
        return _dlpack_range(obj)
    return None


class SharedPool(_kvxfer.SharedPool):
    """Host memory in a memory file, mapped shared: `SharedPool(size)` or
    `SharedPool(fd=...)` (all of that memory file). Registered with
    `Agent.register_pool`, same-host shm peers map it once and copy with
    plain loads and stores. `buffer()` is a writable view of its bytes
    (valid while the pool object lives)."""

    def buffer(self):
        """A writable `memoryview` of the pool's bytes (it keeps the pool
        alive)."""
        arr = (ctypes.c_char * len(self)).from_address(self.addr)
        arr._pool = self
        return memoryview(arr).cast("B")


class PoolRegistration:
    """A `SharedPool` registered with an agent (`Agent.register_pool`):
    `descs()`, `deregister()` (which revokes every peer's mapping before
    it returns), a context manager. Holds the pool while registered."""

    def __init__(self, agent, pool, read_only=False):
        self._agent = agent
        self._pool = pool
        self.addr, self.len = agent.register_shared_pool(pool, read_only)
        self.mem_type = "dram"
        self.device = 0
        self._live = True

    def descs(self, offset=0, length=None):
        """`[(address, length)]` for `length` bytes from `offset` (default:
        to the end), checked against the registration."""
        return _range(self.addr, self.len, offset, length)

    def deregister(self):
        """Deregisters the pool and revokes it from every peer."""
        if not self._live:
            return
        self._agent.deregister_raw([(self.addr, self.len, 0)], "dram")
        self._live = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.deregister()

    def __del__(self):
        try:
            self.deregister()
        except Exception:
            pass


class Agent(_kvxfer.Agent):
    """A kvxfer agent. `Agent(name, backend="tcp", listen=None, secret=None,
    connect_timeout=10.0, io_timeout=30.0, etcd=None, etcd_prefix="/kvxfer",
    etcd_lease_ttl=5.0)`; with `etcd` ("host:port,..."), published there
    and able to `connect_by_name`."""

    def register(self, obj):
        """Registers a writable buffer (`bytearray`, `memoryview`, `mmap`, a
        contiguous numpy array) or a contiguous tensor (torch-like, DLPack,
        or with `__cuda_array_interface__`; CUDA tensors are registered as
        GPU memory, checked by the driver: `GpuError` when it is not, or no
        driver is present); returns its `Registration`."""
        return Registration(self, obj)

    def register_pool(self, pool, read_only=False):
        """Registers a `SharedPool` for same-host peers to map (read only
        with `read_only`); returns its `PoolRegistration`."""
        return PoolRegistration(self, pool, read_only)

    def write(self, local, remote, remote_agent, notif=None):
        """WRITE `local` `(address, length)` pieces into `remote` ones at
        `remote_agent`; `notif` is delivered after the data."""
        return self.transfer("write", local, remote, remote_agent, notif)

    def read(self, local, remote, remote_agent, notif=None):
        """READ `remote` pieces at `remote_agent` into `local` ones."""
        return self.transfer("read", local, remote, remote_agent, notif)
