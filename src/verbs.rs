//! Verbs layer: the one module that talks to `sideway` (RDMA verbs). Device
//! selection, protection domain, memory regions, reliable-connected queue
//! pairs and completion polling, with one typed error per verb.
//!
//! The agent's RDMA path (`tcp/rdma.rs`) is built on it. Hosts without an RDMA-capable kernel get
//! [`VerbsError::NoDevice`] from [`Device::open`], never a crash: the verbs
//! library is loaded at run time.
//!
//! # Resource cleanup
//! Every resource holds an `Arc` to its parents (sideway's design), so a
//! protection domain outlives its memory regions and queue pairs, and a
//! device context outlives all of them. Within [`RcQueuePair`] the queue
//! pair is declared before its completion queues, so it is destroyed first.

use std::io;
use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::GidType;
use sideway::ibverbs::completion::{
    CompletionChannel, CompletionQueue, GenericCompletionQueue, PollCompletionQueueError,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    GenericQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SendOperationFlags, SetInlineData, SetScatterGatherEntry, WorkRequestFlags,
};

/// Errors of the verbs layer: one variant per verb, with the OS error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No usable RDMA device: the kernel has no RDMA support, no device
    /// exists, or none has an active port.
    #[error("no usable RDMA device: {0}")]
    NoDevice(String),
    /// The operation is not supported by this device or provider.
    #[error("{what} is not supported by this RDMA device")]
    Unsupported {
        /// The operation.
        what: &'static str,
    },
    /// A verb failed.
    #[error("{verb} failed: {source}")]
    Verb {
        /// The verb (`ibv_reg_mr`, `ibv_modify_qp(RTR)`, ...).
        verb: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A work request completed with an error status.
    #[error(
        "work request {wr_id} completed with {status_name} (status {status}, vendor error {vendor_err:#x})"
    )]
    WorkCompletion {
        /// The request's id.
        wr_id: u64,
        /// `ibv_wc_status` value.
        status: u32,
        /// Its name (`IBV_WC_REM_ACCESS_ERR`, ...).
        status_name: &'static str,
        /// Vendor error code.
        vendor_err: u32,
    },
}

fn verb(verb: &'static str) -> impl FnOnce(io::Error) -> VerbsError {
    move |source| {
        if source.raw_os_error() == Some(libc::EOPNOTSUPP) {
            VerbsError::Unsupported { what: verb }
        } else {
            VerbsError::Verb { verb, source }
        }
    }
}

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// The name of an `ibv_wc_status` value.
pub fn wc_status_name(status: u32) -> &'static str {
    const NAMES: [&str; 23] = [
        "IBV_WC_SUCCESS",
        "IBV_WC_LOC_LEN_ERR",
        "IBV_WC_LOC_QP_OP_ERR",
        "IBV_WC_LOC_EEC_OP_ERR",
        "IBV_WC_LOC_PROT_ERR",
        "IBV_WC_WR_FLUSH_ERR",
        "IBV_WC_MW_BIND_ERR",
        "IBV_WC_BAD_RESP_ERR",
        "IBV_WC_LOC_ACCESS_ERR",
        "IBV_WC_REM_INV_REQ_ERR",
        "IBV_WC_REM_ACCESS_ERR",
        "IBV_WC_REM_OP_ERR",
        "IBV_WC_RETRY_EXC_ERR",
        "IBV_WC_RNR_RETRY_EXC_ERR",
        "IBV_WC_LOC_RDD_VIOL_ERR",
        "IBV_WC_REM_INV_RD_REQ_ERR",
        "IBV_WC_REM_ABORT_ERR",
        "IBV_WC_INV_EECN_ERR",
        "IBV_WC_INV_EEC_STATE_ERR",
        "IBV_WC_FATAL_ERR",
        "IBV_WC_RESP_TIMEOUT_ERR",
        "IBV_WC_GENERAL_ERR",
        "IBV_WC_TM_ERR",
    ];
    NAMES
        .get(status as usize)
        .copied()
        .unwrap_or("IBV_WC_UNKNOWN")
}

/// Names of the RDMA devices present (empty, or `NoDevice`, without RDMA).
///
/// # Errors
/// [`VerbsError::NoDevice`] when the device list cannot be read (no kernel
/// support: ENOSYS).
pub fn device_names() -> Result<Vec<String>, VerbsError> {
    let list =
        DeviceList::new().map_err(|e| VerbsError::NoDevice(format!("ibv_get_device_list: {e}")))?;
    Ok(list.iter().map(|d| d.name()).collect())
}

/// An opened device: context, protection domain, the port and GID in use,
/// and the limits the data path must respect.
pub struct Device {
    name: String,
    port: u8,
    gid_index: u32,
    gid: [u8; 16],
    gid_type: &'static str,
    mtu: Mtu,
    max_sge: u32,
    max_qp_wr: u32,
    /// Receives a shared receive queue may hold (0: none supported).
    max_srq_wr: u32,
    max_msg_size: u64,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("gid_type", &self.gid_type)
            .field("max_sge", &self.max_sge)
            .field("max_qp_wr", &self.max_qp_wr)
            .finish()
    }
}

/// Where a queue pair can be reached: exchanged over the side channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QpInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// GID of the port.
    pub gid: [u8; 16],
    /// Path MTU code (`ibv_mtu`).
    pub mtu: u32,
}

/// A range registered with a device (`ibv_reg_mr`); deregistered when the
/// last clone is dropped. The verbs layer's own type, so that no sideway
/// type leaves this module.
#[derive(Clone)]
pub struct Registered(Arc<MemoryRegion>);

impl Registered {
    /// The key local work requests name it by.
    pub fn lkey(&self) -> u32 {
        self.0.lkey()
    }

    /// The key a peer's one-sided work requests name it by.
    pub fn rkey(&self) -> u32 {
        self.0.rkey()
    }
}

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl Device {
    /// Opens a device: `name`, else `KVXFER_RDMA_DEVICE`, else the first one
    /// with an active port 1. GID: `gid_index`, else `KVXFER_RDMA_GID_INDEX`,
    /// else the first RoCE v2 GID of the port, else index 0.
    ///
    /// # Errors
    /// [`VerbsError::NoDevice`], or the failing verb.
    pub fn open(name: Option<&str>, gid_index: Option<u32>) -> Result<Self, VerbsError> {
        let env_name = std::env::var("KVXFER_RDMA_DEVICE").ok();
        let want = name.or(env_name.as_deref());
        let list = DeviceList::new()
            .map_err(|e| VerbsError::NoDevice(format!("ibv_get_device_list: {e}")))?;
        if list.is_empty() {
            return Err(VerbsError::NoDevice("the device list is empty".into()));
        }
        let port = 1u8;
        let mut reasons = Vec::new();
        for dev in list.iter() {
            let dname = dev.name();
            if want.is_some_and(|w| w != dname) {
                continue;
            }
            let ctx = dev.open().map_err(|e| verb("ibv_open_device")(other(e)))?;
            let pattr = ctx
                .query_port(port)
                .map_err(|e| verb("ibv_query_port")(other(e)))?;
            if pattr.port_state() != PortState::Active {
                reasons.push(format!("{dname}: port {port} not active"));
                continue;
            }
            let env_gid = std::env::var("KVXFER_RDMA_GID_INDEX")
                .ok()
                .and_then(|s| s.parse().ok());
            let table = ctx
                .query_gid_table()
                .map_err(|e| verb("ibv_query_gid_table")(other(e)))?;
            let entry = match gid_index.or(env_gid) {
                Some(i) => table
                    .iter()
                    .find(|g| g.gid_index() == i && g.port_num() == u32::from(port)),
                None => table
                    .iter()
                    .find(|g| g.port_num() == u32::from(port) && g.gid_type() == GidType::RoceV2)
                    .or_else(|| table.iter().find(|g| g.port_num() == u32::from(port))),
            };
            let Some(entry) = entry else {
                reasons.push(format!("{dname}: no usable GID on port {port}"));
                continue;
            };
            let gid_type = match entry.gid_type() {
                GidType::RoceV2 => "RoCE v2",
                GidType::RoceV1 => "RoCE v1",
                _ => "InfiniBand",
            };
            let dattr = ctx
                .query_device()
                .map_err(|e| verb("ibv_query_device")(other(e)))?;
            let a = &dattr.attr.orig_attr;
            let pd = ctx.alloc_pd().map_err(|e| verb("ibv_alloc_pd")(other(e)))?;
            let d = Device {
                name: dname,
                port,
                gid_index: entry.gid_index(),
                gid: entry.gid().raw,
                gid_type,
                mtu: pattr.active_mtu(),
                max_sge: a.max_sge.max(1) as u32,
                max_qp_wr: a.max_qp_wr.max(1) as u32,
                max_srq_wr: if a.max_srq > 0 {
                    a.max_srq_wr.max(0) as u32
                } else {
                    0
                },
                max_msg_size: u64::from(pattr.attr.max_msg_sz).max(1),
                pd,
                ctx,
            };
            tracing::info!(device = %d.name, port, gid_index = d.gid_index, gid_type, "RDMA device opened");
            return Ok(d);
        }
        Err(VerbsError::NoDevice(match want {
            Some(w) if reasons.is_empty() => format!("no device named {w:?}"),
            _ => reasons.join("; "),
        }))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// GID index in use.
    pub fn gid_index(&self) -> u32 {
        self.gid_index
    }

    /// Most scatter-gather entries per work request.
    pub fn max_sge(&self) -> u32 {
        self.max_sge
    }

    /// Most outstanding work requests per queue.
    pub fn max_qp_wr(&self) -> u32 {
        self.max_qp_wr
    }

    /// Largest message of one work request.
    pub fn max_msg_size(&self) -> u64 {
        self.max_msg_size
    }

    /// Registers `[addr, addr + len)` for local write and remote read/write.
    ///
    /// # Safety
    /// The range must stay allocated until the returned region is dropped.
    ///
    /// # Errors
    /// `ibv_reg_mr`'s error.
    pub unsafe fn register(&self, addr: u64, len: u64) -> Result<Registered, VerbsError> {
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        // SAFETY: forwarded contract: the range outlives the region.
        unsafe { self.pd.reg_mr(addr as usize, len as usize, access) }
            .map(Registered)
            .map_err(|e| verb("ibv_reg_mr")(other(e)))
    }

    /// A reliable-connected queue pair with its own completion queues, able
    /// to hold `depth` outstanding sends and receives.
    ///
    /// # Errors
    /// The failing verb.
    pub fn create_rc(&self, depth: u32) -> Result<RcQueuePair, VerbsError> {
        self.create_rc_with(depth, false)
    }

    /// As [`create_rc`](Self::create_rc); with `send_events`, the send
    /// completion queue also signals a completion channel, so a thread can
    /// sleep until a completion arrives ([`RcQueuePair::send_events`]).
    ///
    /// # Errors
    /// The failing verb.
    pub fn create_rc_with(&self, depth: u32, send_events: bool) -> Result<RcQueuePair, VerbsError> {
        self.create_rc_with_events(depth, send_events, false)
    }

    /// As [`create_rc_with`](Self::create_rc_with), choosing for each
    /// completion queue whether it signals a channel of its own
    /// ([`RcQueuePair::send_events`], [`RcQueuePair::recv_events`]).
    ///
    /// # Errors
    /// The failing verb.
    pub fn create_rc_with_events(
        &self,
        depth: u32,
        send_events: bool,
        recv_events: bool,
    ) -> Result<RcQueuePair, VerbsError> {
        let depth = depth.clamp(1, self.max_qp_wr);
        let new_channel = |on: bool| on.then(|| self.new_channel()).transpose();
        let (channel, recv_channel) = (new_channel(send_events)?, new_channel(recv_events)?);
        let cq = |ch: &Option<Arc<CompletionChannel>>| self.new_cq(depth * 2, ch.as_ref());
        let recv_cq = cq(&recv_channel)?;
        let send_cq = cq(&channel)?;
        let mut qpb = self.pd.create_qp_builder();
        qpb.setup_max_send_wr(depth)
            .setup_max_recv_wr(depth)
            .setup_max_send_sge(self.max_sge.min(30))
            .setup_max_recv_sge(1)
            .setup_max_inline_data(MAX_INLINE)
            .setup_send_cq(send_cq.clone())
            .setup_recv_cq(recv_cq.clone())
            .setup_send_ops_flags(
                SendOperationFlags::Send
                    | SendOperationFlags::SendWithImmediate
                    | SendOperationFlags::Write
                    | SendOperationFlags::WriteWithImmediate
                    | SendOperationFlags::Read,
            );
        // The extended verbs post a batch of work requests atomically
        // (all or none); devices without them get a basic queue pair.
        let qp: GenericQueuePair = match qpb.build_ex() {
            Ok(qp) => qp.into(),
            Err(e) => {
                tracing::debug!(device = %self.name, error = %e, "ibv_create_qp_ex failed; using a basic queue pair");
                qpb.build()
                    .map_err(|e| verb("ibv_create_qp")(other(e)))?
                    .into()
            }
        };
        let rc = RcQueuePair {
            qp,
            send_cq,
            recv_cq,
            channel,
            recv_channel,
            path: self.path(),
            max_sge: self.max_sge.min(30),
        };
        // SAFETY: the queue pair is alive (owned by `rc`).
        unsafe { rc.path.modify_to_init(rc.qp.qp().as_ptr())? };
        Ok(rc)
    }

    /// A non-blocking completion channel.
    fn new_channel(&self) -> Result<Arc<CompletionChannel>, VerbsError> {
        let ch = CompletionChannel::new(&self.ctx)
            .map_err(|e| verb("ibv_create_comp_channel")(other(e)))?;
        ch.set_nonblocking(true)
            .map_err(verb("fcntl(O_NONBLOCK) on the completion channel"))?;
        Ok(ch)
    }

    /// A completion queue of `cqe` entries, signalling `channel` if given.
    fn new_cq(
        &self,
        cqe: u32,
        channel: Option<&Arc<CompletionChannel>>,
    ) -> Result<GenericCompletionQueue, VerbsError> {
        let mut cqb = self.ctx.create_cq_builder();
        cqb.setup_cqe(cqe);
        if let Some(ch) = channel {
            cqb.setup_comp_channel(ch, 0);
        }
        Ok(GenericCompletionQueue::from(
            cqb.build().map_err(|e| verb("ibv_create_cq")(other(e)))?,
        ))
    }

    /// A fresh queue pair's path on this device's port: random initial
    /// PSN, the default ACK timeout.
    fn path(&self) -> QpPath {
        QpPath {
            port: self.port,
            gid_index: self.gid_index,
            gid: self.gid,
            mtu: self.mtu as u32,
            psn: crate::auth::random_u64() as u32 & 0x00ff_ffff,
            ack_timeout: DEFAULT_ACK_TIMEOUT,
        }
    }

    /// A shared receive queue of `depth` receives (at most the device's
    /// limit) and the completion queue, with its own channel, on which
    /// receives of every queue pair attached to it complete.
    ///
    /// # Errors
    /// [`VerbsError::Unsupported`] when the device has no shared receive
    /// queues; else the failing verb.
    pub fn create_srq(&self, depth: u32) -> Result<Arc<SharedReceiveQueue>, VerbsError> {
        if self.max_srq_wr == 0 {
            return Err(VerbsError::Unsupported {
                what: "a shared receive queue",
            });
        }
        let depth = depth.clamp(1, self.max_srq_wr);
        let channel = self.new_channel()?;
        let cq = self.new_cq(depth * 2, Some(&channel))?;
        // SAFETY: an all-zero ibv_srq_init_attr is valid; the fields that
        // matter are set below.
        let mut init: rdma_mummy_sys::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        init.attr.max_wr = depth;
        init.attr.max_sge = 1;
        // SAFETY: the protection domain is alive (we hold it) and `init`
        // is a valid attribute struct for the call.
        let srq = unsafe { rdma_mummy_sys::ibv_create_srq(self.pd.pd().as_ptr(), &mut init) };
        let srq = std::ptr::NonNull::new(srq)
            .ok_or_else(|| verb("ibv_create_srq")(io::Error::last_os_error()))?;
        Ok(Arc::new(SharedReceiveQueue {
            srq,
            cq,
            channel,
            _pd: Arc::clone(&self.pd),
            depth,
        }))
    }

    /// A reliable-connected queue pair whose receives come from `srq`
    /// (and complete on its completion queue). It is meant for the
    /// receiving end of a connection: its send queue holds one work
    /// request and nothing is posted there (RDMA READ responses and ACKs
    /// need no send work requests).
    ///
    /// # Errors
    /// The failing verb.
    pub fn create_rc_on_srq(
        &self,
        srq: &Arc<SharedReceiveQueue>,
    ) -> Result<SrqQueuePair, VerbsError> {
        // SAFETY: the completion queue is alive (`srq` holds it).
        let cq = unsafe { srq.cq.cq().as_ptr() };
        let mut init = rdma_mummy_sys::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: srq.srq.as_ptr(),
            cap: rdma_mummy_sys::ibv_qp_cap {
                max_send_wr: 1,
                max_recv_wr: 0,
                max_send_sge: 1,
                max_recv_sge: 0,
                max_inline_data: 0,
            },
            qp_type: rdma_mummy_sys::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: protection domain, completion queue and shared receive
        // queue are alive (held by `self` and `srq`); `init` is valid.
        let qp = unsafe { rdma_mummy_sys::ibv_create_qp(self.pd.pd().as_ptr(), &mut init) };
        let qp = std::ptr::NonNull::new(qp)
            .ok_or_else(|| verb("ibv_create_qp(srq)")(io::Error::last_os_error()))?;
        let q = SrqQueuePair {
            qp,
            path: self.path(),
            _srq: Arc::clone(srq),
        };
        // SAFETY: the queue pair is alive (owned by `q`).
        unsafe { q.path.modify_to_init(q.qp.as_ptr())? };
        Ok(q)
    }
}

/// What a queue pair needs to reach its peer, and the connection
/// parameters it is given: the same for both kinds of queue pair.
#[derive(Clone, Copy, Debug)]
struct QpPath {
    port: u8,
    gid_index: u32,
    gid: [u8; 16],
    /// Active MTU code (`ibv_mtu`).
    mtu: u32,
    psn: u32,
    /// Local ACK timeout exponent.
    ack_timeout: u8,
}

impl QpPath {
    fn info(&self, qpn: u32) -> QpInfo {
        QpInfo {
            qpn,
            psn: self.psn,
            gid: self.gid,
            mtu: self.mtu,
        }
    }

    /// RESET → INIT, remote write and read allowed.
    ///
    /// # Safety
    /// `qp` is a live queue pair.
    unsafe fn modify_to_init(&self, qp: *mut rdma_mummy_sys::ibv_qp) -> Result<(), VerbsError> {
        use rdma_mummy_sys::{ibv_access_flags as acc, ibv_qp_attr_mask as m};
        // SAFETY: an all-zero ibv_qp_attr is valid; the masked fields are set.
        let mut attr: rdma_mummy_sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = rdma_mummy_sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = self.port;
        attr.qp_access_flags = (acc::IBV_ACCESS_LOCAL_WRITE
            | acc::IBV_ACCESS_REMOTE_WRITE
            | acc::IBV_ACCESS_REMOTE_READ)
            .0;
        let mask = m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS;
        // SAFETY: forwarded contract on `qp`.
        unsafe { modify_qp(qp, &mut attr, mask, "ibv_modify_qp(INIT)") }
    }

    /// INIT → RTR → RTS towards `remote`.
    ///
    /// # Safety
    /// `qp` is a live queue pair in INIT.
    unsafe fn connect(
        &self,
        qp: *mut rdma_mummy_sys::ibv_qp,
        remote: &QpInfo,
    ) -> Result<(), VerbsError> {
        use rdma_mummy_sys::ibv_qp_attr_mask as m;
        // SAFETY: an all-zero ibv_qp_attr is valid; the masked fields are set.
        let mut attr: rdma_mummy_sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = rdma_mummy_sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = remote.mtu.min(self.mtu);
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = QP_RD_ATOMIC;
        attr.min_rnr_timer = QP_MIN_RNR_TIMER;
        attr.ah_attr.dlid = 0;
        attr.ah_attr.sl = 0;
        attr.ah_attr.port_num = self.port;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.grh.sgid_index = self.gid_index as u8;
        attr.ah_attr.grh.hop_limit = 64;
        attr.ah_attr.grh.dgid.raw = remote.gid;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER;
        // SAFETY: forwarded contract on `qp`.
        unsafe { modify_qp(qp, &mut attr, mask, "ibv_modify_qp(RTR)")? };
        // SAFETY: as above.
        let mut attr: rdma_mummy_sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = rdma_mummy_sys::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = self.psn;
        attr.timeout = self.ack_timeout;
        attr.retry_cnt = QP_RETRY_CNT;
        attr.rnr_retry = QP_RNR_RETRY;
        attr.max_rd_atomic = QP_RD_ATOMIC;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_MAX_QP_RD_ATOMIC;
        // SAFETY: forwarded contract on `qp`.
        unsafe { modify_qp(qp, &mut attr, mask, "ibv_modify_qp(RTS)") }
    }
}

/// `ibv_modify_qp` with a typed error.
///
/// # Safety
/// `qp` is a live queue pair.
unsafe fn modify_qp(
    qp: *mut rdma_mummy_sys::ibv_qp,
    attr: &mut rdma_mummy_sys::ibv_qp_attr,
    mask: rdma_mummy_sys::ibv_qp_attr_mask,
    what: &'static str,
) -> Result<(), VerbsError> {
    // SAFETY: forwarded contract; `attr` is valid for the call.
    let rc = unsafe { rdma_mummy_sys::ibv_modify_qp(qp, attr, mask.0 as i32) };
    if rc == 0 {
        Ok(())
    } else {
        Err(verb(what)(io::Error::from_raw_os_error(rc)))
    }
}

/// Whether a queue pair is in the error state as the device reports it now
/// (`ibv_query_qp`); a failing query counts as an error.
///
/// # Safety
/// `qp` is a live queue pair.
unsafe fn qp_in_error(qp: *mut rdma_mummy_sys::ibv_qp) -> bool {
    // SAFETY: all-zero attribute structs are valid out-parameters.
    let (mut attr, mut init): (
        rdma_mummy_sys::ibv_qp_attr,
        rdma_mummy_sys::ibv_qp_init_attr,
    ) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    let mask = rdma_mummy_sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
    // SAFETY: forwarded contract; the out-parameters are valid.
    let rc = unsafe { rdma_mummy_sys::ibv_query_qp(qp, &mut attr, mask, &mut init) };
    rc != 0 || attr.qp_state == rdma_mummy_sys::ibv_qp_state::IBV_QPS_ERR
}

/// A shared receive queue: receive buffers posted once for every queue pair
/// attached to it, so a receiving agent keeps one pool (and one thread)
/// however many peers send to it. Receives complete on its completion
/// queue; each completion names the queue pair it came through.
///
/// Drop order: the queue pairs attached hold an `Arc` to it, so it is
/// destroyed after them; then its completion queue, then the channel
/// (fields in declaration order), then the protection domain.
pub struct SharedReceiveQueue {
    srq: std::ptr::NonNull<rdma_mummy_sys::ibv_srq>,
    cq: GenericCompletionQueue,
    channel: Arc<CompletionChannel>,
    /// Held so that the protection domain outlives the queue.
    _pd: Arc<ProtectionDomain>,
    depth: u32,
}

// SAFETY: verbs objects may be used from any thread; posting to a shared
// receive queue and polling a completion queue are thread-safe in
// libibverbs.
unsafe impl Send for SharedReceiveQueue {}
// SAFETY: as above; `&self` methods are the thread-safe verbs.
unsafe impl Sync for SharedReceiveQueue {}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        // SAFETY: no queue pair uses it any more (they hold `Arc`s to us).
        let rc = unsafe { rdma_mummy_sys::ibv_destroy_srq(self.srq.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = rc, "ibv_destroy_srq failed");
        }
    }
}

impl std::fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("depth", &self.depth)
            .finish()
    }
}

impl SharedReceiveQueue {
    /// How many receives it holds.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Posts a receive buffer, for whichever attached queue pair gets the
    /// next message.
    ///
    /// # Safety
    /// The buffer must stay registered and valid until the receive
    /// completes or the queue is destroyed.
    ///
    /// # Errors
    /// `ibv_post_srq_recv`'s error.
    pub unsafe fn post_recv(&self, wr_id: u64, sge: Sge) -> Result<(), VerbsError> {
        let mut list = rdma_mummy_sys::ibv_sge::from(sge);
        let mut wr = rdma_mummy_sys::ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut list,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the queue is alive; `wr` and its list are valid for the
        // call (the device copies them); the buffer's validity is the
        // caller's promise.
        let rc = unsafe { rdma_mummy_sys::ibv_post_srq_recv(self.srq.as_ptr(), &mut wr, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(verb("ibv_post_srq_recv")(io::Error::from_raw_os_error(rc)))
        }
    }

    /// Appends up to 32 completions to `out`, each with the number of the
    /// queue pair it arrived on; returns how many.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll(&self, out: &mut Vec<(u32, WorkCompletion)>) -> Result<usize, VerbsError> {
        // SAFETY: the completion queue is alive (we hold it).
        let cq = unsafe { self.cq.cq() };
        poll_raw(cq, |w| {
            out.push((w.qp_num, WorkCompletion::from_wc(w, false)));
        })
    }

    /// Sleeping until a receive completes ([`CqEvents`]).
    pub fn events(&self) -> CqEvents {
        CqEvents {
            channel: Arc::clone(&self.channel),
            cq: self.cq.clone(),
        }
    }
}

/// A reliable-connected queue pair whose receives come from a
/// [`SharedReceiveQueue`]: the receiving end of a connection.
///
/// Drop order: the queue pair is destroyed first (its `Drop`), then its
/// `Arc` on the shared receive queue is released.
pub struct SrqQueuePair {
    qp: std::ptr::NonNull<rdma_mummy_sys::ibv_qp>,
    path: QpPath,
    /// Held so that the shared receive queue outlives the queue pair.
    _srq: Arc<SharedReceiveQueue>,
}

// SAFETY: verbs objects may be used from any thread; the methods that
// change the queue pair take `&mut self`.
unsafe impl Send for SrqQueuePair {}
// SAFETY: `&self` methods only read (`ibv_query_qp`) or return copies.
unsafe impl Sync for SrqQueuePair {}

impl Drop for SrqQueuePair {
    fn drop(&mut self) {
        // SAFETY: we own the queue pair; nothing uses it after this.
        let rc = unsafe { rdma_mummy_sys::ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = rc, "ibv_destroy_qp failed");
        }
    }
}

impl std::fmt::Debug for SrqQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SrqQueuePair")
            .field("qpn", &self.qp_num())
            .finish()
    }
}

impl SrqQueuePair {
    /// The queue pair number (what [`SharedReceiveQueue::poll`] reports).
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the queue pair is alive; `qp_num` is set at creation.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    /// Sets the local ACK timeout (as [`RcQueuePair::set_ack_timeout`]).
    pub fn set_ack_timeout(&mut self, exp: u8) {
        self.path.ack_timeout = exp.clamp(1, 31);
    }

    /// This queue pair's address, for the peer.
    pub fn info(&self) -> QpInfo {
        self.path.info(self.qp_num())
    }

    /// Connects to `remote`: INIT → RTR → RTS.
    ///
    /// # Errors
    /// `ibv_modify_qp`'s error for the failing transition.
    pub fn connect(&mut self, remote: &QpInfo) -> Result<(), VerbsError> {
        // SAFETY: the queue pair is alive and in INIT (created so).
        unsafe { self.path.connect(self.qp.as_ptr(), remote) }
    }

    /// Whether the queue pair is in the error state, as the device
    /// reports it now.
    pub fn is_error(&self) -> bool {
        // SAFETY: the queue pair is alive.
        unsafe { qp_in_error(self.qp.as_ptr()) }
    }
}

/// One local piece of a work request: `len` bytes at `addr` in the region
/// with `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Local key of the memory region.
    pub lkey: u32,
    /// Address.
    pub addr: u64,
    /// Length.
    pub len: u32,
}

impl From<Sge> for rdma_mummy_sys::ibv_sge {
    fn from(s: Sge) -> Self {
        Self {
            addr: s.addr,
            length: s.len,
            lkey: s.lkey,
        }
    }
}

impl From<(u32, u64, u32)> for Sge {
    /// From `(lkey, addr, len)`.
    fn from((lkey, addr, len): (u32, u64, u32)) -> Self {
        Self { lkey, addr, len }
    }
}

/// What one work request of a [`RcQueuePair::post_batch`] does.
#[derive(Clone, Copy, Debug)]
pub enum PostOp {
    /// RDMA WRITE of the gathered pieces to `remote_addr`, with immediate
    /// data when `imm` is given.
    Write {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
        /// Immediate data.
        imm: Option<u32>,
    },
    /// RDMA READ from `remote_addr`, scattered into the pieces.
    Read {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
    },
    /// SEND of the gathered pieces with immediate data.
    Send {
        /// Immediate data.
        imm: u32,
    },
}

/// One work request of a batch.
#[derive(Clone, Copy, Debug)]
pub struct Post<'a> {
    /// Returned in its completion.
    pub wr_id: u64,
    /// The operation.
    pub op: PostOp,
    /// Local pieces, in order.
    pub sges: &'a [Sge],
}

impl<'a> Post<'a> {
    /// The piece this work request carries inline, if it does: a WRITE or
    /// SEND of one piece of at most [`MAX_INLINE`] bytes (copied into the
    /// work request when posted, so the device reads no memory region).
    fn inline_piece(&self) -> Option<&'a Sge> {
        match (self.op, self.sges) {
            (PostOp::Read { .. }, _) => None,
            (_, [one]) if one.len <= MAX_INLINE => Some(one),
            _ => None,
        }
    }
}

/// A completed work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The id given when posting.
    pub wr_id: u64,
    /// `ibv_wc_status` (0 = success).
    pub status: u32,
    /// Vendor error.
    pub vendor_err: u32,
    /// Bytes received (receives).
    pub byte_len: u32,
    /// Immediate data (receives of WRITE_WITH_IMM / SEND_WITH_IMM).
    pub imm: u32,
}

impl WorkCompletion {
    /// From a work completion; `imm`: keep its immediate data (a shared
    /// receive queue's completions carry none the caller reads).
    fn from_wc(w: &rdma_mummy_sys::ibv_wc, imm: bool) -> Self {
        // SAFETY: a plain integer in either member of the union.
        let raw = unsafe { w.imm_data_invalidated_rkey_union.imm_data };
        Self {
            wr_id: w.wr_id,
            status: w.status,
            vendor_err: w.vendor_err,
            byte_len: w.byte_len,
            imm: if imm { raw } else { 0 },
        }
    }

    /// The completion as a result.
    ///
    /// # Errors
    /// [`VerbsError::WorkCompletion`] for an error status.
    pub fn ok(&self) -> Result<(), VerbsError> {
        if self.status == 0 {
            Ok(())
        } else {
            Err(VerbsError::WorkCompletion {
                wr_id: self.wr_id,
                status: self.status,
                status_name: wc_status_name(self.status),
                vendor_err: self.vendor_err,
            })
        }
    }
}

/// A reliable-connected queue pair and its completion queues.
pub struct RcQueuePair {
    // Declared first: destroyed before the completion queues it uses.
    qp: GenericQueuePair,
    send_cq: GenericCompletionQueue,
    recv_cq: GenericCompletionQueue,
    /// The send completion queue's channel, when created with events. The
    /// completion queue holds a reference too, so the channel is destroyed
    /// after it.
    channel: Option<Arc<CompletionChannel>>,
    /// The receive completion queue's channel, likewise.
    recv_channel: Option<Arc<CompletionChannel>>,
    path: QpPath,
    max_sge: u32,
}

/// Bytes a WRITE or SEND carries inside its work request instead of
/// through a gather list (asked of every queue pair at creation; perftest
/// inlines up to 220 in its latency tests): the device reads no memory
/// region for them, and the source is free again once posted.
pub const MAX_INLINE: u32 = 64;

/// The local ACK timeout exponent a queue pair gets unless
/// [`RcQueuePair::set_ack_timeout`] says otherwise: 4.096 µs × 2^14 ≈ 67 ms,
/// perftest's default and a common choice on RoCE fabrics.
pub const DEFAULT_ACK_TIMEOUT: u8 = 14;

/// Connection parameters, chosen for RoCE and documented in
/// `docs/architecture.md`: local ACK timeout [`DEFAULT_ACK_TIMEOUT`], 7
/// transport retries, 7 RNR retries (infinite), minimum RNR timer 12
/// (0.64 ms), 16 outstanding RDMA READs each way.
const QP_RETRY_CNT: u8 = 7;
const QP_RNR_RETRY: u8 = 7;
const QP_MIN_RNR_TIMER: u8 = 12;
const QP_RD_ATOMIC: u8 = 16;

impl RcQueuePair {
    /// Sets the local ACK timeout that [`connect`](Self::connect) gives the
    /// queue pair: the requester retransmits after 4.096 µs × 2^`exp`
    /// without an acknowledgement (7 times, then the queue pair fails).
    /// `exp` is clamped to 1..=31 (0 would mean never, and a lost packet
    /// would then stall the queue pair for good).
    pub fn set_ack_timeout(&mut self, exp: u8) {
        self.path.ack_timeout = exp.clamp(1, 31);
    }

    /// This queue pair's address, for the peer.
    pub fn info(&self) -> QpInfo {
        self.path.info(self.qp.qp_number())
    }

    /// Connects to `remote`: INIT → RTR → RTS.
    ///
    /// # Errors
    /// `ibv_modify_qp`'s error for the failing transition.
    pub fn connect(&mut self, remote: &QpInfo) -> Result<(), VerbsError> {
        // SAFETY: the queue pair is alive (we own it) and in INIT.
        unsafe { self.path.connect(self.qp.qp().as_ptr(), remote) }
    }

    /// Whether the queue pair is in the error state, as the device reports
    /// it now (`ibv_query_qp`; the cached state does not see transitions the
    /// hardware makes on a failed completion).
    pub fn is_error(&self) -> bool {
        // SAFETY: the queue pair is alive (we own it).
        unsafe { qp_in_error(self.qp.qp().as_ptr()) }
    }

    /// Most scatter-gather entries per work request on this queue pair.
    pub fn max_sge(&self) -> u32 {
        self.max_sge
    }

    /// Posts an RDMA WRITE of `sges` (gathered in order) to `remote_addr`
    /// with `rkey`, with immediate data when `imm` is given.
    ///
    /// # Safety
    /// The local pieces must stay registered and valid until the request
    /// completes.
    ///
    /// # Errors
    /// `ibv_post_send`'s error.
    pub unsafe fn post_write(
        &mut self,
        wr_id: u64,
        sges: &[Sge],
        rkey: u32,
        remote_addr: u64,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<(), VerbsError> {
        let op = PostOp::Write {
            rkey,
            remote_addr,
            imm,
        };
        // SAFETY: forwarded contract.
        unsafe { self.post_one(wr_id, op, sges, signaled) }
    }

    /// Posts an RDMA READ from `remote_addr` (with `rkey`) scattered into
    /// `sges` in order.
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write).
    ///
    /// # Errors
    /// `ibv_post_send`'s error.
    pub unsafe fn post_read(
        &mut self,
        wr_id: u64,
        sges: &[Sge],
        rkey: u32,
        remote_addr: u64,
        signaled: bool,
    ) -> Result<(), VerbsError> {
        let op = PostOp::Read { rkey, remote_addr };
        // SAFETY: forwarded contract.
        unsafe { self.post_one(wr_id, op, sges, signaled) }
    }

    /// Posts a SEND of a small inline message with immediate data.
    ///
    /// # Errors
    /// `ibv_post_send`'s error.
    pub fn post_send_inline(&mut self, wr_id: u64, msg: &[u8], imm: u32) -> Result<(), VerbsError> {
        let mut guard = self.qp.start_post_send();
        guard
            .construct_wr(wr_id, WorkRequestFlags::Signaled | WorkRequestFlags::Inline)
            .setup_send_imm(imm)
            .setup_inline_data(msg);
        guard
            .post()
            .map_err(|e| verb("ibv_post_send(SEND)")(other(e)))
    }

    /// Posts a SEND of `sges` with immediate data (signaled).
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write).
    ///
    /// # Errors
    /// `ibv_post_send`'s error.
    pub unsafe fn post_send(
        &mut self,
        wr_id: u64,
        sges: &[Sge],
        imm: u32,
    ) -> Result<(), VerbsError> {
        // SAFETY: forwarded contract.
        unsafe { self.post_one(wr_id, PostOp::Send { imm }, sges, true) }
    }

    /// Whether a failed [`post_batch`](Self::post_batch) posted none of
    /// its work requests: true on queue pairs built with the extended verbs
    /// (`ibv_wr_start` … `ibv_wr_complete`, which discards the whole batch
    /// on error); false on basic ones, where `ibv_post_send` may have posted
    /// a prefix — post one work request per batch there.
    pub fn batch_is_atomic(&self) -> bool {
        matches!(self.qp, GenericQueuePair::Extended(_))
    }

    /// Posts `wrs` in order with one doorbell, each signaled: one system
    /// call (soft-RoCE) or one MMIO write (hardware) for the whole batch.
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write), for every work request.
    ///
    /// # Errors
    /// The post's error; see [`batch_is_atomic`](Self::batch_is_atomic)
    /// for what was posted then.
    pub unsafe fn post_batch(&mut self, wrs: &[Post<'_>]) -> Result<(), VerbsError> {
        // SAFETY: forwarded contract.
        unsafe { self.post_wrs(wrs, true) }
    }

    /// One work request, signaled or not.
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write).
    unsafe fn post_one(
        &mut self,
        wr_id: u64,
        op: PostOp,
        sges: &[Sge],
        signaled: bool,
    ) -> Result<(), VerbsError> {
        let w = [Post { wr_id, op, sges }];
        // SAFETY: forwarded contract.
        unsafe { self.post_wrs(&w, signaled) }
    }

    /// # Safety
    /// As [`post_write`](Self::post_write).
    unsafe fn post_wrs(&mut self, wrs: &[Post<'_>], signaled: bool) -> Result<(), VerbsError> {
        match wrs {
            [] => return Ok(()),
            // SAFETY: forwarded contract.
            [w] if SharedPoster::fits(w) => return unsafe { self.post_direct(w, signaled) },
            _ => {}
        }
        let flags = send_flags(signaled);
        // One scratch list for the whole batch: each work request's list is
        // copied when it is set up. Short lists (the common case) stay on
        // the stack.
        let longest = wrs.iter().map(|w| w.sges.len()).max().unwrap_or(0);
        let blank = rdma_mummy_sys::ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        let mut stack = [blank; 4];
        let mut heap = Vec::new();
        let scratch: &mut [rdma_mummy_sys::ibv_sge] = if longest <= stack.len() {
            &mut stack
        } else {
            heap.resize(longest, blank);
            &mut heap
        };
        let mut guard = self.qp.start_post_send();
        for w in wrs {
            let inline = w.inline_piece();
            // The flag too: soft-RoCE reads the inline bytes only with it
            // (without, the work request fails with a local QP error).
            let wr_flags = match inline {
                Some(_) => flags | WorkRequestFlags::Inline,
                None => flags,
            };
            let wr = guard.construct_wr(w.wr_id, wr_flags);
            let h = match w.op {
                PostOp::Write {
                    rkey,
                    remote_addr,
                    imm: Some(i),
                } => wr.setup_write_imm(rkey, remote_addr, i),
                PostOp::Write {
                    rkey,
                    remote_addr,
                    imm: None,
                } => wr.setup_write(rkey, remote_addr),
                PostOp::Read { rkey, remote_addr } => wr.setup_read(rkey, remote_addr),
                PostOp::Send { imm } => wr.setup_send_imm(imm),
            };
            match inline {
                Some(one) => {
                    // SAFETY: forwarded contract: the piece is valid memory
                    // (a registered region the caller holds) for at least
                    // this call; its bytes are copied into the work request
                    // here.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(one.addr as *const u8, one.len as usize)
                    };
                    h.setup_inline_data(bytes);
                }
                None => {
                    for (r, &s) in scratch.iter_mut().zip(w.sges) {
                        *r = s.into();
                    }
                    // SAFETY: forwarded contract: the pieces stay valid until
                    // the work request completes. The list is copied at once.
                    unsafe { h.setup_sge_list(&scratch[..w.sges.len()]) }
                }
            }
        }
        guard.post().map_err(|e| verb("ibv_post_send")(other(e)))
    }

    /// Posts one work request with `ibv_post_send` ([`post_direct_raw`]).
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write); `w.sges` has at most
    /// [`DIRECT_SGES`] entries.
    unsafe fn post_direct(&mut self, w: &Post<'_>, signaled: bool) -> Result<(), VerbsError> {
        // SAFETY: the queue pair is alive (we own it); the rest is the
        // forwarded contract.
        unsafe { post_direct_raw(self.qp.qp(), w, signaled) }
    }

    /// A handle that posts lone work requests to this queue pair from any
    /// thread, without `&mut` access ([`SharedPoster::post`]): what a
    /// latency-bound caller posts while other threads may be posting
    /// batches through [`post_batch`](Self::post_batch).
    ///
    /// # Safety
    /// The handle must not be used after this queue pair is dropped.
    pub unsafe fn shared_poster(&self) -> SharedPoster {
        // SAFETY: the queue pair is alive now; the caller keeps the handle
        // from outliving it.
        SharedPoster(unsafe { self.qp.qp() })
    }

    /// Moves the queue pair to the error state: every outstanding work
    /// request then completes with `IBV_WC_WR_FLUSH_ERR`.
    ///
    /// # Errors
    /// `ibv_modify_qp`'s error.
    pub fn set_error(&mut self) -> Result<(), VerbsError> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.qp
            .modify(&attr)
            .map_err(|e| verb("ibv_modify_qp(ERR)")(other(e)))
    }

    /// A handle on the send completion queue, usable without the queue pair.
    pub fn send_poller(&self) -> CqPoller {
        CqPoller(self.send_cq.clone())
    }

    /// Completion events of the send queue, when created with them.
    pub fn send_events(&self) -> Option<CqEvents> {
        self.channel.as_ref().map(|ch| CqEvents {
            channel: Arc::clone(ch),
            cq: self.send_cq.clone(),
        })
    }

    /// The receive completion queue's channel, when created with receive
    /// events.
    pub fn recv_events(&self) -> Option<CqEvents> {
        self.recv_channel.as_ref().map(|ch| CqEvents {
            channel: Arc::clone(ch),
            cq: self.recv_cq.clone(),
        })
    }

    /// A handle on the receive completion queue, usable without the queue pair.
    pub fn recv_poller(&self) -> CqPoller {
        CqPoller(self.recv_cq.clone())
    }

    /// Posts a receive buffer.
    ///
    /// # Safety
    /// The buffer must stay registered and valid until the receive completes
    /// or the queue pair is destroyed.
    ///
    /// # Errors
    /// `ibv_post_recv`'s error.
    pub unsafe fn post_recv(&mut self, wr_id: u64, sge: Sge) -> Result<(), VerbsError> {
        let mut guard = self.qp.start_post_recv();
        let h = guard.construct_wr(wr_id);
        // SAFETY: forwarded contract.
        unsafe { h.setup_sge(sge.lkey, sge.addr, sge.len) };
        guard.post().map_err(|e| verb("ibv_post_recv")(other(e)))
    }

    /// Appends the send queue's completions to `out`; returns how many.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll_send(&self, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
        poll(&self.send_cq, out)
    }

    /// Appends the receive queue's completions to `out`; returns how many.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll_recv(&self, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
        poll(&self.recv_cq, out)
    }
}

/// A completion queue handle that polls without holding the queue pair
/// (the queue pair is usually behind a lock for posting).
#[derive(Clone)]
pub struct CqPoller(GenericCompletionQueue);

impl CqPoller {
    /// Appends completions to `out`; returns how many.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll(&self, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
        poll(&self.0, out)
    }

    /// Hands each completion to `each` as it is polled (no buffer);
    /// returns how many there were.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll_each(&self, each: impl FnMut(&WorkCompletion)) -> Result<usize, VerbsError> {
        poll_each(&self.0, each)
    }
}

/// Sleeping until a completion queue has news, instead of polling it:
/// arm, re-poll (a completion may have arrived before arming), then
/// [`wait`](Self::wait).
pub struct CqEvents {
    channel: Arc<CompletionChannel>,
    cq: GenericCompletionQueue,
}

impl CqEvents {
    /// Requests an event for the next completion (`ibv_req_notify_cq`).
    ///
    /// # Errors
    /// The verb's error.
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the completion queue is alive (we hold it).
        let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(verb("ibv_req_notify_cq")(io::Error::from_raw_os_error(rc)))
        }
    }

    /// Waits up to `timeout` for an event; consumes and acknowledges it.
    /// Returns whether one came.
    ///
    /// # Errors
    /// `poll` or `ibv_get_cq_event`'s error.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<bool, VerbsError> {
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&*self.channel),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(verb("poll(completion channel)")(e));
        }
        if n == 0 {
            return Ok(false);
        }
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the channel is alive and non-blocking; the out pointers
        // point to locals.
        let rc = unsafe {
            rdma_mummy_sys::ibv_get_cq_event(
                self.channel.comp_channel().as_ptr(),
                &mut cq,
                &mut ctx,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(false);
            }
            return Err(verb("ibv_get_cq_event")(e));
        }
        // SAFETY: `cq` is the completion queue the event came from (ours,
        // alive); each event is acknowledged once, so destroying the queue
        // never waits for unacknowledged events.
        unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }
}

fn send_flags(signaled: bool) -> WorkRequestFlags {
    if signaled {
        WorkRequestFlags::Signaled
    } else {
        WorkRequestFlags::none()
    }
}

/// Longest gather list a lone work request is posted with directly
/// (`ibv_post_send`, list on the stack); longer ones take the batch path.
const DIRECT_SGES: usize = 4;

/// Posts one signaled-or-not work request with `ibv_post_send`, its work
/// request and gather list built on the stack. (The extended API's start,
/// set-up and complete calls, through sideway's guards, cost about twice the
/// instructions for one work request: callgrind in the soft-RoCE guest,
/// the git history of `docs/benchmarks.md`.) One work request is posted whole or not at all,
/// as with the extended API.
///
/// # Safety
/// `qp` is a live queue pair; the pieces of `w` (at most [`DIRECT_SGES`])
/// stay registered and valid until the work request completes.
unsafe fn post_direct_raw(
    qp: std::ptr::NonNull<rdma_mummy_sys::ibv_qp>,
    w: &Post<'_>,
    signaled: bool,
) -> Result<(), VerbsError> {
    use rdma_mummy_sys as sys;
    let blank = sys::ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    };
    let mut list = [blank; DIRECT_SGES];
    for (r, &s) in list.iter_mut().zip(w.sges) {
        *r = s.into();
    }
    let mut flags = if signaled {
        sys::ibv_send_flags::IBV_SEND_SIGNALED.0
    } else {
        0
    };
    if w.inline_piece().is_some() {
        flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
    }
    let (opcode, imm, remote_addr, rkey) = match w.op {
        PostOp::Write {
            rkey,
            remote_addr,
            imm: None,
        } => (sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE, 0, remote_addr, rkey),
        PostOp::Write {
            rkey,
            remote_addr,
            imm: Some(i),
        } => (
            sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            i,
            remote_addr,
            rkey,
        ),
        PostOp::Read { rkey, remote_addr } => {
            (sys::ibv_wr_opcode::IBV_WR_RDMA_READ, 0, remote_addr, rkey)
        }
        PostOp::Send { imm } => (sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, imm, 0, 0),
    };
    // SAFETY: an all-zero `ibv_send_wr` is valid (null pointers, zero
    // counts); the fields this post uses are set below.
    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = w.wr_id;
    wr.sg_list = list.as_mut_ptr();
    wr.num_sge = w.sges.len().min(DIRECT_SGES) as i32;
    wr.opcode = opcode;
    wr.send_flags = flags;
    // Passed as given, as the extended API's set-up calls do.
    wr.imm_data_invalidated_rkey_union.imm_data = imm;
    wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
    let mut bad = std::ptr::null_mut();
    // SAFETY: the queue pair is alive (the caller's promise); `wr` and
    // `list` outlive the call, which copies them (and the inline bytes);
    // the pieces stay valid until the completion (forwarded contract).
    // `ibv_post_send` is thread-safe: the provider serializes the posts to
    // one send queue, and against the extended API's start…complete
    // sections on it.
    let rc = unsafe { sys::ibv_post_send(qp.as_ptr(), &mut wr, &mut bad) };
    if rc == 0 {
        Ok(())
    } else {
        Err(verb("ibv_post_send")(io::Error::from_raw_os_error(rc)))
    }
}

/// Posts lone work requests to one queue pair through a shared reference,
/// from any thread ([`RcQueuePair::shared_poster`]): `ibv_post_send` is
/// thread-safe in libibverbs (the provider locks the send queue for each
/// post, and around the extended API's start…complete sections), so a
/// caller that posts one work request needs no lock of its own on the
/// queue pair. Valid while the queue pair lives (the creator's promise).
#[derive(Clone, Copy, Debug)]
pub struct SharedPoster(std::ptr::NonNull<rdma_mummy_sys::ibv_qp>);

// SAFETY: the pointer is only handed to `ibv_post_send`, which is
// thread-safe; the queue pair's lifetime is the creator's promise.
unsafe impl Send for SharedPoster {}
// SAFETY: as above: every use is a thread-safe verb.
unsafe impl Sync for SharedPoster {}

impl SharedPoster {
    /// Whether [`post`](Self::post) takes `w` (at most four pieces; longer
    /// lists go through [`RcQueuePair::post_batch`]).
    pub fn fits(w: &Post<'_>) -> bool {
        w.sges.len() <= DIRECT_SGES
    }

    /// Posts `w`, signaled.
    ///
    /// # Safety
    /// The queue pair is alive; `w` [`fits`](Self::fits); its pieces stay
    /// registered and valid until the work request completes.
    ///
    /// # Errors
    /// `ibv_post_send`'s error (nothing was posted).
    pub unsafe fn post(&self, w: &Post<'_>) -> Result<(), VerbsError> {
        // SAFETY: forwarded contract.
        unsafe { post_direct_raw(self.0, w, true) }
    }
}

/// Work completions one poll takes at most.
const POLL_BATCH: usize = 32;

fn poll(cq: &GenericCompletionQueue, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
    poll_each(cq, |c| out.push(*c))
}

/// Polls `cq` once, handing each completion to `each` as it comes (no
/// buffer); returns how many there were.
fn poll_each(
    cq: &GenericCompletionQueue,
    mut each: impl FnMut(&WorkCompletion),
) -> Result<usize, VerbsError> {
    let GenericCompletionQueue::Basic(basic) = cq else {
        let poller = match cq.start_poll() {
            Ok(p) => p,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(0),
            Err(e) => return Err(verb("ibv_poll_cq")(other(e))),
        };
        let mut n = 0;
        for wc in poller {
            each(&WorkCompletion {
                wr_id: wc.wr_id(),
                status: wc.status(),
                vendor_err: wc.vendor_err(),
                byte_len: wc.byte_len(),
                imm: wc.imm_data(),
            });
            n += 1;
        }
        return Ok(n);
    };
    // SAFETY: the completion queue is alive (we hold it).
    let cq = unsafe { basic.cq() };
    poll_raw(cq, |w| each(&WorkCompletion::from_wc(w, true)))
}

/// Polls `cq` once with `ibv_poll_cq` into a batch on the stack, handing
/// each work completion to `each`; returns how many there were. (Straight
/// into the stack: sideway's poller allocates its batch, 32 entries or
/// 1.5 KiB, past the allocator's thread cache, on every poll, which cost a
/// busy-polling waiter more than the poll itself — callgrind on a soft-RoCE
/// ping-pong: about 370 instructions a poll.)
fn poll_raw(
    cq: std::ptr::NonNull<rdma_mummy_sys::ibv_cq>,
    mut each: impl FnMut(&rdma_mummy_sys::ibv_wc),
) -> Result<usize, VerbsError> {
    let mut wc = [const { std::mem::MaybeUninit::<rdma_mummy_sys::ibv_wc>::uninit() }; POLL_BATCH];
    // SAFETY: the caller holds the completion queue alive; `wc` has room
    // for `POLL_BATCH` entries, of which the provider writes the first `n`.
    let n = unsafe {
        rdma_mummy_sys::ibv_poll_cq(cq.as_ptr(), POLL_BATCH as i32, wc.as_mut_ptr().cast())
    };
    if n < 0 {
        return Err(verb("ibv_poll_cq")(io::Error::from_raw_os_error(-n)));
    }
    for w in &wc[..n as usize] {
        // SAFETY: the provider wrote the first `n` entries.
        each(unsafe { w.assume_init_ref() });
    }
    Ok(n as usize)
}
