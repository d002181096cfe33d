"""Shared fixtures: a loopback etcd, free ports, and the environments in
which `import nixl` / `import mooncake` resolve to kvxfer's stand-ins or to
the real libraries."""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import kvxfer.shim

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    """A loopback port free now."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@pytest.fixture
def etcd():
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("SKIPPED: no etcd/etcdctl binary (ci/install-deps.sh test installs them)")
    d = tempfile.mkdtemp(prefix="kvxfer-py-etcd-")
    client, peer = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        ["etcd", "--name", "n0", "--data-dir", os.path.join(d, "n0"),
         "--listen-client-urls", f"http://{client}", "--advertise-client-urls", f"http://{client}",
         "--listen-peer-urls", f"http://{peer}", "--initial-advertise-peer-urls", f"http://{peer}",
         "--initial-cluster", f"n0=http://{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    env = dict(os.environ, ETCDCTL_API="3")
    deadline = time.time() + 60
    while subprocess.run(["etcdctl", "--endpoints", client, "get", "x"], env=env,
                         capture_output=True).returncode != 0:
        assert time.time() < deadline, "etcd did not come up"
        time.sleep(0.1)
    yield client
    proc.kill()
    proc.wait()
    shutil.rmtree(d, ignore_errors=True)



def shim_env(name, over_real=False):
    """The environment in which `import name` gives kvxfer's stand-in."""
    env = dict(os.environ, PYTHONPATH=kvxfer.shim.path(name))
    if over_real:
        env["KVXFER_SHIM_OVER_REAL"] = "1"
    return env


@pytest.fixture(scope="session")
def real_nixl_env(tmp_path_factory):
    """The environment in which `import nixl` gives the real NIXL: a `nixl`
    package that is the installed `nixl_cu12` (as NIXL's own `nixl`
    distribution provides). Skips where the real NIXL is not installed."""
    if importlib.util.find_spec("nixl_cu12") is None:
        pytest.skip("SKIPPED: the real NIXL (nixl-cu12) is not installed here (ci/python.sh installs it)")
    d = tmp_path_factory.mktemp("real-nixl")
    os.makedirs(d / "nixl")
    (d / "nixl" / "__init__.py").write_text(
        "import importlib, sys\n"
        "from nixl_cu12 import *  # noqa\n"
        "for _n in ('_api', '_bindings', '_utils', 'logging'):\n"
        "    sys.modules['nixl.' + _n] = importlib.import_module('nixl_cu12.' + _n)\n"
        "    globals()[_n] = sys.modules['nixl.' + _n]\n"
    )
    return dict(os.environ, PYTHONPATH=str(d))


@pytest.fixture(scope="session")
def real_mooncake_env():
    """The environment in which `import mooncake` gives the real Mooncake;
    skips where it is not installed."""
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("SKIPPED: the real Mooncake is not installed here (ci/python.sh installs it)")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def run_script(script, env, *args, timeout=180):
    """Runs one of the scripted sessions here; its `RESULT` list."""
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *map(str, args)],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir(),
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"{script} gave no result (rc {out.returncode}):\n"
                         + out.stdout[-3000:] + out.stderr[-3000:])
