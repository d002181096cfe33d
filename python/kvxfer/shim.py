"""Makes unmodified `import nixl` / `from mooncake.engine import
TransferEngine` resolve to kvxfer, on request.

    python -m kvxfer.shim install nixl mooncake   # this environment, from now on
    python -m kvxfer.shim uninstall nixl mooncake
    python -m kvxfer.shim status
    PYTHONPATH=$(python -m kvxfer.shim path nixl) python serve.py   # one process

`install` writes a `.pth` file into this environment's site-packages that
puts kvxfer's stand-in package on the path. It refuses where the real
package is installed; and a stand-in imported where a real one is also
importable raises `ImportError` (unless `KVXFER_SHIM_OVER_REAL=1`), so a
real NIXL or Mooncake is never shadowed by surprise.
"""

import argparse
import importlib.machinery
import os
import sys
import sysconfig

NAMES = ("nixl", "mooncake")


def path(name):
    """The directory holding kvxfer's stand-in for `name`."""
    if name not in NAMES:
        raise ValueError(f"{name!r}: kvxfer stands in for {', '.join(NAMES)}")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim", f"{name}_path")


def _pth(name):
    return os.path.join(sysconfig.get_paths()["purelib"], f"kvxfer-shim-{name}.pth")


def _real(name):
    """Where a real `name` is importable from, or None."""
    ours = os.path.realpath(path(name))
    search = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != ours]
    spec = importlib.machinery.PathFinder.find_spec(name, search)
    return None if spec is None else (spec.origin or str(spec.submodule_search_locations))


def install(name):
    """Puts the stand-in for `name` on this environment's path; refuses
    (ValueError) where the real package is installed."""
    real = _real(name)
    if real is not None:
        raise ValueError(f"a real {name!r} is installed ({real}): kvxfer will not shadow it")
    with open(_pth(name), "w") as f:
        f.write(path(name) + "\n")
    return _pth(name)


def uninstall(name):
    """Removes the stand-in for `name` from this environment's path."""
    try:
        os.remove(_pth(name))
        return True
    except FileNotFoundError:
        return False


def status(name):
    """A line saying what `import name` gives in this environment."""
    installed = os.path.exists(_pth(name))
    real = _real(name)
    if real is not None:
        return f"{name}: the real package ({real})" + (
            "; kvxfer's stand-in is installed but not used" if installed else ""
        )
    if installed:
        return f"{name}: kvxfer ({path(name)})"
    return f"{name}: not importable (`python -m kvxfer.shim install {name}`)"


def main(argv=None):
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m kvxfer.shim", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("install", "uninstall", "status", "path"))
    p.add_argument("names", nargs="*", help=f"any of {', '.join(NAMES)} (default: all)")
    a = p.parse_args(argv)
    names = a.names or list(NAMES)
    for n in names:
        if n not in NAMES:
            p.error(f"{n!r}: kvxfer stands in for {', '.join(NAMES)}")
    rc = 0
    for n in names:
        if a.command == "path":
            print(path(n))
        elif a.command == "status":
            print(status(n))
        elif a.command == "uninstall":
            print(f"{n}: " + ("removed" if uninstall(n) else "was not installed"))
        else:
            try:
                print(f"{n}: installed ({install(n)})")
            except ValueError as e:
                print(f"{n}: {e}", file=sys.stderr)
                rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
