//! The KV-cache protocol through the C ABI: a context rank's sender and a
//! generation rank's receiver over agents made with `kvxfer_agent_new`,
//! with a handle per request to wait on, and cancellation.

use std::ffi::c_char;
use std::sync::Arc;
use std::time::Duration;

use kvxfer_core::cache::{
    Attention, CacheError, CacheReceiver, CacheSender, CacheState, DataType, ReceiverConfig,
    RecvHandle, RecvRequest, SendHandle, SenderConfig, SessionStats,
};

use super::kvxfer_result::*;
use super::{
    Fail, Kind, boundary, free_handle, hand_out, kvxfer_agent, kvxfer_result, live, non_null,
    slice, text,
};

/// Element type of a KV-cache pool (`kvxfer_cache_state.dtype`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvxfer_dtype {
    /// 32-bit float.
    KVXFER_DTYPE_F32 = 0,
    /// 16-bit float.
    KVXFER_DTYPE_F16 = 1,
    /// bfloat16.
    KVXFER_DTYPE_BF16 = 2,
    /// 8-bit float (E4M3 or E5M2).
    KVXFER_DTYPE_FP8 = 3,
    /// 8-bit integer.
    KVXFER_DTYPE_I8 = 4,
}

/// One executor's KV-cache layout (TensorRT-LLM's `CacheState`). Blocks
/// are `[layer][k|v][head][token][dim]` per rank (see `docs/c-api.md`).
#[repr(C)]
pub struct kvxfer_cache_state {
    /// Layers of the model.
    pub layers: u32,
    /// KV heads per rank per layer.
    pub kv_heads_per_rank: u32,
    /// Elements per head.
    pub head_size: u32,
    /// Token slots per block.
    pub tokens_per_block: u32,
    /// Element type.
    pub dtype: kvxfer_dtype,
    /// 0: multi-head / grouped-query attention (K and V); 1 or 2:
    /// multi-head latent attention with that many tensors per layer.
    pub mla_kv_factor: u32,
    /// Tensor-parallel ranks.
    pub tp: u32,
    /// Pipeline-parallel ranks.
    pub pp: u32,
    /// Attention data-parallel groups (0: none) and this rank's group.
    pub dp_size: u32,
    /// This rank's attention-DP group (with `dp_size` > 0).
    pub dp_rank: u32,
    /// `pp` layer counts, one per PP rank; NULL: as even as possible.
    pub layers_per_pp: *const u32,
}

/// What one side measured for one request.
#[repr(C)]
#[derive(Default)]
pub struct kvxfer_cache_stats {
    /// Bytes moved.
    pub bytes: u64,
    /// Fragments before coalescing.
    pub fragments: u64,
    /// Fragments written (after coalescing).
    pub fragments_coalesced: u64,
    /// From the first byte posted (or the first `Ready`) to the last share
    /// landing, in microseconds.
    pub transmission_us: u64,
}

/// A context rank's KV-cache sender. Thread-safe; free once.
pub struct kvxfer_cache_sender {
    sender: CacheSender,
}

/// A generation rank's KV-cache receiver. Thread-safe; free once.
pub struct kvxfer_cache_receiver {
    receiver: CacheReceiver,
}

/// One request being sent or received: wait on it, then free it.
pub struct kvxfer_cache_handle {
    inner: HandleKind,
}

enum HandleKind {
    Send(SendHandle),
    Recv(RecvHandle),
}

fn cache_fail(e: CacheError) -> Fail {
    let code = match &e {
        CacheError::InvalidState(_)
        | CacheError::Incompatible { .. }
        | CacheError::DuplicateRequest(_)
        | CacheError::UnknownRequest(_)
        | CacheError::LayersOutOfRange { .. } => KVXFER_ERR_INVALID_ARGUMENT,
        CacheError::Protocol { .. } => KVXFER_ERR_PROTOCOL,
        CacheError::Timeout { .. } => KVXFER_ERR_TIMEOUT,
        CacheError::Cancelled { .. } | CacheError::UnknownBlockKey(_) => KVXFER_ERR_CANCELLED,
        CacheError::Transfer(t) => return Fail::from(t.clone()),
        CacheError::Closed => KVXFER_ERR_CLOSED,
        CacheError::Unsettled { .. } => KVXFER_ERR_UNSETTLED,
        CacheError::Integrity { .. } => KVXFER_ERR_INTEGRITY,
        _ => KVXFER_ERR_IO,
    };
    Fail::new(code, e.to_string())
}

/// The Rust state a C state describes (checked by the sender/receiver).
///
/// # Safety
/// `s.layers_per_pp` is NULL or valid for `s.pp` reads.
unsafe fn state_from(s: &kvxfer_cache_state, what: &str) -> Result<CacheState, Fail> {
    let attention = match s.mla_kv_factor {
        0 => Attention::Default,
        k => Attention::Mla { kv_factor: k },
    };
    let dtype = match s.dtype {
        kvxfer_dtype::KVXFER_DTYPE_F32 => DataType::F32,
        kvxfer_dtype::KVXFER_DTYPE_F16 => DataType::F16,
        kvxfer_dtype::KVXFER_DTYPE_BF16 => DataType::Bf16,
        kvxfer_dtype::KVXFER_DTYPE_FP8 => DataType::Fp8,
        kvxfer_dtype::KVXFER_DTYPE_I8 => DataType::I8,
    };
    let mut st = CacheState::new(
        s.layers,
        s.kv_heads_per_rank,
        s.head_size,
        s.tokens_per_block,
        dtype,
        attention,
        s.tp,
        s.pp,
    );
    if !s.layers_per_pp.is_null() {
        // SAFETY: valid for `pp` reads per the contract.
        let split = unsafe { slice(s.layers_per_pp, s.pp as usize, what)? };
        st = st.with_layers_per_pp(split.to_vec());
    }
    if s.dp_size > 0 {
        st = st.with_attention_dp(s.dp_rank, s.dp_size);
    }
    st.validate().map_err(cache_fail)?;
    Ok(st)
}

fn timeout_of(ms: i64) -> Duration {
    u64::try_from(ms).map_or(Duration::from_secs(60), Duration::from_millis)
}

/// A sender for context `rank` of an executor with `state`, writing from
/// pools registered with `agent` (it takes over the agent's sync
/// messages). `timeout_ms`: how long every counterpart has to ask and the
/// writes have to finish (negative: 60 s).
///
/// # Safety
/// `state` is valid (its `layers_per_pp` NULL or valid for `pp` reads);
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_sender_new(
    agent: *const kvxfer_agent,
    state: *const kvxfer_cache_state,
    rank: u32,
    timeout_ms: i64,
    out: *mut *mut kvxfer_cache_sender,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(state, "state")?;
        non_null(out, "out")?;
        // SAFETY: non-null and valid per the contract.
        let st = unsafe { state_from(&*state, "state.layers_per_pp")? };
        let config = SenderConfig {
            timeout: timeout_of(timeout_ms),
            ..SenderConfig::default()
        };
        let sender =
            CacheSender::new(Arc::clone(&a.agent), st, rank, None, config).map_err(cache_fail)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe {
            hand_out(
                out,
                Box::new(kvxfer_cache_sender { sender }),
                Kind::CacheSender,
            )
        }
    })
}

/// Sends request `request_id` from `n` blocks (start addresses, oldest
/// first), every layer computed, once every generation rank that targets
/// this rank has asked; `out` receives a handle to wait on.
///
/// # Safety
/// `blocks` is valid for `n` reads; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_sender_send(
    sender: *const kvxfer_cache_sender,
    request_id: u64,
    blocks: *const u64,
    n: usize,
    out: *mut *mut kvxfer_cache_handle,
) -> kvxfer_result {
    // SAFETY: the caller's contract, passed on.
    boundary(|| unsafe { open_send(sender, request_id, blocks, n, out, true) })
}

/// Layer-wise sending: request `request_id` will be in `n` blocks (as for
/// `kvxfer_cache_sender_send`) as the prefill computes it; each layer is
/// written once `kvxfer_cache_sender_layers_ready` marks it. `out`
/// receives a handle that completes when every layer landed.
///
/// # Safety
/// `blocks` is valid for `n` reads; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_sender_begin(
    sender: *const kvxfer_cache_sender,
    request_id: u64,
    blocks: *const u64,
    n: usize,
    out: *mut *mut kvxfer_cache_handle,
) -> kvxfer_result {
    // SAFETY: the caller's contract, passed on.
    boundary(|| unsafe { open_send(sender, request_id, blocks, n, out, false) })
}

/// Model layers `first_layer .. first_layer + count` of a request given to
/// `kvxfer_cache_sender_begin` hold their final values (call it after
/// their compute finished; for GPU pools, after the computing stream was
/// synchronised): their writes are posted now, or once the counterparts
/// asked. Marking a layer twice, or a request that already ended, is a
/// no-op. `KVXFER_ERR_INVALID_ARGUMENT` for layers outside this rank's
/// (or none), or a request never begun.
///
/// # Safety
/// `sender` is a handle from `kvxfer_cache_sender_new` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_sender_layers_ready(
    sender: *const kvxfer_cache_sender,
    request_id: u64,
    first_layer: u32,
    count: u32,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(sender, Kind::CacheSender, "sender")? };
        let layers = first_layer..first_layer.saturating_add(count);
        s.sender
            .layers_ready(request_id, layers)
            .map_err(cache_fail)?;
        Ok(KVXFER_OK)
    })
}

/// As `kvxfer_cache_sender_layers_ready`, once the GPU work recorded
/// before `cuda_event` (a `CUevent` / `cudaEvent_t` of device `device`'s
/// primary context, alive until then) completed: returns at once; one
/// thread of the sender waits on the events in the order given. A fault
/// in that work fails the request. Bad layers or request:
/// `KVXFER_ERR_INVALID_ARGUMENT`, checked now.
///
/// # Safety
/// `sender` is a handle from `kvxfer_cache_sender_new` (checked);
/// `cuda_event` is a live event of that context and stays so until the
/// layers are marked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_sender_layers_ready_after(
    sender: *const kvxfer_cache_sender,
    request_id: u64,
    first_layer: u32,
    count: u32,
    cuda_event: *mut std::ffi::c_void,
    device: u32,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(sender, Kind::CacheSender, "sender")? };
        non_null(cuda_event, "cuda_event")?;
        let layers = first_layer..first_layer.saturating_add(count);
        // SAFETY: the caller's contract on `cuda_event`.
        let event = unsafe { kvxfer_core::gpu::CudaEvent::from_raw(cuda_event as u64, device) };
        s.sender
            .layers_ready_after(request_id, layers, event)
            .map_err(cache_fail)?;
        Ok(KVXFER_OK)
    })
}

/// `kvxfer_cache_sender_send` (`all_ready`) or `_begin`.
///
/// # Safety
/// As `kvxfer_cache_sender_send`.
unsafe fn open_send(
    sender: *const kvxfer_cache_sender,
    request_id: u64,
    blocks: *const u64,
    n: usize,
    out: *mut *mut kvxfer_cache_handle,
    all_ready: bool,
) -> Result<kvxfer_result, Fail> {
    {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(sender, Kind::CacheSender, "sender")? };
        non_null(out, "out")?;
        // SAFETY: valid for `n` reads.
        let blocks = unsafe { slice(blocks, n, "blocks")? }.to_vec();
        let h = if all_ready {
            s.sender.send(request_id, blocks)
        } else {
            s.sender.begin(request_id, blocks)
        }
        .map_err(cache_fail)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe {
            hand_out(
                out,
                Box::new(kvxfer_cache_handle {
                    inner: HandleKind::Send(h),
                }),
                Kind::CacheHandle,
            )
        }
    }
}

/// Cancels a request being sent: returns once nothing of it is in flight
/// (the context blocks may be reused at once).
///
/// # Safety
/// `sender` is a handle from `kvxfer_cache_sender_new` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_sender_cancel(
    sender: *const kvxfer_cache_sender,
    request_id: u64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(sender, Kind::CacheSender, "sender")? };
        s.sender.cancel(request_id).map_err(cache_fail)?;
        Ok(KVXFER_OK)
    })
}

/// Stops and frees a sender; its open requests fail. NULL is a no-op.
///
/// # Safety
/// `sender` is NULL or a handle from `kvxfer_cache_sender_new` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_sender_free(
    sender: *mut kvxfer_cache_sender,
) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(sender, Kind::CacheSender, "sender") })
}

/// Settings of a KV-cache receiver beyond its layout
/// (`kvxfer_cache_receiver_new_with`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvxfer_cache_receiver_options {
    /// Bounds each request and each cancel, in milliseconds (negative:
    /// 60 s).
    pub timeout_ms: i64,
    /// How long the context ranks of a failed or cancelled request have to
    /// confirm that they stopped writing before its outcome is
    /// `KVXFER_ERR_UNSETTLED`, in milliseconds (negative: 10 s).
    pub settle_timeout_ms: i64,
    /// Nonzero: end-to-end integrity. The context ranks write with a
    /// CRC32C per piece, checked where it lands before anything is reported
    /// landed (`KVXFER_ERR_INTEGRITY` on a mismatch; host memory only).
    pub integrity: u8,
}

/// A receiver for generation `rank` of an executor with `state`, whose
/// pools are registered with `agent` (it takes over the agent's sync
/// messages). The context executor has `ctx_state`; its ranks are reachable
/// at `ctx_connections` (`n` connection infos, by context rank), which are
/// loaded now. `timeout_ms` bounds each request and each cancel (negative:
/// 60 s). `kvxfer_cache_receiver_new_with` takes more settings.
///
/// # Safety
/// The states are valid; `ctx_connections` holds `n` NUL-terminated
/// strings; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_receiver_new(
    agent: *const kvxfer_agent,
    state: *const kvxfer_cache_state,
    rank: u32,
    ctx_state: *const kvxfer_cache_state,
    ctx_connections: *const *const c_char,
    n: usize,
    timeout_ms: i64,
    out: *mut *mut kvxfer_cache_receiver,
) -> kvxfer_result {
    let options = kvxfer_cache_receiver_options {
        timeout_ms,
        settle_timeout_ms: -1,
        integrity: 0,
    };
    // SAFETY: forwarded contract; `options` is a live local.
    unsafe {
        kvxfer_cache_receiver_new_with(
            agent,
            state,
            rank,
            ctx_state,
            ctx_connections,
            n,
            &options,
            out,
        )
    }
}

/// As `kvxfer_cache_receiver_new`, with the settings in `options`.
///
/// # Safety
/// As `kvxfer_cache_receiver_new`; `options` is valid for a read.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvxfer_cache_receiver_new_with(
    agent: *const kvxfer_agent,
    state: *const kvxfer_cache_state,
    rank: u32,
    ctx_state: *const kvxfer_cache_state,
    ctx_connections: *const *const c_char,
    n: usize,
    options: *const kvxfer_cache_receiver_options,
    out: *mut *mut kvxfer_cache_receiver,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(state, "state")?;
        non_null(ctx_state, "ctx_state")?;
        non_null(options, "options")?;
        non_null(out, "out")?;
        // SAFETY: non-null and valid per the contract.
        let st = unsafe { state_from(&*state, "state.layers_per_pp")? };
        // SAFETY: as above.
        let ctx = unsafe { state_from(&*ctx_state, "ctx_state.layers_per_pp")? };
        // SAFETY: non-null and valid for a read per the contract.
        let o = unsafe { *options };
        // SAFETY: valid for `n` reads.
        let ptrs = unsafe { slice(ctx_connections, n, "ctx_connections")? };
        let conns = ptrs
            .iter()
            // SAFETY: each is NUL-terminated per the contract.
            .map(|&p| unsafe { text(p, "ctx_connections[i]") }.map(str::to_owned))
            .collect::<Result<Vec<_>, _>>()?;
        let defaults = ReceiverConfig::default();
        let config = ReceiverConfig {
            timeout: timeout_of(o.timeout_ms),
            settle_timeout: u64::try_from(o.settle_timeout_ms)
                .map_or(defaults.settle_timeout, Duration::from_millis),
            integrity: o.integrity != 0,
            ..defaults
        };
        let receiver = CacheReceiver::new(Arc::clone(&a.agent), st, rank, ctx, &conns, config)
            .map_err(cache_fail)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe {
            hand_out(
                out,
                Box::new(kvxfer_cache_receiver { receiver }),
                Kind::CacheReceiver,
            )
        }
    })
}

/// Asks the context ranks for request `request_id` into `n` destination
/// blocks (start addresses in this rank's registered pool, oldest first;
/// written whole, padding slots of the last one included), served by the
/// context side's attention-DP group `ctx_dp_rank`; `out` receives a
/// handle to wait on.
///
/// # Safety
/// `blocks` is valid for `n` reads; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_receiver_request(
    receiver: *const kvxfer_cache_receiver,
    request_id: u64,
    ctx_dp_rank: u32,
    blocks: *const u64,
    n: usize,
    out: *mut *mut kvxfer_cache_handle,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let r = unsafe { live(receiver, Kind::CacheReceiver, "receiver")? };
        non_null(out, "out")?;
        // SAFETY: valid for `n` reads.
        let blocks = unsafe { slice(blocks, n, "blocks")? }.to_vec();
        let h = r
            .receiver
            .request(RecvRequest {
                request_id,
                ctx_dp_rank,
                blocks,
                last_block_key: None,
            })
            .map_err(cache_fail)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe {
            hand_out(
                out,
                Box::new(kvxfer_cache_handle {
                    inner: HandleKind::Recv(h),
                }),
                Kind::CacheHandle,
            )
        }
    })
}

/// Cancels a request being received: returns once every context rank that
/// sends has stopped (the destination blocks may be reused at once).
///
/// # Safety
/// `receiver` is a handle from `kvxfer_cache_receiver_new` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_receiver_cancel(
    receiver: *const kvxfer_cache_receiver,
    request_id: u64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let r = unsafe { live(receiver, Kind::CacheReceiver, "receiver")? };
        r.receiver.cancel(request_id).map_err(cache_fail)?;
        Ok(KVXFER_OK)
    })
}

/// Stops and frees a receiver; its open requests fail. NULL is a no-op.
///
/// # Safety
/// `receiver` is NULL or a handle from `kvxfer_cache_receiver_new`
/// (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_receiver_free(
    receiver: *mut kvxfer_cache_receiver,
) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(receiver, Kind::CacheReceiver, "receiver") })
}

/// Waits up to `timeout_ms` (negative: 60 s at a time, until it ends) for a
/// request; on success writes its statistics to `stats` (may be NULL).
/// `KVXFER_ERR_TIMEOUT` while it is still going; `KVXFER_ERR_CANCELLED`
/// when it was cancelled or failed on the context side.
///
/// Any outcome but `KVXFER_ERR_TIMEOUT` (still going) and
/// `KVXFER_ERR_UNSETTLED` means that nothing of the request can land any
/// more: its blocks may be reused at once. After `KVXFER_ERR_UNSETTLED`,
/// reuse them once `kvxfer_cache_wait_settled` returns `KVXFER_OK`.
///
/// # Safety
/// `handle` is a handle from `kvxfer_cache_sender_send` or
/// `kvxfer_cache_receiver_request` (checked); `stats` is NULL or valid for
/// a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_wait(
    handle: *const kvxfer_cache_handle,
    timeout_ms: i64,
    stats: *mut kvxfer_cache_stats,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let h = unsafe { live(handle, Kind::CacheHandle, "handle")? };
        let wait = |t: Duration| -> Result<SessionStats, CacheError> {
            match &h.inner {
                HandleKind::Send(s) => s.wait(t),
                HandleKind::Recv(r) => r.wait(t),
            }
        };
        let outcome = if timeout_ms < 0 {
            loop {
                match wait(Duration::from_secs(60)) {
                    Err(CacheError::Timeout { .. }) if !is_done(h) => continue,
                    other => break other,
                }
            }
        } else {
            wait(Duration::from_millis(timeout_ms as u64))
        };
        let s = outcome.map_err(cache_fail)?;
        if !stats.is_null() {
            // SAFETY: non-null and valid for a write per the contract.
            unsafe {
                *stats = kvxfer_cache_stats {
                    bytes: s.bytes,
                    fragments: s.fragments,
                    fragments_coalesced: s.fragments_coalesced,
                    transmission_us: s.transmission.as_micros() as u64,
                }
            };
        }
        Ok(KVXFER_OK)
    })
}

/// Waits up to `timeout_ms` (negative: 60 s at a time, until it is known)
/// until nothing of a request being received can land in its blocks any
/// more: it completed, or it ended otherwise and every context rank writing
/// them delivered its share or confirmed that it stopped. `KVXFER_OK`: the
/// blocks may be reused. `KVXFER_ERR_TIMEOUT` while not yet;
/// `KVXFER_ERR_UNSETTLED` when the request was forgotten with ranks still
/// unconfirmed; `KVXFER_ERR_INVALID_ARGUMENT` for a sender's handle.
///
/// # Safety
/// `handle` is a handle from `kvxfer_cache_receiver_request` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_wait_settled(
    handle: *const kvxfer_cache_handle,
    timeout_ms: i64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let h = unsafe { live(handle, Kind::CacheHandle, "handle")? };
        let r = receiving(h)?;
        wait_ms(timeout_ms, |t| r.wait_settled(t)).map_err(cache_fail)?;
        Ok(KVXFER_OK)
    })
}

/// Waits up to `timeout_ms` (negative: without end) until model layers
/// `first_layer .. first_layer + count` of a request being received have
/// landed (every context rank writing them reported them), or the request
/// completed. `KVXFER_ERR_TIMEOUT` when they have not yet; the request's
/// failure when it ended without them; `KVXFER_ERR_INVALID_ARGUMENT` for a
/// sender's handle, or layers outside this rank's (or none).
///
/// # Safety
/// `handle` is a handle from `kvxfer_cache_receiver_request` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_wait_layers(
    handle: *const kvxfer_cache_handle,
    first_layer: u32,
    count: u32,
    timeout_ms: i64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let h = unsafe { live(handle, Kind::CacheHandle, "handle")? };
        let r = receiving(h)?;
        let layers = first_layer..first_layer.saturating_add(count);
        wait_ms(timeout_ms, |t| r.wait_layers(layers.clone(), t)).map_err(cache_fail)?;
        Ok(KVXFER_OK)
    })
}

/// Writes to `landed` how many of model layers `first_layer .. first_layer
/// + count` of a request being received have landed so far.
/// `KVXFER_ERR_INVALID_ARGUMENT` for a sender's handle.
///
/// # Safety
/// `handle` is a handle from `kvxfer_cache_receiver_request` (checked);
/// `landed` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_layers_landed(
    handle: *const kvxfer_cache_handle,
    first_layer: u32,
    count: u32,
    landed: *mut u32,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let h = unsafe { live(handle, Kind::CacheHandle, "handle")? };
        non_null(landed, "landed")?;
        let r = receiving(h)?;
        let want = first_layer..first_layer.saturating_add(count);
        let n: u32 = r
            .layers_landed()
            .iter()
            .map(|(run, _)| run.start.max(want.start)..run.end.min(want.end))
            .map(|part| part.len() as u32)
            .sum();
        // SAFETY: non-null and valid for a write per the contract.
        unsafe { *landed = n };
        Ok(KVXFER_OK)
    })
}

/// The receiver's handle `h` is (layers land and blocks settle on the
/// generation side): `KVXFER_ERR_INVALID_ARGUMENT` for a sender's.
fn receiving(h: &kvxfer_cache_handle) -> Result<&RecvHandle, Fail> {
    match &h.inner {
        HandleKind::Recv(r) => Ok(r),
        HandleKind::Send(_) => Err(Fail::new(
            KVXFER_ERR_INVALID_ARGUMENT,
            "layers land and blocks settle on the generation side: pass a receiver's handle",
        )),
    }
}

/// Runs a wait of `timeout_ms` (negative: 60 s at a time until it ends
/// otherwise than by timing out).
fn wait_ms<T>(
    timeout_ms: i64,
    mut wait: impl FnMut(Duration) -> Result<T, CacheError>,
) -> Result<T, CacheError> {
    if timeout_ms >= 0 {
        return wait(Duration::from_millis(timeout_ms as u64));
    }
    loop {
        match wait(Duration::from_secs(60)) {
            Err(CacheError::Timeout { .. }) => continue,
            other => return other,
        }
    }
}

fn is_done(h: &kvxfer_cache_handle) -> bool {
    match &h.inner {
        HandleKind::Send(s) => s.is_done(),
        HandleKind::Recv(r) => r.is_done(),
    }
}

/// Frees a request handle (the request goes on). NULL is a no-op.
///
/// # Safety
/// `handle` is NULL or a request handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cache_handle_free(
    handle: *mut kvxfer_cache_handle,
) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(handle, Kind::CacheHandle, "handle") })
}
