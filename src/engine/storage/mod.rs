//! The storage path: a request to this agent itself whose remote
//! descriptors are its own FILE or BLK regions. Its link resolves them in
//! the agent's registry (held until the request completes), checks every
//! range before anything moves (the file not shrunk under a region, direct
//! I/O alignment of offsets, lengths and buffers, room in the inbox for the
//! sync message) and hands the reads or writes to the storage I/O engine
//! ([`crate::storage::io`]), or for GPU memory to the staging worker
//! ([`crate::storage::staged`]); the status completes once every one of them
//! (and, for a durable request, the sync of each file written) has. An
//! abort skips the ops not yet handed to the kernel.

use std::os::fd::RawFd;

use crate::storage::StorageFile;
use crate::storage::io::{Batch, OP_MAX, Op, PSYNC_THREADS};
use crate::storage::obj::PARTS_MAX;
use crate::storage::obj::pool::{ObjBatch, ObjOp};
use crate::storage::staged::{Piece, StagedBatch};

use crate::agent::{DataPath, TransferOp, TransferRequest, TransferStatus, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::ctx::Ctx;
use crate::engine::transport::{Link, Submission};
use crate::engine::{lock, transport};
use crate::error::Error;
use crate::inbox::Reservation;
use crate::memory::MemoryType;
use crate::registry::RegionGuard;
use std::io;
use std::sync::{Arc, Mutex};

/// A request of this many bytes or more through the page cache is split
/// among the page-cache workers, in parts of at least half as many: a READ
/// in any parts, a WRITE by file.
const PAGE_CACHE_SPLIT_MIN: u64 = 8 << 20;

/// How many parts a large page-cache request is split in: the host's
/// cores, up to the page-cache workers (asked once: the answer reads the
/// process's cgroup files).
fn page_cache_parts() -> usize {
    static PARTS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PARTS.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(PSYNC_THREADS))
    })
}

/// The link of the agent to itself: its storage.
struct StorageLink {
    path: Arc<DataPath>,
    /// Set by [`Link::fail`] (the first cause wins).
    broken: Mutex<Option<Error>>,
    /// Where its requests' outcomes are counted.
    meter: Arc<crate::metrics::Meter>,
}

/// The agent's own storage (its FILE and BLK regions), the transport of
/// its self-peer: requests from its host or GPU memory (staged).
pub(in crate::engine) struct OwnStorage;

impl transport::Transport for OwnStorage {
    fn kind(&self) -> TransportKind {
        TransportKind::Storage
    }

    fn moves(&self, local: MemoryType, remote: MemoryType, _peer: &AgentDesc) -> bool {
        match remote {
            MemoryType::File | MemoryType::Blk => local.is_virtual_address(),
            // Objects from host memory, or GPU memory through a host
            // buffer per HTTP request.
            MemoryType::Obj => matches!(local, MemoryType::Dram | MemoryType::Vram),
            _ => false,
        }
    }

    fn reach(&self, _peer: &AgentDesc) -> Result<(), String> {
        Ok(())
    }

    fn resolves_remote(&self) -> bool {
        // The regions are this agent's own: its link resolves (and holds)
        // them.
        false
    }

    fn connect(&self, cx: Ctx<'_>, _peer: &AgentDesc) -> Result<Arc<dyn Link>, Error> {
        Ok(StorageLink::open(cx)?)
    }
}

impl StorageLink {
    /// The link, with the agent's storage I/O engine started.
    fn open(cx: Ctx<'_>) -> Result<Arc<Self>, Error> {
        let io = cx.storage().engine()?;
        Ok(Arc::new(StorageLink {
            path: Arc::new(DataPath {
                transport: TransportKind::Storage,
                device: Some(io.name().to_owned()),
                mechanism: "reads and writes between registered host memory and the agent's \
                            files and block devices, zero copy (O_DIRECT where opened so); \
                            GPU memory through pinned staging buffers",
            }),
            broken: Mutex::new(None),
            meter: cx
                .metrics()
                .meter(TransportKind::Storage, &cx.config().name),
        }))
    }
}

impl Link for StorageLink {
    fn is_broken(&self) -> bool {
        lock(&self.broken).is_some()
    }

    fn fail(&self, cause: Error) {
        lock(&self.broken).get_or_insert(cause);
    }

    fn join(&self) {}

    fn submit(self: Arc<Self>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        if let Some(e) = lock(&self.broken).clone() {
            return Err(e);
        }
        let Submission {
            cx,
            req,
            resolved,
            sync,
            ..
        } = sub;
        let me = cx.config().name.as_str();
        // Only requests naming FILE or BLK regions reach the self-peer
        // (`Engine::check_request`); one without data is an empty batch.
        let held = cx.registry().acquire_local_keyed(&req.remote, None)?;
        if req.remote.mem_type == MemoryType::Obj {
            let ops = plan_objects(cx, req)?;
            let room = match &sync {
                Some(m) => Some(reserve(cx, me, m.len())?),
                None => None,
            };
            let (id, completion) = cx.in_flight().start(&self.meter, req.local.total_len());
            let done = finisher(cx, &completion, (resolved.guards, held), room, sync);
            let asked = Arc::clone(&completion);
            let batch = ObjBatch {
                ops,
                deadline: None,
                done,
                stop: Box::new(move || asked.abort_requested()),
            };
            // SAFETY: every op's memory lies in local regions checked and
            // held (`guards`) until `done` has run; `plan_objects` refused
            // READs whose destinations overlap.
            unsafe { crate::storage::obj::pool::submit(batch)? };
            return Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)));
        }
        let vram = req.local.mem_type == MemoryType::Vram;
        let shape = cx.config().gpu.shape();
        let Planned {
            ops,
            pieces,
            files,
            written,
        } = plan(cx, req, &resolved.guards, vram.then_some(shape))?;
        // Through the page cache only: writes go to the page-cache
        // workers, and so do large reads; large requests are split among
        // them (the workers started before anything is counted in
        // flight).
        let buffered = !files.is_empty() && files.iter().all(|f| f.buffered);
        let large = buffered && req.local.total_len() >= PAGE_CACHE_SPLIT_MIN;
        let io = if buffered && (req.op == TransferOp::Write || large) {
            cx.storage().page_cache()?
        } else {
            cx.storage().engine()?
        };
        let room = match &sync {
            Some(m) => Some(reserve(cx, me, m.len())?),
            None => None,
        };
        let syncs = if req.durable && req.op == TransferOp::Write {
            written
        } else {
            Vec::new()
        };
        let (id, completion) = cx.in_flight().start(&self.meter, req.local.total_len());
        // The files stay open until now, whatever happened to their handles.
        let done = finisher(cx, &completion, (resolved.guards, held, files), room, sync);
        // `TransferStatus::abort`: the ops not yet handed to the kernel are
        // skipped (and the sync message not delivered).
        let asked = Arc::clone(&completion);
        let stop: crate::storage::io::Stop = Box::new(move || asked.abort_requested());
        if vram {
            let batch = StagedBatch {
                pieces,
                write: req.op == TransferOp::Write,
                sync: syncs,
                shape,
                done,
                stop: Some(stop),
            };
            // SAFETY: every piece's device memory lies in local VRAM
            // regions checked and held (`guards`) and every fd belongs to a
            // storage region held (`held`) until `done` has run.
            unsafe { cx.storage().stager()?.submit(batch) };
            return Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)));
        }
        let batch = Batch {
            ops,
            sync: syncs,
            done,
            stop: Some(stop),
        };
        // Each part a copy by the CPU into or out of the page cache, one
        // core's worth: reads in any parts (they take no lock of the
        // file's), writes a file to a part (one file's take turns).
        let (parts, min_part) = (page_cache_parts(), PAGE_CACHE_SPLIT_MIN / 2);
        let parts = match req.op {
            _ if !large => vec![batch],
            TransferOp::Read => batch.split(parts, min_part),
            TransferOp::Write => batch.split_by_file(parts, min_part),
        };
        for batch in parts {
            // SAFETY: every op's memory lies in local regions checked and
            // held (`guards`) and every fd belongs to a storage region held
            // (`held`) — a held region cannot be deregistered, and storage
            // with registered regions cannot be closed — until `done` has
            // run (the last part's).
            unsafe { io.submit(batch) };
        }
        Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)))
    }
}

/// What runs once a request's I/O has ended: `holds` (its regions, its
/// files) are let go before the status completes, so a caller may
/// deregister them as soon as it sees the outcome; then the sync message is
/// delivered (on success) and the status completed.
fn finisher<H: Send + 'static>(
    cx: Ctx<'_>,
    completion: &Arc<crate::status::Completion>,
    holds: H,
    room: Option<Reservation>,
    sync: Option<Vec<u8>>,
) -> crate::storage::io::Done {
    let inbox = Arc::clone(cx.inbox());
    let done_status = Arc::clone(completion);
    Box::new(move |r: Result<(), Error>| {
        drop(holds);
        if let (Ok(()), Some(room), Some(m)) = (&r, room, sync) {
            inbox.deliver(room, m);
        }
        done_status.complete(r);
    })
}

/// Room in this agent's inbox for its own sync message.
fn reserve(cx: Ctx<'_>, me: &str, len: usize) -> Result<Reservation, Error> {
    cx.inbox()
        .reserve(me, len as u64)
        // Reserved before any I/O.
        .map_err(|reason| Error::RemoteRejected {
            remote: me.to_owned(),
            reason,
            landed: crate::error::Landed::Nothing,
        })
}

/// A request's I/O, planned and checked.
struct Planned {
    /// Host memory's reads or writes.
    ops: Vec<Op>,
    /// GPU memory's, one per descriptor (staged chunk by chunk).
    pieces: Vec<Piece>,
    /// The files its ops use, kept open until it is done.
    files: Vec<Arc<StorageFile>>,
    /// The files it writes: (handle, fd).
    written: Vec<(u32, RawFd)>,
}

/// `req`'s reads or writes, each at most [`OP_MAX`] bytes, after every check
/// (nothing has moved when this fails); and the files written (handle, fd).
/// `guards`: the holds on the local regions, in the order the local
/// descriptors meet them. `staging`: the local memory is on the GPU, moved
/// through staging rings of this shape (whose pinned buffers, not the
/// device addresses, meet the file's alignment: its chunk must).
fn plan(
    cx: Ctx<'_>,
    req: &TransferRequest,
    guards: &[RegionGuard],
    staging: Option<crate::gpu::StagingShape>,
) -> Result<Planned, Error> {
    let write = req.op == TransferOp::Write;
    let n = req.local.descs.len();
    let (mut ops, mut pieces) = match staging {
        None => (Vec::with_capacity(n), Vec::new()),
        Some(_) => (Vec::new(), Vec::with_capacity(n)),
    };
    let mut files: Vec<(Arc<StorageFile>, u64)> = Vec::new();
    let mut held = guards.iter();
    let mut region = held.next();
    for (l, r) in req.local.descs.iter().zip(&req.remote.descs) {
        let f = match files.iter_mut().find(|(f, _)| f.handle == r.device_id) {
            Some((f, end)) => {
                *end = (*end).max(r.addr + r.len);
                Arc::clone(f)
            }
            None => {
                let f = cx
                    .storage()
                    .get(r.device_id)
                    .ok_or(Error::InvalidDescriptor {
                        desc: *r,
                        reason: "device_id is not an open storage handle",
                    })?;
                files.push((Arc::clone(&f), r.addr + r.len));
                f
            }
        };
        f.aligned("offset", r.addr)?;
        f.aligned("length", r.len)?;
        if let Some(shape) = staging {
            f.aligned("staging chunk", shape.chunk as u64)?;
            pieces.push(Piece {
                device: l.device_id,
                gpu: l.addr,
                fd: f.raw_fd(),
                handle: f.handle,
                offset: r.addr,
                len: l.len,
            });
            continue;
        }
        f.aligned("memory address", l.addr)?;
        // The host region holding `l` (the next hold once `l` leaves the
        // current one), and its registered buffer (io_uring fixed buffers).
        while region.is_some_and(|g| !contains(&g.region().desc, l)) {
            region = held.next();
        }
        let fixed = region.and_then(|g| cx.storage().buffer_slot(g.region()));
        let mut done = 0;
        while done < l.len {
            let n = (l.len - done).min(OP_MAX);
            ops.push(Op {
                fd: f.raw_fd(),
                handle: f.handle,
                write,
                buf: l.addr + done,
                len: n as u32,
                offset: r.addr + done,
                fixed,
            });
            done += n;
        }
    }
    // A file shrunk under its regions (truncated by someone else): refused
    // before anything moves, rather than a READ stopping short or a WRITE
    // growing the file back. A file opened to grow: a WRITE may extend it,
    // a READ past its end is refused the same way.
    for (f, end) in &files {
        if write && f.grow {
            continue;
        }
        let size = f.size().map_err(|e| Error::Storage {
            handle: u64::from(f.handle),
            op: "fstat",
            source: Arc::new(e),
        })?;
        if *end > size {
            return Err(Error::Storage {
                handle: u64::from(f.handle),
                op: "size check",
                source: Arc::new(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "{} is {size} bytes long but the request reaches byte {end}: \
                         it was truncated under a registered region",
                        f.path.display()
                    ),
                )),
            });
        }
    }
    let written = if write {
        files.iter().map(|(f, _)| (f.handle, f.raw_fd())).collect()
    } else {
        Vec::new()
    };
    Ok(Planned {
        ops,
        pieces,
        files: files.into_iter().map(|(f, _)| f).collect(),
        written,
    })
}

/// `req`'s object operations, after every check (nothing has been sent
/// when this fails): each remote descriptor's object open; a WRITE writes
/// its object whole (offset 0, one descriptor per object, at most
/// [`PARTS_MAX`] parts); READs' destinations do not overlap.
fn plan_objects(cx: Ctx<'_>, req: &TransferRequest) -> Result<Vec<ObjOp>, Error> {
    let write = req.op == TransferOp::Write;
    let mut ops = Vec::with_capacity(req.local.descs.len());
    let mut written = std::collections::HashSet::new();
    for (l, r) in req.local.descs.iter().zip(&req.remote.descs) {
        let o = cx.storage().object(r)?;
        let part = o.store.config().part_size;
        if write {
            if r.addr != 0 {
                return Err(Error::InvalidDescriptor {
                    desc: *r,
                    reason: "a WRITE to an object writes it whole: its offset must be 0",
                });
            }
            if !written.insert(r.device_id) {
                return Err(Error::InvalidRequest(format!(
                    "object handle {} is written by two descriptors of one request",
                    r.device_id
                )));
            }
            if r.len.div_ceil(part) > PARTS_MAX {
                return Err(Error::InvalidDescriptor {
                    desc: *r,
                    reason: "an object WRITE of more than 10,000 parts (raise the store's part size)",
                });
            }
        }
        ops.push(ObjOp {
            store: Arc::clone(&o.store.inner),
            key: Arc::clone(&o.key),
            write,
            buf: l.addr,
            len: l.len,
            offset: r.addr,
            device: (req.local.mem_type == MemoryType::Vram).then_some(l.device_id),
        });
    }
    if !write {
        let mut spans: Vec<(u64, u64)> = req.local.descs.iter().map(|d| (d.addr, d.len)).collect();
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(Error::InvalidRequest(format!(
                "a READ from objects into overlapping memory ({:#x}+{} and {:#x})",
                w[0].0, w[0].1, w[1].0
            )));
        }
    }
    Ok(ops)
}

/// Whether `d` lies inside `region`.
fn contains(region: &crate::memory::MemoryDesc, d: &crate::memory::MemoryDesc) -> bool {
    region.addr <= d.addr && d.addr + d.len <= region.addr + region.len
}
