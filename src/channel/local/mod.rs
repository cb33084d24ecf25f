//! The in-process kind: a reader on another thread of the writer's process gets the value
//! itself, through an in-memory queue per reader, without serialization (moved to the last
//! reader, cloned for the others by the writer's [`FanOut`](super::FanOut)).
//!
//! Queues are single-producer single-consumer rings ([`ring`]: one writer, one reader per
//! queue) whose slots carry the stamp that publishes them, polled without blocking, so a small
//! message costs the reader one cache line from the writer's core (crossbeam's bounded queue,
//! made for many producers and consumers, moved a slot's line both ways and took a locked
//! instruction per end: a thread ping-pong here took 0.68 µs through it, 0.42 µs through
//! `rtrb`, whose reader fetches the tail index's line and then the slot's). Their ends wait
//! with the same adaptive spin → yield → futex wait as the shared-memory ring ([`WaitCell`]),
//! so that a chain of thread actors hands values on as fast as a chain of processes, and a
//! close wakes every sleeper at once.
use super::wait::{DEFAULT_SPIN, SpinPolicy, WaitCell};
use super::{ChanError, ChannelReader, ChannelWriter, Msg};
use parking_lot::Mutex;
use ring::{Consumer, Producer};
use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub(crate) mod ring;

/// The wait cells of one in-memory channel (one writer, one reader): the reader sleeps on
/// `data`, a writer facing a full channel on `space`.
#[derive(Debug, Default)]
pub(crate) struct LocalWaits {
    data: WaitCell,
    space: WaitCell,
}

impl LocalWaits {
    /// Wakes both ends (a close: they see the closed flag).
    fn wake_all(&self) {
        self.data.wake();
        self.space.wake();
    }
}

/// The writing end of one in-memory channel.
pub(crate) struct LocalTx<T> {
    tx: Producer<Msg<T>>,
    waits: Arc<LocalWaits>,
    policy: SpinPolicy,
    closed: Arc<AtomicBool>,
}

impl<T> Drop for LocalTx<T> {
    fn drop(&mut self) {
        // The reader may be asleep: it must see the channel disconnected now.
        self.waits.data.wake();
    }
}

/// The reading end of one in-memory channel.
pub(crate) struct LocalRx<T> {
    rx: Consumer<Msg<T>>,
    waits: Arc<LocalWaits>,
    policy: SpinPolicy,
    closed: Arc<AtomicBool>,
}

impl<T> Drop for LocalRx<T> {
    fn drop(&mut self) {
        self.waits.space.wake();
    }
}

impl<T: Send> ChannelWriter<T> for LocalTx<T> {
    fn write(&mut self, msg: Msg<T>, deadline: Option<Instant>) -> Result<(), ChanError> {
        let LocalTx {
            tx,
            waits,
            policy,
            closed,
        } = self;
        let mut pending = Some(msg);
        let sent = waits.space.wait(policy, deadline, || {
            if closed.load(Ordering::Acquire) {
                return Some(Err(ChanError::Closed));
            }
            if tx.is_abandoned() {
                return Some(Err(ChanError::Closed));
            }
            let msg = pending.take()?;
            match tx.push(msg) {
                Ok(()) => Some(Ok(())),
                Err(msg) => {
                    pending = Some(msg);
                    None
                }
            }
        });
        match sent {
            Some(Ok(())) => {
                waits.data.notify_in_process();
                Ok(())
            }
            Some(Err(err)) => Err(err),
            None => Err(ChanError::Timeout),
        }
    }

    fn moves_values(&self) -> bool {
        true
    }
}

impl<T: Send> ChannelReader<T> for LocalRx<T> {
    fn read(&mut self, deadline: Option<Instant>) -> Result<Msg<T>, ChanError> {
        let LocalRx {
            rx,
            waits,
            policy,
            closed,
        } = self;
        // What was sent before a close is still delivered; then the close.
        let got = waits.data.wait(policy, deadline, || {
            if let Some(msg) = rx.pop() {
                return Some(Ok(msg));
            }
            if !closed.load(Ordering::Acquire) && !rx.is_abandoned() {
                return None;
            }
            // The writer may have written its last message just before it left.
            Some(rx.pop().ok_or(ChanError::Closed))
        });
        match got {
            Some(Ok(msg)) => {
                waits.space.notify_in_process();
                Ok(msg)
            }
            Some(Err(err)) => Err(err),
            None => Err(ChanError::Timeout),
        }
    }
}

/// The in-memory channels of one process, by channel id, created on first use by whichever
/// end (writer or reader) asks first, since only the typed ends know the value type. Closing
/// the hub closes every channel made here.
pub(crate) struct LocalHub {
    chans: Mutex<HashMap<u64, Box<dyn Any + Send>>>,
    /// The wait cells of every channel made here, for a close to wake.
    waits: Mutex<Vec<Arc<LocalWaits>>>,
    closed: Arc<AtomicBool>,
    /// Spin budget of the ends' waits.
    spin: Duration,
}

impl Default for LocalHub {
    fn default() -> Self {
        Self::new(DEFAULT_SPIN)
    }
}

type LocalEnd<E> = (E, Arc<LocalWaits>);

struct LocalChan<T> {
    senders: Option<Vec<LocalEnd<Producer<Msg<T>>>>>,
    receivers: Vec<Option<LocalEnd<Consumer<Msg<T>>>>>,
}

impl LocalHub {
    /// A hub whose ends spin up to `spin` before they sleep.
    pub(crate) fn new(spin: Duration) -> Self {
        LocalHub {
            chans: Mutex::new(HashMap::new()),
            waits: Mutex::new(Vec::new()),
            closed: Arc::new(AtomicBool::new(false)),
            spin,
        }
    }

    fn with<T: Send + 'static, R>(
        &self,
        chan: u64,
        readers: usize,
        depth: usize,
        f: impl FnOnce(&mut LocalChan<T>) -> R,
    ) -> Option<R> {
        let mut chans = self.chans.lock();
        let entry = chans.entry(chan).or_insert_with(|| {
            let (senders, receivers) = (0..readers)
                .map(|_| {
                    let (s, r) = ring::queue::<Msg<T>>(depth);
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

    /// The writer's ends of channel `chan` (one per reader, each `depth` deep).
    pub(crate) fn writers<T: Send + 'static>(
        &self,
        chan: u64,
        readers: usize,
        depth: usize,
    ) -> Result<Vec<LocalTx<T>>, String> {
        let ends = self
            .with::<T, _>(chan, readers, depth, |c| c.senders.take())
            .flatten()
            .ok_or_else(|| format!("channel {chan}: writer already taken or type mismatch"))?;
        Ok(ends
            .into_iter()
            .map(|(tx, waits)| LocalTx {
                tx,
                waits,
                policy: SpinPolicy::new(self.spin),
                closed: self.closed.clone(),
            })
            .collect())
    }

    /// Reader `index` of the `readers` of channel `chan`.
    pub(crate) fn reader<T: Send + 'static>(
        &self,
        chan: u64,
        index: usize,
        readers: usize,
        depth: usize,
    ) -> Result<LocalRx<T>, String> {
        self.with::<T, _>(chan, readers, depth, |c| {
            c.receivers.get_mut(index).and_then(Option::take)
        })
        .flatten()
        .map(|(rx, waits)| LocalRx {
            rx,
            waits,
            policy: SpinPolicy::new(self.spin),
            closed: self.closed.clone(),
        })
        .ok_or_else(|| format!("channel {chan}: reader {index} already taken or type mismatch"))
    }

    /// Closes every channel: drops every end nobody took (a reader or writer that failed to
    /// install), so that the others see the channel closed instead of waiting for ever, and
    /// wakes every end, which then sees the closed flag.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.chans.lock().clear();
        for waits in self.waits.lock().iter() {
            waits.wake_all();
        }
    }
}

/// Stress tests of the in-memory channels' waits: a lost wake-up leaves an end asleep until
/// the watchdog fires (the futex sleep is bounded by 100 ms slices, so a lost wake-up shows
/// as a run far slower than its sleeps; the deadlines below turn that into a failure).
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::channel::wait::watchdog::{WATCHDOG, with_watchdog};

    fn pair(depth: usize, spin: Duration) -> (Arc<LocalHub>, LocalTx<u64>, LocalRx<u64>) {
        let hub = Arc::new(LocalHub::new(spin));
        let writer = hub.writers::<u64>(1, 1, depth).unwrap().pop().unwrap();
        let reader = hub.reader::<u64>(1, 0, 1, depth).unwrap();
        (hub, writer, reader)
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
                        if state.is_multiple_of(64) {
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
                    if state.is_multiple_of(64) {
                        std::thread::sleep(Duration::from_micros(state % 200));
                    }
                    let deadline = Some(Instant::now() + Duration::from_secs(5));
                    writer.write(Msg::Value(seq), deadline).unwrap();
                }
                drop(consumer.join().unwrap());
            }
        });
    }

    /// Teardown (`close`) wakes a reader asleep on an empty channel and a writer asleep
    /// on a full one; a dropped writer ends the reader.
    #[test]
    fn close_and_drop_wake_sleeping_ends() {
        with_watchdog(WATCHDOG, || {
            let (chans, writer, mut reader) = pair(1, Duration::ZERO);
            let blocked = std::thread::spawn(move || reader.read(None).map(value));
            std::thread::sleep(Duration::from_millis(30));
            chans.close();
            assert_eq!(blocked.join().unwrap(), Err(ChanError::Closed));
            drop(writer);

            let (chans, mut writer, reader) = pair(1, Duration::ZERO);
            writer.write(Msg::Value(1), None).unwrap();
            let blocked = std::thread::spawn(move || writer.write(Msg::Value(2), None));
            std::thread::sleep(Duration::from_millis(30));
            chans.close();
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
