//! Storage tiers: files (`MemoryType::File`), block devices
//! (`MemoryType::Blk`) and objects (`MemoryType::Obj`, [`obj`]) as transfer
//! targets, for KV-cache offload.
//!
//! An agent opens a file or a block device as *storage* ([`StorageSpec`])
//! and gets a handle; FILE and BLK descriptors name a byte range of it
//! (`addr` = offset, `device_id` = handle) and are registered like any
//! other memory. A request to the agent itself (its own name as the remote
//! agent) with FILE or BLK remote descriptors then WRITEs host memory into
//! the range or READs it back, with the same status and sync-message
//! contract as every other path. Storage regions are exported like host
//! memory: a peer that loaded the agent reaches them through it, over TCP
//! (`engine/target/storage.rs`).
//!
//! The I/O runs on an I/O engine: `io_uring` (one ring and thread) where the
//! kernel offers it, else `pread`/`pwrite` on worker threads (detected and
//! logged, or chosen by [`StorageIo`]); writes to files without `O_DIRECT`
//! go to `pwrite` workers either way (a copy into the page cache, which
//! `io_uring` would hand to its own workers), and so do reads of 8 MiB or
//! more from them; requests that large are split among the workers (each
//! part a copy into or out of the page cache, one core's worth; `io_uring`
//! copies what is cached in its one thread): reads in parts of
//! consecutive ops, writes a file to a part. Block devices, and files opened
//! with [`StorageSpec::direct`], use `O_DIRECT`: every offset, length and
//! memory address must then be a multiple of the device's logical block
//! size, checked before anything moves ([`Error::Misaligned`]).

pub(crate) mod io;
pub mod obj;
pub(crate) mod staged;
pub(crate) mod uring;

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use crate::error::Error;
use crate::memory::{MemoryDesc, MemoryType};

/// What kind of storage a handle is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageKind {
    /// A regular file: `MemoryType::File` descriptors.
    File,
    /// A block device, always opened with `O_DIRECT`: `MemoryType::Blk`
    /// descriptors.
    Block,
}

impl StorageKind {
    /// The memory type of its descriptors.
    pub fn mem_type(self) -> MemoryType {
        match self {
            StorageKind::File => MemoryType::File,
            StorageKind::Block => MemoryType::Blk,
        }
    }
}

/// A file or block device to open as storage
/// ([`TransferAgent::open_storage`](crate::TransferAgent::open_storage)).
#[derive(Clone, Debug)]
pub struct StorageSpec {
    /// Its path.
    pub path: PathBuf,
    /// File or block device.
    pub kind: StorageKind,
    /// FILE: create the file when it does not exist.
    pub create: bool,
    /// FILE: set its length to this many bytes (`ftruncate`) once open.
    pub size: Option<u64>,
    /// FILE: open with `O_DIRECT` (no page cache; alignment checked as for
    /// block devices). Block devices are always opened so.
    pub direct: bool,
    /// FILE: ranges may be registered past the end of the file, and a
    /// WRITE there extends it (as `pwrite` does); a READ of bytes past the
    /// end is still refused before anything moves. Off: every registered
    /// range lies inside the file.
    pub grow: bool,
}

impl StorageSpec {
    /// An existing file, through the page cache.
    pub fn file(path: impl Into<PathBuf>) -> Self {
        StorageSpec {
            path: path.into(),
            kind: StorageKind::File,
            create: false,
            size: None,
            direct: false,
            grow: false,
        }
    }

    /// A block device (`O_DIRECT`).
    pub fn block(path: impl Into<PathBuf>) -> Self {
        StorageSpec {
            path: path.into(),
            kind: StorageKind::Block,
            create: false,
            size: None,
            direct: true,
            grow: false,
        }
    }

    /// FILE: created if missing, and `size` bytes long once open.
    pub fn create(mut self, size: u64) -> Self {
        self.create = true;
        self.size = Some(size);
        self
    }

    /// FILE: `O_DIRECT` on or off.
    pub fn direct(mut self, on: bool) -> Self {
        self.direct = on || self.kind == StorageKind::Block;
        self
    }

    /// FILE: ranges past the end allowed, WRITEs there extend the file
    /// (see [`grow`](Self::grow)); a block device never grows.
    pub fn grow(mut self, on: bool) -> Self {
        self.grow = on && self.kind == StorageKind::File;
        self
    }
}

/// Which I/O engine moves storage data ([`AgentConfig::storage`](crate::AgentConfig)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StorageIo {
    /// `io_uring` where the kernel allows it, else `pread`/`pwrite` (logged).
    #[default]
    Auto,
    /// `io_uring` only: opening storage fails where it is unavailable.
    IoUring,
    /// `pread`/`pwrite` on worker threads.
    Psync,
}

impl std::str::FromStr for StorageIo {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "auto" => Ok(StorageIo::Auto),
            "io_uring" | "uring" => Ok(StorageIo::IoUring),
            "psync" | "pread" => Ok(StorageIo::Psync),
            other => Err(Error::InvalidConfig(format!(
                "storage I/O engine {other:?}: expected auto, io_uring or psync"
            ))),
        }
    }
}

/// One open file or block device.
#[derive(Debug)]
pub(crate) struct StorageFile {
    pub(crate) handle: u32,
    pub(crate) kind: StorageKind,
    file: std::fs::File,
    /// The alignment `O_DIRECT` needs of offsets, lengths and addresses
    /// (the logical block size); 1 without `O_DIRECT`.
    pub(crate) align: u32,
    pub(crate) path: PathBuf,
    /// WRITEs may extend the file ([`StorageSpec::grow`]).
    pub(crate) grow: bool,
    /// Without `O_DIRECT`: its I/O goes through the page cache.
    pub(crate) buffered: bool,
}

impl StorageFile {
    fn open(handle: u32, spec: &StorageSpec) -> Result<Self, Error> {
        let fail = |op: &'static str, e: std::io::Error| Error::Storage {
            handle: u64::from(handle),
            op,
            source: Arc::new(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", spec.path.display()),
            )),
        };
        let direct = spec.direct || spec.kind == StorageKind::Block;
        let mut opts = std::fs::OpenOptions::new();
        opts.read(true).write(true);
        if spec.kind == StorageKind::File && spec.create {
            opts.create(true);
        }
        let mut flags = libc::O_CLOEXEC;
        if direct {
            flags |= libc::O_DIRECT;
        }
        std::os::unix::fs::OpenOptionsExt::custom_flags(&mut opts, flags);
        let file = opts.open(&spec.path).map_err(|e| fail("open", e))?;
        let meta = file.metadata().map_err(|e| fail("fstat", e))?;
        let is_block = std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type());
        match spec.kind {
            StorageKind::File if !meta.is_file() => {
                return Err(Error::InvalidConfig(format!(
                    "{} is not a regular file",
                    spec.path.display()
                )));
            }
            StorageKind::Block if !is_block => {
                return Err(Error::InvalidConfig(format!(
                    "{} is not a block device",
                    spec.path.display()
                )));
            }
            _ => {}
        }
        if let (StorageKind::File, Some(size)) = (spec.kind, spec.size) {
            file.set_len(size).map_err(|e| fail("ftruncate", e))?;
        }
        let align = if !direct {
            1
        } else if is_block {
            logical_block_size(file.as_raw_fd()).map_err(|e| fail("ioctl(BLKSSZGET)", e))?
        } else {
            // A file on a filesystem: the block device's logical block size
            // is what O_DIRECT needs; 4096 covers every common device.
            4096
        };
        Ok(StorageFile {
            handle,
            kind: spec.kind,
            file,
            align,
            path: spec.path.clone(),
            grow: spec.grow && spec.kind == StorageKind::File,
            buffered: !direct,
        })
    }

    /// The open file, for plain reads and writes.
    pub(crate) fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// The descriptor for I/O.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Its current size in bytes (a file's length, a device's capacity).
    pub(crate) fn size(&self) -> std::io::Result<u64> {
        match self.kind {
            StorageKind::File => Ok(self.file.metadata()?.len()),
            StorageKind::Block => block_device_size(self.raw_fd()),
        }
    }

    /// `Ok` when `value` is a multiple of the direct-I/O alignment.
    pub(crate) fn aligned(&self, what: &'static str, value: u64) -> Result<(), Error> {
        if !value.is_multiple_of(u64::from(self.align)) {
            return Err(Error::Misaligned {
                handle: u64::from(self.handle),
                what,
                value,
                block: self.align,
            });
        }
        Ok(())
    }
}

/// `BLKSSZGET`: the device's logical block size.
fn logical_block_size(fd: RawFd) -> std::io::Result<u32> {
    let mut v: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which is valid.
    let r = unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut v as *mut libc::c_int) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v.max(1) as u32)
}

/// `_IOR(0x12, 114, size_t)`: not in the libc crate.
const BLKGETSIZE64: libc::Ioctl = 0x8008_1272;

/// `BLKGETSIZE64`: the device's capacity in bytes.
fn block_device_size(fd: RawFd) -> std::io::Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
    let r = unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut v as *mut u64) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

/// An agent's open storage and its I/O engine (started with the first
/// handle).
///
/// Drop order: the engines and the GPU stager first (their drops wait for
/// the batches in flight, whose requests also keep their files open), then
/// the files.
pub(crate) struct Storage {
    engine: OnceLock<Arc<dyn io::IoEngine>>,
    /// I/O through the page cache when `engine` is `io_uring` (started on
    /// first use): `pwrite`/`pread` workers ([`Storage::page_cache`]).
    page_cache: OnceLock<Arc<dyn io::IoEngine>>,
    /// Moves GPU memory to and from storage (started on first use).
    stager: OnceLock<staged::Stager>,
    files: RwLock<HashMap<u32, Arc<StorageFile>>>,
    /// Open objects (OBJ regions' handles), numbered with the files.
    objects: RwLock<HashMap<u32, Arc<OpenObject>>>,
    next: AtomicU32,
    choice: StorageIo,
    /// Serialises starting the engine.
    starting: Mutex<()>,
}

impl Storage {
    pub(crate) fn new(choice: StorageIo) -> Self {
        Storage {
            engine: OnceLock::new(),
            page_cache: OnceLock::new(),
            stager: OnceLock::new(),
            files: RwLock::new(HashMap::new()),
            objects: RwLock::new(HashMap::new()),
            next: AtomicU32::new(1),
            choice,
            starting: Mutex::new(()),
        }
    }

    /// Opens `spec`; its handle.
    pub(crate) fn open(&self, spec: &StorageSpec) -> Result<u32, Error> {
        self.engine()?;
        let handle = self.next.fetch_add(1, Ordering::Relaxed);
        let f = StorageFile::open(handle, spec)?;
        tracing::debug!(handle, path = %spec.path.display(), kind = ?spec.kind, align = f.align, "storage opened");
        self.write().insert(handle, Arc::new(f));
        Ok(handle)
    }

    /// Adopts an open descriptor of a regular file (through the page
    /// cache, unless it was opened with `O_DIRECT`: then offsets, lengths
    /// and addresses must be multiples of 4096).
    pub(crate) fn adopt(&self, fd: OwnedFd) -> Result<u32, Error> {
        self.engine()?;
        let handle = self.next.fetch_add(1, Ordering::Relaxed);
        let path = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        let file = std::fs::File::from(fd);
        let meta = file.metadata().map_err(|e| Error::Storage {
            handle: u64::from(handle),
            op: "fstat",
            source: Arc::new(e),
        })?;
        if !meta.is_file() {
            return Err(Error::InvalidConfig(
                "an adopted storage descriptor must be a regular file".into(),
            ));
        }
        // SAFETY: F_GETFL on a descriptor this function owns; no pointer.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        let direct = flags >= 0 && flags & libc::O_DIRECT != 0;
        let f = StorageFile {
            handle,
            kind: StorageKind::File,
            file,
            align: if direct { 4096 } else { 1 },
            path,
            // The caller's descriptor: its file grows as WRITEs reach past
            // the end, as `pwrite` on it would.
            grow: true,
            buffered: !direct,
        };
        self.write().insert(handle, Arc::new(f));
        Ok(handle)
    }

    /// Opens object `key` of `store`; its handle.
    pub(crate) fn open_object(&self, store: &obj::ObjectStore, key: &str) -> Result<u32, Error> {
        if key.is_empty() || key.len() > 1024 {
            return Err(Error::InvalidConfig(format!(
                "an object key is 1 to 1024 bytes, not {}",
                key.len()
            )));
        }
        let handle = self.next.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(handle, bucket = %store.config().bucket, key, "object opened");
        let o = OpenObject {
            store: store.clone(),
            key: key.into(),
        };
        self.objects
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(handle, Arc::new(o));
        Ok(handle)
    }

    /// The open object an OBJ descriptor names (its `device_id`).
    pub(crate) fn object(&self, d: &MemoryDesc) -> Result<Arc<OpenObject>, Error> {
        self.objects
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&d.device_id)
            .cloned()
            .ok_or(Error::InvalidDescriptor {
                desc: *d,
                reason: "device_id is not an open object handle",
            })
    }

    /// Closes `handle`; `in_use` tells whether regions of it are still
    /// registered (then it stays open).
    pub(crate) fn close(&self, handle: u32, in_use: bool) -> Result<(), Error> {
        {
            let mut objects = self.objects.write().unwrap_or_else(|p| p.into_inner());
            if objects.contains_key(&handle) {
                if in_use {
                    return Err(Error::InvalidRequest(format!(
                        "object handle {handle} still has registered regions: deregister them first"
                    )));
                }
                objects.remove(&handle);
                return Ok(());
            }
        }
        let mut files = self.write();
        if !files.contains_key(&handle) {
            return Err(Error::InvalidRequest(format!(
                "no open storage with handle {handle}"
            )));
        }
        if in_use {
            return Err(Error::InvalidRequest(format!(
                "storage handle {handle} still has registered regions: deregister them first"
            )));
        }
        files.remove(&handle);
        Ok(())
    }

    /// The open storage `handle`.
    pub(crate) fn get(&self, handle: u32) -> Option<Arc<StorageFile>> {
        self.read().get(&handle).cloned()
    }

    /// Checks a FILE or BLK descriptor about to be registered: its handle
    /// open and of the right kind, the range inside the file or device,
    /// aligned for direct I/O.
    pub(crate) fn check_region(&self, mem_type: MemoryType, d: &MemoryDesc) -> Result<(), Error> {
        if mem_type == MemoryType::Obj {
            // The object need not exist yet (a WRITE makes it); a READ past
            // its end fails with `ObjErrorKind::InvalidRange`.
            self.object(d)?;
            return Ok(());
        }
        let f = self.get(d.device_id).ok_or(Error::InvalidDescriptor {
            desc: *d,
            reason: "device_id is not an open storage handle",
        })?;
        if f.kind.mem_type() != mem_type {
            return Err(Error::InvalidDescriptor {
                desc: *d,
                reason: "the storage handle holds the other kind of descriptor (FILE or BLK)",
            });
        }
        f.aligned("offset", d.addr)?;
        f.aligned("length", d.len)?;
        let end = d.addr.checked_add(d.len).ok_or(Error::InvalidDescriptor {
            desc: *d,
            reason: "the range wraps around",
        })?;
        // A file opened to grow takes ranges past its end.
        if !f.grow {
            let size = f.size().map_err(|e| Error::Storage {
                handle: u64::from(f.handle),
                op: "size",
                source: Arc::new(e),
            })?;
            if end > size {
                return Err(Error::InvalidDescriptor {
                    desc: *d,
                    reason: "the range ends past the end of the file or device",
                });
            }
        }
        Ok(())
    }

    /// The registered-buffer slot of host region `region` (registered with
    /// the engine on first use), if the engine has one for it.
    pub(crate) fn buffer_slot(&self, region: &crate::registry::LocalRegion) -> Option<u16> {
        let engine = self.engine.get()?;
        *region.storage_slot.get_or_init(|| {
            // SAFETY: the region is registered with the agent (its memory
            // stays allocated until deregistered, which forgets the slot
            // first, or until the agent, and with it the engine, drops).
            unsafe { engine.register_buffer(region.desc.addr, region.desc.len) }
        })
    }

    /// Gives back a registered-buffer slot (its region deregistered).
    pub(crate) fn forget_buffer(&self, slot: u16) {
        if let Some(e) = self.engine.get() {
            e.forget_buffer(slot);
        }
    }

    /// The I/O engine, started on first use.
    pub(crate) fn engine(&self) -> Result<&Arc<dyn io::IoEngine>, Error> {
        self.started(&self.engine, || io::start(self.choice))
    }

    /// What `cell` holds, made by `start` on first use (one start at a
    /// time: a thread that lost the race finds it made).
    fn started<'a, T>(
        &self,
        cell: &'a OnceLock<T>,
        start: impl FnOnce() -> Result<T, Error>,
    ) -> Result<&'a T, Error> {
        if let Some(v) = cell.get() {
            return Ok(v);
        }
        let _g = self.starting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = cell.get() {
            return Ok(v);
        }
        let v = start()?;
        Ok(cell.get_or_init(|| v))
    }

    /// The engine for a batch of writes to files opened without
    /// `O_DIRECT`, and for the parts of a large read from them:
    /// `pwrite`/`pread` on worker threads even where the agent's engine is
    /// `io_uring`, which hands buffered writes to its own workers and
    /// moves them about a sixth slower (page-cache WRITE 1 MiB × 64: 4.4
    /// against 5.3 GB/s), and reads what is cached in its one thread; the
    /// agent's engine itself when that is `pread`/`pwrite`.
    pub(crate) fn page_cache(&self) -> Result<&Arc<dyn io::IoEngine>, Error> {
        let engine = self.engine()?;
        if engine.name() != "io_uring" {
            return Ok(engine);
        }
        self.started(&self.page_cache, || io::start(StorageIo::Psync))
    }

    /// The GPU stager, started on first use.
    pub(crate) fn stager(&self) -> Result<&staged::Stager, Error> {
        self.started(&self.stager, staged::Stager::start)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<u32, Arc<StorageFile>>> {
        self.files.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<u32, Arc<StorageFile>>> {
        self.files.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// An open object: its store and key.
pub(crate) struct OpenObject {
    pub(crate) store: obj::ObjectStore,
    pub(crate) key: Arc<str>,
}

/// Whether `path` names a block device.
pub fn is_block_device(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
        .unwrap_or(false)
}
