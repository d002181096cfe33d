//! Shared pools: host memory that same-host peers map once and then copy
//! into (or out of) with plain loads and stores.
//!
//! A [`SharedPool`] is a memory file (`memfd_create`, or a file the
//! application owns, such as one under `/dev/shm`) mapped shared into this
//! process. Registered with
//! [`TransferAgent::register_shared_pool`](crate::TransferAgent::register_shared_pool),
//! it is a host (DRAM) region like any other — every transport moves it —
//! and, on the shm transport, a same-host peer that has proven which
//! process it is (see `docs/security.md`) receives the file's descriptor
//! over the local socket, maps it once, and does each transfer as a
//! `memcpy` in its own process: no page pinning per call, no kernel copy.
//!
//! A mapping is standing access: for as long as the pool stays registered,
//! the peer can reach all of the file, not only what a request names.
//! [`PoolAccess::ReadOnly`] gives peers a read-only descriptor (they can
//! READ from the pool, never WRITE it). Deregistration revokes: every peer
//! unmaps the file before
//! [`deregister_memory`](crate::TransferAgent::deregister_memory) returns
//! (or, when a peer does not answer within the agent's I/O timeout, its
//! channel is closed, which an honest peer reads as a revocation).
//!
//! ```
//! use kvxfer::{AgentConfig, Backend, PoolAccess, SharedPool, make_transfer_agent};
//!
//! let agent = make_transfer_agent(Backend::Shm, AgentConfig::new("pool-doc")).unwrap();
//! let pool = SharedPool::new(1 << 20).unwrap();
//! let descs = agent.register_shared_pool(&pool, PoolAccess::ReadWrite).unwrap();
//! assert_eq!(descs.total_len(), 1 << 20);
//! agent.deregister_memory(&descs).unwrap();
//! ```

use std::ffi::CStr;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use crate::error::Error;
use crate::memory::{MemoryDesc, MemoryDescs, MemoryType};

/// What same-host peers may do with a registered shared pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolAccess {
    /// Peers map it writable: WRITE into it and READ from it.
    ReadWrite,
    /// Peers map it read-only (they receive a read-only descriptor): READ
    /// from it only; a WRITE into it goes the cross-memory way, checked
    /// per request as for any region.
    ReadOnly,
}

/// A memory file mapped shared into this process; see the
/// [module documentation](self). Clones share the mapping, which lasts
/// until the last clone (and every agent registration holding one) drops.
#[derive(Clone)]
pub struct SharedPool {
    map: Arc<Mapping>,
}

/// A file mapped into this process, unmapped and closed when dropped (the
/// mapping first, then the descriptor).
pub(crate) struct Mapping {
    addr: std::ptr::NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain memory owned by this value; nothing in it is
// tied to a thread, and this type hands out only raw addresses.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: shared references expose nothing but the address,
// length and descriptor.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are the mapping this value made and owns;
        // nothing uses it after the last owner drops.
        unsafe { libc::munmap(self.addr.as_ptr().cast(), self.len) };
    }
}

impl Mapping {
    /// Maps `len` bytes of `fd` from `offset` (a multiple of the page
    /// size), shared, readable and (when `writable`) writable.
    pub(crate) fn map(fd: OwnedFd, offset: u64, len: usize, writable: bool) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an empty mapping",
            ));
        }
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        let off = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset out of range"))?;
        // SAFETY: a new mapping chosen by the kernel; `fd` is open for the
        // call. Nothing aliases it until this value hands its address out.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let addr = std::ptr::NonNull::new(p.cast()).ok_or_else(|| io::Error::other("null map"))?;
        Ok(Self { addr, len, fd })
    }

    /// The first mapped byte.
    pub(crate) fn addr(&self) -> u64 {
        self.addr.as_ptr() as u64
    }

    /// The file mapped.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Seals the file's size: it can no longer shrink, so no mapping of it
/// ever reaches past its end (which would fault the process that maps it).
fn seal_size(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: `fd` is open; integer arguments.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `len` bytes of the file `fd` can be mapped with no risk that
/// its owner shrinks it under the mapping: the file is that long and its
/// size is sealed against shrinking.
pub(crate) fn sealed(fd: &OwnedFd, len: u64) -> bool {
    // SAFETY: `fd` is open; integer arguments.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return false;
    }
    std::fs::File::from(match fd.try_clone() {
        Ok(f) => f,
        Err(_) => return false,
    })
    .metadata()
    .is_ok_and(|m| m.len() >= len)
}

impl SharedPool {
    /// A new pool of `len` bytes in an anonymous memory file
    /// (`memfd_create`), zero-filled.
    ///
    /// # Errors
    /// [`Error::InvalidDescriptor`] for an empty pool; [`Error::Io`] when
    /// the kernel refuses the file or the mapping.
    pub fn new(len: usize) -> Result<Self, Error> {
        if len == 0 {
            return Err(Error::InvalidDescriptor {
                desc: MemoryDesc::new(0, 0, 0),
                reason: "an empty shared pool",
            });
        }
        let name: &CStr = c"kvxfer-pool";
        // SAFETY: a NUL-terminated name; the flags are plain integers.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pool size out of range"))?;
        // SAFETY: `fd` is open; a plain system call.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error().into());
        }
        seal_size(&fd)?;
        Ok(Self {
            map: Arc::new(Mapping::map(fd, 0, len, true)?),
        })
    }

    /// A pool over all of the memory file `fd`, opened for reading and
    /// writing (a `memfd`, or a file under `/dev/shm` that the application
    /// owns), mapped shared. Peers that are given the pool reach the whole
    /// file.
    ///
    /// # Errors
    /// [`Error::InvalidDescriptor`] for an empty file or one that is not a
    /// regular file; [`Error::Io`] when it cannot be mapped (for instance
    /// a read-only descriptor).
    pub fn from_fd(fd: OwnedFd) -> Result<Self, Error> {
        let meta = std::fs::File::from(fd.try_clone().map_err(Error::from)?).metadata()?;
        if !meta.is_file() || meta.len() == 0 {
            return Err(Error::InvalidDescriptor {
                desc: MemoryDesc::new(0, meta.len(), 0),
                reason: "a shared pool needs a regular, non-empty memory file",
            });
        }
        let len = usize::try_from(meta.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file too large"))?;
        // A file that cannot be sealed (not a memfd made for sealing) is
        // still a pool here, but peers will not map it (see `sealed`).
        let _ = seal_size(&fd);
        Ok(Self {
            map: Arc::new(Mapping::map(fd, 0, len, true)?),
        })
    }

    /// The pool's first byte in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.addr.as_ptr()
    }

    /// The pool's size in bytes.
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Whether the pool is empty (never: pools have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// The whole pool as one host-memory descriptor list.
    pub fn descs(&self) -> MemoryDescs {
        MemoryDescs::new(
            MemoryType::Dram,
            vec![MemoryDesc::new(self.map.addr(), self.map.len as u64, 0)],
        )
    }

    /// The mapping, for a registration to hold.
    pub(crate) fn mapping(&self) -> &Arc<Mapping> {
        &self.map
    }
}

impl fmt::Debug for SharedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedPool")
            .field("addr", &format_args!("{:#x}", self.map.addr()))
            .field("len", &self.map.len)
            .finish()
    }
}

/// A region's access key from `random`: odd for a shared pool, even for
/// any other region, so that a peer asks the agent for a pool only when the
/// key says it is one (one bit of 64 less to guess).
pub(crate) fn access_key(random: u64, pool: bool) -> u64 {
    if pool { random | 1 } else { random & !1 }
}

/// Whether an access key names a shared pool (see [`access_key`]).
pub(crate) fn is_pool_key(key: u64) -> bool {
    key & 1 == 1
}

/// A registered pool's share: what a peer is given.
#[derive(Clone)]
pub(crate) struct Share {
    /// The pool's mapping, held while registered.
    pub(crate) pool: Arc<Mapping>,
    /// Whether peers may map it writable.
    pub(crate) writable: bool,
}

impl fmt::Debug for Share {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Share")
            .field("addr", &format_args!("{:#x}", self.pool.addr()))
            .field("len", &self.pool.len)
            .field("writable", &self.writable)
            .finish()
    }
}

impl Share {
    /// A descriptor of the pool's file to hand a peer: read-only unless
    /// the pool is shared writable (a read-only descriptor cannot be
    /// mapped writable).
    pub(crate) fn descriptor(&self) -> io::Result<OwnedFd> {
        if self.writable {
            return self.pool.fd().try_clone_to_owned();
        }
        let path = format!("/proc/self/fd/{}", self.pool.fd().as_raw_fd());
        Ok(std::fs::File::open(path)?.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_is_shared_memory_of_its_file() {
        let pool = SharedPool::new(8192).unwrap();
        // SAFETY: the pool's 8192 bytes are mapped and ours alone.
        unsafe { pool.as_ptr().add(100).write(42) };
        let share = Share {
            pool: Arc::clone(pool.mapping()),
            writable: false,
        };
        // A second mapping of the file, as a peer makes it, sees the byte.
        let ro = Mapping::map(share.descriptor().unwrap(), 0, 8192, false).unwrap();
        // SAFETY: mapped readable, 8192 bytes.
        assert_eq!(unsafe { *(ro.addr() as *const u8).add(100) }, 42);
        // The read-only descriptor cannot be mapped writable.
        let e = Mapping::map(share.descriptor().unwrap(), 0, 8192, true)
            .err()
            .unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::EACCES));
        assert!(sealed(&share.descriptor().unwrap(), 8192));
        assert!(!sealed(&share.descriptor().unwrap(), 8193));
        assert!(SharedPool::new(0).is_err());
        assert_eq!(pool.descs().total_len(), 8192);
    }
}
