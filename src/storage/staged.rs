//! GPU memory to and from storage: each piece moved through the worker
//! thread's pinned staging ring (`crate::gpu`), the device→host copy of the
//! next chunk running while a chunk is written (and the host→device copy
//! of a chunk while the next is read), with `pwrite`/`pread` on the ring's
//! buffers. Its pinned buffers are page-aligned and its chunk a multiple of
//! the file's block size (checked when the request is planned), so files
//! opened for direct I/O and block devices take them as they are.
//!
//! One worker thread per agent, started with the first such request; it
//! takes batches in order and each piece in order (writing, the copies of
//! a run of pieces on one GPU go ahead across pieces). Its copies are counted
//! with every other staging copy ([`crate::gpu::staging_copies`]).

use std::os::fd::RawFd;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use super::io::{Batch, Done, Stop, pio_all};
use crate::error::Error;
use crate::gpu::{StageError, StagingShape};

/// A range of device memory and a file range of the same length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    /// The GPU holding `gpu`.
    pub(crate) device: u32,
    /// Device memory address.
    pub(crate) gpu: u64,
    /// The open file or device.
    pub(crate) fd: RawFd,
    /// Its storage handle (for errors).
    pub(crate) handle: u32,
    /// File offset.
    pub(crate) offset: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// A request's staged I/O: its pieces in order, then a data sync of each
/// of `sync` once they all succeeded; `done` runs once, after the last
/// copy of the last piece has completed, with the first failure. Once
/// `stop` says so, the pieces not yet begun are skipped and the batch
/// fails with [`Error::Aborted`].
pub(crate) struct StagedBatch {
    pub(crate) pieces: Vec<Piece>,
    /// Device memory into the file (else the file into device memory).
    pub(crate) write: bool,
    /// Files to `fdatasync` after the pieces (handle, fd).
    pub(crate) sync: Vec<(u32, RawFd)>,
    pub(crate) shape: StagingShape,
    pub(crate) done: Done,
    pub(crate) stop: Option<Stop>,
}

/// The worker thread and its queue.
///
/// Drop order: the queue closes first, then the thread is joined once it
/// has finished the batches queued (whose requests hold their memory and
/// files until their `done` runs).
pub(crate) struct Stager {
    tx: Option<Sender<StagedBatch>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Stager {
    /// Starts the worker.
    pub(crate) fn start() -> Result<Self, Error> {
        let (tx, rx): (Sender<StagedBatch>, Receiver<StagedBatch>) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("kvxfer-gpu-storage".into())
            .spawn(move || {
                while let Ok(b) = rx.recv() {
                    // SAFETY: the submitter's contract covers the batch
                    // until its `done` runs, which is after.
                    let r = unsafe { run(&b) };
                    (b.done)(r);
                }
            })?;
        Ok(Stager {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues `batch`; never blocks on its I/O.
    ///
    /// # Safety
    /// Every piece's device range must stay allocated (and for reads not
    /// otherwise accessed) and every fd open until the batch's `done` has
    /// run.
    pub(crate) unsafe fn submit(&self, batch: StagedBatch) {
        let Some(tx) = &self.tx else {
            (batch.done)(Err(Error::Closed));
            return;
        };
        if let Err(e) = tx.send(batch) {
            (e.0.done)(Err(Error::Closed));
        }
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The failure of a staged read or write of storage `handle`.
fn io_error(handle: u32, write: bool, e: std::io::Error) -> Error {
    Error::Storage {
        handle: u64::from(handle),
        op: if write { "write" } else { "read" },
        source: Arc::new(e),
    }
}

/// Runs `b`'s pieces, then its syncs.
///
/// # Safety
/// As [`Stager::submit`].
unsafe fn run(b: &StagedBatch) -> Result<(), Error> {
    if b.write {
        // SAFETY: forwarded contract.
        unsafe { write_pieces(b) }?;
    } else {
        // SAFETY: forwarded contract.
        unsafe { read_pieces(b) }?;
    }
    super::io::sync_files(&b.sync)
}

/// `b`'s pieces written, each run of pieces on one GPU through one
/// pipeline (the copies of the next chunks, of this piece or later ones,
/// run while a chunk is written); stops before a piece once `b.stop` says
/// so.
///
/// # Safety
/// As [`Stager::submit`].
unsafe fn write_pieces(b: &StagedBatch) -> Result<(), Error> {
    let mut i = 0;
    while i < b.pieces.len() {
        let device = b.pieces[i].device;
        let run = &b.pieces[i..];
        let run = &run[..run.iter().take_while(|p| p.device == device).count()];
        let ranges: Vec<(u64, u64)> = run.iter().map(|p| (p.gpu, p.len)).collect();
        // Where the next chunk goes: (piece, file offset).
        let mut at = (usize::MAX, 0u64);
        let mut write = |k: usize, bytes: &[u8]| {
            if at.0 != k {
                at = (k, run[k].offset);
            }
            // SAFETY: `bytes` is a live slice; the fd is open (the
            // submitter's contract).
            unsafe { pio_all(run[k].fd, true, bytes.as_ptr() as u64, bytes.len(), at.1) }?;
            at.1 += bytes.len() as u64;
            Ok(())
        };
        let stop = || Batch::stopped(&b.stop);
        // SAFETY: the device ranges are allocated for the call (the
        // submitter's contract) and never empty (descriptors are not).
        let staged =
            unsafe { crate::gpu::send_staged_pieces(device, b.shape, &ranges, &stop, &mut write) };
        match staged {
            Ok(n) if n < run.len() => return Err(Error::Aborted),
            Ok(_) => {}
            // The piece being written when it failed.
            Err(StageError::Io(e)) => return Err(io_error(run[at.0].handle, true, e)),
            Err(StageError::Gpu(e)) => return Err(Error::Gpu(e)),
        }
        i += run.len();
    }
    Ok(())
}

/// `b`'s pieces read, one after the other, each chunk's host→device copy
/// running while the next chunk is read, of this piece or the next ones
/// (the copies are waited for at the end); stops before a piece once
/// `b.stop` says so (the pieces begun are copied whole).
///
/// # Safety
/// As [`Stager::submit`].
unsafe fn read_pieces(b: &StagedBatch) -> Result<(), Error> {
    // Dropped on every return: waits for the copies still running.
    let mut landings = crate::gpu::Landings::new();
    for p in &b.pieces {
        if Batch::stopped(&b.stop) {
            return Err(Error::Aborted);
        }
        let mut at = p.offset;
        let mut read = |buf: &mut [u8]| {
            // SAFETY: `buf` is a live, writable slice; the fd is open.
            unsafe { pio_all(p.fd, false, buf.as_mut_ptr() as u64, buf.len(), at) }?;
            at += buf.len() as u64;
            Ok(())
        };
        // SAFETY: the device range is allocated for the call, which waits
        // for its copies before it returns (`landings`), and nothing else
        // accesses it (the submitter's contract).
        let staged = unsafe { landings.land(p.device, b.shape, p.gpu, p.len, &mut read, ()) };
        match staged {
            Ok(()) => {}
            Err((StageError::Io(e), ())) => return Err(io_error(p.handle, false, e)),
            Err((StageError::Gpu(e), ())) => return Err(Error::Gpu(e)),
        }
    }
    while let Some(((), landed)) = landings.next(true) {
        landed.map_err(Error::Gpu)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_short_file_is_a_typed_io_error() {
        let (path, f) = super::super::io::temp_file("staged-short", 8);
        let fd = f.as_raw_fd();
        let mut buf = [0u8; 16];
        // SAFETY: `buf` is live and writable; `f` is open.
        let e = unsafe { pio_all(fd, false, buf.as_mut_ptr() as u64, 16, 0) }.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
        let seven = [7u8; 16];
        // SAFETY: as above.
        unsafe { pio_all(fd, true, seven.as_ptr() as u64, 16, 4) }.unwrap();
        // SAFETY: as above.
        unsafe { pio_all(fd, false, buf.as_mut_ptr() as u64, 16, 4) }.unwrap();
        assert_eq!(buf, seven);
        let err = io_error(3, true, e);
        assert!(
            matches!(
                err,
                Error::Storage {
                    handle: 3,
                    op: "write",
                    ..
                }
            ),
            "{err}"
        );
        drop(f);
        std::fs::remove_file(path).unwrap();
    }
}
