"""`mooncake.store` is not offered by kvxfer's stand-in (see
`kvxfer.mooncake`: only the transfer engine is)."""

raise ImportError(
    "mooncake.store: Mooncake Store (the distributed KV cache pool and its master) is not offered by kvxfer's stand-in for "
    "Mooncake, which provides the transfer engine (mooncake.engine) alone; install "
    "the real mooncake-transfer-engine and remove the stand-in "
    "(python -m kvxfer.shim uninstall mooncake) to use it",
    name="mooncake.store",
)
