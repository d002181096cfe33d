//! The I/O engines behind storage transfers: a batch of reads or writes
//! between host memory and open files, then (on request) a data sync of
//! each file written, completed once with the first failure.

use std::os::fd::RawFd;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use super::StorageIo;
use crate::error::Error;

/// Largest piece one read or write moves (io_uring takes a 32-bit length;
/// the kernel moves at most about 2 GiB a call anyway).
pub(crate) const OP_MAX: u64 = 1 << 30;

/// One read or write.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Op {
    /// The open file or device.
    pub(crate) fd: RawFd,
    /// Its storage handle (for errors).
    pub(crate) handle: u32,
    /// Write memory to the file (else read the file into memory).
    pub(crate) write: bool,
    /// Host memory address.
    pub(crate) buf: u64,
    /// Bytes (at most [`OP_MAX`]).
    pub(crate) len: u32,
    /// File offset.
    pub(crate) offset: u64,
    /// The registered buffer holding `buf` (`io_uring` fixed buffers), if
    /// any.
    pub(crate) fixed: Option<u16>,
}

impl Op {
    /// The part of it left after `done` bytes moved.
    pub(crate) fn rest(mut self, done: u32) -> Op {
        self.buf += u64::from(done);
        self.offset += u64::from(done);
        self.len -= done;
        self
    }

    pub(crate) fn name(&self) -> &'static str {
        if self.write { "write" } else { "read" }
    }
}

/// What a finished batch reports.
pub(crate) type Done = Box<dyn FnOnce(Result<(), Error>) + Send>;

/// Whether the batch's caller asked for it to stop (an abort).
pub(crate) type Stop = Box<dyn Fn() -> bool + Send>;

/// A request's I/O: its reads or writes (any order, all in flight at once),
/// then a data sync of each of `sync` once they all succeeded; `done` runs
/// once, after every one of them has finished (so nothing touches the
/// request's memory after it), with the first failure.
///
/// Once `stop` says so, ops not yet handed to the kernel are skipped and
/// the batch fails with [`Error::Aborted`] (if any was skipped: a batch
/// whose ops were all under way by then finishes as usual).
pub(crate) struct Batch {
    pub(crate) ops: Vec<Op>,
    /// Files to `fdatasync` after the ops (handle, fd).
    pub(crate) sync: Vec<(u32, RawFd)>,
    pub(crate) done: Done,
    pub(crate) stop: Option<Stop>,
}

impl Batch {
    /// Whether its caller asked it to stop.
    pub(crate) fn stopped(stop: &Option<Stop>) -> bool {
        stop.as_ref().is_some_and(|s| s())
    }

    /// The batch as at most `parts` batches of consecutive ops, about as
    /// many bytes each and none under `min_part` bytes, to run at once
    /// (see [`Batch::into_parts`]). A batch with files to sync stays whole.
    pub(crate) fn split(self, parts: usize, min_part: u64) -> Vec<Batch> {
        let parts = self.parts_for(parts, min_part);
        if parts < 2 || !self.sync.is_empty() {
            return vec![self];
        }
        let total: u64 = self.ops.iter().map(|o| u64::from(o.len)).sum();
        let mut groups = Vec::with_capacity(parts);
        let mut ops = self.ops.iter().copied().peekable();
        let mut moved = 0u64;
        for k in 1..=parts {
            // Ops until this part's share of the bytes (the last: the rest).
            let upto = total * k as u64 / parts as u64;
            let mut part = Vec::new();
            while let Some(op) = ops.next_if(|_| k == parts || moved < upto) {
                moved += u64::from(op.len);
                part.push(op);
            }
            groups.push((part, Vec::new()));
        }
        self.into_parts(groups)
    }

    /// The batch as at most `parts` batches each of the ops of whole files
    /// (in their order) and those files' syncs, about as many bytes each
    /// and none under `min_part` bytes, to run at once (see
    /// [`Batch::into_parts`]): writes through the page cache to different
    /// files go on together, where those to one file take turns (the file
    /// system holds the file's lock for each).
    pub(crate) fn split_by_file(self, parts: usize, min_part: u64) -> Vec<Batch> {
        let mut files: Vec<(RawFd, u64)> = Vec::new();
        for op in &self.ops {
            match files.iter_mut().find(|f| f.0 == op.fd) {
                Some(f) => f.1 += u64::from(op.len),
                None => files.push((op.fd, u64::from(op.len))),
            }
        }
        let parts = self.parts_for(parts, min_part).min(files.len());
        if parts < 2 {
            return vec![self];
        }
        // The largest files first, each to the part with the fewest bytes.
        files.sort_by_key(|f| std::cmp::Reverse(f.1));
        let mut load = vec![0u64; parts];
        let mut part_of = Vec::with_capacity(files.len());
        for (fd, bytes) in files {
            let k = (0..parts).min_by_key(|&k| load[k]).expect("parts >= 2");
            load[k] += bytes;
            part_of.push((fd, k));
        }
        let part = |fd: RawFd| part_of.iter().find(|p| p.0 == fd).map_or(0, |p| p.1);
        let mut groups: Vec<Group> = vec![(Vec::new(), Vec::new()); parts];
        for &op in &self.ops {
            groups[part(op.fd)].0.push(op);
        }
        for &s in &self.sync {
            groups[part(s.1)].1.push(s);
        }
        self.into_parts(groups)
    }

    /// How many parts of at least `min_part` bytes, and at most `parts`
    /// and one op each, the batch makes.
    fn parts_for(&self, parts: usize, min_part: u64) -> usize {
        let total: u64 = self.ops.iter().map(|o| u64::from(o.len)).sum();
        parts
            .min(usize::try_from(total / min_part.max(1)).unwrap_or(usize::MAX))
            .min(self.ops.len())
    }

    /// A batch for each group of ops and syncs with an op: the original
    /// `done` runs once, after the last part has finished, with the first
    /// failure; a failed part makes the others stop before their next op
    /// (they fail [`Error::Aborted`], which the first failure outranks);
    /// the original `stop` reaches every part.
    fn into_parts(self, groups: Vec<Group>) -> Vec<Batch> {
        let groups: Vec<_> = groups.into_iter().filter(|g| !g.0.is_empty()).collect();
        let joint = Arc::new(Joint {
            state: std::sync::Mutex::new((groups.len(), None, Some(self.done))),
            failed: std::sync::atomic::AtomicBool::new(false),
            stop: std::sync::Mutex::new(self.stop),
        });
        groups
            .into_iter()
            .map(|(ops, sync)| {
                let (j, s) = (Arc::clone(&joint), Arc::clone(&joint));
                Batch {
                    ops,
                    sync,
                    done: Box::new(move |r| j.part_done(r)),
                    stop: Some(Box::new(move || s.stopped())),
                }
            })
            .collect()
    }
}

/// A part's ops and the files it syncs after them.
type Group = (Vec<Op>, Vec<(u32, RawFd)>);

/// What the parts of a split batch share.
struct Joint {
    /// Parts not yet done, the first failure, the batch's `done`.
    state: std::sync::Mutex<(usize, Option<Error>, Option<Done>)>,
    /// A part failed: the others stop.
    failed: std::sync::atomic::AtomicBool,
    /// The batch's own (behind a lock: a `Stop` is not `Sync`).
    stop: std::sync::Mutex<Option<Stop>>,
}

impl Joint {
    fn stopped(&self) -> bool {
        self.failed.load(std::sync::atomic::Ordering::Relaxed)
            || Batch::stopped(&self.stop.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn part_done(&self, r: Result<(), Error>) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = r {
            self.failed
                .store(true, std::sync::atomic::Ordering::Relaxed);
            st.1.get_or_insert(e);
        }
        st.0 -= 1;
        if st.0 == 0 {
            let r = st.1.take().map_or(Ok(()), Err);
            let done = st.2.take().expect("the last part runs done once");
            drop(st);
            done(r);
        }
    }
}

/// Moves batches. Implementations: [`super::uring::Uring`] and [`Psync`].
pub(crate) trait IoEngine: Send + Sync {
    /// `"io_uring"` or `"pread/pwrite"`.
    fn name(&self) -> &'static str;

    /// Starts `batch`; never blocks on the I/O.
    ///
    /// # Safety
    /// Every op's memory range must stay valid (allocated, and for reads
    /// not otherwise accessed) and every fd open until the batch's `done`
    /// has run.
    unsafe fn submit(&self, batch: Batch);

    /// Registers `[addr, addr + len)` with the engine (pinned once, not on
    /// every op); its slot, or `None` where the engine has no such thing or
    /// it failed (ops on it then go as plain reads and writes).
    ///
    /// # Safety
    /// The range must stay allocated until [`forget_buffer`](Self::forget_buffer)
    /// of the slot, or the engine's drop.
    unsafe fn register_buffer(&self, _addr: u64, _len: u64) -> Option<u16> {
        None
    }

    /// Unregisters the buffer in `slot`; no op may use it any more.
    fn forget_buffer(&self, _slot: u16) {}
}

/// The failure of `op` with `e`.
pub(crate) fn op_error(op: &Op, e: std::io::Error) -> Error {
    Error::Storage {
        handle: u64::from(op.handle),
        op: op.name(),
        source: Arc::new(e),
    }
}

/// A read or write that moved nothing: past the end of the file (which
/// shrank under a registered region) or out of space.
pub(crate) fn short_error(op: &Op) -> Error {
    op_error(
        op,
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "{} of {} bytes at offset {} stopped short: the file ends there",
                op.name(),
                op.len,
                op.offset
            ),
        ),
    )
}

/// Starts the engine `choice` asks for.
pub(crate) fn start(choice: StorageIo) -> Result<Arc<dyn IoEngine>, Error> {
    match choice {
        StorageIo::Psync => Ok(Arc::new(Psync::start(PSYNC_THREADS)?)),
        StorageIo::IoUring => Ok(Arc::new(super::uring::Uring::start()?)),
        StorageIo::Auto => match super::uring::Uring::start() {
            Ok(u) => Ok(Arc::new(u)),
            Err(e) => {
                tracing::info!(error = %e, "io_uring unavailable; storage I/O falls back to pread/pwrite");
                Ok(Arc::new(Psync::start(PSYNC_THREADS)?))
            }
        },
    }
}

/// Worker threads of the `pread`/`pwrite` engine: batches in flight at once.
pub(crate) const PSYNC_THREADS: usize = 4;

/// `pread`/`pwrite` on worker threads, a batch per thread at a time.
pub(crate) struct Psync {
    tx: Option<Sender<Batch>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Psync {
    fn start(n: usize) -> Result<Self, Error> {
        let (tx, rx): (Sender<Batch>, Receiver<Batch>) = crossbeam_channel::unbounded();
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let rx = rx.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvxfer-psync-{i}"))
                    .spawn(move || {
                        while let Ok(b) = rx.recv() {
                            // SAFETY: the submitter's contract covers the
                            // batch until its `done` runs, which is after.
                            let r = unsafe { run_sync(&b.ops, &b.sync, &b.stop) };
                            (b.done)(r);
                        }
                    })?,
            );
        }
        Ok(Psync {
            tx: Some(tx),
            threads,
        })
    }
}

impl IoEngine for Psync {
    fn name(&self) -> &'static str {
        "pread/pwrite"
    }

    unsafe fn submit(&self, batch: Batch) {
        let Some(tx) = &self.tx else {
            (batch.done)(Err(Error::Closed));
            return;
        };
        if let Err(e) = tx.send(batch) {
            (e.0.done)(Err(Error::Closed));
        }
    }
}

impl Drop for Psync {
    fn drop(&mut self) {
        // Closing the channel ends the workers once the queued batches are
        // done.
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A batch with `pread`/`pwrite` (short transfers continued), then
/// `fdatasync`; stops at the first failure, or before an op once `stop`
/// says so.
///
/// # Safety
/// As [`IoEngine::submit`].
unsafe fn run_sync(ops: &[Op], sync: &[(u32, RawFd)], stop: &Option<Stop>) -> Result<(), Error> {
    for op in ops {
        if Batch::stopped(stop) {
            return Err(Error::Aborted);
        }
        // SAFETY: the caller keeps the range valid and the fd open.
        let moved = unsafe { pio_all(op.fd, op.write, op.buf, op.len as usize, op.offset) };
        moved.map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => short_error(op),
            _ => op_error(op, e),
        })?;
    }
    sync_files(sync)
}

/// Moves `[buf, buf + len)` into the file at `offset` (`write`) or the
/// file's bytes there into it, with `pwrite`/`pread`, short transfers
/// continued; one that moves nothing (the file ends there, or the disk
/// took nothing) is an `UnexpectedEof`.
///
/// # Safety
/// `[buf, buf + len)` is valid memory (writable for a read) and `fd` open
/// for the call.
pub(crate) unsafe fn pio_all(
    fd: RawFd,
    write: bool,
    mut buf: u64,
    mut len: usize,
    mut offset: u64,
) -> std::io::Result<()> {
    while len > 0 {
        // SAFETY: the caller's contract.
        let n = unsafe {
            if write {
                libc::pwrite(fd, buf as *const libc::c_void, len, offset as libc::off_t)
            } else {
                libc::pread(fd, buf as *mut libc::c_void, len, offset as libc::off_t)
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "{} of {len} bytes at offset {offset} stopped short: the file ends there",
                    if write { "write" } else { "read" }
                ),
            ));
        }
        buf += n as u64;
        len -= n as usize;
        offset += n as u64;
    }
    Ok(())
}

/// `fdatasync` of each file `(handle, fd)`, stopping at the first failure.
pub(crate) fn sync_files(sync: &[(u32, RawFd)]) -> Result<(), Error> {
    for &(handle, fd) in sync {
        // SAFETY: a plain syscall on an fd the caller keeps open; a closed
        // one is an error (EBADF), not undefined behaviour.
        if unsafe { libc::fdatasync(fd) } != 0 {
            return Err(Error::Storage {
                handle: u64::from(handle),
                op: "fdatasync",
                source: Arc::new(std::io::Error::last_os_error()),
            });
        }
    }
    Ok(())
}

/// A new file of `len` bytes in the temporary directory, open for reading
/// and writing.
#[cfg(test)]
pub(crate) fn temp_file(name: &str, len: u64) -> (std::path::PathBuf, std::fs::File) {
    let path = std::env::temp_dir().join(format!("kvxfer-{name}-{}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.set_len(len).unwrap();
    (path, f)
}

/// Runs `ops` as one batch on `engine` (stopping once `stop` says so);
/// its outcome, waited for up to 60 s.
#[cfg(test)]
pub(crate) fn run_batch(
    engine: &dyn IoEngine,
    ops: Vec<Op>,
    stop: Option<Stop>,
) -> Result<(), Error> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let batch = Batch {
        ops,
        sync: Vec::new(),
        done: Box::new(move |r| {
            let _ = tx.send(r);
        }),
        stop,
    };
    // SAFETY: the callers' buffers and files outlive the batch, which is
    // waited for here.
    unsafe { engine.submit(batch) };
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("batch finished")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn run(engine: &dyn IoEngine, ops: Vec<Op>, stop: Stop) -> Result<(), Error> {
        run_batch(engine, ops, Some(stop))
    }

    const PIECE: usize = 4096;

    /// A file of `n` zeroed pieces, and `n` pieces of ones to write to it.
    fn setup(name: &str, n: usize) -> (std::path::PathBuf, std::fs::File, Vec<u8>) {
        let (path, f) = temp_file(&format!("io-{name}"), (n * PIECE) as u64);
        (path, f, vec![1u8; n * PIECE])
    }

    fn writes(f: &std::fs::File, src: &[u8]) -> Vec<Op> {
        src.chunks(PIECE)
            .enumerate()
            .map(|(i, c)| Op {
                fd: f.as_raw_fd(),
                handle: 1,
                write: true,
                buf: c.as_ptr() as u64,
                len: c.len() as u32,
                offset: (i * PIECE) as u64,
                fixed: None,
            })
            .collect()
    }

    /// Pieces of the file that were written (ones), in order.
    fn written(path: &std::path::Path) -> Vec<bool> {
        std::fs::read(path)
            .unwrap()
            .chunks(PIECE)
            .map(|c| c.iter().all(|&b| b == 1))
            .collect()
    }

    #[test]
    fn a_stopped_psync_batch_skips_the_ops_after_the_stop() {
        let (path, f, src) = setup("psync", 8);
        let engine = Psync::start(1).unwrap();
        // Asked before each op: the fourth look says stop.
        let looks = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&looks);
        let stop: Stop = Box::new(move || seen.fetch_add(1, Ordering::SeqCst) >= 3);
        let r = run(&engine, writes(&f, &src), stop);
        assert!(matches!(r, Err(Error::Aborted)), "{r:?}");
        let w = written(&path);
        assert_eq!(w, [true, true, true, false, false, false, false, false]);
        // Never asked to stop: every op runs.
        let r = run(&engine, writes(&f, &src), Box::new(|| false));
        assert!(r.is_ok(), "{r:?}");
        assert!(written(&path).iter().all(|&w| w));
        drop(f);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_split_batch_reports_once_after_its_last_part_with_the_first_failure() {
        let (path, f, src) = setup("split", 10);
        let (tx, rx) = crossbeam_channel::unbounded();
        let batch = |stop: Option<Stop>| Batch {
            ops: writes(&f, &src),
            sync: Vec::new(),
            done: Box::new({
                let tx = tx.clone();
                move |r| tx.send(r).unwrap()
            }),
            stop,
        };
        // Parts of consecutive ops, about as many bytes each; never more
        // parts than `min_part` allows, nor than ops.
        let lens = |b: &[Batch]| b.iter().map(|p| p.ops.len()).collect::<Vec<_>>();
        assert_eq!(lens(&batch(None).split(3, 1)), [4, 3, 3]);
        assert_eq!(lens(&batch(None).split(4, 3 * PIECE as u64)), [4, 3, 3]);
        assert_eq!(lens(&batch(None).split(40, 1)).len(), 10);
        assert_eq!(lens(&batch(None).split(4, 10 * PIECE as u64)), [10]);
        let mut synced = batch(None);
        synced.sync.push((1, f.as_raw_fd()));
        assert_eq!(lens(&synced.split(4, 1)), [10]);
        let offsets: Vec<u64> = batch(None)
            .split(3, 1)
            .iter()
            .flat_map(|p| p.ops.iter().map(|o| o.offset))
            .collect();
        assert_eq!(
            offsets,
            (0..10).map(|i| (i * PIECE) as u64).collect::<Vec<_>>()
        );
        while rx.try_recv().is_ok() {}

        // Done once, after the last part, with the first failure; a failed
        // part stops the others; the batch's own stop reaches each part.
        let parts = batch(None).split(3, 1);
        let mut dones = Vec::new();
        let mut stops = Vec::new();
        for p in parts {
            dones.push(p.done);
            stops.push(p.stop);
        }
        assert!(stops.iter().all(|s| !Batch::stopped(s)));
        let mut dones = dones.into_iter();
        dones.next().unwrap()(Ok(()));
        dones.next().unwrap()(Err(Error::Closed));
        assert!(
            stops.iter().all(Batch::stopped),
            "a failed part stops the rest"
        );
        assert!(rx.try_recv().is_err(), "not before the last part");
        dones.next().unwrap()(Err(Error::Aborted));
        assert!(matches!(rx.try_recv(), Ok(Err(Error::Closed))));
        assert!(rx.try_recv().is_err(), "once");
        let asked = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let a = Arc::clone(&asked);
        let parts = batch(Some(Box::new(move || a.load(Ordering::SeqCst)))).split(2, 1);
        assert!(parts.iter().all(|p| !Batch::stopped(&p.stop)));
        asked.store(true, Ordering::SeqCst);
        assert!(parts.iter().all(|p| Batch::stopped(&p.stop)));

        // Run on the workers at once: every op, one outcome.
        let engine = Psync::start(3).unwrap();
        for p in batch(None).split(3, 1) {
            // SAFETY: `src` and the file outlive the batch, waited for below.
            unsafe { engine.submit(p) };
        }
        assert!(matches!(
            rx.recv_timeout(std::time::Duration::from_secs(60)),
            Ok(Ok(()))
        ));
        assert!(written(&path).iter().all(|&w| w));
        drop(f);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_batch_split_by_file_keeps_each_files_ops_and_syncs_in_one_part() {
        let files: Vec<_> = (0..3).map(|i| setup(&format!("byfile{i}"), 5)).collect();
        // Pieces of file 0 (5), 1 (3) and 2 (2), interleaved.
        let order = [0, 1, 0, 2, 0, 1, 0, 2, 1, 0];
        let mut next = [0usize; 3];
        let ops: Vec<Op> = order
            .iter()
            .map(|&f| {
                let (_, file, src) = &files[f];
                let i = next[f];
                next[f] += 1;
                writes(file, src)[i]
            })
            .collect();
        let fds: Vec<RawFd> = files.iter().map(|f| f.1.as_raw_fd()).collect();
        let (tx, rx) = crossbeam_channel::unbounded();
        let batch = Batch {
            ops: ops.clone(),
            sync: fds
                .iter()
                .enumerate()
                .map(|(i, &fd)| (i as u32, fd))
                .collect(),
            done: Box::new(move |r| tx.send(r).unwrap()),
            stop: None,
        };
        let parts = batch.split_by_file(2, 1);
        // The largest file alone; the two others together.
        let of = |p: &Batch| {
            let mut f: Vec<RawFd> = p.ops.iter().map(|o| o.fd).collect();
            f.dedup();
            f
        };
        assert_eq!(parts.len(), 2);
        assert_eq!(of(&parts[0]), [fds[0]]);
        assert_eq!(parts[0].sync, [(0, fds[0])]);
        assert_eq!(parts[1].sync, [(1, fds[1]), (2, fds[2])]);
        for p in &parts {
            // Each file's ops in their order.
            let mine: Vec<u64> = p.ops.iter().map(|o| o.buf).collect();
            let want: Vec<u64> = ops
                .iter()
                .filter(|o| p.ops.iter().any(|m| m.fd == o.fd))
                .map(|o| o.buf)
                .collect();
            assert_eq!(mine, want);
        }
        assert_eq!(parts.iter().map(|p| p.ops.len()).sum::<usize>(), 10);
        // Run at once: every file whole, synced, one outcome.
        let engine = Psync::start(2).unwrap();
        for p in parts {
            // SAFETY: the sources and files outlive the batch, waited for
            // below.
            unsafe { engine.submit(p) };
        }
        assert!(matches!(
            rx.recv_timeout(std::time::Duration::from_secs(60)),
            Ok(Ok(()))
        ));
        for ((path, file, _), n) in files.into_iter().zip([5, 3, 2]) {
            let w = written(&path);
            assert!(w[..n].iter().all(|&w| w) && !w[n..].iter().any(|&w| w));
            drop(file);
            std::fs::remove_file(&path).unwrap();
        }
        // One file, or too few bytes: whole.
        let (path, f, src) = setup("byfile-one", 4);
        let one = |min| {
            Batch {
                ops: writes(&f, &src),
                sync: Vec::new(),
                done: Box::new(|_| {}),
                stop: None,
            }
            .split_by_file(4, min)
            .len()
        };
        assert_eq!(one(1), 1);
        drop(f);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_stopped_uring_batch_hands_nothing_more_to_the_kernel() {
        let engine = match super::super::uring::Uring::start() {
            Ok(u) => u,
            Err(e) => {
                println!("SKIPPED a_stopped_uring_batch_hands_nothing_more_to_the_kernel: {e}");
                return;
            }
        };
        let (path, f, src) = setup("uring", 8);
        // Stopped before any op went in: none does, the batch is aborted.
        let r = run(&engine, writes(&f, &src), Box::new(|| true));
        assert!(matches!(r, Err(Error::Aborted)), "{r:?}");
        assert!(written(&path).iter().all(|&w| !w));
        let r = run(&engine, writes(&f, &src), Box::new(|| false));
        assert!(r.is_ok(), "{r:?}");
        assert!(written(&path).iter().all(|&w| w));
        drop(f);
        std::fs::remove_file(&path).unwrap();
    }
}
