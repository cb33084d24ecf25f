//! Channels: each moves the messages of one writer to its readers, one message per execution,
//! in order, with back-pressure, close and error frames. Channels know nothing of graphs:
//! whoever wires a graph (the runtime's [`GraphChannels`](crate::actor::channels)) picks a
//! kind for each reader by where it lives and opens the ends; the executor and the actor loop
//! then see only [`ChannelWriter`] and [`ChannelReader`].
//!
//! The kinds, one module each:
//! - [`slot`]: the writing actor reads its own value (no copy, no synchronisation);
//! - [`local`]: a reader in the writer's process (in memory, no serialization);
//! - [`shm`]: readers in other processes of the host (one shared-memory ring for all of them,
//!   encoded once, large payloads read in place);
//! - [`net`]: readers on other hosts (one TCP connection per reading host, the ring's frames
//!   and contract).
//!
//! A writer with readers of several kinds writes through a [`FanOut`].
use crate::buffer::BufferMut;
use crate::error::TaskError;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub(crate) mod cpu;
#[cfg(all(test, not(loom)))]
mod frame_tests;
pub(crate) mod local;
#[cfg(all(test, loom))]
mod loom_tests;
pub(crate) mod net;
pub(crate) use net::Holding;
pub(crate) mod shm;
pub(crate) mod slot;
pub(crate) mod wait;
pub(crate) use wait::passed;

/// Aligns and pads `T` to 128 bytes: two cache lines, because Intel's adjacent-line prefetcher
/// (and the big cores of ARM) move lines in pairs, as tokio's `util/cacheline.rs` explains.
/// The hot words of both ring kinds (shared-memory and in-process) sit in one each.
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub(crate) struct CachePadded<T>(pub(crate) T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// What one slot of a channel carries: a value, or the error of the task that should have
/// produced it.
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

/// The writing end of a channel, whatever its kind.
pub(crate) trait ChannelWriter<T> {
    /// Writes one message, waiting for room until `deadline` (`None`: until the channel
    /// closes).
    fn write(&mut self, msg: Msg<T>, deadline: Option<Instant>) -> Result<(), ChanError>;

    /// Writes a value the caller keeps. Kinds that encode it (shared memory) read it in place;
    /// kinds that hand the value itself over take a clone.
    fn write_ref(&mut self, value: &T, deadline: Option<Instant>) -> Result<(), ChanError>
    where
        T: Clone,
    {
        self.write(Msg::Value(value.clone()), deadline)
    }

    /// Whether this end hands the value itself to its reader (and so needs a copy of its own),
    /// rather than encoding it.
    fn moves_values(&self) -> bool;

    /// `len` bytes of this channel's memory for a buffer built in place, which this channel
    /// then writes by reference; `None` where the kind has no such memory or none is free now.
    fn loan(&mut self, _len: usize) -> Option<BufferMut> {
        None
    }

    /// Lets this end hold small frames back under `holding`'s rules (an actor's writer); ends
    /// that send nothing through system calls ignore it.
    fn hold_in(&mut self, _holding: &Arc<Holding>) {}
}

/// The reading end of a channel, whatever its kind.
pub(crate) trait ChannelReader<T> {
    /// Reads the next message, waiting until `deadline` (`None`: until the channel closes).
    /// Messages written before a close are still delivered, then the close.
    fn read(&mut self, deadline: Option<Instant>) -> Result<Msg<T>, ChanError>;

    /// Whether the next message is whole at hand, so that the next read cannot wait; `false`
    /// where the kind cannot tell cheaply.
    fn next_is_here(&self) -> bool {
        false
    }
}

/// A writing end that can cross threads (the driver's, or one an actor builds and keeps).
pub(crate) type Writer<T> = Box<dyn ChannelWriter<T> + Send>;
/// A reading end that can cross threads.
pub(crate) type Reader<T> = Box<dyn ChannelReader<T> + Send>;

/// What one writer has sent: messages, encoded bytes (ends that move values count none) and
/// how often its shared-memory channel grew. One thread writes them (the writer's), with
/// plain relaxed stores; anyone may read them.
#[derive(Debug, Default)]
pub(crate) struct EndCounters {
    pub messages: AtomicU64,
    pub bytes: AtomicU64,
    pub growths: AtomicU64,
}

/// Add `n` to a counter of one writing thread: a load and a store, no locked instruction.
#[inline]
pub(crate) fn bump(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

/// One writer's ends of several channels (one per reader kind): a message goes to every end,
/// encoded by reference where the end encodes, moved to the last end that takes the value
/// itself and cloned for the others.
pub(crate) struct FanOut<T> {
    encoding: Vec<Writer<T>>,
    moving: Vec<Writer<T>>,
    counters: Option<Arc<EndCounters>>,
}

impl<T> FanOut<T> {
    pub(crate) fn new(ends: Vec<Writer<T>>) -> Self {
        let (moving, encoding) = ends.into_iter().partition(|e| e.moves_values());
        FanOut {
            encoding,
            moving,
            counters: None,
        }
    }

    /// Count every message written in `counters`.
    pub(crate) fn counted(mut self, counters: Arc<EndCounters>) -> Self {
        self.counters = Some(counters);
        self
    }

    #[inline]
    fn count(&self) {
        if let Some(c) = &self.counters {
            bump(&c.messages, 1);
        }
    }
}

impl<T> FanOut<T> {
    /// Memory of the first end that lends some (see [`ChannelWriter::loan`]).
    pub(crate) fn loan(&mut self, len: usize) -> Option<BufferMut> {
        self.encoding.iter_mut().find_map(|end| end.loan(len))
    }
}

impl<T: Clone> ChannelWriter<T> for FanOut<T> {
    fn write(&mut self, msg: Msg<T>, deadline: Option<Instant>) -> Result<(), ChanError> {
        self.count();
        match &msg {
            Msg::Value(v) => {
                for end in &mut self.encoding {
                    end.write_ref(v, deadline)?;
                }
            }
            Msg::Error(_) => {
                for end in &mut self.encoding {
                    end.write(msg.clone(), deadline)?;
                }
            }
        }
        let Some((last, rest)) = self.moving.split_last_mut() else {
            return Ok(());
        };
        for end in rest {
            end.write(msg.clone(), deadline)?;
        }
        last.write(msg, deadline)
    }

    fn write_ref(&mut self, value: &T, deadline: Option<Instant>) -> Result<(), ChanError> {
        self.count();
        for end in &mut self.encoding {
            end.write_ref(value, deadline)?;
        }
        for end in &mut self.moving {
            end.write(Msg::Value(value.clone()), deadline)?;
        }
        Ok(())
    }

    fn moves_values(&self) -> bool {
        !self.moving.is_empty()
    }

    fn hold_in(&mut self, holding: &Arc<Holding>) {
        for end in self.encoding.iter_mut().chain(&mut self.moving) {
            end.hold_in(holding);
        }
    }
}
