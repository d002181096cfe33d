"""NIXL's `nixl._utils` test helpers: raw host memory by address."""

import ctypes
import ctypes.util
import logging

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


def ba_buf(addr, size):
    """Fills `size` bytes at `addr` with 0xba."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1, addr2, size):
    """Logs an error where `size` bytes at two addresses differ (NIXL's
    helper returns nothing either way)."""
    if ctypes.string_at(int(addr1), int(size)) != ctypes.string_at(int(addr2), int(size)):
        logging.getLogger("nixl").error("verify_transfer: %d bytes at %#x and %#x differ",
                                        int(size), int(addr1), int(addr2))
