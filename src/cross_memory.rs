//! Intra-node data path: cross-memory attach (`process_vm_writev` /
//! `process_vm_readv`) copies bytes between two processes' registered
//! regions in one kernel copy, with no socket and no intermediate buffer.
//!
//! Whether a peer may use it is decided once per peer: same host identity
//! (boot id), and a *probe* — reading back, through cross-memory attach, an
//! 8-byte word in which the peer stored its instance id. The probe proves in
//! one step that the pid names that very process in our pid namespace and
//! that the kernel lets us access it (same user or `CAP_SYS_PTRACE`, Yama
//! `ptrace_scope`, seccomp).

use std::io;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};

use caps::{CapSet, CapsHashSet};

/// Most iovecs per call on each side (Linux `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// This host's identity: the kernel boot id (unique per host and boot).
pub(crate) fn host_id() -> String {
    match std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        Ok(s) => s.trim().to_owned(),
        // Unknown: an identity no other agent can share, so the direct path
        // is never chosen.
        Err(_) => format!("unknown-{:016x}", crate::auth::random_u64()),
    }
}

/// Checks that process `pid` (of this host) is one this process can reach
/// directly and that it is the agent with `instance`: the 8-byte word at
/// its `probe_addr` holds `instance`. Returns why not, otherwise.
pub(crate) fn probe(pid: u32, probe_addr: u64, instance: u64) -> Result<(), String> {
    let mut word = 0u64;
    let local = libc::iovec {
        iov_base: (&mut word as *mut u64).cast(),
        iov_len: 8,
    };
    let remote = libc::iovec {
        iov_base: probe_addr as *mut libc::c_void,
        iov_len: 8,
    };
    let pid_t = libc::pid_t::try_from(pid).map_err(|_| "pid out of range".to_string())?;
    // SAFETY: `local` points at `word`, 8 writable bytes on our stack; the
    // remote iovec is only dereferenced by the kernel in the other process,
    // where a bad address yields EFAULT.
    let n = unsafe { libc::process_vm_readv(pid_t, &local, 1, &remote, 1, 0) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EPERM) => format!(
                "cross-memory attach to pid {} denied ({e}): another user, ptrace restrictions, or missing CAP_SYS_PTRACE",
                pid
            ),
            Some(libc::ESRCH) => format!("no process {pid} in this pid namespace"),
            Some(libc::ENOSYS) => "cross-memory attach is not available (ENOSYS)".into(),
            _ => format!("cross-memory attach probe failed: {e}"),
        });
    }
    if n != 8 || word != instance {
        return Err(format!(
            "pid {pid} is not the agent that published this descriptor (another pid namespace?)"
        ));
    }
    Ok(())
}

/// While held, the calling thread runs without effective capabilities:
/// what it asks of the kernel is checked as for its user alone. A
/// cross-memory copy (or an open of `/proc/<pid>/mem`) then reaches only a
/// process whose real, effective and saved ids all equal this thread's
/// real ones, that is dumpable (not running a set-user-id program), holds
/// no capability this process could not hold, and the security modules let
/// it (Yama's `ptrace_scope`). Threads spawned while it is held start
/// without them too. Dropping it raises them again (from the permitted set,
/// which it leaves as it was); the thread's ids never change, so neither
/// does who may signal or trace it.
///
/// Tied to its thread (capability sets are per thread): not `Send`.
pub(crate) struct Unprivileged {
    /// The effective set to raise again.
    saved: CapsHashSet,
    _thread: PhantomData<*const ()>,
}

impl Unprivileged {
    /// Drops this thread's effective capabilities until the guard drops.
    ///
    /// # Errors
    /// The kernel refused to read or lower the set.
    pub(crate) fn enter() -> io::Result<Self> {
        let saved = caps::read(None, CapSet::Effective).map_err(io::Error::other)?;
        if !saved.is_empty() {
            caps::clear(None, CapSet::Effective).map_err(io::Error::other)?;
        }
        Ok(Self {
            saved,
            _thread: PhantomData,
        })
    }
}

impl Drop for Unprivileged {
    fn drop(&mut self) {
        if !self.saved.is_empty()
            && let Err(e) = caps::set(None, CapSet::Effective, &self.saved)
        {
            // Less privilege than before, never more: logged, not fatal.
            tracing::error!(error = %e, "could not raise this thread's capabilities again");
        }
    }
}

/// The other side of a copy.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Peer<'a> {
    /// Another process, reached by cross-memory attach; pieces' remote
    /// addresses are that process's.
    Process(u32),
    /// Memory mapped into this process (a peer's shared pool): pieces'
    /// remote addresses are this process's, and the copy is `memmove`.
    Mapped {
        /// A checked copy: both sides of each part are compared byte for
        /// byte right after it moved (both still in cache), and this is set
        /// when they differ. (No sums: whoever sees both sides compares
        /// them exactly, where a CRC32C is only a digest to send along.)
        differs: Option<&'a AtomicBool>,
    },
}

/// Direction of a cross-memory copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Local → remote.
    Write,
    /// Remote → local.
    Read,
}

use crate::integrity::Crc32c;
use crate::memory::Piece;

/// Most bytes one cross-memory call moves: an abort (see [`copy`]) takes
/// effect within this much per copying thread (one TCP segment's worth,
/// well under a millisecond).
pub(crate) const CALL_MAX_BYTES: u64 = 4 << 20;

/// Whether `addr` can go into an iovec list: it extends the last entry, or
/// the list has room for another.
fn fits(v: &[libc::iovec], addr: u64) -> bool {
    v.last()
        .is_some_and(|last| last.iov_base as u64 + last.iov_len as u64 == addr)
        || v.len() < IOV_MAX
}

/// Appends `len` bytes at `addr` to an iovec list, extending the last entry
/// when the bytes follow it.
fn push_iov(v: &mut Vec<libc::iovec>, addr: u64, len: u64) {
    match v.last_mut() {
        Some(last) if last.iov_base as u64 + last.iov_len as u64 == addr => {
            last.iov_len += len as usize;
        }
        _ => v.push(libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len as usize,
        }),
    }
}

/// Copies every piece between this process and `pid`, resuming after
/// partial transfers. Each side's ranges are merged where they are adjacent
/// (the two iovec lists of a call need not match entry for entry), up to
/// 1024 entries per side per call: the kernel pins the other process's pages
/// one iovec at a time, so a contiguous remote side costs one pin call per
/// 16 pages rather than one per piece.
///
///
/// Each call moves at most [`CALL_MAX_BYTES`]; `stop` is asked before each
/// one, and when it says so the copy ends there: `Ok(false)` (the bytes
/// copied so far are in place, the rest untouched). `Ok(true)`: all copied.
///
/// `sums` (one per piece): each piece's CRC32C over its local side, the
/// bytes of each call (then at most `integrity::CHECK_CHUNK`) summed right
/// after it, still in cache; whole only when all was copied. Never with
/// [`Peer::Mapped`] (which compares instead).
///
/// # Safety
/// Every `local` range must be valid for reads (`Write`) or writes (`Read`)
/// for the whole call, and not accessed by Rust code meanwhile (with
/// `sums`, also readable, and not written meanwhile by anyone else).
///
/// With [`Peer::Mapped`] the remote ranges must be valid for writes
/// (`Write`) or reads (`Read`) in this process for the whole call, as the
/// local ones (and readable when comparing).
pub(crate) unsafe fn copy(
    peer: Peer<'_>,
    dir: Direction,
    pieces: &[Piece],
    stop: &(dyn Fn() -> bool + Sync),
    mut sums: Option<&mut [u32]>,
) -> io::Result<bool> {
    debug_assert!(sums.as_ref().is_none_or(|s| s.len() == pieces.len()));
    let pid = match peer {
        Peer::Process(pid) => pid,
        // SAFETY: forwarded contract.
        Peer::Mapped { differs } => {
            debug_assert!(sums.is_none(), "a mapped copy compares, it does not sum");
            // SAFETY: forwarded contract.
            return Ok(unsafe { copy_mapped(dir, pieces, stop, differs) });
        }
    };
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut local = Vec::with_capacity(IOV_MAX.min(pieces.len()));
    let mut remote = Vec::with_capacity(IOV_MAX.min(pieces.len()));
    let (mut i, mut off) = (0usize, 0u64);
    // The running sum of a piece that spans calls.
    let mut partial: Option<Crc32c> = None;
    while i < pieces.len() {
        if stop() {
            return Ok(false);
        }
        local.clear();
        remote.clear();
        let (mut j, mut o) = (i, off);
        // Summed: a call small enough that what it read (or wrote) here
        // is still in the core's cache for the sum.
        let mut room = if sums.is_some() {
            crate::integrity::CHECK_CHUNK as u64
        } else {
            CALL_MAX_BYTES
        };
        while j < pieces.len() && room > 0 {
            let p = pieces[j];
            let (l, r) = (p.local + o, p.remote + o);
            let n = (p.len - o).min(room);
            // Both lists take the piece, or neither does: a full list ends
            // the call (the first piece always fits in empty lists).
            if !fits(&local, l) || !fits(&remote, r) {
                break;
            }
            push_iov(&mut local, l, n);
            push_iov(&mut remote, r, n);
            room -= n;
            j += 1;
            o = 0;
        }
        let (lc, rc) = (local.len() as libc::c_ulong, remote.len() as libc::c_ulong);
        // SAFETY: both iovec arrays are live and hold `lc` / `rc` entries
        // covering the same number of bytes; local ranges are valid per this
        // function's contract; remote ranges are only touched by the kernel
        // in the other process (EFAULT if bad).
        let n = unsafe {
            match dir {
                Direction::Write => {
                    libc::process_vm_writev(pid, local.as_ptr(), lc, remote.as_ptr(), rc, 0)
                }
                Direction::Read => {
                    libc::process_vm_readv(pid, local.as_ptr(), lc, remote.as_ptr(), rc, 0)
                }
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::other("cross-memory copy made no progress"));
        }
        // Advance by `n` bytes (summing them).
        let mut left = n as u64;
        while left > 0 {
            let take = (pieces[i].len - off).min(left);
            if let Some(sums) = sums.as_deref_mut() {
                // SAFETY: a part of a local piece, readable per the
                // contract; the kernel has just copied it.
                let bytes = unsafe {
                    std::slice::from_raw_parts((pieces[i].local + off) as *const u8, take as usize)
                };
                if off == 0 && take == pieces[i].len {
                    sums[i] = crate::integrity::crc32c(bytes);
                } else {
                    // A piece over several calls: one running sum (a
                    // combination of two sums costs more than summing
                    // the call's bytes).
                    partial.get_or_insert_with(Crc32c::new).update(bytes);
                    if off + take == pieces[i].len {
                        sums[i] = partial.take().map_or(0, |c| c.finish());
                    }
                }
            }
            left -= take;
            off += take;
            if off == pieces[i].len {
                i += 1;
                off = 0;
            }
        }
    }
    Ok(true)
}

/// Bytes a mapped copy moves at a time before it compares them: both
/// sides stay in the core's own cache for the comparison.
const COMPARE_CHUNK: u64 = 64 << 10;

/// [`copy`] within this process: each piece by `memmove`, in parts of at
/// most [`CALL_MAX_BYTES`] (of [`COMPARE_CHUNK`] when comparing), `stop`
/// asked before each part; with `differs`, a part whose two sides differ
/// once it moved sets it.
///
/// # Safety
/// As [`copy`] with [`Peer::Mapped`].
unsafe fn copy_mapped(
    dir: Direction,
    pieces: &[Piece],
    stop: &(dyn Fn() -> bool + Sync),
    differs: Option<&AtomicBool>,
) -> bool {
    let part = if differs.is_some() {
        COMPARE_CHUNK
    } else {
        CALL_MAX_BYTES
    };
    for p in pieces {
        let mut off = 0;
        while off < p.len {
            if stop() {
                return false;
            }
            let n = (p.len - off).min(part);
            let (local, remote) = (p.local + off, p.remote + off);
            let (from, to) = match dir {
                Direction::Write => (local, remote),
                Direction::Read => (remote, local),
            };
            // SAFETY: both ranges are valid per the contract. They lie in
            // different mappings; `copy` (memmove) stays correct even for
            // ranges that overlap.
            unsafe { std::ptr::copy(from as *const u8, to as *mut u8, n as usize) };
            if let Some(differs) = differs {
                // SAFETY: both ranges, readable per the contract, just
                // copied.
                let same = unsafe {
                    std::slice::from_raw_parts(local as *const u8, n as usize)
                        == std::slice::from_raw_parts(remote as *const u8, n as usize)
                };
                if !same {
                    differs.store(true, Ordering::Relaxed);
                }
            }
            off += n;
        }
    }
    true
}

/// Splits `pieces` into `parts` runs of about equal bytes (splitting pieces
/// where needed), in order.
pub(crate) fn split(pieces: &[Piece], parts: usize) -> Vec<Vec<Piece>> {
    let total: u64 = pieces.iter().map(|p| p.len).sum();
    let parts = parts.max(1);
    let share = total.div_ceil(parts as u64).max(1);
    let mut out: Vec<Vec<Piece>> = vec![Vec::new()];
    let mut room = share;
    for p in pieces {
        let mut p = *p;
        while p.len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = share;
            }
            let n = p.len.min(room);
            out.last_mut().expect("never empty").push(Piece {
                local: p.local,
                remote: p.remote,
                len: n,
            });
            p.local += n;
            p.remote += n;
            p.len -= n;
            room -= n;
        }
    }
    out
}

/// [`copy`] with the pieces spread over `threads` threads (the caller's
/// included) when there are at least `min_bytes` to move; with `sums`, each
/// thread sums what it copied and the parts of a split piece are combined.
///
/// # Safety
/// As [`copy`].
pub(crate) unsafe fn copy_parallel(
    peer: Peer<'_>,
    dir: Direction,
    pieces: &[Piece],
    (threads, min_bytes): (usize, u64),
    stop: &(dyn Fn() -> bool + Sync),
    sums: Option<&mut [u32]>,
) -> io::Result<bool> {
    let total: u64 = pieces.iter().map(|p| p.len).sum();
    if threads <= 1 || total < min_bytes {
        // SAFETY: forwarded contract.
        return unsafe { copy(peer, dir, pieces, stop, sums) };
    }
    let parts = split(pieces, threads);
    let summed = sums.is_some();
    let mut part_sums: Vec<Vec<u32>> = parts
        .iter()
        .map(|p| if summed { vec![0; p.len()] } else { Vec::new() })
        .collect();
    let copied = std::thread::scope(|s| {
        let mut each = parts.iter().zip(part_sums.iter_mut());
        let (part0, sums0) = each.next().expect("split gives one part at least");
        let handles: Vec<_> = each
            .map(|(part, ps)| {
                let ps = summed.then_some(ps.as_mut_slice());
                // SAFETY: forwarded contract; each part is a subset of
                // `pieces`.
                s.spawn(move || unsafe { copy(peer, dir, part, stop, ps) })
            })
            .collect();
        // SAFETY: forwarded contract.
        let first = unsafe {
            copy(
                peer,
                dir,
                part0,
                stop,
                summed.then_some(sums0.as_mut_slice()),
            )
        };
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(io::Error::other("copy thread panicked")))
            })
            .fold(first, |acc, r| Ok(acc? & r?))
    })?;
    if let Some(sums) = sums
        && copied
    {
        combine_parts(pieces, &parts, &part_sums, sums);
    }
    Ok(copied)
}

/// Each piece's sum from its parts' sums (`parts` as [`split`] made them:
/// the pieces in order, a split piece's parts in a row).
fn combine_parts(pieces: &[Piece], parts: &[Vec<Piece>], part_sums: &[Vec<u32>], sums: &mut [u32]) {
    let mut parts = parts.iter().flatten().zip(part_sums.iter().flatten());
    for (p, sum) in pieces.iter().zip(sums.iter_mut()) {
        let mut covered = 0;
        while covered < p.len {
            let (part, &s) = parts.next().expect("the parts cover every piece");
            *sum = if covered == 0 {
                s
            } else {
                crate::integrity::crc32c_combine(*sum, s, part.len)
            };
            covered += part.len;
        }
    }
}

/// The CRC32C of each piece's local side, spread over `threads` threads
/// (the caller's included) when there are at least `min_bytes`.
///
/// # Safety
/// Every `local` range must be valid for reads for the whole call.
pub(crate) unsafe fn sum_parallel(
    pieces: &[Piece],
    (threads, min_bytes): (usize, u64),
) -> Vec<u32> {
    let sum = |p: &Piece| {
        // SAFETY: forwarded contract.
        let bytes = unsafe { std::slice::from_raw_parts(p.local as *const u8, p.len as usize) };
        crate::integrity::crc32c(bytes)
    };
    let total: u64 = pieces.iter().map(|p| p.len).sum();
    if threads <= 1 || total < min_bytes {
        return pieces.iter().map(sum).collect();
    }
    let parts = split(pieces, threads);
    let part_sums: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = parts[1..]
            .iter()
            .map(|part| s.spawn(move || part.iter().map(sum).collect::<Vec<u32>>()))
            .collect();
        let first: Vec<u32> = parts[0].iter().map(sum).collect();
        std::iter::once(first)
            .chain(
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a sum does not panic")),
            )
            .collect()
    });
    let mut sums = vec![0u32; pieces.len()];
    combine_parts(pieces, &parts, &part_sums, &mut sums);
    sums
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Root's copy into another user's process goes through with
    /// `CAP_SYS_PTRACE` and is refused without it; the thread's effective
    /// set comes back when the guard drops. Needs root.
    #[test]
    fn unprivileged_copies_reach_only_the_users_own_processes() {
        // SAFETY: a plain system call without arguments.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!(
                "SKIPPED unprivileged_copies_reach_only_the_users_own_processes: needs root (to run a process as another user)"
            );
            return;
        }
        use std::os::unix::process::CommandExt;
        let mut other = std::process::Command::new("sleep")
            .arg("60")
            .uid(65534)
            .gid(65534)
            .spawn()
            .unwrap();
        let pid = other.id();
        // `spawn` returns once the child runs `sleep` (as that user).
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let start = u64::from_str_radix(maps.split('-').next().unwrap(), 16).unwrap();
        let read = || {
            let mut w = [0u8; 8];
            let pieces = [Piece {
                local: w.as_mut_ptr() as u64,
                remote: start,
                len: 8,
            }];
            // SAFETY: `w` is written by the kernel only.
            unsafe {
                copy(
                    Peer::Process(pid),
                    Direction::Read,
                    &pieces,
                    &|| false,
                    None,
                )
            }
        };
        let before = caps::read(None, CapSet::Effective).unwrap();
        assert!(before.contains(&caps::Capability::CAP_SYS_PTRACE));
        assert!(read().unwrap());
        {
            let _u = Unprivileged::enter().unwrap();
            assert!(caps::read(None, CapSet::Effective).unwrap().is_empty());
            let e = read().unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM));
            // A thread spawned meanwhile starts without them too.
            std::thread::scope(|s| {
                s.spawn(|| assert!(read().is_err())).join().unwrap();
            });
        }
        assert_eq!(caps::read(None, CapSet::Effective).unwrap(), before);
        assert!(read().unwrap());
        other.kill().unwrap();
        other.wait().unwrap();
    }

    #[test]
    fn split_keeps_order_and_bytes() {
        let pieces: Vec<Piece> = (0..5u64)
            .map(|i| Piece {
                local: i * 100,
                remote: 1000 + i * 100,
                len: 100,
            })
            .collect();
        for parts in 1..8 {
            let out = split(&pieces, parts);
            assert!(out.len() <= parts);
            let flat: Vec<Piece> = out.concat();
            assert_eq!(flat.iter().map(|p| p.len).sum::<u64>(), 500);
            // Consecutive bytes, in order, same local/remote offsets.
            let mut at = 0u64;
            for p in &flat {
                assert_eq!(p.remote - p.local, 1000);
                assert_eq!(p.local, at);
                at += p.len;
            }
        }
    }

    #[test]
    fn copies_within_own_process_and_probes_self() {
        let instance = 0x1234_5678_9abc_def0u64;
        let word = Box::new(instance);
        let (pid, addr) = (std::process::id(), &*word as *const u64 as u64);
        probe(pid, addr, instance).unwrap();
        let why = probe(pid, addr, instance ^ 1).unwrap_err();
        assert!(why.contains("not the agent"), "{why}");

        // 3000 pieces (more than one system call's worth), odd sizes.
        let src: Vec<u8> = (0..3000 * 7).map(|i| (i * 31 % 251) as u8).collect();
        let dst = vec![0u8; 3000 * 9];
        let pieces: Vec<Piece> = (0..3000u64)
            .map(|i| Piece {
                local: src.as_ptr() as u64 + i * 7,
                remote: dst.as_ptr() as u64 + i * 9,
                len: 7,
            })
            .collect();
        let mut sums = vec![0u32; pieces.len()];
        // SAFETY: `src` is valid for reads; `dst` is written by the kernel
        // only and read after the call.
        unsafe {
            assert!(
                copy_parallel(
                    Peer::Process(std::process::id()),
                    Direction::Write,
                    &pieces,
                    (3, 1),
                    &|| false,
                    Some(&mut sums)
                )
                .unwrap()
            )
        };
        let dst = std::hint::black_box(dst);
        for i in 0..3000 {
            assert_eq!(dst[i * 9..i * 9 + 7], src[i * 7..i * 7 + 7]);
            assert_eq!(dst[i * 9 + 7..i * 9 + 9], [0, 0]);
            assert_eq!(sums[i], crate::integrity::crc32c(&src[i * 7..i * 7 + 7]));
        }
    }

    /// Each piece's sum is its local side's CRC32C, also when a piece spans
    /// several calls or is split between threads, both ways (and summed
    /// alone, as a target checks).
    #[test]
    fn copies_sum_each_piece_across_calls_and_threads() {
        let sizes = [CALL_MAX_BYTES + 3, 5 << 20, 100, 1, 3 << 20];
        let len = sizes.iter().sum::<u64>() as usize;
        let src: Vec<u8> = (0..len).map(|i| (i * 131 % 253) as u8).collect();
        let dst = vec![0u8; len];
        let mut at = 0u64;
        let pieces: Vec<Piece> = sizes
            .iter()
            .map(|&n| {
                let p = Piece {
                    local: src.as_ptr() as u64 + at,
                    remote: dst.as_ptr() as u64 + at,
                    len: n,
                };
                at += n;
                p
            })
            .collect();
        let want: Vec<u32> = pieces
            .iter()
            .map(|p| {
                let o = (p.local - src.as_ptr() as u64) as usize;
                crate::integrity::crc32c(&src[o..o + p.len as usize])
            })
            .collect();
        // One checked copy, all of it: each piece's sum.
        let copy_summed = |dir: Direction, pieces: &[Piece], threads: usize| {
            let mut sums = vec![0u32; pieces.len()];
            // SAFETY: each local side is `src` (valid for reads) or `back`
            // (written by the kernel only, read after the call); the remote
            // side is `dst`, touched only by the kernel during the call.
            let copied = unsafe {
                copy_parallel(
                    Peer::Process(std::process::id()),
                    dir,
                    pieces,
                    (threads, 1),
                    &|| false,
                    Some(&mut sums),
                )
            };
            assert!(copied.unwrap());
            sums
        };
        for threads in [1, 2, 3, 7] {
            let sums = copy_summed(Direction::Write, &pieces, threads);
            assert_eq!(sums, want, "{threads} threads, write");
            assert!(std::hint::black_box(&dst) == &src);
            // READ back into a fresh buffer: the sums are of what landed.
            let back = vec![0u8; len];
            let rev: Vec<Piece> = pieces
                .iter()
                .map(|p| Piece {
                    local: back.as_ptr() as u64 + (p.local - src.as_ptr() as u64),
                    remote: p.remote,
                    len: p.len,
                })
                .collect();
            let sums = copy_summed(Direction::Read, &rev, threads);
            assert_eq!(sums, want, "{threads} threads, read");
            assert!(std::hint::black_box(&back) == &src);
            // SAFETY: `src` is valid for reads.
            let summed = unsafe { sum_parallel(&pieces, (threads, 1)) };
            assert_eq!(summed, want, "{threads} threads, summed");
        }
    }

    /// Within this process (a mapped pool), a checked copy compares both
    /// sides of what it moved, both ways, across parts and threads: equal
    /// sides leave `differs` clear; a piece whose source changes under its
    /// copy sets it.
    #[test]
    fn mapped_copies_compare_both_sides() {
        let sizes = [(1 << 20) + 5, 64 << 10, 1, 300 << 10];
        let len = sizes.iter().sum::<u64>() as usize;
        let mut src: Vec<u8> = (0..len).map(|i| (i * 131 % 253) as u8).collect();
        let mut dst = vec![0u8; len];
        let mut back = vec![0u8; len];
        let (s, d, b) = (
            src.as_mut_ptr() as u64,
            dst.as_mut_ptr() as u64,
            back.as_mut_ptr() as u64,
        );
        let mut at = 0u64;
        let mut pieces = Vec::new();
        for &n in &sizes {
            pieces.push((at, n));
            at += n;
        }
        for threads in [1, 2, 3] {
            for (dir, local) in [(Direction::Write, s), (Direction::Read, b)] {
                let ps: Vec<Piece> = pieces
                    .iter()
                    .map(|&(o, n)| Piece {
                        local: local + o,
                        remote: d + o,
                        len: n,
                    })
                    .collect();
                let differs = AtomicBool::new(false);
                // SAFETY: the three buffers are live, distinct and not
                // touched by Rust code during the call.
                let copied = unsafe {
                    copy_parallel(
                        Peer::Mapped {
                            differs: Some(&differs),
                        },
                        dir,
                        &ps,
                        (threads, 1),
                        &|| false,
                        None,
                    )
                };
                assert!(copied.unwrap());
                assert!(
                    !differs.load(Ordering::Relaxed),
                    "{threads} threads, {dir:?}"
                );
            }
            assert!(dst == src && back == src);
            dst.fill(0);
            back.fill(0);
        }
        // A piece whose source changes under its copy (here it overlaps
        // its own destination, so the move rewrites it): the sides differ
        // once it moved, and that is seen.
        let p = Piece {
            local: s,
            remote: s + 1,
            len: 4096,
        };
        let differs = AtomicBool::new(false);
        // SAFETY: both ranges lie in `src`, live and not touched by Rust
        // code during the call; the mapped copy allows them to overlap.
        let copied = unsafe {
            copy(
                Peer::Mapped {
                    differs: Some(&differs),
                },
                Direction::Write,
                &[p],
                &|| false,
                None,
            )
        };
        assert!(copied.unwrap());
        assert!(differs.load(Ordering::Relaxed));
    }

    /// A copy asked to stop ends at a call boundary: what it copied is one
    /// call's worth (the first [`CALL_MAX_BYTES`], a piece split at it),
    /// and nothing after it is written.
    #[test]
    fn a_stopped_copy_ends_at_a_call_boundary() {
        let len = 3 * CALL_MAX_BYTES as usize + 5;
        let src = vec![0xa5u8; len];
        let dst = vec![0u8; len];
        // Two pieces; the first larger than one call.
        let cut = CALL_MAX_BYTES as usize + 3;
        let pieces = [
            Piece {
                local: src.as_ptr() as u64,
                remote: dst.as_ptr() as u64,
                len: cut as u64,
            },
            Piece {
                local: src.as_ptr() as u64 + cut as u64,
                remote: dst.as_ptr() as u64 + cut as u64,
                len: (len - cut) as u64,
            },
        ];
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let stop = || calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 1;
        // SAFETY: `src` is valid for reads; `dst` is written by the kernel
        // only and read after the call.
        let done = unsafe {
            copy(
                Peer::Process(std::process::id()),
                Direction::Write,
                &pieces,
                &stop,
                None,
            )
        };
        assert!(!done.unwrap());
        let dst = std::hint::black_box(dst);
        let copied = dst.iter().take_while(|&&b| b == 0xa5).count();
        assert_eq!(copied, CALL_MAX_BYTES as usize);
        assert!(dst[copied..].iter().all(|&b| b == 0));
    }

    /// Runs of adjacent ranges on either side, broken at different places
    /// on each, over more than one call's worth of iovecs per side, both
    /// directions: every byte lands where its piece says, nothing else is
    /// written.
    #[test]
    fn merges_each_side_independently() {
        let n = 5000u64;
        let len = |i: u64| 1 + (i * 7919) % 13;
        // Local: a gap after every 4th piece (1250 runs); remote: after
        // every 3rd (1667 runs): more than 1024 entries on either side.
        let (mut lo, mut ro) = (Vec::new(), Vec::new());
        let (mut l, mut r) = (0u64, 0u64);
        for i in 0..n {
            lo.push(l);
            ro.push(r);
            l += len(i) + u64::from(i % 4 == 3);
            r += len(i) + 2 * u64::from(i % 3 == 2);
        }
        let src: Vec<u8> = (0..l).map(|i| (i * 131 % 251) as u8 + 1).collect();
        for dir in [Direction::Write, Direction::Read] {
            let other = vec![0u8; r as usize];
            let mut here = vec![0u8; l as usize];
            let (local_base, remote_base) = match dir {
                Direction::Write => (src.as_ptr() as u64, other.as_ptr() as u64),
                Direction::Read => (here.as_mut_ptr() as u64, other.as_ptr() as u64),
            };
            if dir == Direction::Read {
                // Fill the remote side from `src` first (a write), then read
                // it back into `here`.
                let w: Vec<Piece> = (0..n)
                    .map(|i| Piece {
                        local: src.as_ptr() as u64 + lo[i as usize],
                        remote: remote_base + ro[i as usize],
                        len: len(i),
                    })
                    .collect();
                // SAFETY: `src` is readable; `other` is written by the kernel
                // only and read after the call.
                assert!(unsafe {
                    copy(
                        Peer::Process(std::process::id()),
                        Direction::Write,
                        &w,
                        &|| false,
                        None,
                    )
                    .unwrap()
                });
            }
            let pieces: Vec<Piece> = (0..n)
                .map(|i| Piece {
                    local: local_base + lo[i as usize],
                    remote: remote_base + ro[i as usize],
                    len: len(i),
                })
                .collect();
            // SAFETY: local ranges lie in `src` (readable) or `here`
            // (written by the kernel only, read after the call).
            assert!(unsafe {
                copy(
                    Peer::Process(std::process::id()),
                    dir,
                    &pieces,
                    &|| false,
                    None,
                )
                .unwrap()
            });
            let (other, here) = (std::hint::black_box(other), std::hint::black_box(here));
            let mut touched = vec![false; r as usize];
            for i in 0..n as usize {
                let k = len(i as u64) as usize;
                let want = &src[lo[i] as usize..lo[i] as usize + k];
                assert_eq!(
                    &other[ro[i] as usize..ro[i] as usize + k],
                    want,
                    "piece {i}"
                );
                if dir == Direction::Read {
                    assert_eq!(&here[lo[i] as usize..lo[i] as usize + k], want, "piece {i}");
                }
                touched[ro[i] as usize..ro[i] as usize + k].fill(true);
            }
            for (b, t) in other.iter().zip(&touched) {
                if !t {
                    assert_eq!(*b, 0, "a gap was written");
                }
            }
        }
    }
}
