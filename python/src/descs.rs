//! Descriptor lists held in Rust and requests made from them by index:
//! integer arrays read through numpy's `__array_interface__` (no Python
//! object per descriptor or index), pairs merged as NIXL merges them.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use std::sync::{Arc, Mutex, Weak};

use kvxfer::{
    MemoryDesc, MemoryDescs, MemoryType, PreparedDescList, TransferAgent, TransferRequest,
};

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

    /// Every element as an index below `len`, into a shared slice (one
    /// allocation of its own size, one branch-free pass); `None` when an
    /// element is not such an index.
    fn indices_below(&self, obj: &Bound<'_, PyAny>, len: u64) -> Option<Arc<[u32]>> {
        let n = self.len();
        let _alive = obj; // the array: its data stays put for the reads below
        let bad = std::cell::Cell::new(false);
        macro_rules! read {
            // Negative values wrap to huge ones, which fail the bound.
            ($t:ty, $wide:expr) => {{
                let p = self.ptr as *const $t;
                let out: Arc<[u32]> = (0..n)
                    .map(|i| {
                        // SAFETY: as in `each`: `obj` is borrowed for this
                        // call, its data holds `n` elements of this type
                        // (possibly unaligned).
                        let k: u64 = $wide(unsafe { p.add(i).read_unaligned() });
                        bad.set(bad.get() | (k >= len));
                        k as u32
                    })
                    .collect();
                out
            }};
        }
        let out = match (self.kind, self.size) {
            (b'i', 1) => read!(i8, |v: i8| v as i64 as u64),
            (b'i', 2) => read!(i16, |v: i16| v as i64 as u64),
            (b'i', 4) => read!(i32, |v: i32| v as i64 as u64),
            (b'i', 8) => read!(i64, |v: i64| v as u64),
            (_, 1) => read!(u8, u64::from),
            (_, 2) => read!(u16, u64::from),
            (_, 4) => read!(u32, u64::from),
            _ => read!(u64, |v: u64| v),
        };
        (!bad.get()).then_some(out)
    }

    /// Every element, in order.
    fn values(&self, obj: &Bound<'_, PyAny>) -> Vec<i128> {
        let mut v = Vec::with_capacity(self.len());
        self.each(obj, |x| v.push(x));
        v
    }
}

/// The buffer protocol, declared here: the limited API of Python 3.9 (this
/// wheel's floor) leaves it out, though every CPython since 3.3 exports
/// these two functions and lays `Py_buffer` out this way (it joined the
/// limited API unchanged in 3.11). Through it an index array is read
/// without the dictionary `__array_interface__` builds on every access,
/// which after a large transfer (caches cold) cost about 25 µs a call here.
mod buffer {
    use std::ffi::{c_char, c_int, c_void};

    use pyo3::ffi::PyObject;

    /// CPython's `Py_buffer`.
    #[repr(C)]
    pub(super) struct RawBuffer {
        pub(super) buf: *mut c_void,
        obj: *mut PyObject,
        pub(super) len: isize,
        pub(super) itemsize: isize,
        readonly: c_int,
        pub(super) ndim: c_int,
        pub(super) format: *mut c_char,
        shape: *mut isize,
        strides: *mut isize,
        suboffsets: *mut isize,
        internal: *mut c_void,
    }

    unsafe extern "C" {
        fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
        fn PyBuffer_Release(view: *mut RawBuffer);
    }

    /// `PyBUF_C_CONTIGUOUS | PyBUF_FORMAT`: contiguous data, its format.
    const FLAGS: c_int = 0x38 | 0x04;

    /// A buffer taken from an object (released on drop); the GIL is held
    /// by whoever holds it (it borrows the object's `Bound`).
    pub(super) struct Held<'a> {
        pub(super) view: RawBuffer,
        _obj: &'a pyo3::Bound<'a, pyo3::PyAny>,
    }

    impl<'a> Held<'a> {
        /// `obj`'s contiguous buffer; `None` (the error cleared) for an
        /// object without one.
        pub(super) fn take(obj: &'a pyo3::Bound<'a, pyo3::PyAny>) -> Option<Self> {
            let mut view = RawBuffer {
                buf: std::ptr::null_mut(),
                obj: std::ptr::null_mut(),
                len: 0,
                itemsize: 0,
                readonly: 0,
                ndim: 0,
                format: std::ptr::null_mut(),
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                suboffsets: std::ptr::null_mut(),
                internal: std::ptr::null_mut(),
            };
            // SAFETY: `obj` is a live object and the GIL is held (its
            // `Bound`); `view` is a writable `Py_buffer` of CPython's
            // layout, filled by the call when it succeeds.
            let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut view, FLAGS) };
            if rc != 0 {
                // Not a buffer (a list, say): the other ways are tried.
                drop(pyo3::PyErr::take(obj.py()));
                return None;
            }
            Some(Held { view, _obj: obj })
        }

        /// The format's element kind (`b'i'` signed, `b'u'` unsigned) when
        /// it is a native or little-endian integer.
        pub(super) fn int_kind(&self) -> Option<u8> {
            if self.view.format.is_null() {
                return Some(b'u'); // "B", unsigned bytes
            }
            // SAFETY: a non-null format is a NUL-terminated string the
            // exporter keeps while the buffer is held.
            let f = unsafe { std::ffi::CStr::from_ptr(self.view.format) }.to_bytes();
            let f = match f {
                [b'@' | b'=' | b'<', rest @ ..] => rest,
                other => other,
            };
            match f {
                [c] if b"bhilqn".contains(c) => Some(b'i'),
                [c] if b"BHILQN".contains(c) => Some(b'u'),
                _ => None,
            }
        }
    }

    impl Drop for Held<'_> {
        fn drop(&mut self) {
            // SAFETY: taken by `PyObject_GetBuffer` and released once, with
            // the GIL held (the `Bound` borrowed for this value's life).
            unsafe { PyBuffer_Release(&mut self.view) };
        }
    }
}

/// Indices from a list of ints or a one-dimensional integer numpy array,
/// each checked against `len` (read in one pass, straight into the result).
pub(crate) fn indices(obj: &Bound<'_, PyAny>, len: usize, what: &str) -> PyResult<Arc<[u32]>> {
    let outside = |i: i128| PyValueError::new_err(format!("{what}: index {i} outside 0..{len}"));
    // Lists hold fewer than u32::MAX descriptors (the agent refuses more).
    let len = len.min(u32::MAX as usize) as u64;
    let check = |i: i128| u32::try_from(i).ok().filter(|&k| u64::from(k) < len);
    // Integer arrays (numpy, array.array) through the buffer protocol.
    let held = buffer::Held::take(obj);
    let view = match &held {
        Some(h) if h.view.ndim == 1 && h.view.itemsize > 0 => match h.int_kind() {
            Some(kind) if matches!(h.view.itemsize, 1 | 2 | 4 | 8) => Some(ArrayView {
                ptr: h.view.buf as usize,
                kind,
                size: h.view.itemsize as usize,
                shape: vec![(h.view.len / h.view.itemsize) as usize],
            }),
            _ => None,
        },
        _ => None,
    };
    let view = match view {
        Some(v) => Some(v),
        None => {
            drop(held);
            array_view(obj)?
        }
    };
    match view {
        Some(v) if v.shape.len() == 1 => {
            if let Some(out) = v.indices_below(obj, len) {
                return Ok(out);
            }
            // The first culprit, for the message.
            let mut bad = None;
            v.each(obj, |i| {
                if check(i).is_none() {
                    bad.get_or_insert(i);
                }
            });
            Err(outside(bad.unwrap_or(-1)))
        }
        Some(_) => Err(PyValueError::new_err(format!(
            "{what}: a one-dimensional array"
        ))),
        None => obj
            .extract::<Vec<i64>>()?
            .into_iter()
            .map(|i| check(i128::from(i)).ok_or_else(|| outside(i128::from(i))))
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
    /// The list as an agent last prepared it (for this agent's side or a
    /// remote agent's), so that requests made from it select by index.
    prepared: Mutex<Option<Prepared>>,
}

/// A list prepared by one agent for one side.
struct Prepared {
    agent: Weak<dyn TransferAgent>,
    remote: Option<String>,
    list: Arc<PreparedDescList>,
}

impl PyDescList {
    /// The list prepared by `agent` for `remote`'s side (this agent's when
    /// `None`): kept from the last time, or prepared now.
    pub(crate) fn prepared(
        &self,
        agent: &Arc<dyn TransferAgent>,
        remote: Option<&str>,
    ) -> Result<Arc<PreparedDescList>, kvxfer::Error> {
        let mut slot = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = slot.as_ref()
            && p.remote.as_deref() == remote
            && std::ptr::addr_eq(p.agent.as_ptr(), Arc::as_ptr(agent))
        {
            return Ok(Arc::clone(&p.list));
        }
        let list =
            agent.prepare_desc_list(MemoryDescs::new(self.mem, self.descs.clone()), remote)?;
        *slot = Some(Prepared {
            agent: Arc::downgrade(agent),
            remote: remote.map(str::to_owned),
            list: Arc::clone(&list),
        });
        Ok(list)
    }
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
        Ok(Self {
            mem,
            descs: out,
            prepared: Mutex::new(None),
        })
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
    /// Made by index and released: prepared again by each post.
    Indexed(Arc<kvxfer::IndexedRequest>),
}

impl Made {
    /// The request (for one prepared by index, made on the first call).
    pub(crate) fn request(&self) -> std::borrow::Cow<'_, TransferRequest> {
        match self {
            Made::Prepared(p) => std::borrow::Cow::Borrowed(p.request()),
            Made::Plain(r) => std::borrow::Cow::Borrowed(r),
            Made::Indexed(r) => std::borrow::Cow::Owned(
                r.to_request()
                    .expect("its shape was checked when it was made"),
            ),
        }
    }

    /// Bytes it moves.
    pub(crate) fn total_bytes(&self) -> u64 {
        match self {
            Made::Prepared(p) => p.total_bytes(),
            Made::Plain(r) => r.local.total_len(),
            Made::Indexed(_) => self.request().local.total_len(),
        }
    }

    /// Pieces after merging.
    pub(crate) fn desc_count(&self) -> usize {
        match self {
            Made::Prepared(p) => p.desc_count(),
            Made::Plain(r) => r.local.descs.len(),
            Made::Indexed(_) => self.request().local.descs.len(),
        }
    }

    /// Its sync message.
    pub(crate) fn sync_message(&self) -> Option<&[u8]> {
        match self {
            Made::Prepared(p) => p.sync_message(),
            Made::Plain(r) => r.sync_message.as_deref(),
            Made::Indexed(r) => r.sync_message.as_deref(),
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
        // under way still shares it (rare): then a copy. One made by index
        // keeps its indices (no request is made of them).
        let empty = MemoryDescs::new(MemoryType::Dram, Vec::new());
        *m = Made::Plain(Arc::new(TransferRequest::write(empty.clone(), empty, "")));
        let p = match Arc::try_unwrap(p) {
            Ok(p) => p,
            Err(p) => {
                *m = match p.indexed_request() {
                    Some(r) => Made::Indexed(Arc::new(r.clone())),
                    None => Made::Plain(Arc::new(p.request().clone())),
                };
                return;
            }
        };
        *m = if p.indexed_request().is_some() {
            Made::Indexed(Arc::new(p.into_indexed_request().expect("made by index")))
        } else {
            Made::Plain(Arc::new(p.into_request()))
        };
    }

    /// Bytes the request moves.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.made().total_bytes()
    }

    /// Descriptors after merging (pairs adjacent on both sides are one).
    #[getter]
    fn desc_count(&self) -> usize {
        self.made().desc_count()
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
