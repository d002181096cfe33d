//! The KV-cache protocol from Python: `CacheState` from plain values,
//! `CacheSender` (context side) and `CacheReceiver` (generation side) over
//! an `Agent`, their handles, and the block-size and test-pattern helpers.

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

use kvxfer::cache::pattern::{check_block, fill_block};
use kvxfer::cache::{
    Attention, CacheError, CacheReceiver, CacheSender, CacheState, DataType, ReceiverConfig,
    RecvHandle, RecvRequest, SendHandle, SenderConfig, SessionStats, distinct_heads, rank_slice,
};

use crate::{KvxferError, PyAgent, secs, to_py};

pyo3::create_exception!(
    _kvxfer,
    CacheProtocolError,
    KvxferError,
    "A KV-cache protocol error (kvxfer's `CacheError`): an incompatible layout, a cancelled or timed-out request, a peer's protocol violation."
);

pyo3::create_exception!(
    _kvxfer,
    CacheUnsettledError,
    CacheProtocolError,
    "A KV-cache request ended, but context ranks writing into its blocks did not confirm that they stopped: their writes may still land. Reuse the blocks only once `RecvHandle.wait_settled` returns."
);

pyo3::create_exception!(
    _kvxfer,
    CacheIntegrityError,
    CacheProtocolError,
    "A KV-cache request failed its end-to-end integrity check (`CacheReceiver(integrity=True)`): a context rank's write did not match its checksum where it landed. The blocks hold bytes that must not be used."
);

pub(crate) fn cache_err(e: CacheError) -> PyErr {
    match e {
        CacheError::Transfer(t) => to_py(t),
        e @ CacheError::Integrity { .. } => CacheIntegrityError::new_err(e.to_string()),
        e @ CacheError::Unsettled { .. } => CacheUnsettledError::new_err(e.to_string()),
        other => CacheProtocolError::new_err(other.to_string()),
    }
}

fn dtype(name: &str) -> PyResult<DataType> {
    match name.to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DataType::F32),
        "f16" | "float16" => Ok(DataType::F16),
        "bf16" | "bfloat16" => Ok(DataType::Bf16),
        "fp8" | "float8" => Ok(DataType::Fp8),
        "i8" | "int8" => Ok(DataType::I8),
        _ => Err(PyValueError::new_err(format!(
            "dtype {name:?}: f32, f16, bf16, fp8 or i8"
        ))),
    }
}

/// One side's KV-cache layout (TensorRT-LLM's `CacheState`).
#[pyclass(module = "kvxfer._kvxfer", name = "CacheState", frozen)]
#[derive(Clone)]
pub(crate) struct PyCacheState {
    pub(crate) s: CacheState,
}

#[pymethods]
impl PyCacheState {
    /// `layers` of the model, `kv_heads_per_rank`, `head_size`,
    /// `tokens_per_block`, `dtype` (`"bf16"`, ...), `tp` × `pp` ranks;
    /// `attention` `"default"` or `"mla"` (with `kv_factor`); attention DP
    /// as `(dp_rank, dp_size)`.
    #[new]
    #[pyo3(signature = (layers, kv_heads_per_rank, head_size, tokens_per_block, dtype = "bf16", tp = 1, pp = 1, attention = "default", kv_factor = 1, attention_dp = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: u32,
        kv_heads_per_rank: u32,
        head_size: u32,
        tokens_per_block: u32,
        dtype: &str,
        tp: u32,
        pp: u32,
        attention: &str,
        kv_factor: u32,
        attention_dp: Option<(u32, u32)>,
    ) -> PyResult<Self> {
        let att = match attention {
            "default" | "mha" | "gqa" => Attention::Default,
            "mla" => Attention::Mla { kv_factor },
            _ => {
                return Err(PyValueError::new_err(format!(
                    "attention {attention:?}: default or mla"
                )));
            }
        };
        let mut s = CacheState::new(
            layers,
            kv_heads_per_rank,
            head_size,
            tokens_per_block,
            self::dtype(dtype)?,
            att,
            tp,
            pp,
        );
        if let Some((r, n)) = attention_dp {
            s = s.with_attention_dp(r, n);
        }
        s.validate().map_err(cache_err)?;
        Ok(Self { s })
    }

    /// Ranks of this executor (TP × PP).
    #[getter]
    fn world_size(&self) -> u32 {
        self.s.world_size()
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.s)
    }
}

/// Bytes of one block of `rank` of `state` when it exchanges cache with
/// an executor laid out as `peer` (the heads both sides share decide the
/// per-block layout).
#[pyfunction]
pub(crate) fn block_bytes(state: &PyCacheState, rank: u32, peer: &PyCacheState) -> u64 {
    let d = distinct_heads(&state.s, &peer.s);
    rank_slice(&state.s, rank, d).block_bytes()
}

/// Fills `buf[offset : offset + block_bytes]` with the test pattern of the
/// request's block `logical_block`, as `rank` of `state` holds it.
#[pyfunction]
pub(crate) fn pattern_fill(
    state: &PyCacheState,
    rank: u32,
    peer: &PyCacheState,
    buf: &Bound<'_, PyByteArray>,
    offset: usize,
    logical_block: u32,
) -> PyResult<()> {
    let slice = rank_slice(&state.s, rank, distinct_heads(&state.s, &peer.s));
    let n = slice.block_bytes() as usize;
    // SAFETY: no Python code runs while the slice is alive (the GIL is
    // held and nothing here calls back into Python), so the bytearray
    // cannot be resized or read concurrently.
    let bytes = unsafe { buf.as_bytes_mut() };
    let block = bytes
        .get_mut(offset..offset + n)
        .ok_or_else(|| PyValueError::new_err("the block lies outside the buffer"))?;
    fill_block(&state.s, &slice, block, logical_block);
    Ok(())
}

/// The first difference from the test pattern in the block at
/// `buf[offset:]` for tokens below `tokens`, described; `None` when it
/// holds the pattern.
#[pyfunction]
pub(crate) fn pattern_check(
    state: &PyCacheState,
    rank: u32,
    peer: &PyCacheState,
    buf: &Bound<'_, PyAny>,
    offset: usize,
    logical_block: u32,
    tokens: u32,
) -> PyResult<Option<String>> {
    let slice = rank_slice(&state.s, rank, distinct_heads(&state.s, &peer.s));
    let n = slice.block_bytes() as usize;
    let check = |bytes: &[u8]| -> PyResult<Option<String>> {
        let block = bytes
            .get(offset..offset + n)
            .ok_or_else(|| PyValueError::new_err("the block lies outside the buffer"))?;
        Ok(check_block(&state.s, &slice, block, logical_block, tokens))
    };
    if let Ok(b) = buf.cast::<PyBytes>() {
        return check(b.as_bytes());
    }
    let b = buf
        .cast::<PyByteArray>()
        .map_err(|_| PyValueError::new_err("pattern_check takes bytes or a bytearray"))?;
    // SAFETY: no Python code runs while the slice is alive (the GIL is
    // held and the check does not call back into Python), so the bytearray
    // cannot be resized or written meanwhile.
    check(unsafe { b.as_bytes() })
}

fn stats<'py>(py: Python<'py>, s: &SessionStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("request_id", s.request_id)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("fragments", s.fragments)?;
    d.set_item("fragments_coalesced", s.fragments_coalesced)?;
    d.set_item("staging_copies", s.staging_copies)?;
    d.set_item("transmission_s", s.transmission.as_secs_f64())?;
    d.set_item("mapping_s", s.mapping.as_secs_f64())?;
    d.set_item("request_info_s", s.request_info.as_secs_f64())?;
    d.set_item("peers", s.peers.len())?;
    Ok(d)
}

/// Waits on an outcome cell in slices, honouring Ctrl-C.
fn wait_stats<'py>(
    py: Python<'py>,
    timeout: f64,
    mut once: impl FnMut(Duration) -> Option<Result<SessionStats, CacheError>> + Send,
) -> PyResult<Bound<'py, PyDict>> {
    let t = secs("timeout", timeout)?;
    let deadline = std::time::Instant::now() + t;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let slice = left.min(Duration::from_millis(100));
        if let Some(r) = py.detach(|| once(slice)) {
            return stats(py, &r.map_err(cache_err)?);
        }
        if left.is_zero() {
            return Err(cache_err(CacheError::Timeout {
                what: "KV-cache request".into(),
                after: t,
            }));
        }
        py.check_signals()?;
    }
}

/// One request being sent.
#[pyclass(module = "kvxfer._kvxfer", name = "SendHandle", frozen)]
struct PySendHandle {
    h: SendHandle,
}

#[pymethods]
impl PySendHandle {
    /// Whether it finished.
    fn done(&self) -> bool {
        self.h.is_done()
    }

    /// Waits until every share landed: the session's measures (a dict).
    fn wait<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        wait_stats(py, timeout, |t| match self.h.wait(t) {
            Err(CacheError::Timeout { what, .. }) if what == "cache send" => None,
            r => Some(r),
        })
    }
}

/// One request being received.
#[pyclass(module = "kvxfer._kvxfer", name = "RecvHandle", frozen)]
struct PyRecvHandle {
    h: RecvHandle,
}

#[pymethods]
impl PyRecvHandle {
    /// Whether it finished.
    fn done(&self) -> bool {
        self.h.is_done()
    }

    /// Waits until every share landed: the session's measures (a dict).
    /// Any error but `CacheUnsettledError` (and this wait's own timeout)
    /// means that nothing of the request can land any more: its blocks may
    /// be reused at once; after `CacheUnsettledError`, once `wait_settled`
    /// returns.
    fn wait<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        wait_stats(py, timeout, |t| match self.h.wait(t) {
            Err(CacheError::Timeout { what, .. }) if what == "cache receive" => None,
            r => Some(r),
        })
    }

    /// Waits until nothing of the request can land in its blocks any more
    /// (it completed, or every context rank writing them delivered or
    /// confirmed that it stopped): then the blocks may be reused. Raises
    /// `CacheProtocolError` on a timeout, `CacheUnsettledError` when the
    /// request was forgotten with ranks still unconfirmed.
    #[pyo3(signature = (timeout = 60.0))]
    fn wait_settled(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = secs("timeout", timeout)?;
        let deadline = std::time::Instant::now() + t;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let slice = left.min(Duration::from_millis(100));
            match py.detach(|| self.h.wait_settled(slice)) {
                Err(CacheError::Timeout { .. }) if !left.is_zero() => py.check_signals()?,
                Err(CacheError::Timeout { .. }) => {
                    return Err(cache_err(CacheError::Timeout {
                        what: "the request settling".into(),
                        after: t,
                    }));
                }
                r => return r.map_err(cache_err),
            }
        }
    }

    /// The runs of this rank's model layers that landed so far, in the
    /// order they did: a list of `(start, stop)`.
    fn layers_landed(&self) -> Vec<(u32, u32)> {
        self.h
            .layers_landed()
            .into_iter()
            .map(|(r, _)| (r.start, r.end))
            .collect()
    }

    /// Waits until model layers `first_layer .. first_layer + count` landed
    /// (or the request completed); raises `CacheProtocolError` on a
    /// timeout or when the request ended without them.
    #[pyo3(signature = (first_layer, count = 1, timeout = 60.0))]
    fn wait_layers(
        &self,
        py: Python<'_>,
        first_layer: u32,
        count: u32,
        timeout: f64,
    ) -> PyResult<()> {
        let t = secs("timeout", timeout)?;
        let layers = first_layer..first_layer.saturating_add(count);
        let deadline = std::time::Instant::now() + t;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let slice = left.min(Duration::from_millis(100));
            match py.detach(|| self.h.wait_layers(layers.clone(), slice)) {
                Err(CacheError::Timeout { .. }) if !left.is_zero() => py.check_signals()?,
                Err(CacheError::Timeout { .. }) => {
                    return Err(cache_err(CacheError::Timeout {
                        what: format!("layers {layers:?}"),
                        after: t,
                    }));
                }
                r => return r.map_err(cache_err),
            }
        }
    }
}

/// The context side of the KV-cache protocol for one rank (it takes over
/// the agent's notifications).
#[pyclass(module = "kvxfer._kvxfer", name = "CacheSender", frozen)]
struct PyCacheSender {
    s: CacheSender,
}

#[pymethods]
impl PyCacheSender {
    /// A sender for `rank` of an executor laid out as `state`, writing from
    /// pools registered with `agent`.
    #[new]
    #[pyo3(signature = (agent, state, rank, timeout = 60.0, batch_bytes = 64 << 20, batches_in_flight = 4))]
    fn new(
        agent: &PyAgent,
        state: &PyCacheState,
        rank: u32,
        timeout: f64,
        batch_bytes: u64,
        batches_in_flight: usize,
    ) -> PyResult<Self> {
        let cfg = SenderConfig {
            timeout: secs("timeout", timeout)?,
            batch_bytes,
            batches_in_flight,
            ..SenderConfig::default()
        };
        let s = CacheSender::new(Arc::clone(&agent.agent), state.s.clone(), rank, None, cfg)
            .map_err(cache_err)?;
        Ok(Self { s })
    }

    /// The request's KV cache is in `blocks` (start addresses, oldest
    /// first), every layer computed: each counterpart gets its share once
    /// it has asked.
    fn send(&self, request_id: u64, blocks: Vec<u64>) -> PyResult<PySendHandle> {
        let h = self.s.send(request_id, blocks).map_err(cache_err)?;
        Ok(PySendHandle { h })
    }

    /// Layer-wise sending: the request's KV cache will be in `blocks` as
    /// the prefill computes it; each layer is written once `layers_ready`
    /// marks it.
    fn begin(&self, request_id: u64, blocks: Vec<u64>) -> PyResult<PySendHandle> {
        let h = self.s.begin(request_id, blocks).map_err(cache_err)?;
        Ok(PySendHandle { h })
    }

    /// Model layers `first_layer .. first_layer + count` of a request given
    /// to `begin` hold their final values (call it after their compute
    /// finished). For GPU pools, pass the CUDA event recorded after their
    /// compute (`cuda_event`: `torch.cuda.Event().cuda_event`, of device
    /// `device`, kept alive until then): they are written once it
    /// completed, and this returns at once.
    #[pyo3(signature = (request_id, first_layer, count = 1, cuda_event = None, device = 0))]
    fn layers_ready(
        &self,
        request_id: u64,
        first_layer: u32,
        count: u32,
        cuda_event: Option<u64>,
        device: u32,
    ) -> PyResult<()> {
        let layers = first_layer..first_layer.saturating_add(count);
        match cuda_event {
            None => self.s.layers_ready(request_id, layers),
            Some(0) => return Err(PyValueError::new_err("cuda_event is a null handle")),
            Some(raw) => {
                // SAFETY: the caller passes a live event of `device`'s
                // primary context (documented).
                let event = unsafe { kvxfer::gpu::CudaEvent::from_raw(raw, device) };
                self.s.layers_ready_after(request_id, layers, event)
            }
        }
        .map_err(cache_err)
    }

    /// The model layers this rank holds: `(start, stop)`.
    #[getter]
    fn held_layers(&self) -> (u32, u32) {
        let r = self.s.held_layers();
        (r.start, r.end)
    }

    /// Cancels a request; returns once nothing posted can still read its
    /// blocks.
    fn cancel(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        py.detach(|| self.s.cancel(request_id)).map_err(cache_err)
    }
}

/// The generation side of the KV-cache protocol for one rank (it takes
/// over the agent's notifications).
#[pyclass(module = "kvxfer._kvxfer", name = "CacheReceiver", frozen)]
struct PyCacheReceiver {
    r: CacheReceiver,
}

#[pymethods]
impl PyCacheReceiver {
    /// A receiver for `rank` of an executor laid out as `state`, whose pools
    /// are registered with `agent`; the context executor is `ctx_state`,
    /// its ranks at `ctx_connections` (connection info by rank).
    /// `settle_timeout`: how long the ranks of a failed request have to
    /// confirm that they stopped writing before its outcome is
    /// `CacheUnsettledError`. `integrity`: the context ranks write with a
    /// CRC32C per piece, checked where it lands before anything is
    /// reported landed (`CacheIntegrityError` on a mismatch; host memory
    /// over TCP, shm or inproc only).
    #[new]
    #[pyo3(signature = (agent, state, rank, ctx_state, ctx_connections, timeout = 60.0, settle_timeout = 10.0, integrity = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        agent: &PyAgent,
        state: &PyCacheState,
        rank: u32,
        ctx_state: &PyCacheState,
        ctx_connections: Vec<String>,
        timeout: f64,
        settle_timeout: f64,
        integrity: bool,
    ) -> PyResult<Self> {
        let cfg = ReceiverConfig {
            timeout: secs("timeout", timeout)?,
            settle_timeout: secs("settle_timeout", settle_timeout)?,
            integrity,
            ..ReceiverConfig::default()
        };
        let a = Arc::clone(&agent.agent);
        let (s, c) = (state.s.clone(), ctx_state.s.clone());
        let r = py
            .detach(|| CacheReceiver::new(a, s, rank, c, &ctx_connections, cfg))
            .map_err(cache_err)?;
        Ok(Self { r })
    }

    /// Asks the context ranks for the request's last `len(blocks)` blocks,
    /// to land at `blocks` (start addresses, oldest first).
    #[pyo3(signature = (request_id, blocks, ctx_dp_rank = 0, last_block_key = None))]
    fn request(
        &self,
        py: Python<'_>,
        request_id: u64,
        blocks: Vec<u64>,
        ctx_dp_rank: u32,
        last_block_key: Option<u64>,
    ) -> PyResult<PyRecvHandle> {
        let req = RecvRequest {
            request_id,
            ctx_dp_rank,
            blocks,
            last_block_key,
        };
        let h = py.detach(|| self.r.request(req)).map_err(cache_err)?;
        Ok(PyRecvHandle { h })
    }

    /// Cancels a request; returns once no context rank can still write
    /// its blocks (raises `CacheUnsettledError` when one did not confirm
    /// within the settle timeout).
    fn cancel(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        py.detach(|| self.r.cancel(request_id)).map_err(cache_err)
    }

    /// Totals over the requests this receiver finished, as a dict:
    /// `completed`, `cancelled`, `failed`, `unsettled`, `bytes`,
    /// `strangers` (messages from agents not party to the request they
    /// name, dropped), `partials_dropped`, `cancels_resent` (cancels sent
    /// again to ranks that had not confirmed).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.r.metrics();
        let d = PyDict::new(py);
        d.set_item("completed", m.completed)?;
        d.set_item("cancelled", m.cancelled)?;
        d.set_item("failed", m.failed)?;
        d.set_item("unsettled", m.unsettled)?;
        d.set_item("cancels_resent", m.cancels_resent)?;
        d.set_item("bytes", m.bytes)?;
        d.set_item("strangers", m.strangers)?;
        d.set_item("partials_dropped", m.partials_dropped)?;
        Ok(d)
    }
}

pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCacheState>()?;
    m.add_class::<PyCacheSender>()?;
    m.add_class::<PyCacheReceiver>()?;
    m.add_class::<PySendHandle>()?;
    m.add_class::<PyRecvHandle>()?;
    m.add_function(wrap_pyfunction!(block_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(pattern_fill, m)?)?;
    m.add_function(wrap_pyfunction!(pattern_check, m)?)?;
    m.add(
        "CacheProtocolError",
        m.py().get_type::<CacheProtocolError>(),
    )?;
    m.add(
        "CacheUnsettledError",
        m.py().get_type::<CacheUnsettledError>(),
    )?;
    m.add(
        "CacheIntegrityError",
        m.py().get_type::<CacheIntegrityError>(),
    )?;
    Ok(())
}
