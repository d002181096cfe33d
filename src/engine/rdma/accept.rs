//! The RDMA path at the target: `QpConnect` answered with a queue pair
//! connected to the initiator's, its receives posted (on the agent's shared
//! receive queue when it has one) and a thread that delivers the sync
//! messages arriving as SENDs.

use crate::engine::*;

impl Inner {
    /// Serves `QpConnect` (the initiator's queue pair: number, PSN, MTU,
    /// then its GID): answers `QpAccept` with this side's, or with the
    /// refusal. Returns the connection's receiver, to keep while it lives.
    pub(in crate::engine) fn qp_connect(
        &self,
        c: &mut Conn<'_, '_, '_>,
        qpn: u32,
        psn: u32,
        mtu: u32,
    ) -> io::Result<Option<RdmaReceiver>> {
        let gid: [u8; 16] = c
            .reader
            .read_vec(16, c.idle)?
            .try_into()
            .map_err(|_| violation("short GID"))?;
        let remote = QpInfo { qpn, psn, gid, mtu };
        match self.accept_qp(&remote, &c.session.remote, c.sock) {
            Ok((info, receiver)) => {
                let hdr = Frame::QpAccept {
                    qpn: info.qpn,
                    psn: info.psn,
                    mtu: info.mtu,
                    status: status::OK,
                }
                .encode();
                let mut iovs = [iov(hdr.as_ptr(), HEADER_LEN), iov(info.gid.as_ptr(), 16)];
                // SAFETY: both iovecs point into live locals.
                unsafe {
                    writev_all(
                        c.sock.as_raw_fd(),
                        &mut iovs,
                        c.idle.clock,
                        self.config.io_timeout,
                    )?
                };
                Ok(Some(receiver))
            }
            Err(st) => {
                let refusal = Frame::QpAccept {
                    qpn: 0,
                    psn: 0,
                    mtu: 0,
                    status: st,
                };
                c.send(&[refusal.encode()], self.config.io_timeout)?;
                Ok(None)
            }
        }
    }

    /// Target side of `QpConnect`: a queue pair connected to the
    /// initiator's, receive buffers posted, and a thread that delivers the
    /// sync messages arriving as SENDs.
    pub(in crate::engine) fn accept_qp(
        &self,
        remote: &QpInfo,
        remote_name: &str,
        sock: &TcpStream,
    ) -> Result<(QpInfo, RdmaReceiver), u16> {
        let Some(dev) = self.device.as_ref() else {
            return Err(status::NO_RDMA);
        };
        let sink = SyncSink {
            inbox: Arc::clone(&self.inbox),
            remote: remote_name.to_owned(),
            sock: sock.try_clone().map_err(|_| status::QP_FAILED)?,
            io_timeout: self.config.io_timeout,
        };
        let refused = |e: crate::verbs::VerbsError| {
            tracing::warn!(remote = %remote_name, error = %e, "cannot accept an RDMA connection");
            status::QP_FAILED
        };
        if let Some(rx) = self.srq_receiver(dev) {
            let mut qp = dev.create_rc_on_srq(&rx.shared.srq).map_err(refused)?;
            qp.set_ack_timeout(ack_timeout(&self.config));
            qp.connect(remote).map_err(refused)?;
            let info = qp.info();
            lock(&rx.shared.conns).insert(info.qpn, Arc::new(sink));
            return Ok((
                info,
                RdmaReceiver::Shared {
                    qpn: info.qpn,
                    _qp: qp,
                    rx,
                },
            ));
        }
        let ack_timeout = ack_timeout(&self.config);
        let setup =
            || -> Result<(crate::verbs::RcQueuePair, rdma::MsgRing), crate::verbs::VerbsError> {
                // Receive events: the thread sleeps until a SEND lands.
                let mut qp = dev.create_rc_with_events(rdma::WINDOW, false, true)?;
                qp.set_ack_timeout(ack_timeout);
                qp.connect(remote)?;
                let ring = rdma::MsgRing::new(dev, rdma::RING)?;
                for slot in 0..rdma::RING {
                    // SAFETY: the ring lives in the receiver thread with the queue
                    // pair, and is dropped after it.
                    unsafe { qp.post_recv(slot as u64, ring.sge(slot, rdma::SYNC_MAX))? };
                }
                Ok((qp, ring))
            };
        let (qp, ring) = setup().map_err(refused)?;
        let info = qp.info();
        let stop = Arc::new(AtomicBool::new(false));
        let ctx = ReceiverCtx {
            sink,
            stop: Arc::clone(&stop),
        };
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-rdma-recv-{remote_name}"))
            .spawn(move || ctx.run(qp, ring))
            .map_err(|_| status::QP_FAILED)?;
        Ok((
            info,
            RdmaReceiver::Own {
                stop,
                thread: Some(thread),
            },
        ))
    }

    /// The agent's shared receive queue and thread, made on first use;
    /// `None` when connections receive on their own queues (configuration,
    /// or a device that cannot make one: logged once).
    pub(in crate::engine) fn srq_receiver(&self, dev: &Arc<Device>) -> Option<Arc<SrqReceiver>> {
        let mut st = lock(&self.srq_rx);
        match &*st {
            SrqState::Ready(rx) => return Some(Arc::clone(rx)),
            SrqState::PerQueuePair => return None,
            SrqState::Untried => {}
        }
        if !self.config.rdma.srq {
            *st = SrqState::PerQueuePair;
            return None;
        }
        match SrqReceiver::start(dev, &self.config.name) {
            Ok(rx) => {
                tracing::info!(device = %dev.name(), depth = rx.shared.srq.depth(), "RDMA connections share one receive queue");
                *st = SrqState::Ready(Arc::clone(&rx));
                Some(rx)
            }
            Err(e) => {
                tracing::info!(device = %dev.name(), error = %e, "no shared receive queue; each RDMA connection posts its own receive buffers");
                *st = SrqState::PerQueuePair;
                None
            }
        }
    }
}
