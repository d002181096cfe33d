//! The VRAM suite against a stand-in driver (`tests/gpu/fakecuda.c`,
//! built here with gcc): every host without a GPU runs it. The stand-in's
//! device memory faults when the host touches it, so a path that treated
//! VRAM as host memory would crash this test; the same suite runs against
//! the real driver in `tests/gpu.rs` (`ci/gpu-check.sh` on a GPU machine).

#[path = "gpu/suite.rs"]
#[macro_use]
mod suite;

use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvxfer::gpu::{self, GpuError};

/// Builds the stand-in and loads it before kvxfer's first driver call: the
/// driver's `dlopen("libcuda.so")` then finds it by its soname.
fn ready(_test: &str) -> bool {
    stand_in();
    true
}

/// The stand-in driver, built and loaded once.
fn stand_in() -> &'static libloading::Library {
    static LOADED: OnceLock<libloading::Library> = OnceLock::new();
    LOADED.get_or_init(|| {
        // Under the temporary directory (writable in the soft-RoCE guest,
        // where the checkout is read-only).
        let dir = std::env::temp_dir().join(format!("kvxfer-fakecuda-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libcuda-fake.so");
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/gpu/fakecuda.c");
        let out = Command::new("gcc")
            .args(["-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-pthread"])
            .arg("-Wl,-soname,libcuda.so")
            .arg("-o")
            .arg(&lib)
            .arg(src)
            .output()
            .expect("gcc runs (ci/install-deps.sh installs it)");
        assert!(
            out.status.success(),
            "building the stand-in driver failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // SAFETY: our own library, with no initialisers of its own.
        let l = unsafe { libloading::Library::new(&lib) }.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        l
    })
}

gpu_suite!(ready);

#[test]
fn probe_reports_the_stand_in() {
    ready("probe_reports_the_stand_in");
    let p = gpu::probe().unwrap();
    assert_eq!(p.driver_version, 13000);
    assert_eq!(p.devices.len(), 2);
    assert_eq!(p.devices[1].pci_bus_id, "0000:11:00.0");
    // FAKECUDA_DMABUF is not set: the export is refused, typed.
    assert!(matches!(
        p.devices[0].dmabuf_export,
        Err(GpuError::Driver { code: 801, .. })
    ));
}

#[test]
fn device_buffer_bounds_are_checked() {
    ready("device_buffer_bounds_are_checked");
    let b = gpu::DeviceBuffer::new(1, 100).unwrap();
    assert_eq!(b.device(), 1);
    assert!(matches!(
        b.write(90, &[0; 11]),
        Err(GpuError::PastAllocation { .. })
    ));
    b.write(90, &[5; 10]).unwrap();
    let mut out = [0u8; 10];
    b.read(90, &mut out).unwrap();
    assert_eq!(out, [5; 10]);
    assert!(matches!(
        gpu::DeviceBuffer::new(7, 1),
        Err(GpuError::Driver { .. })
    ));
}

/// Registration sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation
/// (asked of the stand-in, which records it); on VMM memory, which refuses
/// it, the context's `CU_CTX_SYNC_MEMOPS` flag.
#[test]
fn registration_sets_sync_memops() {
    type GetAttr = unsafe extern "C" fn(*mut std::ffi::c_void, i32, u64) -> i32;
    // SAFETY: the stand-in's cuPointerGetAttribute, with this signature.
    let get: libloading::Symbol<'_, GetAttr> =
        unsafe { stand_in().get(b"cuPointerGetAttribute") }.unwrap();
    let sync = |addr: u64| {
        let mut v: i32 = -1;
        // SAFETY: SYNC_MEMOPS (6) is written as one int.
        assert_eq!(unsafe { get((&mut v as *mut i32).cast(), 6, addr) }, 0);
        v
    };
    let g = gpu::DeviceBuffer::new(0, 1 << 16).unwrap();
    assert_eq!(sync(g.addr()), 0);
    let a = suite::agent(kvxfer::Backend::InProcess, "a");
    suite::register_vram(a.as_ref(), &g).unwrap();
    assert_eq!(sync(g.addr()), 1);
    // VMM memory refuses the attribute (as the driver does): registering
    // it sets the context's flag instead (no other test puts VMM memory on
    // device 1).
    type Flags = unsafe extern "C" fn(i32) -> u32;
    // SAFETY: the stand-in's fakecuda_ctx_flags(int).
    let flags: libloading::Symbol<'_, Flags> =
        unsafe { stand_in().get(b"fakecuda_ctx_flags") }.unwrap();
    const SYNC_MEMOPS: u32 = 0x80;
    // SAFETY: reads a device's recorded flags.
    assert_eq!(unsafe { flags(1) } & SYNC_MEMOPS, 0);
    let v = gpu::DeviceBuffer::new_vmm(1, 1 << 16).unwrap();
    suite::register_vram(a.as_ref(), &v).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { flags(1) } & SYNC_MEMOPS, SYNC_MEMOPS);
    a.deregister_memory(&suite::vram(&v, 0, v.len())).unwrap();
}

fn counter(name: &[u8]) -> u64 {
    type Count = unsafe extern "C" fn() -> u64;
    // SAFETY: one of the stand-in's counters, with this signature.
    let count: libloading::Symbol<'_, Count> = unsafe { stand_in().get(name) }.unwrap();
    // SAFETY: reads a counter.
    unsafe { count() }
}

/// Many small copies between memory of one device run as one launch of
/// the piece-copy kernel (which the stand-in runs and counts); a piece
/// over 64 KiB is split into table entries.
#[test]
fn small_device_copies_run_as_one_kernel_launch() {
    let (launches, entries) = (
        counter(b"fakecuda_kernel_launches"),
        counter(b"fakecuda_kernel_entries"),
    );
    suite::small_pieces(0);
    assert!(counter(b"fakecuda_kernel_launches") > launches);
    assert!(counter(b"fakecuda_kernel_entries") >= entries + 64 + 4 + 3);
}

/// Copies between two devices' memory are not the kernel's (the other
/// device's memory need not be reachable from its context): they go to
/// the driver as one batch (`cuMemcpyBatchAsync`, counted by the
/// stand-in).
#[test]
fn small_copies_across_devices_are_batched() {
    let before = counter(b"fakecuda_batched_copies");
    suite::small_pieces(1);
    assert!(counter(b"fakecuda_batched_copies") >= before + 68);
}

/// Where the driver will not load the kernel (the stand-in with
/// `FAKECUDA_NO_KERNEL`, as a driver too old for its PTX), small copies on
/// one device are batched instead, and the staging buffers' copies go one
/// by one: the same bytes. Runs in a child process:
/// the kernel is loaded once per process.
#[test]
fn without_the_kernel_small_copies_are_batched() {
    if std::env::var_os("KVXFER_FAKE_NO_KERNEL_CHILD").is_some() {
        let before = counter(b"fakecuda_batched_copies");
        suite::small_pieces(0);
        assert!(counter(b"fakecuda_batched_copies") >= before + 68);
        // The staging buffers' copies go one by one (cuMemcpyAsync).
        suite::tcp_round_trips();
        suite::storage_round_trips();
        assert_eq!(counter(b"fakecuda_kernel_launches"), 0);
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "without_the_kernel_small_copies_are_batched",
            "--nocapture",
        ])
        .env("KVXFER_FAKE_NO_KERNEL_CHILD", "1")
        .env("FAKECUDA_NO_KERNEL", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// GPUDirect RDMA registration where the NIC cannot reach the stand-in's
/// device memory (soft-RoCE in the guest: no dma-buf support in its
/// provider, and `ibv_reg_mr` cannot pin an address the host cannot
/// touch): an `rdma` agent's registration fails typed, naming both
/// attempts, and registers nothing; an `auto` agent registers the memory
/// without RDMA and still moves it over TCP. SKIPPED without an RDMA device.
#[test]
fn vram_on_rdma_registration_names_both_attempts() {
    ready("vram_on_rdma_registration_names_both_attempts");
    let a = match kvxfer::make_transfer_agent(
        kvxfer::Backend::Rdma,
        kvxfer::AgentConfig::new("gpu-rdma"),
    ) {
        Ok(a) => a,
        Err(e) => {
            println!("SKIPPED vram_on_rdma_registration_names_both_attempts: no RDMA device ({e})");
            return;
        }
    };
    let g = gpu::DeviceBuffer::new(0, 1 << 20).unwrap();
    let e = suite::register_vram(a.as_ref(), &g).unwrap_err();
    match &e {
        kvxfer::Error::Gpu(GpuError::RdmaRegistration {
            dmabuf, peermem, ..
        }) => {
            assert!(
                dmabuf.contains("DMA_BUF") || dmabuf.contains("dmabuf"),
                "{e}"
            );
            assert!(peermem.contains("ibv_reg_mr"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // Nothing registered: the descriptor exports no GPU region.
    assert!(
        a.local_agent_desc()
            .regions
            .iter()
            .all(|r| r.mem_type != kvxfer::MemoryType::Vram)
    );
    // An auto agent keeps the memory for its other paths.
    let b = suite::agent(kvxfer::Backend::Auto, "gpu-auto");
    suite::register_vram(b.as_ref(), &g).unwrap();
    let c = suite::agent(kvxfer::Backend::Tcp, "gpu-tcp");
    let src = suite::pattern(1 << 20, 8);
    suite::register_dram(c.as_ref(), &src);
    c.load_remote_agent(&b.local_agent_desc()).unwrap();
    let st = c
        .submit_transfer(&kvxfer::TransferRequest::write(
            kvxfer::MemoryDescs::dram(&src),
            suite::vram(&g, 0, 1 << 20),
            "gpu-auto",
        ))
        .unwrap();
    st.wait(std::time::Duration::from_secs(120)).unwrap();
    assert!(suite::device_bytes(&g) == src);
}

/// The stand-in's test controls, each about the copies into or from one
/// allocation (named by its base address): hold them (0 lets go), count them, make
/// the next one fail as an asynchronous fault does.
fn control(name: &[u8]) -> unsafe extern "C" fn(u64) -> u64 {
    // SAFETY: the stand-in's controls all take one address; those that
    // return nothing leave the return register unread by the caller.
    *unsafe { stand_in().get::<unsafe extern "C" fn(u64) -> u64>(name) }.unwrap()
}

/// Holds the copies into or from the allocation at `base` until dropped (also
/// when a check fails, so that the agents' threads can finish). The
/// stand-in holds one allocation at a time: tests that hold take turns.
struct Held(#[allow(dead_code)] std::sync::MutexGuard<'static, ()>);

fn hold(base: u64) -> Held {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: the stand-in's fakecuda_hold(CUdeviceptr).
    unsafe { control(b"fakecuda_hold")(base) };
    Held(turn)
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: as in `hold`; 0 holds nothing.
        unsafe { control(b"fakecuda_hold")(0) };
    }
}

fn copies_with(base: u64) -> u64 {
    // SAFETY: the stand-in's fakecuda_copies_with(CUdeviceptr).
    unsafe { control(b"fakecuda_copies_with")(base) }
}

fn fail_copy_with(base: u64) {
    // SAFETY: the stand-in's fakecuda_fail_copy_with(CUdeviceptr).
    unsafe { control(b"fakecuda_fail_copy_with")(base) };
}

/// Waits up to a minute for `what` to hold.
fn until(what: &str, f: impl Fn() -> bool) {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !f() {
        assert!(std::time::Instant::now() < end, "still not: {what}");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

const PIECE: u64 = 64 << 10;

/// Two TCP agents with one stream each (every segment through one
/// connection thread, so one staging ring on each side), each with host
/// memory `src` and GPU memory (`ga` on `a`, `gb` on `b`) registered.
/// The agents are dropped before the memory.
struct Pair {
    a: Box<dyn kvxfer::TransferAgent>,
    b: Box<dyn kvxfer::TransferAgent>,
    b_name: String,
    src: Vec<u8>,
    ga: gpu::DeviceBuffer,
    gb: gpu::DeviceBuffer,
}

impl Pair {
    fn new(name: &str, seed: u8) -> Pair {
        let make = |name: String| {
            kvxfer::make_transfer_agent(
                kvxfer::Backend::Tcp,
                kvxfer::AgentConfig::new(name).with_streams_per_peer(1),
            )
            .unwrap()
        };
        let b_name = format!("{name}-b");
        let (a, b) = (make(format!("{name}-a")), make(b_name.clone()));
        let src = suite::pattern(3 * PIECE as usize, seed);
        let ga = gpu::DeviceBuffer::new(0, 6 * PIECE).unwrap();
        let gb = gpu::DeviceBuffer::new(0, 6 * PIECE).unwrap();
        suite::register_dram(a.as_ref(), &src);
        suite::register_dram(b.as_ref(), &src);
        suite::register_vram(a.as_ref(), &ga).unwrap();
        suite::register_vram(b.as_ref(), &gb).unwrap();
        a.load_remote_agent(&b.local_agent_desc()).unwrap();
        Pair {
            a,
            b,
            b_name,
            src,
            ga,
            gb,
        }
    }

    /// Three 64 KiB pieces of `src` (the i-th at `i * PIECE`) into GPU
    /// memory, the i-th at `(2 - i) * 2 * PIECE`: three segments, none
    /// adjacent. A write: `a`'s host memory into `gb` (the target
    /// receives); a read: `b`'s host memory into `ga` (the initiator
    /// receives). Returns the request and its GPU memory.
    fn three_pieces(&self, write: bool) -> (kvxfer::TransferRequest, &gpu::DeviceBuffer) {
        let g = if write { &self.gb } else { &self.ga };
        let (dram, vram) = (host_pieces(&self.src), gpu_pieces(g));
        let req = if write {
            kvxfer::TransferRequest::write(dram, vram, &self.b_name)
        } else {
            kvxfer::TransferRequest::read(vram, dram, &self.b_name)
        };
        (req, g)
    }

    /// `gb` with the three pieces of `src` written where [`gpu_pieces`]
    /// puts them.
    fn filled_gb(&self) -> &gpu::DeviceBuffer {
        let (fill, gb) = self.three_pieces(true);
        self.a
            .submit_transfer(&fill)
            .unwrap()
            .wait(std::time::Duration::from_secs(60))
            .unwrap();
        gb
    }
}

/// Three 64 KiB pieces of host memory `buf`, back to back.
fn host_pieces(buf: &[u8]) -> kvxfer::MemoryDescs {
    let l = (0..3)
        .map(|i| kvxfer::MemoryDesc::new(buf.as_ptr() as u64 + i * PIECE, PIECE, 0))
        .collect();
    kvxfer::MemoryDescs::new(kvxfer::MemoryType::Dram, l)
}

/// Three 64 KiB pieces of GPU memory `g`, the i-th at `(2 - i) * 2 *
/// PIECE`.
fn gpu_pieces(g: &gpu::DeviceBuffer) -> kvxfer::MemoryDescs {
    let r = (0..3)
        .map(|i| kvxfer::MemoryDesc::new(g.addr() + (2 - i) * 2 * PIECE, PIECE, g.device()))
        .collect();
    kvxfer::MemoryDescs::new(kvxfer::MemoryType::Vram, r)
}

/// Whether `g` holds the three pieces of `src` where [`gpu_pieces`] puts
/// them.
fn three_landed(src: &[u8], g: &gpu::DeviceBuffer) -> bool {
    let on = suite::device_bytes(g);
    (0..3usize).all(|i| {
        let at = (2 - i) * 2 * PIECE as usize;
        on[at..at + PIECE as usize] == src[i * PIECE as usize..(i + 1) * PIECE as usize]
    })
}

/// Posts `req` with the copies into or from `g` held: waits until three of
/// them are queued, checks that the request is still unfinished, then lets
/// the copies run and waits for it.
fn three_queued_while_held(
    a: &dyn kvxfer::TransferAgent,
    g: &gpu::DeviceBuffer,
    req: &kvxfer::TransferRequest,
) {
    let held = hold(g.addr());
    let before = copies_with(g.addr());
    let st = a.submit_transfer(req).unwrap();
    until("the three segments' copies queued while held", || {
        copies_with(g.addr()) >= before + 3
    });
    assert_eq!(st.poll().unwrap(), kvxfer::TransferState::InProgress);
    drop(held);
    st.wait(std::time::Duration::from_secs(60)).unwrap();
}

/// A receiver of staged GPU data reads the next segments from the socket
/// while the copies of the earlier ones run. With the copies into the
/// destination held, all three segments of a WRITE (at the target) and of
/// a READ's data (at the initiator) are read and their copies queued — a
/// receiver that waited for each segment's copies would queue one and
/// wait — and the request stays unfinished; once they run, it completes
/// with the data in place.
#[test]
fn staged_receives_read_on_while_copies_run() {
    ready("staged_receives_read_on_while_copies_run");
    let p = Pair::new("read-on", 21);
    for write in [true, false] {
        let (req, g) = p.three_pieces(write);
        three_queued_while_held(p.a.as_ref(), g, &req);
        assert!(three_landed(&p.src, g), "write: {write}");
    }
}

/// A copy into GPU memory that fails after the receiver moved on to the
/// next segments fails its request, typed: at the target, a refusal
/// (`GpuCopy`); at a READ's initiator, the driver's error. The connection
/// serves on, and the same transfer then succeeds (the failed staging ring
/// replaced).
#[test]
fn a_failed_staged_copy_fails_its_request_and_the_link_serves_on() {
    ready("a_failed_staged_copy_fails_its_request_and_the_link_serves_on");
    let p = Pair::new("fault", 22);
    for write in [true, false] {
        let (req, g) = p.three_pieces(write);
        fail_copy_with(g.addr());
        let st = p.a.submit_transfer(&req).unwrap();
        let e = st.wait(std::time::Duration::from_secs(60)).unwrap_err();
        if write {
            assert!(
                matches!(
                    e,
                    kvxfer::Error::RemoteRejected {
                        reason: kvxfer::RejectReason::GpuCopy,
                        ..
                    }
                ),
                "{e:?}"
            );
        } else {
            assert!(
                matches!(e, kvxfer::Error::Gpu(GpuError::Driver { code: 700, .. })),
                "{e:?}"
            );
        }
        let st = p.a.submit_transfer(&req).unwrap();
        st.wait(std::time::Duration::from_secs(60)).unwrap();
        assert!(three_landed(&p.src, g), "write: {write}");
    }
}

/// The target answers READs of its GPU memory that arrived together
/// through one pipeline: with the copies from that memory held, the copies
/// of all three segments are queued before any is sent (answering each
/// segment on its own, its copy waited for, would queue one and wait);
/// once they run, the data arrives exact and in order.
#[test]
fn gpu_reads_answered_through_one_pipeline() {
    ready("gpu_reads_answered_through_one_pipeline");
    let back = vec![0u8; 3 * PIECE as usize];
    let p = Pair::new("read-run", 23);
    suite::register_dram(p.a.as_ref(), &back);
    let gb = p.filled_gb();
    let req = kvxfer::TransferRequest::read(host_pieces(&back), gpu_pieces(gb), &p.b_name);
    three_queued_while_held(p.a.as_ref(), gb, &req);
    assert!(back == p.src);
}

/// READs that arrive together at the target and that one pipeline cannot
/// take (a refused key, host memory) end its run and are answered in turn:
/// with the target held answering a first READ of its GPU memory, READs
/// of its GPU memory, of GPU memory with a stale key, again of its GPU
/// memory and of its host memory queue behind it; each gets its own
/// answer, in order — the data exact, the stale key refused `BadKey`.
#[test]
fn gpu_read_runs_end_at_what_they_cannot_take() {
    ready("gpu_read_runs_end_at_what_they_cannot_take");
    let backs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 3 * PIECE as usize]).collect();
    let stale = gpu::DeviceBuffer::new(0, 6 * PIECE).unwrap();
    let p = Pair::new("read-mix", 24);
    for back in &backs {
        suite::register_dram(p.a.as_ref(), back);
    }
    suite::register_vram(p.b.as_ref(), &stale).unwrap();
    p.a.load_remote_agent(&p.b.local_agent_desc()).unwrap();
    // `stale`'s key as `a` knows it stops being valid.
    p.b.deregister_memory(&suite::vram(&stale, 0, stale.len()))
        .unwrap();
    suite::register_vram(p.b.as_ref(), &stale).unwrap();
    let gb = p.filled_gb();
    let read = |back: &[u8], from: kvxfer::MemoryDescs| {
        p.a.submit_transfer(&kvxfer::TransferRequest::read(
            host_pieces(back),
            from,
            &p.b_name,
        ))
        .unwrap()
    };
    let held = hold(gb.addr());
    let before = copies_with(gb.addr());
    let first = read(&backs[0], gpu_pieces(gb));
    until("the first READ's copies queued while held", || {
        copies_with(gb.addr()) >= before + 3
    });
    let gpu_again = read(&backs[1], gpu_pieces(gb));
    let refused = read(&backs[2], gpu_pieces(&stale));
    let gpu_third = read(&backs[3], gpu_pieces(gb));
    let host = read(&backs[2], host_pieces(&p.src));
    drop(held);
    let wait = |st: &kvxfer::TransferStatus| st.wait(std::time::Duration::from_secs(60));
    for st in [&first, &gpu_again, &gpu_third] {
        wait(st).unwrap();
    }
    let e = wait(&refused).unwrap_err();
    assert!(
        matches!(
            e,
            kvxfer::Error::RemoteRejected {
                reason: kvxfer::RejectReason::BadKey,
                ..
            }
        ),
        "{e:?}"
    );
    wait(&host).unwrap();
    for back in &backs {
        assert!(back == &p.src);
    }
}

/// A driver entry point of the stand-in, for the test to play the serving
/// engine (streams, events, asynchronous copies).
fn entry<T: Copy>(name: &[u8]) -> T {
    // SAFETY: the caller names the symbol's true signature.
    *unsafe { stand_in().get::<T>(name) }.unwrap()
}

type Create = unsafe extern "C" fn(*mut *mut std::ffi::c_void, u32) -> u32;
type Record = unsafe extern "C" fn(*mut std::ffi::c_void, *mut std::ffi::c_void) -> u32;
type CopyAsync = unsafe extern "C" fn(u64, u64, usize, *mut std::ffi::c_void) -> u32;

/// The "compute" of a layer: a device-to-device copy on `stream`, then an
/// event recorded after it.
fn compute_then_event(
    stream: *mut std::ffi::c_void,
    into: &gpu::DeviceBuffer,
    from: &gpu::DeviceBuffer,
) -> gpu::CudaEvent {
    let mut ev = std::ptr::null_mut();
    // SAFETY: the stand-in's cuEventCreate, cuMemcpyAsync and cuEventRecord
    // with live buffers, stream and event.
    unsafe {
        assert_eq!(entry::<Create>(b"cuEventCreate")(&mut ev, 0), 0);
        let copy = entry::<CopyAsync>(b"cuMemcpyAsync");
        assert_eq!(
            copy(into.addr(), from.addr(), into.len() as usize, stream),
            0
        );
        assert_eq!(entry::<Record>(b"cuEventRecord")(ev, stream), 0);
        // The event stays alive for the test's length (never destroyed).
        gpu::CudaEvent::from_raw(ev as u64, 0)
    }
}

/// Layer-wise sending after CUDA events: a layer marked ready after an
/// event is written only once the work recorded before it ran, and a fault
/// in that work fails the request.
#[test]
fn layers_ready_after_their_cuda_event() {
    use kvxfer::cache::{
        CacheError, CacheReceiver, CacheSender, CacheState, DataType, RecvRequest, SenderConfig,
        distinct_heads, rank_slice,
    };
    use kvxfer::{AgentConfig, Backend, MemoryDescs};
    stand_in();
    let into = gpu::DeviceBuffer::new(0, 1 << 16).unwrap();
    let from = gpu::DeviceBuffer::new(0, 1 << 16).unwrap();
    let mut stream = std::ptr::null_mut();
    // SAFETY: the stand-in's cuStreamCreate (its context is current: the
    // buffers above bound it).
    let made = unsafe { entry::<Create>(b"cuStreamCreate")(&mut stream, 0) };
    assert_eq!(made, 0);

    // TP1 -> TP1, two layers, host pools over TCP.
    let st = CacheState::new(
        2,
        2,
        16,
        4,
        DataType::Bf16,
        kvxfer::cache::Attention::Default,
        1,
        1,
    );
    let slice = rank_slice(&st, 0, distinct_heads(&st, &st));
    let bb = slice.block_bytes() as usize;
    let agent = |n: &str| -> Arc<dyn kvxfer::TransferAgent> {
        Arc::from(kvxfer::make_transfer_agent(Backend::Tcp, AgentConfig::new(n)).unwrap())
    };
    let (ca, ga) = (agent("ev-ctx"), agent("ev-gen"));
    let mut src = vec![0u8; 2 * bb];
    for b in 0..2 {
        kvxfer::cache::pattern::fill_block(&st, &slice, &mut src[b * bb..(b + 1) * bb], b as u32);
    }
    let dst = vec![0u8; 2 * bb];
    // SAFETY: the pools outlive the agents' use (the sender and receiver
    // are dropped first, below).
    unsafe {
        ca.register_memory(&MemoryDescs::dram(&src)).unwrap();
        ga.register_memory(&MemoryDescs::dram(&dst)).unwrap();
    }
    let sender = CacheSender::new(
        Arc::clone(&ca),
        st.clone(),
        0,
        None,
        SenderConfig {
            timeout: Duration::from_secs(20),
            ..SenderConfig::default()
        },
    )
    .unwrap();
    let receiver = CacheReceiver::new(
        Arc::clone(&ga),
        st.clone(),
        0,
        st.clone(),
        &[ca.local_connection_info()],
        kvxfer::cache::ReceiverConfig::default(),
    )
    .unwrap();
    let addrs = |v: &[u8]| vec![v.as_ptr() as u64, v.as_ptr() as u64 + bb as u64];
    let ask = |id| {
        receiver
            .request(RecvRequest {
                request_id: id,
                ctx_dp_rank: 0,
                blocks: addrs(&dst),
                last_block_key: None,
            })
            .unwrap()
    };
    let wait = Duration::from_secs(60);

    let rh = ask(1);
    let sh = sender.begin(1, addrs(&src)).unwrap();
    let held = hold(into.addr());
    let ev = compute_then_event(stream, &into, &from);
    sender.layers_ready_after(1, 0..1, ev).unwrap();
    assert!(matches!(
        sender.layers_ready_after(1, 1..3, ev),
        Err(CacheError::LayersOutOfRange { .. })
    ));
    sender.layers_ready(1, 1..2).unwrap();
    rh.wait_layers(1..2, wait).unwrap();
    // Layer 0's compute is held: it cannot have been written.
    assert_eq!(rh.layers_landed().len(), 1);
    assert!(!rh.is_done());
    drop(held);
    rh.wait_layers(0..1, wait).unwrap();
    sh.wait(wait).unwrap();
    rh.wait(wait).unwrap();
    for b in 0..2 {
        let blk = &dst[b * bb..(b + 1) * bb];
        assert_eq!(
            kvxfer::cache::pattern::check_block(&st, &slice, blk, b as u32, 8),
            None
        );
    }

    // A fault in the layer's compute fails the request on both sides.
    let rh = ask(2);
    let sh = sender.begin(2, addrs(&src)).unwrap();
    fail_copy_with(into.addr());
    let ev = compute_then_event(stream, &into, &from);
    sender.layers_ready_after(2, 0..2, ev).unwrap();
    let e = sh.wait(wait).unwrap_err();
    assert!(
        matches!(&e, CacheError::Transfer(kvxfer::Error::Gpu(_))),
        "{e}"
    );
    assert!(rh.wait(wait).is_err());
    drop(receiver);
    drop(sender);
}

/// Small pieces are packed into the staging buffers. With two buffers of
/// 1 MiB, the copies of 32 pieces of 16 KiB are queued together, on the
/// side that receives into GPU memory and on the side that sends from it,
/// while that memory's copies are held (one buffer per piece would queue
/// two copies and wait for the first), as a few launches of the piece-copy
/// kernel; then the data lands exact.
#[test]
fn small_staged_pieces_share_a_buffer() {
    ready("small_staged_pieces_share_a_buffer");
    const N: u64 = 32;
    const P: u64 = 16 << 10;
    let make = |name: &str| {
        kvxfer::make_transfer_agent(
            kvxfer::Backend::Tcp,
            kvxfer::AgentConfig::new(name)
                .with_streams_per_peer(1)
                .with_gpu_staging(1 << 20, 2),
        )
        .unwrap()
    };
    // The memory first: the agents are dropped before it, also when a
    // check fails.
    let src = suite::pattern((N * P) as usize, 9);
    let dst = vec![0u8; (N * P) as usize];
    let ga = gpu::DeviceBuffer::new(0, 2 * N * P).unwrap();
    let gb = gpu::DeviceBuffer::new(0, 2 * N * P).unwrap();
    let (a, b) = (make("pack-a"), make("pack-b"));
    suite::register_dram(a.as_ref(), &src);
    suite::register_dram(b.as_ref(), &dst);
    suite::register_vram(a.as_ref(), &ga).unwrap();
    suite::register_vram(b.as_ref(), &gb).unwrap();
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    let host = |buf: &[u8]| {
        let l = (0..N)
            .map(|i| kvxfer::MemoryDesc::new(buf.as_ptr() as u64 + i * P, P, 0))
            .collect();
        kvxfer::MemoryDescs::new(kvxfer::MemoryType::Dram, l)
    };
    // The i-th piece at (N - 1 - i) * 2 * P: none adjacent.
    let vram = |g: &gpu::DeviceBuffer| {
        let l = (0..N)
            .map(|i| kvxfer::MemoryDesc::new(g.addr() + (N - 1 - i) * 2 * P, P, 0))
            .collect();
        kvxfer::MemoryDescs::new(kvxfer::MemoryType::Vram, l)
    };
    let placed = |g: &gpu::DeviceBuffer| {
        let on = suite::device_bytes(g);
        (0..N as usize).all(|i| {
            let at = (N as usize - 1 - i) * 2 * P as usize;
            on[at..][..P as usize] == src[i * P as usize..][..P as usize]
        })
    };
    let queued_while_held = |g: &gpu::DeviceBuffer, req: kvxfer::TransferRequest| {
        let held = hold(g.addr());
        let before = copies_with(g.addr());
        let st = a.submit_transfer(&req).unwrap();
        until("the small pieces' copies queued while held", || {
            copies_with(g.addr()) >= before + 8
        });
        assert_eq!(st.poll().unwrap(), kvxfer::TransferState::InProgress);
        drop(held);
        st.wait(std::time::Duration::from_secs(60)).unwrap();
    };
    let launches = counter(b"fakecuda_kernel_launches");
    // The target receives into GPU memory.
    queued_while_held(
        &gb,
        kvxfer::TransferRequest::write(host(&src), vram(&gb), "pack-b"),
    );
    assert!(placed(&gb), "host → a peer's VRAM");
    // The initiator sends from GPU memory.
    for i in 0..N {
        let at = (N - 1 - i) * 2 * P;
        ga.write(at, &src[(i * P) as usize..][..P as usize])
            .unwrap();
    }
    queued_while_held(
        &ga,
        kvxfer::TransferRequest::write(vram(&ga), host(&dst), "pack-b"),
    );
    assert!(dst == src, "VRAM → a peer's host memory");
    // Each side's copies went as launches of the piece-copy kernel (a
    // buffer's worth each), not one by one.
    let launched = counter(b"fakecuda_kernel_launches") - launches;
    assert!((2..=16).contains(&launched), "{launched} launches");
}
