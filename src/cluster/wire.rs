//! The protocol between a driver and the agents of other hosts: an authenticated handshake,
//! then length-prefixed postcard frames over one TCP connection (`TCP_NODELAY`).
//!
//! # Handshake (mutual challenge–response; the secret never crosses the wire)
//!
//! ```text
//! agent  → driver   MAGIC (8) | version (u32 LE) | nonce_a (32)
//! driver → agent    nonce_b (32) | HMAC-SHA256(secret, "adag-join driver" | nonce_a | nonce_b)
//! agent  → driver   HMAC-SHA256(secret, "adag-join agent" | nonce_a | nonce_b)
//! agent  → driver   frame: Hello { name, cores, pid, data port }
//! driver → agent    frame: Welcome { host, heartbeat } or Refused { reason }
//! ```
//!
//! The agent checks the driver's proof before it proves anything itself (a process that
//! does not know the secret learns nothing it can replay: both nonces are fresh). A connection
//! whose first bytes are not the magic, or that does not prove itself within the port's
//! pre-authentication deadline ([`super::gate`]), is dropped. Frames longer than
//! [`MAX_FRAME`] are refused without being read.
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// The first bytes of every join.
pub(crate) const MAGIC: &[u8; 8] = b"adagjoin";
/// The protocol's version; a different one is refused with a message naming both.
pub(crate) const VERSION: u32 = 4;
/// How long each side waits for the other's part of the handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest frame read before the peer is authenticated: the join is small.
pub(crate) const MAX_FRAME: usize = 1 << 20;
/// The largest frame read from an authenticated peer: one-off calls carry their arguments and
/// results (the default ceiling of one message, `CompileOptions::max_message_bytes`).
pub(crate) const MAX_JOINED_FRAME: usize = 1 << 30;

/// Bytes of a handshake's nonce and of its proof (an HMAC-SHA256).
pub(crate) const NONCE: usize = 32;
pub(crate) const PROOF: usize = 32;

/// The agent's first message after the handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Hello {
    pub name: String,
    pub cores: usize,
    pub pid: u32,
    /// Where the host's data port is reached (an unspecified address: at the address the
    /// driver sees the agent connect from, on this port).
    pub data: std::net::SocketAddr,
}

/// What the driver asks of a host's agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum AgentRequest {
    /// Start a worker process for actor `actor` of type `type_name` built from `init`.
    Spawn {
        actor: u64,
        name: String,
        type_name: String,
        init: Vec<u8>,
    },
    /// A one-off call of `method` on `actor` with encoded `args`.
    Call {
        actor: u64,
        method: String,
        args: Vec<u8>,
    },
    /// Kill the actor's worker at once.
    Kill { actor: u64 },
    /// The driver holds no handle of the actor any more: stop its worker.
    Release { actor: u64 },
    /// Install this host's part of graph `graph` (encoded by the runtime, opaque here);
    /// answered once every actor there installed its schedule.
    Install { graph: u64, part: Vec<u8> },
    /// Close graph `graph` on this host; answered once its actors there stopped their loops.
    CloseGraph { graph: u64 },
    /// The counters of `actor`'s current (or last) graph, waiting at most `wait_ms` for its
    /// worker: the driver's wait is bounded, so the agent's must be too.
    Observe { actor: u64, wait_ms: u64 },
}

/// What an agent answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum AgentReply {
    Spawned {
        pid: u32,
    },
    Returned(Vec<u8>),
    Done,
    /// An actor's report, encoded by the runtime (opaque here); `None` when its worker is
    /// dead, unknown here or did not answer in time.
    Observed(Option<Vec<u8>>),
}

/// Why a request to an agent failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum RemoteFailure {
    NoSuchMethod,
    BadArgs(String),
    Task(crate::error::MethodError),
    /// The actor did not take the call in time: it is stuck inside a method.
    Busy,
    Spawn(String),
    NoSuchActor,
    Died(String),
    /// The host was lost before it answered (set by the driver, never sent).
    HostLost(String),
    /// The host did not answer within the driver's wait (set by the driver, never sent).
    TimedOut(std::time::Duration),
}

/// Messages from the driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ToAgent {
    /// Joined as host `host`; send a heartbeat every `interval_ms`, and leave when nothing
    /// came from the driver for `timeout_ms`.
    Welcome {
        host: u64,
        interval_ms: u64,
        timeout_ms: u64,
        /// The most verbose `tracing` level the driver lets through (its workers' events
        /// less severe than this are never sent).
        log_level: String,
    },
    Refused {
        reason: String,
    },
    /// Also the driver's clock when it was sent (`crate::clock::mono_ns`), answered at once
    /// with [`ToDriver::Clock`]: the samples of the host's clock offset.
    Heartbeat {
        driver_ns: u64,
    },
    /// The driver is going away: exit with everything started here.
    Shutdown,
    /// Request `req`; answered by one `ToDriver::Reply` with the same number.
    Request {
        req: u64,
        request: AgentRequest,
    },
}

/// Messages from an agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ToDriver {
    Heartbeat,
    Reply {
        req: u64,
        result: Result<AgentReply, RemoteFailure>,
    },
    /// Actor `actor`'s worker died.
    Died {
        actor: u64,
        reason: String,
    },
    /// Actor `actor`'s schedule of graph `graph` stopped before the driver closed the graph
    /// (a connection of the graph broke): the graph is over.
    GraphFault {
        graph: u64,
        actor: String,
        reason: String,
    },
    /// The answer to a heartbeat: its `driver_ns`, and this host's clock when it arrived.
    Clock {
        driver_ns: u64,
        agent_ns: u64,
    },
    /// Lines the workers of this host wrote, each already prefixed with its actor, pid and
    /// host: `(true, line)` for stderr.
    Logs {
        lines: Vec<(bool, String)>,
    },
    /// A `tracing` event of a worker of this host (encoded by the runtime, opaque here).
    Event {
        actor: String,
        pid: u32,
        record: Vec<u8>,
    },
}

/// Why a handshake or a frame failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("the peer does not speak the adag join protocol (first bytes {0:02x?})")]
    NotAdag(Vec<u8>),
    #[error(
        "the peer speaks version {theirs} of the join protocol, this process {VERSION}; run the same executable on every host"
    )]
    Version { theirs: u32 },
    #[error("authentication failed: {0}")]
    Auth(&'static str),
    #[error("a frame of {0} bytes, over the limit of {1}")]
    TooLarge(usize, usize),
    #[error("a frame that does not decode: {0}")]
    Decode(String),
    #[error("no random numbers for the handshake: {0}")]
    Random(String),
    #[error("{0}")]
    Refused(String),
}

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// The proof that a peer knows `secret`: an HMAC-SHA256 keyed with it over a `domain` (which
/// handshake: the join, or a data connection) and the handshake's `parts` (role, both fresh
/// nonces, and what the connection is for), so that no proof of one handshake passes in another.
pub(crate) fn keyed_proof(secret: &[u8], domain: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut mac =
        <HmacSha256 as KeyInit>::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(domain);
    for part in parts {
        mac.update(part);
    }
    mac
}

fn proof(secret: &[u8], role: &[u8], nonce_a: &[u8], nonce_b: &[u8]) -> HmacSha256 {
    keyed_proof(secret, b"adag-join ", &[role, nonce_a, nonce_b])
}

/// A fresh random nonce of a handshake.
pub(crate) fn fresh_nonce() -> Result<[u8; NONCE], getrandom::Error> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n)?;
    Ok(n)
}

fn nonce() -> Result<[u8; NONCE], WireError> {
    fresh_nonce().map_err(|e| WireError::Random(e.to_string()))
}

/// The agent's side of the handshake: proves it knows `secret` only after the driver did.
pub(crate) fn agent_handshake(stream: &mut TcpStream, secret: &[u8]) -> Result<(), WireError> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let nonce_a = nonce()?;
    let mut hello = Vec::with_capacity(MAGIC.len() + 4 + NONCE);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&nonce_a);
    stream.write_all(&hello)?;
    let mut reply = [0u8; NONCE + PROOF];
    stream.read_exact(&mut reply)?;
    if &reply[..8] == OTHER_VERSION {
        let driver = u32::from_le_bytes(reply[8..12].try_into().expect("4 bytes"));
        return Err(WireError::Version { theirs: driver });
    }
    let (nonce_b, driver_proof) = reply.split_at(NONCE);
    proof(secret, b"driver", &nonce_a, nonce_b)
        .verify_slice(driver_proof)
        .map_err(|_| {
            WireError::Auth(
                "the driver did not prove it knows the secret: ADAG_TOKEN differs between this host and the driver",
            )
        })?;
    let mine = proof(secret, b"agent", &nonce_a, nonce_b)
        .finalize()
        .into_bytes();
    stream.write_all(&mine)?;
    Ok(())
}

/// What a driver answers, in place of its nonce and proof, to an agent of another protocol
/// version: this marker, then its own version (u32 LE), zero-padded to the answer's length. The
/// agent stops at once, naming both versions, rather than retrying a join that cannot succeed.
const OTHER_VERSION: &[u8; 8] = b"adagvers";

/// The driver's side of a join's handshake, fed the bytes as they arrive on a non-blocking
/// stream (the port's door reads every pending join on one thread): checks the magic, the
/// version and the agent's proof, and answers with the driver's own in between.
pub(crate) struct JoinCheck {
    greeting: [u8; 8 + 4 + NONCE],
    got: usize,
    /// The driver's nonce, once it answered.
    nonce_b: Option<[u8; NONCE]>,
    agent_proof: [u8; PROOF],
    proof_got: usize,
}

impl Default for JoinCheck {
    fn default() -> Self {
        JoinCheck {
            greeting: [0; 8 + 4 + NONCE],
            got: 0,
            nonce_b: None,
            agent_proof: [0; PROOF],
            proof_got: 0,
        }
    }
}

impl JoinCheck {
    /// Reads what arrived and answers when due: `Ok(true)` once the agent proved it knows
    /// `secret`, `Ok(false)` while bytes are missing. Each failure says which step failed and
    /// what that means (a peer that closes the connection instead of proving itself is an agent
    /// with another secret: it checks the driver's proof first and leaves).
    pub(crate) fn advance(&mut self, stream: &TcpStream, secret: &[u8]) -> Result<bool, WireError> {
        let Some(nonce_b) = self.nonce_b else {
            let before = self.got;
            let full = super::gate::read_some(stream, &mut self.greeting, &mut self.got).map_err(
                refused(if before == 0 {
                    "before sending the join's first bytes (a port scan or a health check?)"
                } else {
                    "in the middle of its greeting"
                }),
            );
            // The magic first, on its own: a stranger is dropped after 8 bytes.
            if self.got >= MAGIC.len() && &self.greeting[..MAGIC.len()] != MAGIC {
                return Err(WireError::NotAdag(self.greeting[..MAGIC.len()].to_vec()));
            }
            if !full? {
                return Ok(false);
            }
            let theirs = u32::from_le_bytes(self.greeting[8..12].try_into().expect("4 bytes"));
            if theirs != VERSION {
                let mut answer = [0u8; NONCE + PROOF];
                answer[..8].copy_from_slice(OTHER_VERSION);
                answer[8..12].copy_from_slice(&VERSION.to_le_bytes());
                let _ = (&*stream).write(&answer);
                return Err(WireError::Version { theirs });
            }
            let nonce_b = nonce()?;
            let nonce_a = &self.greeting[12..];
            let mut answer = Vec::with_capacity(NONCE + PROOF);
            answer.extend_from_slice(&nonce_b);
            answer.extend_from_slice(
                &proof(secret, b"driver", nonce_a, &nonce_b)
                    .finalize()
                    .into_bytes(),
            );
            // A new socket's buffer always has room for the answer.
            if (&*stream).write(&answer)? != answer.len() {
                return Err(WireError::Io(io::Error::other(
                    "the answer to the greeting did not fit the new socket",
                )));
            }
            self.nonce_b = Some(nonce_b);
            return self.advance(stream, secret);
        };
        if !super::gate::read_some(stream, &mut self.agent_proof, &mut self.proof_got).map_err(
            refused(
                "instead of proving it knows the secret: its ADAG_TOKEN differs from this driver's (an agent checks the driver's proof first, and leaves when it fails)",
            ),
        )? {
            return Ok(false);
        }
        proof(secret, b"agent", &self.greeting[12..], &nonce_b)
            .verify_slice(&self.agent_proof)
            .map_err(|_| WireError::Auth("the agent did not prove it knows the secret"))?;
        Ok(true)
    }
}

/// Names a handshake read that failed: the peer closed the connection (`when`), or said
/// nothing within [`HANDSHAKE_TIMEOUT`].
fn refused(when: &'static str) -> impl Fn(io::Error) -> WireError {
    move |e| match e.kind() {
        io::ErrorKind::UnexpectedEof => {
            WireError::Refused(format!("the peer closed the connection {when}"))
        }
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => WireError::Refused(format!(
            "the peer said nothing for {HANDSHAKE_TIMEOUT:?} (not an adag agent, or one on a network that drops packets)"
        )),
        _ => WireError::Io(e),
    }
}

/// Writes one frame: its length (u32 LE), then the message in postcard.
pub(crate) fn write_frame<T: Serialize>(stream: &mut impl Write, msg: &T) -> Result<(), WireError> {
    let body = postcard::to_stdvec(msg).map_err(|e| WireError::Decode(e.to_string()))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    stream.write_all(&frame)?;
    Ok(())
}

/// Reads one frame of at most [`MAX_FRAME`] bytes (the join).
pub(crate) fn read_frame<T: for<'de> Deserialize<'de>>(
    stream: &mut impl Read,
) -> Result<T, WireError> {
    read_frame_within(stream, MAX_FRAME)
}

/// Reads one frame; a length over `limit` is refused before anything is allocated.
pub(crate) fn read_frame_within<T: for<'de> Deserialize<'de>>(
    stream: &mut impl Read,
    limit: usize,
) -> Result<T, WireError> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > limit {
        return Err(WireError::TooLarge(len, limit));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    postcard::from_bytes(&body).map_err(|e| WireError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (a, b)
    }

    /// The driver's check driven as the port's door drives it (non-blocking), bounded in time.
    fn driver_handshake(stream: &mut TcpStream, secret: &[u8]) -> Result<(), WireError> {
        stream.set_nonblocking(true).unwrap();
        let mut check = JoinCheck::default();
        let until = std::time::Instant::now() + Duration::from_secs(20);
        while !check.advance(stream, secret)? {
            assert!(
                std::time::Instant::now() < until,
                "the handshake never ended"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    #[test]
    fn the_same_secret_joins_and_a_different_one_is_refused_on_both_sides() {
        for (agent_secret, ok) in [(&b"s3cret"[..], true), (&b"guess"[..], false)] {
            let (mut agent, mut driver) = pair();
            let d = std::thread::spawn(move || driver_handshake(&mut driver, b"s3cret"));
            let a = agent_handshake(&mut agent, agent_secret);
            drop(agent);
            let d = d.join().unwrap();
            assert_eq!(a.is_ok(), ok, "{a:?}");
            assert_eq!(d.is_ok(), ok, "{d:?}");
            if !ok {
                assert!(matches!(a, Err(WireError::Auth(_))), "{a:?}");
            }
        }
    }

    /// What the driver sends never contains the secret, whatever the agent sends it.
    #[test]
    fn the_secret_never_crosses_the_wire() {
        let secret = b"a-secret-long-enough-to-find";
        let (mut agent, mut driver) = pair();
        let d = std::thread::spawn(move || driver_handshake(&mut driver, secret));
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&[7u8; NONCE]);
        agent.write_all(&hello).unwrap();
        let mut reply = [0u8; NONCE + PROOF];
        agent.read_exact(&mut reply).unwrap();
        assert!(!reply.windows(secret.len()).any(|w| w == secret));
        agent.write_all(&[0u8; PROOF]).unwrap();
        assert!(matches!(d.join().unwrap(), Err(WireError::Auth(_))));
    }

    #[test]
    fn strangers_and_other_versions_are_dropped() {
        let (mut agent, mut driver) = pair();
        let d = std::thread::spawn(move || driver_handshake(&mut driver, b"x"));
        agent.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert!(matches!(d.join().unwrap(), Err(WireError::NotAdag(_))));

        let (mut agent, mut driver) = pair();
        let d = std::thread::spawn(move || driver_handshake(&mut driver, b"x"));
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&9u32.to_le_bytes());
        hello.extend_from_slice(&[0u8; NONCE]);
        agent.write_all(&hello).unwrap();
        assert!(matches!(
            d.join().unwrap(),
            Err(WireError::Version { theirs: 9 })
        ));
    }

    /// An agent of another version is told the driver's version: it stops at once instead of
    /// retrying a join that cannot succeed.
    #[test]
    fn an_agent_of_another_version_learns_the_drivers() {
        let (mut agent, mut driver) = pair();
        let d = std::thread::spawn(move || driver_handshake(&mut driver, b"x"));
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&(VERSION + 1).to_le_bytes());
        hello.extend_from_slice(&[0u8; NONCE]);
        agent.write_all(&hello).unwrap();
        let mut answer = [0u8; NONCE + PROOF];
        agent.read_exact(&mut answer).unwrap();
        assert_eq!(&answer[..8], OTHER_VERSION);
        assert_eq!(
            u32::from_le_bytes(answer[8..12].try_into().unwrap()),
            VERSION
        );
        assert!(d.join().unwrap().is_err());
    }

    #[test]
    fn frames_round_trip_and_oversized_ones_are_refused_unread() {
        let mut buf = Vec::new();
        let msg = ToAgent::Welcome {
            host: 3,
            interval_ms: 100,
            timeout_ms: 1000,
            log_level: "info".into(),
        };
        write_frame(&mut buf, &msg).unwrap();
        assert_eq!(read_frame::<ToAgent>(&mut &buf[..]).unwrap(), msg);
        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        assert!(matches!(
            read_frame::<ToAgent>(&mut &huge[..]),
            Err(WireError::TooLarge(..))
        ));
    }

    proptest! {
        /// Random bytes read as frames: a typed error or a message, never a panic, and never
        /// an allocation past the limit.
        #[test]
        fn random_frames_are_typed_errors(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = read_frame::<ToAgent>(&mut &bytes[..]);
            let _ = read_frame::<ToDriver>(&mut &bytes[..]);
            let _ = read_frame::<Hello>(&mut &bytes[..]);
        }
    }
}
