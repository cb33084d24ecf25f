//! The data plane: the TCP connections of network channels between hosts. Every host's agent
//! (and the driver, for the driver's host) listens on a data port; for each network channel
//! the writer's host connects to the reading host's port, both prove they know the cluster's
//! secret, and the reading side files the connection under its graph and channel until that
//! host's install takes it.
//!
//! # Handshake (mutual, the secret never crosses the wire)
//!
//! ```text
//! reader → writer   DATA_MAGIC (8) | nonce_r (32)
//! writer → reader   graph (u64 LE) | channel (u64 LE) | nonce_w (32)
//!                   | HMAC-SHA256(secret, "adag-data writer" | nonce_r | nonce_w | graph | channel)
//! reader → writer   HMAC-SHA256(secret, "adag-data reader" | nonce_r | nonce_w | graph | channel)
//! ```
//!
//! # Strangers cannot jam the port
//!
//! The port's door is the cluster's one ([`super::gate`]): pending handshakes cost a file
//! descriptor, not a thread, are dropped past the pre-authentication deadline, and the oldest
//! of the busiest address makes room when too many are pending, so a peer that knows the
//! secret always gets through. The writing side retries a refused or cut handshake until the
//! install's deadline.
use super::gate::{self, Doorman, PRE_AUTH_DEADLINE, Step};
use super::wire::{HmacSha256, NONCE, PROOF, fresh_nonce, keyed_proof};
use hmac::Mac;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The first bytes a data port sends.
pub(crate) const DATA_MAGIC: &[u8; 8] = b"adagdata";
/// A connection nobody claimed within this long (its graph failed to install) is dropped.
const UNCLAIMED_FOR: Duration = Duration::from_secs(120);
/// Graphs whose install was abandoned, remembered so that a host still waiting for one of
/// their connections stops at once; the oldest are forgotten past this many.
const ABANDONED_KEPT: usize = 1024;
/// The bytes the writing side sends: graph, channel, its nonce and its proof.
const CLAIM: usize = 16 + NONCE + PROOF;

/// The proof of one side of a data connection: the join's keyed proof, in its own domain, over
/// the role, both nonces, the graph and the channel.
fn proof(
    secret: &[u8],
    role: &[u8],
    nonce_r: &[u8],
    nonce_w: &[u8],
    graph: u64,
    chan: u64,
) -> HmacSha256 {
    keyed_proof(
        secret,
        b"adag-data ",
        &[
            role,
            nonce_r,
            nonce_w,
            &graph.to_le_bytes(),
            &chan.to_le_bytes(),
        ],
    )
}

fn nonce() -> io::Result<[u8; NONCE]> {
    fresh_nonce().map_err(|e| io::Error::other(format!("no random numbers: {e}")))
}

#[derive(Default)]
struct Filed {
    arrived: HashMap<(u64, u64), (TcpStream, Instant)>,
    abandoned: VecDeque<u64>,
}

/// A host's data port and the connections that arrived on it.
pub(crate) struct DataPlane {
    addr: SocketAddr,
    secret: Vec<u8>,
    filed: Mutex<Filed>,
    changed: Condvar,
    stop: AtomicBool,
}

impl DataPlane {
    /// Listens on `bind` (port 0: any free port) for the connections of network channels.
    pub(crate) fn start(bind: SocketAddr, secret: &[u8]) -> io::Result<Arc<DataPlane>> {
        let listener = TcpListener::bind(bind)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let plane = Arc::new(DataPlane {
            addr,
            secret: secret.to_vec(),
            filed: Mutex::new(Filed::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&plane);
        std::thread::Builder::new()
            .name("adag-data-accept".into())
            .spawn(move || gate::run(listener, &weak))?;
        Ok(plane)
    }

    /// Where it listens.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting (the accept thread leaves within [`TICK`]) and wakes every `take`.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _filed = self.filed.lock();
        self.changed.notify_all();
    }

    /// The connection of channel `chan` of graph `graph`, waiting until `deadline` for it
    /// (or until the graph is abandoned, or the port stops).
    pub(crate) fn take(
        &self,
        graph: u64,
        chan: u64,
        deadline: Instant,
    ) -> Result<TcpStream, String> {
        let mut filed = self.filed.lock();
        loop {
            if let Some((stream, _)) = filed.arrived.remove(&(graph, chan)) {
                return Ok(stream);
            }
            if self.stop.load(Ordering::Acquire) {
                return Err("the data port was closed".into());
            }
            if filed.abandoned.contains(&graph) {
                return Err("the graph was abandoned (its compile failed elsewhere, or it was torn down) before its writer's host connected".into());
            }
            if self.changed.wait_until(&mut filed, deadline).timed_out() {
                return filed.arrived.remove(&(graph, chan)).map(|(s, _)| s).ok_or_else(|| {
                    "its writer's host did not connect in time (is that host reachable on its data port, and does it run the same binary?)".into()
                });
            }
        }
    }

    /// Drops every connection of `graph` that nobody took, and stops every wait for one: the
    /// graph is closed, or its install failed.
    pub(crate) fn forget_graph(&self, graph: u64) {
        let mut filed = self.filed.lock();
        filed.arrived.retain(|(g, _), _| *g != graph);
        if filed.abandoned.len() >= ABANDONED_KEPT {
            filed.abandoned.pop_front();
        }
        filed.abandoned.push_back(graph);
        drop(filed);
        self.changed.notify_all();
    }

    fn file(&self, graph: u64, chan: u64, stream: TcpStream) {
        let mut filed = self.filed.lock();
        if filed.abandoned.contains(&graph) {
            return;
        }
        filed
            .arrived
            .retain(|_, (_, at)| at.elapsed() < UNCLAIMED_FOR);
        filed
            .arrived
            .insert((graph, chan), (stream, Instant::now()));
        drop(filed);
        self.changed.notify_all();
    }

    /// The writing side of channel `chan` of `graph`: connects to the data port at `addr`,
    /// retrying until `deadline`.
    pub(crate) fn connect(
        &self,
        addr: SocketAddr,
        graph: u64,
        chan: u64,
        deadline: Instant,
    ) -> io::Result<TcpStream> {
        connect(addr, &self.secret, graph, chan, deadline)
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// The writing side: connects to the data port at `addr` for channel `chan` of `graph`. A
/// connection refused, cut or timed out (the reading host not listening yet, its port busy
/// dropping strangers) is tried again, with growing pauses, until `deadline`; a port that
/// fails to prove it knows the secret, or is not an adag data port, is not.
pub(crate) fn connect(
    addr: SocketAddr,
    secret: &[u8],
    graph: u64,
    chan: u64,
    deadline: Instant,
) -> io::Result<TcpStream> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(2);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let err = match connect_once(addr, secret, graph, chan, deadline) {
            Ok(stream) => return Ok(stream),
            Err(e) => e,
        };
        let final_kind = matches!(
            err.kind(),
            io::ErrorKind::PermissionDenied | io::ErrorKind::InvalidData
        );
        if final_kind || Instant::now() + pause >= deadline {
            return Err(io::Error::new(
                err.kind(),
                format!(
                    "{err} (attempt {attempts}, after {:.1?})",
                    started.elapsed()
                ),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

/// One attempt of [`connect`]; each error says which step of the handshake failed.
fn connect_once(
    addr: SocketAddr,
    secret: &[u8],
    graph: u64,
    chan: u64,
    deadline: Instant,
) -> io::Result<TcpStream> {
    let within = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(1), PRE_AUTH_DEADLINE);
    let step = |what: &'static str| {
        move |e: io::Error| {
            let why = if e.kind() == io::ErrorKind::UnexpectedEof {
                "the port closed the connection (it drops connections that do not prove themselves in time, and the oldest when a flood of them arrives)".to_string()
            } else {
                e.to_string()
            };
            io::Error::new(e.kind(), format!("{what}: {why}"))
        }
    };
    let mut stream = TcpStream::connect_timeout(&addr, within).map_err(step("connecting"))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(within))?;
    stream.set_write_timeout(Some(within))?;
    let mut hello = [0u8; 8 + NONCE];
    stream
        .read_exact(&mut hello)
        .map_err(step("waiting for the port's greeting"))?;
    if &hello[..8] != DATA_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{addr} is not an adag data port (its first bytes are not adag's)"),
        ));
    }
    let nonce_r = &hello[8..];
    let nonce_w = nonce()?;
    let mut claim = Vec::with_capacity(CLAIM);
    claim.extend_from_slice(&graph.to_le_bytes());
    claim.extend_from_slice(&chan.to_le_bytes());
    claim.extend_from_slice(&nonce_w);
    claim.extend_from_slice(
        &proof(secret, b"writer", nonce_r, &nonce_w, graph, chan)
            .finalize()
            .into_bytes(),
    );
    stream
        .write_all(&claim)
        .map_err(step("sending this side's proof"))?;
    let mut theirs = [0u8; PROOF];
    stream
        .read_exact(&mut theirs)
        .map_err(step("waiting for the port's proof"))?;
    proof(secret, b"reader", nonce_r, &nonce_w, graph, chan)
        .verify_slice(&theirs)
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("the data port at {addr} did not prove it knows the cluster's secret (another cluster's port?)"),
            )
        })?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    Ok(stream)
}

/// A data connection's handshake so far, on the port's side.
pub(crate) struct Claim {
    nonce_r: [u8; NONCE],
    claim: [u8; CLAIM],
    got: usize,
}

impl Doorman for DataPlane {
    type Progress = Claim;
    /// The graph, the channel and the port's own proof to answer with.
    type Proved = (u64, u64, [u8; PROOF]);
    const WHAT: &'static str = "data connections";

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// The magic and a fresh nonce.
    fn greet(&self, stream: &TcpStream) -> io::Result<Claim> {
        let nonce_r = nonce()?;
        let mut hello = [0u8; 8 + NONCE];
        hello[..8].copy_from_slice(DATA_MAGIC);
        hello[8..].copy_from_slice(&nonce_r);
        if (&*stream).write(&hello)? != hello.len() {
            return Err(io::Error::other("the greeting did not fit the new socket"));
        }
        Ok(Claim {
            nonce_r,
            claim: [0; CLAIM],
            got: 0,
        })
    }

    fn advance(&self, c: &mut Claim, stream: &TcpStream) -> Step<Self::Proved> {
        match gate::read_some(stream, &mut c.claim, &mut c.got) {
            Ok(false) => return Step::Waiting,
            Ok(true) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Step::Refused(format!(
                    "it closed the connection after {} of the handshake's {CLAIM} bytes",
                    c.got
                ));
            }
            Err(e) => return Step::Refused(format!("reading its handshake failed: {e}")),
        }
        let graph = u64::from_le_bytes(c.claim[..8].try_into().expect("8 bytes"));
        let chan = u64::from_le_bytes(c.claim[8..16].try_into().expect("8 bytes"));
        let nonce_w = &c.claim[16..16 + NONCE];
        if proof(&self.secret, b"writer", &c.nonce_r, nonce_w, graph, chan)
            .verify_slice(&c.claim[16 + NONCE..])
            .is_err()
        {
            // An answer no proof can equal: the writer learns the port is not its cluster's
            // (and does not retry), rather than seeing the connection cut.
            let _ = (&*stream).write(&[0u8; PROOF]);
            return Step::Refused(
                "it did not prove it knows the cluster's secret (a different ADAG_TOKEN?)".into(),
            );
        }
        let mine = proof(&self.secret, b"reader", &c.nonce_r, nonce_w, graph, chan)
            .finalize()
            .into_bytes()
            .into();
        Step::Proved((graph, chan, mine))
    }

    /// Answers with the port's own proof and files the connection, blocking.
    fn proved(
        self: &Arc<Self>,
        stream: TcpStream,
        peer: SocketAddr,
        (graph, chan, mine): Self::Proved,
    ) {
        let answered = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_write_timeout(Some(PRE_AUTH_DEADLINE)))
            .and_then(|()| (&stream).write_all(&mine))
            .and_then(|()| stream.set_write_timeout(None));
        match answered {
            Ok(()) => self.file(graph, chan, stream),
            Err(e) => {
                tracing::warn!(%peer, error = %e, "data connection lost while answering its proof")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"s3cret";

    fn within(secs: u64) -> Instant {
        Instant::now() + Duration::from_secs(secs)
    }

    #[test]
    fn a_connection_with_the_secret_is_filed_and_taken() {
        let plane = DataPlane::start("127.0.0.1:0".parse().unwrap(), SECRET).unwrap();
        let mut w = connect(plane.addr(), SECRET, 7, 9, within(10)).unwrap();
        let mut r = plane.take(7, 9, within(10)).unwrap();
        w.write_all(b"hello").unwrap();
        let mut got = [0u8; 5];
        r.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        plane.stop();
    }

    #[test]
    fn a_wrong_secret_or_a_stranger_is_refused_and_never_filed() {
        let plane = DataPlane::start("127.0.0.1:0".parse().unwrap(), SECRET).unwrap();
        let err = connect(plane.addr(), b"guess", 1, 2, within(30)).unwrap_err();
        // Told at once, in words (not "failed to fill whole buffer"), and not retried.
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        assert!(err.to_string().contains("did not prove"), "{err}");
        assert!(err.to_string().contains("attempt 1,"), "{err}");
        let mut stranger = TcpStream::connect(plane.addr()).unwrap();
        let _ = stranger.write_all(&[0xab; 200]);
        let r = plane.take(1, 2, Instant::now() + Duration::from_millis(300));
        assert!(r.is_err());
        // The port still serves the right secret afterwards.
        connect(plane.addr(), SECRET, 1, 3, within(10)).unwrap();
        assert!(plane.take(1, 3, within(10)).is_ok());
        // A port that does not know the secret gets no connection either, and the writer
        // does not retry it.
        let impostor = DataPlane::start("127.0.0.1:0".parse().unwrap(), b"other").unwrap();
        let err = connect(impostor.addr(), SECRET, 1, 4, within(30)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        assert!(err.to_string().contains("attempt 1,"), "{err}");
        assert!(
            impostor
                .take(1, 4, Instant::now() + Duration::from_millis(300))
                .is_err()
        );
        plane.stop();
        impostor.stop();
    }

    /// The measured attack: strangers open connections to the port and say nothing. Each
    /// writer with the secret still gets through at once, however many strangers hold
    /// connections (more than the port keeps pending, from the same address).
    #[test]
    fn idle_strangers_never_keep_a_writer_with_the_secret_out() {
        let plane = DataPlane::start("127.0.0.1:0".parse().unwrap(), SECRET).unwrap();
        let mut strangers = Vec::new();
        for round in 0..3u64 {
            for _ in 0..300 {
                strangers.push(TcpStream::connect(plane.addr()).unwrap());
            }
            for chan in 0..4 {
                let started = Instant::now();
                let w = connect(plane.addr(), SECRET, round, chan, within(20)).unwrap();
                let r = plane.take(round, chan, within(20)).unwrap();
                // Not a timing goal: a writer that had to wait for strangers to time out
                // (the pre-authentication deadline) would show it.
                assert!(
                    started.elapsed() < PRE_AUTH_DEADLINE,
                    "round {round}: {:?} with {} strangers",
                    started.elapsed(),
                    strangers.len()
                );
                drop((w, r));
            }
        }
        plane.stop();
    }

    #[test]
    fn a_silent_stranger_is_dropped_after_the_pre_authentication_deadline() {
        let plane = DataPlane::start("127.0.0.1:0".parse().unwrap(), SECRET).unwrap();
        let mut silent = TcpStream::connect(plane.addr()).unwrap();
        silent
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut greeting = [0u8; 8 + NONCE];
        silent.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], DATA_MAGIC);
        let started = Instant::now();
        let mut rest = [0u8; 1];
        let r = silent.read(&mut rest);
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
        assert!(
            started.elapsed() < PRE_AUTH_DEADLINE + Duration::from_secs(10),
            "closed only after {:?}",
            started.elapsed()
        );
        plane.stop();
    }

    #[test]
    fn a_wait_for_a_connection_ends_when_its_graph_is_abandoned_or_the_port_stops() {
        let plane = DataPlane::start("127.0.0.1:0".parse().unwrap(), SECRET).unwrap();
        let (tx, rx) = crossbeam_channel::bounded(2);
        for graph in [5, 6] {
            let (plane, tx) = (plane.clone(), tx.clone());
            std::thread::spawn(move || {
                let _ = tx.send((graph, plane.take(graph, 1, within(60))));
            });
        }
        std::thread::sleep(Duration::from_millis(50));
        plane.forget_graph(5);
        let (graph, r) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(graph, 5);
        assert!(r.unwrap_err().contains("abandoned"));
        // A connection of an abandoned graph that arrives late is not kept.
        connect(plane.addr(), SECRET, 5, 2, within(10)).unwrap();
        assert!(
            plane
                .take(5, 2, Instant::now() + Duration::from_millis(200))
                .is_err()
        );
        plane.stop();
        let (graph, r) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(graph, 6);
        assert!(r.unwrap_err().contains("closed"));
    }

    #[test]
    fn a_writer_retries_until_the_port_listens() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            DataPlane::start(port, SECRET).unwrap()
        });
        let w = connect(port, SECRET, 3, 4, within(20)).unwrap();
        let plane = late.join().unwrap();
        assert!(plane.take(3, 4, within(10)).is_ok());
        drop(w);
        plane.stop();
        // Nobody listening until the deadline: the error says so, after several attempts.
        let gone = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = connect(
            gone,
            SECRET,
            1,
            1,
            Instant::now() + Duration::from_millis(200),
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("connecting:"), "{err}");
        assert!(!err.to_string().contains("attempt 1,"), "{err}");
    }
}
