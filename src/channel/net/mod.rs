//! The network kind: a writer and its readers on different hosts, joined by one TCP
//! connection (`TCP_NODELAY`) per reading host, with the contract of the shared-memory ring.
//!
//! Each message is a 16-byte header (the frame's length, u64 LE, then its tag) followed by a
//! [frame](crate::value::frame) exactly as the ring holds it: the writer sends the frame's
//! head and then each large attachment from where it already lies (one `writev`, nothing
//! large copied); a reader receives the whole frame into one buffer and hands large payloads
//! to the value in place. Several readers on one host get one copy over the network: the
//! host's [`relay`] writes each frame straight into a shared-memory ring there, which they
//! read like any other. A channel back from that reader to the writer goes over the same
//! connection in the other direction (see `GraphPlan::shared_connections`): its messages
//! carry the ACKs of the way out.
//!
//! - **Depth and back-pressure.** The driver admits at most `max_inflight_executions`
//!   executions, so no edge ever carries more messages than that. A writer never waits for
//!   its reader: what the socket does not take at once (a frame larger than the TCP window,
//!   a reader busy elsewhere) is finished by a thread of the channel's, in order, while the
//!   writer goes on. Actors that send each other large values across hosts (an all-to-all)
//!   would otherwise each wait in its write for a peer that waits in its own.
//! - **Waits.** A reader spins (non-blocking receives) up to its spin budget, then sleeps in
//!   `poll` until data, the deadline, or a close: closing shuts the socket down, which wakes
//!   both ends at once. A message is never cut: a write whose deadline passes before its first
//!   byte fails with a timeout and sends nothing; once begun, it is finished (or the channel
//!   closed). A read whose deadline passes keeps what arrived and resumes at the next read.
//! - **Held frames.** An actor's writers may hold small frames back while the actor already has
//!   its next input whole in hand, and send them together, one system call for several frames
//!   ([`Holding`]). Under a pipeline of small messages the system calls are most of the cost
//!   (each send also runs the loopback receive), so a stage that is behind catches up in
//!   batches instead of one frame per call. Nothing is held while the actor waits, and
//!   nothing for long: see [`Holding`].
//! - **Hostile peers.** A header naming a frame over the ceiling, or a frame that does not
//!   decode, is a typed error: nothing is allocated past the ceiling and nothing panics.
use super::shm::ShmWriter;
use super::shm::{TAG_ERROR, TAG_VALUE};
use super::wait::SpinPolicy;
use super::{ChanError, ChannelReader, ChannelWriter, EndCounters, Msg, bump};
use crate::buffer::Recycler;
use crate::clock::mono_ns;
use crate::error::TaskError;
use crate::value::frame;
use bytes::Bytes;
pub(crate) use hold::Holding;
use hold::{HOLD_BYTES, HOLD_FRAME};
use rustix::event::{PollFd, PollFlags, Timespec};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::io::{self, IoSlice, Read};
use std::marker::PhantomData;
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod hold;

/// Bytes before each frame: its length (u64 LE), its tag, 7 reserved.
pub(crate) const HEADER: usize = 16;
const ZEROS: [u8; 64] = [0; 64];

fn io_error(e: io::Error) -> ChanError {
    match e.kind() {
        io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::NotConnected
        | io::ErrorKind::UnexpectedEof => ChanError::Closed,
        _ => ChanError::Codec(format!("the network connection failed: {e}")),
    }
}

/// Sleeps until `stream` is ready for `events`, the deadline passes (`Err(Timeout)`) or the
/// connection is shut down (returns, and the next operation on it says so).
fn wait_ready(
    stream: &TcpStream,
    events: PollFlags,
    deadline: Option<Instant>,
) -> Result<(), ChanError> {
    loop {
        let timeout = match deadline {
            None => None,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ChanError::Timeout);
                }
                Some(Timespec::try_from(left).unwrap_or(Timespec {
                    tv_sec: i64::MAX,
                    tv_nsec: 0,
                }))
            }
        };
        let mut fds = [PollFd::new(stream, events)];
        match rustix::event::poll(&mut fds, timeout.as_ref()) {
            Ok(0) => continue, // the deadline is checked above
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(io_error(e.into())),
        }
    }
}

/// Prepares a connected stream for a channel: non-blocking, no Nagle delay.
pub(crate) fn prepare(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_nonblocking(true)
}

/// Shuts a channel's connection down: every end blocked on it wakes and sees it closed.
pub(crate) fn shut(stream: &TcpStream) {
    let _ = stream.shutdown(Shutdown::Both);
}

/// The writer's end of a network channel, for values of type `T`.
pub(crate) struct NetTx<T> {
    /// The connection and what is pending on it; shared with the [`Holding`] of the actor
    /// that writes here, which sends held frames before the actor waits.
    out: Arc<parking_lot::Mutex<Outgoing>>,
    /// The ceiling of one message.
    limit: usize,
    counters: Option<Arc<EndCounters>>,
    /// Where this writer may hold small frames back (actors' writers only).
    holding: Option<Arc<Holding>>,
    _t: PhantomData<fn(T)>,
}

/// One writer's connection, with its frames not yet handed to the socket.
struct Outgoing {
    stream: TcpStream,
    /// Frames the socket did not take at once, finished in order by a thread; made at the
    /// first such frame.
    backlog: Option<Backlog>,
    /// Whole frames (headers included) held back, in order, and how many.
    held: Vec<u8>,
    held_frames: usize,
    /// When the first of them was held ([`mono_ns`]).
    held_since: u64,
    /// Why the flusher could not send held frames, for the writer's next write.
    failed: Option<ChanError>,
}

impl Outgoing {
    /// Sends `unsent` now, or what the socket does not take through the backlog: in order
    /// behind everything before it.
    fn send(&mut self, mut unsent: Unsent) -> Result<(), ChanError> {
        if let Some(b) = &self.backlog
            && b.busy()
        {
            return b.hand_over(unsent);
        }
        if !unsent.push(&self.stream)? {
            // The rest goes out behind the writer's back; it does not wait for its reader.
            if self.backlog.is_none() {
                self.backlog = Some(Backlog::start(&self.stream)?);
            }
            self.backlog.as_ref().expect("started").hand_over(unsent)?;
        }
        Ok(())
    }

    /// The held frames, to go out before whatever follows them; `holding` counts them out.
    fn take_held(&mut self, holding: Option<&Holding>) -> Vec<u8> {
        if let Some(h) = holding {
            h.left(self.held_frames);
        }
        self.held_frames = 0;
        std::mem::take(&mut self.held)
    }

    /// Sends every held frame.
    fn release(&mut self, holding: &Holding) -> Result<(), ChanError> {
        if self.held.is_empty() {
            return Ok(());
        }
        let prefix = self.take_held(Some(holding));
        self.send(Unsent {
            prefix,
            frame: None,
            sent: 0,
        })
    }
}

/// A frame's bytes on the stream, in order: its header, its head, then each attachment after
/// its padding.
fn frame_parts<'a>(
    header: &'a [u8; HEADER],
    frame: &'a frame::Gathered,
) -> impl Iterator<Item = &'a [u8]> {
    [&header[..], &frame.head[..]].into_iter().chain(
        frame
            .attachments
            .iter()
            .flat_map(|(pad, data)| [&ZEROS[..*pad], &data[..]])
            .filter(|part| !part.is_empty()),
    )
}

/// Frames going out on a connection, and how much of them is out: held frames first (whole,
/// headers included), then one frame as encoded.
struct Unsent {
    prefix: Vec<u8>,
    frame: Option<([u8; HEADER], frame::Gathered)>,
    sent: usize,
}

impl Unsent {
    /// Sends what the socket takes now; whether the frame is out.
    fn push(&mut self, stream: &TcpStream) -> Result<bool, ChanError> {
        // The slices borrow the frames, not the count of what is out.
        let mut all = Vec::with_capacity(
            3 + self
                .frame
                .as_ref()
                .map_or(0, |(_, f)| 2 * f.attachments.len()),
        );
        if !self.prefix.is_empty() {
            all.push(IoSlice::new(&self.prefix));
        }
        if let Some((header, frame)) = &self.frame {
            all.extend(frame_parts(header, frame).map(IoSlice::new));
        }
        let mut slices = &mut all[..];
        IoSlice::advance_slices(&mut slices, self.sent);
        while !slices.is_empty() {
            // `MSG_NOSIGNAL`: a connection the peer reset is an error here, never a SIGPIPE
            // that kills the process (a worker starts before Rust's runtime would ignore it).
            match rustix::net::sendmsg(
                stream,
                slices,
                &mut rustix::net::SendAncillaryBuffer::default(),
                rustix::net::SendFlags::NOSIGNAL,
            ) {
                Ok(0) => return Err(ChanError::Closed),
                Ok(n) => {
                    self.sent += n;
                    IoSlice::advance_slices(&mut slices, n);
                }
                Err(rustix::io::Errno::AGAIN) => return Ok(false),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(io_error(e.into())),
            }
        }
        Ok(true)
    }
}

/// The thread that finishes a writer's frames the socket did not take at once.
struct Backlog {
    queue: crossbeam_channel::Sender<Unsent>,
    /// Frames handed over and not yet out.
    queued: Arc<std::sync::atomic::AtomicUsize>,
    /// Why the thread stopped sending (the connection broke), for the writer's next write.
    failed: Arc<parking_lot::Mutex<Option<ChanError>>>,
}

impl Backlog {
    fn start(stream: &TcpStream) -> Result<Backlog, ChanError> {
        let stream = stream.try_clone().map_err(io_error)?;
        let (queue, frames) = crossbeam_channel::unbounded::<Unsent>();
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let failed = Arc::new(parking_lot::Mutex::new(None));
        let (q, f) = (queued.clone(), failed.clone());
        std::thread::Builder::new()
            .name("adag-net-send".into())
            .spawn(move || {
                // Ends when the writer is gone and every frame is out, or the connection
                // fails (closing the channel shuts it down).
                for mut unsent in frames {
                    let done = loop {
                        match unsent.push(&stream) {
                            Ok(true) => break Ok(()),
                            Ok(false) => {
                                if let Err(e) = wait_ready(&stream, PollFlags::OUT, None) {
                                    break Err(e);
                                }
                            }
                            Err(e) => break Err(e),
                        }
                    };
                    if let Err(e) = done {
                        *f.lock() = Some(e);
                        return;
                    }
                    q.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                }
            })
            .map_err(|e| ChanError::Codec(format!("no thread to send a large frame: {e}")))?;
        Ok(Backlog {
            queue,
            queued,
            failed,
        })
    }

    fn busy(&self) -> bool {
        self.queued.load(std::sync::atomic::Ordering::Acquire) > 0
    }

    fn hand_over(&self, unsent: Unsent) -> Result<(), ChanError> {
        self.queued
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.queue.send(unsent).map_err(|_| ChanError::Closed)
    }
}

impl<T> NetTx<T> {
    pub(crate) fn new(stream: TcpStream, limit: usize) -> Self {
        NetTx {
            out: Arc::new(parking_lot::Mutex::new(Outgoing {
                stream,
                backlog: None,
                held: Vec::new(),
                held_frames: 0,
                held_since: 0,
                failed: None,
            })),
            limit,
            counters: None,
            holding: None,
            _t: PhantomData,
        }
    }

    /// Count the bytes this end sends in `counters`.
    pub(crate) fn counted(mut self, counters: Arc<EndCounters>) -> Self {
        self.counters = Some(counters);
        self
    }

    fn send<V: Serialize + ?Sized>(
        &mut self,
        tag: u8,
        value: &V,
        deadline: Option<Instant>,
    ) -> Result<(), ChanError> {
        let g = frame::encode_gathered(value).map_err(|e| match e {
            frame::EncodeError::Failed(e) => ChanError::Codec(format!(
                "cannot encode a value of type {}: {e}",
                std::any::type_name::<V>()
            )),
            frame::EncodeError::TooSmall(n) => ChanError::TooLarge {
                size: n,
                limit: self.limit,
            },
        })?;
        if g.total > self.limit {
            return Err(ChanError::TooLarge {
                size: g.total,
                limit: self.limit,
            });
        }
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&(g.total as u64).to_le_bytes());
        header[8] = tag;
        let total = g.total;
        let mut out = self.out.lock();
        if let Some(e) = out.failed.take() {
            return Err(e);
        }
        if let Some(b) = &out.backlog
            && let Some(e) = b.failed.lock().take()
        {
            return Err(e);
        }
        if let Some(h) = &self.holding
            && h.holds()
            && Self::hold(&mut out, h, &header, &g)
        {
            self.count(total);
            if mono_ns().saturating_sub(out.held_since) < h.hold_max_ns() {
                return Ok(());
            }
            return out.release(h);
        }
        let prefix = out.take_held(self.holding.as_deref());
        // Held frames were written already: they go out whatever this write's deadline.
        if prefix.is_empty() && deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(ChanError::Timeout);
        }
        out.send(Unsent {
            prefix,
            frame: Some((header, g)),
            sent: 0,
        })?;
        self.count(total);
        Ok(())
    }

    /// Holds the frame back on `out` when it is small and there is room; whether it did.
    fn hold(
        out: &mut Outgoing,
        h: &Arc<Holding>,
        header: &[u8; HEADER],
        g: &frame::Gathered,
    ) -> bool {
        let len = HEADER + g.total;
        let busy = out.backlog.as_ref().is_some_and(Backlog::busy);
        if len > HOLD_FRAME || out.held.len() + len > HOLD_BYTES || busy {
            return false;
        }
        if out.held.is_empty() {
            out.held_since = mono_ns();
            out.held.reserve(HOLD_BYTES);
        }
        for part in frame_parts(header, g) {
            out.held.extend_from_slice(part);
        }
        out.held_frames += 1;
        h.held_one();
        true
    }

    fn count(&self, total: usize) {
        if let Some(c) = &self.counters {
            bump(&c.bytes, total as u64);
        }
    }
}

impl<T: Serialize> ChannelWriter<T> for NetTx<T> {
    fn write(&mut self, msg: Msg<T>, deadline: Option<Instant>) -> Result<(), ChanError> {
        match &msg {
            Msg::Value(v) => self.send(TAG_VALUE, v, deadline),
            Msg::Error(e) => self.send(TAG_ERROR, &**e, deadline),
        }
    }

    fn write_ref(&mut self, value: &T, deadline: Option<Instant>) -> Result<(), ChanError> {
        self.send(TAG_VALUE, value, deadline)
    }

    fn moves_values(&self) -> bool {
        false
    }

    fn hold_in(&mut self, holding: &Arc<Holding>) {
        holding.register(self.out.clone());
        self.holding = Some(holding.clone());
    }
}

/// Bytes a reader asks the kernel for at once: small frames that arrived together (a
/// pipeline) come out of one receive.
const READ_AHEAD: usize = 64 << 10;

/// Receives frames from a stream, resuming where a timed-out read stopped.
pub(crate) struct FrameReader {
    stream: TcpStream,
    limit: usize,
    /// How a wait spins and yields before it sleeps in `poll`.
    policy: SpinPolicy,
    /// Bytes received and not yet consumed (`ahead[..filled]` from `at`).
    ahead: Vec<u8>,
    at: usize,
    /// A frame larger than what was buffered, being received straight into its own memory.
    large: Option<Large>,
    /// The memory of the last large frame, back once its value was dropped: the next large
    /// frame reuses it rather than faulting fresh pages in (a new 100 MiB mapping costs more
    /// than receiving into it).
    spare: Recycler,
    /// A protocol error ended the stream: every later read says so.
    broken: Option<String>,
}

impl FrameReader {
    pub(crate) fn new(stream: TcpStream, limit: usize, spin: Duration) -> Self {
        FrameReader {
            stream,
            limit,
            policy: SpinPolicy::new(spin),
            ahead: Vec::with_capacity(READ_AHEAD),
            at: 0,
            large: None,
            spare: Recycler::default(),
            broken: None,
        }
    }

    /// Whether the next frame is whole in the buffer (the next read takes it without a
    /// system call).
    fn has_whole_frame(&self) -> bool {
        let buffered = &self.ahead[self.at..];
        self.large.is_none()
            && buffered.len() >= HEADER
            && (buffered.len() - HEADER) as u64
                >= u64::from_le_bytes(buffered[..8].try_into().expect("8 bytes"))
    }

    /// Where large frames return their memory when their value is dropped.
    pub(crate) fn recycler(&self) -> Recycler {
        self.spare.clone()
    }

    /// One non-blocking receive appended to `buf` (within its capacity): `Ok(true)` when
    /// bytes came, `Ok(false)` when none were there.
    fn receive(stream: &TcpStream, buf: &mut Vec<u8>) -> Result<bool, ChanError> {
        loop {
            return match rustix::io::read(stream, rustix::buffer::spare_capacity(buf)) {
                Ok(0) => Err(ChanError::Closed),
                Ok(_) => Ok(true),
                Err(rustix::io::Errno::AGAIN) => Ok(false),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => Err(io_error(e.into())),
            };
        }
    }

    /// One non-blocking receive into `buf`: how many bytes came (0: none were there).
    fn receive_into(stream: &TcpStream, buf: &mut [u8]) -> Result<usize, ChanError> {
        loop {
            return match rustix::io::read(stream, &mut *buf) {
                Ok(0) => Err(ChanError::Closed),
                Ok(n) => Ok(n),
                Err(rustix::io::Errno::AGAIN) => Ok(0),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => Err(io_error(e.into())),
            };
        }
    }

    /// A frame whole in the buffer, or the start of a large one moved to its own memory.
    fn parse(&mut self) -> Result<Option<(u8, Vec<u8>)>, ChanError> {
        let buffered = &self.ahead[self.at..];
        if buffered.len() < HEADER {
            return Ok(None);
        }
        let len = u64::from_le_bytes(buffered[..8].try_into().expect("8 bytes"));
        let tag = buffered[8];
        if len > self.limit as u64 || (tag != TAG_VALUE && tag != TAG_ERROR) {
            let why = format!(
                "the peer sent a frame header of {len} bytes with tag {tag} (the ceiling is {} bytes): not an adag channel, or a corrupt stream",
                self.limit
            );
            self.broken = Some(why.clone());
            shut(&self.stream);
            return Err(ChanError::Codec(why));
        }
        let len = len as usize;
        let body = &buffered[HEADER..];
        if body.len() >= len {
            let frame = body[..len].to_vec();
            self.at += HEADER + len;
            return Ok(Some((tag, frame)));
        }
        if HEADER + len > READ_AHEAD {
            let large = match self.spare.take(len) {
                Some(mut buf) => {
                    buf[..body.len()].copy_from_slice(body);
                    Large::Reused {
                        tag,
                        filled: body.len(),
                        buf,
                    }
                }
                None => {
                    let mut buf = Vec::with_capacity(len);
                    if buf.capacity() != len {
                        // Spare-capacity receives end at the capacity: it must be the length.
                        buf = vec![0u8; len];
                        buf[..body.len()].copy_from_slice(body);
                        Large::Reused {
                            tag,
                            filled: body.len(),
                            buf,
                        }
                    } else {
                        buf.extend_from_slice(body);
                        Large::Fresh { tag, buf }
                    }
                }
            };
            self.at = 0;
            self.ahead.clear();
            self.large = Some(large);
        }
        Ok(None)
    }

    /// One step towards the next frame: parse what is buffered, else receive once.
    fn advance(&mut self) -> Result<Progress, ChanError> {
        if let Some(large) = &mut self.large {
            let (got, whole) = match large {
                Large::Fresh { buf, .. } => {
                    let got = Self::receive(&self.stream, buf)?;
                    (got, buf.len() == buf.capacity())
                }
                Large::Reused { buf, filled, .. } => {
                    let got = Self::receive_into(&self.stream, &mut buf[*filled..])?;
                    *filled += got;
                    (got > 0, *filled == buf.len())
                }
            };
            if whole {
                let (Large::Fresh { tag, buf } | Large::Reused { tag, buf, .. }) =
                    self.large.take().expect("a large frame");
                return Ok(Progress::Frame(tag, buf));
            }
            return Ok(if got { Progress::Some } else { Progress::None });
        }
        if let Some((tag, frame)) = self.parse()? {
            return Ok(Progress::Frame(tag, frame));
        }
        if self.large.is_some() {
            return Ok(Progress::Some);
        }
        // Keep the unconsumed bytes at the front, then receive after them.
        if self.at > 0 {
            self.ahead.drain(..self.at);
            self.at = 0;
        }
        Ok(if Self::receive(&self.stream, &mut self.ahead)? {
            Progress::Some
        } else {
            Progress::None
        })
    }

    /// The next whole frame and its tag, waiting until `deadline`: receives while bytes
    /// come, then spins and yields (the channels' wait strategy), then sleeps in `poll`.
    pub(crate) fn next(&mut self, deadline: Option<Instant>) -> Result<(u8, Vec<u8>), ChanError> {
        if let Some(why) = &self.broken {
            return Err(ChanError::Codec(why.clone()));
        }
        loop {
            match self.advance()? {
                Progress::Frame(tag, frame) => return Ok((tag, frame)),
                Progress::Some => continue,
                Progress::None => {}
            }
            let mut policy = self.policy.clone();
            let mut done = None;
            let ready = policy.idle(|| {
                Ok::<_, ChanError>(match self.advance()? {
                    Progress::Frame(tag, frame) => {
                        done = Some((tag, frame));
                        true
                    }
                    Progress::Some => true,
                    Progress::None => false,
                })
            })?;
            self.policy = policy;
            if let Some(frame) = done {
                return Ok(frame);
            }
            if !ready {
                wait_ready(&self.stream, PollFlags::IN, deadline)?;
            }
        }
    }
}

/// A large frame being received into memory of its own.
enum Large {
    /// Fresh memory, filled through its spare capacity (its capacity is the frame's length).
    Fresh { tag: u8, buf: Vec<u8> },
    /// Recycled memory, cut to the frame's length, `filled` bytes of it received.
    Reused {
        tag: u8,
        buf: Vec<u8>,
        filled: usize,
    },
}

/// What one step of a [`FrameReader`] achieved.
enum Progress {
    Frame(u8, Vec<u8>),
    /// Bytes came (or were parsed), but no whole frame yet.
    Some,
    None,
}

/// One reader's end of a network channel (the only reader on its host), for values of `T`.
pub(crate) struct NetRx<T> {
    frames: FrameReader,
    _t: PhantomData<fn() -> T>,
}

impl<T> NetRx<T> {
    pub(crate) fn new(stream: TcpStream, limit: usize, spin: Duration) -> Self {
        NetRx {
            frames: FrameReader::new(stream, limit, spin),
            _t: PhantomData,
        }
    }
}

impl<T: DeserializeOwned> ChannelReader<T> for NetRx<T> {
    fn next_is_here(&self) -> bool {
        self.frames.has_whole_frame()
    }

    fn read(&mut self, deadline: Option<Instant>) -> Result<Msg<T>, ChanError> {
        let (tag, frame) = self.frames.next(deadline)?;
        let frame = if frame.len() + HEADER > READ_AHEAD {
            self.frames.recycler().wrap(frame)
        } else {
            Bytes::from(frame)
        };
        let keep = || frame.clone();
        let decoded = match tag {
            TAG_VALUE => {
                frame::decode::<T>(&frame, frame.len(), keep, &frame::Copied).map(Msg::Value)
            }
            _ => frame::decode::<TaskError>(&frame, frame.len(), keep, &frame::Copied)
                .map(|e| Msg::Error(Arc::new(e))),
        };
        decoded.map_err(|e| {
            ChanError::Codec(format!(
                "cannot decode a {} from {} bytes received over the network: {e}; the writer and reader disagree on the type (a different binary on another host?)",
                std::any::type_name::<T>(),
                frame.len()
            ))
        })
    }
}

/// Moves every frame of `stream` into the shared-memory ring of `shm` (the readers of one
/// host), straight into its slots, until the stream or the ring closes; then closes the ring
/// (dropping its writer), so that its readers see the close.
pub(crate) fn relay(stream: TcpStream, mut shm: ShmWriter, limit: usize) -> Result<(), ChanError> {
    // The relay has the connection to itself: it waits in blocking reads.
    let _ = stream.set_nonblocking(false);
    let mut stream = stream;
    loop {
        let mut header = [0u8; HEADER];
        stream.read_exact(&mut header).map_err(io_error)?;
        let len = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
        let tag = header[8];
        if len > limit as u64 || (tag != TAG_VALUE && tag != TAG_ERROR) {
            shut(&stream);
            return Err(ChanError::Codec(format!(
                "the peer sent a frame header of {len} bytes with tag {tag} (the ceiling is {limit} bytes)"
            )));
        }
        let len = len as usize;
        let mut failed: Option<io::Error> = None;
        let written = shm.write_framed(
            tag,
            &mut |buf: &mut [u8]| {
                if buf.len() < len {
                    return Err(len);
                }
                match stream.read_exact(&mut buf[..len]) {
                    Ok(()) => Ok(len),
                    Err(e) => {
                        failed = Some(e);
                        Err(usize::MAX)
                    }
                }
            },
            None,
        );
        if let Some(e) = failed {
            return Err(io_error(e));
        }
        written?;
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::Buffer;
    use std::io::Write;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        prepare(&a).unwrap();
        prepare(&b).unwrap();
        (a, b)
    }

    const LIMIT: usize = 256 << 20;
    const WAIT: Duration = Duration::from_secs(30);

    fn soon() -> Option<Instant> {
        Some(Instant::now() + WAIT)
    }

    #[test]
    fn values_errors_and_large_buffers_cross_in_order() {
        let (a, b) = pair();
        let mut tx = NetTx::<(u64, Buffer)>::new(a, LIMIT);
        let mut rx = NetRx::<(u64, Buffer)>::new(b, LIMIT, Duration::from_micros(50));
        let sizes = [0usize, 10, 70_000, 3 << 20];
        let writer = std::thread::spawn(move || {
            for (i, n) in sizes.iter().enumerate() {
                let data: Vec<u8> = (0..*n).map(|k| (k * 7 + i) as u8).collect();
                tx.write(Msg::Value((i as u64, Buffer::from(data))), soon())
                    .unwrap();
            }
            let err = Arc::new(TaskError::new("a", "f", "boom"));
            tx.write(Msg::Error(err), soon()).unwrap();
            tx
        });
        for (i, n) in sizes.iter().enumerate() {
            match rx.read(soon()).unwrap() {
                Msg::Value((k, buf)) => {
                    assert_eq!(k, i as u64);
                    assert_eq!(buf.len(), *n);
                    assert!(buf.iter().enumerate().all(|(j, b)| *b == (j * 7 + i) as u8));
                }
                Msg::Error(e) => panic!("{e:?}"),
            }
        }
        match rx.read(soon()).unwrap() {
            Msg::Error(e) => assert_eq!(e.message, "boom"),
            Msg::Value(_) => panic!("expected the error frame"),
        }
        let tx = writer.join().unwrap();
        drop(tx);
        assert_eq!(rx.read(soon()).unwrap_err(), ChanError::Closed);
    }

    #[test]
    fn a_read_that_times_out_mid_frame_resumes_where_it_stopped() {
        let (mut a, b) = pair();
        let mut rx = NetRx::<Vec<u8>>::new(b, LIMIT, Duration::from_micros(10));
        // One frame as a writer sends it, delivered in three pieces.
        let g = frame::encode_gathered(&vec![9u8; 100]).unwrap();
        assert!(g.attachments.is_empty());
        let mut bytes = vec![0u8; HEADER];
        bytes[..8].copy_from_slice(&(g.total as u64).to_le_bytes());
        bytes.extend_from_slice(&g.head);
        a.set_nonblocking(false).unwrap();
        let short = || Some(Instant::now() + Duration::from_millis(20));
        a.write_all(&bytes[..5]).unwrap();
        assert_eq!(rx.read(short()).unwrap_err(), ChanError::Timeout);
        a.write_all(&bytes[5..30]).unwrap();
        assert_eq!(rx.read(short()).unwrap_err(), ChanError::Timeout);
        a.write_all(&bytes[30..]).unwrap();
        match rx.read(soon()).unwrap() {
            Msg::Value(v) => assert_eq!(v, vec![9u8; 100]),
            Msg::Error(e) => panic!("{e:?}"),
        }
    }

    #[test]
    fn shutting_the_connection_wakes_a_blocked_reader() {
        let (a, b) = pair();
        let closer = b.try_clone().unwrap();
        let mut rx = NetRx::<u64>::new(b, LIMIT, Duration::ZERO);
        let t = std::thread::spawn(move || rx.read(None));
        std::thread::sleep(Duration::from_millis(50));
        shut(&closer);
        assert_eq!(t.join().unwrap().unwrap_err(), ChanError::Closed);
        drop(a);
    }

    #[test]
    fn an_oversized_or_foreign_header_is_a_typed_error_without_allocating() {
        for header in [
            {
                let mut h = [0u8; HEADER];
                h[..8].copy_from_slice(&u64::MAX.to_le_bytes());
                h
            },
            *b"GET / HTTP/1.1\r\n",
        ] {
            let (mut a, b) = pair();
            a.set_nonblocking(false).unwrap();
            a.write_all(&header).unwrap();
            let mut rx = NetRx::<u64>::new(b, 1 << 20, Duration::ZERO);
            assert!(matches!(rx.read(soon()), Err(ChanError::Codec(_))));
            assert!(matches!(rx.read(soon()), Err(ChanError::Codec(_))));
        }
    }

    /// A writer holding under `holding`, and its reader.
    fn holding_pair(holding: &Arc<Holding>) -> (NetTx<Vec<u8>>, NetRx<Vec<u8>>) {
        let (a, b) = pair();
        let mut tx = NetTx::<Vec<u8>>::new(a, LIMIT);
        tx.hold_in(holding);
        (tx, NetRx::new(b, LIMIT, Duration::from_micros(50)))
    }

    fn value(rx: &mut NetRx<Vec<u8>>, deadline: Option<Instant>) -> Result<Vec<u8>, ChanError> {
        match rx.read(deadline)? {
            Msg::Value(v) => Ok(v),
            Msg::Error(e) => panic!("{e:?}"),
        }
    }

    /// Small frames written while the actor has its next input at hand stay held until the
    /// actor releases them (before a wait), then arrive together, in order; a write once the
    /// actor stops holding, and a frame too large to hold, send what is held first.
    #[test]
    fn held_frames_leave_in_order_on_release_or_with_the_next_sent_frame() {
        let lasting = Duration::from_secs(3600);
        let holding = Arc::new(Holding::lasting(lasting, lasting));
        let (mut tx, mut rx) = holding_pair(&holding);
        holding.note_read(true);
        for i in 0..5u8 {
            tx.write(Msg::Value(vec![i; 3]), soon()).unwrap();
        }
        assert_eq!(holding.held(), 5);
        let briefly = || Some(Instant::now() + Duration::from_millis(50));
        assert_eq!(value(&mut rx, briefly()), Err(ChanError::Timeout));
        holding.release().unwrap();
        assert_eq!(holding.held(), 0);
        for i in 0..5u8 {
            assert_eq!(value(&mut rx, soon()).unwrap(), vec![i; 3]);
        }
        // Held, then a write after a read that found nothing at hand: both, in order.
        tx.write(Msg::Value(vec![5]), soon()).unwrap();
        assert_eq!(holding.held(), 1);
        holding.note_read(false);
        tx.write(Msg::Value(vec![6]), soon()).unwrap();
        assert_eq!(holding.held(), 0);
        assert_eq!(value(&mut rx, soon()).unwrap(), vec![5]);
        assert_eq!(value(&mut rx, soon()).unwrap(), vec![6]);
        // Held, then a frame over the size held back: both, in order, while still holding.
        holding.note_read(true);
        tx.write(Msg::Value(vec![7]), soon()).unwrap();
        let large = vec![8u8; HOLD_FRAME + 1];
        tx.write(Msg::Value(large.clone()), soon()).unwrap();
        assert_eq!(holding.held(), 0);
        assert_eq!(value(&mut rx, soon()).unwrap(), vec![7]);
        assert_eq!(value(&mut rx, soon()).unwrap(), large);
        // Errors are held and sent in their place like values.
        tx.write(
            Msg::Error(Arc::new(TaskError::new("a", "f", "held"))),
            soon(),
        )
        .unwrap();
        tx.write(Msg::Value(vec![9]), soon()).unwrap();
        assert_eq!(holding.held(), 2);
        holding.release().unwrap();
        match rx.read(soon()).unwrap() {
            Msg::Error(e) => assert_eq!(e.message, "held"),
            Msg::Value(v) => panic!("expected the error frame, got {v:?}"),
        }
        assert_eq!(value(&mut rx, soon()).unwrap(), vec![9]);
    }

    /// Frames held longer than the bound leave: at the next write, or through the flusher
    /// thread while the actor writes nothing (a long method call); the flusher ends with its
    /// holding.
    #[test]
    fn old_held_frames_leave_by_the_next_write_or_the_flusher() {
        let at_once = Arc::new(Holding::lasting(Duration::ZERO, Duration::from_secs(3600)));
        let (mut tx, mut rx) = holding_pair(&at_once);
        at_once.note_read(true);
        tx.write(Msg::Value(vec![1]), soon()).unwrap();
        tx.write(Msg::Value(vec![2]), soon()).unwrap();
        assert_eq!(at_once.held(), 0);
        assert_eq!(value(&mut rx, soon()).unwrap(), vec![1]);
        assert_eq!(value(&mut rx, soon()).unwrap(), vec![2]);

        let flushed = Arc::new(Holding::lasting(
            Duration::from_secs(3600),
            Duration::from_millis(1),
        ));
        let (mut tx, mut rx) = holding_pair(&flushed);
        flushed.note_read(true);
        for round in 0..3u8 {
            tx.write(Msg::Value(vec![round; 10]), soon()).unwrap();
            // Nobody releases: the flusher sends it.
            assert_eq!(value(&mut rx, soon()).unwrap(), vec![round; 10]);
            // Long enough for the flusher to fall asleep between the rounds.
            std::thread::sleep(Duration::from_millis(30));
        }
        assert_eq!(flushed.held(), 0);
        let flusher = Arc::downgrade(&flushed);
        drop((tx, flushed));
        assert!(
            flusher.upgrade().is_none(),
            "the holding outlived its writers"
        );
    }

    proptest::proptest! {
        /// Random bytes from the network: a typed error or a value, never a panic.
        #[test]
        fn random_bytes_are_typed_errors(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let (mut a, b) = pair();
            a.set_nonblocking(false).unwrap();
            a.write_all(&bytes).unwrap();
            drop(a);
            let mut rx = NetRx::<(u64, Buffer, String)>::new(b, 1 << 16, Duration::ZERO);
            for _ in 0..4 {
                if rx.read(soon()).is_err() {
                    break;
                }
            }
        }
    }
}
