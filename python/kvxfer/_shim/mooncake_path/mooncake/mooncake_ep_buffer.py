"""`mooncake.mooncake_ep_buffer` is not offered by kvxfer's stand-in (see
`kvxfer.mooncake`: only the transfer engine is)."""

raise ImportError(
    "mooncake.mooncake_ep_buffer: Mooncake EP (expert-parallel all-to-all buffers) is not offered by kvxfer's stand-in for "
    "Mooncake, which provides the transfer engine (mooncake.engine) alone; install "
    "the real mooncake-transfer-engine and remove the stand-in "
    "(python -m kvxfer.shim uninstall mooncake) to use it",
    name="mooncake.mooncake_ep_buffer",
)
