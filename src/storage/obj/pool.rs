//! A store's worker threads and a request's batch of object operations.
//!
//! A batch is cut into units: a ranged GET of at most `part_size` bytes, a
//! PUT of an object up to `part_size`, or a multipart upload (its creation,
//! then its parts as units of their own, then its completion, or its abort
//! once a part failed). The units run on the store's `parallel` workers in
//! any order; the batch's `done` runs once, after the last unit has ended,
//! with the first failure — so once a request's outcome is reported, no
//! worker touches its memory any more. After a failure or an abort, the
//! units not yet started are skipped.
//!
//! Drop order: the pool holds only the sending end of the queue; each
//! queued job holds its store's client. When the client drops (no object
//! open, no job queued), the queue closes and the workers end.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::client::Client;
use crate::error::Error;
use crate::storage::io::Done;

/// Whether the batch's caller asked for it to stop (an abort); asked from
/// every worker.
pub(crate) type Stop = Box<dyn Fn() -> bool + Send + Sync>;

/// The guard of `m`, a poisoned lock taken as it is (a panicking unit
/// leaves its batch's state consistent: every field is set in one step).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A job for a worker.
type Job = Box<dyn FnOnce() + Send>;

/// The workers of one store.
pub(crate) struct Pool {
    queue: Sender<Job>,
}

impl Pool {
    fn start(threads: usize) -> Result<Pool, Error> {
        let (queue, jobs) = crossbeam_channel::unbounded::<Job>();
        for i in 0..threads {
            let jobs: Receiver<Job> = jobs.clone();
            std::thread::Builder::new()
                .name(format!("kvxfer-obj-{i}"))
                .spawn(move || {
                    for job in jobs {
                        job();
                    }
                })
                .map_err(|e| Error::Io(Arc::new(e)))?;
        }
        Ok(Pool { queue })
    }

    fn run(&self, job: Job) {
        // The receivers live as long as the pool (the workers end only once
        // every sender is gone): sending cannot fail.
        let _ = self.queue.send(job);
    }
}

/// One descriptor's operation: memory `[buf, buf + len)` to or from
/// object `key` of `store` at `offset`. Host memory, or GPU memory on
/// `device`: then each unit (a PUT, a part, a ranged GET: at most a part
/// size) goes through a host buffer of its own, copied out before it is
/// sent or in after it arrived (a staging copy).
pub(crate) struct ObjOp {
    pub(crate) store: Arc<Client>,
    pub(crate) key: Arc<str>,
    pub(crate) write: bool,
    pub(crate) buf: u64,
    pub(crate) len: u64,
    pub(crate) offset: u64,
    pub(crate) device: Option<u32>,
}

/// A request's object operations.
pub(crate) struct ObjBatch {
    pub(crate) ops: Vec<ObjOp>,
    pub(crate) deadline: Option<Instant>,
    pub(crate) done: Done,
    pub(crate) stop: Stop,
}

/// What the units of a batch share.
struct Shared {
    left: AtomicUsize,
    failure: Mutex<Option<Error>>,
    done: Mutex<Option<Done>>,
    stop: Stop,
    deadline: Option<Instant>,
}

impl Shared {
    /// The outcome of one unit; the last one reports the batch's.
    fn finish(&self, r: Result<(), Error>) {
        if let Err(e) = r {
            lock(&self.failure).get_or_insert(e);
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let failure = lock(&self.failure).take();
            if let Some(done) = lock(&self.done).take() {
                done(failure.map_or(Ok(()), Err));
            }
        }
    }

    /// Before a unit's request: the error to end it with instead.
    fn gate(&self) -> Result<(), Error> {
        if (self.stop)() {
            return Err(Error::Aborted);
        }
        if lock(&self.failure).is_some() {
            // Reported already by the unit that failed.
            return Err(Error::Aborted);
        }
        Ok(())
    }
}

/// Memory of a held region, as a slice for one unit (GPU memory on
/// `device`: through a host buffer).
#[derive(Clone, Copy)]
struct Span {
    addr: u64,
    len: usize,
    device: Option<u32>,
}

impl Span {
    /// `f` on the span's bytes: host memory as it lies, GPU memory copied
    /// into a host buffer first.
    ///
    /// # Safety
    /// As [`bytes`](Self::bytes) (for GPU memory: memory on `device`).
    unsafe fn read_with<R>(self, f: impl FnOnce(&[u8]) -> Result<R, Error>) -> Result<R, Error> {
        match self.device {
            // SAFETY: the caller's contract.
            None => f(unsafe { self.bytes() }),
            Some(device) => {
                let mut host = vec![0u8; self.len];
                // SAFETY: the caller's contract.
                unsafe { crate::gpu::stage_out(device, self.addr, &mut host) }?;
                f(&host)
            }
        }
    }

    /// `f` filling the span: host memory in place, GPU memory through a
    /// host buffer copied in once `f` succeeded.
    ///
    /// # Safety
    /// As [`bytes_mut`](Self::bytes_mut) (for GPU memory: memory on
    /// `device`).
    unsafe fn fill_with(self, f: impl FnOnce(&mut [u8]) -> Result<(), Error>) -> Result<(), Error> {
        match self.device {
            // SAFETY: the caller's contract.
            None => f(unsafe { self.bytes_mut() }),
            Some(device) => {
                let mut host = vec![0u8; self.len];
                f(&mut host)?;
                // SAFETY: the caller's contract.
                unsafe { crate::gpu::stage_in(device, self.addr, &host) }?;
                Ok(())
            }
        }
    }

    /// # Safety
    /// `[addr, addr + len)` is valid for reads while the slice lives.
    unsafe fn bytes<'a>(self) -> &'a [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// # Safety
    /// `[addr, addr + len)` is valid for writes, and no other unit's span
    /// overlaps it, while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut<'a>(self) -> &'a mut [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

/// Runs `batch` on its stores' workers.
///
/// # Safety
/// Every op's memory stays valid (writable for a READ) until `done` has
/// run, and the READs' ranges do not overlap one another.
pub(crate) unsafe fn submit(batch: ObjBatch) -> Result<(), Error> {
    let ObjBatch {
        ops,
        deadline,
        done,
        stop,
    } = batch;
    // The units: (op index, offset into the op, length); a WRITE larger
    // than a part is one unit (its upload).
    let mut units = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let part = op.store.config.part_size;
        if op.write || op.len <= part {
            units.push((i, 0, op.len));
            continue;
        }
        let mut at = 0;
        while at < op.len {
            let n = (op.len - at).min(part);
            units.push((i, at, n));
            at += n;
        }
    }
    for op in &ops {
        op.store.pool()?;
    }
    let shared = Arc::new(Shared {
        left: AtomicUsize::new(units.len().max(1)),
        failure: Mutex::new(None),
        done: Mutex::new(Some(done)),
        stop,
        deadline,
    });
    if units.is_empty() {
        shared.finish(Ok(()));
        return Ok(());
    }
    for (i, at, n) in units {
        let op = &ops[i];
        let store = Arc::clone(&op.store);
        let key = Arc::clone(&op.key);
        let sh = Arc::clone(&shared);
        let span = Span {
            addr: op.buf + at,
            len: n as usize,
            device: op.device,
        };
        let offset = op.offset + at;
        let pool = match op.store.pool() {
            Ok(p) => p,
            // Started above: cannot fail; counted as this unit's failure.
            Err(e) => {
                shared.finish(Err(e));
                continue;
            }
        };
        if !op.write {
            pool.run(Box::new(move || {
                let r = sh.gate().and_then(|()| {
                    // SAFETY: `submit`'s contract; ranges do not overlap.
                    unsafe {
                        span.fill_with(|dst| Ok(store.get_range(&key, offset, dst, sh.deadline)?))
                    }
                });
                sh.finish(r);
            }));
        } else if n <= store.config.part_size {
            pool.run(Box::new(move || {
                let r = sh.gate().and_then(|()| {
                    // SAFETY: `submit`'s contract.
                    unsafe { span.read_with(|src| Ok(store.put(&key, src, sh.deadline)?)) }
                });
                sh.finish(r);
            }));
        } else {
            pool.run(Box::new(move || upload(store, key, span, sh)));
        }
    }
    Ok(())
}

/// A multipart upload's state, shared by its parts.
struct Upload {
    store: Arc<Client>,
    key: Arc<str>,
    id: String,
    etags: Mutex<Vec<Option<String>>>,
    left: AtomicUsize,
    failure: Mutex<Option<Error>>,
    batch: Arc<Shared>,
}

impl Upload {
    /// One part ended; the last completes the upload (or aborts it).
    fn part_done(&self, number: usize, r: Result<String, Error>) {
        match r {
            Ok(etag) => lock(&self.etags)[number] = Some(etag),
            Err(e) => {
                lock(&self.failure).get_or_insert(e);
            }
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let failed = lock(&self.failure).take();
        let r = match failed {
            Some(e) => Err(e),
            None => self.batch.gate().and_then(|()| {
                let etags: Vec<String> = lock(&self.etags)
                    .iter()
                    .map(|e| e.clone().unwrap_or_default())
                    .collect();
                Ok(self
                    .store
                    .complete_upload(&self.key, &self.id, &etags, self.batch.deadline)?)
            }),
        };
        if r.is_err() {
            // The parts uploaded so far go with the upload: no object
            // appears, an existing one stays as it was.
            self.store.abort_upload(&self.key, &self.id);
        }
        self.batch.finish(r);
    }
}

/// The unit of a large WRITE: creates the upload and queues its parts.
fn upload(store: Arc<Client>, key: Arc<str>, span: Span, sh: Arc<Shared>) {
    let id = match sh
        .gate()
        .and_then(|()| Ok(store.create_upload(&key, sh.deadline)?))
    {
        Ok(id) => id,
        Err(e) => return sh.finish(Err(e)),
    };
    let part = store.config.part_size as usize;
    let parts = span.len.div_ceil(part);
    let up = Arc::new(Upload {
        store: Arc::clone(&store),
        key,
        id,
        etags: Mutex::new(vec![None; parts]),
        left: AtomicUsize::new(parts),
        failure: Mutex::new(None),
        batch: sh,
    });
    let pool = match store.pool() {
        Ok(p) => p,
        Err(e) => {
            // Every part fails the same way; the last aborts the upload.
            for n in 0..parts {
                up.part_done(n, Err(e.clone()));
            }
            return;
        }
    };
    for n in 0..parts {
        let up = Arc::clone(&up);
        let piece = Span {
            addr: span.addr + (n * part) as u64,
            len: part.min(span.len - n * part),
            device: span.device,
        };
        pool.run(Box::new(move || {
            let r = up.batch.gate().and_then(|()| {
                if lock(&up.failure).is_some() {
                    return Err(Error::Aborted);
                }
                // SAFETY: `submit`'s contract (the WRITE's memory stays
                // valid until the batch's `done`, which runs after this
                // part).
                unsafe {
                    piece.read_with(|src| {
                        Ok(up.store.upload_part(
                            &up.key,
                            &up.id,
                            (n + 1) as u16,
                            src,
                            up.batch.deadline,
                        )?)
                    })
                }
            });
            up.part_done(n, r);
        }));
    }
}

impl Client {
    /// The store's workers, started on first use.
    pub(crate) fn pool(&self) -> Result<&Pool, Error> {
        if let Some(p) = self.pool.get() {
            return Ok(p);
        }
        let p = Pool::start(self.config.parallel)?;
        // A racing start: the loser's workers end with its queue.
        Ok(self.pool.get_or_init(|| p))
    }
}
