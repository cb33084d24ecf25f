//! What an actor's loop records about itself while it runs a graph: the timeline of its
//! operations (opt-in) and its counters (always). Both are written by the actor's own thread
//! only, with plain relaxed stores, and read by whoever asks (the driver for thread actors,
//! the worker's control loop for process actors) without stopping the actor.
use crate::channel::EndCounters;
pub(crate) use crate::channel::bump;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

pub(crate) use crate::clock::mono_ns;

/// The busy time of an actor's methods on the executions its plain loop samples (one in
/// [`BUSY_SAMPLE`]): the loop times its compute operations on it, and a fused operation (a
/// read, a method and a write as one, see `method::fusable`) times its method on it itself;
/// the loop adds it up once per sampled execution.
#[derive(Debug, Default)]
pub(crate) struct BusyClock {
    sampled: Cell<bool>,
    ns: Cell<u64>,
}

impl BusyClock {
    /// Whether the coming execution is timed.
    pub(crate) fn sample(&self, on: bool) {
        self.sampled.set(on);
    }

    /// The start of a method's run, on a timed execution.
    #[inline]
    pub(crate) fn start(&self) -> Option<u64> {
        self.sampled.get().then(mono_ns)
    }

    #[inline]
    pub(crate) fn stop(&self, start: Option<u64>) {
        if let Some(start) = start {
            self.ns.set(self.ns.get() + (mono_ns() - start));
        }
    }

    /// The time counted since the last call.
    pub(crate) fn take(&self) -> u64 {
        self.ns.take()
    }
}

/// Records per actor a timeline keeps (4 words each: 8 MiB per actor); later operations are
/// counted as dropped, never recorded by allocating.
pub(crate) const TIMELINE_CAPACITY: usize = 1 << 18;

/// One operation of an actor's schedule, run once: which op (its index in the actor's
/// schedule of the plan), for which execution, from when to when (`mono_ns`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct OpRecord {
    pub op: u32,
    pub exec: u64,
    pub start: u64,
    pub end: u64,
}

/// A pre-allocated, append-only buffer of [`OpRecord`]s with one writer (the actor's loop).
/// The writer stores a record's words, then publishes the new length (release); a reader
/// loads the length (acquire) and copies that many records. No lock, no allocation per op,
/// and no `unsafe`: every word is an atomic written with a plain store.
pub(crate) struct TimelineBuf {
    words: Box<[AtomicU64]>,
    len: AtomicUsize,
    dropped: AtomicU64,
}

impl TimelineBuf {
    pub(crate) fn new(capacity: usize) -> Self {
        TimelineBuf {
            words: (0..capacity * 4).map(|_| AtomicU64::new(0)).collect(),
            len: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// Append one record (the single writer only).
    #[inline]
    pub(crate) fn record(&self, op: u32, exec: u64, start: u64, end: u64) {
        let n = self.len.load(Ordering::Relaxed);
        let at = n * 4;
        if at + 4 > self.words.len() {
            bump(&self.dropped, 1);
            return;
        }
        self.words[at].store(u64::from(op), Ordering::Relaxed);
        self.words[at + 1].store(exec, Ordering::Relaxed);
        self.words[at + 2].store(start, Ordering::Relaxed);
        self.words[at + 3].store(end, Ordering::Relaxed);
        self.len.store(n + 1, Ordering::Release);
    }

    /// Every record published so far, and how many did not fit.
    pub(crate) fn snapshot(&self) -> (Vec<OpRecord>, u64) {
        let n = self.len.load(Ordering::Acquire);
        let records = (0..n)
            .map(|i| {
                let w = |k: usize| self.words[i * 4 + k].load(Ordering::Relaxed);
                OpRecord {
                    op: w(0) as u32,
                    exec: w(1),
                    start: w(2),
                    end: w(3),
                }
            })
            .collect();
        (records, self.dropped.load(Ordering::Relaxed))
    }
}

/// Without a timeline, the loop times its methods on one execution in this many.
pub(crate) const BUSY_SAMPLE: u64 = 16;

/// An actor's counters of one graph, written by its loop.
#[derive(Default)]
pub(crate) struct ActorCounters {
    /// Executions whose every operation ran.
    pub executions: AtomicU64,
    /// Nanoseconds spent in compute operations (the actor's methods) of the timed executions.
    pub busy_ns: AtomicU64,
    /// Executions whose methods were timed (every one with a timeline, else one in
    /// [`BUSY_SAMPLE`]).
    pub timed_executions: AtomicU64,
}

impl ActorCounters {
    /// Time spent in methods over all executions, estimated from the timed ones.
    pub(crate) fn busy_estimate(&self) -> u64 {
        let busy = self.busy_ns.load(Ordering::Relaxed);
        let timed = self.timed_executions.load(Ordering::Relaxed);
        let all = self.executions.load(Ordering::Relaxed);
        if timed == 0 {
            return busy;
        }
        (u128::from(busy) * u128::from(all.max(timed)) / u128::from(timed)) as u64
    }
}

/// One writer end's counters of an edge, as they travel from a worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct EdgeCount {
    pub messages: u64,
    pub bytes: u64,
    pub growths: u64,
}

/// The counters of the writers a process opened for one graph, by edge: shared, so that a
/// worker can report them after the graph's channels are unmapped.
#[derive(Clone, Default)]
pub(crate) struct EdgeCounters(Arc<Mutex<Vec<EdgeEnd>>>);

/// One writer's counters and the edge it writes.
type EdgeEnd = (u64, Arc<EndCounters>);

impl EdgeCounters {
    /// Count what the writer of `edge` sends in `counters`.
    pub(crate) fn add(&self, edge: u64, counters: Arc<EndCounters>) {
        self.0.lock().push((edge, counters));
    }

    /// What every writer has sent so far, by edge.
    pub(crate) fn counts(&self) -> Vec<(u64, EdgeCount)> {
        self.0
            .lock()
            .iter()
            .map(|(edge, c)| {
                (
                    *edge,
                    EdgeCount {
                        messages: c.messages.load(Ordering::Relaxed),
                        bytes: c.bytes.load(Ordering::Relaxed),
                        growths: c.growths.load(Ordering::Relaxed),
                    },
                )
            })
            .collect()
    }
}

/// What an actor reports of one graph: its counters, the edges it writes, and its timeline.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct Observation {
    pub executions: u64,
    /// Estimated from the timed executions (see [`ActorCounters::busy_estimate`]).
    pub busy_ns: u64,
    /// By edge id.
    pub edges: Vec<(u64, EdgeCount)>,
    pub timeline: Vec<OpRecord>,
    pub timeline_dropped: u64,
    /// Tracing events of the worker that could not be sent to the driver.
    pub events_dropped: u64,
}

/// What the loop of one actor is given to record into, and what the driver (or the worker's
/// control loop) reads back.
#[derive(Clone, Default)]
pub(crate) struct Recorder {
    pub counters: Arc<ActorCounters>,
    pub timeline: Option<Arc<TimelineBuf>>,
}

impl Recorder {
    pub(crate) fn new(timeline: bool) -> Self {
        Recorder {
            counters: Default::default(),
            timeline: timeline.then(|| Arc::new(TimelineBuf::new(TIMELINE_CAPACITY))),
        }
    }

    /// Read everything recorded so far, with the counters of `edges` (the writers this
    /// process opened for the graph).
    pub(crate) fn observe(&self, edges: Option<&EdgeCounters>) -> Observation {
        let (timeline, timeline_dropped) = self
            .timeline
            .as_ref()
            .map(|t| t.snapshot())
            .unwrap_or_default();
        Observation {
            executions: self.counters.executions.load(Ordering::Relaxed),
            busy_ns: self.counters.busy_estimate(),
            edges: edges.map(|c| c.counts()).unwrap_or_default(),
            timeline,
            timeline_dropped,
            events_dropped: super::logs::events_dropped(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_buffer_keeps_order_and_counts_what_does_not_fit() {
        let buf = TimelineBuf::new(3);
        for i in 0..5u64 {
            buf.record(i as u32, i, 10 * i, 10 * i + 5);
        }
        let (records, dropped) = buf.snapshot();
        assert_eq!(dropped, 2);
        assert_eq!(records.len(), 3);
        assert_eq!(
            records[2],
            OpRecord {
                op: 2,
                exec: 2,
                start: 20,
                end: 25
            }
        );
    }

    #[test]
    fn busy_time_is_scaled_from_the_timed_executions() {
        let c = ActorCounters::default();
        assert_eq!(c.busy_estimate(), 0);
        bump(&c.busy_ns, 100);
        bump(&c.timed_executions, 2);
        bump(&c.executions, 32);
        assert_eq!(c.busy_estimate(), 1600);
    }

    #[test]
    fn the_monotonic_clock_moves_forward() {
        let a = mono_ns();
        let b = mono_ns();
        assert!(b >= a);
    }
}
