//! Typed endpoints of an edge. A writer fans one value out to every reader group of its
//! edge: readers in the writer's process get it through an in-memory channel without
//! serialization (moved to the last reader, cloned for the others); readers in other
//! processes share one shared-memory ring, encoded once with postcard.
//!
//! In-memory channels are crossbeam's bounded queues, polled without blocking; their ends
//! wait with the same adaptive spin → yield → futex wait as the shared-memory ring
//! ([`WaitCell`]), so that a chain of thread actors hands values on as fast as a chain of
//! processes, and teardown wakes every sleeper at once.
use super::oob;
use super::shm::{RingError, ShmChannel, ShmReader, ShmWriter};
use super::wait::{DEFAULT_SPIN, SpinPolicy, WaitCell};
use crate::compile::plan::{GraphPlan, Loc};
use crate::value::Value;
use crossbeam_channel::{Receiver, Sender, TryRecvError, TrySendError};
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

/// The wait cells of one in-memory channel (one writer, one reader): the reader sleeps on
/// `data`, a writer facing a full channel on `space`.
#[derive(Debug, Default)]
pub(crate) struct LocalWaits {
    data: WaitCell,
    space: WaitCell,
}

impl LocalWaits {
    /// Wakes both ends (teardown: they see the closed flag).
    fn wake_all(&self) {
        self.data.wake();
        self.space.wake();
    }
}

/// The writing end of one in-memory channel.
pub(crate) struct LocalTx<T> {
    tx: Sender<Msg<T>>,
    waits: Arc<LocalWaits>,
    policy: SpinPolicy,
}

impl<T> Drop for LocalTx<T> {
    fn drop(&mut self) {
        // The reader may be asleep: it must see the channel disconnected now.
        self.waits.data.wake();
    }
}

/// The reading end of one in-memory channel.
pub(crate) struct LocalRx<T> {
    rx: Receiver<Msg<T>>,
    waits: Arc<LocalWaits>,
    policy: SpinPolicy,
}

impl<T> Drop for LocalRx<T> {
    fn drop(&mut self) {
        self.waits.space.wake();
    }
}

/// The writing end of an edge.
pub(crate) struct EdgeWriter<T> {
    local: Vec<LocalTx<T>>,
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
        let Some((last, rest)) = self.local.split_last_mut() else {
            return Ok(());
        };
        for tx in rest {
            send(tx, &self.closed, msg.clone(), deadline)?;
        }
        send(last, &self.closed, msg, deadline)
    }
}

fn send<T>(
    end: &mut LocalTx<T>,
    closed: &AtomicBool,
    msg: Msg<T>,
    deadline: Option<Instant>,
) -> Result<(), ChanError> {
    let LocalTx { tx, waits, policy } = end;
    let mut pending = Some(msg);
    let sent = waits.space.wait(policy, deadline, || {
        if closed.load(Ordering::Acquire) {
            return Some(Err(ChanError::Closed));
        }
        let msg = pending.take()?;
        match tx.try_send(msg) {
            Ok(()) => Some(Ok(())),
            Err(TrySendError::Full(msg)) => {
                pending = Some(msg);
                None
            }
            Err(TrySendError::Disconnected(_)) => Some(Err(ChanError::Closed)),
        }
    });
    match sent {
        Some(Ok(())) => {
            waits.data.notify();
            Ok(())
        }
        Some(Err(err)) => Err(err),
        None => Err(ChanError::Timeout),
    }
}

fn recv<T>(
    end: &mut LocalRx<T>,
    closed: &AtomicBool,
    deadline: Option<Instant>,
) -> Result<Msg<T>, ChanError> {
    let LocalRx { rx, waits, policy } = end;
    // What was sent before a close is still delivered; then the close.
    let got = waits.data.wait(policy, deadline, || match rx.try_recv() {
        Ok(msg) => Some(Ok(msg)),
        Err(TryRecvError::Empty) => closed
            .load(Ordering::Acquire)
            .then_some(Err(ChanError::Closed)),
        Err(TryRecvError::Disconnected) => Some(Err(ChanError::Closed)),
    });
    match got {
        Some(Ok(msg)) => {
            waits.space.notify();
            Ok(msg)
        }
        Some(Err(err)) => Err(err),
        None => Err(ChanError::Timeout),
    }
}

/// The reading end of an edge for one reader.
pub(crate) enum EdgeReader<T> {
    Local(LocalRx<T>, Arc<AtomicBool>),
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
    /// The wait cells of every channel made here, for teardown to wake.
    waits: Mutex<Vec<Arc<LocalWaits>>>,
}

type LocalEnd<E> = (E, Arc<LocalWaits>);

struct LocalChan<T> {
    senders: Option<Vec<LocalEnd<Sender<Msg<T>>>>>,
    receivers: Vec<Option<LocalEnd<Receiver<Msg<T>>>>>,
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
                    let waits = Arc::new(LocalWaits::default());
                    self.waits.lock().push(waits.clone());
                    ((s, waits.clone()), Some((r, waits)))
                })
                .unzip();
            Box::new(LocalChan::<T> {
                senders: Some(senders),
                receivers,
            })
        });
        entry.downcast_mut::<LocalChan<T>>().map(f)
    }

    fn senders<T: Value>(
        &self,
        edge: u64,
        readers: usize,
        depth: usize,
    ) -> Option<Vec<LocalEnd<Sender<Msg<T>>>>> {
        self.with::<T, _>(edge, readers, depth, |c| c.senders.take())
            .flatten()
    }

    fn receiver<T: Value>(
        &self,
        edge: u64,
        index: usize,
        readers: usize,
        depth: usize,
    ) -> Option<LocalEnd<Receiver<Msg<T>>>> {
        self.with::<T, _>(edge, readers, depth, |c| {
            c.receivers.get_mut(index).and_then(Option::take)
        })
        .flatten()
    }

    /// Drop every end nobody took (a reader or writer that failed to install), so that
    /// the others see the channel closed instead of waiting for ever, and wake every end
    /// (teardown: they see the closed flag).
    pub(crate) fn clear(&self) {
        self.chans.lock().clear();
        for waits in self.waits.lock().iter() {
            waits.wake_all();
        }
    }
}

/// Where an edge's endpoints are found in this process.
pub(crate) struct ProcChannels {
    pub(crate) local: LocalHub,
    pub(crate) shm: HashMap<u64, ShmChannel>,
    pub(crate) closed: Arc<AtomicBool>,
    /// Spin budget of the in-memory channels' waits (`CompileOptions::spin`).
    spin: Duration,
}

impl ProcChannels {
    pub(crate) fn new(shm: HashMap<u64, ShmChannel>) -> Self {
        ProcChannels {
            local: LocalHub::default(),
            shm,
            closed: Arc::new(AtomicBool::new(false)),
            spin: DEFAULT_SPIN,
        }
    }

    /// Sets the spin budget of the in-memory channels' waits.
    pub(crate) fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
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
                .into_iter()
                .map(|(tx, waits)| LocalTx {
                    tx,
                    waits,
                    policy: SpinPolicy::new(self.spin),
                })
                .collect()
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
            .map(|(rx, waits)| {
                let end = LocalRx {
                    rx,
                    waits,
                    policy: SpinPolicy::new(self.spin),
                };
                EdgeReader::Local(end, self.closed.clone())
            })
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

/// Stress tests of the in-memory channels' waits: a lost wake-up leaves an end asleep until
/// the watchdog fires (the futex sleep is bounded by 100 ms slices, so a lost wake-up shows
/// as a run far slower than its sleeps; the deadlines below turn that into a failure).
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::channel::wait::watchdog::{WATCHDOG, with_watchdog};

    fn pair(depth: usize, spin: Duration) -> (Arc<ProcChannels>, EdgeWriter<u64>, EdgeReader<u64>) {
        let chans = Arc::new(ProcChannels::new(HashMap::new()).with_spin(spin));
        let writer = chans.local_writer::<u64>(1, 1, None, depth).unwrap();
        let reader = chans.local_reader::<u64>(1, 0, 1, depth).unwrap();
        (chans, writer, reader)
    }

    fn value(msg: Msg<u64>) -> u64 {
        match msg {
            Msg::Value(v) => v,
            Msg::Error(e) => panic!("unexpected task error {e:?}"),
        }
    }

    /// Both ends pause at random now and then, so that each side is often asleep (spin
    /// budget zero: straight to the futex) when the other acts; every message arrives, in
    /// order, and no wait outlives a generous deadline.
    #[test]
    fn no_wake_up_is_lost_when_both_ends_sleep() {
        with_watchdog(WATCHDOG, || {
            const MESSAGES: u64 = 5_000;
            for (depth, spin) in [(1, Duration::ZERO), (2, Duration::ZERO), (4, DEFAULT_SPIN)] {
                let (_chans, mut writer, mut reader) = pair(depth, spin);
                let consumer = std::thread::spawn(move || {
                    let mut state = 0x2545_f491_u64;
                    for expected in 0..MESSAGES {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        if state % 64 == 0 {
                            std::thread::sleep(Duration::from_micros(state % 200));
                        }
                        let deadline = Some(Instant::now() + Duration::from_secs(5));
                        assert_eq!(value(reader.read(deadline).unwrap()), expected);
                    }
                    reader
                });
                let mut state = 0x9e37_79b9_u64;
                for seq in 0..MESSAGES {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    if state % 64 == 0 {
                        std::thread::sleep(Duration::from_micros(state % 200));
                    }
                    let deadline = Some(Instant::now() + Duration::from_secs(5));
                    writer.write(Msg::Value(seq), deadline).unwrap();
                }
                drop(consumer.join().unwrap());
            }
        });
    }

    /// Teardown (`close_all`) wakes a reader asleep on an empty channel and a writer asleep
    /// on a full one; a dropped writer ends the reader.
    #[test]
    fn close_and_drop_wake_sleeping_ends() {
        with_watchdog(WATCHDOG, || {
            let (chans, writer, mut reader) = pair(1, Duration::ZERO);
            let blocked = std::thread::spawn(move || reader.read(None).map(value));
            std::thread::sleep(Duration::from_millis(30));
            chans.close_all();
            assert_eq!(blocked.join().unwrap(), Err(ChanError::Closed));
            drop(writer);

            let (chans, mut writer, reader) = pair(1, Duration::ZERO);
            writer.write(Msg::Value(1), None).unwrap();
            let blocked = std::thread::spawn(move || writer.write(Msg::Value(2), None));
            std::thread::sleep(Duration::from_millis(30));
            chans.close_all();
            assert_eq!(blocked.join().unwrap(), Err(ChanError::Closed));
            drop(reader);

            let (_chans, writer, mut reader) = pair(1, Duration::ZERO);
            let blocked = std::thread::spawn(move || reader.read(None).map(value));
            std::thread::sleep(Duration::from_millis(30));
            drop(writer);
            assert_eq!(blocked.join().unwrap(), Err(ChanError::Closed));
        });
    }
}
