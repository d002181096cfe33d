//! The agent's metrics, scraped for real from its HTTP endpoint: requests
//! by outcome, bytes, and latency histograms per transport and peer, in the
//! Prometheus text format.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvxfer::{AgentConfig, Backend, Error, MemoryDescs, TransferRequest, make_transfer_agent};

/// `GET path` on `addr`: the status line and the body.
fn get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut all = String::new();
    s.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

/// As [`get`], `None` where the endpoint closed the connection or broke
/// off its answer.
fn try_get(addr: std::net::SocketAddr, path: &str) -> Option<(String, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut all = String::new();
    s.read_to_string(&mut all).ok()?;
    let (head, body) = all.split_once("\r\n\r\n")?;
    Some((head.lines().next()?.to_owned(), body.to_owned()))
}

/// The value of the sample `name{labels}` in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn metrics_are_scraped_from_the_endpoint() {
    let target = make_transfer_agent(Backend::Tcp, AgentConfig::new("m-target")).unwrap();
    let dst = vec![0u8; 1 << 20];
    let gone = vec![0u8; 4096];
    // SAFETY: the agents are dropped at the end of the test, before these
    // buffers go.
    unsafe {
        target.register_memory(&MemoryDescs::dram(&dst)).unwrap();
        target.register_memory(&MemoryDescs::dram(&gone)).unwrap();
    }
    let cfg = AgentConfig::new("m-init").with_metrics_listen("127.0.0.1:0".parse().unwrap());
    let init = make_transfer_agent(Backend::Tcp, cfg).unwrap();
    let src = vec![1u8; 1 << 20];
    // SAFETY: as above.
    unsafe { init.register_memory(&MemoryDescs::dram(&src)).unwrap() };
    init.load_remote_agent(&target.local_agent_desc()).unwrap();
    let write = |dst: &[u8]| {
        let req = TransferRequest::write(
            MemoryDescs::dram(&src[..dst.len()]),
            MemoryDescs::dram(dst),
            "m-target",
        );
        init.submit_transfer(&req)?
            .wait_success(Duration::from_secs(60))
    };
    for _ in 0..5 {
        write(&dst).unwrap();
    }
    // A region the target let go after the initiator loaded its key.
    target.deregister_memory(&MemoryDescs::dram(&gone)).unwrap();
    let e = write(&gone).unwrap_err();
    assert!(matches!(e, Error::RemoteRejected { .. }), "{e}");

    let addr = init.metrics_addr().expect("an endpoint");
    let (status, text) = get(addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    let l = "agent=\"m-init\",transport=\"tcp\",peer=\"m-target\"";
    let val = |s: &str| sample(&text, s).unwrap_or_else(|| panic!("no {s}:\n{text}"));
    assert_eq!(
        val(&format!("kvxfer_requests_total{{{l},outcome=\"ok\"}}")),
        5.0
    );
    assert_eq!(
        val(&format!(
            "kvxfer_requests_total{{{l},outcome=\"rejected\"}}"
        )),
        1.0
    );
    assert_eq!(
        val(&format!("kvxfer_bytes_total{{{l}}}")),
        5.0 * (1 << 20) as f64
    );
    assert_eq!(
        val(&format!("kvxfer_request_duration_seconds_count{{{l}}}")),
        6.0
    );
    assert_eq!(
        val(&format!(
            "kvxfer_request_duration_seconds_bucket{{{l},le=\"+Inf\"}}"
        )),
        6.0
    );
    assert!(val(&format!("kvxfer_request_duration_seconds_sum{{{l}}}")) > 0.0);
    assert_eq!(val("kvxfer_requests_in_flight{agent=\"m-init\"}"), 0.0);
    // The same text without HTTP; other paths are not served.
    assert!(init.metrics_text().contains("kvxfer_bytes_total"));
    let (status, _) = get(addr, "/other");
    assert!(status.contains("404"), "{status}");
    drop(init);
    drop(target);
}

/// Clients that connect and say nothing, or trickle their request a byte
/// at a time (each byte within any per-read timeout), delay no scrape:
/// each client is served on its own, and dropped at one deadline from
/// accept, however it trickles.
#[test]
fn slow_clients_delay_no_scrape() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let cfg = AgentConfig::new("m-slow").with_metrics_listen("127.0.0.1:0".parse().unwrap());
    let agent = make_transfer_agent(Backend::Tcp, cfg).unwrap();
    let addr = agent.metrics_addr().expect("an endpoint");
    let silent: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let trickler = s.spawn(|| {
            let mut t = TcpStream::connect(addr).unwrap();
            for b in b"GET /metrics HTTP/1.1\r\n".iter().cycle().take(600) {
                if stop.load(Ordering::SeqCst) || t.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            t
        });
        // Scrapes while the silent clients and the trickler hold on.
        for _ in 0..3 {
            let (status, body) = get(addr, "/metrics");
            assert_eq!(status, "HTTP/1.1 200 OK");
            assert!(body.contains("kvxfer_"), "{body}");
        }
        // The trickler is dropped at its deadline, unanswered.
        let mut t = trickler.join().unwrap_or_else(|_| panic!("trickler"));
        t.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut rest = Vec::new();
        let _ = t.read_to_end(&mut rest);
        assert!(rest.is_empty(), "the trickler was answered");
        stop.store(true, Ordering::SeqCst);
    });
    drop(silent);
}

/// An outsider (another address) that keeps 20 silent connections open,
/// reopening at once each one the endpoint closes, keeps no scrape out:
/// it holds at most its share (half the places), its new connections
/// evict its own oldest, and a scrape is never evicted (before, 0 of 10
/// got through). From the scrapers' own address such a flood could evict
/// a scrape in the instant before its request is in: see `docs/security.md`.
#[test]
fn a_flood_of_silent_clients_keeps_no_scrape_out() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let cfg = AgentConfig::new("m-flood").with_metrics_listen("127.0.0.1:0".parse().unwrap());
    let agent = make_transfer_agent(Backend::Tcp, cfg).unwrap();
    let addr = agent.metrics_addr().expect("an endpoint");
    let stop = AtomicBool::new(false);
    let served = std::thread::scope(|s| {
        for _ in 0..20 {
            s.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    let s =
                        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                            .unwrap();
                    let outsider = std::net::SocketAddr::from(([127, 0, 0, 2], 0));
                    s.bind(&outsider.into()).unwrap();
                    if s.connect(&addr.into()).is_err() {
                        continue;
                    }
                    let mut c = TcpStream::from(s);
                    c.set_read_timeout(Some(Duration::from_millis(200)))
                        .unwrap();
                    // Silent until the endpoint closes it (or the test ends).
                    while !stop.load(Ordering::SeqCst) {
                        match c.read(&mut [0u8; 1]) {
                            Ok(0) => break,
                            Err(e)
                                if e.kind() == std::io::ErrorKind::WouldBlock
                                    || e.kind() == std::io::ErrorKind::TimedOut => {}
                            _ => break,
                        }
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_millis(300));
        let served = (0..10)
            .filter(|_| {
                try_get(addr, "/metrics").is_some_and(|(status, body)| {
                    status == "HTTP/1.1 200 OK" && body.contains("kvxfer_")
                })
            })
            .count();
        stop.store(true, Ordering::SeqCst);
        served
    });
    assert!(
        served >= 9,
        "{served} of 10 scrapes served during the flood"
    );
}
