"""The examples in examples/python run and check themselves."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "..", "examples", "python")


@pytest.mark.parametrize(
    "script,args",
    [
        ("disagg_prefill_decode.py", ["--backend", "tcp"]),
        ("disagg_prefill_decode.py", ["--backend", "shm"]),
        ("nixl_pull_vllm_order.py", []),
    ],
)
def test_example(script, args):
    out = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    print(out.stdout)
