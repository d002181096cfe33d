"""The storage side of kvxfer's NIXL stand-in: the POSIX, GDS, GDS_MT and
OBJ plugins, transfers an agent posts to itself, path-mode registration,
`query_memory`, deregistration under a finished handle, and SGLang's
HiCacheNixl, LMCache's NIXL storage adapter and vLLM's offload tiers'
call sequences. One scripted session
(`nixl_storage_sequence.py`) runs unmodified on kvxfer and on the real
NIXL (1.5.1, its POSIX plugin; OBJ where the gateway runs), step by step."""

import ctypes
import os

import pytest
from conftest import run_script, shim_env

import kvxfer.nixl as nixl_api
from kvxfer import nixl_bindings as b

# What the session must show on kvxfer whatever the real NIXL does.
MUST = {
    "create POSIX": ["ok", None],
    "register before a backend": ["raise", "nixlNotFoundError"],
    "size after registering": ["ok", 0],
    "write at 0": ["ok", "DONE"],
    "file holds it": ["ok", True],
    "query backend": ["ok", "POSIX"],
    "size after": ["ok", 3 * 16384],
    "read back": ["ok", True],
    "hole is zeros": ["ok", True],
    "unregistered range": ["raise", "nixlNotFoundError"],
    "unknown fd": ["raise", "nixlNotFoundError"],
    "read past the end": ["ok", "failed"],
    "prepped landed": ["ok", True],
    "prepped read back": ["ok", True],
    "query memory": ["ok", [[["mode", "mtime", "size"], str(3 * 16384)], None]],
    "path-mode probe": ["raise", "nixlBackendError"],
    "path-mode created": ["ok", 0],
    "path-mode write": ["ok", "DONE"],
    "path-mode landed": ["ok", True],
    "read-only write": ["ok", "failed"],
    "read-only read back": ["ok", True],
    "deregister DRAM under finished handles": ["ok", None],
    "deregister FILE": ["ok", None],
    "hicache probe": ["ok", "path mode"],
    "hicache exists before": ["ok", [False, False, False, False, False]],
    "hicache set": ["ok", "DONE"],
    "hicache exists after": ["ok", [True, True, True, True, False]],
    "hicache get": ["ok", "DONE"],
    "hicache got": ["ok", True],
}


def _lmcache(backend):
    """LMCache's L2 adapter on `backend`: every step goes through."""
    return {
        f"lmcache {backend} create": ["ok", None],
        f"lmcache {backend} store": ["ok", "DONE"],
        f"lmcache {backend} load": ["ok", "DONE"],
        f"lmcache {backend} loaded": ["ok", True],
        f"lmcache {backend} close": ["ok", None],
    }


def _vllm(backend):
    """vLLM's offload tier on `backend`: every job goes through."""
    return {
        f"vllm {backend} create": ["ok", None],
        f"vllm {backend} store": ["ok", "DONE"],
        f"vllm {backend} load": ["ok", "DONE"],
        f"vllm {backend} loaded": ["ok", [True, True, True]],
        f"vllm {backend} load tail": ["ok", "DONE"],
        f"vllm {backend} tail loaded": ["ok", [True, True, True]],
        f"vllm {backend} shutdown": ["ok", None],
    }


MUST.update(_lmcache("POSIX"))
MUST.update(_vllm("POSIX"))
MUST_OBJ = {
    "query before": ["ok", [None]],
    "put": ["ok", "DONE"],
    "query after": ["ok", [{}]],
    "got the range": ["ok", True],
    **_lmcache("OBJ"),
    **_vllm("OBJ"),
}


def test_kvxfer_storage_session_shows_what_nixl_promises(tmp_path):
    ours = dict(run_script("nixl_storage_sequence.py", shim_env("nixl"), tmp_path))
    must = dict(MUST, **(MUST_OBJ if os.environ.get("KVXFER_S3_ENDPOINT") else {}))
    for step, want in must.items():
        assert ours[step] == want, f"{step}: {ours[step]} (want {want})"


def test_same_storage_results_as_the_real_nixl(real_nixl_env, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "ours").mkdir()
    real = run_script("nixl_storage_sequence.py", real_nixl_env, tmp_path / "real")
    ours = run_script("nixl_storage_sequence.py", shim_env("nixl"), tmp_path / "ours")
    assert [s for s, _ in ours] == [s for s, _ in real]
    diff = [(s, o, r) for (s, o), (_, r) in zip(ours, real) if o != r]
    assert not diff, "\n".join(f"{s}: kvxfer {o} vs nixl {r}" for s, o, r in diff)


def _wait(agent, h):
    s = agent.transfer(h)
    while s == "PROC":
        s = agent.check_xfer_state(h)
    return s


@pytest.mark.parametrize("plugin", ["GDS", "GDS_MT"])
def test_the_gds_plugins_move_host_memory_to_files(plugin, tmp_path):
    """GDS and GDS_MT (no GPU here: host memory, as NIXL's GDS example
    moves it) through kvxfer's file storage."""
    a = nixl_api.nixl_agent("gds-" + plugin, nixl_api.nixl_agent_config(backends=[]))
    assert a.get_plugin_mem_types(plugin) == ["DRAM_SEG", "VRAM_SEG", "FILE_SEG"]
    a.create_backend(plugin)
    n = 65536
    src = ctypes.create_string_buffer(os.urandom(n), n)
    back = ctypes.create_string_buffer(n)
    reg = a.register_memory([(ctypes.addressof(src), n, 0, "a"), (ctypes.addressof(back), n, 0, "b")], "DRAM")
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT)
    files = a.register_memory([(0, n, fd, "b")], "FILE")
    w = a.initialize_xfer("WRITE", a.get_xfer_descs([(ctypes.addressof(src), n, 0)], "DRAM"),
                          files.trim(), a.name)
    assert _wait(a, w) == "DONE"
    assert a.query_xfer_backend(w) == plugin
    assert a.query_xfer_transport(w) == "storage"
    r = a.initialize_xfer("READ", a.get_xfer_descs([(ctypes.addressof(back), n, 0)], "DRAM"),
                          files.trim(), a.name)
    assert _wait(a, r) == "DONE"
    assert back.raw == src.raw
    for h in (w, r):
        a.release_xfer_handle(h)
    a.deregister_memory(files)
    a.deregister_memory(reg)
    os.close(fd)


def test_a_handle_whose_memory_was_deregistered_fails_its_next_post(tmp_path):
    """NIXL lets memory go under a finished handle and posts it again into
    freed memory; kvxfer lets it go too, and the next post fails."""
    a = nixl_api.nixl_agent("dereg-held", nixl_api.nixl_agent_config(backends=[]))
    a.create_backend("POSIX")
    n = 8192
    src = ctypes.create_string_buffer(os.urandom(n), n)
    reg = a.register_memory([(ctypes.addressof(src), n, 0, "")], "DRAM")
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT)
    files = a.register_memory([(0, n, fd, "")], "FILE")
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(ctypes.addressof(src), n, 0)], "DRAM")
    remote = a.prep_xfer_dlist(a.name, [(0, n, fd)], "FILE")
    h = a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    assert _wait(a, h) == "DONE"
    a.deregister_memory(reg)
    assert a.transfer(h) == "ERR"
    # Registered again, the same handle moves it again.
    reg = a.register_memory([(ctypes.addressof(src), n, 0, "")], "DRAM")
    assert _wait(a, h) == "DONE"
    a.release_xfer_handle(h)
    a.deregister_memory(files)
    a.deregister_memory(reg)
    os.close(fd)


def test_storage_loopback_of_memory_and_blk_are_refused_typed(tmp_path):
    a = nixl_api.nixl_agent("loop-refused", nixl_api.nixl_agent_config(backends=["UCX"]))
    a.create_backend("POSIX")
    n = 4096
    buf = ctypes.create_string_buffer(n)
    a.register_memory([(ctypes.addressof(buf), n, 0, "")], "DRAM")
    d = a.get_xfer_descs([(ctypes.addressof(buf), n, 0)], "DRAM")
    with pytest.raises(b.nixlNotSupportedError):
        a.initialize_xfer("WRITE", d, d, a.name)
    with pytest.raises(b.nixlNotFoundError):
        a.register_memory([(0, n, 0, "")], "BLOCK")
    # OBJ without its backend: no plugin has OBJ_SEG.
    with pytest.raises(b.nixlNotFoundError):
        a.register_memory([(0, n, 3, "key")], "OBJ")
    # An OBJ backend needs a bucket.
    env = dict(os.environ)
    os.environ.pop("AWS_DEFAULT_BUCKET", None)
    try:
        with pytest.raises(b.nixlInvalidParamError):
            a.create_backend("OBJ", {})
    finally:
        os.environ.clear()
        os.environ.update(env)
