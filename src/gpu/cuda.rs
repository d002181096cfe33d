//! The CUDA driver API calls kvxfer makes, through cudarc's raw bindings
//! with the library loaded at run time.
//!
//! cudarc panics when a call is made and `libcuda.so` cannot be loaded, so
//! [`driver`] first checks that the library loads, then initialises it;
//! every other call goes through the [`Cuda`] it returns. Each device's
//! primary context is retained on first use and kept for the life of the
//! process (the driver releases it at exit). Copies run on a non-blocking
//! stream of the calling thread (one per device, destroyed with the
//! thread) and are waited for before the call returns.

use std::cell::RefCell;
use std::ffi::{CStr, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::sys as cu;

use super::{Allocation, GpuError};

/// The loaded and initialised driver.
pub(crate) struct Cuda {
    version: i32,
    /// Whether `cuMemcpyBatchAsync` is there (driver 12.8 or later) and has
    /// not failed: many small copies are then issued in one call.
    batch: std::sync::atomic::AtomicBool,
    /// Whether many small copies between device memory run as one launch
    /// of the piece-copy kernel (`kernels/copy_pieces.cu`): on unless
    /// `KVXFER_CUDA_COPY_KERNEL=0`, off once loading or launching it
    /// failed.
    kernel: std::sync::atomic::AtomicBool,
    /// Per device ordinal: its primary context (as an address), retained on
    /// first use.
    contexts: Vec<OnceLock<Result<usize, GpuError>>>,
    /// Per device ordinal: the piece-copy kernel loaded into its primary
    /// context (the function's address), on first use; `None`: it did not
    /// load there.
    kernels: Vec<OnceLock<Option<usize>>>,
}

/// The piece-copy kernel's PTX (generated from `kernels/copy_pieces.cu` by
/// `ci/gen-copy-ptx.py`), compiled by the driver for the GPU on first use.
const COPY_PTX: &str = concat!(include_str!("kernels/copy_pieces.ptx"), "\0");

/// The kernel's entry point in [`COPY_PTX`].
const COPY_ENTRY: &CStr = c"kvxfer_copy_pieces";

/// Longest table entry of the piece-copy kernel: longer pieces are split,
/// so that one thread block's share stays small and a launch spreads over
/// the GPU's multiprocessors.
pub(super) const KERNEL_ENTRY_MAX: u64 = 64 << 10;

/// Fewest pieces that go through the kernel rather than one
/// `cuMemcpyAsync` each.
const KERNEL_MIN: usize = 4;

/// Threads per block of the piece-copy kernel.
const KERNEL_THREADS: u32 = 256;

/// Most thread blocks of one launch (each walks the table in steps of the
/// grid's size).
const KERNEL_BLOCKS_MAX: usize = 1 << 16;

static CUDA: OnceLock<Result<Cuda, GpuError>> = OnceLock::new();

/// The driver, loaded and initialised on first use.
///
/// # Errors
/// [`GpuError::NoDriver`] when `libcuda.so` cannot be loaded or `cuInit`
/// fails (no device, driver and library of different versions, ...).
pub(crate) fn driver() -> Result<&'static Cuda, GpuError> {
    CUDA.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Cuda, GpuError> {
    // SAFETY: only tries to open the library (and closes it again).
    if !unsafe { cu::is_culib_present() } {
        return Err(GpuError::NoDriver(
            "libcuda.so (the NVIDIA driver's library) could not be loaded".into(),
        ));
    }
    let no_driver = |e: GpuError| GpuError::NoDriver(e.to_string());
    // SAFETY: the library is present (above); cuInit takes flags 0.
    check("cuInit", unsafe { cu::cuInit(0) }).map_err(no_driver)?;
    let mut version = 0;
    // SAFETY: writes one int.
    check("cuDriverGetVersion", unsafe {
        cu::cuDriverGetVersion(&mut version)
    })
    .map_err(no_driver)?;
    let mut count = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetCount", unsafe {
        cu::cuDeviceGetCount(&mut count)
    })
    .map_err(no_driver)?;
    // SAFETY: looks a symbol up in the loaded library (no call).
    let batch = version >= 12080
        && unsafe { cu::culib().get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync") }.is_ok();
    tracing::info!(
        version,
        devices = count,
        batch_copies = batch,
        "CUDA driver loaded"
    );
    let kernel = std::env::var("KVXFER_CUDA_COPY_KERNEL").map_or(true, |v| v != "0");
    Ok(Cuda {
        batch: std::sync::atomic::AtomicBool::new(batch),
        kernel: std::sync::atomic::AtomicBool::new(kernel),
        version,
        contexts: (0..count.max(0)).map(|_| OnceLock::new()).collect(),
        kernels: (0..count.max(0)).map(|_| OnceLock::new()).collect(),
    })
}

/// `Ok` for `CUDA_SUCCESS`, else the call's error with the result's name.
pub(super) fn check(call: &'static str, r: cu::CUresult) -> Result<(), GpuError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string (or
    // leaves it null for an unknown code).
    let named = unsafe { cu::cuGetErrorName(r, &mut name) } == cu::CUresult::CUDA_SUCCESS;
    let name = if named && !name.is_null() {
        // SAFETY: a NUL-terminated static string of the driver's.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    } else {
        "unknown error".into()
    };
    Err(GpuError::Driver {
        call,
        code: r as u32,
        name,
    })
}

/// A new non-blocking stream of the current context.
pub(super) fn new_stream() -> Result<cu::CUstream, GpuError> {
    let mut raw: cu::CUstream = std::ptr::null_mut();
    // SAFETY: writes one stream handle of the current context.
    check("cuStreamCreate", unsafe {
        cu::cuStreamCreate(&mut raw, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    })?;
    Ok(raw)
}

/// A stream of the calling thread on one device, with the piece-copy
/// kernel's table: entries written to pinned host memory and read there by
/// the kernel.
struct Stream {
    device: u32,
    raw: cu::CUstream,
    table: Option<Table>,
}

/// The kernel's table of one [`Stream`] (pinned host memory), for `cap`
/// entries.
struct Table {
    host: *mut u64,
    cap: usize,
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created by cuStreamCreate, destroyed once; work on it was
        // waited for by the call that issued it.
        let _ = unsafe { cu::cuStreamDestroy_v2(self.raw) };
        if let Some(t) = self.table.take() {
            free_table(t);
        }
    }
}

/// Frees a table (no launch reads it any more: each was waited for by the
/// call that issued it).
fn free_table(t: Table) {
    // SAFETY: allocated by `Cuda::table`, freed once, no longer used.
    let _ = unsafe { cu::cuMemFreeHost(t.host.cast()) };
}

thread_local! {
    /// The calling thread's copy streams, one per device used.
    static STREAMS: RefCell<Vec<Stream>> = const { RefCell::new(Vec::new()) };
}

impl Cuda {
    /// The driver's version (`1000 * major + 10 * minor`).
    pub(crate) fn version(&self) -> i32 {
        self.version
    }

    /// How many devices the driver sees.
    pub(crate) fn device_count(&self) -> u32 {
        self.contexts.len() as u32
    }

    /// Makes `device`'s primary context current on the calling thread.
    pub(super) fn bind(&self, device: u32) -> Result<(), GpuError> {
        let slot = self
            .contexts
            .get(device as usize)
            .ok_or_else(|| GpuError::Driver {
                call: "cuDeviceGet",
                code: cu::CUresult::CUDA_ERROR_INVALID_DEVICE as u32,
                name: format!("no device {device} ({} present)", self.contexts.len()),
            })?;
        let ctx = slot
            .get_or_init(|| {
                let mut dev = 0;
                // SAFETY: writes one device handle; the ordinal is in range.
                check("cuDeviceGet", unsafe {
                    cu::cuDeviceGet(&mut dev, device as i32)
                })?;
                let mut ctx: cu::CUcontext = std::ptr::null_mut();
                // SAFETY: writes one context handle, retained for the life
                // of the process (never released).
                check("cuDevicePrimaryCtxRetain", unsafe {
                    cu::cuDevicePrimaryCtxRetain(&mut ctx, dev)
                })?;
                Ok(ctx as usize)
            })
            .clone()?;
        // SAFETY: a retained primary context.
        check("cuCtxSetCurrent", unsafe {
            cu::cuCtxSetCurrent(ctx as cu::CUcontext)
        })
    }

    /// The allocation that contains `addr`, which must be device memory.
    pub(crate) fn allocation(&self, addr: u64) -> Result<Allocation, GpuError> {
        let not_device = |detail: String| GpuError::NotDeviceMemory { addr, detail };
        let mut mem_type: u32 = 0;
        // SAFETY: the memory-type attribute is written as one unsigned int.
        let r = unsafe {
            cu::cuPointerGetAttribute(
                (&mut mem_type as *mut u32).cast::<c_void>(),
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        check("cuPointerGetAttribute(MEMORY_TYPE)", r).map_err(|e| not_device(e.to_string()))?;
        if mem_type != cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(not_device(format!(
                "the driver reports memory type {mem_type}"
            )));
        }
        let mut ordinal: i32 = -1;
        // SAFETY: the device-ordinal attribute is written as one int.
        check("cuPointerGetAttribute(DEVICE_ORDINAL)", unsafe {
            cu::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast::<c_void>(),
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        })?;
        let device =
            u32::try_from(ordinal).map_err(|_| not_device(format!("device ordinal {ordinal}")))?;
        self.bind(device)?;
        let (mut base, mut size): (cu::CUdeviceptr, usize) = (0, 0);
        // SAFETY: writes the base and size of the allocation holding addr.
        check("cuMemGetAddressRange", unsafe {
            cu::cuMemGetAddressRange_v2(&mut base, &mut size, addr)
        })?;
        Ok(Allocation {
            base,
            size: size as u64,
            device,
        })
    }

    /// Sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation at `base`.
    pub(crate) fn set_sync_memops(&self, base: u64) -> Result<(), GpuError> {
        let on: u32 = 1;
        // SAFETY: the attribute's value is read as one unsigned int.
        check("cuPointerSetAttribute(SYNC_MEMOPS)", unsafe {
            cu::cuPointerSetAttribute(
                (&on as *const u32).cast::<c_void>(),
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                base,
            )
        })
    }

    /// Whether the memory at `base` is a VMM allocation (`cuMemCreate`,
    /// mapped), as PyTorch's expandable segments are.
    pub(crate) fn is_vmm(&self, base: u64) -> bool {
        let mut h: cu::CUmemGenericAllocationHandle = 0;
        // SAFETY: writes one handle; fails for memory that is not VMM.
        let r = unsafe { cu::cuMemRetainAllocationHandle(&mut h, base as *mut c_void) };
        if check("cuMemRetainAllocationHandle", r).is_err() {
            return false;
        }
        // SAFETY: the handle retained above, released once.
        let _ = unsafe { cu::cuMemRelease(h) };
        true
    }

    /// Sets `CU_CTX_SYNC_MEMOPS` on `device`'s primary context: what
    /// [`set_sync_memops`](Self::set_sync_memops) does for one allocation,
    /// for VMM memory, which refuses that attribute (drivers from CUDA
    /// 12.1, which have `cuCtxSetFlags`).
    pub(crate) fn set_ctx_sync_memops(&self, device: u32) -> Result<(), GpuError> {
        self.bind(device)?;
        // SAFETY: looks a symbol up in the loaded library (no call).
        if unsafe { cu::culib().get::<unsafe extern "C" fn()>(b"cuCtxSetFlags") }.is_err() {
            return check("cuCtxSetFlags", cu::CUresult::CUDA_ERROR_NOT_SUPPORTED);
        }
        let mut flags: std::ffi::c_uint = 0;
        // SAFETY: writes one unsigned int.
        check("cuCtxGetFlags", unsafe { cu::cuCtxGetFlags(&mut flags) })?;
        let sync = cu::CUctx_flags::CU_CTX_SYNC_MEMOPS as std::ffi::c_uint;
        if flags & sync != 0 {
            return Ok(());
        }
        // SAFETY: sets flags of the current (bound) context.
        check("cuCtxSetFlags", unsafe { cu::cuCtxSetFlags(flags | sync) })
    }

    /// Copies `len` bytes from `src` to `dst` (host or device memory,
    /// either way) with `device`'s context, and waits for the copy.
    ///
    /// # Safety
    /// Both ranges valid for `len` bytes for the whole call.
    pub(crate) unsafe fn copy(
        &self,
        dst: u64,
        src: u64,
        len: u64,
        device: u32,
    ) -> Result<(), GpuError> {
        // SAFETY: forwarded contract.
        unsafe { self.copy_many(&[(dst, src, len)], device, false) }
    }

    /// Copies each `(dst, src, len)` with `device`'s context, all issued on
    /// the thread's stream, then waits once for all of them. With
    /// `all_device` (every range is device memory that `device`'s kernels
    /// can reach: its own, or mapped into its context), many pieces go
    /// through one launch of the piece-copy kernel.
    ///
    /// # Safety
    /// Every range valid for its length for the whole call.
    pub(crate) unsafe fn copy_many(
        &self,
        pieces: &[(u64, u64, u64)],
        device: u32,
        all_device: bool,
    ) -> Result<(), GpuError> {
        if pieces.iter().all(|p| p.2 == 0) {
            return Ok(());
        }
        self.bind(device)?;
        STREAMS.with(|s| {
            let mut streams = s.borrow_mut();
            let at = match streams.iter().position(|s| s.device == device) {
                Some(i) => i,
                None => {
                    let raw = new_stream()?;
                    streams.push(Stream {
                        device,
                        raw,
                        table: None,
                    });
                    streams.len() - 1
                }
            };
            let stream = streams[at].raw;
            let live: Vec<(u64, u64, u64)> = pieces.iter().copied().filter(|p| p.2 > 0).collect();
            if all_device
                && live.len() >= KERNEL_MIN
                && let Some(f) = self.kernel_for(device)
            {
                // SAFETY: every range is reachable device memory, valid for
                // the call (the caller's contract); the launch is waited for
                // below before the table or the ranges are let go.
                let launched = unsafe { self.launch_copies(&mut streams[at], f, &live) };
                // SAFETY: a stream of this thread.
                let synced = check("cuStreamSynchronize", unsafe {
                    cu::cuStreamSynchronize(stream)
                });
                match launched {
                    Ok(()) => return synced,
                    Err(e) => {
                        // Nothing was launched (a launch that was accepted
                        // does not fail here): copy the same bytes below.
                        tracing::warn!(error = %e, "piece-copy kernel failed to launch; copying piece by piece from now on");
                        self.kernel.store(false, std::sync::atomic::Ordering::Relaxed);
                        synced?;
                    }
                }
            }
            if live.len() >= BATCH_MIN && self.batch.load(std::sync::atomic::Ordering::Relaxed) {
                // SAFETY: as for the single copies below.
                match unsafe { batch_copy(&live, stream) } {
                    Ok(()) => {
                        // SAFETY: a stream of this thread.
                        return check("cuStreamSynchronize", unsafe {
                            cu::cuStreamSynchronize(stream)
                        });
                    }
                    Err(e) => {
                        // Whatever was issued completes before the copies
                        // are issued again one by one (same bytes).
                        // SAFETY: a stream of this thread.
                        let _ = unsafe { cu::cuStreamSynchronize(stream) };
                        tracing::warn!(error = %e, "batched copies failed; copying one by one from now on");
                        self.batch.store(false, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            let mut issued = Ok(());
            for &(dst, src, len) in &live {
                // SAFETY: the caller keeps every range valid; the copies are
                // waited for below (also after a failed issue), before they
                // may change owner.
                issued = check("cuMemcpyAsync", unsafe {
                    cu::cuMemcpyAsync(dst, src, len as usize, stream)
                });
                if issued.is_err() {
                    break;
                }
            }
            // SAFETY: a stream of this thread.
            let synced = check("cuStreamSynchronize", unsafe {
                cu::cuStreamSynchronize(stream)
            });
            issued.and(synced)
        })
    }

    /// The piece-copy kernel for `device` (its context current) unless it
    /// is turned off or failed.
    pub(super) fn kernel_for(&self, device: u32) -> Option<cu::CUfunction> {
        if !self.kernel.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        self.copy_kernel(device)
    }

    /// The piece-copy kernel in `device`'s context (the context is
    /// current), loaded on first use; `None` when the driver would not load
    /// it (logged once).
    fn copy_kernel(&self, device: u32) -> Option<cu::CUfunction> {
        let f = (*self.kernels.get(device as usize)?.get_or_init(|| {
            let mut module: cu::CUmodule = std::ptr::null_mut();
            // SAFETY: a NUL-terminated PTX image; the module stays loaded
            // for the life of the process (never unloaded).
            let loaded = check("cuModuleLoadData", unsafe {
                cu::cuModuleLoadData(&mut module, COPY_PTX.as_ptr().cast())
            });
            let mut f: cu::CUfunction = std::ptr::null_mut();
            let found = loaded.and_then(|()| {
                // SAFETY: writes one function handle of the loaded module.
                check("cuModuleGetFunction", unsafe {
                    cu::cuModuleGetFunction(&mut f, module, COPY_ENTRY.as_ptr())
                })
            });
            match found {
                Ok(()) => Some(f as usize),
                Err(e) => {
                    tracing::warn!(device, error = %e, "the piece-copy kernel did not load; small copies go one by one");
                    None
                }
            }
        }))?;
        Some(f as cu::CUfunction)
    }

    /// Writes `pieces` (split into entries of at most
    /// [`KERNEL_ENTRY_MAX`] bytes) into `s`'s table and launches the kernel
    /// on `s`'s stream. Not waited for.
    ///
    /// # Safety
    /// Every range is device memory reachable from the current context,
    /// valid until the stream is synchronised; `s`'s earlier work has
    /// completed (its table may be rewritten).
    unsafe fn launch_copies(
        &self,
        s: &mut Stream,
        f: cu::CUfunction,
        pieces: &[(u64, u64, u64)],
    ) -> Result<(), GpuError> {
        let entries: usize = pieces
            .iter()
            .map(|p| p.2.div_ceil(KERNEL_ENTRY_MAX) as usize)
            .sum();
        let n = u32::try_from(entries).map_err(|_| GpuError::Driver {
            call: "cuLaunchKernel",
            code: cu::CUresult::CUDA_ERROR_INVALID_VALUE as u32,
            name: format!("{entries} copies in one launch"),
        })?;
        let table = self.table(s, entries)?;
        // SAFETY: the table holds `cap >= entries` entries of three u64
        // each, and no launch reads it (earlier work completed).
        let host = unsafe { std::slice::from_raw_parts_mut(table.host, entries * 3) };
        let mut rows = host.chunks_exact_mut(3);
        for &(dst, src, len) in pieces {
            for_each_entry(dst, src, len, KERNEL_ENTRY_MAX, |e| {
                rows.next().expect("counted above").copy_from_slice(&e)
            });
        }
        let at = table.host as u64;
        // SAFETY: the table (pinned host memory, which the GPU reads where
        // it is) holds `n` entries of reachable ranges (the caller's
        // contract).
        unsafe { launch_pieces(f, at, n, s.raw) }
    }

    /// `s`'s table, grown to hold at least `entries` entries.
    fn table<'s>(&self, s: &'s mut Stream, entries: usize) -> Result<&'s Table, GpuError> {
        if s.table.as_ref().is_some_and(|t| t.cap >= entries) {
            return Ok(s.table.as_ref().expect("checked above"));
        }
        if let Some(t) = s.table.take() {
            free_table(t);
        }
        let cap = entries.next_power_of_two().max(1024);
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer to `cap * 24` bytes of pinned memory.
        check("cuMemHostAlloc", unsafe {
            cu::cuMemHostAlloc(&mut host, cap * 24, cu::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(s.table.insert(Table {
            host: host.cast(),
            cap,
        }))
    }

    /// A device attribute of `device`.
    pub(crate) fn attribute(
        &self,
        device: u32,
        attr: cu::CUdevice_attribute,
    ) -> Result<i32, GpuError> {
        let mut dev = 0;
        // SAFETY: writes one device handle.
        check("cuDeviceGet", unsafe {
            cu::cuDeviceGet(&mut dev, device as i32)
        })?;
        let mut v = 0;
        // SAFETY: writes one int.
        check("cuDeviceGetAttribute", unsafe {
            cu::cuDeviceGetAttribute(&mut v, attr, dev)
        })?;
        Ok(v)
    }

    /// `device`'s PCI bus id (`0000:3b:00.0`), as sysfs names it.
    pub(crate) fn pci_bus_id(&self, device: u32) -> Result<String, GpuError> {
        let mut dev = 0;
        // SAFETY: writes one device handle.
        check("cuDeviceGet", unsafe {
            cu::cuDeviceGet(&mut dev, device as i32)
        })?;
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: writes a NUL-terminated string of at most 32 bytes.
        check("cuDeviceGetPCIBusId", unsafe {
            cu::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev)
        })?;
        // SAFETY: NUL-terminated by the driver within the buffer.
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(s.to_string_lossy().to_lowercase())
    }

    /// Exports `[base, base + size)` of device memory as a dma-buf (for
    /// `ibv_reg_dmabuf_mr`); `base` and `size` host-page aligned.
    pub(crate) fn dmabuf(&self, device: u32, base: u64, size: u64) -> Result<OwnedFd, GpuError> {
        self.bind(device)?;
        let mut fd: i32 = -1;
        // SAFETY: the dma-buf handle type writes one int (a file descriptor).
        check("cuMemGetHandleForAddressRange(DMA_BUF_FD)", unsafe {
            cu::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast::<c_void>(),
                base,
                size as usize,
                cu::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        // SAFETY: a new descriptor the driver made for us.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The legacy IPC handle of the allocation at `base` (64 bytes), for
    /// another process to open.
    pub(crate) fn ipc_handle(&self, device: u32, base: u64) -> Result<[u8; 64], GpuError> {
        self.bind(device)?;
        let mut h = cu::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: writes one 64-byte handle.
        check("cuIpcGetMemHandle", unsafe {
            cu::cuIpcGetMemHandle(&mut h, base)
        })?;
        Ok(h.reserved.map(|c| c as u8))
    }

    /// Opens another process's IPC handle on `device`: the base address of
    /// its allocation in this process.
    pub(crate) fn ipc_open(&self, device: u32, handle: &[u8; 64]) -> Result<u64, GpuError> {
        self.bind(device)?;
        let h = cu::CUipcMemHandle_st {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; the handle is passed by value.
        check("cuIpcOpenMemHandle", unsafe {
            cu::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(ptr)
    }

    /// Closes a mapping from [`ipc_open`](Self::ipc_open).
    ///
    /// # Safety
    /// `ptr` came from `ipc_open` and is not used afterwards.
    pub(crate) unsafe fn ipc_close(&self, device: u32, ptr: u64) -> Result<(), GpuError> {
        self.bind(device)?;
        // SAFETY: forwarded contract.
        check("cuIpcCloseMemHandle", unsafe {
            cu::cuIpcCloseMemHandle(ptr)
        })
    }

    /// The POSIX file descriptor of the VMM allocation (`cuMemCreate`)
    /// mapped at `base`, exported for another process to import
    /// (`cuMemExportToShareableHandle`); `None` when the memory is not a
    /// VMM allocation, or its creator did not ask for descriptor handles.
    pub(crate) fn vmm_export(&self, device: u32, base: u64) -> Result<Option<OwnedFd>, GpuError> {
        self.bind(device)?;
        let mut h: cu::CUmemGenericAllocationHandle = 0;
        // SAFETY: writes one handle; fails for memory that is not VMM.
        let r = unsafe { cu::cuMemRetainAllocationHandle(&mut h, base as *mut c_void) };
        if check("cuMemRetainAllocationHandle", r).is_err() {
            return Ok(None);
        }
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: a POSIX descriptor handle is written as one int.
        let r = unsafe {
            cu::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast::<c_void>(),
                h,
                cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        // SAFETY: the handle retained above, released once (the mapping
        // keeps the allocation).
        let _ = unsafe { cu::cuMemRelease(h) };
        match check("cuMemExportToShareableHandle", r) {
            // SAFETY: the driver made `fd`, and gives it to the caller.
            Ok(()) if fd >= 0 => Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) })),
            Ok(()) => Ok(None),
            Err(e) => {
                tracing::debug!(base, error = %e, "a VMM allocation without a descriptor handle");
                Ok(None)
            }
        }
    }

    /// Imports a peer process's VMM allocation of `size` bytes from its
    /// descriptor `fd` and maps it whole, readable and writable from
    /// `device`: its address in this process.
    pub(crate) fn vmm_import(&self, device: u32, fd: &OwnedFd, size: u64) -> Result<u64, GpuError> {
        use std::os::fd::AsRawFd;
        self.bind(device)?;
        let size = size as usize;
        let mut h: cu::CUmemGenericAllocationHandle = 0;
        // SAFETY: a POSIX descriptor handle is passed as the descriptor's
        // value; the driver does not take ownership of it.
        check("cuMemImportFromShareableHandle", unsafe {
            cu::cuMemImportFromShareableHandle(
                &mut h,
                fd.as_raw_fd() as usize as *mut c_void,
                cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        // SAFETY: the handle was just imported, and is given up here.
        unsafe { map_whole(h, size, device) }
    }

    /// Unmaps a mapping from [`vmm_import`](Self::vmm_import) or
    /// [`vmm_alloc`](Self::vmm_alloc) and frees its address range.
    ///
    /// # Safety
    /// `ptr` and `size` are such a mapping's, not used afterwards.
    pub(crate) unsafe fn vmm_unmap(
        &self,
        device: u32,
        ptr: u64,
        size: u64,
    ) -> Result<(), GpuError> {
        self.bind(device)?;
        // SAFETY: forwarded contract.
        check("cuMemUnmap", unsafe { cu::cuMemUnmap(ptr, size as usize) })?;
        // SAFETY: the range reserved for the mapping, now unmapped.
        check("cuMemAddressFree", unsafe {
            cu::cuMemAddressFree(ptr, size as usize)
        })
    }

    /// Allocates at least `len` bytes on `device` through the VMM API,
    /// shareable as a POSIX file descriptor (as PyTorch's expandable
    /// segments are when asked to share), mapped at a fresh address:
    /// `(address, mapped size)`.
    pub(crate) fn vmm_alloc(&self, device: u32, len: u64) -> Result<(u64, u64), GpuError> {
        self.bind(device)?;
        let mut prop: cu::CUmemAllocationProp = zeroed_prop();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = location(device);
        let mut grain: usize = 0;
        // SAFETY: writes one size.
        check("cuMemGetAllocationGranularity", unsafe {
            cu::cuMemGetAllocationGranularity(
                &mut grain,
                &prop,
                cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        let grain = grain.max(1) as u64;
        let size = len.max(1).div_ceil(grain) * grain;
        let mut h: cu::CUmemGenericAllocationHandle = 0;
        // SAFETY: writes one handle.
        check("cuMemCreate", unsafe {
            cu::cuMemCreate(&mut h, size as usize, &prop, 0)
        })?;
        // SAFETY: the handle was just made, and is given up here.
        let ptr = unsafe { map_whole(h, size as usize, device) }?;
        Ok((ptr, size))
    }

    /// Allocates `len` bytes of device memory on `device`.
    pub(crate) fn alloc(&self, device: u32, len: u64) -> Result<u64, GpuError> {
        self.bind(device)?;
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: writes one device pointer.
        check("cuMemAlloc", unsafe {
            cu::cuMemAlloc_v2(&mut ptr, len.max(1) as usize)
        })?;
        Ok(ptr)
    }

    /// Frees device memory from [`alloc`](Self::alloc).
    ///
    /// # Safety
    /// `ptr` came from `alloc` and is not used afterwards.
    pub(crate) unsafe fn free(&self, device: u32, ptr: u64) -> Result<(), GpuError> {
        self.bind(device)?;
        // SAFETY: forwarded contract.
        check("cuMemFree", unsafe { cu::cuMemFree_v2(ptr) })
    }
}

/// Calls `f` with the table entries (`[dst, src, len]`) of one copy: cut
/// into parts of at most `most` bytes.
pub(super) fn for_each_entry(dst: u64, src: u64, len: u64, most: u64, mut f: impl FnMut([u64; 3])) {
    let mut at = 0;
    while at < len {
        let n = (len - at).min(most);
        f([dst + at, src + at, n]);
        at += n;
    }
}

/// Launches the piece-copy kernel `f` on `stream` over the `n` entries
/// (`dst, src, len`, three u64 each) of the table at `table` (device
/// memory, or pinned host memory: the GPU reads it where it is).
///
/// # Safety
/// The table and every range in it reachable from the stream's context,
/// valid until the launch has completed; no entry longer than
/// [`KERNEL_ENTRY_MAX`] bytes.
pub(super) unsafe fn launch_pieces(
    f: cu::CUfunction,
    table: u64,
    n: u32,
    stream: cu::CUstream,
) -> Result<(), GpuError> {
    let blocks = (n as usize).clamp(1, KERNEL_BLOCKS_MAX) as u32;
    let (mut arg_table, mut arg_n) = (table, n);
    let mut args = [
        (&mut arg_table as *mut u64).cast::<c_void>(),
        (&mut arg_n as *mut u32).cast::<c_void>(),
    ];
    // SAFETY: the kernel takes (const Piece *table, unsigned n), given by
    // pointers that live for the call; the rest is the caller's contract.
    check("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(
            f,
            blocks,
            1,
            1,
            KERNEL_THREADS,
            1,
            1,
            0,
            stream,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

/// Fewest copies issued as one batch (`cuMemcpyBatchAsync`): per-copy
/// launch cost dominates small pieces (a KV cache's fragments are a few
/// KiB to tens of KiB each).
const BATCH_MIN: usize = 4;

/// Issues `pieces` (`(dst, src, len)`, each non-empty) on `stream` with one
/// `cuMemcpyBatchAsync` call, sources read in stream order.
///
/// # Safety
/// Every range valid for its length until the stream is synchronised.
unsafe fn batch_copy(pieces: &[(u64, u64, u64)], stream: cu::CUstream) -> Result<(), GpuError> {
    let mut dsts: Vec<cu::CUdeviceptr> = pieces.iter().map(|p| p.0).collect();
    let mut srcs: Vec<cu::CUdeviceptr> = pieces.iter().map(|p| p.1).collect();
    let mut sizes: Vec<usize> = pieces.iter().map(|p| p.2 as usize).collect();
    let nowhere = cu::CUmemLocation_st {
        type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
        id: 0,
    };
    let mut attrs = [cu::CUmemcpyAttributes_st {
        srcAccessOrder: cu::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: nowhere,
        dstLocHint: nowhere,
        flags: 0,
    }];
    let mut attr_at = [0usize];
    let mut fail = usize::MAX;
    // SAFETY: the arrays hold `pieces.len()` entries each and live for the
    // call; one attribute entry applies from index 0; the ranges are the
    // caller's to keep valid.
    check("cuMemcpyBatchAsync", unsafe {
        cu::cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            pieces.len(),
            attrs.as_mut_ptr(),
            attr_at.as_mut_ptr(),
            1,
            &mut fail,
            stream,
        )
    })
}

/// Whether the driver reports `attr` set on `device` (a probe: errors read
/// as "no").
pub(crate) fn flag(cuda: &Cuda, device: u32, attr: cu::CUdevice_attribute) -> bool {
    cuda.attribute(device, attr).is_ok_and(|v| v != 0)
}

pub(crate) use cu::CUdevice_attribute as DeviceAttribute;

/// Maps the physical allocation `h` of `size` bytes whole at a fresh
/// address, readable and writable from `device`: reserves the range, maps
/// the handle, opens it, undoing each step done when a later one fails;
/// gives up the handle either way (a mapping keeps the allocation). The
/// mapping's address.
///
/// # Safety
/// `h` is a live handle of `size` bytes the caller owns and gives up.
unsafe fn map_whole(
    h: cu::CUmemGenericAllocationHandle,
    size: usize,
    device: u32,
) -> Result<u64, GpuError> {
    let mut ptr: cu::CUdeviceptr = 0;
    // SAFETY: each call on the range this one reserved, undone in reverse
    // when a later one fails; the handle released once.
    unsafe {
        let r = check(
            "cuMemAddressReserve",
            cu::cuMemAddressReserve(&mut ptr, size, 0, 0, 0),
        )
        .and_then(|()| {
            check("cuMemMap", cu::cuMemMap(ptr, size, 0, h, 0)).inspect_err(|_| {
                cu::cuMemAddressFree(ptr, size);
            })
        })
        .and_then(|()| {
            let access = access_desc(device);
            check("cuMemSetAccess", cu::cuMemSetAccess(ptr, size, &access, 1)).inspect_err(|_| {
                cu::cuMemUnmap(ptr, size);
                cu::cuMemAddressFree(ptr, size);
            })
        });
        cu::cuMemRelease(h);
        r.map(|()| ptr)
    }
}

/// `device` as a VMM location.
fn location(device: u32) -> cu::CUmemLocation {
    cu::CUmemLocation {
        type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device as std::ffi::c_int,
    }
}

/// Read and write access for `device`.
fn access_desc(device: u32) -> cu::CUmemAccessDesc {
    cu::CUmemAccessDesc {
        location: location(device),
        flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// An allocation property with every field zero (what the driver reads as
/// "none" for each), for the caller to fill.
fn zeroed_prop() -> cu::CUmemAllocationProp {
    cu::CUmemAllocationProp {
        type_: cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_INVALID,
        requestedHandleTypes: cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: location(0),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: cu::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Device memory allocated with `cuMemAlloc`, freed on drop: for tests,
/// the benchmark and examples that need VRAM to register (kvxfer itself
/// never allocates device memory for a caller).
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: u64,
    len: u64,
    device: u32,
    /// Made through the VMM API: the size mapped, unmapped on drop.
    vmm: Option<u64>,
}

impl DeviceBuffer {
    /// `len` bytes (at least one) of device memory on `device`, unset.
    ///
    /// # Errors
    /// [`GpuError::NoDriver`] without a driver; [`GpuError::Driver`] when
    /// the allocation fails.
    pub fn new(device: u32, len: u64) -> Result<Self, GpuError> {
        let ptr = driver()?.alloc(device, len)?;
        Ok(Self {
            ptr,
            len,
            device,
            vmm: None,
        })
    }

    /// `len` bytes (at least one) of device memory on `device` made through
    /// the VMM API (`cuMemCreate`, mapped at an address of its own) and
    /// shareable as a POSIX file descriptor, as PyTorch's expandable
    /// segments make it: same-host peers reach it through that descriptor
    /// rather than a legacy IPC handle, which VMM memory has none of.
    ///
    /// # Errors
    /// [`GpuError::NoDriver`] without a driver; [`GpuError::Driver`] when
    /// the allocation fails.
    pub fn new_vmm(device: u32, len: u64) -> Result<Self, GpuError> {
        let (ptr, size) = driver()?.vmm_alloc(device, len)?;
        Ok(Self {
            ptr,
            len,
            device,
            vmm: Some(size),
        })
    }

    /// Its device address (what a VRAM descriptor names).
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device ordinal it lives on.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Copies `data` to offset `at`.
    ///
    /// # Errors
    /// [`GpuError::PastAllocation`] when it does not fit; a driver error.
    pub fn write(&self, at: u64, data: &[u8]) -> Result<(), GpuError> {
        let dst = self.range(at, data.len() as u64)?;
        // SAFETY: `dst..+len` lies inside this allocation (checked), `data`
        // is a live slice.
        unsafe { driver()?.copy(dst, data.as_ptr() as u64, data.len() as u64, self.device) }
    }

    /// Copies `out.len()` bytes from offset `at` into `out`.
    ///
    /// # Errors
    /// [`GpuError::PastAllocation`] when the range does not fit; a driver
    /// error.
    pub fn read(&self, at: u64, out: &mut [u8]) -> Result<(), GpuError> {
        let src = self.range(at, out.len() as u64)?;
        // SAFETY: as in `write`, with `out` a live mutable slice.
        unsafe { driver()?.copy(out.as_mut_ptr() as u64, src, out.len() as u64, self.device) }
    }

    /// Copies `(at, src_at, len)` pieces from `src` into this buffer (both
    /// device memory), all issued at once, then waits for them.
    ///
    /// # Errors
    /// [`GpuError::PastAllocation`] when a piece does not fit either
    /// buffer; a driver error.
    pub fn copy_pieces(
        &self,
        src: &DeviceBuffer,
        pieces: &[(u64, u64, u64)],
    ) -> Result<(), GpuError> {
        let mut abs = Vec::with_capacity(pieces.len());
        for &(at, src_at, len) in pieces {
            abs.push((self.range(at, len)?, src.range(src_at, len)?, len));
        }
        // SAFETY: every piece lies inside one of the two live allocations
        // (checked above).
        unsafe { driver()?.copy_many(&abs, self.device, src.device == self.device) }
    }

    fn range(&self, at: u64, len: u64) -> Result<u64, GpuError> {
        match at.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.ptr + at),
            _ => Err(GpuError::PastAllocation {
                addr: self.ptr.wrapping_add(at),
                len,
                base: self.ptr,
                size: self.len,
            }),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Ok(cuda) = driver() {
            // SAFETY: allocated by `new` (or mapped by `new_vmm`), freed
            // once; the owner promised (by registering) to deregister
            // before dropping it.
            let freed = unsafe {
                match self.vmm {
                    None => cuda.free(self.device, self.ptr),
                    Some(size) => cuda.vmm_unmap(self.device, self.ptr, size),
                }
            };
            if let Err(e) = freed {
                tracing::warn!(error = %e, "freeing device memory failed");
            }
        }
    }
}

/// A CUDA event the caller recorded on a stream of device `device`'s
/// primary context (`torch.cuda.Event`'s handle, a `cudaEvent_t`): work
/// that may go once the stream reached it waits for it
/// ([`CacheSender::layers_ready_after`](crate::cache::CacheSender::layers_ready_after)).
#[derive(Clone, Copy, Debug)]
pub struct CudaEvent {
    raw: u64,
    device: u32,
}

impl CudaEvent {
    /// The event whose handle is `raw`, of device `device`.
    ///
    /// # Safety
    /// `raw` is a `CUevent` of `device`'s primary context, and stays valid
    /// (not destroyed) until the wait on it ended.
    pub unsafe fn from_raw(raw: u64, device: u32) -> Self {
        Self { raw, device }
    }

    /// Blocks the calling thread until the work recorded before the event
    /// completed (`cuEventSynchronize`; a `CU_EVENT_BLOCKING_SYNC` event
    /// sleeps instead of spinning).
    ///
    /// # Errors
    /// [`GpuError::NoDriver`]; the driver's error for a fault in that work.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        let cuda = driver()?;
        cuda.bind(self.device)?;
        // SAFETY: a live event of this context, per `from_raw`'s contract.
        check("cuEventSynchronize", unsafe {
            cu::cuEventSynchronize(self.raw as cu::CUevent)
        })
    }
}

/// The device ordinal of the GPU memory at `addr` (as a `__cuda_array_interface__`
/// pointer does not say).
///
/// # Errors
/// [`GpuError::NoDriver`] without a driver; [`GpuError::NotDeviceMemory`]
/// when `addr` is not device memory.
pub fn device_of(addr: u64) -> Result<u32, GpuError> {
    Ok(driver()?.allocation(addr)?.device)
}

/// What the driver and its devices offer, for diagnostics (`kvxfer-bench
/// gpu-probe`, the GPU check script).
#[derive(Debug, Clone)]
pub struct Probe {
    /// The driver's version (`1000 * major + 10 * minor`).
    pub driver_version: i32,
    /// One entry per device.
    pub devices: Vec<DeviceProbe>,
}

/// One device, as [`probe`] found it.
#[derive(Debug, Clone)]
pub struct DeviceProbe {
    /// Its ordinal.
    pub ordinal: u32,
    /// Its PCI bus id, as sysfs names it.
    pub pci_bus_id: String,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dmabuf_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpudirect_rdma_supported: bool,
    /// Whether a 2 MiB allocation could be exported as a dma-buf (the
    /// driver's error otherwise).
    pub dmabuf_export: Result<(), GpuError>,
}

/// Probes the driver and every device (allocating 2 MiB on each to try a
/// dma-buf export).
///
/// # Errors
/// [`GpuError::NoDriver`] without a driver.
pub fn probe() -> Result<Probe, GpuError> {
    let cuda = driver()?;
    let mut devices = Vec::new();
    for ordinal in 0..cuda.device_count() {
        let dmabuf_export = DeviceBuffer::new(ordinal, 2 << 20)
            .and_then(|b| cuda.dmabuf(ordinal, b.addr(), b.len()).map(drop));
        devices.push(DeviceProbe {
            ordinal,
            pci_bus_id: cuda.pci_bus_id(ordinal).unwrap_or_else(|e| e.to_string()),
            dmabuf_supported: flag(
                cuda,
                ordinal,
                DeviceAttribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            ),
            gpudirect_rdma_supported: flag(
                cuda,
                ordinal,
                DeviceAttribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED,
            ),
            dmabuf_export,
        });
    }
    Ok(Probe {
        driver_version: cuda.version(),
        devices,
    })
}

/// A peer process's allocation opened through its IPC handle, closed on
/// drop (after which its address must not be used).
#[derive(Debug)]
pub(crate) struct IpcMapping {
    device: u32,
    base: u64,
    /// Imported through a VMM descriptor: the size mapped.
    vmm: Option<u64>,
}

impl IpcMapping {
    /// Opens `handle` with `device`'s context.
    pub(crate) fn open(device: u32, handle: &[u8; 64]) -> Result<Self, GpuError> {
        let base = driver()?.ipc_open(device, handle)?;
        tracing::debug!(device, base, "opened a peer's GPU allocation (CUDA IPC)");
        Ok(Self {
            device,
            base,
            vmm: None,
        })
    }

    /// Imports a peer's VMM allocation of `size` bytes from its descriptor
    /// `fd` and maps it for `device`.
    pub(crate) fn import(device: u32, fd: &OwnedFd, size: u64) -> Result<Self, GpuError> {
        let base = driver()?.vmm_import(device, fd, size)?;
        tracing::debug!(device, base, size, "mapped a peer's VMM allocation");
        Ok(Self {
            device,
            base,
            vmm: Some(size),
        })
    }

    /// The allocation's base address in this process.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Ok(cuda) = driver() {
            // SAFETY: opened by `open`, closed once; its owner (a link's IPC
            // table) is dropped only when no copy through it runs.
            let closed = unsafe {
                match self.vmm {
                    None => cuda.ipc_close(self.device, self.base),
                    Some(size) => cuda.vmm_unmap(self.device, self.base, size),
                }
            };
            if let Err(e) = closed {
                tracing::warn!(error = %e, "closing a peer's GPU allocation failed");
            }
        }
    }
}

/// How GPU memory was registered with an RDMA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RdmaMethod {
    /// `cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer (the `nvidia-peermem` module).
    PeerMemory,
}

/// The method that worked, per (GPU, RDMA device): tried first next time.
static RDMA_METHODS: std::sync::Mutex<Vec<((u32, String), RdmaMethod)>> =
    std::sync::Mutex::new(Vec::new());

/// Registers VRAM region `d` (of allocation `g`) with `dev` for GPUDirect
/// RDMA: by dma-buf (the host-page-aligned range around it exported by the
/// driver, registered at the region's own address), else by handing the
/// device pointer to `ibv_reg_mr` (peer memory); the method that works for
/// a (GPU, NIC) pair is logged once and tried first afterwards.
///
/// # Safety
/// The range must stay allocated while registered (the NIC may access it).
///
/// # Errors
/// [`GpuError::RdmaRegistration`] naming both attempts' failures.
pub(crate) unsafe fn register_rdma(
    dev: &crate::verbs::Device,
    d: &crate::memory::MemoryDesc,
    g: &crate::registry::GpuRegion,
) -> Result<crate::verbs::Registered, crate::error::Error> {
    use std::os::fd::AsRawFd;
    let key = (g.device, dev.name().to_owned());
    let known = {
        let m = RDMA_METHODS.lock().unwrap_or_else(|p| p.into_inner());
        m.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    };
    let dmabuf = || -> Result<crate::verbs::Registered, String> {
        let cuda = driver().map_err(|e| e.to_string())?;
        const PAGE: u64 = 4096;
        let start = (d.addr & !(PAGE - 1)).max(g.base);
        let end = (d.addr + d.len).next_multiple_of(PAGE);
        let fd = cuda
            .dmabuf(g.device, start, end - start)
            .map_err(|e| e.to_string())?;
        // SAFETY: the caller keeps the range allocated while registered;
        // the region holds its own reference to the dma-buf.
        unsafe { dev.register_dmabuf(fd.as_raw_fd(), d.addr - start, d.len, d.addr) }
            .map_err(|e| e.to_string())
    };
    let peermem = || -> Result<crate::verbs::Registered, String> {
        // SAFETY: as above.
        unsafe { dev.register(d.addr, d.len) }.map_err(|e| e.to_string())
    };
    let order = if known == Some(RdmaMethod::PeerMemory) {
        [RdmaMethod::PeerMemory, RdmaMethod::DmaBuf]
    } else {
        [RdmaMethod::DmaBuf, RdmaMethod::PeerMemory]
    };
    let (mut dmabuf_err, mut peermem_err) = (String::from("not tried"), String::from("not tried"));
    for method in order {
        let r = match method {
            RdmaMethod::DmaBuf => dmabuf(),
            RdmaMethod::PeerMemory => peermem(),
        };
        match r {
            Ok(mr) => {
                if known != Some(method) {
                    tracing::info!(gpu = g.device, nic = %dev.name(), ?method, "GPU memory registered for GPUDirect RDMA");
                    let mut m = RDMA_METHODS.lock().unwrap_or_else(|p| p.into_inner());
                    m.retain(|(k, _)| *k != key);
                    m.push((key.clone(), method));
                }
                return Ok(mr);
            }
            Err(e) => match method {
                RdmaMethod::DmaBuf => dmabuf_err = e,
                RdmaMethod::PeerMemory => peermem_err = e,
            },
        }
    }
    Err(GpuError::RdmaRegistration {
        nic: dev.name().to_owned(),
        dmabuf: dmabuf_err,
        peermem: peermem_err,
    }
    .into())
}
