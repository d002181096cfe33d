//! The `io_uring` engine: one ring and one thread per agent. Submitters
//! hand batches to the thread over a channel and ring its eventfd (a read
//! of which the ring always has armed); the thread puts every op of every
//! batch in flight (as far as the submission queue holds them), reaps
//! completions, continues short transfers, then syncs the files written
//! when the batch asks, and finishes each batch once all of its ops have.
//!
//! Host regions used with storage are registered with the ring as fixed
//! buffers on first use (pinned once, instead of on every op): a sparse
//! table of [`BUFFERS`] slots, each region's slot given back when it is
//! deregistered. Regions over 1 GiB, or past the table, go as plain reads
//! and writes.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crossbeam_channel::{Receiver, Sender};
use io_uring::{IoUring, opcode, squeue, types};

use super::io::{Batch, Done, IoEngine, Op, Stop, op_error, short_error};
use crate::error::Error;

/// Submission queue entries (the completion queue has twice as many).
const ENTRIES: u32 = 256;
/// Registered-buffer slots.
const BUFFERS: u16 = 256;
/// The largest buffer the kernel registers.
const BUFFER_MAX: u64 = 1 << 30;
/// The user data of the eventfd read.
const WAKE: u64 = u64::MAX;
/// Marks a sync's user data (else an op's).
const SYNC_BIT: u64 = 1 << 31;

/// The engine's handle: the channel to its thread and the thread's eventfd.
pub(crate) struct Uring {
    tx: Sender<Cmd>,
    wake: OwnedFd,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Free registered-buffer slots (empty when the kernel has no sparse
    /// buffer table).
    slots: std::sync::Mutex<Vec<u16>>,
}

/// What the ring's thread is asked to do.
enum Cmd {
    Batch(Batch),
    /// Register `[addr, addr + len)` in `slot`.
    Register {
        slot: u16,
        addr: u64,
        len: u64,
        reply: Sender<std::io::Result<()>>,
    },
    /// Empty `slot`.
    Forget {
        slot: u16,
        reply: Sender<()>,
    },
}

impl Uring {
    /// Sets up the ring (failing where the kernel has no io_uring or
    /// forbids it) and starts its thread.
    pub(crate) fn start() -> Result<Self, Error> {
        let ring = IoUring::new(ENTRIES).map_err(|e| Error::BackendUnavailable {
            backend: "storage",
            reason: format!("io_uring_setup: {e}"),
        })?;
        // SAFETY: eventfd returns a new descriptor or -1.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(Error::Io(std::sync::Arc::new(
                std::io::Error::last_os_error(),
            )));
        }
        // SAFETY: `efd` is a new descriptor that nothing else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        let thread_wake = wake.try_clone()?;
        let slots = match ring.submitter().register_buffers_sparse(u32::from(BUFFERS)) {
            Ok(()) => (0..BUFFERS).rev().collect(),
            Err(e) => {
                tracing::info!(error = %e, "io_uring has no sparse buffer table; storage ops pin their buffers each time");
                Vec::new()
            }
        };
        let (tx, rx) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("kvxfer-uring".into())
            .spawn(move || Ring::new(ring, thread_wake, rx).run())?;
        Ok(Uring {
            tx,
            wake,
            thread: Some(thread),
            slots: std::sync::Mutex::new(slots),
        })
    }

    fn ring_bell(&self) {
        ring_bell(self.wake.as_raw_fd());
    }
}

impl IoEngine for Uring {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    unsafe fn submit(&self, batch: Batch) {
        match self.tx.send(Cmd::Batch(batch)) {
            Ok(()) => self.ring_bell(),
            Err(e) => {
                if let Cmd::Batch(b) = e.0 {
                    (b.done)(Err(Error::Closed));
                }
            }
        }
    }

    unsafe fn register_buffer(&self, addr: u64, len: u64) -> Option<u16> {
        if len > BUFFER_MAX {
            return None;
        }
        let slot = self.slots.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        let (reply, answer) = crossbeam_channel::bounded(1);
        let cmd = Cmd::Register {
            slot,
            addr,
            len,
            reply,
        };
        if self.tx.send(cmd).is_ok() {
            self.ring_bell();
            if let Ok(Ok(())) = answer.recv() {
                return Some(slot);
            }
        }
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slot);
        tracing::debug!(
            addr,
            len,
            "registering a storage buffer failed; plain reads and writes for it"
        );
        None
    }

    fn forget_buffer(&self, slot: u16) {
        let (reply, answer) = crossbeam_channel::bounded(1);
        if self.tx.send(Cmd::Forget { slot, reply }).is_ok() {
            self.ring_bell();
            let _ = answer.recv();
        }
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slot);
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        // The thread sees the channel closed once it is woken, finishes the
        // batches in flight and exits.
        let (tx, _) = crossbeam_channel::bounded(0);
        drop(std::mem::replace(&mut self.tx, tx));
        self.ring_bell();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A batch in flight.
struct InFlight {
    ops: Vec<Op>,
    sync: Vec<(u32, RawFd)>,
    done: Option<Done>,
    stop: Option<Stop>,
    /// Ops (or syncs) submitted or queued and not yet completed.
    remaining: usize,
    error: Option<Error>,
    syncing: bool,
}

/// Work waiting for room in the submission queue.
#[derive(Clone, Copy)]
enum Item {
    /// The op at `index` in its batch (what is left of it).
    Op { slot: u32, index: u32 },
    /// The sync of the batch's file at `index`.
    Sync { slot: u32, index: u32 },
}

/// The thread's side: the ring, the batches in flight, the backlog.
struct Ring {
    /// Declared before `ring`'s buffer users: dropped after the ring.
    wake_buf: Box<u64>,
    wake: OwnedFd,
    ring: IoUring,
    rx: Receiver<Cmd>,
    batches: Vec<Option<InFlight>>,
    free: Vec<u32>,
    backlog: VecDeque<Item>,
    /// Whether the eventfd read is in flight.
    armed: bool,
}

impl Ring {
    fn new(ring: IoUring, wake: OwnedFd, rx: Receiver<Cmd>) -> Self {
        Ring {
            wake_buf: Box::new(0),
            wake,
            ring,
            rx,
            batches: Vec::new(),
            free: Vec::new(),
            backlog: VecDeque::new(),
            armed: false,
        }
    }

    fn run(mut self) {
        let mut open = true;
        loop {
            // New batches (and whether the engine is being dropped).
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Batch(b)) => self.admit(b),
                    Ok(Cmd::Register {
                        slot,
                        addr,
                        len,
                        reply,
                    }) => {
                        let iov = libc::iovec {
                            iov_base: addr as *mut libc::c_void,
                            iov_len: len as usize,
                        };
                        // SAFETY: the caller keeps the range allocated until
                        // it forgets the slot (or the ring goes).
                        let r = unsafe {
                            self.ring.submitter().register_buffers_update(
                                u32::from(slot),
                                &[iov],
                                None,
                            )
                        };
                        let _ = reply.send(r);
                    }
                    Ok(Cmd::Forget { slot, reply }) => {
                        let empty = libc::iovec {
                            iov_base: std::ptr::null_mut(),
                            iov_len: 0,
                        };
                        // SAFETY: an empty entry refers to no memory.
                        let r = unsafe {
                            self.ring.submitter().register_buffers_update(
                                u32::from(slot),
                                &[empty],
                                None,
                            )
                        };
                        if let Err(e) = r {
                            tracing::warn!(slot, error = %e, "emptying a registered storage buffer failed");
                        }
                        let _ = reply.send(());
                    }
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            if open && !self.armed {
                self.arm();
            }
            self.fill();
            let busy = self.batches.iter().any(Option::is_some);
            if !open && !busy && !self.armed {
                return;
            }
            if !open && self.armed {
                // Complete the armed read, so that nothing is in flight
                // when the ring goes.
                ring_bell(self.wake.as_raw_fd());
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) {
                    continue;
                }
                tracing::error!(error = %e, "io_uring_enter failed; failing the storage batches in flight");
                self.fail_all(e);
                return;
            }
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (user, res) in done {
                if user == WAKE {
                    self.armed = false;
                } else {
                    self.complete(user, res);
                }
            }
        }
    }

    /// Arms the eventfd read.
    fn arm(&mut self) {
        let e = opcode::Read::new(
            types::Fd(self.wake.as_raw_fd()),
            (&mut *self.wake_buf) as *mut u64 as *mut u8,
            8,
        )
        .build()
        .user_data(WAKE);
        // SAFETY: the buffer is owned by `self` and outlives the ring's use
        // of it (the read completes before the thread returns).
        if unsafe { self.ring.submission().push(&e) }.is_ok() {
            self.armed = true;
        }
    }

    fn admit(&mut self, b: Batch) {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.batches.push(None);
            (self.batches.len() - 1) as u32
        });
        let n = b.ops.len();
        for index in 0..n as u32 {
            self.backlog.push_back(Item::Op { slot, index });
        }
        self.batches[slot as usize] = Some(InFlight {
            ops: b.ops,
            sync: b.sync,
            done: Some(b.done),
            stop: b.stop,
            remaining: n,
            error: None,
            syncing: false,
        });
        if n == 0 {
            self.step(slot);
        }
    }

    /// Moves backlog into the submission queue while it has room; ops of
    /// a batch asked to stop are skipped instead.
    fn fill(&mut self) {
        while let Some(item) = self.backlog.front().copied() {
            let entry = match item {
                Item::Op { slot, index } => {
                    let b = self.batches[slot as usize].as_mut().expect("live batch");
                    if Batch::stopped(&b.stop) {
                        self.backlog.pop_front();
                        b.error.get_or_insert(Error::Aborted);
                        b.remaining -= 1;
                        if b.remaining == 0 {
                            self.step(slot);
                        }
                        continue;
                    }
                    op_entry(&b.ops[index as usize]).user_data(user_data(slot, u64::from(index)))
                }
                Item::Sync { slot, index } => {
                    let b = self.batches[slot as usize].as_ref().expect("live batch");
                    let fd = b.sync[index as usize].1;
                    opcode::Fsync::new(types::Fd(fd))
                        .flags(types::FsyncFlags::DATASYNC)
                        .build()
                        .user_data(user_data(slot, u64::from(index) | SYNC_BIT))
                }
            };
            // SAFETY: the entry's buffer and fd stay valid until its batch's
            // `done` has run (the submitter's contract), which waits for
            // this completion.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                break;
            }
            self.backlog.pop_front();
        }
    }

    fn complete(&mut self, user: u64, res: i32) {
        let slot = (user >> 32) as u32;
        let low = user & 0xffff_ffff;
        let Some(b) = self.batches.get_mut(slot as usize).and_then(Option::as_mut) else {
            return;
        };
        if low & SYNC_BIT != 0 {
            let index = (low & !SYNC_BIT) as usize;
            if res < 0 && b.error.is_none() {
                b.error = Some(Error::Storage {
                    handle: u64::from(b.sync[index].0),
                    op: "fdatasync",
                    source: std::sync::Arc::new(std::io::Error::from_raw_os_error(-res)),
                });
            }
        } else {
            // What was in flight: the op, or what was left of it after a
            // short transfer.
            let index = low as u32;
            let op = b.ops[low as usize];
            if res == -libc::EINTR || res == -libc::EAGAIN {
                self.backlog.push_back(Item::Op { slot, index });
                return;
            }
            if res < 0 {
                if b.error.is_none() {
                    b.error = Some(op_error(&op, std::io::Error::from_raw_os_error(-res)));
                }
            } else if (res as u32) < op.len {
                if res == 0 {
                    if b.error.is_none() {
                        b.error = Some(short_error(&op));
                    }
                } else {
                    b.ops[low as usize] = op.rest(res as u32);
                    self.backlog.push_back(Item::Op { slot, index });
                    return;
                }
            }
        }
        b.remaining -= 1;
        if b.remaining == 0 {
            self.step(slot);
        }
    }

    /// A batch whose ops (or syncs) have all finished: syncs next, or done.
    fn step(&mut self, slot: u32) {
        let b = self.batches[slot as usize].as_mut().expect("live batch");
        if !b.syncing && b.error.is_none() && !b.sync.is_empty() {
            b.syncing = true;
            b.remaining = b.sync.len();
            for index in 0..b.sync.len() as u32 {
                self.backlog.push_back(Item::Sync { slot, index });
            }
            return;
        }
        let mut b = self.batches[slot as usize].take().expect("live batch");
        self.free.push(slot);
        let r = b.error.take().map_or(Ok(()), Err);
        if let Some(done) = b.done.take() {
            done(r);
        }
    }

    /// The ring failed: every batch fails (nothing more will complete on a
    /// ring this thread no longer drives; the kernel cancels the rest when
    /// the ring goes).
    fn fail_all(&mut self, e: std::io::Error) {
        let e = std::sync::Arc::new(e);
        for b in self.batches.iter_mut().filter_map(Option::take) {
            if let Some(done) = b.done {
                done(Err(Error::Io(e.clone())));
            }
        }
    }
}

/// Adds one to the eventfd `fd` (its armed read completes).
fn ring_bell(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live local to an eventfd.
    unsafe { libc::write(fd, &one as *const u64 as *const libc::c_void, 8) };
}

fn user_data(slot: u32, low: u64) -> u64 {
    (u64::from(slot) << 32) | low
}

fn op_entry(op: &Op) -> squeue::Entry {
    if let Some(slot) = op.fixed {
        return if op.write {
            opcode::WriteFixed::new(types::Fd(op.fd), op.buf as *const u8, op.len, slot)
                .offset(op.offset)
                .build()
        } else {
            opcode::ReadFixed::new(types::Fd(op.fd), op.buf as *mut u8, op.len, slot)
                .offset(op.offset)
                .build()
        };
    }
    if op.write {
        opcode::Write::new(types::Fd(op.fd), op.buf as *const u8, op.len)
            .offset(op.offset)
            .build()
    } else {
        opcode::Read::new(types::Fd(op.fd), op.buf as *mut u8, op.len)
            .offset(op.offset)
            .build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// Runs `ops` as one batch; its outcome.
    fn run(u: &Uring, ops: Vec<Op>) -> Result<(), Error> {
        super::super::io::run_batch(u, ops, None)
    }

    fn op(fd: RawFd, write: bool, buf: &[u8], offset: u64, fixed: Option<u16>) -> Op {
        Op {
            fd,
            handle: 1,
            write,
            buf: buf.as_ptr() as u64,
            len: buf.len() as u32,
            offset,
            fixed,
        }
    }

    #[test]
    fn fixed_buffers_move_data_and_their_slots_come_back() {
        let u = match Uring::start() {
            Ok(u) => u,
            Err(e) => {
                println!("SKIPPED fixed_buffers_move_data_and_their_slots_come_back: {e}");
                return;
            }
        };
        if u.slots.lock().unwrap().is_empty() {
            println!(
                "SKIPPED fixed_buffers_move_data_and_their_slots_come_back: no sparse buffer table"
            );
            return;
        }
        let (path, f) = super::super::io::temp_file("uring", 8192);
        let fd = f.as_raw_fd();
        let src: Vec<u8> = (0..8192u32).map(|i| (i * 31 + 7) as u8).collect();
        // SAFETY: `src` outlives the registration (forgotten below).
        let slot =
            unsafe { u.register_buffer(src.as_ptr() as u64, src.len() as u64) }.expect("a slot");
        // A piece inside the registered buffer, by its slot.
        run(&u, vec![op(fd, true, &src[4096..], 0, Some(slot))]).unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(&on_disk[..4096], &src[4096..]);
        // Memory outside the registered buffer under its slot: the kernel
        // refuses (so the op above did go by the slot).
        let other = vec![0u8; 4096];
        let e = run(&u, vec![op(fd, false, &other, 0, Some(slot))]).unwrap_err();
        assert!(
            matches!(&e, Error::Storage { source, .. } if source.raw_os_error() == Some(libc::EFAULT)),
            "{e}"
        );
        u.forget_buffer(slot);
        // Slots are given back: many more registrations than slots.
        for _ in 0..2 * BUFFERS as usize {
            // SAFETY: as above; forgotten at once.
            let s = unsafe { u.register_buffer(src.as_ptr() as u64, src.len() as u64) }
                .expect("a slot after the others were forgotten");
            u.forget_buffer(s);
        }
        drop(f);
        std::fs::remove_file(&path).unwrap();
    }
}
