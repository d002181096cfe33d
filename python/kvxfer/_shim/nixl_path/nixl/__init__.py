"""kvxfer standing in for NIXL: `import nixl`, `nixl._api`, `nixl._bindings`
and `nixl._utils` resolve to kvxfer's NIXL front (`kvxfer.nixl`).
Installed by `python -m kvxfer.shim install nixl`."""

from kvxfer._shim import guard

guard("nixl", __file__)

import sys  # noqa: E402

import kvxfer.nixl as _api  # noqa: E402
import kvxfer.nixl_bindings as _bindings  # noqa: E402

# One module object each, so that what a caller patches on
# `nixl._bindings` is what `nixl._api` uses.
sys.modules[__name__ + "._api"] = _api
sys.modules[__name__ + "._bindings"] = _bindings

from kvxfer.nixl import *  # noqa: E402,F401,F403  (NIXL's top-level names)
from kvxfer.nixl import __all__  # noqa: E402,F401
