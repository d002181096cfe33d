"""Objects through the native API, against the S3 server that ci/test.sh
starts (KVXFER_S3_ENDPOINT, KVXFER_S3_BUCKET; credentials from the AWS
environment): a buffer PUT into an object (a multipart upload) and read
back in ranges, and the typed failure of a missing key."""

import os

import pytest

import kvxfer

WAIT = 60.0
ENDPOINT = os.environ.get("KVXFER_S3_ENDPOINT")
BUCKET = os.environ.get("KVXFER_S3_BUCKET")

pytestmark = pytest.mark.skipif(
    not (ENDPOINT and BUCKET),
    reason="SKIPPED: no S3 server (KVXFER_S3_ENDPOINT unset; ci/test.sh starts one)",
)


def test_a_buffer_goes_to_an_object_and_comes_back_in_ranges():
    agent = kvxfer.Agent("py-obj", backend="tcp")
    n = (9 << 20) + 5  # more than one 8 MiB part: a multipart upload
    key = f"py/{os.getpid()}/kv"
    handle = agent.open_object(BUCKET, key, endpoint=ENDPOINT)
    agent.register_raw([(0, n, handle)], mem_type="obj")
    src = bytearray(os.urandom(n))
    back = bytearray(n)
    s = agent.register(src)
    b = agent.register(back)
    t = agent.transfer("write", [(s.addr, n)], [(0, n)], "py-obj",
                       remote_mem="obj", remote_device=handle)
    t.wait(WAIT)
    assert t.state == "DONE"
    assert t.transport == "storage"
    # Two ranges, the second across the parts' boundary, landing swapped.
    half = n // 2
    t = agent.transfer("read", [(b.addr + half, n - half), (b.addr, half)],
                       [(half, n - half), (0, half)], "py-obj",
                       remote_mem="obj", remote_device=handle)
    t.wait(WAIT)
    assert bytes(back[half:]) == bytes(src[half:]) and bytes(back[:half]) == bytes(src[:half])
    # A WRITE not at offset 0 is refused before anything is sent.
    with pytest.raises(kvxfer.InvalidDescriptorError):
        agent.transfer("write", [(s.addr, 100)], [(100, 100)], "py-obj",
                       remote_mem="obj", remote_device=handle)
    # A key that does not exist: the transfer fails, typed.
    missing = agent.open_object(BUCKET, key + "-missing", endpoint=ENDPOINT)
    agent.register_raw([(0, 100, missing)], mem_type="obj")
    t = agent.transfer("read", [(b.addr, 100)], [(0, 100)], "py-obj",
                       remote_mem="obj", remote_device=missing)
    with pytest.raises(kvxfer.ObjectStoreError, match="no such key"):
        t.wait(WAIT)
    with pytest.raises(kvxfer.InvalidRequestError):
        agent.close_storage(handle)
    agent.deregister_raw([(0, n, handle)], mem_type="obj")
    agent.deregister_raw([(0, 100, missing)], mem_type="obj")
    agent.close_storage(handle)
    agent.close_storage(missing)


def test_a_peers_object_through_its_agent():
    target = kvxfer.Agent("py-obj-target", backend="tcp")
    n = (6 << 20) + 3
    key = f"py/{os.getpid()}/peer"
    handle = target.open_object(BUCKET, key, endpoint=ENDPOINT)
    target.register_raw([(0, n, handle)], mem_type="obj")
    agent = kvxfer.Agent("py-obj-init", backend="tcp")
    name = agent.connect(target.connection_info())
    src = bytearray(os.urandom(n))
    back = bytearray(n)
    s = agent.register(src)
    b = agent.register(back)
    t = agent.transfer("write", [(s.addr, n)], [(0, n)], name, notif=b"stored",
                       remote_mem="obj", remote_device=handle)
    t.wait(WAIT)
    assert t.transport == "tcp"
    assert target.wait_notifs(WAIT) == {"py-obj-init": [b"stored"]}
    t = agent.transfer("read", [(b.addr, n)], [(0, n)], name,
                       remote_mem="obj", remote_device=handle)
    t.wait(WAIT)
    assert bytes(back) == bytes(src)
    s.deregister()
    b.deregister()
    target.deregister_raw([(0, n, handle)], mem_type="obj")
    target.close_storage(handle)
