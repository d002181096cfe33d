"""kvxfer.mooncake against the real Mooncake TransferEngine: the same
scripted sequence (SGLang's batch write, single writes and reads, a write
outside the peer's memory) in two processes, once per implementation;
return codes and destination bytes must match."""

import ctypes
import importlib
import multiprocessing as mp
import time
import urllib.error

import pytest

SIZE = 1 << 20
WAIT = 60.0
spawn = mp.get_context("spawn")


def pattern(n, salt):
    return bytes((i * 13 + salt) % 251 for i in range(n))


def engine(module):
    return importlib.import_module(module).TransferEngine()


def target_main(conn, module):
    te = engine(module)
    rc_init = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = ctypes.create_string_buffer(pattern(SIZE, 1), SIZE)
    addr = ctypes.addressof(buf)
    rc_reg = te.register_memory(addr, SIZE)
    conn.send((rc_init, rc_reg, f"127.0.0.1:{te.get_rpc_port()}", addr))
    conn.recv()
    conn.send((buf.raw, te.unregister_memory(addr)))
    conn.recv()


def initiator_main(conn, module, session, dst):
    te = engine(module)
    rcs = [te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")]
    src = ctypes.create_string_buffer(pattern(SIZE, 2), SIZE)
    s = ctypes.addressof(src)
    rcs.append(te.register_memory(s, SIZE))
    # SGLang's shape: one batch per layer, pages grouped, any order.
    rcs.append(
        te.batch_transfer_sync_write(
            session, [s, s + 4096, s + 65536], [dst + 8192, dst, dst + 131072], [4096, 4096, 65536]
        )
    )
    rcs.append(te.transfer_sync_write(session, s + 200_000, dst + 300_000, 1000))
    rcs.append(te.transfer_sync_read(session, s + 500_000, dst + 700_000, 4096))
    # Outside what the peer registered.
    rcs.append(te.transfer_sync_write(session, s, dst + SIZE + (1 << 20), 4096))
    rcs.append(te.batch_register_memory([], []))
    rcs.append(te.unregister_memory(s))
    conn.send((rcs, src.raw))
    conn.recv()


def run(module):
    tconn, tchild = spawn.Pipe()
    t = spawn.Process(target=target_main, args=(tchild, module))
    t.start()
    try:
        assert tconn.poll(WAIT), f"{module}: target did not start"
        rc_init, rc_reg, session, dst = tconn.recv()
        iconn, ichild = spawn.Pipe()
        i = spawn.Process(target=initiator_main, args=(ichild, module, session, dst))
        i.start()
        try:
            assert iconn.poll(WAIT), f"{module}: initiator did not report"
            rcs, src = iconn.recv()
            iconn.send("stop")
        finally:
            i.join(WAIT)
            if i.is_alive():
                i.kill()
        tconn.send("report")
        assert tconn.poll(WAIT), f"{module}: target did not report"
        dst_bytes, rc_unreg = tconn.recv()
        tconn.send("stop")
        return [rc_init, rc_reg] + rcs + [rc_unreg], dst_bytes, src
    finally:
        t.join(WAIT)
        if t.is_alive():
            t.kill()


def test_kvxfer_mooncake_runs_the_sglang_sequence():
    rcs, dst, src = run("kvxfer.mooncake")
    assert rcs == [0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0], rcs
    want = bytearray(pattern(SIZE, 1))
    s = pattern(SIZE, 2)
    want[8192:8192 + 4096] = s[0:4096]
    want[0:4096] = s[4096:8192]
    want[131072:131072 + 65536] = s[65536:131072]
    want[300_000:301_000] = s[200_000:201_000]
    assert dst == bytes(want)
    # The read brought the peer's bytes.
    assert src[500_000:504_096] == pattern(SIZE, 1)[700_000:704_096]


def test_same_results_as_the_real_mooncake():
    try:
        importlib.import_module("mooncake.engine")
    except ImportError as e:
        pytest.skip(f"SKIPPED: the real Mooncake is not installed here ({e})")
    real = run("mooncake.engine")
    ours = run("kvxfer.mooncake")
    assert ours[0] == real[0], f"return codes: kvxfer {ours[0]} vs mooncake {real[0]}"
    assert ours[1] == real[1], "destination bytes differ"
    assert ours[2] == real[2], "read-back bytes differ"


def test_rdma_falls_back_to_tcp_unless_required(monkeypatch):
    import kvxfer
    from kvxfer.mooncake import TransferEngine

    try:
        kvxfer.Agent("rdma-probe", backend="rdma")
        pytest.skip("SKIPPED: this host has an RDMA device; the fallback needs a host without one")
    except kvxfer.KvxferError:
        pass
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    assert te.get_transport() == "tcp"
    strict = TransferEngine(require_protocol=True)
    assert strict.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == -1
    assert isinstance(strict.get_last_error(), kvxfer.KvxferError)
    # SGLang's MOONCAKE_PROTOCOL=efa on a host without EFA: TCP.
    monkeypatch.delenv("KVXFER_FABRIC_PROVIDER", raising=False)
    efa = TransferEngine()
    assert efa.initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "") == 0
    assert efa.get_transport() == "tcp"
    assert TransferEngine(require_protocol=True).initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "") == -1
    monkeypatch.setenv("KVXFER_REQUIRE_PROTOCOL", "1")
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == -1
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1


def test_efa_devices_are_rails():
    """Protocol `"efa"` takes each device named as a rail: its RDM domain."""
    from kvxfer.mooncake import _efa

    assert _efa("rdmap16s27, rdmap32s27") == {
        "fabric_provider": "efa",
        "fabric_domain": "rdmap16s27-rdm,rdmap32s27-rdm",
    }
    assert _efa("")["fabric_domain"] is None


@pytest.mark.parametrize("rails", [1, 2])
def test_efa_runs_on_kvxfer_fabric(monkeypatch, rails):
    """Protocol `"efa"` is kvxfer's libfabric transport: here with provider
    `tcp;ofi_rxm` standing in for `efa`, a WRITE and a READ between two
    engines; with `rails` 2, the initiating engine has two rails (the
    loopback domain twice) and the other one."""
    from kvxfer.mooncake import TransferEngine

    monkeypatch.setenv("KVXFER_FABRIC_PROVIDER", "tcp;ofi_rxm")
    a, b = TransferEngine(require_protocol=True), TransferEngine(require_protocol=True)
    if rails > 1:
        monkeypatch.setenv("KVXFER_FABRIC_DOMAIN", ",".join(["lo"] * rails))
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "") == 0
    monkeypatch.delenv("KVXFER_FABRIC_DOMAIN", raising=False)
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "") == 0
    assert a.get_transport() == "efa"
    n = 1 << 20
    src = ctypes.create_string_buffer(bytes((i * 7) % 251 for i in range(n)), n)
    dst = ctypes.create_string_buffer(n)
    back = ctypes.create_string_buffer(n)
    assert a.register_memory(ctypes.addressof(src), n) == 0
    assert a.register_memory(ctypes.addressof(back), n) == 0
    assert b.register_memory(ctypes.addressof(dst), n) == 0
    peer = f"127.0.0.1:{b.get_rpc_port()}"
    assert a.transfer_sync_write(peer, ctypes.addressof(src), ctypes.addressof(dst), n) == 0
    assert dst.raw == src.raw
    assert a.transfer_sync_read(peer, ctypes.addressof(back), ctypes.addressof(dst), n) == 0
    assert back.raw == src.raw


def test_bad_input_changes_nothing():
    from kvxfer.mooncake import TransferEngine

    te = TransferEngine()
    assert te.register_memory(4096, 4096) == -1  # not initialized
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = ctypes.create_string_buffer(4096)
    addr = ctypes.addressof(buf)
    assert te.register_memory(addr, 4096) == 0
    assert te.register_memory(addr + 1024, 1024) == -7  # overlaps
    assert te.batch_register_memory([addr], []) == -1
    assert te.write_bytes_to_buffer(addr + 4000, b"x" * 200, 200) == -3  # runs past the region
    assert te.write_bytes_to_buffer(addr, b"x", 2) == -1  # shorter than length
    assert te.read_bytes_from_buffer(addr - 8, 16) == b""
    assert te.write_bytes_to_buffer(addr, b"abc", 3) == 0
    assert te.read_bytes_from_buffer(addr, 3) == b"abc"
    assert te.transfer_check_status(12345) == -1
    assert te.get_batch_transfer_status([12345]) == -1
    assert te.free_managed_buffer(addr, 4096) == -3  # not a managed buffer
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0  # again: kept
    assert te.unregister_memory(addr) == 0
    assert te.unregister_memory(addr) == -3


def test_http_metadata_server_bounds_and_refusals():
    import http.client
    import threading

    from kvxfer.mooncake_metadata import MetadataServer

    server = MetadataServer("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]

    def call(method, path, body=None, headers=None):
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        out = (r.status, r.read())
        c.close()
        return out

    try:
        assert call("GET", "/metadata?key=a")[0] == 404
        assert call("PUT", "/metadata?key=a", b"1")[0] == 200
        assert call("GET", "/metadata?key=a") == (200, b"1")
        assert call("PUT", "/metadata?key=mooncake/rpc_meta/x", b"1")[0] == 200
        assert call("PUT", "/metadata?key=mooncake/rpc_meta/x", b"2")[0] == 400  # held
        assert call("GET", "/metadata")[0] == 400  # no key
        assert call("GET", "/other?key=a")[0] == 404
        too_big = {"Content-Length": str(64 << 20)}
        assert call("PUT", "/metadata?key=b", b"", too_big)[0] == 413
        assert call("DELETE", "/metadata?key=a")[0] == 200
        assert call("DELETE", "/metadata?key=a")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_http_metadata_server_holds_its_bounds_against_abuse(monkeypatch):
    """An entry is replaced or deleted only by its writer; values, keys and
    connections are bounded; a silent or trickling connection is closed at
    its deadline, and a legitimate engine is served throughout."""
    import http.client
    import socket
    import threading
    import time

    from kvxfer import mooncake_metadata as mm

    monkeypatch.setattr(mm, "MAX_TOTAL", 1000)
    monkeypatch.setattr(mm, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(mm, "DEADLINE", 1.0)
    server = mm.MetadataServer("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]

    def call(method, path, body=None, source="127.0.0.1"):
        c = http.client.HTTPConnection(host, port, timeout=30, source_address=(source, 0))
        c.request(method, path, body=body)
        r = c.getresponse()
        out = (r.status, r.read())
        c.close()
        return out

    try:
        assert call("PUT", "/metadata?key=mine", b"x" * 600)[0] == 200
        # Another address can neither replace nor delete it.
        assert call("PUT", "/metadata?key=mine", b"y", source="127.0.0.2")[0] == 403
        assert call("DELETE", "/metadata?key=mine", source="127.0.0.2")[0] == 403
        assert call("GET", "/metadata?key=mine") == (200, b"x" * 600)
        # 1000 bytes of values in all (600 held): 500 more is refused,
        # replacing the 600 with 900 is not.
        assert call("PUT", "/metadata?key=other", b"z" * 500, source="127.0.0.2")[0] == 507
        assert call("PUT", "/metadata?key=mine", b"w" * 900)[0] == 200
        # Four silent connections fill the server; a fifth is closed at
        # once; after the deadline the silent ones are closed too and a
        # legitimate call goes through.
        silent = [socket.create_connection((host, port)) for _ in range(4)]
        silent[0].sendall(b"GET /metadata?key=mine HTTP/1.1\r\n")  # trickles
        time.sleep(0.2)
        extra = socket.create_connection((host, port))
        extra.settimeout(30)
        assert extra.recv(1) == b""
        for s in silent:
            s.settimeout(30)
            t0 = time.monotonic()
            assert s.recv(1) == b""
            assert time.monotonic() - t0 < 10
        # Their threads let their places go (a moment after the close each
        # client saw).
        assert server.wait_idle(30)
        assert call("GET", "/metadata?key=mine") == (200, b"w" * 900)
        assert call("DELETE", "/metadata?key=mine")[0] == 200
        assert server.total == 0
    finally:
        server.shutdown()
        server.server_close()


def test_http_metadata_server_with_a_secret_takes_writes_only_from_members(monkeypatch):
    """Given the cluster secret, the server takes a PUT or DELETE only with
    a fresh proof of it: none, a wrong secret, a stale clock or a replay is
    refused (401) and changes nothing; reads stay open; kvxfer's Mooncake
    front, holding the secret, publishes and withdraws as before."""
    import http.client
    import threading

    from kvxfer import mooncake_metadata as mm
    from kvxfer.mooncake import _Metadata

    secret = b"5c0d9e2a7f41b836-d2e7a90c4f1b5e63"
    server = mm.MetadataServer("127.0.0.1", 0, secret)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]

    def call(method, key, body=b"", auth=None):
        c = http.client.HTTPConnection(host, port, timeout=10)
        headers = {mm.AUTH_HEADER: auth} if auth else {}
        c.request(method, f"/metadata?key={key}", body=body, headers=headers)
        r = c.getresponse()
        out = (r.status, r.read())
        c.close()
        return out

    try:
        assert call("PUT", "k", b"v")[0] == 401
        wrong = mm.auth_header(b"another-cluster-0f9e8d7c6b5a4938", "PUT", "k", b"v")
        assert call("PUT", "k", b"v", wrong)[0] == 401
        stale = mm.auth_header(secret, "PUT", "k", b"v", now=time.time() - 600)
        assert call("PUT", "k", b"v", stale)[0] == 401
        other_body = mm.auth_header(secret, "PUT", "k", b"w")
        assert call("PUT", "k", b"v", other_body)[0] == 401
        assert call("GET", "k")[0] == 404
        good = mm.auth_header(secret, "PUT", "k", b"v")
        assert call("PUT", "k", b"v", good)[0] == 200
        assert call("PUT", "k", b"v", good)[0] == 401  # replayed
        assert call("GET", "k") == (200, b"v")  # reads stay open
        assert call("DELETE", "k")[0] == 401
        assert call("DELETE", "k", b"", mm.auth_header(secret, "DELETE", "k", b""))[0] == 200
        # The front reads the secret as the agents do.
        monkeypatch.setenv("KVXFER_SECRET", secret.decode())
        meta = _Metadata(server.url)
        meta.publish("engine-a", "127.0.0.1:1234", "127.0.0.1", 1234)
        assert meta.lookup("engine-a") == "127.0.0.1:1234"
        meta.withdraw("engine-a")
        assert call("GET", "mooncake/rpc_meta/engine-a")[0] == 404
        monkeypatch.delenv("KVXFER_SECRET")
        try:
            _Metadata(server.url).publish("engine-b", "x", "127.0.0.1", 1)
            raise AssertionError("published without the secret")
        except urllib.error.HTTPError as e:
            assert e.code == 401
    finally:
        server.shutdown()
        server.server_close()
