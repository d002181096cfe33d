"""The KV-cache protocol's Python surface: layouts, typed errors."""

import pytest

import kvxfer


def test_layouts_and_block_sizes():
    ctx = kvxfer.CacheState(4, 4, 64, 16, "bf16", tp=2)
    gen = kvxfer.CacheState(4, 8, 64, 16, "bf16", tp=1)
    assert ctx.world_size == 2 and gen.world_size == 1
    # [layer][k|v][head][token][dim] x 2 bytes.
    assert kvxfer.block_bytes(ctx, 0, gen) == 4 * 2 * 4 * 16 * 64 * 2
    assert kvxfer.block_bytes(gen, 0, ctx) == 4 * 2 * 8 * 16 * 64 * 2
    buf = bytearray(kvxfer.block_bytes(ctx, 1, gen))
    kvxfer.pattern_fill(ctx, 1, gen, buf, 0, 3)
    assert kvxfer.pattern_check(ctx, 1, gen, buf, 0, 3, 64) is None
    assert kvxfer.pattern_check(ctx, 1, gen, bytes(buf), 0, 3, 64) is None
    buf[100] ^= 0xFF
    assert "block 3" in kvxfer.pattern_check(ctx, 1, gen, buf, 0, 3, 64)
    with pytest.raises(ValueError):
        kvxfer.pattern_fill(ctx, 1, gen, buf, 1, 0)  # runs past the end


def test_bad_layouts_are_typed_errors():
    with pytest.raises(ValueError):
        kvxfer.CacheState(4, 4, 64, 16, "f64")
    with pytest.raises(kvxfer.CacheProtocolError):
        kvxfer.CacheState(0, 4, 64, 16, "bf16")
    assert issubclass(kvxfer.CacheProtocolError, kvxfer.KvxferError)
    a = kvxfer.Agent("py-cache-bad")
    ctx = kvxfer.CacheState(4, 4, 64, 16, "bf16", tp=2)
    gen_other_dtype = kvxfer.CacheState(4, 8, 64, 16, "f16", tp=1)
    # Incompatible with the context side: refused at construction.
    with pytest.raises(kvxfer.CacheProtocolError):
        kvxfer.CacheReceiver(a, gen_other_dtype, 0, ctx, ["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(kvxfer.CacheProtocolError):
        kvxfer.CacheSender(a, ctx, 5)  # rank outside TP2


def test_a_request_nobody_answers_times_out_typed():
    ctx = kvxfer.CacheState(2, 2, 16, 4, "bf16", tp=1)
    t = kvxfer.Agent("py-cache-ctx")
    g = kvxfer.Agent("py-cache-gen")
    buf = bytearray(kvxfer.block_bytes(ctx, 0, ctx) * 2)
    reg = g.register(buf)
    # The context agent exists but runs no sender: nobody answers.
    r = kvxfer.CacheReceiver(
        g, ctx, 0, ctx, [t.connection_info()], timeout=0.5, settle_timeout=0.5
    )
    h = r.request(1, [reg.addr])
    # Nobody confirms that it stopped writing either: the outcome says so,
    # and the blocks are not reported safe to reuse.
    assert issubclass(kvxfer.CacheUnsettledError, kvxfer.CacheProtocolError)
    with pytest.raises(kvxfer.CacheUnsettledError, match="timed out"):
        h.wait(30.0)
    with pytest.raises(kvxfer.CacheProtocolError, match="settling timed out"):
        h.wait_settled(0.1)
    m = r.metrics()
    assert (m["failed"], m["unsettled"], m["strangers"]) == (1, 1, 0)
    assert bytes(buf) == bytes(len(buf))


@pytest.mark.parametrize("integrity", [False, True])
def test_layer_by_layer_out_of_order(integrity):
    """Also with end-to-end integrity asked by the receiver: every write
    checked where it lands before its layer is reported."""
    st = kvxfer.CacheState(4, 2, 16, 4, "bf16", tp=1)
    c = kvxfer.Agent(f"py-lw-ctx-{integrity}")
    g = kvxfer.Agent(f"py-lw-gen-{integrity}")
    bb = kvxfer.block_bytes(st, 0, st)
    src = bytearray(bb * 2)
    dst = bytearray(bb * 2)
    for b in range(2):
        kvxfer.pattern_fill(st, 0, st, src, b * bb, b)
    rs = c.register(src)
    rd = g.register(dst)
    s = kvxfer.CacheSender(c, st, 0)
    r = kvxfer.CacheReceiver(g, st, 0, st, [c.connection_info()], integrity=integrity)
    assert s.held_layers == (0, 4)
    h = r.request(5, [rd.addr, rd.addr + bb])
    sh = s.begin(5, [rs.addr, rs.addr + bb])
    assert h.layers_landed() == []
    with pytest.raises(kvxfer.CacheProtocolError, match="layers"):
        s.layers_ready(5, 4)
    with pytest.raises(kvxfer.CacheProtocolError, match="unknown request"):
        s.layers_ready(6, 0)
    # Each layer lands before the next is ready.
    for n, layer in enumerate((2, 0, 3, 1)):
        s.layers_ready(5, layer)
        h.wait_layers(layer, timeout=30.0)
        assert len(h.layers_landed()) == n + 1
        assert (layer, layer + 1) in h.layers_landed()
    assert sh.wait(30.0)["bytes"] == h.wait(30.0)["bytes"] == 2 * bb
    for b in range(2):
        assert kvxfer.pattern_check(st, 0, st, dst, b * bb, b, 8) is None
