//! The door of a listening port (the driver's join port, every host's data port): accepts
//! connections and reads each one's handshake on one thread, so that a connection still
//! proving it knows the cluster's secret costs a file descriptor and a few bytes, never a
//! thread or a place a peer with the secret needs.
//!
//! # Strangers cannot keep a peer with the secret out
//!
//! Every pending handshake is read as its bytes arrive (`poll`), without blocking. A
//! connection that has not proved itself within [`PRE_AUTH_DEADLINE`] of its accept is
//! dropped, and when too many are pending ([`MAX_PENDING`] in all, [`MAX_PENDING_PER_ADDRESS`]
//! from one address) the oldest one of the address holding the most makes room for the
//! newcomer. A peer that knows the secret proves itself within a round trip or two, so
//! however many idle or stalled connections anyone holds, from any address (the joining host's
//! own, a NAT's), it gets in; the most a stranger can do is make a peer retry.
//!
//! What a handshake is (its bytes, its proof, what becomes of a proved connection) is the
//! port's own: a [`Doorman`].
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long a connection has, from its accept, to prove it knows the secret: a peer that
/// does answers within a round trip or two, even across continents.
pub(crate) const PRE_AUTH_DEADLINE: Duration = Duration::from_secs(2);
/// Connections still proving themselves, in all and from one address; past either bound the
/// oldest of the address holding the most is dropped.
pub(crate) const MAX_PENDING: usize = 512;
pub(crate) const MAX_PENDING_PER_ADDRESS: usize = 64;
/// How often the door looks at its port's stop flag and its deadlines while nothing arrives.
const TICK: Duration = Duration::from_millis(200);
/// How often a count of dropped strangers is logged, at most.
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// What became of a pending handshake after its bytes were read.
pub(crate) enum Step<P> {
    /// More bytes are needed.
    Waiting,
    /// The peer proved it knows the secret; `P` is what the handshake established.
    Proved(P),
    /// The connection is dropped, for this reason (logged).
    Refused(String),
}

/// A port's handshake, as the [`run`] loop drives it over non-blocking streams.
pub(crate) trait Doorman: Send + Sync + 'static {
    /// A pending connection's progress through the handshake.
    type Progress: Send;
    /// What a proved connection carries on to [`Doorman::proved`].
    type Proved;
    /// The port's connections in a log line ("joins", "data connections").
    const WHAT: &'static str;

    /// Whether the port was closed: the loop ends.
    fn stopped(&self) -> bool;
    /// Starts the handshake of a connection just accepted (non-blocking): the port's greeting,
    /// if it speaks first (a new socket's buffer always has room for a few bytes).
    fn greet(&self, stream: &TcpStream) -> io::Result<Self::Progress>;
    /// Reads (and answers) whatever of the handshake arrived; never blocks.
    fn advance(&self, progress: &mut Self::Progress, stream: &TcpStream) -> Step<Self::Proved>;
    /// Takes over a connection that proved itself (still non-blocking). Called on the door's
    /// thread: anything that may block goes to a thread of its own.
    fn proved(self: &Arc<Self>, stream: TcpStream, peer: SocketAddr, proved: Self::Proved);
}

struct Pending<S> {
    stream: TcpStream,
    peer: SocketAddr,
    since: Instant,
    progress: S,
}

/// The door's state: its listener and the connections still proving themselves.
struct Door<D: Doorman> {
    listener: TcpListener,
    pending: Vec<Pending<D::Progress>>,
    dropped: usize,
    last_dropped: Option<SocketAddr>,
    reported: Instant,
}

/// Runs the door of `listener` (non-blocking) until `doorman` is gone or stopped.
pub(crate) fn run<D: Doorman>(listener: TcpListener, doorman: &Weak<D>) {
    let mut door = Door::<D> {
        listener,
        pending: Vec::new(),
        dropped: 0,
        last_dropped: None,
        reported: Instant::now(),
    };
    loop {
        let Some(d) = doorman.upgrade() else { return };
        if d.stopped() {
            return;
        }
        let ready = door.poll();
        if !ready.is_empty() {
            // Reads first (they only shrink the list), then accepts (they grow it).
            for i in (0..door.pending.len()).rev() {
                if ready[i + 1] {
                    door.advance(i, &d);
                }
            }
            if ready[0] {
                door.accept_all(&d);
            }
        }
        door.expire();
        door.report();
    }
}

impl<D: Doorman> Door<D> {
    /// Waits for bytes on any pending connection or a new connection, at most until the
    /// nearest deadline; which are ready (the listener first), or nothing on a timeout.
    fn poll(&self) -> Vec<bool> {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let now = Instant::now();
        let wait = self
            .pending
            .iter()
            .map(|c| (c.since + PRE_AUTH_DEADLINE).saturating_duration_since(now))
            .fold(TICK, Duration::min)
            .max(Duration::from_millis(1));
        let mut fds = Vec::with_capacity(1 + self.pending.len());
        fds.push(PollFd::new(&self.listener, PollFlags::IN));
        fds.extend(
            self.pending
                .iter()
                .map(|c| PollFd::new(&c.stream, PollFlags::IN)),
        );
        let timeout = Timespec {
            tv_sec: wait.as_secs() as i64,
            tv_nsec: i64::from(wait.subsec_nanos()),
        };
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(n) if n > 0 => fds.iter().map(|f| !f.revents().is_empty()).collect(),
            _ => Vec::new(),
        }
    }

    fn accept_all(&mut self, doorman: &Arc<D>) {
        loop {
            let (stream, peer) = match self.listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    // Out of descriptors, a connection reset before it was accepted: the
                    // next round tries again.
                    tracing::debug!(error = %e, what = D::WHAT, "accepting a connection failed");
                    return;
                }
            };
            let greeted = stream
                .set_nonblocking(true)
                .and_then(|()| stream.set_nodelay(true))
                .and_then(|()| doorman.greet(&stream));
            match greeted {
                Ok(progress) => {
                    self.make_room(peer.ip());
                    self.pending.push(Pending {
                        stream,
                        peer,
                        since: Instant::now(),
                        progress,
                    });
                    // A peer that spoke first may have its bytes here already.
                    let last = self.pending.len() - 1;
                    self.advance(last, doorman);
                }
                Err(e) => {
                    tracing::debug!(%peer, error = %e, what = D::WHAT, "greeting a connection failed")
                }
            }
            if doorman.stopped() {
                return;
            }
        }
    }

    /// Drops the oldest pending connection of `incoming`'s address when that address is at
    /// its bound, else of the address holding the most when all are.
    fn make_room(&mut self, incoming: IpAddr) {
        let mut per_address: HashMap<IpAddr, usize> = HashMap::new();
        for c in &self.pending {
            *per_address.entry(c.peer.ip()).or_default() += 1;
        }
        let victim = if per_address.get(&incoming).copied().unwrap_or(0) >= MAX_PENDING_PER_ADDRESS
        {
            Some(incoming)
        } else if self.pending.len() >= MAX_PENDING {
            per_address
                .into_iter()
                .max_by_key(|(_, n)| *n)
                .map(|(ip, _)| ip)
        } else {
            None
        };
        if let Some(ip) = victim
            && let Some(oldest) = self.pending.iter().position(|c| c.peer.ip() == ip)
        {
            let c = self.pending.remove(oldest);
            self.note_dropped(c.peer);
        }
    }

    fn advance(&mut self, i: usize, doorman: &Arc<D>) {
        let c = &mut self.pending[i];
        match doorman.advance(&mut c.progress, &c.stream) {
            Step::Waiting => {}
            Step::Proved(proved) => {
                let c = self.pending.swap_remove(i);
                doorman.proved(c.stream, c.peer, proved);
            }
            Step::Refused(why) => {
                let c = self.pending.swap_remove(i);
                tracing::warn!(peer = %c.peer, reason = %why, what = D::WHAT, "connection refused");
            }
        }
    }

    fn expire(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.pending.len() {
            if now.duration_since(self.pending[i].since) >= PRE_AUTH_DEADLINE {
                let c = self.pending.swap_remove(i);
                self.note_dropped(c.peer);
            } else {
                i += 1;
            }
        }
    }

    fn note_dropped(&mut self, peer: SocketAddr) {
        self.dropped += 1;
        self.last_dropped = Some(peer);
    }

    /// Logs, at most once per [`REPORT_EVERY`], how many connections were dropped unproven
    /// (one line a flood, not one line a connection).
    fn report(&mut self) {
        if self.dropped == 0 || self.reported.elapsed() < REPORT_EVERY {
            return;
        }
        if let Some(peer) = self.last_dropped.take() {
            tracing::warn!(
                dropped = self.dropped,
                last_peer = %peer,
                what = D::WHAT,
                "connections dropped before proving they know the cluster's secret (silent past {PRE_AUTH_DEADLINE:?}, or pushed out by a flood)"
            );
        }
        self.dropped = 0;
        self.reported = Instant::now();
    }
}

/// Reads into `buf[*got..]` what arrived on a non-blocking stream: `Ok(true)` once `buf` is
/// full, `Ok(false)` while bytes are missing; an `UnexpectedEof` error when the peer closed.
pub(crate) fn read_some(stream: &TcpStream, buf: &mut [u8], got: &mut usize) -> io::Result<bool> {
    use std::io::Read;
    while *got < buf.len() {
        match (&*stream).read(&mut buf[*got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => *got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}
