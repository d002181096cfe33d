"""`mooncake.mooncake_connector_v1` is not offered by kvxfer's stand-in (see
`kvxfer.mooncake`: only the transfer engine is)."""

raise ImportError(
    "mooncake.mooncake_connector_v1: Mooncake's own vLLM connector (vLLM's NIXL connector runs on kvxfer.nixl) is not offered by kvxfer's stand-in for "
    "Mooncake, which provides the transfer engine (mooncake.engine) alone; install "
    "the real mooncake-transfer-engine and remove the stand-in "
    "(python -m kvxfer.shim uninstall mooncake) to use it",
    name="mooncake.mooncake_connector_v1",
)
