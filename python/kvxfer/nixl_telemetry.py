"""NIXL's telemetry file, written by the NIXL front: with telemetry on
(`NIXL_TELEMETRY_ENABLE`, else `capture_telemetry`) and
`NIXL_TELEMETRY_DIR` set, each agent keeps `<dir>/<agent name>`, the
shared ring of events that NIXL's `examples/python/telemetry_reader.py`
reads (format version 4).

The file: a 40-byte header (`write_pos`, `read_pos`: slot indices,
`size_t`; `version`, `expected_version`: `int`; `capacity` (a power of two,
`NIXL_TELEMETRY_BUFFER_SIZE`, 4096 by default) and `mask`: `size_t`), then
`capacity` events of 16 bytes (`u32` type, 4 bytes of padding, `u64`
value). The agent writes at `write_pos`, a reader takes from `read_pos`;
one slot stays empty, and an event that finds the ring full is dropped and
counted (`AGENT_TELEMETRY_EVENTS_DROPPED` once there is room). Events go
in as they happen (NIXL stages them for up to 100 ms). Per transfer, when
it ends: post time and transfer time (µs), bytes and one request, as sent
(WRITE) or received (READ); memory registered and deregistered (bytes);
one per error status. `NIXL_TELEMETRY_ENABLED_METRICS` (comma-separated
glob patterns of the event names) keeps some only.
"""

import fnmatch
import mmap
import os
import struct
import threading

VERSION = 4
(TX_BYTES, RX_BYTES, TX_REQUESTS_NUM, RX_REQUESTS_NUM, MEMORY_REGISTERED,
 MEMORY_DEREGISTERED, XFER_TIME, XFER_POST_TIME) = range(8)
# NIXL's error statuses (-1 .. -9), then its remote-disconnect, cancelled
# and no-telemetry errors.
ERR_FIRST = 8
ERR_REMOTE_DISCONNECT, ERR_CANCELED, ERR_NO_TELEMETRY = 17, 18, 19
EVENTS_DROPPED = 20
NAMES = [
    "agent_tx_bytes", "agent_rx_bytes", "agent_tx_requests_num", "agent_rx_requests_num",
    "agent_memory_registered", "agent_memory_deregistered", "agent_xfer_time",
    "agent_xfer_post_time", "agent_err_not_posted", "agent_err_invalid_param",
    "agent_err_backend", "agent_err_not_found", "agent_err_mismatch", "agent_err_not_allowed",
    "agent_err_repost_active", "agent_err_unknown", "agent_err_not_supported",
    "agent_err_remote_disconnect", "agent_err_canceled", "agent_err_no_telemetry",
    "agent_telemetry_events_dropped",
]
_HEADER = struct.Struct("=QQiiQQ")
_EVENT = struct.Struct("=I4xQ")


def open_for(agent_name, enabled):
    """The agent's telemetry file when telemetry is `enabled` and
    `NIXL_TELEMETRY_DIR` is set, else None. Raises `ValueError` for a
    buffer size that is no power of two, `OSError` when the file cannot
    be made."""
    d = os.environ.get("NIXL_TELEMETRY_DIR")
    if not enabled or not d:
        return None
    size = int(os.environ.get("NIXL_TELEMETRY_BUFFER_SIZE", "4096"))
    if size <= 0 or size & (size - 1):
        raise ValueError(f"NIXL_TELEMETRY_BUFFER_SIZE={size}: a power of two is needed")
    spec = os.environ.get("NIXL_TELEMETRY_ENABLED_METRICS", "")
    patterns = [t.strip() for t in spec.split(",") if t.strip()]
    on = [not patterns or any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in NAMES]
    return TelemetryFile(os.path.join(d, agent_name), size, on)


class TelemetryFile:
    """One agent's ring of telemetry events in a shared file."""

    def __init__(self, path, capacity, on):
        self.path = path
        self._cap = capacity
        self._on = on
        self._lock = threading.Lock()
        self._dropped = 0
        size = _HEADER.size + _EVENT.size * capacity
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, 0, 0, VERSION, VERSION, capacity, capacity - 1)

    def _push(self, kind, value):
        write, read = struct.unpack_from("=QQ", self._map, 0)
        nxt = (write + 1) & (self._cap - 1)
        if nxt == read:
            return False
        _EVENT.pack_into(self._map, _HEADER.size + _EVENT.size * write, kind, value)
        # The slot first, then the position that shows it to the reader.
        struct.pack_into("=Q", self._map, 0, nxt)
        return True

    def events(self, *pairs):
        """Adds `(type, value)` events, all or none (a batch that does not
        fit is dropped and counted)."""
        pairs = [(k, v) for k, v in pairs if self._on[k]]
        if not pairs:
            return
        with self._lock:
            if self._dropped and self._on[EVENTS_DROPPED] and self._room() > len(pairs):
                self._push(EVENTS_DROPPED, self._dropped)
                self._dropped = 0
            if self._room() < len(pairs):
                self._dropped += len(pairs)
                return
            for k, v in pairs:
                self._push(k, max(0, int(v)))

    def _room(self):
        write, read = struct.unpack_from("=QQ", self._map, 0)
        return self._cap - 1 - ((write - read) & (self._cap - 1))

    def transfer(self, write, nbytes, post_us, xfer_us):
        """A transfer that ended."""
        self.events(
            (XFER_POST_TIME, post_us),
            (XFER_TIME, xfer_us),
            (TX_BYTES if write else RX_BYTES, nbytes),
            (TX_REQUESTS_NUM if write else RX_REQUESTS_NUM, 1),
        )

    def error(self, status):
        """One error of NIXL status `status` (negative)."""
        if -9 <= status <= -1:
            self.events((ERR_FIRST - 1 - status, 1))

    def close(self):
        """Flushes and unmaps (the file stays, as NIXL leaves it)."""
        with self._lock:
            if not self._map.closed:
                self._map.flush()
                self._map.close()
