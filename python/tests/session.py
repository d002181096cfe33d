"""The record the scripted sessions keep (`nixl_sequence.py`,
`nixl_storage_sequence.py`): each step's outcome, as JSON that compares
equal on the real library and on kvxfer's stand-in when they behave
alike."""

import json
import sys

out = []


def plain(v):
    """A value as JSON: bytes marked, descriptor lists by class and size,
    other objects by class."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (bytes, bytearray)):
        return "bytes:" + bytes(v).decode("latin-1")
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if hasattr(v, "descCount"):
        return [type(v).__name__, v.descCount()]
    return type(v).__name__


def step(name, f):
    """Runs `f` and records `["ok", value]` or `["raise", class name]`."""
    try:
        out.append([name, ["ok", plain(f())]])
    except Exception as e:  # noqa: BLE001  (the class is the observation)
        out.append([name, ["raise", type(e).__name__]])


def report():
    """Prints the one line the tests read: `RESULT <json>`."""
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()
