//! An etcd cluster of a test's own (Debian's `etcd-server`), started on
//! loopback ports in a temporary data directory; members can be killed and
//! started again. Used by `tests/etcd.rs` and by the C ABI tests.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a member may take to answer.
const WAIT: Duration = Duration::from_secs(60);

/// A free loopback port (taken by the OS, then let go).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An etcd cluster of this test's own.
pub struct Etcd {
    nodes: Vec<Node>,
    dir: PathBuf,
    /// The network namespace its members run in (`None`: this one).
    netns: Option<String>,
    /// TLS on the client port: `ca.crt`, `server.crt`, `server.key` in this
    /// directory (clients must present a certificate of that CA).
    tls: Option<PathBuf>,
}

struct Node {
    name: String,
    client: String,
    peer: String,
    proc: Option<Child>,
}

impl Etcd {
    /// `n` members, started and answering; `Err` with the reason when this
    /// machine has no etcd. Ports are picked free, then bound by etcd: one
    /// taken meanwhile by another test fails that start, which is tried
    /// again on other ports.
    pub fn start(n: usize) -> Result<Self, String> {
        let mut last = String::new();
        for _ in 0..3 {
            match Self::start_once(n) {
                Ok(e) => return Ok(e),
                Err(why) if why.starts_with("no etcd") => return Err(why),
                Err(why) => last = why,
            }
        }
        Err(last)
    }

    /// One member in network namespace `netns` (made by the test), on
    /// `host` there.
    pub fn start_in(netns: &str, host: &str) -> Result<Self, String> {
        Self::check_binary()?;
        let node = Node {
            name: "n0".into(),
            client: format!("{host}:2379"),
            peer: format!("{host}:2380"),
            proc: None,
        };
        let mut e = Etcd {
            nodes: vec![node],
            dir: Self::new_dir(),
            netns: Some(netns.to_owned()),
            tls: None,
        };
        e.run(0);
        e.wait_ready()?;
        Ok(e)
    }

    /// One member whose client port speaks TLS with the certificates in
    /// `certs` (`ca.crt`, `server.crt` for 127.0.0.1, `server.key`) and
    /// requires client certificates of that CA.
    pub fn start_tls(certs: &std::path::Path) -> Result<Self, String> {
        Self::check_binary()?;
        let mut e = Etcd {
            nodes: vec![Node {
                name: "n0".into(),
                client: format!("127.0.0.1:{}", free_port()),
                peer: format!("127.0.0.1:{}", free_port()),
                proc: None,
            }],
            dir: Self::new_dir(),
            netns: None,
            tls: Some(certs.to_owned()),
        };
        e.run(0);
        e.wait_ready()?;
        Ok(e)
    }

    fn check_binary() -> Result<(), String> {
        let v = Command::new("etcd")
            .arg("--version")
            .output()
            .map_err(|e| {
                format!("no etcd binary ({e}); ci/install-deps.sh test installs etcd-server")
            })?;
        if !v.status.success() {
            return Err("etcd --version failed".into());
        }
        Ok(())
    }

    fn new_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kvxfer-etcd-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// `program`, run in the cluster's namespace.
    fn command(&self, program: &str) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, program]);
                c
            }
            None => Command::new(program),
        }
    }

    fn start_once(n: usize) -> Result<Self, String> {
        Self::check_binary()?;
        let dir = Self::new_dir();
        let nodes: Vec<Node> = (0..n)
            .map(|i| Node {
                name: format!("n{i}"),
                client: format!("127.0.0.1:{}", free_port()),
                peer: format!("127.0.0.1:{}", free_port()),
                proc: None,
            })
            .collect();
        let mut e = Etcd {
            nodes,
            dir,
            netns: None,
            tls: None,
        };
        for i in 0..n {
            e.run(i);
        }
        e.wait_ready()?;
        Ok(e)
        // (On failure `e` drops: its members are killed, its directory
        // removed.)
    }

    fn cluster(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("{}=http://{}", n.name, n.peer))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Starts member `i` (again, on its data directory).
    pub fn run(&mut self, i: usize) {
        let cluster = self.cluster();
        let mut etcd = self.command("etcd");
        let scheme = match &self.tls {
            Some(d) => {
                etcd.arg("--cert-file")
                    .arg(d.join("server.crt"))
                    .arg("--key-file")
                    .arg(d.join("server.key"))
                    .arg("--trusted-ca-file")
                    .arg(d.join("ca.crt"))
                    .arg("--client-cert-auth");
                "https"
            }
            None => "http",
        };
        let n = &mut self.nodes[i];
        let log = std::fs::File::create(self.dir.join(format!("{}.log", n.name))).unwrap();
        let child = etcd
            .args(["--name", &n.name])
            .arg("--data-dir")
            .arg(self.dir.join(&n.name))
            .args(["--listen-client-urls", &format!("{scheme}://{}", n.client)])
            .args([
                "--advertise-client-urls",
                &format!("{scheme}://{}", n.client),
            ])
            .args(["--listen-peer-urls", &format!("http://{}", n.peer)])
            .args([
                "--initial-advertise-peer-urls",
                &format!("http://{}", n.peer),
            ])
            .args(["--initial-cluster", &cluster])
            .args(["--initial-cluster-state", "new"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        n.proc = Some(child);
    }

    /// Waits until every running member answers a read (a member that
    /// exited, on a port taken meanwhile, fails at once).
    pub fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + WAIT;
        for i in 0..self.nodes.len() {
            let (name, client) = (self.nodes[i].name.clone(), self.nodes[i].client.clone());
            while let Some(child) = self.nodes[i].proc.as_mut() {
                if let Ok(Some(st)) = child.try_wait() {
                    return Err(format!("etcd member {name} exited: {st}"));
                }
                let mut ctl = self.command("etcdctl");
                if let Some(d) = &self.tls {
                    ctl.arg("--cacert")
                        .arg(d.join("ca.crt"))
                        .arg("--cert")
                        .arg(d.join("client.crt"))
                        .arg("--key")
                        .arg(d.join("client.key"));
                }
                let endpoint = match &self.tls {
                    Some(_) => format!("https://{client}"),
                    None => client.clone(),
                };
                let ok = ctl
                    .env("ETCDCTL_API", "3")
                    .args(["--endpoints", &endpoint, "--command-timeout=2s", "get", "x"])
                    .output()
                    .is_ok_and(|o| o.status.success());
                if ok {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("etcd member {name} did not come up"));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.client.clone()).collect()
    }

    /// Kills member `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].proc.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Writes `value` under `key` with etcdctl.
    pub fn put(&self, key: &str, value: &str) {
        let st = self
            .command("etcdctl")
            .env("ETCDCTL_API", "3")
            .args([
                "--endpoints",
                &self.endpoints().join(","),
                "put",
                key,
                value,
            ])
            .output()
            .unwrap();
        assert!(st.status.success(), "{st:?}");
    }

    /// Writes the bytes `value` under `key` with etcdctl (from its stdin).
    pub fn put_bytes(&self, key: &str, value: &[u8]) {
        use std::io::Write;
        let mut c = self
            .command("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoints().join(","), "put", key])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(value).unwrap();
        assert!(c.wait().unwrap().success());
    }

    /// Writes `value` under `key` bound to a lease of its own (60 s), as
    /// a writer that keeps its entry alive would.
    pub fn put_leased(&self, key: &str, value: &str) {
        let out = self
            .command("etcdctl")
            .env("ETCDCTL_API", "3")
            .args([
                "--endpoints",
                &self.endpoints().join(","),
                "lease",
                "grant",
                "60",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        // "lease 694d77aa9e38260f granted with TTL(60s)"
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let id = text
            .split_whitespace()
            .nth(1)
            .expect("a lease id")
            .to_owned();
        let st = self
            .command("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoints().join(",")])
            .args(["put", &format!("--lease={id}"), key, value])
            .output()
            .unwrap();
        assert!(st.status.success(), "{st:?}");
    }

    /// The value under `key`, if any.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let out = self
            .command("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoints().join(",")])
            .args(["get", "--print-value-only", key])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let mut v = out.stdout;
        if v.is_empty() {
            return None;
        }
        // etcdctl ends the value with a newline.
        v.pop();
        Some(v)
    }

    /// The member that leads, by index.
    pub fn leader(&self) -> Option<usize> {
        let out = self
            .command("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoints().join(",")])
            .args(["endpoint", "status", "-w", "fields"])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        // Per endpoint: "Endpoint" : "...", then "Leader" : id, "MemberID" : id.
        let mut endpoint = None;
        let mut member = None;
        for line in text.lines() {
            let value = line.split(':').skip(1).collect::<Vec<_>>().join(":");
            let value = value.trim().trim_matches('"').to_owned();
            if line.contains("\"Endpoint\"") {
                endpoint = Some(value);
            } else if line.contains("\"MemberID\"") {
                member = Some(value);
            } else if line.contains("\"Leader\"") && member.as_deref() == Some(value.as_str()) {
                let ep = endpoint.clone()?;
                return self.nodes.iter().position(|n| ep.ends_with(&n.client));
            }
        }
        None
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
