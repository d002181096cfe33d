"""Stand-in packages that make unmodified imports of `nixl` and
`mooncake.engine` resolve to kvxfer (opt-in: `python -m kvxfer.shim`)."""

import importlib.machinery
import os
import sys


def guard(name, init_file):
    """Refuses to stand in for `name` where a real package of that name is
    also importable: a user with the real NIXL or Mooncake installed gets
    it, never kvxfer by surprise. `KVXFER_SHIM_OVER_REAL=1` overrides (for
    side-by-side comparisons)."""
    if os.environ.get("KVXFER_SHIM_OVER_REAL") == "1":
        return
    here = os.path.realpath(os.path.dirname(os.path.dirname(init_file)))
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != here]
    if importlib.machinery.PathFinder.find_spec(name, path) is not None:
        raise ImportError(
            f"kvxfer's stand-in for {name!r} is on the path, but a real {name!r} is installed "
            f"too; remove one (`python -m kvxfer.shim uninstall {name}`), or set "
            "KVXFER_SHIM_OVER_REAL=1 to use kvxfer's on purpose"
        )
