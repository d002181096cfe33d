//! Cluster metadata on a real etcd (Debian's `etcd-server`), started by
//! the tests on loopback ports in a temporary data directory: agents
//! published and found by name, a live name taken once, peers that leave
//! (closed, killed, stopped) failing their requests with `PeerGone`,
//! reconnection by name, etcd faults (its leader killed, all of it stopped
//! and started again), and agents on "hosts" that are network namespaces
//! the test makes (one unplugged from their switch). Without an `etcd`
//! binary, or network namespaces, the tests print a SKIPPED line.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::PeerProc;
use common::etcd::Etcd;
use kvxfer::{
    AgentConfig, Backend, Error, EtcdConfig, MemoryDescs, TransferAgent, TransferRequest,
    make_transfer_agent,
};

/// A lease short enough for the tests, long enough for a loaded machine.
const TTL: Duration = Duration::from_secs(3);
const WAIT: Duration = Duration::from_secs(60);

/// An agent configuration on `etcd` under `prefix`.
fn config(etcd: &Etcd, name: &str, prefix: &str) -> AgentConfig {
    AgentConfig::new(name).with_etcd(
        EtcdConfig::new(etcd.endpoints())
            .with_prefix(prefix)
            .with_lease_ttl(TTL),
    )
}

/// A prefix of this test's own.
fn prefix(test: &str) -> String {
    format!("/kvxfer-test-{}-{test}", std::process::id())
}

/// The etcd cluster, or a SKIPPED line and `None`.
fn etcd(test: &str, n: usize) -> Option<Etcd> {
    match Etcd::start(n) {
        Ok(e) => Some(e),
        Err(why) => {
            println!("SKIPPED {test}: {why}");
            None
        }
    }
}

/// A buffer registered with `agent`, leaked (it outlives every agent of the
/// test).
fn buffer(agent: &dyn TransferAgent, len: usize, fill: u8) -> &'static mut [u8] {
    let b: &'static mut [u8] = Box::leak(vec![fill; len].into_boxed_slice());
    // SAFETY: leaked: the memory lives for the whole process.
    unsafe { agent.register_memory(&MemoryDescs::dram(b)).unwrap() };
    b
}

fn write(init: &dyn TransferAgent, src: &[u8], dst: &[u8], to: &str) -> Result<(), Error> {
    let req = TransferRequest::write(MemoryDescs::dram(src), MemoryDescs::dram(dst), to);
    init.submit_transfer(&req)?.wait_success(WAIT)
}

/// Retries `f` (a store request during an election, say) until it succeeds
/// or `within` has passed.
fn eventually<T>(within: Duration, mut f: impl FnMut() -> Result<T, Error>) -> Result<T, Error> {
    let t0 = Instant::now();
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if t0.elapsed() < within => {
                println!("retrying: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

#[test]
fn agents_find_each_other_by_name_and_a_live_name_is_taken_once() {
    let Some(etcd) = etcd("agents_find_each_other_by_name", 1) else {
        return;
    };
    let p = prefix("names");
    let target = make_transfer_agent(Backend::Tcp, config(&etcd, "ctx-0", &p)).unwrap();
    let dst = buffer(target.as_ref(), 1 << 20, 0);
    let init = make_transfer_agent(Backend::Tcp, config(&etcd, "gen-0", &p)).unwrap();
    let src = buffer(init.as_ref(), 1 << 20, 0x5a);
    init.load_remote_agent_by_name("ctx-0").unwrap();
    write(init.as_ref(), src, dst, "ctx-0").unwrap();
    assert!(dst.iter().all(|&b| b == 0x5a));

    // The same live name again: refused, typed; the holder is unaffected.
    let e = make_transfer_agent(Backend::Tcp, config(&etcd, "ctx-0", &p))
        .err()
        .expect("a second ctx-0 was accepted");
    assert!(
        matches!(e, Error::NameTaken { ref name, .. } if name == "ctx-0"),
        "{e}"
    );
    // Another prefix is another cluster: the name is free there.
    drop(make_transfer_agent(Backend::Tcp, config(&etcd, "ctx-0", &prefix("other"))).unwrap());
    // A name nobody holds; data under the prefix that is not a descriptor.
    let e = init.load_remote_agent_by_name("nobody").unwrap_err();
    assert!(matches!(e, Error::UnknownAgent(_)), "{e}");
    etcd.put(&format!("{p}/agents/junk"), "not a descriptor");
    let e = init.load_remote_agent_by_name("junk").unwrap_err();
    assert!(matches!(e, Error::InvalidAgentDesc(_)), "{e}");
    // ... which the watchers ignore: transfers go on.
    write(init.as_ref(), src, dst, "ctx-0").unwrap();

    // The target closes: its key goes at once, and the initiator's next
    // request finds it gone.
    drop(target);
    let t0 = Instant::now();
    let e = eventually(Duration::from_secs(10), || {
        match write(init.as_ref(), src, dst, "ctx-0") {
            Err(Error::PeerGone { .. }) => Ok(()),
            Ok(()) => Err(Error::Closed),
            Err(e) => Err(e),
        }
    });
    e.unwrap();
    println!(
        "a closed peer was gone for its peers after {:?}",
        t0.elapsed()
    );

    // It comes back (a new instance): the next request reconnects by name.
    let again = make_transfer_agent(Backend::Tcp, config(&etcd, "ctx-0", &p)).unwrap();
    let dst2 = buffer(again.as_ref(), 1 << 20, 0);
    src.fill(0x3c);
    eventually(Duration::from_secs(10), || {
        write(init.as_ref(), src, dst2, "ctx-0")
    })
    .unwrap();
    assert!(dst2.iter().all(|&b| b == 0x3c));
}

/// With a cluster credential, a store writer without the secret can
/// neither redirect nor lock out agents: a live agent's entry replaced or
/// deleted is put back (sealed) and peers keep reaching it by name; an
/// unsealed entry is never taken for a descriptor; a name squatted by an
/// entry that is no live agent's (no lease; a lease of its own but no
/// seal) is taken over at start; a live agent's name is still taken once.
#[test]
fn a_rogue_store_writer_neither_redirects_nor_locks_out_agents() {
    let Some(etcd) = etcd("a_rogue_store_writer", 1) else {
        return;
    };
    let p = prefix("rogue");
    let cred = kvxfer::Credential::new(b"etcd-test-6f0c2e9b41a7d853e2c9".to_vec()).unwrap();
    let sealed = |name: &str| config(&etcd, name, &p).with_credential(cred.clone());
    let target = make_transfer_agent(Backend::Tcp, sealed("ctx-0")).unwrap();
    let dst = buffer(target.as_ref(), 1 << 20, 0);
    let init = make_transfer_agent(Backend::Tcp, sealed("gen-0")).unwrap();
    let src = buffer(init.as_ref(), 1 << 20, 0x5a);
    let key = format!("{p}/agents/ctx-0");
    let published = etcd.get(&key).expect("the target's entry");
    assert!(published.starts_with(b"kvxfer\x01S"), "not sealed");

    // Replaced by a writer without the secret (the target's own
    // descriptor, unsealed: what a forger could copy): put back.
    let forged = &published[40..];
    etcd.put_bytes(&key, forged);
    eventually(WAIT, || match etcd.get(&key) {
        Some(v) if v == published => Ok(()),
        _ => Err(Error::Closed),
    })
    .unwrap();
    init.load_remote_agent_by_name("ctx-0").unwrap();
    write(init.as_ref(), src, dst, "ctx-0").unwrap();
    // Deleted: put back too.
    let st = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &etcd.endpoints().join(","), "del", &key])
        .output()
        .unwrap();
    assert!(st.status.success());
    eventually(WAIT, || match etcd.get(&key) {
        Some(v) if v == published => Ok(()),
        _ => Err(Error::Closed),
    })
    .unwrap();

    // An unsealed entry under a name no agent holds is not a descriptor
    // for an agent with the credential.
    etcd.put_bytes(&format!("{p}/agents/fake"), forged);
    let e = init.load_remote_agent_by_name("fake").unwrap_err();
    assert!(
        matches!(&e, Error::MetadataStore { reason, .. } if reason.contains("not sealed")),
        "{e}"
    );

    // Squatted names: no lease, and a live lease without a seal. Both
    // agents start, and are reached by name.
    etcd.put(&format!("{p}/agents/ctx-1"), "squatted, no lease");
    etcd.put_leased(&format!("{p}/agents/ctx-2"), "squatted, leased");
    for name in ["ctx-1", "ctx-2"] {
        let a = make_transfer_agent(Backend::Tcp, sealed(name))
            .unwrap_or_else(|e| panic!("{name} kept out by a squatter: {e}"));
        let d = buffer(a.as_ref(), 1 << 20, 0);
        init.load_remote_agent_by_name(name).unwrap();
        write(init.as_ref(), src, d, name).unwrap();
        assert!(d.iter().all(|&b| b == 0x5a));
    }
    // A live agent's name is still taken once.
    let e = make_transfer_agent(Backend::Tcp, sealed("ctx-0"))
        .err()
        .expect("a second ctx-0 was accepted");
    assert!(matches!(e, Error::NameTaken { .. }), "{e}");
    write(init.as_ref(), src, dst, "ctx-0").unwrap();
}

/// A peer process stopped (SIGSTOP: it holds its sockets but renews
/// nothing, as a hung or cut-off host): its lease expires and a request
/// stuck on it fails with `PeerGone` long before the I/O timeout. A peer
/// killed (SIGKILL) is gone from the store once its lease expires; a new
/// process under its name is reached by the next request.
#[test]
fn peers_that_die_or_hang_fail_their_requests_with_peer_gone() {
    let Some(etcd) = etcd("peers_that_die_or_hang", 1) else {
        return;
    };
    let p = prefix("die");
    let eps = etcd.endpoints().join(",");
    let ttl = TTL.as_secs().to_string();
    let env = [
        ("KVXFER_ETCD", eps.as_str()),
        ("KVXFER_ETCD_PREFIX", p.as_str()),
        ("KVXFER_ETCD_LEASE_TTL", ttl.as_str()),
    ];
    const LEN: u64 = 64 << 20;
    let mut cfg = config(&etcd, "init", &p);
    cfg.io_timeout = Duration::from_secs(120);
    let init = make_transfer_agent(Backend::Tcp, cfg).unwrap();
    let src = buffer(init.as_ref(), LEN as usize, 0x11);

    // Hung.
    let hung = PeerProc::spawn("hung", LEN, 1, &env);
    init.load_remote_agent_by_name("hung").unwrap();
    let small =
        TransferRequest::write(MemoryDescs::dram(&src[..4096]), hung.range(0, 4096), "hung");
    init.submit_transfer(&small)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    hung.signal("STOP");
    let big = TransferRequest::write(MemoryDescs::dram(src), hung.range(0, LEN), "hung");
    let t0 = Instant::now();
    let st = init.submit_transfer(&big).unwrap();
    let e = st.wait_success(Duration::from_secs(100)).unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(e, Error::PeerGone { .. }), "{e}");
    println!(
        "a hung peer's request failed with PeerGone after {took:?} (its lease {TTL:?}, I/O timeout 120 s)"
    );
    assert!(took < Duration::from_secs(100));
    hung.signal("CONT");
    drop(hung);

    // Killed.
    let mut killed = PeerProc::spawn("killed", LEN, 2, &env);
    init.load_remote_agent_by_name("killed").unwrap();
    let to_killed = killed.range(0, 4096);
    let req = TransferRequest::write(MemoryDescs::dram(&src[..4096]), to_killed, "killed");
    init.submit_transfer(&req)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    killed.kill();
    let t0 = Instant::now();
    eventually(Duration::from_secs(30), || {
        match init
            .submit_transfer(&req)
            .and_then(|s| s.wait_success(WAIT))
        {
            Err(Error::PeerGone { .. }) => Ok(()),
            Ok(()) => panic!("a killed peer took a write"),
            Err(e) => Err(e),
        }
    })
    .unwrap();
    println!(
        "a killed peer was gone from the store after {:?}",
        t0.elapsed()
    );
    // A new process under the name: the next request reaches it.
    let back = PeerProc::spawn("killed", LEN, 3, &env);
    let req = TransferRequest::write(
        MemoryDescs::dram(&src[..4096]),
        back.range(0, 4096),
        "killed",
    );
    eventually(Duration::from_secs(30), || {
        init.submit_transfer(&req)
            .and_then(|s| s.wait_success(WAIT))
    })
    .unwrap();
}

/// Three members; the leader is killed: lookups and lease renewals go on
/// (an agent outlives several lease periods), and so do transfers.
#[test]
fn lookups_and_renewals_survive_the_etcd_leader() {
    let Some(mut etcd) = etcd("lookups_and_renewals_survive_the_etcd_leader", 3) else {
        return;
    };
    let p = prefix("leader");
    let a = make_transfer_agent(Backend::Tcp, config(&etcd, "a", &p)).unwrap();
    let dst = buffer(a.as_ref(), 1 << 16, 0);
    let b = make_transfer_agent(Backend::Tcp, config(&etcd, "b", &p)).unwrap();
    let src = buffer(b.as_ref(), 1 << 16, 7);
    b.load_remote_agent_by_name("a").unwrap();
    let leader = etcd.leader().unwrap_or(0);
    etcd.kill(leader);
    println!("killed etcd member {leader} (the leader)");
    // Several lease periods: renewals must go on for `a` to stay.
    let until = Instant::now() + 3 * TTL;
    while Instant::now() < until {
        write(b.as_ref(), src, dst, "a").unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    let c = make_transfer_agent(Backend::Tcp, config(&etcd, "c", &p)).unwrap();
    eventually(Duration::from_secs(20), || c.load_remote_agent_by_name("a")).unwrap();
    write(b.as_ref(), src, dst, "a").unwrap();
}

/// All of etcd stopped: transfers between connected agents go on, lookups
/// fail with a typed error naming the store (within its timeout); started
/// again (same data), lookups work and the agents are still published.
#[test]
fn transfers_outlive_an_etcd_outage() {
    let Some(mut etcd) = etcd("transfers_outlive_an_etcd_outage", 1) else {
        return;
    };
    let p = prefix("outage");
    let a = make_transfer_agent(Backend::Tcp, config(&etcd, "a", &p)).unwrap();
    let dst = buffer(a.as_ref(), 1 << 16, 0);
    let b = make_transfer_agent(Backend::Tcp, config(&etcd, "b", &p)).unwrap();
    let src = buffer(b.as_ref(), 1 << 16, 9);
    b.load_remote_agent_by_name("a").unwrap();
    etcd.kill(0);
    let until = Instant::now() + 2 * TTL;
    while Instant::now() < until {
        write(b.as_ref(), src, dst, "a").unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    let t0 = Instant::now();
    let e = b.load_remote_agent_by_name("a").unwrap_err();
    assert!(matches!(e, Error::MetadataStore { .. }), "{e}");
    assert!(e.to_string().contains("etcd"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    etcd.run(0);
    etcd.wait_ready().unwrap();
    eventually(Duration::from_secs(30), || b.load_remote_agent_by_name("a")).unwrap();
    write(b.as_ref(), src, dst, "a").unwrap();
    // Both still hold their names.
    let e = make_transfer_agent(Backend::Tcp, config(&etcd, "a", &p)).err();
    assert!(matches!(e, Some(Error::NameTaken { .. })), "{e:?}");
}

/// Entry point of the peer processes (`PeerProc`).
#[test]
fn peer_process_entry() {
    if std::env::var("KVXFER_PEER").is_ok() {
        common::peer_main();
    }
}

/// Network namespaces made by the test: a switch (a bridge in a namespace
/// of its own) and hosts plugged into it by veth pairs, `10.77.0.<i+1>/24`
/// each. Deleted on drop.
struct Net {
    switch: String,
    hosts: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

impl Net {
    fn new(hosts: usize) -> Result<Self, String> {
        let tag = format!("kvx{}", std::process::id());
        let switch = format!("{tag}-sw");
        ip(&["netns", "add", &switch])?;
        let mut net = Net {
            switch,
            hosts: Vec::new(),
        };
        let sw = net.switch.clone();
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..hosts {
            let h = format!("{tag}-h{i}");
            ip(&["netns", "add", &h])?;
            net.hosts.push(h.clone());
            let port = format!("p{i}");
            ip(&[
                "-n", &h, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns",
                &sw,
            ])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", &port, "up"])?;
            ip(&[
                "-n",
                &h,
                "addr",
                "add",
                &format!("{}/24", Net::addr(i)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &h, "link", "set", "eth0", "up"])?;
            ip(&["-n", &h, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    fn addr(i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// Unplugs host `i` (its switch port down) or plugs it back.
    fn plug(&self, i: usize, up: bool) {
        ip(&[
            "-n",
            &self.switch,
            "link",
            "set",
            &format!("p{i}"),
            if up { "up" } else { "down" },
        ])
        .unwrap();
    }

    /// Runs `f` on a thread inside host `i`'s namespace: agents made there
    /// listen and connect there (their threads inherit it).
    fn run_in<T: Send>(&self, i: usize, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}", self.hosts[i]);
        std::thread::scope(|s| {
            s.spawn(move || {
                use std::os::fd::AsRawFd;
                let ns = std::fs::File::open(&path).expect("netns file");
                // SAFETY: moves this thread only into the namespace, whose
                // descriptor is open for the call.
                let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .expect("namespace thread")
        })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for h in self.hosts.iter().chain([&self.switch]) {
            let _ = ip(&["netns", "del", h]);
        }
    }
}

/// Three "hosts" (network namespaces on a bridge): etcd on one, a target
/// process on another, the initiator on the third. They find each other by
/// name and transfer; the target's host unplugged, its lease expires and a
/// request stuck on it fails with `PeerGone` (its connection still open);
/// plugged back, the next request reaches it again.
#[test]
fn agents_on_other_hosts_find_each_other_and_an_unplugged_host_is_gone() {
    let test = "agents_on_other_hosts_find_each_other_and_an_unplugged_host_is_gone";
    let net = match Net::new(3) {
        Ok(n) => n,
        Err(why) => {
            println!("SKIPPED {test}: no network namespaces here ({why})");
            return;
        }
    };
    let etcd = match Etcd::start_in(&net.hosts[2], &Net::addr(2)) {
        Ok(e) => e,
        Err(why) => {
            println!("SKIPPED {test}: {why}");
            return;
        }
    };
    let endpoint = format!("{}:2379", Net::addr(2));
    let p = prefix("hosts");
    let secret = "netns-test-a4e19c70d3b25f86b1e7";
    let ttl = TTL.as_secs().to_string();
    let listen = format!("{}:0", Net::addr(0));
    const LEN: u64 = 64 << 20;
    let target = PeerProc::spawn_in(
        &net.hosts[0],
        "host-a",
        LEN,
        5,
        &[
            ("KVXFER_ETCD", endpoint.as_str()),
            ("KVXFER_ETCD_PREFIX", p.as_str()),
            ("KVXFER_ETCD_LEASE_TTL", ttl.as_str()),
            ("KVXFER_TEST_LISTEN", listen.as_str()),
            ("KVXFER_SECRET", secret),
        ],
    );
    let to_a = |off, len| target.range(off, len);
    let small_dst = to_a(0, 4096);
    let big_dst = to_a(0, LEN);
    net.run_in(1, || {
        let mut cfg = AgentConfig::new("host-b")
            .with_listen(format!("{}:0", Net::addr(1)).parse().unwrap())
            .with_credential(kvxfer::Credential::new(secret.as_bytes().to_vec()).unwrap())
            .with_etcd(
                EtcdConfig::new([endpoint.clone()])
                    .with_prefix(&p)
                    .with_lease_ttl(TTL),
            );
        cfg.io_timeout = Duration::from_secs(120);
        let init = make_transfer_agent(Backend::Tcp, cfg).unwrap();
        let src = buffer(init.as_ref(), LEN as usize, 0x77);
        init.load_remote_agent_by_name("host-a").unwrap();
        let small =
            TransferRequest::write(MemoryDescs::dram(&src[..4096]), small_dst.clone(), "host-a");
        let st = init.submit_transfer(&small).unwrap();
        st.wait_success(WAIT).unwrap();
        assert_eq!(st.data_path().transport, kvxfer::TransportKind::Tcp);
        // Unplugged: no reset, no answer; the lease runs out.
        net.plug(0, false);
        let big = TransferRequest::write(MemoryDescs::dram(src), big_dst.clone(), "host-a");
        let t0 = Instant::now();
        let e = init
            .submit_transfer(&big)
            .unwrap()
            .wait_success(Duration::from_secs(100))
            .unwrap_err();
        let took = t0.elapsed();
        assert!(matches!(e, Error::PeerGone { .. }), "{e}");
        println!("an unplugged host's request failed with PeerGone after {took:?} (lease {TTL:?}, I/O timeout 120 s)");
        // Plugged back: it publishes itself again, and the next request
        // finds it by name.
        net.plug(0, true);
        eventually(Duration::from_secs(60), || {
            init.submit_transfer(&small)
                .and_then(|s| s.wait_success(WAIT))
        })
        .unwrap();
    });
    drop(target);
    drop(etcd);
}

/// A context rank of the KV-cache protocol in a process of its own,
/// published in etcd (`KVXFER_ETCD`), that never sends: it waits on stdin.
fn kv_context_main(s: &kvxfer::cache::CacheState) -> ! {
    use std::io::{BufRead, Write};
    let agent: std::sync::Arc<dyn kvxfer::TransferAgent> =
        make_transfer_agent(Backend::Tcp, AgentConfig::new("kv-ctx0"))
            .unwrap()
            .into();
    let slice = kvxfer::cache::rank_slice(s, 0, kvxfer::cache::distinct_heads(s, s));
    let pool: &'static mut [u8] =
        Box::leak(vec![0u8; 4 * slice.block_bytes() as usize].into_boxed_slice());
    // SAFETY: leaked: lives as long as the process.
    unsafe { agent.register_memory(&MemoryDescs::dram(pool)).unwrap() };
    let _sender = kvxfer::cache::CacheSender::new(
        std::sync::Arc::clone(&agent),
        s.clone(),
        0,
        None,
        kvxfer::cache::SenderConfig::default(),
    )
    .unwrap();
    println!("READY {}", agent.local_connection_info());
    std::io::stdout().flush().unwrap();
    for _ in std::io::stdin().lock().lines() {}
    std::process::exit(0)
}

/// The KV-cache receiver waits on a context rank's share; the context
/// process is killed: the request fails with `PeerGone` once its lease runs
/// out, not at the receiver's deadline (120 s).
#[test]
fn a_kv_request_fails_at_once_when_its_context_rank_leaves() {
    use kvxfer::cache::{
        Attention, CacheError, CacheReceiver, CacheState, DataType, ReceiverConfig, RecvRequest,
    };
    let s = CacheState::new(2, 2, 16, 16, DataType::F32, Attention::Default, 1, 1);
    if std::env::var_os("KVXFER_KV_PEER").is_some() {
        kv_context_main(&s);
    }
    let Some(etcd) = etcd("a_kv_request_fails_at_once_when_its_context_rank_leaves", 1) else {
        return;
    };
    let p = prefix("kv");
    let eps = etcd.endpoints().join(",");
    let ttl = TTL.as_secs().to_string();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_kv_request_fails_at_once_when_its_context_rank_leaves",
        ])
        .arg("--nocapture")
        .env("KVXFER_KV_PEER", "1")
        .env("KVXFER_ETCD", &eps)
        .env("KVXFER_ETCD_PREFIX", &p)
        .env("KVXFER_ETCD_LEASE_TTL", &ttl)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let conn = {
        use std::io::BufRead;
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the context process exited"
            );
            // (The harness may print the test's name on the same line.)
            if let Some(at) = line.find("READY ") {
                break line[at + 6..].trim().to_owned();
            }
        }
    };
    let agent: std::sync::Arc<dyn TransferAgent> =
        make_transfer_agent(Backend::Tcp, config(&etcd, "kv-gen0", &p))
            .unwrap()
            .into();
    let slice = kvxfer::cache::rank_slice(&s, 0, kvxfer::cache::distinct_heads(&s, &s));
    let pool = buffer(agent.as_ref(), 4 * slice.block_bytes() as usize, 0);
    let recv = CacheReceiver::new(
        std::sync::Arc::clone(&agent),
        s.clone(),
        0,
        s.clone(),
        &[conn],
        ReceiverConfig {
            timeout: Duration::from_secs(120),
            ..ReceiverConfig::default()
        },
    )
    .unwrap();
    let h = recv
        .request(RecvRequest {
            request_id: 9,
            ctx_dp_rank: 0,
            blocks: vec![pool.as_ptr() as u64],
            last_block_key: None,
        })
        .unwrap();
    let t0 = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    let e = h.wait(Duration::from_secs(110)).unwrap_err();
    let took = t0.elapsed();
    // Gone, and never confirmed that it stopped writing: the outcome says
    // both.
    assert!(
        matches!(&e, CacheError::Unsettled { ranks, cause, .. }
            if ranks == &[0] && matches!(**cause, CacheError::Transfer(Error::PeerGone { .. }))),
        "{e}"
    );
    println!(
        "a KV request failed with PeerGone {took:?} after its context rank was killed (lease {TTL:?}, receiver timeout 120 s)"
    );
    assert!(took < Duration::from_secs(100));
    drop(recv);
}

/// A certificate authority, a server certificate for 127.0.0.1 and a
/// client certificate, made with `openssl` in `dir` (P-256 keys, one day).
fn make_certs(dir: &std::path::Path) -> Result<(), String> {
    let run = |args: &[&str]| -> Result<(), String> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .map_err(|e| format!("no openssl ({e})"))?;
        if !out.status.success() {
            return Err(format!(
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(())
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    run(&[
        &["req", "-x509"][..],
        &ec,
        &[
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "1",
            "-subj",
            "/CN=kvxfer test CA",
        ],
    ]
    .concat())?;
    std::fs::write(dir.join("server.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for who in ["server", "client"] {
        let (key, csr, crt, ext) = (
            format!("{who}.key"),
            format!("{who}.csr"),
            format!("{who}.crt"),
            format!("{who}.ext"),
        );
        run(&[
            &["req"][..],
            &ec,
            &[
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN=kvxfer {who}"),
            ],
        ]
        .concat())?;
        run(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "1",
            "-extfile",
            &ext,
        ])?;
    }
    Ok(())
}

/// etcd over TLS with client certificates: agents with the CA and a
/// client certificate publish and find each other; one without a client
/// certificate, or speaking plain HTTP, cannot start (a typed store error).
#[test]
fn agents_reach_etcd_over_tls_with_client_certificates() {
    let test = "agents_reach_etcd_over_tls_with_client_certificates";
    let certs = std::env::temp_dir().join(format!("kvxfer-certs-{}", std::process::id()));
    std::fs::create_dir_all(&certs).unwrap();
    if let Err(why) = make_certs(&certs) {
        println!("SKIPPED {test}: {why}");
        let _ = std::fs::remove_dir_all(&certs);
        return;
    }
    let etcd = match Etcd::start_tls(&certs) {
        Ok(e) => e,
        Err(why) => {
            println!("SKIPPED {test}: {why}");
            let _ = std::fs::remove_dir_all(&certs);
            return;
        }
    };
    let p = prefix("tls");
    let tls = kvxfer::EtcdTls::new(certs.join("ca.crt"))
        .with_client_cert(certs.join("client.crt"), certs.join("client.key"));
    let cfg = |name: &str, tls: Option<kvxfer::EtcdTls>| {
        let mut e = EtcdConfig::new(etcd.endpoints())
            .with_prefix(&p)
            .with_lease_ttl(TTL);
        if let Some(t) = tls {
            e = e.with_tls(t);
        }
        AgentConfig::new(name).with_etcd(e)
    };
    let target = make_transfer_agent(Backend::Tcp, cfg("tls-a", Some(tls.clone()))).unwrap();
    let dst = buffer(target.as_ref(), 1 << 16, 0);
    let init = make_transfer_agent(Backend::Tcp, cfg("tls-b", Some(tls))).unwrap();
    let src = buffer(init.as_ref(), 1 << 16, 0x2e);
    init.load_remote_agent_by_name("tls-a").unwrap();
    write(init.as_ref(), src, dst, "tls-a").unwrap();
    assert!(dst.iter().all(|&b| b == 0x2e));
    // No client certificate: the server refuses the handshake.
    let e = make_transfer_agent(
        Backend::Tcp,
        cfg("tls-c", Some(kvxfer::EtcdTls::new(certs.join("ca.crt")))),
    )
    .err()
    .expect("an agent without a client certificate was published");
    assert!(matches!(e, Error::MetadataStore { .. }), "{e}");
    // Plain HTTP to a TLS port.
    let e = make_transfer_agent(Backend::Tcp, cfg("tls-d", None))
        .err()
        .expect("an agent speaking plain HTTP was published");
    assert!(matches!(e, Error::MetadataStore { .. }), "{e}");
    // A CA file that is not one: a configuration error.
    let e = make_transfer_agent(
        Backend::Tcp,
        cfg(
            "tls-e",
            Some(kvxfer::EtcdTls::new(certs.join("server.ext"))),
        ),
    )
    .err()
    .expect("a bad CA file was accepted");
    assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    drop(init);
    drop(target);
    drop(etcd);
    std::fs::remove_dir_all(&certs).unwrap();
}
