//! The device: opening one (port, GID, limits), its protection domain,
//! memory registration, and making queue pairs (with the path they connect
//! over).

use super::*;

/// An opened device: context, protection domain, the port and GID in use,
/// and the limits the data path must respect.
pub struct Device {
    pub(super) name: String,
    pub(super) port: u8,
    pub(super) gid_index: u32,
    pub(super) gid: [u8; 16],
    pub(super) gid_type: &'static str,
    pub(super) mtu: Mtu,
    pub(super) max_sge: u32,
    pub(super) max_qp_wr: u32,
    /// Receives a shared receive queue may hold (0: none supported).
    pub(super) max_srq_wr: u32,
    pub(super) max_msg_size: u64,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) ctx: Arc<DeviceContext>,
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
pub struct Registered(pub(super) Arc<MemoryRegion>);

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

    /// Registers `len` bytes of a dma-buf (`fd`, from `offset` in it), seen
    /// by peers at virtual address `iova` (`ibv_reg_dmabuf_mr`): GPU memory
    /// exported by its driver. The region keeps its own reference to the
    /// dma-buf; `fd` may be closed afterwards.
    ///
    /// # Safety
    /// The memory behind the dma-buf must stay allocated while the region
    /// is registered (the device may access it).
    ///
    /// # Errors
    /// The failing verb (`EOPNOTSUPP` where the provider or kernel has no
    /// dma-buf support).
    pub unsafe fn register_dmabuf(
        &self,
        fd: std::os::fd::RawFd,
        offset: u64,
        len: u64,
        iova: u64,
    ) -> Result<Registered, VerbsError> {
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        // SAFETY: forwarded contract.
        unsafe {
            self.pd
                .reg_dmabuf_mr(offset, len as usize, iova, fd, access)
        }
        .map(Registered)
        .map_err(|e| verb("ibv_reg_dmabuf_mr")(other(e)))
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
            psn: random_psn(),
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
pub(super) struct QpPath {
    pub(super) port: u8,
    pub(super) gid_index: u32,
    pub(super) gid: [u8; 16],
    /// Active MTU code (`ibv_mtu`).
    pub(super) mtu: u32,
    pub(super) psn: u32,
    /// Local ACK timeout exponent.
    pub(super) ack_timeout: u8,
}

impl QpPath {
    pub(super) fn info(&self, qpn: u32) -> QpInfo {
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
    pub(super) unsafe fn connect(
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
pub(super) unsafe fn modify_qp(
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
pub(super) unsafe fn qp_in_error(qp: *mut rdma_mummy_sys::ibv_qp) -> bool {
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

/// A random initial packet sequence number (24 bits) from the operating
/// system's random source.
///
/// # Panics
/// When the OS has no random source to offer.
fn random_psn() -> u32 {
    getrandom::u32().expect("the OS random source failed") & 0x00ff_ffff
}
