"""The opt-in that makes unmodified imports resolve to kvxfer
(`python -m kvxfer.shim`), and its refusal to shadow a real NIXL or
Mooncake."""

import importlib.util
import os
import subprocess
import sys

import pytest

import kvxfer.nixl
import kvxfer.nixl_bindings
import kvxfer.shim
from conftest import shim_env


def py(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


# The import lines of vLLM, SGLang, LMCache and Dynamo, as they are written.
IMPORTS = """
from nixl._api import nixl_agent as NixlWrapper
from nixl._bindings import nixlXferTelemetry
from nixl._api import nixl_agent_config
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
from nixl._bindings import nixlRemoteDisconnectError, nixlBackendError, nixlCancelledError
from nixl import nixl_agent, nixl_agent_config
import nixl._bindings as bindings
import nixl._utils as utils
import kvxfer.nixl, kvxfer.nixl_bindings
assert NixlWrapper is kvxfer.nixl.nixl_agent
assert bindings is kvxfer.nixl_bindings and nixlXferTelemetry is bindings.nixlXferTelemetry
addr = utils.malloc_passthru(64); utils.free_passthru(addr)
print("ok")
"""


def test_framework_import_lines_resolve_to_kvxfer():
    out = py(IMPORTS, shim_env("nixl"))
    assert out.stdout.strip() == "ok", out.stderr
    out = py("from mooncake.engine import TransferEngine; import kvxfer.mooncake as m;"
             "assert TransferEngine is m.TransferEngine; print('ok')",
             shim_env("mooncake", over_real=True))
    assert out.stdout.strip() == "ok", out.stderr


def test_a_real_package_is_never_shadowed(tmp_path):
    fake = tmp_path / "nixl"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    env = shim_env("nixl")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    out = py("import nixl", env)
    assert out.returncode != 0 and "a real 'nixl' is installed too" in out.stderr, out.stderr
    env["KVXFER_SHIM_OVER_REAL"] = "1"
    out = py("import nixl._api, kvxfer.nixl; assert nixl._api is kvxfer.nixl; print('ok')", env)
    assert out.stdout.strip() == "ok", out.stderr


def test_install_status_uninstall():
    clean = dict(os.environ)
    clean.pop("PYTHONPATH", None)
    probe = "import nixl._api, kvxfer.nixl; assert nixl._api is kvxfer.nixl; print('ok')"
    assert py(probe, clean).returncode != 0, "nixl importable before install"
    try:
        assert kvxfer.shim.main(["install", "nixl"]) == 0
        assert "nixl: kvxfer" in kvxfer.shim.status("nixl")
        assert py(probe, clean).stdout.strip() == "ok"
    finally:
        kvxfer.shim.uninstall("nixl")
    assert py(probe, clean).returncode != 0, "nixl importable after uninstall"
    if importlib.util.find_spec("mooncake") is not None:
        with pytest.raises(ValueError, match="will not shadow"):
            kvxfer.shim.install("mooncake")
        assert "the real package" in kvxfer.shim.status("mooncake")


@pytest.mark.parametrize("listen", [True, False])
@pytest.mark.parametrize("mode", [None] + list(kvxfer.nixl.nixl_thread_sync_t))
def test_sync_mode_reaches_the_agent(monkeypatch, mode, listen):
    seen = {}
    made = kvxfer.nixl_bindings.nixlAgent

    def spy(name, config):
        seen["mode"] = config.syncMode
        return made(name, config)

    monkeypatch.setattr(kvxfer.nixl_bindings, "nixlAgent", spy)
    kvxfer.nixl.nixl_agent(f"sync-{mode}-{listen}",
                           kvxfer.nixl.nixl_agent_config(sync_mode=mode, enable_listen_thread=listen))
    t = kvxfer.nixl.nixl_thread_sync_t
    want = mode or (t.NIXL_THREAD_SYNC_STRICT if listen else t.NIXL_THREAD_SYNC_NONE)
    assert seen["mode"] == want.value
    with pytest.raises(TypeError, match="sync_mode must be a nixl_thread_sync_t"):
        kvxfer.nixl.nixl_agent_config(sync_mode=1)


def test_what_the_mooncake_stand_in_leaves_out_says_so():
    """Mooncake Store, EP, the process group and Mooncake's vLLM connector
    are out of scope: importing them names kvxfer; `get_engine()` (the C++
    engine those take) raises a typed error instead of handing out
    something else."""
    code = (
        "import importlib\n"
        "for m in ('store', 'ep', 'mooncake_ep_buffer', 'pg', 'mooncake_connector_v1', 'async_store'):\n"
        "    try:\n"
        "        importlib.import_module('mooncake.' + m)\n"
        "    except ImportError as e:\n"
        "        assert 'kvxfer' in str(e) and e.name == 'mooncake.' + m, e\n"
        "    else:\n"
        "        raise AssertionError(m)\n"
        "from mooncake.engine import TransferEngine\n"
        "from kvxfer.mooncake import MooncakeUnsupportedError\n"
        "e = TransferEngine()\n"
        "for f in (e.get_engine, e.get_engine_ptr):\n"
        "    try:\n"
        "        f()\n"
        "    except MooncakeUnsupportedError as x:\n"
        "        assert isinstance(x, NotImplementedError)\n"
        "    else:\n"
        "        raise AssertionError(f)\n"
        "print('ok')\n"
    )
    out = py(code, shim_env("mooncake", over_real=True))
    assert out.stdout.strip() == "ok", out.stderr
