//! The control protocol between the driver and a worker process: framed postcard messages
//! over a `SOCK_SEQPACKET` socket pair, with file descriptors (shared-memory channels)
//! passed as `SCM_RIGHTS`. Payloads larger than one packet are split into chunks.
use crate::compile::plan::GraphPlan;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, recvmsg, sendmsg,
};
use serde::{Deserialize, Serialize};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

/// Requests from the driver.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToWorker {
    Spawn {
        id: u64,
        name: String,
        type_name: String,
        init: Vec<u8>,
        /// The driver's tracing level; the socket for the worker's events comes as an fd.
        log_level: String,
    },
    Call {
        method: String,
        args: Vec<u8>,
    },
    /// Run a graph; the shared-memory channels `chans` arrive as fds in the same order.
    Install {
        plan: GraphPlan,
        chans: Vec<u64>,
        /// Network connections of the graph this worker writes or reads; their fds follow
        /// the shared-memory channels' fds.
        net: Vec<u64>,
        /// The ceiling of one message (network ends check it themselves).
        max_message_bytes: u64,
        /// Record a timeline of the schedule's operations.
        timeline: bool,
    },
    /// The communicator ranks of the next `Install`: each ticket's descriptors arrive with
    /// this message, in ticket order (`fds` of them per ticket). A message of its own, so that
    /// `Install` keeps its shape and each message carries few descriptors.
    InstallComms {
        comms: Vec<CommTicket>,
    },
    /// Report the counters and timeline of the current (or last) graph.
    Observe,
    Shutdown,
}

/// One communicator rank for a worker: open rank `rank` of the group of `ticket` with the
/// `fds` descriptors that come with it; the schedule names the group by `group`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct CommTicket {
    pub group: u32,
    pub ticket: crate::comm::GroupTicket,
    pub rank: usize,
    pub fds: usize,
}

/// Why a one-off call failed, as it crosses the socket.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireFailure {
    NoSuchMethod,
    BadArgs(String),
    Task(crate::error::MethodError),
    /// The worker's actor did not take the call in time (stuck inside a method).
    Busy,
}

/// Replies and events from the worker.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum FromWorker {
    Spawned(Result<(), String>),
    CallResult(Result<Vec<u8>, WireFailure>),
    Installed(Result<(), String>),
    GraphDone(String),
    Observed(crate::actor::observe::Observation),
}

const CHUNK: usize = 64 * 1024;
const MAX_FDS: usize = 64;

/// Send one message with its fds.
pub(crate) fn send<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let body = postcard::to_stdvec(msg).map_err(std::io::Error::other)?;
    let total = (body.len() as u64).to_le_bytes();
    let first = body.len().min(CHUNK);
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        if fds.len() > MAX_FDS {
            return Err(std::io::Error::other(format!(
                "at most {MAX_FDS} channels per actor"
            )));
        }
        ancillary.push(SendAncillaryMessage::ScmRights(fds));
    }
    let iov = [IoSlice::new(&total), IoSlice::new(&body[..first])];
    sendmsg(sock, &iov, &mut ancillary, SendFlags::NOSIGNAL)?;
    for chunk in body[first..].chunks(CHUNK) {
        sendmsg(
            sock,
            &[IoSlice::new(chunk)],
            &mut SendAncillaryBuffer::default(),
            SendFlags::NOSIGNAL,
        )?;
    }
    Ok(())
}

/// Receive one message and its fds; `Ok(None)` when the peer closed the socket.
pub(crate) fn recv<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
) -> std::io::Result<Option<(T, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; CHUNK + 8];
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut ancillary = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut buf)],
        &mut ancillary,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    if got.bytes == 0 {
        return Ok(None);
    }
    let mut fds = Vec::new();
    for m in ancillary.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if got.bytes < 8 {
        return Err(std::io::Error::other("truncated control message header"));
    }
    let total = usize::try_from(u64::from_le_bytes(buf[..8].try_into().expect("8 bytes")))
        .map_err(|_| {
            std::io::Error::other(
                "control message header announces more than this machine can address",
            )
        })?;
    // The header is only a claim: reserve what one packet holds, and grow as chunks arrive,
    // so that a corrupt or hostile length cannot abort the process on allocation.
    let mut body = Vec::with_capacity(total.min(4 * CHUNK));
    body.extend_from_slice(&buf[8..got.bytes]);
    while body.len() < total {
        let n = rustix::net::recv(sock, &mut buf[..CHUNK], RecvFlags::empty())?.0;
        if n == 0 {
            return Err(std::io::Error::other(
                "control message cut short: the peer closed the socket",
            ));
        }
        body.extend_from_slice(&buf[..n]);
    }
    if body.len() != total {
        return Err(std::io::Error::other(
            "control message longer than its header says",
        ));
    }
    let msg = postcard::from_bytes(&body)
        .map_err(|e| std::io::Error::other(format!("malformed control message: {e}")))?;
    Ok(Some((msg, fds)))
}

/// A connected pair of control sockets.
pub(crate) fn socket_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType, socketpair};
    Ok(socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}
