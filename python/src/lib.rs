//! `kvxfer._kvxfer`: the Python extension module over a kvxfer agent.
//!
//! The module exposes the agent with raw `(address, length)` descriptors;
//! the `kvxfer` package around it (`python/kvxfer/__init__.py`) turns
//! Python buffers into registrations. Every call that can block (making an
//! agent, connecting, waiting) releases the GIL; every wait has a deadline
//! and honours Ctrl-C. Errors are typed: one exception class per variant
//! of [`kvxfer::Error`], all subclasses of `KvxferError`.

use std::sync::Arc;
use std::time::{Duration, Instant};

mod cache;
mod descs;

use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use descs::{Made, PyDescList, PyRequest, indices, merge};

use kvxfer::auth::Credential;
use kvxfer::storage::obj::StoreOptions;
use kvxfer::{
    AgentConfig, AgentDesc, Backend, Error, IndexedRequest, MemoryDesc, MemoryDescs, MemoryType,
    TransferAgent, TransferOp, TransferRequest, TransferState, TransferStatus, make_transfer_agent,
};

pyo3::create_exception!(_kvxfer, KvxferError, PyException, "Every kvxfer error.");

/// One exception class per variant of [`kvxfer::Error`], and the mapping.
macro_rules! errors {
    ($($variant:ident => $class:ident),* $(,)?) => {
        $(pyo3::create_exception!(
            _kvxfer,
            $class,
            KvxferError,
            concat!("kvxfer's `Error::", stringify!($variant), "`.")
        );)*

        pub(crate) fn to_py(e: Error) -> PyErr {
            let msg = e.to_string();
            match e {
                $(Error::$variant { .. } => $class::new_err(msg),)*
                _ => KvxferError::new_err(msg),
            }
        }

        fn add_errors(m: &Bound<'_, PyModule>) -> PyResult<()> {
            let py = m.py();
            m.add("KvxferError", py.get_type::<KvxferError>())?;
            $(m.add(stringify!($class), py.get_type::<$class>())?;)*
            Ok(())
        }
    };
}

errors! {
    InvalidDescriptor => InvalidDescriptorError,
    Overlap => OverlapError,
    UnsupportedMemoryType => UnsupportedMemoryTypeError,
    NotRegistered => NotRegisteredError,
    NotARegistration => NotARegistrationError,
    RegionBusy => RegionBusyError,
    UnknownAgent => UnknownAgentError,
    RemoteRangeNotExported => RemoteRangeNotExportedError,
    InvalidRequest => InvalidRequestError,
    InvalidAgentDesc => InvalidAgentDescError,
    InvalidConnectionInfo => InvalidConnectionInfoError,
    InvalidConfig => InvalidConfigError,
    BackendUnavailable => BackendUnavailableError,
    TransportRequired => TransportRequiredError,
    Credential => CredentialError,
    AuthFailed => AuthFailedError,
    RemoteRejected => RemoteRejectedError,
    StaleAgent => StaleAgentError,
    ProtocolViolation => ProtocolViolationError,
    ConnectionLost => ConnectionLostError,
    Connect => ConnectError,
    Rdma => RdmaError,
    RdmaCompletion => RdmaCompletionError,
    PeerTimedOut => PeerTimedOutError,
    Timeout => TimeoutError,
    WouldBlock => WouldBlockError,
    Aborted => AbortedError,
    Closed => ClosedError,
    Io => IoError,
    Storage => StorageError,
    Misaligned => MisalignedError,
    PeerGone => PeerGoneError,
    MetadataStore => MetadataStoreError,
    NameTaken => NameTakenError,
    Gpu => GpuError,
    Integrity => IntegrityError,
    IntegrityUnsupported => IntegrityUnsupportedError,
    Object => ObjectStoreError,
}

/// A duration from seconds, refusing what is negative or not a number.
pub(crate) fn secs(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, not {s}"
        ))
    })
}

fn mem_type(name: &str) -> PyResult<MemoryType> {
    match name.to_ascii_lowercase().as_str() {
        "dram" | "cpu" => Ok(MemoryType::Dram),
        "vram" | "cuda" | "gpu" => Ok(MemoryType::Vram),
        "blk" => Ok(MemoryType::Blk),
        "obj" => Ok(MemoryType::Obj),
        "file" => Ok(MemoryType::File),
        _ => Err(PyValueError::new_err(format!(
            "unknown memory type {name:?} (dram, vram, blk, obj, file)"
        ))),
    }
}

/// Waits in slices, so that Ctrl-C (a pending signal) ends the wait.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// A kvxfer agent (see the `kvxfer` package for the buffer helpers).
#[pyclass(module = "kvxfer._kvxfer", name = "Agent", subclass, frozen)]
pub(crate) struct PyAgent {
    pub(crate) agent: Arc<dyn TransferAgent>,
    io_timeout: Duration,
    /// The object stores its objects were opened in.
    stores: kvxfer::storage::obj::ObjectStores,
}

#[pymethods]
impl PyAgent {
    /// Makes an agent named `name` on `backend` (`tcp`, `shm`, `rdma`,
    /// `fabric`, `auto`, or `inproc`: agents of this process, plain copies), listening on `listen` (`host:port`; default an ephemeral
    /// loopback port). `secret`: the cluster secret every peer must hold.
    /// `etcd`: an etcd cluster (`host:port[,host:port...]`) to publish the
    /// agent in and find peers in by name, under `etcd_prefix`, with a
    /// lease of `etcd_lease_ttl` seconds; over TLS with `etcd_ca` (and a
    /// client certificate `etcd_cert` with its key `etcd_key`).
    /// `fabric_provider`, `fabric_domain`: the libfabric provider and
    /// domain of a `fabric` agent (several domains, comma-separated, are
    /// several rails; default `KVXFER_FABRIC_PROVIDER`,
    /// `KVXFER_FABRIC_DOMAIN`, else libfabric's choice).
    #[new]
    #[pyo3(signature = (name, backend = "tcp", listen = None, secret = None, connect_timeout = 10.0, io_timeout = 30.0, etcd = None, etcd_prefix = "/kvxfer", etcd_lease_ttl = 5.0, etcd_ca = None, etcd_cert = None, etcd_key = None, fabric_provider = None, fabric_domain = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: String,
        backend: &str,
        listen: Option<&str>,
        secret: Option<&[u8]>,
        connect_timeout: f64,
        io_timeout: f64,
        etcd: Option<&str>,
        etcd_prefix: &str,
        etcd_lease_ttl: f64,
        etcd_ca: Option<std::path::PathBuf>,
        etcd_cert: Option<std::path::PathBuf>,
        etcd_key: Option<std::path::PathBuf>,
        fabric_provider: Option<String>,
        fabric_domain: Option<String>,
    ) -> PyResult<Self> {
        let backend: Backend = backend.parse().map_err(to_py)?;
        let io_timeout = secs("io_timeout", io_timeout)?;
        let mut cfg = AgentConfig::new(name)
            .with_connect_timeout(secs("connect_timeout", connect_timeout)?)
            .with_io_timeout(io_timeout);
        if let Some(l) = listen {
            let addr = l
                .parse()
                .map_err(|e| PyValueError::new_err(format!("listen address {l:?}: {e}")))?;
            cfg = cfg.with_listen(addr);
        }
        if let Some(p) = fabric_provider {
            cfg = cfg.with_fabric_provider(p);
        }
        if let Some(d) = fabric_domain {
            let mut f = cfg.fabric.clone();
            f.domain = Some(d);
            cfg = cfg.with_fabric(f);
        }
        if let Some(s) = secret {
            let c = Credential::new(s.to_vec()).map_err(|e| to_py(Error::Credential(e)))?;
            cfg = cfg.with_credential(c);
        }
        if let Some(eps) = etcd {
            let mut e = kvxfer::EtcdConfig::new(eps.split(',').map(str::trim))
                .with_prefix(etcd_prefix)
                .with_lease_ttl(secs("etcd_lease_ttl", etcd_lease_ttl)?);
            if let Some(ca) = etcd_ca {
                let mut tls = kvxfer::EtcdTls::new(ca);
                if let (Some(c), Some(k)) = (etcd_cert, etcd_key) {
                    tls = tls.with_client_cert(c, k);
                }
                e = e.with_tls(tls);
            }
            cfg = cfg.with_etcd(e);
        }
        let agent = py
            .detach(|| make_transfer_agent(backend, cfg))
            .map_err(to_py)?;
        Ok(Self {
            agent: Arc::from(agent),
            io_timeout,
            stores: Default::default(),
        })
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> String {
        self.agent.name().to_owned()
    }

    /// The backend's name.
    #[getter]
    fn backend(&self) -> &'static str {
        self.agent.backend_name()
    }

    /// Where peers reach this agent (`host:port`).
    fn connection_info(&self) -> String {
        self.agent.local_connection_info()
    }

    /// This agent's descriptor, encoded, for a peer's `add_remote_agent`.
    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.agent.local_agent_desc().encode())
    }

    /// Loads a peer from its `metadata()` bytes; returns its name.
    fn add_remote_agent(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<String> {
        let desc = AgentDesc::decode(metadata).map_err(|e| to_py(Error::InvalidAgentDesc(e)))?;
        let name = desc.name.clone();
        py.detach(|| self.agent.load_remote_agent(&desc))
            .map_err(to_py)?;
        Ok(name)
    }

    /// The agent's metrics in the Prometheus text format.
    fn metrics_text(&self) -> String {
        self.agent.metrics_text()
    }

    /// Finds a peer by name in the metadata store (the agent's `etcd`) and
    /// loads it; watched from then on (`PeerGoneError` once it leaves, and
    /// resolved again on the next request).
    fn connect_by_name(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        py.detach(|| self.agent.load_remote_agent_by_name(name))
            .map_err(to_py)
    }

    /// Fetches a peer's descriptor from its connection info and loads it;
    /// returns its name.
    fn connect(&self, py: Python<'_>, connection_info: &str) -> PyResult<String> {
        py.detach(|| self.agent.load_remote_agent_by_connection(connection_info))
            .map_err(to_py)
    }

    /// Forgets a peer (its transfers in flight fail).
    fn remove_remote_agent(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        py.detach(|| self.agent.invalidate_remote_agent(name))
            .map_err(to_py)
    }

    /// How a loaded peer is reached (`tcp`, `shm`, `rdma`, `fabric`, `inproc`;
    /// `storage` for the agent itself).
    fn remote_transport(&self, name: &str) -> PyResult<&'static str> {
        self.agent.remote_transport(name).map_err(to_py)
    }

    /// The regions a loaded peer exported, in the order its descriptor
    /// lists them: `(address, length, device, memory type)`.
    fn remote_regions(&self, name: &str) -> PyResult<Vec<(u64, u64, u32, &'static str)>> {
        let desc = self.agent.remote_agent_desc(name).map_err(to_py)?;
        Ok(desc
            .regions
            .iter()
            .map(|r| {
                (
                    r.desc.addr,
                    r.desc.len,
                    r.desc.device_id,
                    r.mem_type.as_str(),
                )
            })
            .collect())
    }

    /// Checks that every descriptor of `descs` lies in memory registered
    /// here (`remote_agent` None) or exported by `remote_agent`, and
    /// prepares the list for that side; raises the reason otherwise.
    #[pyo3(signature = (descs, remote_agent = None))]
    fn check_descs(&self, descs: &PyDescList, remote_agent: Option<&str>) -> PyResult<()> {
        descs
            .prepared(&self.agent, remote_agent)
            .map(|_| ())
            .map_err(to_py)
    }

    /// Registers raw `(address, length, device)` ranges of `mem_type`.
    /// The caller vouches that the memory stays valid until it is
    /// deregistered (`kvxfer.Agent.register` does so for Python buffers).
    #[pyo3(signature = (descs, mem_type = "dram"))]
    fn register_raw(&self, descs: Vec<(u64, u64, u32)>, mem_type: &str) -> PyResult<()> {
        let d = descs_of(mem_type, &descs)?;
        // SAFETY: the caller's promise (see the method's documentation):
        // the ranges stay valid memory until deregistered.
        unsafe { self.agent.register_memory(&d) }.map_err(to_py)
    }

    /// Registers all of `pool` (a `SharedPool`) as host memory that
    /// same-host shm peers map and copy with `memcpy` (read only with
    /// `read_only`); returns its `(address, length)`. Deregister it with
    /// `deregister_raw`, which also revokes every peer's mapping.
    #[pyo3(signature = (pool, read_only = false))]
    fn register_shared_pool(&self, pool: &PySharedPool, read_only: bool) -> PyResult<(u64, u64)> {
        let access = if read_only {
            kvxfer::PoolAccess::ReadOnly
        } else {
            kvxfer::PoolAccess::ReadWrite
        };
        let d = self
            .agent
            .register_shared_pool(&pool.pool, access)
            .map_err(to_py)?;
        let d = d.descs[0];
        Ok((d.addr, d.len))
    }

    /// Deregisters ranges registered by `register_raw` (refused while
    /// transfers use them).
    #[pyo3(signature = (descs, mem_type = "dram"))]
    fn deregister_raw(&self, descs: Vec<(u64, u64, u32)>, mem_type: &str) -> PyResult<()> {
        let d = descs_of(mem_type, &descs)?;
        self.agent.deregister_memory(&d).map_err(to_py)
    }

    /// Starts a transfer: `op` is `"write"` (local → remote) or `"read"`
    /// (remote → local); `local` and `remote` are paired `(address,
    /// length)` lists; `notif` is delivered to the peer after the data.
    /// Storage: the remote agent is this agent's own name (or a peer's,
    /// through its agent), `remote_mem` `"file"`, `"blk"` or `"obj"`,
    /// `remote_device` the handle `open_storage` / `open_object` returned
    /// (addresses are then offsets); `durable` completes the
    /// transfer only once written data is on stable storage. `integrity`
    /// checks every piece end to end (a CRC32C computed over the source,
    /// checked where it lands): a mismatch raises `IntegrityError` and the
    /// notification is not delivered; `IntegrityUnsupportedError` where
    /// the memory cannot be checked (host memory only).
    #[pyo3(signature = (op, local, remote, remote_agent, notif = None, local_mem = "dram", remote_mem = "dram", remote_device = 0, durable = false, integrity = false))]
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        py: Python<'_>,
        op: &str,
        local: Vec<(u64, u64)>,
        remote: Vec<(u64, u64)>,
        remote_agent: String,
        notif: Option<&[u8]>,
        local_mem: &str,
        remote_mem: &str,
        remote_device: u32,
        durable: bool,
        integrity: bool,
    ) -> PyResult<PyTransfer> {
        let pairs = |v: &[(u64, u64)], dev: u32| {
            v.iter().map(|&(a, l)| MemoryDesc::new(a, l, dev)).collect()
        };
        let l = MemoryDescs::new(mem_type(local_mem)?, pairs(&local, 0));
        let r = MemoryDescs::new(mem_type(remote_mem)?, pairs(&remote, remote_device));
        let mut req = new_request(transfer_op(op)?, l, r, remote_agent);
        if let Some(n) = notif {
            req = req.with_sync_message(n.to_vec());
        }
        req.durable = durable;
        req.integrity = integrity;
        self.submit(py, &req)
    }

    /// Opens a file (`kind="file"`; created with `size` bytes when `size`
    /// is given; `O_DIRECT` when `direct`; with `grow`, ranges may be
    /// registered past its end and a WRITE there extends it, a READ past
    /// the end is refused) or a block device (`kind="blk"`, always
    /// `O_DIRECT`) as storage; returns its handle, the `device` of the
    /// FILE or BLK ranges registered with `register_raw` (addresses are
    /// byte offsets).
    #[pyo3(signature = (path, kind = "file", size = None, direct = false, grow = false))]
    fn open_storage(
        &self,
        path: std::path::PathBuf,
        kind: &str,
        size: Option<u64>,
        direct: bool,
        grow: bool,
    ) -> PyResult<u32> {
        let spec = match kind {
            "file" => {
                let s = kvxfer::StorageSpec::file(path).direct(direct).grow(grow);
                match size {
                    Some(n) => s.create(n),
                    None => s,
                }
            }
            "blk" | "block" => kvxfer::StorageSpec::block(path),
            other => {
                return Err(PyValueError::new_err(format!(
                    "storage kind {other:?}: expected \"file\" or \"blk\""
                )));
            }
        };
        self.agent.open_storage(&spec).map_err(to_py)
    }

    /// Adopts open file descriptor `fd` (a duplicate of it: the caller
    /// keeps and closes its own) as FILE storage, with its access mode;
    /// ranges may be registered past the file's end and a WRITE there
    /// extends it. Returns its handle, as `open_storage`.
    fn adopt_storage(&self, fd: i32) -> PyResult<u32> {
        use std::os::fd::BorrowedFd;
        if fd < 0 {
            return Err(PyValueError::new_err(format!("file descriptor {fd}")));
        }
        // SAFETY: `fd` is only borrowed for the duplication, which fails
        // (EBADF) when it is not an open descriptor.
        let owned = unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .map_err(|e| to_py(Error::InvalidConfig(format!("file descriptor {fd}: {e}"))))?;
        self.agent.adopt_storage(owned).map_err(to_py)
    }

    /// Opens object `key` of `bucket` in an S3-compatible store (it need
    /// not exist yet); returns its handle, the `device` of the OBJ ranges
    /// registered with `register_raw` (addresses are byte offsets in the
    /// object). A WRITE replaces the object whole (offset 0); a READ is a
    /// ranged GET. `endpoint` (`http://host:port`) defaults to what the AWS
    /// tools find, as do the credentials and the region (`AWS_*`
    /// variables, `~/.aws`). Objects of one bucket and endpoint share one
    /// connection pool. Close with `close_storage`.
    ///
    /// Keywords `region`, `access_key` with `secret_key` (and
    /// `session_token`), and `virtual_hosted` take the place of what the
    /// environment says.
    #[pyo3(signature = (bucket, key, endpoint = None, **options))]
    fn open_object(
        &self,
        bucket: &str,
        key: &str,
        endpoint: Option<String>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<u32> {
        let store = self.store(bucket, endpoint, options)?;
        self.agent.open_object(&store, key).map_err(to_py)
    }

    /// The size of object `key` of `bucket` (one HEAD request), or `None`
    /// when it does not exist; the store as `open_object` finds it (the same
    /// keywords).
    #[pyo3(signature = (bucket, key, endpoint = None, **options))]
    fn object_size(
        &self,
        py: Python<'_>,
        bucket: &str,
        key: &str,
        endpoint: Option<String>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Option<u64>> {
        let store = self.store(bucket, endpoint, options)?;
        py.detach(|| store.object_size(key)).map_err(to_py)
    }

    /// Closes storage or object `handle` (refused while ranges of it are
    /// registered).
    fn close_storage(&self, handle: u32) -> PyResult<()> {
        self.agent.close_storage(handle).map_err(to_py)
    }

    /// A request from two descriptor lists and the indices to take from
    /// each (lists of ints or integer numpy arrays, any order, paired in
    /// order); pairs adjacent on both sides merge unless `merge` is false.
    #[pyo3(signature = (op, local, local_indices, remote, remote_indices, remote_agent, notif = None, merge = true))]
    #[allow(clippy::too_many_arguments)]
    fn make_request(
        &self,
        op: &str,
        local: &PyDescList,
        local_indices: &Bound<'_, PyAny>,
        remote: &PyDescList,
        remote_indices: &Bound<'_, PyAny>,
        remote_agent: String,
        notif: Option<&[u8]>,
        merge: bool,
    ) -> PyResult<PyRequest> {
        let li = indices(local_indices, local.descs.len(), "local indices")?;
        let ri = indices(remote_indices, remote.descs.len(), "remote indices")?;
        if li.len() != ri.len() {
            return Err(PyValueError::new_err(format!(
                "{} local indices for {} remote ones",
                li.len(),
                ri.len()
            )));
        }
        let op = transfer_op(op)?;
        let requested = li.len();
        let sync = notif.filter(|n| !n.is_empty()).map(<[u8]>::to_vec);
        // Made by index from the lists as this agent prepared them: checked
        // and planned without a step per descriptor here.
        let lists = local
            .prepared(&self.agent, None)
            .and_then(|l| Ok((l, remote.prepared(&self.agent, Some(&remote_agent))?)));
        if let Ok((l, r)) = lists {
            let req = IndexedRequest {
                op,
                local: l,
                local_indices: li,
                remote: r,
                remote_indices: ri,
                sync_message: sync,
                merge,
            };
            return Ok(match self.agent.prepare_indexed(req.clone()) {
                Ok(p) => PyRequest::new(Made::Prepared(Arc::new(p)), requested),
                // Refused: a bad shape raises now; otherwise each post
                // checks it in full, and fails as it would have.
                Err(_) => {
                    let plain = req.to_request().map_err(to_py)?;
                    plain.validate_shape().map_err(to_py)?;
                    PyRequest::new(Made::Plain(Arc::new(plain)), requested)
                }
            });
        }
        // A list the agent refuses (a range not registered or not
        // exported): the request its pairs make, refused at each post as it
        // would be without the lists.
        warm(&local.descs, li.len());
        warm(&remote.descs, ri.len());
        let pairs = li
            .iter()
            .zip(ri.iter())
            .map(|(&a, &b)| (local.descs[a as usize], remote.descs[b as usize]));
        let (l, r) = if merge {
            self::merge(pairs)
        } else {
            pairs.unzip()
        };
        let mut req = new_request(
            op,
            MemoryDescs::new(local.mem, l),
            MemoryDescs::new(remote.mem, r),
            remote_agent,
        );
        req.sync_message = sync;
        req.validate_shape().map_err(to_py)?;
        Ok(PyRequest::new(Made::Plain(Arc::new(req)), requested))
    }

    /// Posts a request made by `make_request`; `notif`, when given,
    /// replaces its notification for this post.
    #[pyo3(signature = (request, notif = None))]
    fn post(
        &self,
        py: Python<'_>,
        request: &PyRequest,
        notif: Option<&[u8]>,
    ) -> PyResult<PyTransfer> {
        // Taken out of the lock before the GIL is let go (a `release` on
        // another thread waits for the lock holding the GIL).
        let made = request.made();
        if let Some(n) = notif.filter(|n| !n.is_empty())
            && made.sync_message() != Some(n)
        {
            let mut r = made.request().into_owned();
            r.sync_message = Some(n.to_vec());
            return self.submit(py, &r);
        }
        let t0 = Instant::now();
        let p = match &made {
            Made::Prepared(p) => Arc::clone(p),
            Made::Plain(req) => return self.submit(py, req),
            // Released: prepared again for this post (its holds then last
            // as long as the transfer).
            Made::Indexed(req) => {
                let r = (**req).clone();
                Arc::new(py.detach(|| self.agent.prepare_indexed(r)).map_err(to_py)?)
            }
        };
        let st = py
            .detach(|| self.agent.submit_prepared(&p))
            .map_err(to_py)?;
        let size = (p.total_bytes(), p.desc_count());
        Ok(PyTransfer::new(st, self.io_timeout, size, t0))
    }

    /// Sends `message` to `remote` as a notification (no data); returns its
    /// handle (done once the peer has it).
    fn send_notif(&self, py: Python<'_>, remote: &str, message: &[u8]) -> PyResult<PyTransfer> {
        let t0 = Instant::now();
        let st = py
            .detach(|| self.agent.notify_sync_message(remote, message.to_vec()))
            .map_err(to_py)?;
        Ok(PyTransfer::new(st, self.io_timeout, (0, 0), t0))
    }

    /// The notifications that arrived: `{peer name: [bytes, ...]}`, each
    /// peer's in order; empty when none.
    fn get_new_notifs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        notifs(py, self.agent.take_sync_messages())
    }

    /// As `get_new_notifs`, waiting up to `timeout` seconds for the first.
    fn wait_notifs<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let deadline = Instant::now() + secs("timeout", timeout)?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let got = py.detach(|| self.agent.wait_sync_messages(left.min(WAIT_SLICE)));
            if !got.is_empty() || left <= WAIT_SLICE {
                return notifs(py, got);
            }
            py.check_signals()?;
        }
    }
}

impl PyAgent {
    /// The object store of `bucket` with `endpoint` and the keywords of
    /// `open_object` in place of the environment's settings.
    fn store(
        &self,
        bucket: &str,
        endpoint: Option<String>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<kvxfer::storage::obj::ObjectStore> {
        let mut o = StoreOptions {
            endpoint,
            ..StoreOptions::default()
        };
        for (k, v) in options.into_iter().flat_map(|d| d.iter()) {
            let k: String = k.extract()?;
            let text = || v.extract::<String>().map(Some);
            match k.as_str() {
                "region" => o.region = text()?,
                "access_key" => o.access_key = text()?,
                "secret_key" => o.secret_key = text()?,
                "session_token" => o.session_token = text()?,
                "virtual_hosted" => o.virtual_hosted = Some(v.extract()?),
                other => {
                    return Err(PyValueError::new_err(format!(
                        "object store option {other:?}: expected region, access_key, \
                         secret_key, session_token or virtual_hosted"
                    )));
                }
            }
        }
        self.stores.get_with(bucket, &o).map_err(to_py)
    }

    /// Submits `req` (the GIL released), timing the submission.
    fn submit(&self, py: Python<'_>, req: &TransferRequest) -> PyResult<PyTransfer> {
        let t0 = Instant::now();
        let st = py
            .detach(|| self.agent.submit_transfer(req))
            .map_err(to_py)?;
        let size = (req.local.total_len(), req.local.descs.len());
        Ok(PyTransfer::new(st, self.io_timeout, size, t0))
    }
}

/// `"write"` or `"read"` (any case).
fn transfer_op(op: &str) -> PyResult<TransferOp> {
    match op.to_ascii_lowercase().as_str() {
        "write" => Ok(TransferOp::Write),
        "read" => Ok(TransferOp::Read),
        _ => Err(PyValueError::new_err(format!(
            "op must be \"write\" or \"read\", not {op:?}"
        ))),
    }
}

/// A READ or WRITE request.
fn new_request(
    op: TransferOp,
    local: MemoryDescs,
    remote: MemoryDescs,
    remote_agent: String,
) -> TransferRequest {
    match op {
        TransferOp::Read => TransferRequest::read(local, remote, remote_agent),
        _ => TransferRequest::write(local, remote, remote_agent),
    }
}

fn descs_of(mem: &str, v: &[(u64, u64, u32)]) -> PyResult<MemoryDescs> {
    Ok(MemoryDescs::new(
        mem_type(mem)?,
        v.iter()
            .map(|&(a, l, d)| MemoryDesc::new(a, l, d))
            .collect(),
    ))
}

fn notifs<'py>(py: Python<'py>, msgs: kvxfer::agent::SyncMessages) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (from, list) in msgs {
        let l = PyList::empty(py);
        for m in list {
            l.append(PyBytes::new(py, &m))?;
        }
        d.set_item(from, l)?;
    }
    Ok(d)
}

/// A transfer in flight or finished.
#[pyclass(module = "kvxfer._kvxfer", name = "Transfer", frozen)]
struct PyTransfer {
    st: TransferStatus,
    default_timeout: Duration,
    /// Bytes and descriptors of the request.
    size: (u64, usize),
    /// When `submit_transfer` was called, and how long it took.
    started: Instant,
    post: Duration,
    /// When a look at the transfer first saw it finished.
    seen_done: std::sync::OnceLock<Instant>,
}

impl PyTransfer {
    fn new(st: TransferStatus, default_timeout: Duration, size: (u64, usize), t0: Instant) -> Self {
        Self {
            st,
            default_timeout,
            size,
            started: t0,
            post: t0.elapsed(),
            seen_done: std::sync::OnceLock::new(),
        }
    }

    /// Records the first look that found it finished.
    fn seen(&self, finished: bool) {
        if finished {
            self.seen_done.get_or_init(Instant::now);
        }
    }

    /// A look's result as `"PROC"`, `"DONE"` or `"ERR"`, recorded.
    fn observe(&self, r: &Result<TransferState, Error>) -> &'static str {
        let s = match r {
            Ok(TransferState::InProgress) => "PROC",
            Ok(TransferState::Completed) => "DONE",
            Err(_) => "ERR",
        };
        self.seen(s != "PROC");
        s
    }
}

#[pymethods]
impl PyTransfer {
    /// Whether it finished (successfully or not).
    fn done(&self) -> bool {
        let d = self.st.is_completed();
        self.seen(d);
        d
    }

    /// `"PROC"` while in flight, `"DONE"` once every byte landed (and the
    /// notification, if any, was delivered), `"ERR"` when it failed.
    #[getter]
    fn state(&self) -> &'static str {
        self.observe(&self.st.poll())
    }

    /// As `state`, after waiting at most `max_wait` seconds (the GIL
    /// released) for it to finish: for callers that poll in a loop, whose
    /// spinning would otherwise take the CPU from the threads moving the
    /// data.
    fn check(&self, py: Python<'_>, max_wait: f64) -> PyResult<&'static str> {
        let t = secs("max_wait", max_wait)?;
        Ok(self.observe(&py.detach(|| self.st.wait(t))))
    }

    /// Waits until it finished, at most `timeout` seconds (default: the
    /// agent's I/O timeout); raises its error, or `TimeoutError` (kvxfer's)
    /// when it is still in flight then.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let t = match timeout {
            Some(s) => secs("timeout", s)?,
            None => self.default_timeout,
        };
        let deadline = Instant::now() + t;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(WAIT_SLICE);
            let r = py.detach(|| self.st.wait(slice));
            self.observe(&r);
            match r {
                Ok(TransferState::Completed) => return Ok(()),
                Ok(TransferState::InProgress) if left <= WAIT_SLICE => {
                    return Err(to_py(Error::Timeout {
                        what: "transfer",
                        after: t,
                    }));
                }
                Ok(TransferState::InProgress) => py.check_signals()?,
                Err(e) => return Err(to_py(e)),
            }
        }
    }

    /// Whether it finished and no byte of it can land any more, in either
    /// agent's memory: false while in flight, and after a failure that
    /// broke the connection (`PeerTimedOutError`, `ConnectionLostError`)
    /// until `wait_settled` proved it. Until then, treat a WRITE's
    /// destination as still being written.
    fn is_settled(&self) -> bool {
        self.st.is_settled()
    }

    /// Waits at most `timeout` seconds in all for it to finish and for
    /// proof that no byte of it can land any more (after a broken link,
    /// the target is asked to end the link's streams). Returns once
    /// settled, whatever the outcome; raises `TimeoutError` (kvxfer's) when
    /// the transfer or the target's answer did not come in time.
    fn wait_settled(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = secs("timeout", timeout)?;
        py.detach(|| self.st.wait_settled(t)).map_err(to_py)
    }

    /// Stops it: nothing more of it is sent; it ends (`AbortedError`) once
    /// nothing of it can touch either side's memory. False when it had
    /// already finished.
    fn abort(&self) -> bool {
        self.st.abort()
    }

    /// Same as `abort` (the name NIXL-style callers use).
    fn cancel(&self) -> bool {
        self.st.abort()
    }

    /// What it moved and how: `bytes`, `descs`, `transport`, `device`,
    /// `mechanism`, `post_us` (the submission call), and `xfer_us` (from
    /// the submission to the first look that found it finished; `None`
    /// while in flight).
    fn telemetry<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.seen(self.st.is_completed());
        let d = PyDict::new(py);
        let path = self.st.data_path();
        d.set_item("bytes", self.size.0)?;
        d.set_item("descs", self.size.1)?;
        d.set_item("transport", path.transport.as_str())?;
        d.set_item("device", path.device.clone())?;
        d.set_item("mechanism", path.mechanism)?;
        d.set_item("post_us", self.post.as_secs_f64() * 1e6)?;
        let xfer = self
            .seen_done
            .get()
            .map(|t| t.saturating_duration_since(self.started).as_secs_f64() * 1e6);
        d.set_item("xfer_us", xfer)?;
        Ok(d)
    }

    /// The transport that carries it (`tcp`, `shm`, `rdma`, `fabric`, `inproc`,
    /// `storage`).
    #[getter]
    fn transport(&self) -> &'static str {
        self.st.data_path().transport.as_str()
    }

    /// `await transfer` in asyncio: resumes once it finished (raising its
    /// error), woken by the completion itself through the loop's reader
    /// on a `CompletionQueue` (no polling, no thread).
    fn __await__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        py.import("kvxfer._aio")?
            .call_method1("wait", (slf,))?
            .call_method0("__await__")
    }
}

/// Outcomes of watched transfers in the order they finished; `fileno()` is
/// readable while any is ready (for `loop.add_reader`, `select`).
#[pyclass(module = "kvxfer._kvxfer", name = "CompletionQueue", frozen)]
struct PyCompletionQueue {
    cq: kvxfer::CompletionQueue,
}

#[pymethods]
impl PyCompletionQueue {
    #[new]
    fn new() -> PyResult<Self> {
        Ok(Self {
            cq: kvxfer::CompletionQueue::new().map_err(to_py)?,
        })
    }

    /// Reports `transfer`'s outcome here, with `token`, once it finishes.
    fn watch(&self, transfer: PyRef<'_, PyTransfer>, token: u64) {
        self.cq.watch(&transfer.st, token);
    }

    /// The outcomes ready now: `(token, None)` for a success, `(token,
    /// exception)` for a failure.
    fn take(&self, py: Python<'_>) -> Vec<(u64, Option<Py<PyAny>>)> {
        self.cq
            .try_take()
            .into_iter()
            .map(|(token, outcome)| {
                (
                    token,
                    outcome.err().map(|e| to_py(e).into_value(py).into_any()),
                )
            })
            .collect()
    }

    /// The descriptor readable while an outcome is ready (never read it).
    fn fileno(&self) -> i32 {
        std::os::fd::AsRawFd::as_raw_fd(&self.cq)
    }
}

/// Host memory in a memory file, mapped shared: registered with
/// `Agent.register_shared_pool`, same-host peers map it and copy into and
/// out of it with plain loads and stores (see the Rust `kvxfer::pool`).
#[pyclass(module = "kvxfer._kvxfer", name = "SharedPool", subclass, frozen)]
pub(crate) struct PySharedPool {
    pool: kvxfer::SharedPool,
}

#[pymethods]
impl PySharedPool {
    /// A new zero-filled pool of `size` bytes (`memfd_create`), or, with
    /// `fd`, a pool over all of that memory file (duplicated; the caller
    /// keeps its descriptor).
    #[new]
    #[pyo3(signature = (size = None, fd = None))]
    fn new(size: Option<usize>, fd: Option<i32>) -> PyResult<Self> {
        let pool = match (size, fd) {
            (Some(n), None) => kvxfer::SharedPool::new(n),
            (None, Some(fd)) => {
                // SAFETY: only borrowed for the duplication; the caller
                // keeps ownership of `fd`.
                let b = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
                let owned = b.try_clone_to_owned().map_err(|e| to_py(Error::from(e)))?;
                kvxfer::SharedPool::from_fd(owned)
            }
            _ => {
                return Err(PyValueError::new_err(
                    "SharedPool takes a size or a file descriptor",
                ));
            }
        }
        .map_err(to_py)?;
        Ok(Self { pool })
    }

    /// The pool's first byte.
    #[getter]
    fn addr(&self) -> u64 {
        self.pool.as_ptr() as u64
    }

    fn __len__(&self) -> usize {
        self.pool.len()
    }
}

/// The device ordinal of the GPU memory at `addr` (`GpuError` when it is
/// not GPU memory or no CUDA driver is present).
#[pyfunction]
fn gpu_device_of(addr: u64) -> PyResult<u32> {
    kvxfer::gpu::device_of(addr).map_err(|e| to_py(Error::Gpu(e)))
}

#[pymodule]
fn _kvxfer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gpu_device_of, m)?)?;
    m.add_class::<PyAgent>()?;
    m.add_class::<PySharedPool>()?;
    m.add_class::<PyTransfer>()?;
    m.add_class::<PyCompletionQueue>()?;
    m.add_class::<PyDescList>()?;
    m.add_class::<PyRequest>()?;
    cache::add(m)?;
    add_errors(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// Reads `descs` through once when `picks` of them are to be read in any
/// order and the list is large (see `make_request`).
fn warm(descs: &[kvxfer::MemoryDesc], picks: usize) {
    if picks >= 64 && picks * 4 >= descs.len() {
        std::hint::black_box(descs.iter().fold(0u64, |x, d| x ^ d.addr));
    }
}
