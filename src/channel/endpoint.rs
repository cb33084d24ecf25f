//! Typed endpoints of an edge. A writer fans one value out to every reader group of its
//! edge: readers in the writer's process get it through an in-memory ring without
//! serialization (moved to the last reader, cloned for the others); readers in other
//! processes share one shared-memory ring, encoded once with postcard.
use super::oob;
use super::shm::{RingError, ShmChannel, ShmReader, ShmWriter};
use crate::compile::plan::{GraphPlan, Loc};
use crate::value::Value;
use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use std::time::Instant;

/// A failed task, carried in place of a value to every downstream reader.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct TaskError {
    pub actor: String,
    pub method: String,
    pub message: String,
}

impl From<&TaskError> for crate::Error {
    fn from(e: &TaskError) -> Self {
        crate::Error::Task {
            actor: e.actor.clone(),
            method: e.method.clone(),
            message: e.message.clone(),
        }
    }
}

/// What one slot of a channel carries.
#[derive(Debug, Clone)]
pub(crate) enum Msg<T> {
    Value(T),
    Error(Arc<TaskError>),
}

/// Why a channel operation did not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ChanError {
    /// The channel was closed (teardown, a peer left or died).
    Closed,
    /// The deadline passed.
    Timeout,
    /// The message exceeds the channel's ceiling.
    TooLarge { size: usize, limit: usize },
    /// Encoding or decoding failed.
    Codec(String),
}

impl From<RingError> for ChanError {
    fn from(e: RingError) -> Self {
        match e {
            RingError::Closed => ChanError::Closed,
            RingError::Timeout => ChanError::Timeout,
            RingError::TooLarge { size, limit } => ChanError::TooLarge { size, limit },
            other => ChanError::Codec(other.to_string()),
        }
    }
}

const TAG_VALUE: u8 = 0;
const TAG_ERROR: u8 = 1;

/// Encode `value` as a frame straight into a slot of `shm` (large byte strings out of band),
/// growing the channel when the slot is too small, and telling that apart from a value that
/// cannot be encoded at all.
fn write_encoded<T: Serialize>(
    shm: &mut ShmWriter,
    tag: u8,
    value: &T,
    deadline: Option<Instant>,
) -> Result<(), ChanError> {
    let mut failure: Option<String> = None;
    let written = shm.write(
        tag,
        &mut |buf: &mut [u8]| match oob::encode(value, buf) {
            Ok(len) => Ok(len),
            Err(oob::EncodeError::TooSmall(needed)) => Err(needed),
            Err(oob::EncodeError::Failed(e)) => {
                failure = Some(e.to_string());
                // Over any ceiling: the writer gives up at once, without growing.
                Err(usize::MAX)
            }
        },
        deadline,
    );
    if let Some(e) = failure {
        return Err(ChanError::Codec(format!(
            "cannot encode a value of type {}: {e}",
            std::any::type_name::<T>()
        )));
    }
    Ok(written?)
}

/// The writing end of an edge.
pub(crate) struct EdgeWriter<T> {
    local: Vec<Sender<Msg<T>>>,
    closed: Arc<AtomicBool>,
    shm: Option<ShmWriter>,
}

impl<T: Value> EdgeWriter<T> {
    /// Write a value the caller keeps: encoded by reference when no reader in this process
    /// needs its own copy (no clone of a large input for shared-memory readers).
    pub(crate) fn write_ref(
        &mut self,
        value: &T,
        deadline: Option<Instant>,
    ) -> Result<(), ChanError> {
        if !self.local.is_empty() {
            return self.write(Msg::Value(value.clone()), deadline);
        }
        match &mut self.shm {
            Some(shm) => write_encoded(shm, TAG_VALUE, value, deadline),
            None => Ok(()),
        }
    }

    pub(crate) fn write(
        &mut self,
        msg: Msg<T>,
        deadline: Option<Instant>,
    ) -> Result<(), ChanError> {
        if let Some(shm) = &mut self.shm {
            // Encoded straight into the slot: no allocation per message.
            match &msg {
                Msg::Value(v) => write_encoded(shm, TAG_VALUE, v, deadline)?,
                Msg::Error(e) => write_encoded(shm, TAG_ERROR, &**e, deadline)?,
            }
        }
        let Some((last, rest)) = self.local.split_last() else {
            return Ok(());
        };
        for sender in rest {
            send(sender, &self.closed, msg.clone(), deadline)?;
        }
        send(last, &self.closed, msg, deadline)
    }
}

/// How often a thread blocked on an in-memory channel looks at the graph's closed flag.
/// Data wakes it at once; only teardown waits for this tick.
const CLOSE_POLL: Duration = Duration::from_millis(20);

fn poll_deadline(deadline: Option<Instant>) -> Instant {
    let tick = Instant::now() + CLOSE_POLL;
    deadline.map_or(tick, |d| d.min(tick))
}

fn send<T>(
    sender: &Sender<Msg<T>>,
    closed: &AtomicBool,
    mut msg: Msg<T>,
    deadline: Option<Instant>,
) -> Result<(), ChanError> {
    loop {
        if closed.load(Ordering::Acquire) {
            return Err(ChanError::Closed);
        }
        match sender.send_deadline(msg, poll_deadline(deadline)) {
            Ok(()) => return Ok(()),
            Err(SendTimeoutError::Disconnected(_)) => return Err(ChanError::Closed),
            Err(SendTimeoutError::Timeout(m)) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(ChanError::Timeout);
                }
                msg = m;
            }
        }
    }
}

/// How long a reader of an in-memory channel spins (then yields) before it parks: a parked
/// thread woken from the other core costs ~80 µs here, a spin hand-off well under 1 µs.
const LOCAL_SPIN: Duration = Duration::from_micros(50);

fn recv<T>(
    rx: &Receiver<Msg<T>>,
    closed: &AtomicBool,
    deadline: Option<Instant>,
) -> Result<Msg<T>, ChanError> {
    let backoff = crossbeam_utils::Backoff::new();
    let mut spin_start: Option<Instant> = None;
    loop {
        match rx.try_recv() {
            Ok(m) => return Ok(m),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(ChanError::Closed),
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        if !backoff.is_completed() {
            backoff.snooze();
            continue;
        }
        let start = *spin_start.get_or_insert_with(Instant::now);
        if start.elapsed() >= LOCAL_SPIN || closed.load(Ordering::Acquire) {
            break;
        }
        std::thread::yield_now();
    }
    loop {
        if closed.load(Ordering::Acquire) {
            return Err(ChanError::Closed);
        }
        match rx.recv_deadline(poll_deadline(deadline)) {
            Ok(m) => return Ok(m),
            Err(RecvTimeoutError::Disconnected) => return Err(ChanError::Closed),
            Err(RecvTimeoutError::Timeout) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(ChanError::Timeout);
                }
            }
        }
    }
}

/// The reading end of an edge for one reader.
pub(crate) enum EdgeReader<T> {
    Local(Receiver<Msg<T>>, Arc<AtomicBool>),
    Shm(ShmReader, std::marker::PhantomData<fn() -> T>),
}

impl<T: Value> EdgeReader<T> {
    pub(crate) fn read(&mut self, deadline: Option<Instant>) -> Result<Msg<T>, ChanError> {
        match self {
            EdgeReader::Local(rx, closed) => recv(rx, closed, deadline),
            EdgeReader::Shm(reader, _) => {
                let frame = reader.read(deadline)?;
                let decoded = match frame.tag {
                    TAG_VALUE => oob::decode::<T>(&frame).map(Msg::Value),
                    _ => oob::decode::<TaskError>(&frame).map(|e| Msg::Error(Arc::new(e))),
                };
                decoded.map_err(|e| {
                    ChanError::Codec(format!(
                        "cannot decode a {} from {} bytes: {e}; the writer and reader disagree on the type (a stale worker binary?)",
                        std::any::type_name::<T>(),
                        frame.data().len()
                    ))
                })
            }
        }
    }
}

/// The in-memory channels of one graph in one process, created on first use by whichever
/// end (writer or reader) asks first, since only the typed ends know the value type.
#[derive(Default)]
pub(crate) struct LocalHub {
    chans: Mutex<HashMap<u64, Box<dyn Any + Send>>>,
}

struct LocalChan<T> {
    senders: Option<Vec<Sender<Msg<T>>>>,
    receivers: Vec<Option<Receiver<Msg<T>>>>,
}

impl LocalHub {
    fn with<T: Value, R>(
        &self,
        edge: u64,
        readers: usize,
        depth: usize,
        f: impl FnOnce(&mut LocalChan<T>) -> R,
    ) -> Option<R> {
        let mut chans = self.chans.lock();
        let entry = chans.entry(edge).or_insert_with(|| {
            let (senders, receivers) = (0..readers)
                .map(|_| {
                    let (s, r) = crossbeam_channel::bounded::<Msg<T>>(depth);
                    (s, Some(r))
                })
                .unzip();
            Box::new(LocalChan::<T> {
                senders: Some(senders),
                receivers,
            })
        });
        entry.downcast_mut::<LocalChan<T>>().map(f)
    }

    pub(crate) fn senders<T: Value>(
        &self,
        edge: u64,
        readers: usize,
        depth: usize,
    ) -> Option<Vec<Sender<Msg<T>>>> {
        self.with::<T, _>(edge, readers, depth, |c| c.senders.take())
            .flatten()
    }

    pub(crate) fn receiver<T: Value>(
        &self,
        edge: u64,
        index: usize,
        readers: usize,
        depth: usize,
    ) -> Option<Receiver<Msg<T>>> {
        self.with::<T, _>(edge, readers, depth, |c| {
            c.receivers.get_mut(index).and_then(Option::take)
        })
        .flatten()
    }

    /// Drop every end nobody took (a reader or writer that failed to install), so that
    /// the others see the channel closed instead of waiting for ever.
    pub(crate) fn clear(&self) {
        self.chans.lock().clear();
    }
}

/// Where an edge's endpoints are found in this process.
pub(crate) struct ProcChannels {
    pub(crate) local: LocalHub,
    pub(crate) shm: HashMap<u64, ShmChannel>,
    pub(crate) closed: Arc<AtomicBool>,
}

impl ProcChannels {
    pub(crate) fn new(shm: HashMap<u64, ShmChannel>) -> Self {
        ProcChannels {
            local: LocalHub::default(),
            shm,
            closed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The writing end of `edge` for the endpoint `me`.
    pub(crate) fn writer<T: Value>(
        &self,
        plan: &GraphPlan,
        edge: u64,
        me: Loc,
    ) -> Result<EdgeWriter<T>, String> {
        let e = plan.edge(edge)?;
        if e.writer != me {
            return Err(format!("{me:?} does not write edge {}", e.label));
        }
        self.local_writer::<T>(
            edge,
            e.local_readers.len(),
            e.shm.as_ref().map(|s| s.chan),
            plan.depth,
        )
    }

    /// The reading end of `edge` for the endpoint `me`.
    pub(crate) fn reader<T: Value>(
        &self,
        plan: &GraphPlan,
        edge: u64,
        me: Loc,
    ) -> Result<EdgeReader<T>, String> {
        let e = plan.edge(edge)?;
        if let Some(k) = e.local_readers.iter().position(|l| *l == me) {
            return self.local_reader::<T>(edge, k, e.local_readers.len(), plan.depth);
        }
        if let Some(shm) = &e.shm
            && let Some(k) = shm.readers.iter().position(|l| *l == me)
        {
            return self.shm_reader::<T>(edge, shm.chan, k);
        }
        Err(format!("{me:?} does not read edge {}", e.label))
    }

    pub(crate) fn local_writer<T: Value>(
        &self,
        edge: u64,
        local_readers: usize,
        shm_chan: Option<u64>,
        depth: usize,
    ) -> Result<EdgeWriter<T>, String> {
        let local = if local_readers == 0 {
            Vec::new()
        } else {
            self.local
                .senders::<T>(edge, local_readers, depth)
                .ok_or_else(|| format!("edge {edge}: writer already taken or type mismatch"))?
        };
        let shm = match shm_chan {
            None => None,
            Some(chan) => Some(
                self.shm
                    .get(&chan)
                    .ok_or_else(|| {
                        format!("edge {edge}: shared-memory channel {chan} is not mapped here")
                    })?
                    .writer(),
            ),
        };
        Ok(EdgeWriter {
            local,
            closed: self.closed.clone(),
            shm,
        })
    }

    pub(crate) fn local_reader<T: Value>(
        &self,
        edge: u64,
        index: usize,
        readers: usize,
        depth: usize,
    ) -> Result<EdgeReader<T>, String> {
        self.local
            .receiver::<T>(edge, index, readers, depth)
            .map(|rx| EdgeReader::Local(rx, self.closed.clone()))
            .ok_or_else(|| format!("edge {edge}: reader {index} already taken or type mismatch"))
    }

    pub(crate) fn shm_reader<T: Value>(
        &self,
        edge: u64,
        chan: u64,
        index: usize,
    ) -> Result<EdgeReader<T>, String> {
        let ch = self.shm.get(&chan).ok_or_else(|| {
            format!("edge {edge}: shared-memory channel {chan} is not mapped here")
        })?;
        Ok(EdgeReader::Shm(
            ch.reader(index as u32),
            std::marker::PhantomData,
        ))
    }

    /// Close every shared-memory channel mapped here (teardown, death of a peer).
    pub(crate) fn close_all(&self) {
        self.closed.store(true, Ordering::Release);
        for ch in self.shm.values() {
            ch.close();
        }
        self.local.clear();
    }
}
