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
//! A connection that does not finish this within [`HANDSHAKE_TIMEOUT`], or whose proof is
//! wrong, is closed and forgotten; each is checked on a thread of its own (at most
//! [`MAX_HANDSHAKES`] at once), so a slow or hostile peer holds up nobody.
use super::wire::{HANDSHAKE_TIMEOUT, HmacSha256, NONCE, PROOF, fresh_nonce, keyed_proof};
use hmac::Mac;
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The first bytes a data port sends.
pub(crate) const DATA_MAGIC: &[u8; 8] = b"adagdata";
/// Handshakes checked at once; connections beyond are closed at once.
pub(crate) const MAX_HANDSHAKES: usize = 64;
/// A connection nobody claimed within this long (its graph failed to install) is dropped.
const UNCLAIMED_FOR: Duration = Duration::from_secs(120);

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

/// A host's data port and the connections that arrived on it.
pub(crate) struct DataPlane {
    addr: SocketAddr,
    secret: Vec<u8>,
    arrived: Mutex<HashMap<(u64, u64), (TcpStream, Instant)>>,
    changed: Condvar,
    stop: AtomicBool,
    handshakes: AtomicUsize,
}

impl DataPlane {
    /// Listens on `bind` (port 0: any free port) for the connections of network channels.
    pub(crate) fn start(bind: SocketAddr, secret: &[u8]) -> io::Result<Arc<DataPlane>> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let plane = Arc::new(DataPlane {
            addr,
            secret: secret.to_vec(),
            arrived: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            handshakes: AtomicUsize::new(0),
        });
        let weak = Arc::downgrade(&plane);
        std::thread::Builder::new()
            .name("adag-data-accept".into())
            .spawn(move || accept_loop(listener, weak))?;
        Ok(plane)
    }

    /// Where it listens.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting (the accept thread leaves within its poll interval).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.changed.notify_all();
    }

    /// The connection of channel `chan` of graph `graph`, waiting until `deadline` for it.
    pub(crate) fn take(
        &self,
        graph: u64,
        chan: u64,
        deadline: Instant,
    ) -> Result<TcpStream, String> {
        let mut arrived = self.arrived.lock();
        loop {
            if let Some((stream, _)) = arrived.remove(&(graph, chan)) {
                return Ok(stream);
            }
            if self.stop.load(Ordering::Acquire) {
                return Err("the data port was closed".into());
            }
            if self.changed.wait_until(&mut arrived, deadline).timed_out() {
                return arrived.remove(&(graph, chan)).map(|(s, _)| s).ok_or_else(|| {
                    "its writer's host did not connect in time (is that host reachable on its data port, and does it run the same binary?)".into()
                });
            }
        }
    }

    /// Drops every connection of `graph` that nobody took (its install failed).
    pub(crate) fn forget_graph(&self, graph: u64) {
        self.arrived.lock().retain(|(g, _), _| *g != graph);
    }

    fn file(&self, graph: u64, chan: u64, stream: TcpStream) {
        let mut arrived = self.arrived.lock();
        arrived.retain(|_, (_, at)| at.elapsed() < UNCLAIMED_FOR);
        arrived.insert((graph, chan), (stream, Instant::now()));
        drop(arrived);
        self.changed.notify_all();
    }

    /// The reading side of the handshake; the connection's graph and channel.
    fn admit(&self, stream: &mut TcpStream) -> io::Result<(u64, u64)> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let nonce_r = nonce()?;
        let mut hello = Vec::with_capacity(DATA_MAGIC.len() + NONCE);
        hello.extend_from_slice(DATA_MAGIC);
        hello.extend_from_slice(&nonce_r);
        stream.write_all(&hello)?;
        let mut claim = [0u8; 16 + NONCE + PROOF];
        stream.read_exact(&mut claim)?;
        let graph = u64::from_le_bytes(claim[..8].try_into().expect("8 bytes"));
        let chan = u64::from_le_bytes(claim[8..16].try_into().expect("8 bytes"));
        let nonce_w = &claim[16..16 + NONCE];
        proof(&self.secret, b"writer", &nonce_r, nonce_w, graph, chan)
            .verify_slice(&claim[16 + NONCE..])
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "the connecting side did not prove it knows the cluster's secret",
                )
            })?;
        let mine = proof(&self.secret, b"reader", &nonce_r, nonce_w, graph, chan)
            .finalize()
            .into_bytes();
        stream.write_all(&mine)?;
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        Ok((graph, chan))
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl DataPlane {
    /// The writing side of channel `chan` of `graph`: connects to the data port at `addr`.
    pub(crate) fn connect(&self, addr: SocketAddr, graph: u64, chan: u64) -> io::Result<TcpStream> {
        connect(addr, &self.secret, graph, chan)
    }
}

/// The writing side: connects to the data port at `addr` for channel `chan` of `graph`.
pub(crate) fn connect(
    addr: SocketAddr,
    secret: &[u8],
    graph: u64,
    chan: u64,
) -> io::Result<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&addr, HANDSHAKE_TIMEOUT)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut hello = [0u8; 8 + NONCE];
    stream.read_exact(&mut hello)?;
    if &hello[..8] != DATA_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{addr} is not an adag data port"),
        ));
    }
    let nonce_r = &hello[8..];
    let nonce_w = nonce()?;
    let mut claim = Vec::with_capacity(16 + NONCE + PROOF);
    claim.extend_from_slice(&graph.to_le_bytes());
    claim.extend_from_slice(&chan.to_le_bytes());
    claim.extend_from_slice(&nonce_w);
    claim.extend_from_slice(
        &proof(secret, b"writer", nonce_r, &nonce_w, graph, chan)
            .finalize()
            .into_bytes(),
    );
    stream.write_all(&claim)?;
    let mut theirs = [0u8; PROOF];
    stream.read_exact(&mut theirs)?;
    proof(secret, b"reader", nonce_r, &nonce_w, graph, chan)
        .verify_slice(&theirs)
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("the data port at {addr} did not prove it knows the cluster's secret"),
            )
        })?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    Ok(stream)
}

fn accept_loop(listener: TcpListener, plane: std::sync::Weak<DataPlane>) {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let tick = Timespec {
        tv_sec: 0,
        tv_nsec: 200_000_000,
    };
    loop {
        {
            let Some(p) = plane.upgrade() else { return };
            if p.stop.load(Ordering::Acquire) {
                return;
            }
        }
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        if !matches!(rustix::event::poll(&mut fds, Some(&tick)), Ok(n) if n > 0) {
            continue;
        }
        let Ok((mut stream, peer)) = listener.accept() else {
            continue;
        };
        let Some(p) = plane.upgrade() else { return };
        if p.handshakes.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
            p.handshakes.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(%peer, "too many data connections at once; one refused");
            continue;
        }
        let spawned = std::thread::Builder::new()
            .name("adag-data-admit".into())
            .spawn(move || {
                match p.admit(&mut stream) {
                    Ok((graph, chan)) => p.file(graph, chan, stream),
                    Err(e) => tracing::warn!(%peer, error = %e, "data connection refused"),
                }
                p.handshakes.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            tracing::warn!(%peer, "no thread to check a data connection; refused");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"s3cret";

    #[test]
    fn a_connection_with_the_secret_is_filed_and_taken() {
        let plane = DataPlane::start("127.0.0.1:0".parse().unwrap(), SECRET).unwrap();
        let mut w = connect(plane.addr(), SECRET, 7, 9).unwrap();
        let mut r = plane
            .take(7, 9, Instant::now() + Duration::from_secs(10))
            .unwrap();
        w.write_all(b"hello").unwrap();
        let mut got = [0u8; 5];
        r.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        plane.stop();
    }

    #[test]
    fn a_wrong_secret_or_a_stranger_is_refused_and_never_filed() {
        let plane = DataPlane::start("127.0.0.1:0".parse().unwrap(), SECRET).unwrap();
        let err = connect(plane.addr(), b"guess", 1, 2).unwrap_err();
        assert!(
            matches!(
                err.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::PermissionDenied
            ),
            "{err:?}"
        );
        let mut stranger = TcpStream::connect(plane.addr()).unwrap();
        let _ = stranger.write_all(&[0xab; 200]);
        let r = plane.take(1, 2, Instant::now() + Duration::from_millis(300));
        assert!(r.is_err());
        // The port still serves the right secret afterwards.
        connect(plane.addr(), SECRET, 1, 3).unwrap();
        assert!(
            plane
                .take(1, 3, Instant::now() + Duration::from_secs(10))
                .is_ok()
        );
        // A port that does not know the secret gets no connection either.
        let impostor = DataPlane::start("127.0.0.1:0".parse().unwrap(), b"other").unwrap();
        assert!(connect(impostor.addr(), SECRET, 1, 4).is_err());
        assert!(
            impostor
                .take(1, 4, Instant::now() + Duration::from_millis(300))
                .is_err()
        );
        plane.stop();
        impostor.stop();
    }
}
