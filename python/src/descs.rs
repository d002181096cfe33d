//! Descriptor lists held in Rust and requests made from them by index:
//! integer arrays read through numpy's `__array_interface__` (no Python
//! object per descriptor or index), pairs merged as NIXL merges them.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use std::sync::Arc;

use kvxfer::{MemoryDesc, MemoryDescs, MemoryType, TransferRequest};

/// An integer array seen through numpy's `__array_interface__`: its data
/// pointer, element kind and size, and shape (C-contiguous only).
struct ArrayView {
    ptr: usize,
    kind: u8,
    size: usize,
    shape: Vec<usize>,
}

/// `obj`'s array interface, when it has one with integer elements laid out
/// C-contiguously (`None` for objects without the interface).
fn array_view(obj: &Bound<'_, PyAny>) -> PyResult<Option<ArrayView>> {
    let Ok(ai) = obj.getattr("__array_interface__") else {
        return Ok(None);
    };
    let ai = ai
        .cast_into::<PyDict>()
        .map_err(|_| PyValueError::new_err("__array_interface__ is not a dict"))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        ai.get_item(k)?
            .ok_or_else(|| PyValueError::new_err(format!("__array_interface__ without {k:?}")))
    };
    let typestr: String = get("typestr")?.extract()?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let (ptr, _readonly): (usize, bool) = get("data")?.extract()?;
    let b = typestr.as_bytes();
    if b.len() < 3 || !matches!(b[0], b'<' | b'|' | b'=') || !matches!(b[1], b'i' | b'u') {
        return Err(PyValueError::new_err(format!(
            "an index or descriptor array must hold little-endian integers, not {typestr:?}"
        )));
    }
    let size: usize = typestr[2..]
        .parse()
        .map_err(|_| PyValueError::new_err(format!("element type {typestr:?}")))?;
    if !matches!(size, 1 | 2 | 4 | 8) {
        return Err(PyValueError::new_err(format!("element type {typestr:?}")));
    }
    if let Some(st) = ai.get_item("strides")?
        && !st.is_none()
    {
        // Contiguous arrays may still name their strides: accept those.
        let strides: Vec<isize> = st.extract()?;
        let mut want = size as isize;
        for (d, s) in shape.iter().zip(&strides).rev() {
            if *s != want {
                return Err(PyValueError::new_err(
                    "the array must be C-contiguous (use numpy.ascontiguousarray)",
                ));
            }
            want *= *d as isize;
        }
    }
    Ok(Some(ArrayView {
        ptr,
        kind: b[1],
        size,
        shape,
    }))
}

impl ArrayView {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Every element, in order, through `f` (each integer type read with
    /// one loop of its own).
    fn each(&self, obj: &Bound<'_, PyAny>, mut f: impl FnMut(i128)) {
        let n = self.len();
        let _alive = obj; // the array: its data stays put for the reads below
        macro_rules! read {
            ($t:ty) => {{
                let p = self.ptr as *const $t;
                for i in 0..n {
                    // SAFETY: `obj` (the array) is borrowed for this call, so
                    // its data stays where `ptr` says, `n` elements of this
                    // type (the array interface's shape and typestr); numpy
                    // data need not be aligned, hence the unaligned read.
                    f(i128::from(unsafe { p.add(i).read_unaligned() }));
                }
            }};
        }
        match (self.kind, self.size) {
            (b'i', 1) => read!(i8),
            (b'i', 2) => read!(i16),
            (b'i', 4) => read!(i32),
            (b'i', 8) => read!(i64),
            (_, 1) => read!(u8),
            (_, 2) => read!(u16),
            (_, 4) => read!(u32),
            _ => read!(u64),
        }
    }

    /// Every element, in order.
    fn values(&self, obj: &Bound<'_, PyAny>) -> Vec<i128> {
        let mut v = Vec::with_capacity(self.len());
        self.each(obj, |x| v.push(x));
        v
    }
}

/// Indices from a list of ints or a one-dimensional integer numpy array,
/// each checked against `len` (read in one pass, straight into the result).
pub(crate) fn indices(obj: &Bound<'_, PyAny>, len: usize, what: &str) -> PyResult<Vec<usize>> {
    let outside = |i: i128| PyValueError::new_err(format!("{what}: index {i} outside 0..{len}"));
    match array_view(obj)? {
        Some(v) if v.shape.len() == 1 => {
            let mut out = Vec::with_capacity(v.len());
            let mut bad = None;
            v.each(obj, |i| match usize::try_from(i) {
                Ok(k) if k < len => out.push(k),
                _ => {
                    bad.get_or_insert(i);
                }
            });
            match bad {
                Some(i) => Err(outside(i)),
                None => Ok(out),
            }
        }
        Some(_) => Err(PyValueError::new_err(format!(
            "{what}: a one-dimensional array"
        ))),
        None => obj
            .extract::<Vec<i64>>()?
            .into_iter()
            .map(|i| {
                usize::try_from(i)
                    .ok()
                    .filter(|&k| k < len)
                    .ok_or_else(|| outside(i128::from(i)))
            })
            .collect(),
    }
}

/// A descriptor list held in Rust: `(address, length, device)` triples of
/// one memory type. Made once (from tuples or an N x 3 integer array);
/// requests then select from it by index without a Python object per
/// descriptor.
#[pyclass(module = "kvxfer._kvxfer", name = "DescList", frozen)]
pub(crate) struct PyDescList {
    pub(crate) mem: MemoryType,
    pub(crate) descs: Vec<MemoryDesc>,
}

#[pymethods]
impl PyDescList {
    /// From `(address, length[, device])` tuples or an N x 2 / N x 3
    /// integer array.
    #[new]
    #[pyo3(signature = (descs, mem_type = "dram"))]
    fn new(descs: &Bound<'_, PyAny>, mem_type: &str) -> PyResult<Self> {
        let mem = crate::mem_type(mem_type)?;
        let out = match array_view(descs)? {
            Some(v) if v.shape.len() == 2 && (v.shape[1] == 2 || v.shape[1] == 3) => {
                let w = v.shape[1];
                let vals = v.values(descs);
                vals.chunks(w)
                    .map(|r| {
                        let f = |x: i128| {
                            u64::try_from(x)
                                .map_err(|_| PyValueError::new_err(format!("negative field {x}")))
                        };
                        let dev = if w == 3 { f(r[2])? } else { 0 };
                        Ok(MemoryDesc::new(f(r[0])?, f(r[1])?, dev as u32))
                    })
                    .collect::<PyResult<Vec<_>>>()?
            }
            Some(_) => {
                return Err(PyValueError::new_err(
                    "a descriptor array must be N x 2 or N x 3 (address, length[, device])",
                ));
            }
            None => {
                let mut out = Vec::new();
                for item in descs.try_iter()? {
                    let item = item?;
                    let t: Vec<u64> = item.extract()?;
                    match t.as_slice() {
                        [a, l] => out.push(MemoryDesc::new(*a, *l, 0)),
                        [a, l, d, ..] => out.push(MemoryDesc::new(*a, *l, *d as u32)),
                        _ => {
                            return Err(PyValueError::new_err(
                                "a descriptor is (address, length[, device])",
                            ));
                        }
                    }
                }
                out
            }
        };
        Ok(Self { mem, descs: out })
    }

    fn __len__(&self) -> usize {
        self.descs.len()
    }

    /// Descriptor `i` as `(address, length, device)`.
    fn __getitem__(&self, i: isize) -> PyResult<(u64, u64, u32)> {
        let n = self.descs.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if !(0..n).contains(&j) {
            return Err(pyo3::exceptions::PyIndexError::new_err(
                "descriptor index out of range",
            ));
        }
        let d = self.descs[j as usize];
        Ok((d.addr, d.len, d.device_id))
    }

    /// The memory type's name.
    #[getter]
    fn mem_type(&self) -> &'static str {
        self.mem.as_str()
    }
}

/// A transfer request made once (descriptors selected and merged, and,
/// where the agent could, checked, resolved and planned), posted by
/// `Agent.post` as often as wanted.
#[pyclass(module = "kvxfer._kvxfer", name = "Request", frozen)]
pub(crate) struct PyRequest {
    pub(crate) made: std::sync::Mutex<Made>,
    pub(crate) requested: usize,
}

/// A request as made: prepared by the agent (its holds on the local
/// regions and its plan), or plain — released, or refused when prepared
/// (each post then checks it in full, and fails as it would have).
/// Shared, so that a post lets the lock go before it lets the GIL go.
#[derive(Clone)]
pub(crate) enum Made {
    Prepared(Arc<kvxfer::PreparedTransfer>),
    Plain(Arc<TransferRequest>),
}

impl Made {
    pub(crate) fn request(&self) -> &TransferRequest {
        match self {
            Made::Prepared(p) => p.request(),
            Made::Plain(r) => r,
        }
    }
}

impl PyRequest {
    pub(crate) fn new(made: Made, requested: usize) -> Self {
        PyRequest {
            made: std::sync::Mutex::new(made),
            requested,
        }
    }

    /// What it is now (a shared reference: the lock is let go).
    pub(crate) fn made(&self) -> Made {
        self.made.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[pymethods]
impl PyRequest {
    /// Lets the agent's preparation go (its holds on the local regions,
    /// which keep them from being deregistered); later posts check the
    /// request in full.
    fn release(&self) {
        let mut m = self.made.lock().unwrap_or_else(|p| p.into_inner());
        let Made::Prepared(p) = &*m else {
            return;
        };
        let p = Arc::clone(p);
        // `m`'s reference let go (an empty stand-in for the moment), the
        // request comes out of the preparation uncopied, unless a post
        // under way still shares it (rare): then a copy.
        let empty = MemoryDescs::new(MemoryType::Dram, Vec::new());
        *m = Made::Plain(Arc::new(TransferRequest::write(empty.clone(), empty, "")));
        let req = match Arc::try_unwrap(p) {
            Ok(p) => p.into_request(),
            Err(p) => p.request().clone(),
        };
        *m = Made::Plain(Arc::new(req));
    }

    /// Bytes the request moves.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.made().request().local.total_len()
    }

    /// Descriptors after merging (pairs adjacent on both sides are one).
    #[getter]
    fn desc_count(&self) -> usize {
        self.made().request().local.descs.len()
    }

    /// Descriptors selected before merging.
    #[getter]
    fn requested(&self) -> usize {
        self.requested
    }
}

/// Merges pairs adjacent on both sides (and on the same devices).
pub(crate) fn merge(
    pairs: impl Iterator<Item = (MemoryDesc, MemoryDesc)>,
) -> (Vec<MemoryDesc>, Vec<MemoryDesc>) {
    let n = pairs.size_hint().0;
    let (mut l, mut r): (Vec<MemoryDesc>, Vec<MemoryDesc>) =
        (Vec::with_capacity(n), Vec::with_capacity(n));
    for (a, b) in pairs {
        if let (Some(pa), Some(pb)) = (l.last_mut(), r.last_mut())
            && pa.end() == Some(a.addr)
            && pb.end() == Some(b.addr)
            && pa.device_id == a.device_id
            && pb.device_id == b.device_id
        {
            pa.len += a.len;
            pb.len += b.len;
            continue;
        }
        l.push(a);
        r.push(b);
    }
    (l, r)
}
