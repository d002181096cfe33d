"""Mooncake's HTTP metadata server, served by kvxfer
(`kvxfer.mooncake_metadata`): `python -m mooncake.http_metadata_server
--port 8080`."""

from kvxfer.mooncake_metadata import MetadataServer, main  # noqa: F401

if __name__ == "__main__":
    main()
