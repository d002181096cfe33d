"""The import lines and call sequences of vLLM's NixlConnector, SGLang's
NIXL and Mooncake backends and LMCache's NIXL channel (`frameworks.py`),
two processes on one host, unmodified: on kvxfer's stand-ins they must
work, and give what the real NIXL and Mooncake give."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import HERE, shim_env

TIMEOUT = 180

EXPECT = {
    "vllm": {
        "prefill": {"notifs": {"true": ["req-1:1", "req-2:1"]}, "source unchanged": True},
        # 8 regions x 4 blocks: 3 adjacent + 1 apart in each -> 16 after merging.
        "decode": {"remote name": True, "first": True, "state": "DONE",
                   "telemetry": [True, 32 * 4096, 16], "data": True},
    },
    "sglang-nixl": {
        "prefill": {"plugins": True, "posted": [True, True, True],
                    "states": ["DONE", "DONE", "DONE"]},
        "decode": {"plugins": True, "notifs": ["7_aux", "7_kv_0_0", "7_kv_1_1"], "kv": True,
                   "aux": True, "registered": [True, True]},
    },
    "sglang-mooncake": {
        "prefill": {"rc": [0, 0, 0, 0, 0, 0]},
        "decode": {"rc": [0, 0, 0], "kv": True},
    },
    "lmcache": {
        "sender": {"states": ["DONE", "DONE"], "read": True},
        "receiver": {"sender name": True, "written": True},
    },
}


def run(framework, env):
    roles = list(EXPECT[framework])
    with tempfile.TemporaryDirectory(prefix="kvxfer-fw-") as d:
        procs = {
            r: subprocess.Popen(
                [sys.executable, os.path.join(HERE, "frameworks.py"), framework, r, d],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                cwd=tempfile.gettempdir(),
            )
            for r in roles
        }
        results = {}
        for r, p in procs.items():
            try:
                out, err = p.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                for q in procs.values():
                    q.kill()
                raise
            lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
            assert lines, f"{framework} {r} (rc {p.returncode}):\n{out[-2000:]}{err[-4000:]}"
            results[r] = json.loads(lines[-1][7:])
    return results


@pytest.mark.parametrize("framework", sorted(EXPECT))
def test_runs_unmodified_on_kvxfer(framework):
    # The real Mooncake is installed next to kvxfer here: its stand-in is
    # asked for on purpose.
    env = shim_env("mooncake", over_real=True) if framework == "sglang-mooncake" else shim_env("nixl")
    assert run(framework, env) == EXPECT[framework]


@pytest.mark.parametrize("framework", sorted(EXPECT))
def test_same_results_as_the_real_library(framework, request):
    fixture = "real_mooncake_env" if framework == "sglang-mooncake" else "real_nixl_env"
    assert run(framework, request.getfixturevalue(fixture)) == EXPECT[framework]
