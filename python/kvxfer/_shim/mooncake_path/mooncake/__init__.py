"""kvxfer standing in for Mooncake's transfer engine: `from mooncake.engine
import TransferEngine` resolves to `kvxfer.mooncake`. Installed by
`python -m kvxfer.shim install mooncake`."""

from kvxfer._shim import guard

guard("mooncake", __file__)
