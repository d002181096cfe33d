//! Attacks on the local proof: a process proves itself, then becomes
//! another program (of its own user, or set-user-id root); a process
//! connects, hands its socket on and exits, and a third process takes its
//! pid. The attacker is this test process, a raw wire client with an
//! authenticated session; the processes it proves are children running
//! this test binary in a role (`rogue_role_entry`). Each test asserts the
//! target's canaries and secret and the child's secret are unchanged, and
//! that the target still serves a good peer.
//!
//! Who runs as what: the target agent runs as the test's user. The
//! same-user exec test runs for any user. The set-user-id test needs root
//! (it makes a set-user-id-root copy of this binary and runs the prover as
//! uid 65534); the reused-pid test needs root (it steers the next pid
//! through `/proc/sys/kernel/ns_last_pid`). Both say SKIPPED otherwise.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use super::{RawConn, Victim, delegate_probed, grant, present, raw};
use kvxfer::{AgentConfig, Backend};

/// The secret a holder keeps, never to leave its process or change.
const HOLDER_SECRET: &[u8] = b"the holder's own secret: not for the agent to read or write";
/// The probe value a prover stores (any value: the frame claims it).
const PROVER_PROBE: u64 = 0x7072_6f76_6572_2121;
/// The bytes a prover offers for a delegated copy that should work: the
/// target region's own fill, so the region stays as it was.
const BAIT: u8 = 0xA5;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

/// Writes a role's line (`role ...`) for the parent to read.
fn say(words: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "role {words}").unwrap();
    out.flush().unwrap();
}

fn local_socket(instance: u64) -> std::os::unix::net::SocketAddr {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(format!("kvxfer-{instance:016x}")).unwrap()
}

/// The roles a child of this test binary plays.
pub(super) fn role_main(role: &str) {
    match role {
        // Proves itself with the session's ticket, says so, then on a line
        // from its parent runs `KVXFER_ROGUE_EXEC` as the holder.
        "prover" => {
            let instance = u64::from_str_radix(&env("KVXFER_ROGUE_INSTANCE"), 16).unwrap();
            let ticket = u128::from_str_radix(&env("KVXFER_ROGUE_TICKET"), 16).unwrap();
            let probe = Box::new(PROVER_PROBE);
            let bait = [BAIT; 64];
            let mut s = UnixStream::connect_addr(&local_socket(instance)).unwrap();
            if let Ok(victim) = std::env::var("KVXFER_ROGUE_MEM_OF") {
                mount_over_own_mem(&victim);
            }
            let mem = std::fs::File::open("/proc/self/mem").unwrap();
            let answer = present(&mut s, ticket, Some(&mem)).map_or(-1, i32::from);
            if std::env::var_os("KVXFER_ROGUE_NONDUMPABLE").is_some() {
                // SAFETY: a plain system call with integer arguments.
                assert_eq!(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }, 0);
            }
            say(&format!(
                "proved {answer} {} {} {}",
                &*probe as *const u64 as u64,
                *probe,
                bait.as_ptr() as u64
            ));
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            let e = Command::new(env("KVXFER_ROGUE_EXEC"))
                .args(role_args())
                .env("KVXFER_ROGUE_ROLE", "holder")
                .exec();
            panic!("exec: {e}");
        }
        // Holds a secret, says where, waits for the end of its input, and
        // says whether the secret is intact.
        "holder" => {
            let secret = HOLDER_SECRET.to_vec();
            let probe = Box::new(0x686f_6c64_6572_2121u64);
            // SAFETY: a plain system call without arguments.
            let euid = unsafe { libc::geteuid() };
            say(&format!(
                "holder {} {} {} {} {euid}",
                &*probe as *const u64 as u64,
                *probe,
                secret.as_ptr() as u64,
                secret.len()
            ));
            let mut rest = String::new();
            let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
            let intact = std::hint::black_box(&secret)[..] == *HOLDER_SECRET;
            say(if intact { "intact" } else { "changed" });
        }
        // Connects descriptor 3 to the target's local socket, and exits.
        "connector" => {
            let instance = u64::from_str_radix(&env("KVXFER_ROGUE_INSTANCE"), 16).unwrap();
            let name = format!("kvxfer-{instance:016x}");
            // SAFETY: an all-zero sockaddr_un is a valid value.
            let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
            addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
            for (d, s) in addr.sun_path[1..].iter_mut().zip(name.bytes()) {
                *d = s as libc::c_char;
            }
            let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
            // SAFETY: `addr` is a live sockaddr_un, `len` within it.
            let r = unsafe {
                libc::connect(
                    3,
                    (&addr as *const libc::sockaddr_un).cast(),
                    len as libc::socklen_t,
                )
            };
            assert_eq!(r, 0, "connect: {}", std::io::Error::last_os_error());
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

/// In a mount namespace of its own (root: no user namespace needed),
/// mounts `/proc/<victim>/mem` over this process's own memory file, so
/// that opening `/proc/self/mem` opens the victim's.
fn mount_over_own_mem(victim: &str) {
    use std::ffi::CString;
    let c = |s: &str| CString::new(s).unwrap();
    // SAFETY: plain system calls on NUL-terminated strings that outlive
    // them (or null where the call takes none).
    unsafe {
        assert_eq!(libc::unshare(libc::CLONE_NEWNS), 0, "unshare");
        assert_eq!(
            libc::mount(
                std::ptr::null(),
                c("/").as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null()
            ),
            0,
            "private mounts"
        );
        let from = c(&format!("/proc/{victim}/mem"));
        let to = c(&format!("/proc/{}/mem", std::process::id()));
        assert_eq!(
            libc::mount(
                from.as_ptr(),
                to.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null()
            ),
            0,
            "bind mount: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The arguments that run `rogue_role_entry` alone.
fn role_args() -> [&'static str; 5] {
    [
        "--exact",
        "rogue_role_entry",
        "--nocapture",
        "--test-threads",
        "1",
    ]
}

/// A child in a role, its `role ...` lines read one at a time.
struct Role {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Role {
    fn spawn(mut cmd: Command, role: &str) -> Self {
        let mut child = cmd
            .args(role_args())
            .env("KVXFER_ROGUE_ROLE", role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        Self {
            stdin: child.stdin.take(),
            out: BufReader::new(child.stdout.take().unwrap()),
            child,
        }
    }

    /// The next `role` line's words.
    fn line(&mut self) -> Vec<String> {
        loop {
            let mut l = String::new();
            assert!(self.out.read_line(&mut l).unwrap() > 0, "the child ended");
            // The harness may have begun the line ("test ... ").
            if let Some(at) = l.find("role ") {
                return l[at + 5..].split_whitespace().map(str::to_owned).collect();
            }
        }
    }

    fn tell(&mut self, line: &str) {
        writeln!(self.stdin.as_mut().unwrap(), "{line}").unwrap();
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Ends its input; its last line, once it has exited.
    fn finish(mut self) -> Vec<String> {
        drop(self.stdin.take());
        let last = self.line();
        assert!(self.child.wait().unwrap().success());
        last
    }
}

fn num(w: &str) -> u64 {
    w.parse().unwrap()
}

/// A raw session to `v` as "mallory": the connection and its ticket.
fn session(v: &Victim, link: u64) -> (RawConn, u128) {
    let mut c = RawConn::connect(&v.conn());
    c.auth("mallory", None).unwrap();
    let ack = c.hello("mallory", link).unwrap();
    assert_eq!((ack.kind, ack.status), (raw::HELLO_ACK, raw::ST_OK));
    (c, u128::from(ack.addr) | u128::from(ack.len) << 64)
}

/// A prover (this binary `exe`) for `v`'s session `ticket` that runs
/// `exec` as the holder when told.
fn prover_cmd(exe: &Path, v: &Victim, ticket: u128, exec: &Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.env("KVXFER_ROGUE_INSTANCE", format!("{:x}", v.desc.instance))
        .env("KVXFER_ROGUE_TICKET", format!("{ticket:x}"))
        .env("KVXFER_ROGUE_EXEC", exec);
    cmd
}

/// Whether a delegated copy was kept from happening: refused, or failed
/// (which closes the connection).
fn kept_out(st: u16) -> bool {
    st == raw::ST_DELEGATE_REFUSED || st == 15
}

/// Attacks a holder whose pid is `pid` through `c`: the target asked to
/// write its region over the secret (READ) and to read the secret into
/// its region (WRITE), with each probe given. Every copy is refused (or
/// failed) and nothing changes.
fn attack_holder(
    v: &Victim,
    c: &mut RawConn,
    req: &mut u64,
    pid: u32,
    probes: &[(u64, u64)],
    (secret, len): (u64, u64),
) {
    for &probe in probes {
        for write in [false, true] {
            *req += 1;
            assert_eq!(grant(c, *req, v.region_addr(), len, v.key()), raw::ST_OK);
            let st = delegate_probed(c, *req, write, pid, probe, (v.region_addr(), secret, len));
            assert!(kept_out(st), "write {write}: status {st}");
            v.assert_untouched();
            if st != raw::ST_DELEGATE_REFUSED {
                return;
            }
        }
    }
}

/// Asks the target (request `req`) to copy the prover's bait into its
/// region as a delegated WRITE, the probe and bait from the prover's
/// `proved` line; the answer (a copy done is committed and acknowledged,
/// the acknowledgement read here).
fn take_bait(v: &Victim, c: &mut RawConn, req: u64, pid: u32, proved: &[String]) -> u16 {
    assert_eq!(grant(c, req, v.region_addr(), 64, v.key()), raw::ST_OK);
    let st = delegate_probed(
        c,
        req,
        true,
        pid,
        (num(&proved[2]), num(&proved[3])),
        (v.region_addr(), num(&proved[4]), 64),
    );
    if st == raw::ST_OK {
        let ack = c.recv().unwrap();
        assert_eq!((ack.kind, ack.id, ack.status), (raw::ACK, req, raw::ST_OK));
    }
    st
}

/// A ticket binds one process: once a process is bound to the session,
/// another one presenting the same ticket (with its own memory file) is
/// refused, and delegated copies still reach the first one only.
#[test]
fn a_bound_ticket_binds_no_other_process() {
    let v = Victim::new(Backend::Shm, AgentConfig::new("target"));
    let (mut c, ticket) = session(&v, 79);
    let exe = std::env::current_exe().unwrap();
    let mut first = Role::spawn(prover_cmd(&exe, &v, ticket, &exe), "prover");
    let first_pid = first.child.id();
    let proved = first.line();
    assert_eq!(proved[..2], ["proved", "0"], "the first process is bound");
    let mut second = Role::spawn(prover_cmd(&exe, &v, ticket, &exe), "prover");
    let second_pid = second.child.id();
    let refused = second.line();
    assert_eq!(refused[..2], ["proved", "1"], "another process is refused");
    // A delegated copy naming the second process is kept out; the first
    // still takes its bait.
    assert!(kept_out(take_bait(&v, &mut c, 1, second_pid, &refused)));
    v.assert_untouched();
    second.kill();
    assert_eq!(take_bait(&v, &mut c, 2, first_pid, &proved), raw::ST_OK);
    v.assert_untouched();
    drop(c);
    first.kill();
    v.still_serves(AgentConfig::new("good"));
}

/// A process proves itself and then runs another program of its own user:
/// the binding was to the program it proved itself in, so no delegated
/// copy reaches the new one, even with the probe word that worked before.
#[test]
fn exec_after_proof_reaches_nothing_of_the_new_program() {
    let v = Victim::new(Backend::Shm, AgentConfig::new("target"));
    let (mut c, ticket) = session(&v, 78);
    let exe = std::env::current_exe().unwrap();
    let mut prover = Role::spawn(prover_cmd(&exe, &v, ticket, &exe), "prover");
    let pid = prover.child.id();
    let proved = prover.line();
    assert_eq!(
        proved[..2],
        ["proved", "0"],
        "a process of this user is bound"
    );
    let probe = (num(&proved[2]), num(&proved[3]));
    // Bound: a delegated copy from the prover's bait goes through.
    let mut req = 1;
    assert_eq!(take_bait(&v, &mut c, req, pid, &proved), raw::ST_OK);
    v.assert_untouched();
    // Now the same process runs the holder.
    prover.tell("exec");
    let holder = prover.line();
    assert_eq!(holder[0], "holder");
    let own_probe = (num(&holder[1]), num(&holder[2]));
    let secret = (num(&holder[3]), num(&holder[4]));
    attack_holder(&v, &mut c, &mut req, pid, &[probe, own_probe], secret);
    assert_eq!(prover.finish(), ["intact"]);
    drop(c);
    v.still_serves(AgentConfig::new("good"));
}

/// A process that mounted another process's memory file over its own
/// name (in a mount namespace of its own) and sends it as its own is not
/// bound: the file is not the one the kernel names for the process that
/// connected. No delegated copy reaches the other process (a holder of
/// the same user, with a secret).
#[test]
fn a_memory_file_mounted_over_the_provers_binds_nothing() {
    // SAFETY: a plain system call without arguments.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!(
            "SKIPPED a_memory_file_mounted_over_the_provers_binds_nothing: needs root (a mount namespace and a bind mount)"
        );
        return;
    }
    let v = Victim::new(Backend::Shm, AgentConfig::new("target"));
    let (mut c, ticket) = session(&v, 82);
    let exe = std::env::current_exe().unwrap();
    let mut holder = Role::spawn(Command::new(&exe), "holder");
    let held = holder.line();
    let hpid = holder.child.id();
    let own_probe = (num(&held[1]), num(&held[2]));
    let secret = (num(&held[3]), num(&held[4]));
    let mut cmd = prover_cmd(&exe, &v, ticket, Path::new("/nonexistent"));
    cmd.env("KVXFER_ROGUE_MEM_OF", hpid.to_string());
    let mut prover = Role::spawn(cmd, "prover");
    let pid = prover.child.id();
    let proved = prover.line();
    assert_ne!(
        proved[..2],
        ["proved", "0"],
        "a process was bound with another's memory file"
    );
    let mut req = 0;
    // Neither as the prover (its pid) nor as the holder.
    attack_holder(&v, &mut c, &mut req, pid, &[own_probe], secret);
    attack_holder(&v, &mut c, &mut req, hpid, &[own_probe], secret);
    prover.kill();
    assert_eq!(holder.finish(), ["intact"]);
    drop(c);
    v.still_serves(AgentConfig::new("good"));
}

/// A proven initiator that the target cannot reach without privilege (it
/// made itself non-dumpable after its proof, as a set-user-id program is;
/// Yama's `ptrace_scope` has the same effect) is refused (status 14, so
/// the initiator copies itself), not failed: the connection serves on.
#[test]
fn an_initiator_out_of_reach_is_refused_and_the_link_serves_on() {
    let v = Victim::new(Backend::Shm, AgentConfig::new("target"));
    let (mut c, ticket) = session(&v, 81);
    let mut cmd = prover_cmd(
        &std::env::current_exe().unwrap(),
        &v,
        ticket,
        Path::new("/nonexistent"),
    );
    cmd.env("KVXFER_ROGUE_NONDUMPABLE", "1");
    let mut prover = Role::spawn(cmd, "prover");
    let pid = prover.child.id();
    let proved = prover.line();
    assert_eq!(proved[..2], ["proved", "0"]);
    assert_eq!(
        take_bait(&v, &mut c, 1, pid, &proved),
        raw::ST_DELEGATE_REFUSED
    );
    // The same connection still serves: a grant is answered.
    assert_eq!(grant(&mut c, 2, v.region_addr(), 64, v.key()), raw::ST_OK);
    v.assert_untouched();
    prover.kill();
    drop(c);
    v.still_serves(AgentConfig::new("good"));
}

/// Where the set-user-id test's copies of this binary go, or why the test
/// cannot run here.
fn suid_dir() -> Result<PathBuf, String> {
    // SAFETY: a plain system call without arguments.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (a set-user-id-root program, a prover of uid 65534)".into());
    }
    let dir = std::env::temp_dir().join(format!("kvxfer-suid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: an all-zero statvfs is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a C string, `st` a live statvfs.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    if st.f_flag & libc::ST_NOSUID != 0 {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(format!("{} is mounted nosuid", dir.display()));
    }
    Ok(dir)
}

/// Removes the set-user-id test's directory however the test ends (a
/// set-user-id-root copy of a test binary must not outlive it).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copies this test binary to `to` with `mode` (root-owned).
fn copy_self(to: &Path, mode: u32) {
    std::fs::copy(std::env::current_exe().unwrap(), to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// An unprivileged process (uid 65534) proves itself, then runs a
/// set-user-id-root program holding a secret: the target (root) neither
/// binds it (another user than the agent's) nor, even with the probe word
/// that pointed into it before, reads or writes the new program's memory.
#[test]
fn a_set_user_id_program_after_proof_is_out_of_reach() {
    let dir = match suid_dir() {
        Ok(d) => d,
        Err(why) => {
            eprintln!("SKIPPED a_set_user_id_program_after_proof_is_out_of_reach: {why}");
            return;
        }
    };
    let dir = RemoveOnDrop(dir);
    let (plain, suid) = (dir.0.join("prover"), dir.0.join("holder"));
    copy_self(&plain, 0o755);
    copy_self(&suid, 0o4755);
    let v = Victim::new(Backend::Shm, AgentConfig::new("target"));
    let (mut c, ticket) = session(&v, 79);
    let mut cmd = prover_cmd(&plain, &v, ticket, &suid);
    cmd.uid(65534).gid(65534);
    let mut prover = Role::spawn(cmd, "prover");
    let pid = prover.child.id();
    let proved = prover.line();
    // Whatever the proof's answer (never "bound", checked last, after the
    // attack it would have allowed).
    let bound = proved[1] == "0";
    let probe = (num(&proved[2]), num(&proved[3]));
    let mut req = 1;
    let st = take_bait(&v, &mut c, req, pid, &proved);
    prover.tell("exec");
    let holder = prover.line();
    assert_eq!(holder[0], "holder");
    assert_eq!(holder[5], "0", "the holder runs set-user-id root");
    let own_probe = (num(&holder[1]), num(&holder[2]));
    let secret = (num(&holder[3]), num(&holder[4]));
    attack_holder(&v, &mut c, &mut req, pid, &[probe, own_probe], secret);
    assert_eq!(prover.finish(), ["intact"]);
    assert!(!bound, "another user was bound");
    assert_eq!(st, raw::ST_DELEGATE_REFUSED);
    drop(c);
    drop(dir);
    v.still_serves(AgentConfig::new("good"));
}

/// A process connects to the local socket and exits; its socket, in other
/// hands, then presents the ticket while a third process (holding a
/// secret) has taken the dead process's pid. Nothing is bound to the third
/// process, and no delegated copy reaches it.
#[test]
fn a_reused_pid_binds_nothing() {
    const NS_LAST_PID: &str = "/proc/sys/kernel/ns_last_pid";
    // SAFETY: a plain system call without arguments.
    if unsafe { libc::geteuid() } != 0
        || std::fs::OpenOptions::new()
            .write(true)
            .open(NS_LAST_PID)
            .is_err()
    {
        eprintln!(
            "SKIPPED a_reused_pid_binds_nothing: needs root and a writable {NS_LAST_PID} (to hand a dead process's pid to another)"
        );
        return;
    }
    let v = Victim::new(Backend::Shm, AgentConfig::new("target"));
    let (mut c, ticket) = session(&v, 80);
    // SAFETY: plain system call; the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    // SAFETY: a new descriptor nothing else owns.
    let mut sock = UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let raw_fd = sock.as_raw_fd();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(role_args())
        .env("KVXFER_ROGUE_ROLE", "connector")
        .env("KVXFER_ROGUE_INSTANCE", format!("{:x}", v.desc.instance))
        .stdout(Stdio::null());
    // SAFETY: dup2 is async-signal-safe; it gives the child the socket as
    // descriptor 3 (without close-on-exec).
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(raw_fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut connector = cmd.spawn().unwrap();
    let dead = connector.id();
    assert!(connector.wait().unwrap().success());
    // Hand its pid to a holder (the next pid is steered; other processes
    // may take it first: try again).
    let mut holder = None;
    for _ in 0..50 {
        std::fs::write(NS_LAST_PID, format!("{}", dead - 1)).unwrap();
        let h = Role::spawn(Command::new(std::env::current_exe().unwrap()), "holder");
        if h.child.id() == dead {
            holder = Some(h);
            break;
        }
        h.kill();
    }
    let Some(mut holder) = holder else {
        eprintln!("SKIPPED a_reused_pid_binds_nothing: pid {dead} was never handed to the holder");
        return;
    };
    let held = holder.line();
    let own_probe = (num(&held[1]), num(&held[2]));
    let secret = (num(&held[3]), num(&held[4]));
    // With the holder's own memory file, as a legitimate initiator sends
    // (this process, root, can open it).
    let mem = std::fs::File::open(format!("/proc/{dead}/mem")).unwrap();
    let answer = present(&mut sock, ticket, Some(&mem));
    assert_ne!(
        answer,
        Some(0),
        "the holder was bound under the dead process's pid"
    );
    let mut req = 0;
    attack_holder(&v, &mut c, &mut req, dead, &[own_probe], secret);
    assert_eq!(holder.finish(), ["intact"]);
    drop(c);
    v.still_serves(AgentConfig::new("good"));
}
