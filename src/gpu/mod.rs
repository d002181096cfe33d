//! GPU memory (VRAM): what the engine needs from the CUDA driver, and the
//! checks a VRAM registration must pass.
//!
//! The driver (`libcuda.so`) is loaded at run time, on first use (feature
//! `cuda`, cudarc with dynamic loading): kvxfer builds and runs on hosts
//! without CUDA, where registering VRAM fails with
//! [`GpuError::NoDriver`]. This module is pure (no FFI): the driver calls
//! live in `cuda.rs`, behind `driver`, and the staging rings in `staging.rs`.
//!
//! A VRAM registration names a range `[addr, addr + len)` and a device
//! ordinal (`device_id`). It is accepted only when the driver reports that
//! `addr` is device memory, on that device, inside one allocation that
//! covers the whole range; `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`
//! is then set on the allocation so that synchronous copies and memsets
//! are ordered with the transfers that read or write it.

// The driver's FFI is confined to `cuda`.
#![deny(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use crate::memory::MemoryDesc;

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod staging;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod topology;

pub(crate) mod error;
pub use error::GpuError;

/// The RDMA device nearest GPU `gpu` by PCI topology (same PCIe switch,
/// else same NUMA node), when the driver knows the GPU, there are several
/// devices, and one is nearer than the others.
#[cfg(feature = "cuda")]
pub(crate) fn nearest_nic(gpu: u32) -> Option<String> {
    nearest_nics(gpu).into_iter().next()
}

/// Without the `cuda` feature no GPU is known.
#[cfg(not(feature = "cuda"))]
pub(crate) fn nearest_nic(_gpu: u32) -> Option<String> {
    None
}

/// The RDMA devices nearest GPU `gpu` (`topology::nearest_all`: every one
/// under its PCIe switch, else one on its NUMA node), when there are
/// several devices and one is nearer than another; else none.
#[cfg(feature = "cuda")]
pub(crate) fn nearest_nics(gpu: u32) -> Vec<String> {
    let sys = std::path::Path::new("/sys");
    let several = std::fs::read_dir(sys.join("class/infiniband")).map_or(0, Iterator::count) > 1;
    if !several {
        return Vec::new();
    }
    let Ok(cuda) = driver() else {
        return Vec::new();
    };
    if gpu >= cuda.device_count() {
        return Vec::new();
    }
    let Ok(bdf) = cuda.pci_bus_id(gpu) else {
        return Vec::new();
    };
    let Some((g, nics)) = topology::read_topology(sys, &bdf) else {
        return Vec::new();
    };
    topology::nearest_all(&g, &nics)
        .into_iter()
        .map(str::to_owned)
        .collect()
}

/// Without the `cuda` feature no GPU is known (asked by the libfabric
/// transport only).
#[cfg(all(not(feature = "cuda"), feature = "fabric"))]
pub(crate) fn nearest_nics(_gpu: u32) -> Vec<String> {
    Vec::new()
}
#[cfg(feature = "cuda")]
pub use cuda::{CudaEvent, DeviceBuffer, DeviceProbe, Probe, device_of, probe};
#[cfg(feature = "cuda")]
pub(crate) use cuda::{IpcMapping, driver, register_rdma};
#[cfg(feature = "cuda")]
use staging::Ticket;
#[cfg(feature = "cuda")]
pub(crate) use staging::with_staging;

/// Without the `cuda` feature nothing is received into GPU memory.
#[cfg(not(feature = "cuda"))]
#[derive(Debug, Clone, Copy)]
struct Ticket;

/// Without the `cuda` feature no GPU memory is registered.
///
/// # Safety
/// None needed: it only fails.
#[cfg(not(feature = "cuda"))]
#[allow(unsafe_code)]
pub(crate) unsafe fn register_rdma(
    _dev: &crate::verbs::Device,
    _d: &MemoryDesc,
    _g: &crate::registry::GpuRegion,
) -> Result<crate::verbs::Registered, crate::error::Error> {
    Err(GpuError::NoDriver("kvxfer was built without the `cuda` feature".into()).into())
}

/// Without the `cuda` feature no peer's GPU memory can be opened.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub(crate) struct IpcMapping;

#[cfg(not(feature = "cuda"))]
impl IpcMapping {
    pub(crate) fn open(_device: u32, _handle: &[u8; 64]) -> Result<Self, GpuError> {
        Err(GpuError::NoDriver(
            "kvxfer was built without the `cuda` feature".into(),
        ))
    }

    pub(crate) fn import(
        _device: u32,
        _fd: &std::os::fd::OwnedFd,
        _size: u64,
    ) -> Result<Self, GpuError> {
        Err(GpuError::NoDriver(
            "kvxfer was built without the `cuda` feature".into(),
        ))
    }

    pub(crate) fn base(&self) -> u64 {
        0
    }
}

/// The shape of a thread's staging ring: `slots` pinned host buffers of
/// `chunk` bytes each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StagingShape {
    pub(crate) chunk: usize,
    pub(crate) slots: usize,
}

/// Why moving device memory through a socket failed: the socket or the
/// driver.
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum StageError {
    Io(std::io::Error),
    Gpu(GpuError),
}

impl From<GpuError> for StageError {
    fn from(e: GpuError) -> Self {
        StageError::Gpu(e)
    }
}

static STAGED_COPIES: AtomicU64 = AtomicU64::new(0);
static STAGED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Counts copies through pinned host buffers (the one place a copy is
/// made: device memory on a path that cannot reach it).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn count_staged(copies: u64, bytes: u64) {
    STAGED_COPIES.fetch_add(copies, Ordering::Relaxed);
    STAGED_BYTES.fetch_add(bytes, Ordering::Relaxed);
}

/// Staging copies made by this process so far: `(copies, bytes)`. Device
/// memory moved over TCP passes through pinned host buffers, one copy per
/// chunk (at most `GpuConfig::staging_chunk` bytes); every other path
/// copies nothing.
pub fn staging_copies() -> (u64, u64) {
    (
        STAGED_COPIES.load(Ordering::Relaxed),
        STAGED_BYTES.load(Ordering::Relaxed),
    )
}

/// One device-memory allocation, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Allocation {
    /// Its base address.
    pub(crate) base: u64,
    /// Its size in bytes.
    pub(crate) size: u64,
    /// The device ordinal it lives on.
    pub(crate) device: u32,
}

/// Checks that `desc` lies inside `alloc` (which contains `desc.addr`) and
/// names its device.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn check_range(alloc: &Allocation, desc: &MemoryDesc) -> Result<(), GpuError> {
    if alloc.device != desc.device_id {
        return Err(GpuError::WrongDevice {
            addr: desc.addr,
            len: desc.len,
            claimed: desc.device_id,
            actual: alloc.device,
        });
    }
    let end = desc.addr.checked_add(desc.len);
    let alloc_end = alloc.base.saturating_add(alloc.size);
    if desc.addr < alloc.base || end.is_none_or(|e| e > alloc_end) {
        return Err(GpuError::PastAllocation {
            addr: desc.addr,
            len: desc.len,
            base: alloc.base,
            size: alloc.size,
        });
    }
    Ok(())
}

/// Checks a VRAM registration against the driver (see the module docs),
/// sets `SYNC_MEMOPS` on its allocation, and takes the allocation's IPC
/// handle for peers on this host — a legacy one, else (VMM memory) its
/// POSIX file descriptor when its creator made it shareable so; none when
/// the driver gives neither.
#[cfg(feature = "cuda")]
pub(crate) fn admit_registration(
    desc: &MemoryDesc,
) -> Result<crate::registry::GpuRegion, GpuError> {
    let cuda = driver()?;
    let alloc = cuda.allocation(desc.addr)?;
    check_range(&alloc, desc)?;
    if cuda.is_vmm(alloc.base) {
        // VMM memory refuses the allocation's attribute: the context's
        // flag orders its synchronous operations instead.
        cuda.set_ctx_sync_memops(alloc.device)?;
    } else {
        cuda.set_sync_memops(alloc.base)?;
    }
    let (ipc, vmm) = match cuda.ipc_handle(alloc.device, alloc.base) {
        Ok(h) => (Some(h), None),
        Err(e) => match cuda.vmm_export(alloc.device, alloc.base)? {
            Some(fd) => (
                None,
                Some(std::sync::Arc::new(crate::registry::VmmShare {
                    fd,
                    size: alloc.size,
                })),
            ),
            None => {
                tracing::info!(addr = desc.addr, error = %e, "no IPC handle for a GPU region: peers on this host reach it over TCP");
                (None, None)
            }
        },
    };
    Ok(crate::registry::GpuRegion {
        device: alloc.device,
        base: alloc.base,
        offset: desc.addr - alloc.base,
        ipc,
        vmm,
    })
}

/// Without the `cuda` feature no VRAM can be registered.
#[cfg(not(feature = "cuda"))]
pub(crate) fn admit_registration(
    _desc: &MemoryDesc,
) -> Result<crate::registry::GpuRegion, GpuError> {
    Err(GpuError::NoDriver(
        "kvxfer was built without the `cuda` feature".into(),
    ))
}

/// Copies each `(dst, src, len)` (host or device memory, either way) with
/// `device`'s context, issued together, and waits for all. `all_device`:
/// every range is device memory reachable from `device`'s context (its
/// own, or mapped into it), so that many small pieces may go through one
/// kernel launch.
///
/// # Safety
/// Every range valid for its length for the whole call.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub(crate) unsafe fn copy_many(
    pieces: &[(u64, u64, u64)],
    device: u32,
    all_device: bool,
) -> Result<(), GpuError> {
    // SAFETY: forwarded contract.
    unsafe { driver()?.copy_many(pieces, device, all_device) }
}

/// Without the `cuda` feature there is no device memory to copy.
///
/// # Safety
/// None needed: it only fails.
#[cfg(not(feature = "cuda"))]
#[allow(unsafe_code)]
pub(crate) unsafe fn copy_many(
    _pieces: &[(u64, u64, u64)],
    _device: u32,
    _all_device: bool,
) -> Result<(), GpuError> {
    Err(GpuError::NoDriver(
        "kvxfer was built without the `cuda` feature".into(),
    ))
}

/// Copies device memory `[src, src + dst.len())` on `device` into the host
/// buffer `dst`, waited for; counted as a staging copy (a path that
/// cannot reach device memory: objects).
///
/// # Safety
/// The device range is memory on `device`, allocated for the whole call.
#[allow(unsafe_code)]
pub(crate) unsafe fn stage_out(device: u32, src: u64, dst: &mut [u8]) -> Result<(), GpuError> {
    // SAFETY: `dst` is a live host buffer of that length; the device range
    // per this function's contract.
    unsafe { staged_copy(device, (dst.as_mut_ptr() as u64, src, dst.len() as u64)) }
}

/// Copies the host buffer `src` into device memory at `dst` on `device`,
/// waited for; counted as a staging copy.
///
/// # Safety
/// `[dst, dst + src.len())` is memory on `device`, allocated and not
/// otherwise accessed for the whole call.
#[allow(unsafe_code)]
pub(crate) unsafe fn stage_in(device: u32, dst: u64, src: &[u8]) -> Result<(), GpuError> {
    // SAFETY: `src` is a live host buffer of that length; the device range
    // per this function's contract.
    unsafe { staged_copy(device, (dst, src.as_ptr() as u64, src.len() as u64)) }
}

/// One `(dst, src, len)` copy between host and device memory with
/// `device`'s context, waited for and counted as a staging copy.
///
/// # Safety
/// Both ranges valid for their length for the whole call.
#[allow(unsafe_code)]
unsafe fn staged_copy(device: u32, piece: (u64, u64, u64)) -> Result<(), GpuError> {
    // SAFETY: forwarded contract.
    unsafe { copy_many(&[piece], device, false) }?;
    count_staged(1, piece.2);
    Ok(())
}

/// Sends device memory pieces `(address, length)` on `device` through
/// `write` (`write(i, bytes)`: a chunk of piece `i`), in order, staged
/// through the calling thread's pinned ring with the copies running ahead
/// across pieces; `stop` is asked before each piece. Returns the pieces
/// sent (fewer only when stopped), every copy completed.
///
/// # Safety
/// Each piece is device memory on `device`, not empty, allocated for the
/// whole call.
#[allow(unsafe_code)]
pub(crate) unsafe fn send_staged_pieces(
    device: u32,
    shape: StagingShape,
    pieces: &[(u64, u64)],
    stop: &dyn Fn() -> bool,
    write: &mut dyn FnMut(usize, &[u8]) -> std::io::Result<()>,
) -> Result<usize, StageError> {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: forwarded contract.
        with_staging(device, shape, |s| unsafe {
            s.send_pieces(pieces, stop, write)
        })?
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, shape, pieces, stop, write);
        Err(StageError::Gpu(GpuError::NoDriver(
            "kvxfer was built without the `cuda` feature".into(),
        )))
    }
}

/// Segments received into GPU memory through the calling thread's staging
/// rings whose copies may still be running, oldest first, each with what
/// its receiver keeps until they have landed (the guard that holds the
/// memory registered, the request to tell). Receiving a segment returns
/// once its copies are issued, so the next segment is read from the socket
/// while they run; [`next`](Self::next) hands segments back in order, once
/// landed.
///
/// Bound to the thread that made it (the rings are the thread's own).
/// Dropping it waits for every copy still running, then drops the tags: the
/// memory a copy writes stays held until the copy is over.
pub(crate) struct Landings<T> {
    queue: std::collections::VecDeque<(Ticket, T)>,
    _thread: std::marker::PhantomData<*const ()>,
}

impl<T> Landings<T> {
    /// No segment in flight.
    pub(crate) fn new() -> Self {
        Landings {
            queue: std::collections::VecDeque::new(),
            _thread: std::marker::PhantomData,
        }
    }

    /// Whether every segment received has been handed back.
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Receives `len` bytes through `read` into device memory at `dst` on
    /// `device` (the calling thread's ring of `shape`), chunk by chunk, and
    /// returns once the copies are issued: `tag` comes back from
    /// [`next`](Self::next) when they have landed. On failure `tag` comes
    /// back at once, every copy of the ring completed (a driver failure
    /// that leaves the ring failed fails the segments before it too).
    ///
    /// # Safety
    /// `[dst, dst + len)` is device memory of `device`, allocated and
    /// writable until `tag` comes back (`tag` may be what holds it so).
    #[allow(unsafe_code)]
    pub(crate) unsafe fn land(
        &mut self,
        device: u32,
        shape: StagingShape,
        dst: u64,
        len: u64,
        read: &mut dyn FnMut(&mut [u8]) -> std::io::Result<()>,
        tag: T,
    ) -> Result<(), (StageError, T)> {
        #[cfg(feature = "cuda")]
        {
            // SAFETY: forwarded contract; the copies are asked after before
            // `tag` is handed back (`next`, `drop`).
            match unsafe { staging::recv_deferred(device, shape, dst, len, read) } {
                Ok(ticket) => {
                    self.queue.push_back((ticket, tag));
                    Ok(())
                }
                Err(e) => Err((e, tag)),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, shape, dst, len, read);
            Err((
                StageError::Gpu(GpuError::NoDriver(
                    "kvxfer was built without the `cuda` feature".into(),
                )),
                tag,
            ))
        }
    }

    /// Issues the copies of received segments still gathered in the
    /// thread's staging buffers (they are issued a buffer at a time, or
    /// when waited for): for a receiver with nothing more to read now.
    pub(crate) fn flush(&self) {
        #[cfg(feature = "cuda")]
        if !self.queue.is_empty() {
            staging::flush_all();
        }
    }

    /// The oldest segment with its outcome once its copies have completed
    /// (or failed); `None` when none is in flight, or when the oldest is
    /// still gathered or copying and `block` is false (else it is issued
    /// and waited for).
    pub(crate) fn next(&mut self, block: bool) -> Option<(T, Result<(), GpuError>)> {
        let &(ticket, _) = self.queue.front()?;
        let r = match landed(ticket, block) {
            Ok(false) => return None,
            Ok(true) => Ok(()),
            Err(e) => Err(e),
        };
        self.queue.pop_front().map(|(_, tag)| (tag, r))
    }
}

/// Whether the copies up to `ticket`'s have landed.
#[cfg(feature = "cuda")]
fn landed(ticket: Ticket, block: bool) -> Result<bool, GpuError> {
    staging::landed(ticket, block)
}

/// Without the `cuda` feature no ticket is ever made.
#[cfg(not(feature = "cuda"))]
fn landed(_ticket: Ticket, _block: bool) -> Result<bool, GpuError> {
    Ok(true)
}

impl<T> Drop for Landings<T> {
    fn drop(&mut self) {
        // The newest ticket of each ring waits for all its copies; the tags
        // (holding the memory) drop after.
        while let Some((ticket, tag)) = self.queue.pop_back() {
            let _ = landed(ticket, true);
            drop(tag);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_must_lie_in_the_allocation_on_the_named_device() {
        let a = Allocation {
            base: 0x1000,
            size: 0x1000,
            device: 1,
        };
        assert_eq!(check_range(&a, &MemoryDesc::new(0x1000, 0x1000, 1)), Ok(()));
        assert_eq!(check_range(&a, &MemoryDesc::new(0x1800, 0x10, 1)), Ok(()));
        assert!(matches!(
            check_range(&a, &MemoryDesc::new(0x1000, 0x10, 0)),
            Err(GpuError::WrongDevice {
                claimed: 0,
                actual: 1,
                ..
            })
        ));
        for d in [
            MemoryDesc::new(0x1800, 0x801, 1),
            MemoryDesc::new(0xfff, 0x10, 1),
            MemoryDesc::new(0x1800, u64::MAX, 1),
        ] {
            assert!(
                matches!(check_range(&a, &d), Err(GpuError::PastAllocation { .. })),
                "{d:?}"
            );
        }
    }
}
