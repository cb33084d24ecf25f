//! Hosts joining a driver (the first part of graphs across hosts): hosts are separate process
//! trees on this machine, started with this test executable and `ADAG_JOIN`/`ADAG_TOKEN`;
//! all traffic stays on loopback, and every wait is bounded.
#[path = "common/procs.rs"]
mod procs;

use adag::Runtime;
use adag::cluster::{ClusterOptions, EXIT_JOIN_FAILED, LocalHosts};
use procs::alive;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const SECRET: &str = "test-secret-4b1d";
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

fn options() -> ClusterOptions {
    ClusterOptions::new(SECRET)
        .heartbeat_interval(Duration::from_millis(100))
        .heartbeat_timeout(Duration::from_secs(2))
}

/// Waits (bounded) until `cond` holds.
fn eventually(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn three_hosts_join_and_are_listed() {
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(options()).unwrap();
    assert!(
        addr.ip().is_loopback(),
        "listens on loopback by default: {addr}"
    );
    let hosts = LocalHosts::start(3, addr, SECRET).unwrap();
    let joined = rt.wait_for_hosts(3, JOIN_TIMEOUT).unwrap();
    assert_eq!(joined.len(), 3);
    let mut names: Vec<&str> = joined.iter().map(|h| h.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["local-0", "local-1", "local-2"]);
    let mut ids: Vec<u64> = joined.iter().map(|h| h.id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "distinct host ids: {joined:?}");
    assert!(ids.iter().all(|id| *id > 0), "0 is the driver's host");
    let mut pids: Vec<u32> = joined.iter().map(|h| h.pid).collect();
    pids.sort();
    let mut started = hosts.pids();
    started.sort();
    assert_eq!(pids, started, "the agents are the processes started");
    for h in &joined {
        assert!(h.address.ip().is_loopback() && h.cores >= 1, "{h:?}");
    }
    // The same hosts listed (their clock estimates move with every heartbeat).
    let without_clock = |hosts: Vec<adag::cluster::HostInfo>| {
        hosts
            .into_iter()
            .map(|mut h| {
                h.clock = None;
                h
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(without_clock(rt.hosts()), without_clock(joined));
    // A second listener on one runtime is refused.
    assert!(rt.listen(options()).is_err());
}

#[test]
fn waiting_for_more_hosts_than_join_times_out_naming_the_address() {
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(options()).unwrap();
    let _hosts = LocalHosts::start(1, addr, SECRET).unwrap();
    let err = rt
        .wait_for_hosts(2, Duration::from_secs(3))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&addr.to_string()) && err.contains("ADAG_JOIN"),
        "{err}"
    );
    assert_eq!(rt.hosts().len(), 1);
}

#[test]
fn a_wrong_secret_is_refused_and_the_agent_exits() {
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(options()).unwrap();
    let mut hosts = LocalHosts::start(1, addr, "not-the-secret").unwrap();
    assert_eq!(hosts.wait(0).unwrap(), Some(EXIT_JOIN_FAILED));
    assert!(rt.hosts().is_empty());
    // The listener is still there for the right secret.
    let _ok = LocalHosts::start(1, addr, SECRET).unwrap();
    assert_eq!(rt.wait_for_hosts(1, JOIN_TIMEOUT).unwrap().len(), 1);
}

#[test]
fn random_bytes_at_the_port_are_dropped_and_real_hosts_still_join() {
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(options()).unwrap();
    let mut state = 0x243f_6a88_85a3_08d3_u64;
    for round in 0..20 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let junk: Vec<u8> = (0..64 + round * 13)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let _ = s.write_all(&junk);
        // The driver closes the connection (or resets it): a read ends, it does not hang.
        let mut buf = [0u8; 64];
        let r = s.read(&mut buf);
        assert!(matches!(r, Ok(0) | Err(_)), "round {round}: {r:?}");
    }
    // A silent connection is dropped after the handshake timeout, too.
    let mut silent = TcpStream::connect(addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut buf = [0u8; 8];
    assert!(matches!(silent.read(&mut buf), Ok(0) | Err(_)));
    let _hosts = LocalHosts::start(2, addr, SECRET).unwrap();
    assert_eq!(rt.wait_for_hosts(2, JOIN_TIMEOUT).unwrap().len(), 2);
    assert!(rt.hosts().iter().all(|h| h.name.starts_with("local-")));
}

#[test]
fn agents_leave_when_the_driver_goes() {
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(options()).unwrap();
    let mut hosts = LocalHosts::start(2, addr, SECRET).unwrap();
    rt.wait_for_hosts(2, JOIN_TIMEOUT).unwrap();
    let pids = hosts.pids();
    drop(rt);
    for (i, pid) in pids.iter().enumerate() {
        assert_eq!(hosts.wait(i).unwrap(), Some(0), "agent {pid} left cleanly");
        assert!(!alive(*pid));
    }
}

#[test]
fn a_killed_host_is_lost_and_the_others_stay() {
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(options()).unwrap();
    let mut hosts = LocalHosts::start(2, addr, SECRET).unwrap();
    let joined = rt.wait_for_hosts(2, JOIN_TIMEOUT).unwrap();
    let victim = joined.iter().find(|h| h.name == "local-0").unwrap().id;
    let killed_at = std::time::SystemTime::now();
    hosts.kill(0).unwrap();
    eventually(
        "the killed host to be lost",
        Duration::from_secs(10),
        || rt.hosts().iter().any(|h| h.id == victim && !h.is_alive()),
    );
    // The lost host stays listed (Ray's `Alive: False`), with when and why; the other is alive.
    let listed = rt.hosts();
    assert_eq!(listed.len(), 2);
    let lost = listed.iter().find(|h| h.id == victim).unwrap();
    let loss = lost.lost.as_ref().unwrap();
    assert!(loss.at >= killed_at, "{loss:?}");
    assert!(loss.reason.contains("connection"), "{loss:?}");
    let alive: Vec<_> = listed.iter().filter(|h| h.is_alive()).collect();
    assert_eq!(alive.len(), 1);
    assert_eq!(alive[0].name, "local-1");
    // Waiting counts only live hosts.
    assert!(rt.wait_for_hosts(2, Duration::from_millis(300)).is_err());
    assert_eq!(
        rt.wait_for_hosts(1, JOIN_TIMEOUT).unwrap()[0].name,
        "local-1"
    );
}

/// A listener that does not know the secret: the agent refuses to trust it and exits with
/// the join failure code.
#[test]
fn an_agent_refuses_a_driver_without_the_secret() {
    use std::net::TcpListener;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut hosts = LocalHosts::start(1, addr, SECRET).unwrap();
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut hello = [0u8; 44];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], b"adagjoin");
    s.write_all(&[0u8; 64]).unwrap();
    assert_eq!(hosts.wait(0).unwrap(), Some(EXIT_JOIN_FAILED));
}

/// The driver's messages, as the protocol encodes them (a mirror of the library's own).
#[derive(serde::Serialize)]
enum ToAgent {
    Welcome {
        host: u64,
        interval_ms: u64,
        timeout_ms: u64,
        log_level: String,
    },
}

/// A driver that completes the handshake and then falls silent: the agent leaves after the
/// heartbeat timeout it was given, instead of waiting for ever.
#[test]
fn an_agent_leaves_a_silent_driver() {
    use hmac::{Hmac, KeyInit, Mac};
    use std::net::TcpListener;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut hosts = LocalHosts::start(1, addr, SECRET).unwrap();
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut hello = [0u8; 44];
    s.read_exact(&mut hello).unwrap();
    let nonce_a = &hello[12..];
    let nonce_b = [9u8; 32];
    let mut mac = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(b"adag-join driver");
    mac.update(nonce_a);
    mac.update(&nonce_b);
    s.write_all(&nonce_b).unwrap();
    s.write_all(&mac.finalize().into_bytes()).unwrap();
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    let welcome = postcard::to_stdvec(&ToAgent::Welcome {
        host: 1,
        interval_ms: 100,
        timeout_ms: 500,
        log_level: "off".into(),
    })
    .unwrap();
    s.write_all(&(welcome.len() as u32).to_le_bytes()).unwrap();
    s.write_all(&welcome).unwrap();
    // Now silent (the agent's heartbeats are read by nobody): it leaves on its own.
    let start = Instant::now();
    assert_eq!(hosts.wait(0).unwrap(), Some(0));
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "left after {:?}",
        start.elapsed()
    );
    drop(s);
}

/// A small actor for the hosts' workers.
pub struct Counter {
    n: u64,
}

#[adag::actor]
impl Counter {
    pub fn new(start: u64) -> Self {
        Counter { n: start }
    }

    pub fn add(&mut self, k: u64) -> u64 {
        self.n += k;
        self.n
    }

    pub fn process_id(&self) -> u32 {
        std::process::id()
    }

    pub fn fail(&mut self, why: String) -> Result<u64, String> {
        Err(why)
    }
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Process actors placed on hosts: started there by each host's agent, answering one-off
/// calls, and keeping their state between calls.
#[test]
fn actors_on_other_hosts_answer_calls() {
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(options()).unwrap();
    let _hosts = LocalHosts::start(2, addr, SECRET).unwrap();
    let joined = rt.wait_for_hosts(2, JOIN_TIMEOUT).unwrap();
    for h in &joined {
        let c = rt
            .spawn::<Counter>(adag::Placement::Host(h.id), 10)
            .unwrap_or_else(|e| panic!("spawn on {h:?}: {e}"));
        assert_eq!(c.call().add(5).unwrap(), 15);
        assert_eq!(c.call().add(1).unwrap(), 16, "state kept between calls");
        let pid = c.call().process_id().unwrap();
        assert_eq!(c.pid(), Some(pid), "the handle knows its worker's pid");
        assert_eq!(
            parent_of(pid),
            Some(h.pid),
            "the worker is a child of {}'s agent",
            h.name
        );
        match c.call().fail("no".into()) {
            Err(adag::Error::Task {
                method, message, ..
            }) => {
                assert_eq!(method, "fail");
                assert!(message.contains("no"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
    // Host 0 is the driver's own: a process actor here.
    let local = rt.spawn::<Counter>(adag::Placement::Host(0), 1).unwrap();
    assert_eq!(
        parent_of(local.call().process_id().unwrap()),
        Some(std::process::id())
    );
    // A host that never joined.
    assert!(rt.spawn::<Counter>(adag::Placement::Host(99), 1).is_err());
}

/// A killed remote worker, and a lost host: calls fail with `ActorDied` naming why.
#[test]
fn remote_deaths_are_actor_died() {
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(options()).unwrap();
    let mut hosts = LocalHosts::start(2, addr, SECRET).unwrap();
    let joined = rt.wait_for_hosts(2, JOIN_TIMEOUT).unwrap();
    let h0 = joined.iter().find(|h| h.name == "local-0").unwrap().id;
    let h1 = joined.iter().find(|h| h.name == "local-1").unwrap().id;
    let a = rt.spawn::<Counter>(adag::Placement::Host(h0), 0).unwrap();
    let b = rt.spawn::<Counter>(adag::Placement::Host(h1), 0).unwrap();
    assert_eq!(a.call().add(1).unwrap(), 1);
    a.kill().unwrap();
    eventually(
        "the killed worker's death to be reported",
        Duration::from_secs(10),
        || matches!(a.call().add(1), Err(adag::Error::ActorDied { .. })),
    );
    // The other host's actor is untouched.
    assert_eq!(b.call().add(2).unwrap(), 2);
    // The whole host goes (agent and workers): its actors are dead, naming the host.
    hosts.kill(1).unwrap();
    eventually(
        "the lost host's actors to be dead",
        Duration::from_secs(10),
        || match b.call().add(1) {
            Err(adag::Error::ActorDied { reason, .. }) => {
                assert!(reason.contains("local-1"), "names the host: {reason}");
                true
            }
            _ => false,
        },
    );
}

/// When the driver goes, each agent leaves with every worker it started.
#[test]
fn agents_leave_with_their_workers() {
    let rt = Runtime::new().unwrap();
    let addr = rt.listen(options()).unwrap();
    let mut hosts = LocalHosts::start(1, addr, SECRET).unwrap();
    let h = rt.wait_for_hosts(1, JOIN_TIMEOUT).unwrap()[0].id;
    let a = rt.spawn::<Counter>(adag::Placement::Host(h), 0).unwrap();
    let b = rt.spawn::<Counter>(adag::Placement::Host(h), 0).unwrap();
    let workers = [a.pid().unwrap(), b.pid().unwrap()];
    assert!(workers.iter().all(|p| alive(*p)));
    drop((a, b, rt));
    assert_eq!(hosts.wait(0).unwrap(), Some(0));
    eventually("the workers to exit", Duration::from_secs(10), || {
        workers.iter().all(|p| !alive(*p))
    });
}

const ENV_ROLE: &str = "ADAG_TEST_ENV_LISTEN_DRIVER";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits (bounded) for `child` to exit; kills it past `limit`.
fn exit_code(child: &mut std::process::Child, limit: Duration) -> Option<i32> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("process {} still running after {limit:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A driver configured only by its launcher: `ADAG_LISTEN` and `ADAG_TOKEN` in the
/// environment, no `listen` call. It waits for one host, lists it, and exits 0.
#[test]
#[ignore = "run by a_driver_listens_where_adag_listen_says"]
fn env_listen_driver_role() {
    if std::env::var(ENV_ROLE).is_err() {
        return;
    }
    let rt = Runtime::new().unwrap();
    let joined = rt.wait_for_hosts(1, JOIN_TIMEOUT).unwrap();
    println!("JOINED {}", joined[0].name);
    // A second runtime of the process does not try the same address.
    let second = Runtime::new().unwrap();
    assert!(second.hosts().is_empty());
}

/// Starts `env_listen_driver_role` as a driver configured only by its environment:
/// `ADAG_LISTEN=listen`, and `ADAG_TOKEN` when given (removed otherwise); output piped.
fn env_listen_driver(listen: &str, token: Option<&str>) -> std::process::Child {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "env_listen_driver_role",
        "--ignored",
        "--nocapture",
    ])
    .env(ENV_ROLE, "1")
    .env(adag::cluster::ENV_LISTEN, listen)
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    match token {
        Some(t) => cmd.env(adag::cluster::ENV_TOKEN, t),
        None => cmd.env_remove(adag::cluster::ENV_TOKEN),
    };
    cmd.spawn().unwrap()
}

#[test]
fn a_driver_listens_where_adag_listen_says() {
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    // The host starts first and waits for the driver (a launcher's order is any).
    let mut hosts = LocalHosts::start(1, addr, SECRET).unwrap();
    let mut driver = env_listen_driver(&addr.to_string(), Some(SECRET));
    let mut out = String::new();
    let code = exit_code(&mut driver, Duration::from_secs(120));
    driver
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let mut err = String::new();
    driver
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("JOINED local-0"), "{out}\n{err}");
    // The driver left: its host follows.
    assert_eq!(hosts.wait(0).unwrap(), Some(0));
}

#[test]
fn adag_listen_without_a_token_is_an_error_naming_both() {
    let mut driver = env_listen_driver("127.0.0.1:0", None);
    let code = exit_code(&mut driver, Duration::from_secs(60));
    let mut out = String::new();
    driver
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    driver
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("ADAG_TOKEN is not set") && out.contains("ADAG_LISTEN"),
        "{out}"
    );
}

#[test]
fn a_host_keeps_trying_for_adag_join_timeout_then_gives_up() {
    let nobody: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let started = Instant::now();
    let mut hosts = LocalHosts::start_with_env(
        nobody,
        SECRET,
        vec![vec![(
            adag::cluster::ENV_JOIN_TIMEOUT.to_string(),
            "1.5".to_string(),
        )]],
    )
    .unwrap();
    assert_eq!(hosts.wait(0).unwrap(), Some(EXIT_JOIN_FAILED));
    // It tried for its window, not the default 30 s.
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1000) && took < Duration::from_secs(20),
        "{took:?}"
    );
}

/// A join the driver's port drops before answering (as it drops the oldest unproven
/// connection when strangers fill its room) is tried again until the join window ends: the
/// host joins once a driver answers on that address.
#[test]
fn a_join_dropped_before_its_answer_is_tried_again() {
    use std::net::TcpListener;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut hosts = LocalHosts::start(1, addr, SECRET).unwrap();
    // Two joins dropped unanswered, after their greeting.
    for _ in 0..2 {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut hello = [0u8; 44];
        s.read_exact(&mut hello).unwrap();
        assert_eq!(&hello[..8], b"adagjoin");
    }
    drop(listener);
    // Then a driver on the same address: the host keeps trying and joins it.
    let rt = Runtime::new().unwrap();
    rt.listen(options().addr(addr)).unwrap();
    assert_eq!(rt.wait_for_hosts(1, JOIN_TIMEOUT).unwrap().len(), 1);
    drop(rt);
    assert_eq!(hosts.wait(0).unwrap(), Some(0));
}
