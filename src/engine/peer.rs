//! Peers: the local descriptor, choosing a data path for a loaded peer,
//! connecting (endpoints, authentication, `Hello`), fetching a descriptor
//! over the side channel, and a peer's link, opened on first use.

use crate::agent::{AgentConfig, Backend};
use crate::desc::{AgentDesc, ExportedRegion, TransportOffer};
use crate::engine::ctx::Ctx;
use crate::engine::handshake::{self};
use crate::engine::sock::{FrameReader, ProgressClock, UntilDeadline, iov, timeout_or, writev_all};
use crate::engine::transport::{Link, Transport};
use crate::engine::wire::{Frame, HEADER_LEN, PROTOCOL_VERSION, status};
use crate::engine::{Inner, Peer, StorageRoute, lock, tick, transport};
use crate::error::Error;
use crate::memory::{MemoryType, RegionMap};
use rustix::fd::{AsFd, AsRawFd};
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

impl Inner {
    /// The descriptor, with the CUDA IPC handles of its exported GPU
    /// memory (a handle opens its whole allocation: for same-host peers
    /// that ask only, see [`desc_for`](Self::desc_for)).
    fn local_desc(&self) -> AgentDesc {
        self.desc_for(Some(&self.host))
    }

    /// The descriptor for a requester on host `host` (`None`: one that did
    /// not ask for GPU handles): the CUDA IPC handles only when it is this
    /// host.
    pub(in crate::engine) fn desc_for(&self, host: Option<&str>) -> AgentDesc {
        let transports: Vec<_> = self
            .transports
            .iter()
            .filter_map(|t| {
                Some(TransportOffer {
                    name: t.kind().as_str().to_owned(),
                    info: t.offer()?,
                })
            })
            .collect();
        let offered: Vec<&str> = transports.iter().map(|o| o.name.as_str()).collect();
        let mut desc = AgentDesc {
            name: self.config.name.clone(),
            instance: self.instance,
            endpoints: vec![self.endpoint.clone()],
            regions: self
                .registry
                .exported(&offered, |h| self.storage.get(h).map_or(1, |f| f.align)),
            transports,
        };
        for t in &self.transports {
            t.describe(Ctx::of(self), &mut desc, host);
        }
        desc
    }

    /// Chooses the transport to a remote agent for requests from this
    /// agent's host memory to its memory of `mem_type`: the first of this
    /// agent's transports that moves it and reaches the peer
    /// ([`transport::choose`]).
    pub(in crate::engine) fn choose_transport(
        &self,
        desc: &AgentDesc,
        mem_type: MemoryType,
    ) -> Result<Arc<dyn Transport>, Error> {
        let t = transport::choose(
            &self.transports,
            self.mode,
            desc,
            MemoryType::Dram,
            mem_type,
        )?;
        tracing::info!(agent = %self.config.name, remote = %desc.name, %mem_type, transport = %t.kind(), "data path");
        Ok(t)
    }

    /// The agent as its own peer, the target of requests to its storage
    /// (FILE and BLK regions).
    pub(in crate::engine) fn self_peer(&self) -> Arc<Peer> {
        Arc::clone(self.self_peer.get_or_init(|| {
            Arc::new(Peer::new(
                self.local_desc(),
                RegionMap::new(),
                Arc::clone(&self.own_storage),
                StorageRoute::Same,
            ))
        }))
    }

    /// Closes `peer`, already out of the peer table: retired, its links
    /// failed with `cause()` and their threads joined.
    pub(in crate::engine) fn close_peer(&self, peer: &Peer, cause: impl Fn() -> Error) {
        peer.retire();
        for l in peer.take_links() {
            l.fail(cause());
            l.join();
        }
    }

    pub(in crate::engine) fn peer(&self, name: &str) -> Result<Arc<Peer>, Error> {
        self.peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownAgent(name.to_owned()))
    }
}

/// The RDMA local ACK timeout exponent, resolved when the agent was made.
pub(in crate::engine) fn ack_timeout(config: &AgentConfig) -> u8 {
    config
        .rdma
        .ack_timeout
        .unwrap_or(crate::verbs::DEFAULT_ACK_TIMEOUT)
}

/// Connects to the first endpoint that answers before `deadline`.
pub(in crate::engine) fn connect_any(
    endpoints: &[String],
    deadline: std::time::Instant,
) -> Result<TcpStream, Error> {
    let mut last = None;
    for ep in endpoints {
        let addrs = match ep.to_socket_addrs() {
            Ok(a) => a,
            Err(e) => {
                last = Some(Error::Connect {
                    addr: ep.clone(),
                    cause: Arc::new(e),
                });
                continue;
            }
        };
        for a in addrs {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(last.unwrap_or(Error::Timeout {
                    what: "connecting",
                    after: Duration::ZERO,
                }));
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    let _ = socket2::SockRef::from(&s).set_tcp_keepalive(
                        &socket2::TcpKeepalive::new()
                            .with_time(Duration::from_secs(10))
                            .with_interval(Duration::from_secs(5)),
                    );
                    return Ok(s);
                }
                Err(e) => {
                    last = Some(Error::Connect {
                        addr: a.to_string(),
                        cause: Arc::new(e),
                    })
                }
            }
        }
    }
    Err(last.unwrap_or_else(|| Error::InvalidConnectionInfo {
        info: String::new(),
        reason: "no endpoint".into(),
    }))
}

/// Authenticates, sends `Hello` and checks the `HelloAck`; returns the
/// session's ticket and the target's I/O timeout (`None`: it has none).
pub(in crate::engine) fn handshake(
    inner: &Inner,
    peer: &AgentDesc,
    sock: &TcpStream,
    link: u64,
    stream: u32,
    clock: &ProgressClock,
    deadline: std::time::Instant,
) -> Result<(u128, Option<Duration>), Error> {
    let t = inner.config.connect_timeout;
    sock.set_read_timeout(Some(tick(t)))?;
    sock.set_write_timeout(Some(tick(t)))?;
    handshake::initiate(
        sock,
        &inner.config.security,
        &inner.config.name,
        Some(&peer.name),
        &peer.name,
        deadline,
        t,
    )?;
    let name = inner.config.name.as_bytes();
    let hello = Frame::Hello {
        instance: inner.instance,
        expect: peer.instance,
        version: PROTOCOL_VERSION,
        link,
        stream,
        name_len: name.len() as u32,
    }
    .encode();
    let mut iovs = [
        iov(hello.as_ptr(), HEADER_LEN),
        iov(name.as_ptr(), name.len()),
    ];
    let conn_err = |e: io::Error| Error::ConnectionLost {
        remote: peer.name.clone(),
        cause: Arc::new(e),
    };
    // SAFETY: both iovecs point into live locals.
    unsafe { writev_all(sock.as_raw_fd(), &mut iovs, clock, t) }.map_err(conn_err)?;
    let mut reader = FrameReader::new(sock.as_raw_fd(), clock);
    reader.set_deadline(Some(deadline));
    let raw = reader
        .next_header(&mut UntilDeadline)
        .map_err(|e| timeout_or(e, "connection handshake", t, conn_err))?
        .ok_or_else(|| conn_err(io::ErrorKind::UnexpectedEof.into()))?;
    match Frame::decode(&raw) {
        Ok(Frame::HelloAck {
            status: status::OK,
            ticket,
            idle_ms,
            ..
        }) => Ok((
            ticket,
            (idle_ms > 0).then(|| Duration::from_millis(idle_ms.into())),
        )),
        Ok(Frame::HelloAck {
            status: status::STALE_INSTANCE,
            ..
        }) => Err(Error::StaleAgent {
            remote: peer.name.clone(),
            addr: sock.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
        }),
        other => Err(Error::ProtocolViolation {
            remote: peer.name.clone(),
            detail: format!("bad hello answer {other:?}"),
        }),
    }
}

/// Fetches an agent descriptor over the side channel, after the
/// authentication exchange; the descriptor must name the agent that
/// authenticated.
pub(in crate::engine) fn fetch_desc(cx: Ctx<'_>, info: &str) -> Result<AgentDesc, Error> {
    let inner = cx.state();
    // One deadline for the whole exchange: connect, authenticate, fetch.
    let timeout = inner.config.connect_timeout;
    let deadline = std::time::Instant::now() + timeout;
    let addrs: Vec<SocketAddr> = info
        .to_socket_addrs()
        .map_err(|e| Error::InvalidConnectionInfo {
            info: info.to_owned(),
            reason: e.to_string(),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(Error::InvalidConnectionInfo {
            info: info.to_owned(),
            reason: "resolves to no address".into(),
        });
    }
    let sock = connect_any(&[info.to_owned()], deadline)?;
    sock.set_read_timeout(Some(tick(timeout)))?;
    sock.set_write_timeout(Some(tick(timeout)))?;
    let target = handshake::initiate(
        &sock,
        &inner.config.security,
        &inner.config.name,
        None,
        info,
        deadline,
        timeout,
    )?;
    let clock = ProgressClock::new();
    let conn_err = |e: io::Error| Error::Connect {
        addr: info.to_owned(),
        cause: Arc::new(e),
    };
    // Only an agent that could open CUDA IPC handles (shm, auto) asks for
    // them, naming its host.
    let host: &[u8] = match inner.mode {
        Backend::Shm | Backend::Auto => inner.host.as_bytes(),
        _ => &[],
    };
    let ask = Frame::DescRequest {
        host_len: host.len() as u32,
    }
    .encode();
    handshake::send(sock.as_fd(), &ask, host, &clock, timeout).map_err(conn_err)?;
    let mut reader = FrameReader::new(sock.as_raw_fd(), &clock);
    reader.set_deadline(Some(deadline));
    let mut idle = UntilDeadline;
    let raw = reader
        .next_header(&mut idle)
        .map_err(|e| timeout_or(e, "descriptor fetch", timeout, conn_err))?
        .ok_or_else(|| conn_err(io::ErrorKind::UnexpectedEof.into()))?;
    let Ok(Frame::DescReply { body_len }) = Frame::decode(&raw) else {
        return Err(Error::ProtocolViolation {
            remote: info.to_owned(),
            detail: "expected a descriptor reply".into(),
        });
    };
    let body = reader
        .read_vec(body_len as usize, &mut idle)
        .map_err(|e| timeout_or(e, "descriptor fetch", timeout, conn_err))?;
    let desc = AgentDesc::decode(&body)?;
    if desc.name != target {
        return Err(Error::AuthFailed {
            remote: info.to_owned(),
            reason: format!(
                "the descriptor names agent {:?}, but {target:?} authenticated",
                desc.name
            ),
        });
    }
    Ok(desc)
}

impl Peer {
    /// The region the peer exported that `d` (of `mem_type`) lies in,
    /// trying `hint` (the previous descriptor's) first.
    ///
    /// # Errors
    /// [`Error::RemoteRangeNotExported`] when none holds it.
    pub(in crate::engine) fn exported<'a>(
        &'a self,
        mem_type: MemoryType,
        d: &crate::memory::MemoryDesc,
        hint: Option<&'a crate::memory::Region<ExportedRegion>>,
    ) -> Result<&'a crate::memory::Region<ExportedRegion>, Error> {
        self.regions
            .find_hinted(mem_type, d, hint)
            .ok_or_else(|| Error::RemoteRangeNotExported {
                remote: self.desc.name.clone(),
                mem_type,
                desc: *d,
            })
    }

    /// An entry with no link yet.
    pub(in crate::engine) fn new(
        desc: AgentDesc,
        regions: RegionMap<ExportedRegion>,
        transport: Arc<dyn Transport>,
        storage: StorageRoute,
    ) -> Self {
        static ENTRIES: AtomicU64 = AtomicU64::new(0);
        Peer {
            desc,
            entry: ENTRIES.fetch_add(1, Ordering::Relaxed),
            regions,
            transport,
            link: Mutex::new(None),
            retired: AtomicBool::new(false),
            storage,
        }
    }

    /// The entry whose link reaches the peer's FILE and BLK regions: this
    /// one, or its storage lane.
    pub(in crate::engine) fn for_storage(self: &Arc<Self>) -> Result<Arc<Peer>, Error> {
        match &self.storage {
            StorageRoute::Same => Ok(Arc::clone(self)),
            StorageRoute::Lane(lane) => Ok(Arc::clone(lane)),
            StorageRoute::Unreachable(e) => Err(e.clone()),
        }
    }

    /// Marks the entry (and its storage lane) replaced or invalidated.
    pub(in crate::engine) fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        if let StorageRoute::Lane(lane) = &self.storage {
            lane.retired.store(true, Ordering::Release);
        }
    }

    /// Takes the entry's links (its own and its storage lane's), to fail
    /// or hand on.
    pub(in crate::engine) fn take_links(&self) -> Vec<Arc<dyn Link>> {
        let mut links: Vec<_> = lock(&self.link).take().into_iter().collect();
        if let StorageRoute::Lane(lane) = &self.storage {
            links.extend(lock(&lane.link).take());
        }
        links
    }

    /// Its link when one is open and not broken (never connects).
    pub(in crate::engine) fn current_link(&self) -> Option<Arc<dyn Link>> {
        lock(&self.link)
            .as_ref()
            .filter(|l| !l.is_broken())
            .map(Arc::clone)
    }

    /// The live link, opening a new one when there is none or it broke.
    pub(in crate::engine) fn link(&self, inner: &Inner) -> Result<Arc<dyn Link>, Error> {
        let mut slot = lock(&self.link);
        if let Some(l) = slot.as_ref() {
            if !l.is_broken() {
                return Ok(Arc::clone(l));
            }
            let old = slot.take().expect("checked above");
            old.join();
        }
        let l = self.transport.connect(Ctx::of(inner), &self.desc)?;
        *slot = Some(Arc::clone(&l));
        Ok(l)
    }
}
