//! `kvxfer-bench`: transfer benchmark between two agents.
//!
//! With no arguments it starts a target process on loopback and sweeps block
//! sizes 4 KiB – 4 MiB as the initiator. `--listen` runs only the target
//! role, `--connect` only the initiator role, for runs across two hosts.
//! `kvxfer-bench kv` measures the KV-cache protocol (see `kv.rs`).

mod failures;
mod kv;
mod layerwise;
mod names;
mod pingpong;
mod plot;
mod storage;

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvxfer::{
    AgentConfig, Backend, MemoryDesc, MemoryDescs, MemoryType, PreparedTransfer, TransferAgent,
    TransferRequest, make_transfer_agent,
};

#[derive(Parser, Debug, Clone)]
#[command(version, about = "kvxfer transfer benchmark (loopback by default)")]
struct Args {
    #[command(subcommand)]
    command: Option<Sub>,
    /// Backend: auto, tcp, shm, rdma, fabric, inproc.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Operation: write or read.
    #[arg(long, default_value = "write", value_parser = ["write", "read"])]
    op: String,
    /// Block (descriptor) size, e.g. 4096, 64KiB, 1MiB. Repeat for several
    /// points. Default: the sweep 4 KiB, 16 KiB, ..., 4 MiB.
    #[arg(long = "block-size", value_parser = parse_size)]
    block_size: Vec<u64>,
    /// Descriptors per request. Default: 256, fewer for large blocks so a
    /// request stays within 64 MiB.
    #[arg(long)]
    batch: Option<u64>,
    /// Measured requests per point. Default: enough for about 1 GiB, at
    /// least 20 and at most 2000.
    #[arg(long)]
    iters: Option<u64>,
    /// Unmeasured requests before each point.
    #[arg(long, default_value_t = 5)]
    warmup: u64,
    /// Requests kept in flight (a new one is submitted as the oldest
    /// completes), as perftest keeps its work requests outstanding; 1
    /// waits for each request before the next.
    #[arg(long, default_value_t = 1)]
    depth: usize,
    /// End-to-end integrity on every request (`TransferRequest::
    /// with_integrity`: a CRC32C per piece, checked where it lands).
    #[arg(long)]
    integrity: bool,
    /// TCP streams per peer (default: the library's, 2).
    #[arg(long)]
    streams: Option<usize>,
    /// Threads copying one large shm request (default: the library's).
    #[arg(long)]
    shm_copy_threads: Option<usize>,
    /// The target's host memory is a shared pool (`SharedPool`, shared
    /// read-write): a same-host shm initiator maps it and copies with
    /// `memcpy` (`kvxfer_shm_pool_copies_total`).
    #[arg(long)]
    shared_pool: bool,
    /// Bytes per pinned buffer of the GPU staging rings, both sides
    /// (default: the library's).
    #[arg(long, value_parser = parse_size)]
    gpu_staging_chunk: Option<u64>,
    /// Pinned buffers per GPU staging ring, both sides (default: the
    /// library's).
    #[arg(long)]
    gpu_staging_slots: Option<usize>,
    /// One JSON object per measured point on stdout instead of a table.
    #[arg(long)]
    json: bool,
    /// Run only the target role, listening on ADDR (e.g. 0.0.0.0:7000).
    #[arg(long, conflicts_with = "connect")]
    listen: Option<SocketAddr>,
    /// Address to advertise to peers in target role (default: the bound one).
    #[arg(long, requires = "listen")]
    advertise: Option<String>,
    /// File holding the cluster secret both sides authenticate with
    /// (default: `KVXFER_SECRET_FILE`, `KVXFER_SECRET`). Needed to listen on
    /// a non-loopback address unless `--insecure`.
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
    /// Listen on a non-loopback address without a cluster secret: any
    /// process that reaches the port can read and write the region.
    #[arg(long)]
    insecure: bool,
    /// Encrypt every connection (`SecurityConfig::encrypt`: AES-128-GCM
    /// through the kernel's TLS). Needs a cluster secret; without one
    /// given, the initiator and the target it starts share a random one.
    #[arg(long)]
    encrypt: bool,
    /// Run only the initiator role against the target at ADDR (host:port),
    /// or, with `--metadata`, the target agent of that name.
    #[arg(long)]
    connect: Option<String>,
    /// A metadata store, `etcd://host:port[,host:port...]`: both roles
    /// publish themselves there, and `--connect NAME` finds the target by
    /// name (the target's name is `kvxfer-bench-target`).
    #[arg(long)]
    metadata: Option<String>,
    /// Size of the target's registered region, e.g. 256MiB.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    region_size: u64,
    /// Measure a single-thread memcpy of the same descriptors between two
    /// buffers of this process instead of transfers (the baseline for the
    /// intra-node backend).
    #[arg(long, conflicts_with_all = ["listen", "connect"])]
    memcpy: bool,
    /// RDMA device for the target process started on loopback (default: the
    /// same selection as the initiator: `KVXFER_RDMA_DEVICE`, else the first
    /// active device).
    #[arg(long)]
    target_rdma_device: Option<String>,
    /// Latency the way `ib_write_lat` measures it: two agents in this
    /// process (the second on `--target-rdma-device`) bounce one block
    /// (default 8 bytes) back and forth with WRITEs, each side spinning on
    /// its own memory for the other's write; reports half the round trip.
    #[arg(long, conflicts_with_all = ["listen", "connect", "memcpy"])]
    pingpong: bool,
    /// The same ping-pong driven through the verbs layer alone (one queue
    /// pair each way, created as the agent creates them, a post and a
    /// completion-queue poll per write): what the transport costs without
    /// the agent, to tell the library's share from soft-RoCE's.
    #[arg(long, conflicts_with_all = ["listen", "connect", "memcpy", "pingpong"])]
    pingpong_verbs: bool,
    /// The `--pingpong` and `--pingpong-verbs` round trips in one process,
    /// alternating blocks of 100: the agent's cost over the verbs layer,
    /// both measured in the same machine state.
    #[arg(long, conflicts_with_all = ["listen", "connect", "memcpy", "pingpong", "pingpong_verbs"])]
    pingpong_ab: bool,
    /// Ping-pongs: submit a request prepared once (`prepare_transfer`,
    /// then `submit_prepared` each round trip) instead of validating it
    /// on every `submit_transfer`. `--pingpong-ab` runs both.
    #[arg(long)]
    prepared: bool,
    /// Ping-pongs (`--pingpong`, `--pingpong-verbs`): the answering side
    /// runs in a child process, as `ib_write_lat` runs its two sides (and
    /// as two serving executors do), instead of a second thread of this
    /// one.
    #[arg(long, conflicts_with = "pingpong_ab")]
    two_process: bool,
    /// Internal: run the answering side of a `--two-process` ping-pong
    /// (`agent` or `verbs`), set up over stdin/stdout.
    #[arg(long, hide = true, value_parser = ["agent", "verbs"])]
    pong_child: Option<String>,
    /// Ping-pongs: run the two sides' threads on CPUs 0 and 1 (as
    /// `taskset -c 0` / `-c 1` would two perftest processes), so that the
    /// scheduler never puts both spinning sides on one CPU.
    #[arg(long)]
    pin: bool,
    /// Ping-pongs (`--pingpong`, `--pingpong-verbs`): also time where each
    /// round trip goes — in the submission (or post), waiting for the own
    /// completion, waiting for the answer — at four more clock reads a
    /// round trip on the initiating side and three on the answering one.
    /// Off by default: like `ib_write_lat`, a round trip then reads the
    /// clock once, on the initiating side.
    #[arg(long)]
    phases: bool,
    /// Ping-pongs: how many polls of its memory the thread waiting for the
    /// other side's WRITE makes between yields of its CPU (and clock reads
    /// for the timeout). Few (1024) where the transport's own threads need
    /// the CPU that thread spins on (a provider moving the target's data
    /// in the target process, `tcp` or `shm`, on a 2-core host); many
    /// under TCG, where a yield costs more than a round trip.
    #[arg(long, default_value_t = 1 << 16, value_parser = clap::value_parser!(u32).range(1..))]
    spin_yield: u32,
    /// `--pingpong`: seconds to measure the two idle agents' CPU use for
    /// after the round trips (`idle_cpu_pct`); 0 skips it.
    #[arg(long, default_value_t = 1.0)]
    idle_secs: f64,
    /// How RDMA progress threads wait for completions: events or poll
    /// (default: the library's).
    #[arg(long)]
    rdma_progress: Option<String>,
    /// RDMA queue pairs per remote agent (default: the library's).
    #[arg(long)]
    rdma_qps: Option<usize>,
    /// RDMA local ACK timeout exponent, 4.096 µs × 2^n (default: the
    /// library's; the spawned target gets it too).
    #[arg(long)]
    rdma_ack_timeout: Option<u8>,
    /// RDMA bytes in flight per remote agent, e.g. 16MiB (default: the
    /// library's).
    #[arg(long, value_parser = parse_size)]
    rdma_inflight: Option<u64>,
    /// The memory moved. `dram` or `vram` (GPU memory on `--gpu`): both
    /// sides' memory, unless `--src-memory` or `--dst-memory` says
    /// otherwise; with `--memcpy`, `vram` times device-to-device copies.
    /// Or the destination (WRITE) or source (READ) in this agent's own
    /// storage instead of a peer's memory: `file:PATH` (created, opened
    /// with O_DIRECT unless `--buffered`) or `blk:DEVICE` (a block device,
    /// O_DIRECT). Compare with `fio --ioengine=io_uring --direct=1` at the
    /// same block size and `--iodepth` = `--batch` (benches/storage_vs_fio.sh).
    /// Or `obj:BUCKET[/PREFIX]`: `--batch` objects in an S3 store (endpoint
    /// and credentials from `KVXFER_S3_ENDPOINT` and the AWS variables),
    /// each descriptor one whole object, `PREFIX/0`, `PREFIX/1`, ... (READ
    /// reads objects a WRITE made; benches/obj_vs_rclone.sh).
    #[arg(long, conflicts_with_all = ["pingpong"])]
    memory: Option<String>,
    /// The initiator's memory: dram or vram (default: `--memory`'s, else
    /// dram).
    #[arg(long, value_parser = ["dram", "vram"])]
    src_memory: Option<String>,
    /// The target's memory: dram or vram (default: `--memory`'s, else
    /// dram).
    #[arg(long, value_parser = ["dram", "vram"])]
    dst_memory: Option<String>,
    /// The GPU (device ordinal) of `vram` memory.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// `--memory file:PATH`: through the page cache instead of O_DIRECT.
    #[arg(long, requires = "memory")]
    buffered: bool,
    /// `--memory`: the storage I/O engine (auto, io_uring, psync).
    #[arg(long, requires = "memory", default_value = "auto")]
    storage_io: String,
    /// `--memory`: the storage belongs to a second agent of this process, a
    /// peer reached over TCP on loopback, which reads and writes it on this
    /// agent's behalf (a peer's storage through its agent).
    #[arg(long, requires = "memory")]
    storage_peer: bool,
    /// Internal: in target role, exit when standard input closes.
    #[arg(long, hide = true)]
    exit_with_parent: bool,
    /// Also draw the sweep (GB/s against block size) to this SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

#[derive(clap::Subcommand, Debug, Clone)]
enum Sub {
    /// One request's KV cache between a context and a generation executor
    /// (every rank an agent in this process), against the raw agent
    /// bandwidth for the same bytes.
    Kv(kv::KvArgs),
    /// Peers found by name in etcd: resolve-and-connect (lookup, side
    /// channel, first transfer) to new peers created in turn, and many
    /// agents publishing at once.
    Names(names::NamesArgs),
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("bad size unit in {s:?} (use B, KiB, MiB, GiB)")),
    };
    n.checked_mul(mult)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("size {s:?} out of range"))
}

fn human(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

/// `etcd://host:port[,host:port...]` as the store's configuration.
pub(crate) fn etcd_config(url: &str) -> Result<kvxfer::EtcdConfig> {
    let eps = url
        .strip_prefix("etcd://")
        .with_context(|| format!("--metadata {url:?}: expected etcd://host:port[,host:port]"))?;
    Ok(kvxfer::EtcdConfig::new(eps.split(',').map(str::trim)))
}

/// A random cluster secret (hex) for the agents of this run: this
/// process's, and its target child's (given in its environment).
fn run_secret() -> &'static str {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| {
        kvxfer::auth::random_bytes::<24>()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    })
}

/// Whether a cluster secret was given (`--secret-file`, or the
/// environment).
fn secret_given(args: &Args) -> bool {
    args.secret_file.is_some()
        || ["KVXFER_SECRET_FILE", "KVXFER_SECRET"]
            .iter()
            .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()))
}

fn config(name: &str, args: &Args) -> AgentConfig {
    let mut cfg = AgentConfig::new(name).with_insecure(args.insecure);
    if let Some(url) = &args.metadata {
        match etcd_config(url) {
            Ok(e) => cfg = cfg.with_etcd(e),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        }
    }
    if let Some(path) = &args.secret_file {
        match kvxfer::Credential::from_file(path) {
            Ok(c) => cfg = cfg.with_credential(c),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        }
    }
    if args.encrypt {
        cfg = cfg.with_encryption(true);
        if !secret_given(args) {
            match kvxfer::Credential::new(run_secret().as_bytes().to_vec()) {
                Ok(c) => cfg = cfg.with_credential(c),
                Err(e) => {
                    eprintln!("{e}");
                    std::process::exit(2);
                }
            }
        }
    }
    if let Some(n) = args.streams {
        cfg = cfg.with_streams_per_peer(n);
    }
    if let Some(n) = args.shm_copy_threads {
        cfg = cfg.with_shm_copy_threads(n);
    }
    if args.gpu_staging_chunk.is_some() || args.gpu_staging_slots.is_some() {
        let chunk = args
            .gpu_staging_chunk
            .map_or(cfg.gpu.staging_chunk, |c| c as usize);
        let slots = args.gpu_staging_slots.unwrap_or(cfg.gpu.staging_slots);
        cfg = cfg.with_gpu_staging(chunk, slots);
    }
    if let Some(n) = args.rdma_qps {
        cfg = cfg.with_rdma_qps_per_peer(n);
    }
    if let Some(n) = args.rdma_ack_timeout {
        cfg = cfg.with_rdma_ack_timeout(n);
    }
    if let Some(n) = args.rdma_inflight {
        cfg = cfg.with_rdma_max_inflight(n);
    }
    if let Some(p) = &args.rdma_progress {
        match p.parse() {
            Ok(p) => cfg = cfg.with_rdma_progress(p),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        }
    }
    cfg
}

/// A registered-for-life buffer on pages of its own ([`Pages`]), filled
/// with a pattern.
struct Buffer {
    mem: Pages,
}

/// Words in whole pages of their own, page-aligned, as perftest allocates
/// its buffers: two buffers never share a cache line, so a side spinning on
/// its block does not share one with the block the other side writes from
/// (side by side in the heap, a ping-pong's four 8-byte blocks sat in one
/// line). Measured in the soft-RoCE guest it made no difference beyond the
/// noise (the git history of `docs/benchmarks.md`, tenth session): one confound less against
/// perftest, not a speed-up.
struct Pages {
    ptr: std::ptr::NonNull<u64>,
    len: usize,
    layout: std::alloc::Layout,
}

// SAFETY: `Pages` owns its allocation, as a `Vec<u64>` would.
unsafe impl Send for Pages {}
// SAFETY: shared access only reads (through `Deref`).
unsafe impl Sync for Pages {}

impl Pages {
    const PAGE: usize = 4096;

    /// `len` words, each set to `fill`.
    fn new(len: usize, fill: u64) -> Self {
        let bytes = (len * 8).max(1).next_multiple_of(Self::PAGE);
        let layout = std::alloc::Layout::from_size_align(bytes, Self::PAGE)
            .expect("buffer size overflows a layout");
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) }.cast::<u64>();
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout);
        };
        for i in 0..len {
            // SAFETY: `i` words lie inside the allocation (`bytes >= 8 * len`).
            unsafe { ptr.as_ptr().add(i).write(fill) };
        }
        Self { ptr, len, layout }
    }
}

impl std::ops::Deref for Pages {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        // SAFETY: the first `len` words are allocated and initialised.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for Pages {
    fn deref_mut(&mut self) -> &mut [u64] {
        // SAFETY: as in `deref`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), self.layout) };
    }
}

impl Buffer {
    fn new(len: u64) -> Self {
        Self {
            mem: Pages::new(len.div_ceil(8) as usize, 0x5a5a_5a5a_5a5a_5a5a),
        }
    }
    fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }
    fn desc(&self) -> MemoryDescs {
        MemoryDescs::new(
            MemoryType::Dram,
            vec![MemoryDesc::new(self.addr(), (self.mem.len() * 8) as u64, 0)],
        )
    }
}

/// A registered buffer of host or GPU memory.
enum Mem {
    Host(Buffer),
    Gpu(kvxfer::gpu::DeviceBuffer),
    /// Host memory in a shared pool (the target's, `--shared-pool`).
    Pool(kvxfer::SharedPool),
}

impl Mem {
    /// `len` bytes of `kind` (`dram` or `vram`) memory.
    fn new(kind: MemoryType, len: u64, gpu: u32) -> Result<Self> {
        Ok(match kind {
            MemoryType::Vram => {
                let b = kvxfer::gpu::DeviceBuffer::new(gpu, len)
                    .context("allocating GPU memory (--memory vram)")?;
                // Touched once, as host memory is by `Buffer::new`.
                let fill = vec![0x5au8; (8u64 << 20).min(len) as usize];
                let mut at = 0;
                while at < len {
                    let n = (len - at).min(fill.len() as u64);
                    b.write(at, &fill[..n as usize])?;
                    at += n;
                }
                Mem::Gpu(b)
            }
            _ => Mem::Host(Buffer::new(len)),
        })
    }

    fn mem_type(&self) -> MemoryType {
        match self {
            Mem::Host(_) | Mem::Pool(_) => MemoryType::Dram,
            Mem::Gpu(_) => MemoryType::Vram,
        }
    }

    fn device(&self) -> u32 {
        match self {
            Mem::Host(_) | Mem::Pool(_) => 0,
            Mem::Gpu(b) => b.device(),
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Mem::Host(b) => b.addr(),
            Mem::Gpu(b) => b.addr(),
            Mem::Pool(p) => p.as_ptr() as u64,
        }
    }

    fn desc(&self) -> MemoryDescs {
        match self {
            Mem::Host(b) => b.desc(),
            Mem::Pool(p) => p.descs(),
            Mem::Gpu(b) => MemoryDescs::new(
                MemoryType::Vram,
                vec![MemoryDesc::new(b.addr(), b.len(), b.device())],
            ),
        }
    }
}

/// The memory type a `dram`/`vram` option names.
fn mem_kind(s: Option<&str>) -> MemoryType {
    match s {
        Some("vram") => MemoryType::Vram,
        _ => MemoryType::Dram,
    }
}

impl Args {
    /// `--memory` when it names host or GPU memory (not storage).
    fn memory_kind(&self) -> Option<&str> {
        self.memory
            .as_deref()
            .filter(|m| matches!(*m, "dram" | "vram"))
    }

    /// The initiator's memory type.
    fn src_kind(&self) -> MemoryType {
        mem_kind(self.src_memory.as_deref().or(self.memory_kind()))
    }

    /// The target's memory type.
    fn dst_kind(&self) -> MemoryType {
        mem_kind(self.dst_memory.as_deref().or(self.memory_kind()))
    }
}

fn run_target(args: &Args, listen: SocketAddr) -> Result<()> {
    let backend: Backend = args.backend.parse()?;
    let mut cfg = config("kvxfer-bench-target", args).with_listen(listen);
    if let Some(a) = &args.advertise {
        cfg = cfg.with_advertise(a.clone());
    }
    let agent = make_transfer_agent(backend, cfg)?;
    let buf = if args.shared_pool {
        let len = usize::try_from(args.region_size)?;
        let pool = kvxfer::SharedPool::new(len)?;
        // SAFETY: the pool's bytes are this process's alone until it is
        // registered below.
        unsafe { std::ptr::write_bytes(pool.as_ptr(), 0x5a, len) };
        agent.register_shared_pool(&pool, kvxfer::PoolAccess::ReadWrite)?;
        Mem::Pool(pool)
    } else {
        Mem::new(args.dst_kind(), args.region_size, args.gpu)?
    };
    if !args.shared_pool {
        // SAFETY: `buf` lives until after the agent is dropped at the end
        // of this function; this process never touches it otherwise.
        unsafe { agent.register_memory(&buf.desc())? };
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "LISTENING {}", agent.local_connection_info())?;
    out.flush()?;
    drop(out);
    if args.exit_with_parent {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink)? > 0 {}
    } else {
        eprintln!(
            "target serving {} on {}; Ctrl-C to stop",
            human(args.region_size),
            agent.local_connection_info()
        );
        loop {
            std::thread::park();
        }
    }
    drop(agent);
    drop(buf);
    Ok(())
}

/// Starts `kvxfer-bench --listen` as a child process on loopback.
fn spawn_target(args: &Args, region: u64) -> Result<(Child, String)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    if let Some(d) = &args.target_rdma_device {
        cmd.env("KVXFER_RDMA_DEVICE", d);
    }
    if let Some(n) = args.rdma_ack_timeout {
        cmd.env("KVXFER_RDMA_ACK_TIMEOUT", n.to_string());
    }
    if let Some(p) = &args.secret_file {
        cmd.arg("--secret-file").arg(p);
    }
    if args.encrypt {
        cmd.arg("--encrypt");
        if !secret_given(args) {
            cmd.env("KVXFER_SECRET", run_secret());
        }
    }
    if args.dst_kind() == MemoryType::Vram {
        cmd.args(["--dst-memory", "vram", "--gpu", &args.gpu.to_string()]);
    }
    if let Some(c) = args.gpu_staging_chunk {
        cmd.args(["--gpu-staging-chunk", &c.to_string()]);
    }
    if let Some(n) = args.gpu_staging_slots {
        cmd.args(["--gpu-staging-slots", &n.to_string()]);
    }
    if args.shared_pool {
        cmd.arg("--shared-pool");
    }
    let mut child = cmd
        .args([
            "--listen",
            "127.0.0.1:0",
            "--exit-with-parent",
            "--backend",
            &args.backend,
            "--region-size",
            &region.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the target process")?;
    let stdout = child.stdout.take().context("target stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let Some(conn) = line.trim().strip_prefix("LISTENING ") else {
        let _ = child.kill();
        bail!("target process did not start: {line:?}");
    };
    Ok((child, conn.to_string()))
}

struct Point {
    block: u64,
    batch: u64,
    iters: u64,
}

struct Measured {
    gb_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    mean_us: f64,
    /// CPU time of this process over wall time (initiator side only).
    cpu_cores: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Where a run's requests go: the remote agent and its region (host
/// memory of a peer, or the agent's own storage).
struct Target {
    remote: String,
    mem_type: MemoryType,
    base: u64,
    device_id: u32,
    /// OBJ: descriptor `i` is object `objects[i]` from its start (a
    /// descriptor moves its object whole), instead of `base + i * block`
    /// of `device_id`.
    objects: Option<Vec<u32>>,
}

fn measure(
    agent: &dyn TransferAgent,
    target: &Target,
    src: &Mem,
    args: &Args,
    pt: &Point,
    bar: &ProgressBar,
) -> Result<Measured> {
    let local = MemoryDescs::new(
        src.mem_type(),
        (0..pt.batch)
            .map(|i| MemoryDesc::new(src.addr() + i * pt.block, pt.block, src.device()))
            .collect(),
    );
    let dst = MemoryDescs::new(
        target.mem_type,
        (0..pt.batch)
            .map(|i| match &target.objects {
                Some(objects) => MemoryDesc::new(0, pt.block, objects[i as usize]),
                None => MemoryDesc::new(target.base + i * pt.block, pt.block, target.device_id),
            })
            .collect(),
    );
    let remote = target.remote.as_str();
    let make = || {
        let r = match args.op.as_str() {
            "read" => TransferRequest::read(local.clone(), dst.clone(), remote),
            _ => TransferRequest::write(local.clone(), dst.clone(), remote),
        };
        if args.integrity {
            r.with_integrity()
        } else {
            r
        }
    };
    let timeout = Duration::from_secs(120);
    for _ in 0..args.warmup {
        agent.submit_transfer(&make())?.wait_success(timeout)?;
    }
    let mut lat = Vec::with_capacity(pt.iters as usize);
    let req = make();
    let depth = args.depth.max(1);
    let mut inflight = std::collections::VecDeque::with_capacity(depth);
    let mut finish = |(t, st): (Instant, kvxfer::TransferStatus)| -> Result<()> {
        st.wait_success(timeout)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        bar.inc(1);
        Ok(())
    };
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    for _ in 0..pt.iters {
        if inflight.len() == depth {
            finish(inflight.pop_front().expect("depth >= 1"))?;
        }
        let t = Instant::now();
        inflight.push_back((t, agent.submit_transfer(&req)?));
    }
    for r in inflight {
        finish(r)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut m = summarize(elapsed, (pt.block * pt.batch * pt.iters) as f64, lat);
    m.cpu_cores = (cpu_seconds() - cpu0) / elapsed;
    Ok(m)
}

/// Copies `batch` blocks from `src` to `dst` with `memcpy`, `iters` times.
fn measure_memcpy(args: &Args, pt: &Point) -> Measured {
    let src = Buffer::new(pt.block * pt.batch);
    let mut dst = Buffer::new(pt.block * pt.batch);
    let (s, d) = (
        src.mem.as_ptr().cast::<u8>(),
        dst.mem.as_mut_ptr().cast::<u8>(),
    );
    let copy_all = || {
        for i in 0..pt.batch {
            let off = (i * pt.block) as usize;
            // SAFETY: both buffers hold `block * batch` bytes, so every
            // block lies inside them; they do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(s.add(off), d.add(off), pt.block as usize) };
        }
        std::hint::black_box(d);
    };
    for _ in 0..args.warmup {
        copy_all();
    }
    let mut lat = Vec::with_capacity(pt.iters as usize);
    let start = Instant::now();
    for _ in 0..pt.iters {
        let t = Instant::now();
        copy_all();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    summarize(
        start.elapsed().as_secs_f64(),
        (pt.block * pt.batch * pt.iters) as f64,
        lat,
    )
}

/// Device-to-device copies of the same descriptors between two GPU buffers
/// of this process (the baseline for GPU memory between processes).
fn measure_device_copy(args: &Args, pt: &Point) -> Result<Measured> {
    let len = pt.block * pt.batch;
    let (src, dst) = (
        Mem::new(MemoryType::Vram, len, args.gpu)?,
        Mem::new(MemoryType::Vram, len, args.gpu)?,
    );
    let (Mem::Gpu(src), Mem::Gpu(dst)) = (&src, &dst) else {
        bail!("GPU buffers expected");
    };
    let pieces: Vec<(u64, u64, u64)> = (0..pt.batch)
        .map(|i| (i * pt.block, i * pt.block, pt.block))
        .collect();
    let copy_all = || -> Result<()> { Ok(dst.copy_pieces(src, &pieces)?) };
    for _ in 0..args.warmup {
        copy_all()?;
    }
    let mut lat = Vec::with_capacity(pt.iters as usize);
    let start = Instant::now();
    for _ in 0..pt.iters {
        let t = Instant::now();
        copy_all()?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(summarize(
        start.elapsed().as_secs_f64(),
        (pt.block * pt.batch * pt.iters) as f64,
        lat,
    ))
}

fn summarize(elapsed: f64, bytes: f64, mut lat: Vec<f64>) -> Measured {
    let mean_us = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
    lat.sort_by(|a, b| a.total_cmp(b));
    Measured {
        gb_per_s: bytes / elapsed / 1e9,
        p50_us: percentile(&lat, 0.50),
        p99_us: percentile(&lat, 0.99),
        mean_us,
        cpu_cores: 0.0,
    }
}

fn plan(args: &Args) -> Vec<Point> {
    let blocks = if args.block_size.is_empty() {
        (0..6).map(|i| 4096u64 << (2 * i)).collect()
    } else {
        args.block_size.clone()
    };
    blocks
        .into_iter()
        .map(|block| {
            let batch = args
                .batch
                .unwrap_or_else(|| (64u64 << 20).div_euclid(block).clamp(1, 256));
            let per_iter = block * batch;
            let iters = args
                .iters
                .unwrap_or_else(|| (1u64 << 30).div_ceil(per_iter).clamp(20, 2000));
            Point {
                block,
                batch,
                iters,
            }
        })
        .collect()
}

fn run_initiator(args: &Args, conn: &str) -> Result<()> {
    let backend: Backend = args.backend.parse()?;
    let points = plan(args);
    let need = points.iter().map(|p| p.block * p.batch).max().unwrap_or(0);
    let agent = make_transfer_agent(backend, config("kvxfer-bench-initiator", args))?;
    let src = Mem::new(args.src_kind(), need, args.gpu)?;
    // SAFETY: `src` outlives the agent (dropped first, below) and is only
    // touched by transfers.
    unsafe { agent.register_memory(&src.desc())? };
    let remote = if args.metadata.is_some() {
        agent.load_remote_agent_by_name(conn)?;
        conn.to_owned()
    } else {
        agent.load_remote_agent_by_connection(conn)?
    };
    let desc = agent.remote_agent_desc(&remote)?;
    let dst_kind = args.dst_kind();
    let region = desc
        .regions
        .iter()
        .find(|r| r.mem_type == dst_kind)
        .with_context(|| format!("target exports no {dst_kind} region"))?;
    if region.desc.len < need {
        bail!(
            "target region is {} but the plan needs {}; raise the target's --region-size",
            human(region.desc.len),
            human(need)
        );
    }
    let target = Target {
        remote,
        mem_type: dst_kind,
        base: region.desc.addr,
        device_id: region.desc.device_id,
        objects: None,
    };
    run_points(args, agent.as_ref(), &target, &src, &points)?;
    drop(agent);
    Ok(())
}

/// Measures every point of the plan against `target` and prints them.
fn run_points(
    args: &Args,
    agent: &dyn TransferAgent,
    target: &Target,
    src: &Mem,
    points: &[Point],
) -> Result<()> {
    let total: u64 = points.iter().map(|p| p.iters).sum();
    let bar = if args.json || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new(total);
        b.set_style(
            ProgressStyle::with_template("{spinner} [{bar:40}] {pos}/{len} {msg}")
                .expect("static template")
                .progress_chars("=> "),
        );
        b
    };
    // The data path actually used (auto picks shm on one host; storage is
    // the agent's own, or a peer's through it over TCP; objects are the
    // agent's own).
    let backend_name = match target.mem_type {
        MemoryType::Obj => "obj",
        MemoryType::File | MemoryType::Blk if target.remote == agent.name() => "storage",
        MemoryType::File | MemoryType::Blk => "tcp",
        _ => agent.remote_transport(&target.remote)?,
    };
    let streams = args
        .streams
        .unwrap_or(AgentConfig::new("defaults").tcp.streams_per_peer);
    let mut rows = Vec::new();
    for pt in points {
        bar.set_message(format!("{} × {}", human(pt.block), pt.batch));
        let m = measure(agent, target, src, args, pt, &bar)?;
        if args.json {
            println!(
                "{{\"backend\":\"{backend_name}\",\"op\":\"{}\",\"block_size\":{},\"batch\":{},\"iters\":{},\"streams\":{},\"bytes_per_request\":{},\"gb_per_s\":{:.4},\"p50_us\":{:.1},\"p99_us\":{:.1},\"mean_us\":{:.1},\"cpu_cores\":{:.3}}}",
                args.op,
                pt.block,
                pt.batch,
                pt.iters,
                streams,
                pt.block * pt.batch,
                m.gb_per_s,
                m.p50_us,
                m.p99_us,
                m.mean_us,
                m.cpu_cores
            );
        }
        rows.push((pt, m));
    }
    bar.finish_and_clear();
    if let Some(path) = &args.plot {
        let pts: Vec<(u64, f64)> = rows.iter().map(|(pt, m)| (pt.block, m.gb_per_s)).collect();
        let title = format!("kvxfer-bench over {backend_name}: {} bandwidth", args.op);
        plot::sweep(path, &title, &pts)?;
    }
    if !args.json {
        println!(
            "{:<8} {:<6} {:>9} {:>6} {:>6} {:>9} {:>10} {:>10}",
            "backend", "op", "block", "batch", "iters", "GB/s", "p50 µs", "p99 µs"
        );
        for (pt, m) in rows {
            println!(
                "{:<8} {:<6} {:>9} {:>6} {:>6} {:>9.3} {:>10.1} {:>10.1}",
                backend_name,
                args.op,
                human(pt.block),
                pt.batch,
                pt.iters,
                m.gb_per_s,
                m.p50_us,
                m.p99_us
            );
        }
        println!("(GB/s = 10^9 bytes/s; latency is per request: submit to completion)");
    }
    Ok(())
}

/// CPU time (user + system) this process has used, in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the zeroed struct we pass.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVXFER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if let Some(Sub::Kv(k)) = &args.command {
        return kv::run(k);
    }
    if let Some(Sub::Names(n)) = &args.command {
        return names::run(n);
    }
    if args.memcpy {
        for pt in plan(&args) {
            let m = if args.src_kind() == MemoryType::Vram {
                measure_device_copy(&args, &pt)?
            } else {
                measure_memcpy(&args, &pt)
            };
            println!(
                "{{\"backend\":\"{}\",\"op\":\"copy\",\"block_size\":{},\"batch\":{},\"iters\":{},\"bytes_per_request\":{},\"gb_per_s\":{:.4},\"p50_us\":{:.1},\"p99_us\":{:.1},\"mean_us\":{:.1}}}",
                if args.src_kind() == MemoryType::Vram {
                    "device-copy"
                } else {
                    "memcpy"
                },
                pt.block,
                pt.batch,
                pt.iters,
                pt.block * pt.batch,
                m.gb_per_s,
                m.p50_us,
                m.p99_us,
                m.mean_us
            );
        }
        return Ok(());
    }
    pingpong::set_spin_yield(args.spin_yield);
    if let Some(kind) = &args.pong_child {
        return pingpong::run_pong_child(&args, kind);
    }
    if args.pingpong {
        return pingpong::run_pingpong(&args);
    }
    if args.pingpong_verbs {
        return pingpong::run_pingpong_verbs(&args);
    }
    if args.pingpong_ab {
        return pingpong::run_pingpong_ab(&args);
    }
    if let Some(memory) = args
        .memory
        .as_ref()
        .filter(|_| args.memory_kind().is_none())
    {
        return storage::run(&args, memory);
    }
    if let Some(listen) = args.listen {
        return run_target(&args, listen);
    }
    if let Some(conn) = &args.connect {
        return run_initiator(&args, conn);
    }
    let need = plan(&args)
        .iter()
        .map(|p| p.block * p.batch)
        .max()
        .unwrap_or(0);
    let (mut child, conn) = spawn_target(&args, need)?;
    let result = run_initiator(&args, &conn);
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if child.try_wait()?.is_some() {
            return result;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    result
}
