//! The ping-pongs: latency the way `ib_write_lat` measures it, through the
//! agent (`--pingpong`), through the verbs layer alone (`--pingpong-verbs`),
//! both alternating (`--pingpong-ab`), with the answering side in this
//! process or a child (`--two-process`).

use super::*;
use std::sync::atomic::{AtomicU32, Ordering};

/// Timestamps for the ping-pong's per-iteration timing, as perftest takes
/// them (`get_cycles`): the time-stamp counter on x86-64, converted to time
/// by a calibration against `Instant` over the run. `Instant` there can be a
/// system call per read (a guest whose clock source is an emulated HPET:
/// 2.2 µs a read, and a round trip took ~20 of them), which perftest does
/// not pay.
struct Ticks {
    t0: Instant,
    k0: u64,
}

impl Ticks {
    fn start() -> Self {
        Self {
            t0: Instant::now(),
            k0: Self::now(),
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn now() -> u64 {
        // SAFETY: RDTSC exists on every x86-64 processor and has no
        // preconditions.
        unsafe { std::arch::x86_64::_rdtsc() }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn now() -> u64 {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }

    /// The ticks now when timing a send's phases (`--phases`), else 0 and
    /// no clock read.
    fn phase(on: bool) -> u64 {
        if on { Self::now() } else { 0 }
    }

    /// A send's two phases from the [`phase`](Self::phase) reads before
    /// (`t0`) and after (`t1`) its issue: `(t1 - t0, now - t1)`, or zeros
    /// when not timed.
    fn phases(on: bool, t0: u64, t1: u64) -> (u64, u64) {
        if on {
            (t1 - t0, Self::now() - t1)
        } else {
            (0, 0)
        }
    }

    /// Ticks per microsecond, measured since `start`.
    fn per_us(&self) -> f64 {
        let (k, us) = (Self::now(), self.t0.elapsed().as_secs_f64() * 1e6);
        (k.wrapping_sub(self.k0)) as f64 / us.max(1e-3)
    }
}

/// Polls of its memory between yields in [`spin_until`] (`--spin-yield`).
static SPIN_YIELD: AtomicU32 = AtomicU32::new(1 << 16);

/// Sets the polls between yields in [`spin_until`].
pub(super) fn set_spin_yield(n: u32) {
    SPIN_YIELD.store(n.max(1), Ordering::Relaxed);
}

/// Spins until the first word of `buf` equals `want`, as `ib_write_lat`
/// spins on its buffer: a load and a compare, no `pause` (under TCG each
/// `pause` leaves the translated code for the emulator's loop: 0.2-0.3 µs
/// a spin in the soft-RoCE guest, against a few nanoseconds for the load).
/// Every `--spin-yield` spins (by default 2^16: about 0.3 ms there, 50 µs
/// on a host) it reads the clock for the timeout (counted from the first
/// read) and yields, so the transport's threads run where cores are
/// scarce.
fn spin_until(buf: &Buffer, want: u64, timeout: Duration) -> Result<()> {
    let mut start = None;
    let mut n = 0u32;
    let every = SPIN_YIELD.load(Ordering::Relaxed);
    // SAFETY: the first word of a live, aligned buffer; read volatile
    // because the transport (another agent's WRITE) changes it.
    while unsafe { std::ptr::read_volatile(buf.mem.as_ptr()) } != want {
        n = n.wrapping_add(1);
        if n.is_multiple_of(every) {
            let now = Instant::now();
            if now - *start.get_or_insert(now) > timeout {
                bail!("no ping-pong write with value {want} within {timeout:?}");
            }
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// One side of the ping-pong: its agent, the block it sends from, the
/// block the other side writes into, and its request (built once and
/// submitted by reference each time, as perftest posts one prepared work
/// request).
struct Side {
    /// `req` prepared (`--prepared`): submitted with `submit_prepared`.
    /// Declared first: dropped before the agent.
    prepared: Option<PreparedTransfer>,
    agent: Box<dyn TransferAgent>,
    src: Buffer,
    dst: Buffer,
    peer: String,
    req: TransferRequest,
}

impl Side {
    fn new(cfg: AgentConfig, backend: Backend, size: u64) -> Result<Self> {
        let agent = make_transfer_agent(backend, cfg)?;
        let (src, dst) = (Buffer::new(size), Buffer::new(size));
        // SAFETY: both buffers live in the `Side` with the agent, which
        // `Drop` order (agent first) releases before them.
        unsafe {
            agent.register_memory(&src.desc())?;
            agent.register_memory(&dst.desc())?;
        }
        // SAFETY: writes the first word of our own buffer, before any
        // transfer uses it.
        unsafe { std::ptr::write_volatile(dst.mem.as_ptr().cast_mut(), 0) };
        Ok(Self {
            prepared: None,
            agent,
            src,
            dst,
            peer: String::new(),
            req: TransferRequest::write(
                MemoryDescs::new(MemoryType::Dram, Vec::new()),
                MemoryDescs::new(MemoryType::Dram, Vec::new()),
                "",
            ),
        })
    }
}

impl Side {
    /// Prepares the side's request: later sends use `submit_prepared`.
    fn prepare(&mut self) -> Result<()> {
        self.prepared = Some(self.agent.prepare_transfer(&self.req)?);
        Ok(())
    }

    /// What the other process needs to write to this side (`--two-process`):
    /// its block's address and length, and the agent's connection info.
    fn details(&self) -> String {
        let conn = self.agent.local_connection_info();
        format!("{} {} {conn}", self.dst.addr(), self.dst.mem.len() * 8)
    }

    /// Loads the other process's agent from its [`details`](Self::details)
    /// and aims the request at its block (prepared, with `prepared`).
    fn aim_at(&mut self, f: &[String], prepared: bool) -> Result<()> {
        let [addr, len, conn] = f else {
            bail!("agent details: {f:?}");
        };
        self.peer = self.agent.load_remote_agent_by_connection(conn)?;
        let block = MemoryDesc::new(addr.parse()?, len.parse()?, 0);
        let remote = MemoryDescs::new(MemoryType::Dram, vec![block]);
        self.req = TransferRequest::write(self.src.desc(), remote, &self.peer);
        if prepared {
            self.prepare()?;
        }
        Ok(())
    }
}

impl PingSide for Side {
    fn dst(&self) -> &Buffer {
        &self.dst
    }

    /// Writes `value` (in the first word of the block) to the other side;
    /// returns the [`Ticks`] spent in `submit_transfer` and then waiting
    /// for the request's completion (with `phases`; else zeros, and no
    /// clock read).
    fn send(&mut self, value: u64, timeout: Duration, phases: bool) -> Result<(u64, u64)> {
        self.src.mem[0] = value;
        let t0 = Ticks::phase(phases);
        let st = match &self.prepared {
            Some(p) => self.agent.submit_prepared(p)?,
            None => self.agent.submit_transfer(&self.req)?,
        };
        let t1 = Ticks::phase(phases);
        st.wait_success(timeout)?;
        Ok(Ticks::phases(phases, t0, t1))
    }
}

/// Per-iteration times of a ping-pong's initiating side, in microseconds:
/// half the round trip, and with `--phases` the send's two phases (in the
/// request, waiting for its completion) and the wait for the answer (empty
/// without).
struct PingTimes {
    lat: Vec<f64>,
    send: Vec<f64>,
    own: Vec<f64>,
    answer: Vec<f64>,
    elapsed_s: f64,
}

/// A ping-pong participant: through an agent, or through verbs alone.
trait PingSide {
    /// Writes `value` into the other side's block; returns the ticks of
    /// the two phases (issuing it, then waiting for its completion) when
    /// asked for `phases` (zeros, and no clock read, otherwise).
    fn send(&mut self, value: u64, timeout: Duration, phases: bool) -> Result<(u64, u64)>;
    /// The block the other side writes into.
    fn dst(&self) -> &Buffer;
}

/// The answering side: waits for each odd value, answers the next even one.
fn pong_loop(side: &mut impl PingSide, total: u64, timeout: Duration) -> Result<()> {
    for i in 0..total {
        spin_until(side.dst(), 2 * i + 1, timeout)?;
        side.send(2 * i + 2, timeout, false)?;
    }
    Ok(())
}

/// Runs `total` round trips: `side` writes an odd value to the other side,
/// then awaits the answer (the next value) in its own block. The first
/// `warmup` are not recorded. Without `phases` the clock is read once a
/// round trip, when the answer has landed (a round trip is the time from
/// one such read to the next, as `ib_write_lat` times the gaps between its
/// posts); with them, also around the send's two phases.
fn ping_loop(
    side: &mut impl PingSide,
    (total, warmup): (u64, u64),
    timeout: Duration,
    phases: bool,
) -> Result<PingTimes> {
    let mut raw: [Vec<f64>; 4] = Default::default();
    raw[0].reserve(total as usize);
    if phases {
        for v in &mut raw[1..] {
            v.reserve(total as usize);
        }
    }
    let start = Instant::now();
    let ticks = Ticks::start();
    let mut t = Ticks::now();
    for i in 0..total {
        let sent = side.send(2 * i + 1, timeout, phases)?;
        let t_sent = Ticks::phase(phases);
        spin_until(side.dst(), 2 * i + 2, timeout)?;
        let end = Ticks::now();
        if i >= warmup {
            raw[0].push((end - t) as f64 / 2.0);
            if phases {
                raw[1].push(sent.0 as f64);
                raw[2].push(sent.1 as f64);
                raw[3].push((end - t_sent) as f64);
            }
        }
        t = end;
    }
    let elapsed_s = start.elapsed().as_secs_f64();
    let per_us = ticks.per_us();
    let [lat, send, own, answer] = raw.map(|v| v.into_iter().map(|t| t / per_us).collect());
    Ok(PingTimes {
        lat,
        send,
        own,
        answer,
        elapsed_s,
    })
}

/// Runs the calling thread on `cpu` alone (`--pin`); a failure (fewer
/// CPUs, a restricted cpuset) is reported and the thread runs unpinned.
fn pin_to(cpu: usize) {
    // SAFETY: `set` is a plain bitmask owned by this frame; the calls only
    // read it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        eprintln!(
            "cannot pin to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Runs `total` round trips: the pong side `b` on a scoped thread, the
/// ping side `a` on this one (each pinned with `pin`); returns the ping
/// side's times, the first `warmup` not recorded.
fn run_pair<S: PingSide + Send>(
    a: &mut S,
    b: &mut S,
    rounds: (u64, u64),
    (pin, phases): (bool, bool),
    timeout: Duration,
) -> Result<PingTimes> {
    let total = rounds.0;
    std::thread::scope(|s| {
        let pong = s.spawn(|| {
            if pin {
                pin_to(1);
            }
            pong_loop(b, total, timeout)
        });
        if pin {
            pin_to(0);
        }
        let t = ping_loop(a, rounds, timeout, phases);
        pong.join()
            .map_err(|_| anyhow::anyhow!("pong thread panicked"))??;
        t
    })
}

/// One side of the verbs-only ping-pong.
struct VerbsSide {
    qp: kvxfer::verbs::RcQueuePair,
    src: Buffer,
    dst: Buffer,
    src_mr: kvxfer::verbs::Registered,
    dst_mr: kvxfer::verbs::Registered,
    /// The other side's block: remote key and address.
    to: (u32, u64),
    /// Completions polled (kept: a send allocates nothing).
    done: Vec<kvxfer::verbs::WorkCompletion>,
    // Declared last: the device outlives its queue pair and regions.
    _dev: kvxfer::verbs::Device,
}

impl VerbsSide {
    fn new(dev: Option<&str>, size: u64) -> Result<Self> {
        let dev = kvxfer::verbs::Device::open(dev, None)?;
        let (src, dst) = (Buffer::new(size), Buffer::new(size));
        // SAFETY: the buffers live in the side with the regions, which are
        // dropped first (field order).
        let (src_mr, dst_mr) = unsafe {
            (
                dev.register(src.addr(), src.mem.len() as u64 * 8)?,
                dev.register(dst.addr(), dst.mem.len() as u64 * 8)?,
            )
        };
        // SAFETY: writes the first word of our own buffer, before any
        // transfer uses it.
        unsafe { std::ptr::write_volatile(dst.mem.as_ptr().cast_mut(), 0) };
        Ok(Self {
            qp: dev.create_rc_with(256, false)?,
            src,
            dst,
            src_mr,
            dst_mr,
            to: (0, 0),
            done: Vec::with_capacity(32),
            _dev: dev,
        })
    }

    /// What the other process needs to write to this side (`--two-process`):
    /// the queue pair's QPN, PSN, GID (hex) and MTU, the block's remote key
    /// and address.
    fn details(&self) -> String {
        let i = self.qp.info();
        let gid: String = i.gid.iter().map(|b| format!("{b:02x}")).collect();
        let (rkey, addr) = (self.dst_mr.rkey(), self.dst.addr());
        format!("{} {} {gid} {} {rkey} {addr}", i.qpn, i.psn, i.mtu)
    }

    /// Connects to the other process's queue pair from its
    /// [`details`](Self::details) and aims the sends at its block.
    fn aim_at(&mut self, f: &[String]) -> Result<()> {
        let [qpn, psn, gid, mtu, rkey, addr] = f else {
            bail!("queue pair details: {f:?}");
        };
        if gid.len() != 32 || !gid.is_ascii() {
            bail!("GID {gid:?}: not 16 bytes in hex");
        }
        let mut g = [0u8; 16];
        for (k, b) in g.iter_mut().enumerate() {
            *b = u8::from_str_radix(&gid[2 * k..2 * k + 2], 16)?;
        }
        self.qp.connect(&kvxfer::verbs::QpInfo {
            qpn: qpn.parse()?,
            psn: psn.parse()?,
            gid: g,
            mtu: mtu.parse()?,
        })?;
        self.to = (rkey.parse()?, addr.parse()?);
        Ok(())
    }
}

impl PingSide for VerbsSide {
    fn dst(&self) -> &Buffer {
        &self.dst
    }

    /// Posts `value` to the other side's block and polls for its
    /// completion; returns the ticks of the post and of the poll (with
    /// `phases`; else zeros, and no clock read).
    fn send(&mut self, value: u64, timeout: Duration, phases: bool) -> Result<(u64, u64)> {
        let (rkey, remote) = self.to;
        self.src.mem[0] = value;
        let sge = [kvxfer::verbs::Sge {
            lkey: self.src_mr.lkey(),
            addr: self.src.addr(),
            len: self.src.mem.len() as u32 * 8,
        }];
        let t0 = Ticks::phase(phases);
        // SAFETY: the piece lies in `src_mr`, alive until the completion
        // polled below.
        unsafe { self.qp.post_write(value, &sge, rkey, remote, None, true)? };
        let t1 = Ticks::phase(phases);
        let done = &mut self.done;
        done.clear();
        let mut n = 0u32;
        let mut start = None;
        while done.is_empty() {
            self.qp.poll_send(done)?;
            n = n.wrapping_add(1);
            if n.is_multiple_of(1024) {
                let now = Instant::now();
                if now - *start.get_or_insert(now) > timeout {
                    bail!("no completion for ping-pong write {value} within {timeout:?}");
                }
            }
        }
        done[0].ok()?;
        Ok(Ticks::phases(phases, t0, t1))
    }
}

/// Two connected agents (`kvxfer-ping`, `kvxfer-pong`), each with its
/// request to the other's block.
fn agent_pair(args: &Args, backend: Backend, size: u64) -> Result<(Side, Side)> {
    let mut cfg_b = config("kvxfer-pong", args);
    if let Some(d) = &args.target_rdma_device {
        cfg_b = cfg_b.with_rdma_device(d.clone(), None);
    }
    let mut a = Side::new(config("kvxfer-ping", args), backend, size)?;
    let mut b = Side::new(cfg_b, backend, size)?;
    let (da, db) = (a.agent.local_agent_desc(), b.agent.local_agent_desc());
    a.agent.load_remote_agent(&db)?;
    b.agent.load_remote_agent(&da)?;
    a.peer = db.name;
    b.peer = da.name;
    a.req = TransferRequest::write(a.src.desc(), b.dst.desc(), &a.peer);
    b.req = TransferRequest::write(b.src.desc(), a.dst.desc(), &b.peer);
    if args.prepared {
        a.prepare()?;
        b.prepare()?;
    }
    Ok((a, b))
}

/// Two connected queue pairs (`KVXFER_RDMA_DEVICE` and
/// `--target-rdma-device`), each side knowing the other's block.
fn verbs_pair(args: &Args, size: u64) -> Result<(VerbsSide, VerbsSide)> {
    let dev_a = std::env::var("KVXFER_RDMA_DEVICE").ok();
    let dev_b = args.target_rdma_device.clone().or_else(|| dev_a.clone());
    let mut a = VerbsSide::new(dev_a.as_deref(), size)?;
    let mut b = VerbsSide::new(dev_b.as_deref(), size)?;
    let (ia, ib) = (a.qp.info(), b.qp.info());
    a.qp.connect(&ib)?;
    b.qp.connect(&ia)?;
    a.to = (b.dst_mr.rkey(), b.dst.addr());
    b.to = (a.dst_mr.rkey(), a.dst.addr());
    Ok((a, b))
}

/// `--pingpong-ab`: the agent and the verbs-only ping-pongs in one
/// process, alternating blocks of round trips, so that both see the same
/// machine state (a separate run of each swings by 1.5x under TCG).
pub(super) fn run_pingpong_ab(args: &Args) -> Result<()> {
    let size = args.block_size.first().copied().unwrap_or(8).max(8);
    let iters = args.iters.unwrap_or(1000);
    let timeout = Duration::from_secs(10);
    const BLOCK: u64 = 100;
    let (mut aa, mut ab) = agent_pair(args, Backend::Rdma, size)?;
    let (mut pa, mut pb) = agent_pair(args, Backend::Rdma, size)?;
    pa.prepare()?;
    pb.prepare()?;
    let (mut va, mut vb) = verbs_pair(args, size)?;
    let (mut agent, mut prepared, mut verbs) = (Vec::new(), Vec::new(), Vec::new());
    let n = BLOCK + args.warmup;
    for _ in 0..iters.div_ceil(BLOCK) {
        let rounds = (n, args.warmup);
        let how = (args.pin, false);
        agent.extend(run_pair(&mut aa, &mut ab, rounds, how, timeout)?.lat);
        prepared.extend(run_pair(&mut pa, &mut pb, rounds, how, timeout)?.lat);
        verbs.extend(run_pair(&mut va, &mut vb, rounds, how, timeout)?.lat);
    }
    let p50 = |v| summarize(1.0, 0.0, v).p50_us;
    let (a50, p50, v50) = (p50(agent), p50(prepared), p50(verbs));
    if args.json {
        println!(
            "{{\"op\":\"pingpong-ab\",\"block_size\":{size},\"iters\":{iters},\"agent_p50_us\":{a50:.2},\"prepared_p50_us\":{p50:.2},\"verbs_p50_us\":{v50:.2},\"agent_over_verbs\":{:.3},\"prepared_over_verbs\":{:.3}}}",
            a50 / v50,
            p50 / v50
        );
    } else {
        println!(
            "ping-pong, {} blocks, {iters} round trips each, alternating blocks of {BLOCK}: agent p50 {a50:.2} µs (submit_transfer), {p50:.2} µs (submit_prepared), verbs alone {v50:.2} µs; over verbs {:.3} / {:.3}",
            human(size),
            a50 / v50,
            p50 / v50
        );
    }
    Ok(())
}

pub(super) fn run_pingpong_verbs(args: &Args) -> Result<()> {
    let size = args.block_size.first().copied().unwrap_or(8).max(8);
    let iters = args.iters.unwrap_or(1000);
    let total = args.warmup + iters;
    let timeout = Duration::from_secs(10);
    let times = if args.two_process {
        let dev_a = std::env::var("KVXFER_RDMA_DEVICE").ok();
        let mut a = VerbsSide::new(dev_a.as_deref(), size)?;
        let mut child = PongChild::spawn("verbs")?;
        a.aim_at(&child.expect("PONG", 6)?)?;
        let ping = format!("PING {}", a.details());
        child.run(&ping, &mut a, args, (total, timeout))?
    } else {
        let (mut a, mut b) = verbs_pair(args, size)?;
        let how = (args.pin, args.phases);
        run_pair(&mut a, &mut b, (total, args.warmup), how, timeout)?
    };
    let phases = phase_medians("post", &times);
    let m = summarize(1.0, 0.0, times.lat);
    print_pingpong(args.json, "verbs", size, iters, &m, phases, None);
    Ok(())
}

/// The answering side of a `--two-process` ping-pong: a child process
/// running this program with `--pong-child`, set up by lines on its stdin
/// and stdout (`PONG` with its side's details, `PING` with ours, `READY`).
struct PongChild {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl PongChild {
    /// Starts the child with this process's own arguments (so it answers
    /// with the same sizes, counts and agent settings).
    fn spawn(kind: &str) -> Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .args(["--pong-child", kind])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the ping-pong's answering process")?;
        let out = BufReader::new(child.stdout.take().context("child stdout")?);
        Ok(Self { child, out })
    }

    /// Reads the child's next line: `word` and then `n` fields.
    fn expect(&mut self, word: &str, n: usize) -> Result<Vec<String>> {
        read_fields(&mut self.out, "child", word, n)
    }

    /// Writes a line to the child.
    fn say(&mut self, line: &str) -> Result<()> {
        write_line(self.child.stdin.as_mut().context("child stdin")?, line)
    }

    /// Sends the child our side's details (`ping`), waits for it to be
    /// ready, then runs the ping side's `total` round trips on `side`.
    fn run(
        mut self,
        ping: &str,
        side: &mut impl PingSide,
        args: &Args,
        (total, timeout): (u64, Duration),
    ) -> Result<PingTimes> {
        self.say(ping)?;
        self.expect("READY", 0)?;
        if args.pin {
            pin_to(0);
        }
        let t = ping_loop(side, (total, args.warmup), timeout, args.phases);
        self.finish(t)
    }

    /// Waits (at most 20 s) for the child to exit after the ping side's
    /// loop ended with `t`; a child that failed fails the run.
    fn finish<T>(mut self, t: Result<T>) -> Result<T> {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait()? {
                let t = t?;
                if !st.success() {
                    bail!("ping-pong child exited with {st}");
                }
                return Ok(t);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                t?;
                bail!("ping-pong child did not exit");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Reads a line of the ping-pong's set-up from `who`: `word` and then `n`
/// fields.
fn read_fields(r: &mut impl BufRead, who: &str, word: &str, n: usize) -> Result<Vec<String>> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let mut f = line.split_whitespace();
    if f.next() != Some(word) {
        bail!("ping-pong {who}: expected {word}, got {line:?}");
    }
    let rest: Vec<String> = f.map(str::to_string).collect();
    if rest.len() != n {
        bail!(
            "ping-pong {who}: {word} with {} fields, not {n}",
            rest.len()
        );
    }
    Ok(rest)
}

/// Writes a line of the ping-pong's set-up, at once.
fn write_line(w: &mut impl Write, line: &str) -> Result<()> {
    writeln!(w, "{line}")?;
    w.flush()?;
    Ok(())
}

/// `--pong-child`: the answering side of a `--two-process` ping-pong.
pub(super) fn run_pong_child(args: &Args, kind: &str) -> Result<()> {
    let size = args.block_size.first().copied().unwrap_or(8).max(8);
    let total = args.warmup + args.iters.unwrap_or(1000);
    let timeout = Duration::from_secs(10);
    let dev = args
        .target_rdma_device
        .clone()
        .or_else(|| std::env::var("KVXFER_RDMA_DEVICE").ok());
    let (mut input, mut out) = (std::io::stdin().lock(), std::io::stdout().lock());
    if args.pin {
        pin_to(1);
    }
    if kind == "verbs" {
        let mut b = VerbsSide::new(dev.as_deref(), size)?;
        write_line(&mut out, &format!("PONG {}", b.details()))?;
        b.aim_at(&read_fields(&mut input, "parent", "PING", 6)?)?;
        write_line(&mut out, "READY")?;
        return pong_loop(&mut b, total, timeout);
    }
    let backend: Backend = args.backend.parse()?;
    let mut cfg = config("kvxfer-pong", args);
    if let Some(d) = dev {
        cfg = cfg.with_rdma_device(d, None);
    }
    let mut b = Side::new(cfg, backend, size)?;
    write_line(&mut out, &format!("PONG {}", b.details()))?;
    b.aim_at(
        &read_fields(&mut input, "parent", "PING", 3)?,
        args.prepared,
    )?;
    write_line(&mut out, "READY")?;
    pong_loop(&mut b, total, timeout)
}

/// Prints a ping-pong's result: one-way latency, with `--phases` the
/// medians of a round trip's phases (`(name of the first, first, own
/// completion, answer)`), and, for agents, the CPU they use idle.
fn print_pingpong(
    json: bool,
    backend: &str,
    size: u64,
    iters: u64,
    m: &Measured,
    phases: Option<(&str, f64, f64, f64)>,
    idle_pct: Option<f64>,
) {
    if json {
        let idle = idle_pct.map_or(String::new(), |p| format!(",\"idle_cpu_pct\":{p:.2}"));
        let phases = phases.map_or(String::new(), |(_, issue, own, answer)| {
            format!(",\"submit_p50_us\":{issue:.2},\"own_completion_p50_us\":{own:.2},\"answer_p50_us\":{answer:.2}")
        });
        println!(
            "{{\"backend\":\"{backend}\",\"op\":\"pingpong\",\"block_size\":{size},\"iters\":{iters},\"p50_us\":{:.2},\"p99_us\":{:.2},\"mean_us\":{:.2}{phases}{idle}}}",
            m.p50_us, m.p99_us, m.mean_us
        );
    } else {
        let idle = idle_pct.map_or(String::new(), |p| {
            format!("; idle agents use {p:.2}% of a CPU")
        });
        let phases = phases.map_or(String::new(), |(first, issue, own, answer)| {
            format!("; per round trip (medians): {first} {issue:.2} µs, own completion {own:.2} µs, answer {answer:.2} µs")
        });
        println!(
            "{backend} ping-pong, {} blocks, {iters} round trips: one-way latency p50 {:.2} µs, p99 {:.2} µs, mean {:.2} µs{phases}{idle}",
            human(size),
            m.p50_us,
            m.p99_us,
            m.mean_us
        );
    }
}

/// The medians of a ping-pong's phases (`None` without `--phases`), the
/// first named `first`.
fn phase_medians(first: &'static str, t: &PingTimes) -> Option<(&'static str, f64, f64, f64)> {
    if t.send.is_empty() {
        return None;
    }
    let median = |v: &[f64]| summarize(1.0, 0.0, v.to_vec()).p50_us;
    Some((first, median(&t.send), median(&t.own), median(&t.answer)))
}

pub(super) fn run_pingpong(args: &Args) -> Result<()> {
    let backend: Backend = args.backend.parse()?;
    let size = args.block_size.first().copied().unwrap_or(8).max(8);
    let iters = args.iters.unwrap_or(1000);
    let total = args.warmup + iters;
    let timeout = Duration::from_secs(10);
    // With `--phases`, where a round trip goes: in `submit_transfer`,
    // waiting for the own WRITE's completion, then for the answer to land.
    let (a, times) = if args.two_process {
        let mut a = Side::new(config("kvxfer-ping", args), backend, size)?;
        let mut child = PongChild::spawn("agent")?;
        a.aim_at(&child.expect("PONG", 3)?, args.prepared)?;
        let ping = format!("PING {}", a.details());
        let t = child.run(&ping, &mut a, args, (total, timeout))?;
        (a, t)
    } else {
        let (mut a, mut b) = agent_pair(args, backend, size)?;
        let how = (args.pin, args.phases);
        let t = run_pair(&mut a, &mut b, (total, args.warmup), how, timeout)?;
        (a, t)
    };
    let backend_name = a.agent.remote_transport(&a.peer)?;
    let phases = phase_medians("submit", &times);
    let m = summarize(times.elapsed_s, (size * 2 * total) as f64, times.lat);
    // What the two connected, idle agents cost: their progress threads.
    let idle = Duration::try_from_secs_f64(args.idle_secs)
        .map_err(|e| anyhow::anyhow!("--idle-secs {}: {e}", args.idle_secs))?;
    let idle_pct = (!idle.is_zero()).then(|| {
        let (c0, t0) = (cpu_seconds(), Instant::now());
        std::thread::sleep(idle);
        100.0 * (cpu_seconds() - c0) / t0.elapsed().as_secs_f64()
    });
    print_pingpong(args.json, backend_name, size, iters, &m, phases, idle_pct);
    Ok(())
}
