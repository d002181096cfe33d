//! The RDMA path at the target: an RDMA link's attach (the initiator's
//! queue pair) answered with a queue pair connected to the initiator's,
//! its receives posted (on the agent's shared receive queue when it has
//! one) and a thread that delivers the sync messages arriving as SENDs.

use crate::engine::ctx::Ctx;
use crate::engine::peer::ack_timeout;
use crate::engine::rdma::recv::{RdmaReceiver, ReceiverCtx, SrqReceiver, SyncSink};
use crate::engine::wire::status;
use crate::engine::{lock, rdma};
use crate::verbs::QpInfo;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::transport::SrqState;

/// Length of a queue pair's attach message: QPN, PSN and path MTU code
/// (u32 LE each), then the port's 16-byte GID.
const QP_MSG_LEN: usize = 28;

/// A queue pair's attach message (see [`QP_MSG_LEN`]).
pub(in crate::engine) fn qp_msg(q: &QpInfo) -> Vec<u8> {
    let mut v = Vec::with_capacity(QP_MSG_LEN);
    for x in [q.qpn, q.psn, q.mtu] {
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.extend_from_slice(&q.gid);
    v
}

/// The queue pair an attach message describes; `None` if it is not one.
pub(in crate::engine) fn qp_from_msg(m: &[u8]) -> Option<QpInfo> {
    if m.len() != QP_MSG_LEN {
        return None;
    }
    let word = |i: usize| u32::from_le_bytes(m[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    Some(QpInfo {
        qpn: word(0),
        psn: word(1),
        mtu: word(2),
        gid: m[12..].try_into().expect("16 bytes"),
    })
}

impl super::transport::Rdma {
    /// An RDMA link's attach: a queue pair connected to the
    /// initiator's, receive buffers posted, and a thread that delivers the
    /// sync messages arriving as SENDs.
    pub(in crate::engine) fn accept_qp(
        &self,
        cx: Ctx<'_>,
        remote: &QpInfo,
        remote_name: &str,
        sock: &TcpStream,
    ) -> Result<(QpInfo, RdmaReceiver), u16> {
        let dev = &self.device;
        let sink = SyncSink {
            inbox: Arc::clone(cx.inbox()),
            remote: remote_name.to_owned(),
            sock: sock.try_clone().map_err(|_| status::ATTACH_FAILED)?,
            io_timeout: cx.config().io_timeout,
        };
        let refused = |e: crate::verbs::VerbsError| {
            tracing::warn!(remote = %remote_name, error = %e, "cannot accept an RDMA connection");
            status::ATTACH_FAILED
        };
        if let Some(rx) = self.srq_receiver(cx) {
            let mut qp = dev.create_rc_on_srq(&rx.shared.srq).map_err(refused)?;
            qp.set_ack_timeout(ack_timeout(cx.config()));
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
        let ack_timeout = ack_timeout(cx.config());
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
            .map_err(|_| status::ATTACH_FAILED)?;
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
    fn srq_receiver(&self, cx: Ctx<'_>) -> Option<Arc<SrqReceiver>> {
        let dev = &self.device;
        let mut st = lock(&self.srq);
        match &*st {
            SrqState::Ready(rx) => return Some(Arc::clone(rx)),
            SrqState::PerQueuePair => return None,
            SrqState::Untried => {}
        }
        if !cx.config().rdma.srq {
            *st = SrqState::PerQueuePair;
            return None;
        }
        match SrqReceiver::start(dev, &cx.config().name) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_pair_message_round_trips_and_nothing_else_passes() {
        let q = QpInfo {
            qpn: 0x11_2233,
            psn: 0xab_cdef,
            mtu: 3,
            gid: [9; 16],
        };
        let m = qp_msg(&q);
        assert_eq!(m.len(), QP_MSG_LEN);
        let back = qp_from_msg(&m).unwrap();
        assert_eq!(
            (back.qpn, back.psn, back.mtu, back.gid),
            (q.qpn, q.psn, q.mtu, q.gid)
        );
        assert!(qp_from_msg(&m[..27]).is_none());
        assert!(qp_from_msg(&[m.clone(), vec![0]].concat()).is_none());
    }
}
