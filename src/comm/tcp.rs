//! The TCP communicator (`transport_name() == "tcp"`): CPU tensors between ranks on any hosts,
//! for communicator groups that span hosts (what `default_communicator = Create` makes for a
//! CPU group with an actor on another host).
//!
//! # Forming a group
//!
//! The process that makes the group (the driver) is its *root*: it listens on a rendezvous
//! port, and the group's ticket carries that address and a fresh 32-byte key (tickets reach
//! the ranks over the runtime's authenticated connections). Each rank listens on a port of its
//! own, at the address it reaches the root from, registers there (rank, address, and a
//! proof over the key), and gets every rank's address back once all registered. Then each
//! pair of ranks opens two connections (one for point-to-point messages, one for
//! collectives, so that the two never interleave), the higher rank dialling the lower, each
//! proving it knows the key. A rank keeps its connection to the root for the group's life:
//! the root closing it (the group destroyed, or the driver gone) wakes the rank from any
//! blocking call with [`CommError::Destroyed`].
//!
//! Forming runs on a thread of its own, so that handing out ranks never blocks (a driver
//! hands every thread actor its rank in turn); the first operation waits for it, within the
//! group's timeout.
//!
//! # Collectives
//!
//! Over the full mesh: `reducescatter` sends each rank the part of the tensor it owns and
//! reduces what it receives in rank order; `allgather` sends each rank one's own part;
//! `allreduce` is the two in turn. Each rank sends and receives `2(n-1)/n` of the tensor in an
//! allreduce, what a ring does, in two rounds instead of `2(n-1)`, and the reductions combine
//! the ranks in rank order, so every rank gets bit-identical results that equal the shared-
//! memory backend's. All transfers of a round progress together (`poll` over the peers'
//! sockets), with the group's deadline and the root's connection watched.
//!
//! Each message carries a 16-byte header (operation, dtype, length): a rank that calls another
//! operation, or with another dtype or length, than its peer gets [`CommError::Mismatch`].
use super::{
    CommError, CommId, CommOp, Communicator, CommunicatorFactory, CommunicatorGroup,
    DEFAULT_TIMEOUT, GroupTicket, ReduceOp, reduce_bytes,
};
use crate::buffer::Recycler;
use crate::tensor::{DType, Tensor};
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The transport's name.
pub const TRANSPORT: &str = "tcp";

const MAGIC: &[u8; 8] = b"adagcomm";
const KEY: usize = 32;
const PROOF: usize = 32;
/// Bytes of a message header: operation, dtype, length.
const HEADER: usize = 16;
/// How often a blocked call looks at the clock when nothing arrives.
const TICK: Duration = Duration::from_millis(100);

static ROOT_IP: OnceLock<IpAddr> = OnceLock::new();

/// Sets where this process's groups listen for their ranks (the runtime sets the address its
/// hosts reach it at); loopback until then.
pub(crate) fn set_root_ip(ip: IpAddr) {
    let _ = ROOT_IP.set(ip);
}

/// What a TCP ticket carries.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Payload {
    root: SocketAddr,
    key: [u8; KEY],
    label: String,
    timeout_ms: u64,
}

/// A ticket's root address with an unspecified IP (the root listens on every interface) made
/// the one `ip` its ranks on some host reach the driver at.
pub(crate) fn resolve_root(ticket: &mut GroupTicket, ip: IpAddr) {
    if ticket.transport != TRANSPORT {
        return;
    }
    if let Ok(mut p) = postcard::from_bytes::<Payload>(&ticket.payload)
        && p.root.ip().is_unspecified()
    {
        p.root.set_ip(ip);
        if let Ok(bytes) = postcard::to_stdvec(&p) {
            ticket.payload = bytes;
        }
    }
}

fn proof(key: &[u8], parts: &[&[u8]]) -> [u8; PROOF] {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("any key length");
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

fn io_err(group: &str, context: impl Into<String>, e: impl fmt::Display) -> CommError {
    CommError::Io {
        group: group.to_string(),
        context: context.into(),
        message: e.to_string(),
    }
}

/// The factory of TCP groups.
#[derive(Debug, Default)]
pub struct TcpFactory;

impl CommunicatorFactory for TcpFactory {
    fn transport_name(&self) -> &str {
        TRANSPORT
    }

    fn create_group(
        &self,
        world_size: usize,
        label: &str,
    ) -> Result<Arc<dyn CommunicatorGroup>, CommError> {
        Ok(Arc::new(TcpGroup::create(
            world_size,
            label,
            DEFAULT_TIMEOUT,
        )?))
    }

    fn open(
        &self,
        ticket: &GroupTicket,
        _fds: Vec<OwnedFd>,
        rank: usize,
    ) -> Result<Arc<dyn Communicator>, CommError> {
        Ok(Arc::new(TcpCommunicator::open(ticket, rank)?))
    }
}

/// A group of TCP ranks, as its root (the process that made it) holds it.
pub struct TcpGroup {
    id: CommId,
    world: usize,
    payload: Payload,
    root: Arc<Root>,
}

impl fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpGroup")
            .field("id", &self.id)
            .field("label", &self.payload.label)
            .field("world", &self.world)
            .field("root", &self.payload.root)
            .finish()
    }
}

/// The root's side: the ranks' registrations, kept open until the group is destroyed.
struct Root {
    destroyed: AtomicBool,
    ranks: Mutex<Vec<TcpStream>>,
}

impl TcpGroup {
    /// A group of `world` ranks whose blocking calls wait at most `timeout`.
    pub fn create(world: usize, label: &str, timeout: Duration) -> Result<TcpGroup, CommError> {
        if world == 0 {
            return Err(CommError::Config {
                message: "a communicator group needs at least one rank".into(),
            });
        }
        let id = CommId::generate();
        let group = format!("{label} ({id})");
        let ip = *ROOT_IP.get().unwrap_or(&IpAddr::V4(Ipv4Addr::LOCALHOST));
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| io_err(&group, format!("listening for its ranks on {ip}"), e))?;
        let root_addr = listener
            .local_addr()
            .map_err(|e| io_err(&group, "its rendezvous address", e))?;
        let mut key = [0u8; KEY];
        getrandom::fill(&mut key).map_err(|e| io_err(&group, "a fresh key", e))?;
        let payload = Payload {
            root: root_addr,
            key,
            label: label.to_string(),
            timeout_ms: timeout.as_millis() as u64,
        };
        let root = Arc::new(Root {
            destroyed: AtomicBool::new(false),
            ranks: Mutex::new(Vec::new()),
        });
        let (r, p) = (root.clone(), payload.clone());
        std::thread::Builder::new()
            .name(format!("adag-comm-root-{label}"))
            .spawn(move || rendezvous(listener, world, &p, &r, &group))
            .map_err(|e| io_err(label, "starting its rendezvous thread", e))?;
        Ok(TcpGroup {
            id,
            world,
            payload,
            root,
        })
    }
}

/// The root's thread: takes each rank's registration (checking its proof), sends every rank
/// the table of addresses once all are in, then holds the connections until the group is
/// destroyed (or nobody came within the timeout).
fn rendezvous(listener: TcpListener, world: usize, p: &Payload, root: &Root, group: &str) {
    let deadline = Instant::now() + Duration::from_millis(p.timeout_ms);
    let _ = listener.set_nonblocking(true);
    let mut table: Vec<Option<(SocketAddr, TcpStream)>> = (0..world).map(|_| None).collect();
    while table.iter().any(Option::is_none) {
        if root.destroyed.load(Ordering::Acquire) || Instant::now() > deadline {
            return;
        }
        let Some((mut s, peer)) = accept_one(&listener) else {
            continue;
        };
        match read_registration(&mut s, &p.key, world) {
            Ok((rank, addr)) if table[rank].is_none() => table[rank] = Some((addr, s)),
            Ok((rank, _)) => {
                tracing::warn!(group, rank, %peer, "a second registration of a rank; refused")
            }
            Err(e) => tracing::warn!(group, %peer, error = %e, "a rank's registration refused"),
        }
    }
    let addrs: Vec<SocketAddr> = table.iter().flatten().map(|(a, _)| *a).collect();
    let Ok(encoded) = postcard::to_stdvec(&addrs) else {
        return;
    };
    let mut ranks = Vec::with_capacity(world);
    for (_, mut s) in table.into_iter().flatten() {
        let _ = s.write_all(&(encoded.len() as u32).to_le_bytes());
        let _ = s.write_all(&encoded);
        ranks.push(s);
    }
    *root.ranks.lock().unwrap_or_else(|e| e.into_inner()) = ranks;
    if root.destroyed.load(Ordering::Acquire) {
        root.close();
    }
}

/// A connection waiting on a non-blocking `listener`, made blocking with a read timeout that
/// bounds its handshake; `None` after a short pause when none is waiting.
fn accept_one(listener: &TcpListener) -> Option<(TcpStream, SocketAddr)> {
    match listener.accept() {
        Ok((s, peer)) => {
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            Some((s, peer))
        }
        Err(e) => {
            if e.kind() == io::ErrorKind::WouldBlock {
                std::thread::sleep(Duration::from_millis(1));
            }
            None
        }
    }
}

fn read_registration(
    s: &mut TcpStream,
    key: &[u8],
    world: usize,
) -> io::Result<(usize, SocketAddr)> {
    let mut head = [0u8; 8 + 8 + 2];
    s.read_exact(&mut head)?;
    if &head[..8] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not an adag rank",
        ));
    }
    let rank = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes")) as usize;
    let len = u16::from_le_bytes([head[16], head[17]]) as usize;
    let mut rest = vec![0u8; len + PROOF];
    s.read_exact(&mut rest)?;
    let (addr, their) = rest.split_at(len);
    if proof(key, &[b"register", &(rank as u64).to_le_bytes(), addr]) != their {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "its proof of the group's key is wrong",
        ));
    }
    if rank >= world {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "rank out of range",
        ));
    }
    let addr = std::str::from_utf8(addr)
        .ok()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not an address"))?;
    Ok((rank, addr))
}

impl Root {
    fn close(&self) {
        for s in self
            .ranks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl CommunicatorGroup for TcpGroup {
    fn id(&self) -> CommId {
        self.id
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn transport_name(&self) -> &str {
        TRANSPORT
    }
    fn communicator(&self, rank: usize) -> Result<Arc<dyn Communicator>, CommError> {
        Ok(Arc::new(TcpCommunicator::open(&self.ticket()?, rank)?))
    }
    fn ticket(&self) -> Result<GroupTicket, CommError> {
        Ok(GroupTicket {
            id: self.id,
            transport: TRANSPORT.into(),
            world_size: self.world,
            payload: postcard::to_stdvec(&self.payload)
                .map_err(|e| io_err(&self.payload.label, "encoding its ticket", e))?,
        })
    }
    fn destroy(&self) {
        self.root.destroyed.store(true, Ordering::Release);
        self.root.close();
    }
}

/// The connections of one rank, once formed.
struct Mesh {
    /// The connection to the root: closed means the group is destroyed.
    root: TcpStream,
    /// By peer rank (`None` at this rank's own index): point-to-point, collectives.
    p2p: Vec<Option<TcpStream>>,
    coll: Vec<Option<TcpStream>>,
}

/// A rank's mesh once formed (or why it could not form), and who waits for it.
type Forming = (
    Mutex<Option<Result<Arc<Mesh>, CommError>>>,
    std::sync::Condvar,
);

/// One rank of a TCP group.
pub struct TcpCommunicator {
    id: CommId,
    rank: usize,
    world: usize,
    group: String,
    timeout: Duration,
    destroyed: Arc<AtomicBool>,
    /// What peers send in a reduction, by peer: kept from call to call.
    scratch: Mutex<Vec<Vec<u8>>>,
    /// The memory of the last result the caller dropped, for the next result (allreduce,
    /// allgather, reducescatter, a receive): each writes its result whole, so it need not be
    /// fresh.
    results: Recycler,
    /// Filled by the forming thread: the mesh, or why it could not form.
    formed: Arc<Forming>,
}

impl fmt::Debug for TcpCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpCommunicator")
            .field("group", &self.group)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl TcpCommunicator {
    /// Opens `rank` of the group of `ticket`; the connections form on a thread of their own.
    pub fn open(ticket: &GroupTicket, rank: usize) -> Result<TcpCommunicator, CommError> {
        let p: Payload =
            postcard::from_bytes(&ticket.payload).map_err(|e| CommError::Protocol {
                group: ticket.id.to_string(),
                message: format!("its ticket does not decode ({e}); run the same build everywhere"),
            })?;
        let group = format!("{} ({})", p.label, ticket.id);
        if rank >= ticket.world_size {
            return Err(CommError::InvalidRank {
                group,
                rank,
                world_size: ticket.world_size,
            });
        }
        let formed = Arc::new((Mutex::new(None), std::sync::Condvar::new()));
        let c = TcpCommunicator {
            id: ticket.id,
            rank,
            world: ticket.world_size,
            group: group.clone(),
            timeout: Duration::from_millis(p.timeout_ms),
            destroyed: Arc::new(AtomicBool::new(false)),
            scratch: Mutex::new(Vec::new()),
            results: Recycler::default(),
            formed: formed.clone(),
        };
        let world = ticket.world_size;
        std::thread::Builder::new()
            .name(format!("adag-comm-form-{rank}"))
            .spawn(move || {
                let result = form(&p, rank, world, &group).map(Arc::new);
                let (lock, cv) = &*formed;
                *lock.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
                cv.notify_all();
            })
            .map_err(|e| io_err(&c.group, "starting the thread that connects its ranks", e))?;
        Ok(c)
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// Waits for the mesh (within the timeout), then runs `f` with it.
    fn with_mesh<R>(
        &self,
        op: CommOp,
        f: impl FnOnce(&Mesh) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        if self.destroyed.load(Ordering::Acquire) {
            return Err(self.destroyed_err(op));
        }
        let (lock, cv) = &*self.formed;
        let deadline = self.deadline();
        let mut formed = lock.lock().unwrap_or_else(|e| e.into_inner());
        while formed.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CommError::Timeout {
                    group: self.group.clone(),
                    rank: self.rank,
                    op,
                    waiting_for: "every rank to connect (each must open its rank)".into(),
                    timeout: self.timeout,
                });
            }
            formed = cv
                .wait_timeout(formed, left.min(TICK))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        // Out of the lock: `destroy` takes it to reach the sockets while `f` blocks.
        let mesh = formed.as_ref().expect("formed").clone()?;
        drop(formed);
        f(&mesh)
    }

    fn destroyed_err(&self, op: CommOp) -> CommError {
        CommError::Destroyed {
            group: self.group.clone(),
            rank: self.rank,
            op,
        }
    }

    fn check_peer(&self, peer: usize, op: CommOp) -> Result<(), CommError> {
        if peer >= self.world || peer == self.rank {
            return Err(CommError::InvalidPeer {
                group: self.group.clone(),
                rank: self.rank,
                peer,
                op,
                world_size: self.world,
            });
        }
        Ok(())
    }

    fn bytes<'t>(&self, t: &'t Tensor, op: CommOp) -> Result<&'t [u8], CommError> {
        t.as_bytes().map_err(|source| CommError::Tensor {
            group: self.group.clone(),
            rank: self.rank,
            op,
            source,
        })
    }

    /// A rank that cannot take part in a call (its tensor is unusable) still goes through the
    /// call's first round, so that its peers fail at once naming it ([`CommError::PeerFailed`])
    /// rather than wait out the group's timeout, and every connection stays in step for the
    /// next call: to each peer `q` it sends a failure notice of `send_lens[q]` bytes (what `q`
    /// expects of it; the reason first, cut to fit) and it takes the `recv_lens[q]` bytes `q`
    /// sends it (a `kind` message). Every rank receives from every other in that round, so all
    /// learn of the failure there and none starts a second one. Returns `error`, its own.
    #[allow(clippy::too_many_arguments)]
    fn fail_round(
        &self,
        op: CommOp,
        dtype: DType,
        kind: u32,
        point_to_point: bool,
        send_lens: &[Option<usize>],
        recv_lens: &[Option<usize>],
        error: CommError,
    ) -> CommError {
        let reason = error.to_string();
        let notices: Vec<Option<Vec<u8>>> = send_lens
            .iter()
            .map(|len| {
                len.map(|len| {
                    let mut notice = vec![0u8; len];
                    let n = reason.len().min(len);
                    notice[..n].copy_from_slice(&reason.as_bytes()[..n]);
                    notice
                })
            })
            .collect();
        let mut taken: Vec<Option<Vec<u8>>> = recv_lens
            .iter()
            .map(|len| len.map(|len| vec![0u8; len]))
            .collect();
        // Whatever this round meets (a peer gone, another failed rank), the call fails with
        // this rank's own error.
        let _ = self.with_mesh(op, |mesh| {
            let conns = if point_to_point {
                &mesh.p2p
            } else {
                &mesh.coll
            };
            let sends = notices
                .iter()
                .map(|n| {
                    n.as_ref()
                        .map(|n| (header(OP_FAILED, dtype, n.len()), n.as_slice()))
                })
                .collect();
            let recvs = taken
                .iter_mut()
                .map(|t| {
                    t.as_mut()
                        .map(|t| (header(kind, dtype, t.len()), t.as_mut_slice()))
                })
                .collect();
            self.round(conns, &mesh.root, op, sends, recvs)
        });
        error
    }

    /// [`fail_round`](Self::fail_round) for a call whose first round is the scatter of a
    /// reduction (allreduce, reducescatter) over parts `split`.
    fn fail_scatter(
        &self,
        op: CommOp,
        dtype: DType,
        split: &[std::ops::Range<usize>],
        error: CommError,
    ) -> CommError {
        let es = dtype.size();
        let mine = split[self.rank].len() * es;
        let (sends, recvs): (Vec<_>, Vec<_>) = (0..self.world)
            .map(|q| {
                let peer = q != self.rank;
                (peer.then_some(split[q].len() * es), peer.then_some(mine))
            })
            .unzip();
        self.fail_round(op, dtype, OP_SCATTER, false, &sends, &recvs, error)
    }

    /// Runs one round of transfers: to each peer `sends[q]` (a header, then a payload), from
    /// each `recvs[q]` (a header, then into the buffer); all at once, until done, the
    /// deadline, a peer's error or the group's destruction.
    fn round(
        &self,
        conns: &[Option<TcpStream>],
        root: &TcpStream,
        op: CommOp,
        sends: Vec<Option<([u8; HEADER], &[u8])>>,
        mut recvs: Vec<Option<([u8; HEADER], &mut [u8])>>,
    ) -> Result<(), CommError> {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        let deadline = self.deadline();
        // Progress of each transfer: bytes of header + payload done.
        let mut sent: Vec<usize> = vec![0; conns.len()];
        let mut got: Vec<usize> = vec![0; conns.len()];
        let mut their_head: Vec<[u8; HEADER]> = vec![[0; HEADER]; conns.len()];
        // Peers that sent a failure notice in place of their part: the round still takes
        // its bytes (the connection stays in step), then fails naming the first of them.
        let mut failed: Vec<bool> = vec![false; conns.len()];
        fn send_left(sends: &[Option<([u8; HEADER], &[u8])>], sent: &[usize], q: usize) -> bool {
            sends[q]
                .as_ref()
                .is_some_and(|(_, body)| sent[q] < HEADER + body.len())
        }
        fn recv_left(recvs: &[Option<([u8; HEADER], &mut [u8])>], got: &[usize], q: usize) -> bool {
            recvs[q]
                .as_ref()
                .is_some_and(|(_, body)| got[q] < HEADER + body.len())
        }
        loop {
            let waiting: Vec<usize> = (0..conns.len())
                .filter(|&q| send_left(&sends, &sent, q) || recv_left(&recvs, &got, q))
                .collect();
            if waiting.is_empty() {
                return match failed.iter().position(|f| *f) {
                    None => Ok(()),
                    Some(q) => {
                        let body = recvs[q].as_ref().map_or(&[][..], |(_, b)| &b[..]);
                        let text = &body[..body.iter().position(|b| *b == 0).unwrap_or(body.len())];
                        let reason = if text.is_empty() {
                            "its part of the call was unusable (the reason did not fit in a message of this size)".to_string()
                        } else {
                            String::from_utf8_lossy(text).into_owned()
                        };
                        Err(CommError::PeerFailed {
                            group: self.group.clone(),
                            rank: self.rank,
                            op,
                            peer: q,
                            reason,
                        })
                    }
                };
            }
            if self.destroyed.load(Ordering::Acquire) {
                return Err(self.destroyed_err(op));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CommError::Timeout {
                    group: self.group.clone(),
                    rank: self.rank,
                    op,
                    waiting_for: format!("ranks {waiting:?}"),
                    timeout: self.timeout,
                });
            }
            let ready: Vec<(bool, bool)> = {
                let mut fds = vec![PollFd::new(root, PollFlags::IN)];
                for &q in &waiting {
                    let mut flags = PollFlags::empty();
                    if send_left(&sends, &sent, q) {
                        flags |= PollFlags::OUT;
                    }
                    if recv_left(&recvs, &got, q) {
                        flags |= PollFlags::IN;
                    }
                    fds.push(PollFd::new(
                        conns[q].as_ref().expect("a peer's connection"),
                        flags,
                    ));
                }
                let wait = left.min(TICK);
                let timeout = Timespec {
                    tv_sec: wait.as_secs() as i64,
                    tv_nsec: i64::from(wait.subsec_nanos()),
                };
                match poll(&mut fds, Some(&timeout)) {
                    Ok(_) | Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(io_err(&self.group, format!("{op}: poll"), e)),
                }
                if !fds[0].revents().is_empty() {
                    return Err(self.destroyed_err(op));
                }
                fds[1..]
                    .iter()
                    .map(|f| {
                        let r = f.revents();
                        (
                            r.intersects(PollFlags::OUT | PollFlags::ERR | PollFlags::HUP),
                            r.intersects(PollFlags::IN | PollFlags::ERR | PollFlags::HUP),
                        )
                    })
                    .collect()
            };
            for (&q, (can_send, can_recv)) in waiting.iter().zip(ready) {
                let mut s = conns[q].as_ref().expect("a peer's connection");
                let gone = |e: io::Error| CommError::Aborted {
                    group: self.group.clone(),
                    rank: self.rank,
                    op,
                    by: q,
                    reason: format!(
                        "its connection failed ({e}): it died, or its group was destroyed"
                    ),
                };
                if can_send && send_left(&sends, &sent, q) {
                    let (head, body) = sends[q].as_ref().expect("pending");
                    let r = if sent[q] < HEADER {
                        s.write(&head[sent[q]..])
                    } else {
                        s.write(&body[sent[q] - HEADER..])
                    };
                    match r {
                        Ok(n) => sent[q] += n,
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                            ) => {}
                        Err(e) => return Err(gone(e)),
                    }
                }
                if can_recv && recv_left(&recvs, &got, q) {
                    let (want, body) = recvs[q].as_mut().expect("pending");
                    let r = if got[q] < HEADER {
                        s.read(&mut their_head[q][got[q]..])
                    } else {
                        s.read(&mut body[got[q] - HEADER..])
                    };
                    match r {
                        Ok(0) => return Err(gone(io::Error::from(io::ErrorKind::UnexpectedEof))),
                        Ok(n) => {
                            let before = got[q];
                            got[q] += n;
                            // The header just completed: the expected one, or a failure
                            // notice of the expected dtype and length.
                            if before < HEADER && got[q] >= HEADER && their_head[q] != *want {
                                let head = &their_head[q];
                                if head[..4] == OP_FAILED.to_le_bytes() && head[4..] == want[4..] {
                                    failed[q] = true;
                                } else {
                                    return Err(CommError::Mismatch {
                                        group: self.group.clone(),
                                        rank: self.rank,
                                        peer: q,
                                        op,
                                        expected: describe(want),
                                        found: describe(head),
                                    });
                                }
                            }
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                            ) => {}
                        Err(e) => return Err(gone(e)),
                    }
                }
            }
        }
    }
}

/// A message header: the operation, the dtype and the payload's length.
fn header(op: u32, dtype: DType, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&op.to_le_bytes());
    h[4..8].copy_from_slice(&(dtype as u32).to_le_bytes());
    h[8..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

fn describe(h: &[u8; HEADER]) -> String {
    let op = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
    let name = match op {
        1 => "send",
        2 => "reducescatter",
        3 => "allgather",
        4 => "a failed rank's notice",
        _ => "another operation",
    };
    format!(
        "{name} of dtype code {} and {} bytes",
        u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")),
        u64::from_le_bytes(h[8..].try_into().expect("8 bytes"))
    )
}

const OP_P2P: u32 = 1;
const OP_SCATTER: u32 = 2;
const OP_GATHER: u32 = 3;
/// Sent in place of a rank's part by a rank that cannot take part in the call (see
/// `TcpCommunicator::fail_round`): as many bytes as the peer expects, the reason first.
const OP_FAILED: u32 = 4;

/// Registers with the root, gets the table, and opens the mesh (two connections a pair).
fn form(p: &Payload, rank: usize, world: usize, group: &str) -> Result<Mesh, CommError> {
    let deadline = Instant::now() + Duration::from_millis(p.timeout_ms);
    let err = |what: &str, e: &dyn fmt::Display| io_err(group, format!("rank {rank}: {what}"), e);
    let mut root = loop {
        match TcpStream::connect_timeout(&p.root, Duration::from_secs(2)) {
            Ok(s) => break s,
            Err(e) if Instant::now() + Duration::from_millis(50) < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(err(&format!("reaching the group's root at {}", p.root), &e)),
        }
    };
    let _ = root.set_nodelay(true);
    let local_ip = root.local_addr().map_err(|e| err("its address", &e))?.ip();
    let listener =
        TcpListener::bind((local_ip, 0)).map_err(|e| err("listening for its peers", &e))?;
    let me = listener
        .local_addr()
        .map_err(|e| err("its address", &e))?
        .to_string();
    let mut reg = Vec::new();
    reg.extend_from_slice(MAGIC);
    reg.extend_from_slice(&(rank as u64).to_le_bytes());
    reg.extend_from_slice(&(me.len() as u16).to_le_bytes());
    reg.extend_from_slice(me.as_bytes());
    reg.extend_from_slice(&proof(
        &p.key,
        &[b"register", &(rank as u64).to_le_bytes(), me.as_bytes()],
    ));
    root.write_all(&reg)
        .map_err(|e| err("registering with the root", &e))?;
    root.set_read_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ))
    .map_err(|e| err("a timeout", &e))?;
    let mut len = [0u8; 4];
    root.read_exact(&mut len).map_err(|e| {
        err(
            "waiting for every rank to register (did each open its rank?)",
            &e,
        )
    })?;
    let mut table = vec![0u8; u32::from_le_bytes(len) as usize];
    root.read_exact(&mut table)
        .map_err(|e| err("reading the ranks' addresses", &e))?;
    let addrs: Vec<SocketAddr> =
        postcard::from_bytes(&table).map_err(|e| err("decoding the ranks' addresses", &e))?;
    if addrs.len() != world {
        return Err(err("the ranks' addresses", &"a table of another size"));
    }
    let mut p2p: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut coll: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    // Dial the lower ranks.
    for (q, addr) in addrs.iter().enumerate().take(rank) {
        for kind in [0u8, 1] {
            let mut s = TcpStream::connect_timeout(addr, Duration::from_secs(5))
                .map_err(|e| err(&format!("connecting to rank {q} at {addr}"), &e))?;
            let mut hello = Vec::with_capacity(8 + 1 + 8 + PROOF);
            hello.extend_from_slice(MAGIC);
            hello.push(kind);
            hello.extend_from_slice(&(rank as u64).to_le_bytes());
            hello.extend_from_slice(&proof(
                &p.key,
                &[
                    b"peer",
                    &[kind],
                    &(rank as u64).to_le_bytes(),
                    &(q as u64).to_le_bytes(),
                ],
            ));
            s.write_all(&hello)
                .map_err(|e| err(&format!("greeting rank {q}"), &e))?;
            if kind == 0 {
                p2p[q] = Some(s);
            } else {
                coll[q] = Some(s);
            }
        }
    }
    // Take the higher ranks' connections.
    listener
        .set_nonblocking(true)
        .map_err(|e| err("its listener", &e))?;
    let expected = 2 * (world - 1 - rank);
    let mut taken = 0;
    while taken < expected {
        if Instant::now() > deadline {
            return Err(CommError::Timeout {
                group: group.to_string(),
                rank,
                op: CommOp::Open,
                waiting_for: "the higher ranks to connect".into(),
                timeout: Duration::from_millis(p.timeout_ms),
            });
        }
        let Some((mut s, _)) = accept_one(&listener) else {
            continue;
        };
        let mut hello = [0u8; 8 + 1 + 8 + PROOF];
        if s.read_exact(&mut hello).is_err() || &hello[..8] != MAGIC {
            continue;
        }
        let kind = hello[8];
        let q = u64::from_le_bytes(hello[9..17].try_into().expect("8 bytes")) as usize;
        let want = proof(
            &p.key,
            &[
                b"peer",
                &[kind],
                &(q as u64).to_le_bytes(),
                &(rank as u64).to_le_bytes(),
            ],
        );
        if q <= rank || q >= world || kind > 1 || want != hello[17..] {
            tracing::warn!(
                group,
                rank,
                "a connection that did not prove the group's key; dropped"
            );
            continue;
        }
        let slot = if kind == 0 { &mut p2p[q] } else { &mut coll[q] };
        if slot.is_none() {
            *slot = Some(s);
            taken += 1;
        }
    }
    for s in p2p.iter().chain(&coll).flatten() {
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(None);
        s.set_nonblocking(true)
            .map_err(|e| err("a peer connection", &e))?;
    }
    root.set_read_timeout(None)
        .map_err(|e| err("a timeout", &e))?;
    Ok(Mesh { root, p2p, coll })
}

/// Element ranges of `numel` split in `n` near-equal parts.
fn parts(numel: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    (0..n)
        .map(|k| (numel * k / n)..(numel * (k + 1) / n))
        .collect()
}

impl TcpCommunicator {
    /// Each rank `q` gets part `q` (of `split`, in elements) of every rank's `bytes` and
    /// reduces them in rank order into `out` (its own part's length). What peers send is
    /// received into buffers kept from call to call (a fresh buffer costs page faults on every
    /// call, and returning it to the system more).
    #[allow(clippy::too_many_arguments)]
    fn scatter_reduce(
        &self,
        mesh: &Mesh,
        op: CommOp,
        reduce: ReduceOp,
        dtype: DType,
        bytes: &[u8],
        split: &[std::ops::Range<usize>],
        out: &mut [u8],
    ) -> Result<(), CommError> {
        let es = dtype.size();
        let mine = &split[self.rank];
        let my_len = mine.len() * es;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        scratch.resize_with(self.world, Vec::new);
        for (q, b) in scratch.iter_mut().enumerate() {
            if q != self.rank && b.len() < my_len {
                b.resize(my_len, 0);
            }
        }
        let sends = (0..self.world)
            .map(|q| {
                (q != self.rank).then(|| {
                    let r = &split[q];
                    (
                        header(OP_SCATTER, dtype, r.len() * es),
                        &bytes[r.start * es..r.end * es],
                    )
                })
            })
            .collect();
        let recvs = scratch
            .iter_mut()
            .enumerate()
            .map(|(q, b)| {
                (q != self.rank).then(|| (header(OP_SCATTER, dtype, my_len), &mut b[..my_len]))
            })
            .collect();
        self.round(&mesh.coll, &mesh.root, op, sends, recvs)?;
        let own = &bytes[mine.start * es..mine.end * es];
        let inputs: Vec<&[u8]> = (0..self.world)
            .map(|q| {
                if q == self.rank {
                    own
                } else {
                    &scratch[q][..my_len]
                }
            })
            .collect();
        if my_len > 0 {
            reduce_bytes(dtype, reduce, &inputs, out).map_err(|source| CommError::Tensor {
                group: self.group.clone(),
                rank: self.rank,
                op,
                source,
            })?;
        }
        Ok(())
    }

    /// Every rank gets every rank's part of `out` (parts of lengths `lens`, in rank order):
    /// this rank's part is in place already, the others are received into theirs.
    fn gather(
        &self,
        mesh: &Mesh,
        op: CommOp,
        dtype: DType,
        out: &mut [u8],
        lens: &[usize],
    ) -> Result<(), CommError> {
        let mut mine: &[u8] = &[];
        let mut recvs: Vec<Option<([u8; HEADER], &mut [u8])>> = Vec::with_capacity(self.world);
        let mut rest = out;
        for (q, &len) in lens.iter().enumerate() {
            let (head, tail) = rest.split_at_mut(len);
            rest = tail;
            if q == self.rank {
                mine = head;
                recvs.push(None);
            } else {
                recvs.push(Some((header(OP_GATHER, dtype, len), head)));
            }
        }
        let sends = (0..self.world)
            .map(|q| (q != self.rank).then(|| (header(OP_GATHER, dtype, mine.len()), mine)))
            .collect();
        self.round(&mesh.coll, &mesh.root, op, sends, recvs)
    }

    fn tensor(
        &self,
        op: CommOp,
        dtype: DType,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<Tensor, CommError> {
        Tensor::from_bytes(dtype, shape, self.results.wrap(data)).map_err(|source| {
            CommError::Tensor {
                group: self.group.clone(),
                rank: self.rank,
                op,
                source,
            }
        })
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&self, tensor: &Tensor, peer: usize) -> Result<(), CommError> {
        let op = CommOp::Send;
        self.check_peer(peer, op)?;
        let bytes = match self.bytes(tensor, op) {
            Ok(b) => b,
            Err(e) => {
                let len = tensor.nbytes();
                let sends: Vec<Option<usize>> = (0..self.world)
                    .map(|q| (q == peer).then_some(len))
                    .collect();
                let recvs = vec![None; self.world];
                return Err(self.fail_round(op, tensor.dtype(), OP_P2P, true, &sends, &recvs, e));
            }
        };
        self.with_mesh(op, |mesh| {
            let mut sends: Vec<Option<([u8; HEADER], &[u8])>> =
                (0..self.world).map(|_| None).collect();
            sends[peer] = Some((header(OP_P2P, tensor.dtype(), bytes.len()), bytes));
            let recvs = (0..self.world).map(|_| None).collect();
            self.round(&mesh.p2p, &mesh.root, op, sends, recvs)
        })
    }

    fn recv(&self, shape: &[usize], dtype: DType, peer: usize) -> Result<Tensor, CommError> {
        let op = CommOp::Recv;
        self.check_peer(peer, op)?;
        let len = shape.iter().product::<usize>() * dtype.size();
        // Written whole by the receive.
        let mut data = self.results.take_or_zeroed(len);
        self.with_mesh(op, |mesh| {
            let sends = (0..self.world).map(|_| None).collect();
            let mut recvs: Vec<Option<([u8; HEADER], &mut [u8])>> =
                (0..self.world).map(|_| None).collect();
            recvs[peer] = Some((header(OP_P2P, dtype, len), data.as_mut_slice()));
            self.round(&mesh.p2p, &mesh.root, op, sends, recvs)
        })?;
        self.tensor(op, dtype, shape.to_vec(), data)
    }

    fn allreduce(&self, tensor: &Tensor, reduce: ReduceOp) -> Result<Tensor, CommError> {
        let op = CommOp::AllReduce(reduce);
        let dtype = tensor.dtype();
        let split = parts(tensor.numel(), self.world);
        let bytes = self
            .bytes(tensor, op)
            .map_err(|e| self.fail_scatter(op, dtype, &split, e))?;
        let lens: Vec<usize> = split.iter().map(|r| r.len() * dtype.size()).collect();
        // Every byte is written below: this rank's part by the reduction, the others by
        // the gather.
        let mut data = self.results.take_or_zeroed(bytes.len());
        self.with_mesh(op, |mesh| {
            // Reduced straight into this rank's part of the result, which is then sent from
            // there while the other parts are received into theirs.
            let at: usize = lens[..self.rank].iter().sum();
            let mine = &mut data[at..at + lens[self.rank]];
            self.scatter_reduce(mesh, op, reduce, dtype, bytes, &split, mine)?;
            self.gather(mesh, op, dtype, &mut data, &lens)
        })?;
        self.tensor(op, dtype, tensor.shape().to_vec(), data)
    }

    fn allgather(&self, tensor: &Tensor) -> Result<Tensor, CommError> {
        let op = CommOp::AllGather;
        let bytes = self.bytes(tensor, op).map_err(|e| {
            let len = tensor.nbytes();
            let each: Vec<Option<usize>> = (0..self.world)
                .map(|q| (q != self.rank).then_some(len))
                .collect();
            self.fail_round(op, tensor.dtype(), OP_GATHER, false, &each, &each, e)
        })?;
        // Every byte is written: this rank's part here, the others by the gather.
        let mut data = self.results.take_or_zeroed(bytes.len() * self.world);
        data[self.rank * bytes.len()..(self.rank + 1) * bytes.len()].copy_from_slice(bytes);
        self.with_mesh(op, |mesh| {
            self.gather(
                mesh,
                op,
                tensor.dtype(),
                &mut data,
                &vec![bytes.len(); self.world],
            )
        })?;
        let mut shape = tensor.shape().to_vec();
        match shape.first_mut() {
            Some(d0) => *d0 *= self.world,
            None => shape = vec![self.world],
        }
        self.tensor(op, tensor.dtype(), shape, data)
    }

    fn reducescatter(&self, tensor: &Tensor, reduce: ReduceOp) -> Result<Tensor, CommError> {
        let op = CommOp::ReduceScatter(reduce);
        let shape = tensor.shape().to_vec();
        let d0 = shape.first().copied().unwrap_or(1);
        if shape.is_empty() || !d0.is_multiple_of(self.world) {
            return Err(CommError::Uneven {
                group: self.group.clone(),
                rank: self.rank,
                op,
                shape,
                world_size: self.world,
            });
        }
        let split = parts(tensor.numel(), self.world);
        let bytes = self
            .bytes(tensor, op)
            .map_err(|e| self.fail_scatter(op, tensor.dtype(), &split, e))?;
        // Written whole by the reduction.
        let mut data = self
            .results
            .take_or_zeroed(split[self.rank].len() * tensor.dtype().size());
        self.with_mesh(op, |mesh| {
            self.scatter_reduce(mesh, op, reduce, tensor.dtype(), bytes, &split, &mut data)
        })?;
        let mut out_shape = shape;
        out_shape[0] = d0 / self.world;
        self.tensor(op, tensor.dtype(), out_shape, data)
    }

    fn destroy(&self) -> Result<(), CommError> {
        self.destroyed.store(true, Ordering::Release);
        let formed = self
            .formed
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(Ok(mesh)) = formed {
            for s in mesh.p2p.iter().chain(&mesh.coll).flatten() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            let _ = mesh.root.shutdown(std::net::Shutdown::Both);
        }
        Ok(())
    }

    fn transport_name(&self) -> &str {
        TRANSPORT
    }

    fn comm_id(&self) -> Option<CommId> {
        Some(self.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(world: usize, label: &str) -> (TcpGroup, Vec<Arc<dyn Communicator>>) {
        let g = TcpGroup::create(world, label, Duration::from_secs(20)).unwrap();
        let comms = (0..world).map(|r| g.communicator(r).unwrap()).collect();
        (g, comms)
    }

    fn on_each<R: Send>(
        comms: &[Arc<dyn Communicator>],
        f: impl Fn(&dyn Communicator) -> R + Sync,
    ) -> Vec<R> {
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c.as_ref()))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn collectives_over_three_ranks_match_the_reference() {
        let (_g, comms) = ranks(3, "tcp-coll");
        for n in [0usize, 1, 1024, 8 << 20] {
            let input = |r: usize| {
                Tensor::from(
                    (0..n)
                        .map(|i| ((i % 97) as f32) * (r as f32 + 1.0))
                        .collect::<Vec<f32>>(),
                )
            };
            let want = crate::comm::reduce_tensors(&[input(0), input(1), input(2)], ReduceOp::Sum)
                .unwrap();
            let got = on_each(&comms, |c| {
                c.allreduce(&input(c.rank()), ReduceOp::Sum).unwrap()
            });
            for t in &got {
                assert_eq!(t, &want, "allreduce of {n}");
            }
        }
        let got = on_each(&comms, |c| {
            c.allgather(&Tensor::from(vec![c.rank() as i64; 2]))
                .unwrap()
        });
        for t in &got {
            assert_eq!(t.as_slice::<i64>().unwrap(), &[0, 0, 1, 1, 2, 2]);
        }
        let got = on_each(&comms, |c| {
            c.reducescatter(&Tensor::from(vec![1i32, 2, 3, 4, 5, 6]), ReduceOp::Max)
                .unwrap()
        });
        for (r, t) in got.iter().enumerate() {
            assert_eq!(
                t.as_slice::<i32>().unwrap(),
                &[2 * r as i32 + 1, 2 * r as i32 + 2]
            );
        }
        let avg = on_each(&comms, |c| {
            c.allreduce(
                &Tensor::from(vec![c.rank() as i32 * 3 + 1; 5]),
                ReduceOp::Average,
            )
            .unwrap()
        });
        assert!(avg.iter().all(|t| t.as_slice::<i32>().unwrap() == [4; 5]));
    }

    /// A result the caller dropped lends its memory to the next one (no fresh pages per
    /// call), and every byte of it is written again: results of calls with other values, of
    /// other collectives and of receives stay exact.
    #[test]
    fn dropped_results_lend_their_memory_to_the_next_and_are_overwritten_whole() {
        let (_g, comms) = ranks(3, "tcp-recycle");
        let n = 1 << 20;
        let input = |r: usize, call: usize| {
            Tensor::from(
                (0..n)
                    .map(|i| ((i + call) % 31) as f32 * (r as f32 + 1.0) + call as f32)
                    .collect::<Vec<f32>>(),
            )
        };
        let mut places: Vec<Vec<usize>> = vec![Vec::new(); 3];
        for call in 0..4 {
            let all: Vec<Tensor> = (0..3).map(|r| input(r, call)).collect();
            let want = crate::comm::reduce_tensors(&all, ReduceOp::Sum).unwrap();
            let got = on_each(&comms, |c| {
                let t = c.allreduce(&input(c.rank(), call), ReduceOp::Sum).unwrap();
                let at = t.as_slice::<f32>().unwrap().as_ptr() as usize;
                (t, at)
            });
            for (r, (t, at)) in got.into_iter().enumerate() {
                assert_eq!(t, want, "call {call}, rank {r}");
                places[r].push(at);
            }
            // Between allreduces, other collectives take and give back the same memory.
            let gathered = on_each(&comms, |c| {
                c.allgather(&Tensor::from(vec![c.rank() as f32 + call as f32; n / 3]))
                    .unwrap()
            });
            for t in &gathered {
                let v = t.as_slice::<f32>().unwrap();
                for r in 0..3 {
                    assert!(
                        v[r * (n / 3)..(r + 1) * (n / 3)]
                            .iter()
                            .all(|x| *x == r as f32 + call as f32)
                    );
                }
            }
        }
        for (r, at) in places.iter().enumerate() {
            assert!(
                at[1..].iter().all(|a| *a == at[1]),
                "rank {r}: results after the first should reuse one memory: {at:x?}"
            );
        }
    }

    /// A rank whose tensor is unusable fails its own call, and its peers fail theirs at once
    /// naming it (not a timeout after the group's 20 s); the connections stay in step, so
    /// the next calls of the group work.
    #[test]
    fn an_unusable_tensor_fails_the_call_on_every_rank_and_the_group_goes_on() {
        use crate::comm::tests::FakeCuda;
        use crate::tensor::TensorError;
        let (_g, comms) = ranks(3, "tcp-unusable");
        let unusable = |n: usize| {
            Tensor::from_device_buffer(DType::F32, [n], Arc::new(FakeCuda(4 * n))).unwrap()
        };
        let assert_failed = |r: usize, e: &CommError| {
            if r == 1 {
                assert!(
                    matches!(
                        e,
                        CommError::Tensor {
                            source: TensorError::NotOnCpu { .. },
                            ..
                        }
                    ),
                    "{e}"
                );
            } else {
                assert!(matches!(e, CommError::PeerFailed { peer: 1, .. }), "{e}");
            }
        };
        // 300 values: the reason fits; 2 values (8 bytes): it does not, and the peers still
        // fail naming rank 1.
        for n in [300usize, 2] {
            let got = on_each(&comms, |c| {
                let t = if c.rank() == 1 {
                    unusable(n)
                } else {
                    Tensor::from(vec![1.0f32; n])
                };
                (
                    c.allreduce(&t, ReduceOp::Sum).unwrap_err(),
                    c.allgather(&t).unwrap_err(),
                )
            });
            for (r, (reduced, gathered)) in got.iter().enumerate() {
                assert_failed(r, reduced);
                assert_failed(r, gathered);
                if r != 1 && n == 300 {
                    assert!(reduced.to_string().contains("cuda"), "{reduced}");
                }
            }
        }
        let got = on_each(&comms, |c| {
            let t = if c.rank() == 1 {
                unusable(6)
            } else {
                Tensor::from(vec![1.0f32; 6])
            };
            c.reducescatter(&t, ReduceOp::Sum).unwrap_err()
        });
        for (r, e) in got.iter().enumerate() {
            assert_failed(r, e);
        }
        // Point to point: the receiver of an unusable send fails naming the sender.
        let got = on_each(&comms, |c| match c.rank() {
            1 => Some(c.send(&unusable(64), 0).unwrap_err()),
            0 => Some(c.recv(&[64], DType::F32, 1).unwrap_err()),
            _ => None,
        });
        assert_failed(1, got[1].as_ref().unwrap());
        assert_failed(0, got[0].as_ref().unwrap());
        // And the group goes on.
        let got = on_each(&comms, |c| {
            c.allreduce(&Tensor::from(vec![c.rank() as f32; 5]), ReduceOp::Sum)
                .unwrap()
        });
        assert!(got.iter().all(|t| t.as_slice::<f32>().unwrap() == [3.0; 5]));
        let got = on_each(&comms, |c| match c.rank() {
            1 => c.send(&Tensor::from(vec![7u8; 3]), 0).map(|_| None),
            0 => c.recv(&[3], DType::U8, 1).map(Some),
            _ => Ok(None),
        });
        assert_eq!(
            got[0]
                .as_ref()
                .unwrap()
                .as_ref()
                .unwrap()
                .as_slice::<u8>()
                .unwrap(),
            &[7, 7, 7]
        );
    }

    #[test]
    fn allreduce_of_two_and_four_ranks_matches_the_reference() {
        for world in [2usize, 4] {
            let (_g, comms) = ranks(world, "tcp-worlds");
            // Parts that do not split evenly.
            let n = 300_001usize;
            let input = |r: usize| {
                Tensor::from(
                    (0..n)
                        .map(|i| (i % 13) as i32 * (r as i32 + 1) - 6)
                        .collect::<Vec<i32>>(),
                )
            };
            for op in [ReduceOp::Sum, ReduceOp::Average, ReduceOp::Min] {
                let all: Vec<Tensor> = (0..world).map(input).collect();
                let want = crate::comm::reduce_tensors(&all, op).unwrap();
                let got = on_each(&comms, |c| c.allreduce(&input(c.rank()), op).unwrap());
                for t in &got {
                    assert_eq!(t, &want, "{op:?} over {world}");
                }
            }
        }
    }

    #[test]
    fn point_to_point_mismatch_and_destroy() {
        let (g, comms) = ranks(2, "tcp-p2p");
        let got = on_each(&comms, |c| {
            if c.rank() == 0 {
                c.send(&Tensor::from(vec![7u8; 3 << 20]), 1).unwrap();
                None
            } else {
                Some(c.recv(&[3 << 20], DType::U8, 0).unwrap())
            }
        });
        assert!(
            got[1]
                .as_ref()
                .unwrap()
                .as_slice::<u8>()
                .unwrap()
                .iter()
                .all(|b| *b == 7)
        );
        // A receiver that names another dtype than its peer sends.
        let got = on_each(&comms, |c| {
            if c.rank() == 0 {
                c.send(&Tensor::from(vec![1f32; 4]), 1).map(|_| ())
            } else {
                c.recv(&[4], DType::I32, 0).map(|_| ())
            }
        });
        assert!(matches!(got[1], Err(CommError::Mismatch { .. })), "{got:?}");
        // A rank blocked on a peer that never comes is woken by the group's destruction.
        let (g2, comms2) = ranks(2, "tcp-destroy");
        let started = Instant::now();
        let waiter = comms2[1].clone();
        let h = std::thread::spawn(move || waiter.recv(&[1], DType::U8, 0));
        // Rank 0 formed too (both ranks are open), but never sends.
        std::thread::sleep(Duration::from_millis(300));
        g2.destroy();
        let r = h.join().unwrap();
        assert!(matches!(r, Err(CommError::Destroyed { .. })), "{r:?}");
        assert!(started.elapsed() < Duration::from_secs(15));
        drop(g);
    }

    #[test]
    fn a_rank_that_never_opens_times_out_naming_it() {
        let g = TcpGroup::create(2, "tcp-missing", Duration::from_millis(500)).unwrap();
        let c = g.communicator(0).unwrap();
        let r = c.allreduce(&Tensor::from(vec![1f32]), ReduceOp::Sum);
        assert!(
            matches!(
                r,
                Err(CommError::Timeout { .. }) | Err(CommError::Io { .. })
            ),
            "{r:?}"
        );
    }
}
