//! Agent configuration: what every agent has (name, addresses, timeouts),
//! then one group per data path and one each for security and limits.
//!
//! ```
//! use std::time::Duration;
//! use kvxfer::AgentConfig;
//!
//! let mut cfg = AgentConfig::new("ctx-0")
//!     .with_io_timeout(Duration::from_secs(10))
//!     .with_streams_per_peer(4);
//! cfg.rdma.qps_per_peer = 2;
//! cfg.validate().unwrap();
//! ```

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use crate::agent::TransportKind;
use crate::auth::Credential;
use crate::error::Error;
use crate::memory::MemoryType;

/// Agent configuration. Construct with [`AgentConfig::new`] and adjust with
/// the `with_*` methods, or set the fields of its groups.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct AgentConfig {
    /// The agent's name, unique among communicating agents.
    pub name: String,
    /// Address the side-channel/data listener binds (default
    /// `127.0.0.1:0`, an ephemeral loopback port).
    pub listen: SocketAddr,
    /// Address advertised to peers, when it differs from the bound one
    /// (e.g. listening on `0.0.0.0`).
    pub advertise: Option<String>,
    /// Bound on connection establishment, including the hello exchange
    /// (default 5 s).
    pub connect_timeout: Duration,
    /// A connection with requests outstanding that moves no byte for this
    /// long is declared dead and its requests fail (default 30 s).
    pub io_timeout: Duration,
    /// The TCP data path.
    pub tcp: TcpConfig,
    /// The cross-memory (shm) data path.
    pub shm: ShmConfig,
    /// The RDMA data path.
    pub rdma: RdmaConfig,
    /// The libfabric data path.
    pub fabric: FabricConfig,
    /// GPU memory (VRAM).
    pub gpu: GpuConfig,
    /// Who may talk to the agent.
    pub security: SecurityConfig,
    /// Bounds on what peers and the application can make the agent hold.
    pub limits: Limits,
    /// Transports required per memory type: a request whose memory is of
    /// such a type, to a peer this agent reaches another way, fails with
    /// [`Error::TransportRequired`] instead of moving over the other path
    /// (an `auto` agent otherwise falls back to TCP, logging why). Empty
    /// by default.
    pub required_transports: Vec<(MemoryType, TransportKind)>,
    /// The I/O engine of the agent's storage (FILE and BLK regions).
    /// `Auto` (the default): `KVXFER_STORAGE_IO` (`io_uring`, `psync`)
    /// when set, else `io_uring` where the kernel allows it, else
    /// `pread`/`pwrite`.
    pub storage_io: crate::storage::StorageIo,
    /// Where the agent publishes itself and finds peers by name
    /// (`Direct`, the default: no store, unless `KVXFER_ETCD` names an
    /// etcd cluster; see [`crate::metadata`]).
    pub metadata: crate::metadata::Metadata,
    /// What the agent measures, and where it serves the figures
    /// ([`crate::metrics`]).
    pub metrics: crate::metrics::MetricsConfig,
}

/// The TCP data path.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TcpConfig {
    /// TCP streams per remote agent (default 2, chosen by measurement: see
    /// the git history of `docs/benchmarks.md`). Small requests use only the first stream.
    pub streams_per_peer: usize,
    /// Largest data segment; larger descriptors are split (default 4 MiB).
    pub segment_size: u64,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            streams_per_peer: 2,
            segment_size: 4 << 20,
        }
    }
}

/// GPU memory (VRAM) on paths that cannot reach it directly.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct GpuConfig {
    /// Bytes per pinned host buffer of a staging ring (default 4 MiB, a
    /// multiple of 4 KiB): VRAM moved over TCP, or to and from storage, is
    /// copied through such buffers (device→host before sending or
    /// writing, host→device after receiving or reading), chunk by chunk.
    pub staging_chunk: usize,
    /// Buffers per ring (default 3, at least 2): the copies of the next
    /// chunks run while the current one is on the wire or the disk. Each
    /// thread that moves VRAM that way (a stream's sender or reader, a
    /// target's connection, the agent's GPU storage worker) has one ring
    /// per device, made on first use.
    pub staging_slots: usize,
}

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            staging_chunk: 4 << 20,
            staging_slots: 3,
        }
    }
}

impl GpuConfig {
    /// The staging ring's shape.
    pub(crate) fn shape(&self) -> crate::gpu::StagingShape {
        crate::gpu::StagingShape {
            chunk: self.staging_chunk,
            slots: self.staging_slots,
        }
    }
}

/// The cross-memory (shm) data path.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ShmConfig {
    /// Threads that copy one large cross-memory request in parallel, the
    /// submitting link's thread included (default: the number of CPUs, at
    /// most 4). Requests under 2 MiB always use one.
    pub copy_threads: usize,
    /// Cross-memory copies are done by whichever side's memory is the
    /// contiguous one (default true): a request whose remote pieces are
    /// much more scattered than its local ones is copied by the target
    /// (which asks nothing of the initiator's layout), because the kernel
    /// pins the *other* process's pages one iovec at a time. An agent with
    /// `false` neither asks its targets to copy nor copies for initiators
    /// (its threads never spend time on other agents' requests).
    pub delegate: bool,
    /// Shared pools (default true): this agent maps the pools that
    /// same-host targets share with it ([`crate::pool`]) and copies into
    /// and out of them itself, and hands its own registered pools to the
    /// initiators that ask. `false`: it does neither; pools move as any
    /// host memory.
    pub pools: bool,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            copy_threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(4),
            delegate: true,
            pools: true,
        }
    }
}

/// The libfabric data path (backend `fabric`). A provider that registers
/// memory with a NIC (`verbs`, `efa`, …) is used only with libfabric's
/// registration cache off (`FI_MR_CACHE_MAX_COUNT=0` in the environment):
/// the cache would keep deregistered memory open to remote writes.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct FabricConfig {
    /// The provider, as libfabric names it (`efa`, `verbs;ofi_rxm`,
    /// `tcp;ofi_rxm`, …); `None`: `KVXFER_FABRIC_PROVIDER`, else the first
    /// provider with reliable-datagram endpoints and RMA.
    pub provider: Option<String>,
    /// The domain (NIC) by name, or several separated by commas (rails: the
    /// agent opens an endpoint on each, registers its regions with each,
    /// and spreads every request over them, see `docs/architecture.md`; at
    /// most 16); `None`: `KVXFER_FABRIC_DOMAIN`, else, with several RDMA
    /// devices, the domains of those nearest GPU `near_gpu`: one rail on
    /// each device under its PCIe switch when the provider has domains of
    /// several (`efa`: `rdmap16s27-rdm` for device `rdmap16s27`), else one
    /// on the nearest (same switch, else same NUMA node) when the provider
    /// has a domain of it, else the provider's first.
    pub domain: Option<String>,
    /// The GPU (device ordinal) whose nearest NIC the agent takes when no
    /// domain is named (default 0; `None`: never look).
    pub near_gpu: Option<u32>,
    /// Bytes of posted, uncompleted operations on the agent's endpoint, all
    /// peers together (one operation may always be posted), of which one
    /// peer may hold half; what is over waits in the agent, where an abort
    /// still stops it. Default [`DEFAULT_RDMA_MAX_INFLIGHT`]; at least
    /// 64 KiB.
    pub max_inflight: u64,
    /// How long a lane of a link of several (a pair of this agent's rail
    /// and a peer's) stays out of service after an operation failed on it
    /// and moved to another lane, counted from the last lane of the link
    /// to fail; then it is tried again. Default
    /// [`DEFAULT_FABRIC_LANE_REST`].
    pub lane_rest: Duration,
}

impl Default for FabricConfig {
    fn default() -> Self {
        Self {
            provider: None,
            domain: None,
            near_gpu: Some(0),
            max_inflight: DEFAULT_RDMA_MAX_INFLIGHT,
            lane_rest: DEFAULT_FABRIC_LANE_REST,
        }
    }
}

/// Default of [`FabricConfig::lane_rest`]: 10 s, long enough that a lane
/// still failing costs its link's requests one moved operation per 10 s,
/// short enough that a path that flapped is back in use soon after.
pub const DEFAULT_FABRIC_LANE_REST: Duration = Duration::from_secs(10);

/// The RDMA data path.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RdmaConfig {
    /// RDMA device by name (e.g. `mlx5_0`); `None`: `KVXFER_RDMA_DEVICE`,
    /// else, with several devices, the one nearest GPU `near_gpu` (same
    /// PCIe switch, else same NUMA node), else the first device with an
    /// active port.
    pub device: Option<String>,
    /// The GPU (device ordinal) whose nearest RDMA device the agent takes
    /// when several exist and none is named (default 0; `None`: never
    /// look).
    pub near_gpu: Option<u32>,
    /// GID index on that device's port; `None`: `KVXFER_RDMA_GID_INDEX`,
    /// else the port's first RoCE v2 GID, else 0.
    pub gid_index: Option<u32>,
    /// How the RDMA progress thread waits for completions (default
    /// [`RdmaProgress::Adaptive`], chosen by measurement: see
    /// the git history of `docs/benchmarks.md`). Threads waiting on a request poll the
    /// completion queue themselves either way.
    pub progress: RdmaProgress,
    /// Reliable-connected queue pairs per remote agent (default 1, at most
    /// 16). With several, a request's work requests are spread over them
    /// (for paths and ports a single flow does not use); a sync message
    /// still follows all of the data before it.
    pub qps_per_peer: usize,
    /// Local ACK timeout of RDMA queue pairs, as the verbs exponent: a
    /// requester retransmits after 4.096 µs × 2^n without an
    /// acknowledgement, 7 times, then the queue pair fails. `None`:
    /// `KVXFER_RDMA_ACK_TIMEOUT`, else 14 (≈ 67 ms, as perftest). Raise it on
    /// fabrics (or emulators) slow enough that 67 ms fires while packets are
    /// still on their way: each firing resends everything unacknowledged.
    pub ack_timeout: Option<u8>,
    /// Whether incoming RDMA connections share one receive queue and one
    /// receive thread (default `true`). Off, or on a device without
    /// shared receive queues, each connection posts its own 64 receive
    /// buffers and runs its own thread.
    pub srq: bool,
    /// Bytes of posted, uncompleted RDMA work requests per remote agent,
    /// shared equally by its queue pairs (each may always have one work
    /// request posted). Default [`DEFAULT_RDMA_MAX_INFLIGHT`]; at least
    /// 64 KiB.
    pub max_inflight: u64,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            device: None,
            gid_index: None,
            near_gpu: Some(0),
            progress: RdmaProgress::default(),
            qps_per_peer: 1,
            ack_timeout: None,
            srq: true,
            max_inflight: DEFAULT_RDMA_MAX_INFLIGHT,
        }
    }
}

impl RdmaConfig {
    /// The local ACK timeout exponent in effect: the field, else
    /// `KVXFER_RDMA_ACK_TIMEOUT`, else [`crate::verbs::DEFAULT_ACK_TIMEOUT`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when either is outside 1..=31 or the
    /// variable is not a number.
    pub fn effective_ack_timeout(&self) -> Result<u8, Error> {
        let exp = match self.ack_timeout {
            Some(e) => e,
            None => match std::env::var("KVXFER_RDMA_ACK_TIMEOUT") {
                Ok(v) => v.trim().parse().map_err(|_| {
                    Error::InvalidConfig(format!("KVXFER_RDMA_ACK_TIMEOUT {v:?} is not 1..=31"))
                })?,
                Err(_) => crate::verbs::DEFAULT_ACK_TIMEOUT,
            },
        };
        if !(1..=31).contains(&exp) {
            return Err(Error::InvalidConfig(format!(
                "rdma.ack_timeout must be 1..=31, got {exp}"
            )));
        }
        Ok(exp)
    }
}

/// Default of [`RdmaConfig::max_inflight`]: 64 MiB, chosen by measurement
/// on soft-RoCE (see the git history of `docs/benchmarks.md`); far above the bandwidth-delay
/// product of any real link, so a stream never waits on it.
pub const DEFAULT_RDMA_MAX_INFLIGHT: u64 = 64 << 20;

/// How an RDMA connection's progress thread waits for completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RdmaProgress {
    /// Poll (as [`Poll`](Self::Poll)) while large requests have work
    /// requests posted; sleep on a completion channel otherwise. Bulk
    /// streams keep their send queues full without a wake-up per
    /// completion; an idle agent, or one whose waiters poll for their own
    /// small requests, costs no CPU.
    #[default]
    Adaptive,
    /// Sleep on a completion channel (no CPU while idle; one wake-up per
    /// burst of completions).
    Events,
    /// Poll the completion queue, spinning, then yielding, then sleeping
    /// 20-100 µs between polls while idle.
    Poll,
}

impl FromStr for RdmaProgress {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "adaptive" => Ok(Self::Adaptive),
            "events" => Ok(Self::Events),
            "poll" => Ok(Self::Poll),
            other => Err(Error::InvalidConfig(format!(
                "unknown RDMA progress mode {other:?} (adaptive, events, poll)"
            ))),
        }
    }
}

/// Who may talk to the agent (see `docs/security.md`).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct SecurityConfig {
    /// The cluster credential: every connection to or from this agent
    /// opens with a mutual HMAC-SHA256 challenge–response over it, and a
    /// peer that does not prove it holds the same secret is answered
    /// nothing. `None`: `KVXFER_SECRET_FILE` (a file holding the secret),
    /// else `KVXFER_SECRET`, else no credential.
    pub credential: Option<Credential>,
    /// Without a credential an agent may listen only on a loopback address;
    /// `true` (or `KVXFER_INSECURE=1`) lets it listen on any address, so
    /// that every process reaching the port can read and write its
    /// exported memory. A warning is logged.
    pub insecure: bool,
    /// Encrypts every connection to and from this agent (its TCP data path
    /// and the control streams of every transport) with AES-128-GCM under
    /// keys derived from each connection's handshake and the credential,
    /// through the kernel's TLS (kTLS) where the kernel has it (the stream
    /// code then sends and reads application memory as it does in the
    /// clear), else the same TLS 1.3 records made in user space (a copy
    /// each way more; `KVXFER_KTLS=0` asks for these anyway). A connection
    /// is encrypted when either side asks. Needs a credential
    /// ([`Error::InvalidConfig`] without). Data moved beside the streams
    /// (RDMA, libfabric, shm copies) is not encrypted. `false` (default):
    /// `KVXFER_ENCRYPT=1` turns it on.
    pub encrypt: bool,
}

/// Bounds on what peers and the application can make an agent hold.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Limits {
    /// Most bytes of received sync messages the agent holds until its
    /// application takes them (`take_sync_messages`, `wait_sync_messages`),
    /// counting messages of requests still arriving; a message beyond it
    /// fails its request at the sender with
    /// [`RejectReason::InboxFull`](crate::RejectReason::InboxFull). Default
    /// 1 GiB.
    pub inbox_max_bytes: u64,
    /// The same bound for the messages of one remote agent (default
    /// 256 MiB), so that one peer cannot fill the inbox for all.
    pub inbox_max_bytes_per_peer: u64,
    /// Most requests in flight (submitted, outcome not in) at once, over
    /// all peers (default 65,536): a submission beyond it fails at once with
    /// [`Error::WouldBlock`] — back-pressure for a caller that submits
    /// faster than the peers complete, instead of unbounded memory.
    pub max_requests_in_flight: usize,
    /// Most requests open at this agent as a target, over all the
    /// connections of all peers (begun, not finished; default 262,144:
    /// about 15 to 30 MiB of tables, an entry being about 57 bytes before
    /// the hash tables' slack; a sync message held for a request is
    /// counted in the inbox's budget). Once they are all taken, a connection
    /// holding its fair share (this over the sessions alive) that opens
    /// one more is closed, and one below its share is served while the
    /// session holding the most is closed instead; a closed connection's
    /// requests fail at their initiator with
    /// [`RejectReason::Overloaded`](crate::RejectReason::Overloaded). One
    /// connection holds at most 65,536 in any case.
    pub max_open_requests: usize,
    /// Most incoming connections served at once (default 1024); one more
    /// is closed at once. Each is a thread.
    pub max_incoming_connections: usize,
    /// Most incoming connections that have not yet authenticated (default
    /// 64). A new one past it evicts the oldest connection of the source
    /// (IP address) that holds the most, so a flood never keeps another
    /// source out.
    pub max_unauthenticated: usize,
    /// Most of those from one source (IP address): a new one past it
    /// evicts that source's own oldest. The default, 64, is the total: the
    /// agents of one host (ranks of several GPUs, each opening its streams
    /// at once) may fill the table alone, and a source gives way only when
    /// the table is full and it holds the most.
    pub max_unauthenticated_per_source: usize,
    /// How long an incoming connection may take to authenticate (default
    /// 3 s, at most `connect_timeout`); then it is dropped.
    pub auth_timeout: Duration,
    /// Most bytes of objects that peers are writing to this agent's object
    /// storage at once (default 1 GiB): an object is PUT whole, so a
    /// peer's WRITE is assembled here until its request commits; a segment
    /// past this bound fails its request with
    /// [`RejectReason::ObjectAssemblyFull`](crate::RejectReason::ObjectAssemblyFull).
    pub max_object_assembly: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            inbox_max_bytes: 1 << 30,
            inbox_max_bytes_per_peer: 256 << 20,
            max_requests_in_flight: 1 << 16,
            max_open_requests: 1 << 18,
            max_incoming_connections: 1024,
            max_unauthenticated: 64,
            max_unauthenticated_per_source: 64,
            auth_timeout: Duration::from_secs(3),
            max_object_assembly: 1 << 30,
        }
    }
}

impl AgentConfig {
    /// Defaults for an agent called `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            tcp: TcpConfig::default(),
            gpu: GpuConfig::default(),
            shm: ShmConfig::default(),
            rdma: RdmaConfig::default(),
            fabric: FabricConfig::default(),
            security: SecurityConfig::default(),
            limits: Limits::default(),
            required_transports: Vec::new(),
            storage_io: crate::storage::StorageIo::Auto,
            metadata: crate::metadata::Metadata::Direct,
            metrics: crate::metrics::MetricsConfig::default(),
        }
    }

    /// Records each request's latency for the metrics
    /// ([`MetricsConfig::timing`](crate::metrics::MetricsConfig::timing)).
    pub fn with_metrics_timing(mut self, on: bool) -> Self {
        self.metrics.timing = on;
        self
    }

    /// Serves the metrics at `http://<addr>/metrics` (cargo feature
    /// `metrics-endpoint`; latency recorded too).
    pub fn with_metrics_listen(mut self, addr: std::net::SocketAddr) -> Self {
        self.metrics.listen = Some(addr);
        self
    }

    /// Publishes the agent in an etcd cluster, and finds peers there by
    /// name ([`crate::metadata`]).
    pub fn with_etcd(mut self, etcd: crate::metadata::EtcdConfig) -> Self {
        self.metadata = crate::metadata::Metadata::Etcd(etcd);
        self
    }

    /// The metadata store in effect: the field, else `KVXFER_ETCD` (with
    /// `KVXFER_ETCD_PREFIX`), else none.
    pub fn effective_metadata(&self) -> crate::metadata::Metadata {
        match &self.metadata {
            crate::metadata::Metadata::Direct => crate::metadata::EtcdConfig::from_env().map_or(
                crate::metadata::Metadata::Direct,
                crate::metadata::Metadata::Etcd,
            ),
            m => m.clone(),
        }
    }

    /// Requires `transport` for requests on `mem_type` memory (see
    /// [`required_transports`](Self::required_transports)); replaces an
    /// earlier requirement for the same type.
    pub fn with_required_transport(
        mut self,
        mem_type: MemoryType,
        transport: TransportKind,
    ) -> Self {
        self.required_transports.retain(|(m, _)| *m != mem_type);
        self.required_transports.push((mem_type, transport));
        self
    }

    /// The transport required for `mem_type`, if any.
    pub fn required_transport(&self, mem_type: MemoryType) -> Option<TransportKind> {
        self.required_transports
            .iter()
            .find(|(m, _)| *m == mem_type)
            .map(|&(_, t)| t)
    }

    /// Sets the listen address.
    pub fn with_listen(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// Sets the advertised address.
    pub fn with_advertise(mut self, addr: impl Into<String>) -> Self {
        self.advertise = Some(addr.into());
        self
    }

    /// Sets the connect timeout.
    pub fn with_connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// Sets the I/O (no progress) timeout.
    pub fn with_io_timeout(mut self, t: Duration) -> Self {
        self.io_timeout = t;
        self
    }

    /// Replaces the TCP group.
    pub fn with_tcp(mut self, tcp: TcpConfig) -> Self {
        self.tcp = tcp;
        self
    }

    /// Replaces the shm group.
    pub fn with_shm(mut self, shm: ShmConfig) -> Self {
        self.shm = shm;
        self
    }

    /// Replaces the libfabric group.
    pub fn with_fabric(mut self, fabric: FabricConfig) -> Self {
        self.fabric = fabric;
        self
    }

    /// Selects the libfabric provider by name (`efa`, `tcp;ofi_rxm`, …).
    pub fn with_fabric_provider(mut self, name: impl Into<String>) -> Self {
        self.fabric.provider = Some(name.into());
        self
    }

    /// Selects the libfabric domain by name, or several separated by commas
    /// (rails, [`FabricConfig::domain`]).
    pub fn with_fabric_domain(mut self, name: impl Into<String>) -> Self {
        self.fabric.domain = Some(name.into());
        self
    }

    /// Sets the bytes of libfabric operations in flight on the agent's
    /// endpoint ([`FabricConfig::max_inflight`]).
    pub fn with_fabric_max_inflight(mut self, bytes: u64) -> Self {
        self.fabric.max_inflight = bytes;
        self
    }

    /// Sets how long a failed lane of a libfabric link rests out of
    /// service ([`FabricConfig::lane_rest`]).
    pub fn with_fabric_lane_rest(mut self, rest: Duration) -> Self {
        self.fabric.lane_rest = rest;
        self
    }

    /// Replaces the RDMA group.
    pub fn with_rdma(mut self, rdma: RdmaConfig) -> Self {
        self.rdma = rdma;
        self
    }

    /// Replaces the limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets the staging ring of VRAM over TCP ([`GpuConfig`]): `slots`
    /// pinned buffers of `chunk` bytes.
    pub fn with_gpu_staging(mut self, chunk: usize, slots: usize) -> Self {
        self.gpu.staging_chunk = chunk;
        self.gpu.staging_slots = slots;
        self
    }

    /// Sets the number of TCP streams per peer ([`TcpConfig::streams_per_peer`]).
    pub fn with_streams_per_peer(mut self, n: usize) -> Self {
        self.tcp.streams_per_peer = n;
        self
    }

    /// Sets the largest TCP segment ([`TcpConfig::segment_size`]).
    pub fn with_segment_size(mut self, n: u64) -> Self {
        self.tcp.segment_size = n;
        self
    }

    /// Sets the threads copying one large shm request
    /// ([`ShmConfig::copy_threads`]).
    pub fn with_shm_copy_threads(mut self, n: usize) -> Self {
        self.shm.copy_threads = n;
        self
    }

    /// Sets whether this agent maps and hands out shared pools (see
    /// [`ShmConfig::pools`]).
    pub fn with_shm_pools(mut self, on: bool) -> Self {
        self.shm.pools = on;
        self
    }

    /// Sets whether shm copies may be done by the side whose memory is
    /// contiguous ([`ShmConfig::delegate`]).
    pub fn with_shm_delegate(mut self, on: bool) -> Self {
        self.shm.delegate = on;
        self
    }

    /// Chooses the RDMA device (and optionally the GID index) instead of
    /// the environment or the first active device.
    pub fn with_rdma_device(mut self, name: impl Into<String>, gid_index: Option<u32>) -> Self {
        self.rdma.device = Some(name.into());
        self.rdma.gid_index = gid_index;
        self
    }

    /// Sets the RDMA queue pairs per remote agent ([`RdmaConfig::qps_per_peer`]).
    pub fn with_rdma_qps_per_peer(mut self, n: usize) -> Self {
        self.rdma.qps_per_peer = n;
        self
    }

    /// Sets whether incoming RDMA connections share a receive queue
    /// ([`RdmaConfig::srq`]).
    pub fn with_rdma_srq(mut self, on: bool) -> Self {
        self.rdma.srq = on;
        self
    }

    /// Sets the RDMA local ACK timeout exponent, 1..=31
    /// ([`RdmaConfig::ack_timeout`]).
    pub fn with_rdma_ack_timeout(mut self, exp: u8) -> Self {
        self.rdma.ack_timeout = Some(exp);
        self
    }

    /// Sets the bytes of RDMA work in flight per remote agent
    /// ([`RdmaConfig::max_inflight`]).
    pub fn with_rdma_max_inflight(mut self, bytes: u64) -> Self {
        self.rdma.max_inflight = bytes;
        self
    }

    /// Sets how the RDMA progress thread waits for completions
    /// ([`RdmaConfig::progress`]).
    pub fn with_rdma_progress(mut self, p: RdmaProgress) -> Self {
        self.rdma.progress = p;
        self
    }

    /// Sets the cluster credential ([`SecurityConfig::credential`]).
    pub fn with_credential(mut self, credential: Credential) -> Self {
        self.security.credential = Some(credential);
        self
    }

    /// Allows listening on a non-loopback address without a credential
    /// ([`SecurityConfig::insecure`]).
    pub fn with_insecure(mut self, on: bool) -> Self {
        self.security.insecure = on;
        self
    }

    /// Encrypts this agent's connections ([`SecurityConfig::encrypt`]).
    pub fn with_encryption(mut self, on: bool) -> Self {
        self.security.encrypt = on;
        self
    }

    /// Chooses the storage I/O engine ([`storage_io`](Self::storage_io)).
    pub fn with_storage_io(mut self, io: crate::storage::StorageIo) -> Self {
        self.storage_io = io;
        self
    }

    /// The storage I/O engine: the configured one, else
    /// `KVXFER_STORAGE_IO`, else `Auto`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown `KVXFER_STORAGE_IO`.
    pub fn effective_storage_io(&self) -> Result<crate::storage::StorageIo, Error> {
        if self.storage_io != crate::storage::StorageIo::Auto {
            return Ok(self.storage_io);
        }
        match std::env::var("KVXFER_STORAGE_IO") {
            Ok(v) => v.trim().parse(),
            Err(_) => Ok(crate::storage::StorageIo::Auto),
        }
    }

    /// Sets the most requests in flight at once
    /// ([`Limits::max_requests_in_flight`]).
    pub fn with_max_requests_in_flight(mut self, n: usize) -> Self {
        self.limits.max_requests_in_flight = n;
        self
    }

    /// Sets the bounds on incoming connections: in all, and not yet
    /// authenticated.
    pub fn with_connection_limits(mut self, total: usize, unauthenticated: usize) -> Self {
        self.limits.max_incoming_connections = total;
        self.limits.max_unauthenticated = unauthenticated;
        self
    }

    /// Sets the bounds on connections still authenticating: from one
    /// source ([`Limits::max_unauthenticated_per_source`]), and how long
    /// each may take ([`Limits::auth_timeout`]).
    pub fn with_pre_auth_limits(mut self, per_source: usize, timeout: Duration) -> Self {
        self.limits.max_unauthenticated_per_source = per_source;
        self.limits.auth_timeout = timeout;
        self
    }

    /// Sets the agent-wide bound on requests open at this target
    /// ([`Limits::max_open_requests`]).
    pub fn with_max_open_requests(mut self, n: usize) -> Self {
        self.limits.max_open_requests = n.max(1);
        self
    }

    /// Sets the sync-message inbox bounds: in all and per remote agent
    /// ([`Limits::inbox_max_bytes`]).
    pub fn with_inbox_limits(mut self, total: u64, per_peer: u64) -> Self {
        self.limits.inbox_max_bytes = total;
        self.limits.inbox_max_bytes_per_peer = per_peer;
        self
    }

    /// Fills in the credential and the `insecure` opt-in from the
    /// environment where the fields leave them unset, and checks that an
    /// agent without a credential listens on loopback only or was let
    /// out explicitly.
    ///
    /// # Errors
    /// [`Error::Credential`] for an unreadable or short secret;
    /// [`Error::InvalidConfig`] for a non-loopback listener with neither a
    /// credential nor `insecure`, or encryption without a credential.
    pub fn resolve_security(&mut self) -> Result<(), Error> {
        let sec = &mut self.security;
        if sec.credential.is_none() {
            sec.credential = Credential::from_env()?;
        }
        if !sec.insecure {
            sec.insecure = std::env::var("KVXFER_INSECURE").is_ok_and(|v| v.trim() == "1");
        }
        if !sec.encrypt {
            sec.encrypt = std::env::var("KVXFER_ENCRYPT").is_ok_and(|v| v.trim() == "1");
        }
        if sec.encrypt && sec.credential.is_none() {
            return Err(Error::InvalidConfig(
                "encrypted connections need a cluster credential (their keys come from it): \
                 set one (AgentConfig::with_credential, KVXFER_SECRET_FILE, KVXFER_SECRET)"
                    .into(),
            ));
        }
        if sec.credential.is_none() && !self.listen.ip().is_loopback() {
            if !sec.insecure {
                return Err(Error::InvalidConfig(format!(
                    "listening on {} without a cluster credential would let any process that \
                     reaches the port read and write this agent's exported memory: set one \
                     (AgentConfig::with_credential, KVXFER_SECRET_FILE, KVXFER_SECRET) or opt in \
                     with AgentConfig::with_insecure / KVXFER_INSECURE=1",
                    self.listen
                )));
            }
            tracing::warn!(agent = %self.name, listen = %self.listen, "INSECURE: listening without a cluster credential; any process that reaches this port can read and write the exported memory");
        }
        Ok(())
    }

    /// Checks every field's range.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.name.is_empty() || self.name.len() > crate::desc::MAX_AGENT_NAME {
            return bad(format!(
                "name must be 1..={} bytes",
                crate::desc::MAX_AGENT_NAME
            ));
        }
        if !(1..=64).contains(&self.tcp.streams_per_peer) {
            return bad(format!(
                "tcp.streams_per_peer must be 1..=64, got {}",
                self.tcp.streams_per_peer
            ));
        }
        if self.tcp.segment_size < 4096 {
            return bad(format!(
                "tcp.segment_size must be at least 4096, got {}",
                self.tcp.segment_size
            ));
        }
        // Whole pages: chunks of GPU memory staged to storage opened for
        // direct I/O then start and end on block boundaries.
        if !(4096..=1 << 30).contains(&self.gpu.staging_chunk)
            || !self.gpu.staging_chunk.is_multiple_of(4096)
            || !(2..=64).contains(&self.gpu.staging_slots)
        {
            return bad(format!(
                "gpu.staging_chunk must be a multiple of 4 KiB in 4 KiB..=1 GiB and gpu.staging_slots 2..=64, got {} and {}",
                self.gpu.staging_chunk, self.gpu.staging_slots
            ));
        }
        if !(1..=64).contains(&self.shm.copy_threads) {
            return bad(format!(
                "shm.copy_threads must be 1..=64, got {}",
                self.shm.copy_threads
            ));
        }
        if !(1..=16).contains(&self.rdma.qps_per_peer) {
            return bad(format!(
                "rdma.qps_per_peer must be 1..=16, got {}",
                self.rdma.qps_per_peer
            ));
        }
        self.rdma.effective_ack_timeout()?;
        if self.rdma.max_inflight < 64 << 10 {
            return bad(format!(
                "rdma.max_inflight must be at least 64 KiB, got {}",
                self.rdma.max_inflight
            ));
        }
        if self.fabric.max_inflight < 64 << 10 {
            return bad(format!(
                "fabric.max_inflight must be at least 64 KiB, got {}",
                self.fabric.max_inflight
            ));
        }
        let l = &self.limits;
        if l.max_requests_in_flight == 0 {
            return bad("limits.max_requests_in_flight must be at least 1".into());
        }
        if l.max_incoming_connections == 0
            || l.max_unauthenticated == 0
            || l.max_unauthenticated_per_source == 0
        {
            return bad("connection limits must be at least 1".into());
        }
        if l.auth_timeout.is_zero() {
            return bad("limits.auth_timeout must be non-zero".into());
        }
        if self.connect_timeout.is_zero() || self.io_timeout.is_zero() {
            return bad("timeouts must be non-zero".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_ranges_are_checked() {
        let ok = AgentConfig::new("a");
        assert!(ok.validate().is_ok());
        for bad in [
            AgentConfig::new("a").with_rdma_qps_per_peer(0),
            AgentConfig::new("a").with_rdma_qps_per_peer(17),
            AgentConfig::new("a").with_rdma_ack_timeout(0),
            AgentConfig::new("a").with_rdma_ack_timeout(32),
            AgentConfig::new("a").with_streams_per_peer(0),
            AgentConfig::new("a").with_rdma_max_inflight((64 << 10) - 1),
            AgentConfig::new("a").with_fabric_max_inflight((64 << 10) - 1),
            AgentConfig::new("a").with_gpu_staging(4096 + 512, 2),
            AgentConfig::new("a").with_gpu_staging(1 << 20, 1),
        ] {
            assert!(
                matches!(bad.validate(), Err(Error::InvalidConfig(_))),
                "{bad:?}"
            );
        }
        let set = AgentConfig::new("a").with_rdma_ack_timeout(20);
        assert_eq!(set.rdma.effective_ack_timeout().unwrap(), 20);
        assert!(
            AgentConfig::new("a")
                .with_rdma_max_inflight(64 << 10)
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn progress_modes_parse() {
        assert_eq!(RdmaProgress::default(), RdmaProgress::Adaptive);
        for (s, m) in [
            ("adaptive", RdmaProgress::Adaptive),
            ("Events", RdmaProgress::Events),
            ("POLL", RdmaProgress::Poll),
        ] {
            assert_eq!(s.parse::<RdmaProgress>().unwrap(), m);
        }
        assert!(matches!(
            "spin".parse::<RdmaProgress>(),
            Err(Error::InvalidConfig(_))
        ));
    }
}
