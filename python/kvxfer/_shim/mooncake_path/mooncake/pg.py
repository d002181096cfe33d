"""`mooncake.pg` is not offered by kvxfer's stand-in (see
`kvxfer.mooncake`: only the transfer engine is)."""

raise ImportError(
    "mooncake.pg: Mooncake's torch.distributed process group backend is not offered by kvxfer's stand-in for "
    "Mooncake, which provides the transfer engine (mooncake.engine) alone; install "
    "the real mooncake-transfer-engine and remove the stand-in "
    "(python -m kvxfer.shim uninstall mooncake) to use it",
    name="mooncake.pg",
)
