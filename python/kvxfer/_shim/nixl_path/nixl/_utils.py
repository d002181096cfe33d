"""NIXL's `nixl._utils` test helpers: raw host memory by address."""

import ctypes
import ctypes.util

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]


def malloc_passthru(size):
    """`size` bytes from the C heap; their address (0 if none)."""
    return int(_libc.malloc(int(size)) or 0)


def free_passthru(addr):
    """Frees what `malloc_passthru` gave."""
    _libc.free(int(addr))


def ba_buf(size):
    """A zeroed `bytearray` of `size` bytes."""
    return bytearray(int(size))


def verify_transfer(addr1, addr2, size):
    """Whether `size` bytes at two addresses are equal."""
    return ctypes.string_at(int(addr1), int(size)) == ctypes.string_at(int(addr2), int(size))
