//! The queue under an in-process channel: one writer, one reader, `depth` slots, each value on
//! the cache line of the stamp that publishes it.
//!
//! Why not `rtrb` (used before): it publishes a message by moving the queue's tail index, so a
//! reader waiting for a message polls the index's line and then reads the slot's line, two
//! lines fetched from the writer's core one after the other. Here the reader polls the slot's
//! own stamp, and the value comes with it: one line per small message. A throwaway ping-pong
//! between two threads measured ~420 ns a round trip through `rtrb` and ~290 ns through
//! stamped slots (docs/benchmarks.md).
//!
//! # Protocol
//!
//! Message `s` (counted from 0) goes into slot `s % depth`.
//! - **Write**: the writer may fill the slot once the reader took message `s - depth` out of
//!   it, i.e. `released > s - depth`. It caches `released`, so it reads the reader's line only
//!   when the cached copy says the queue is full (once every `depth` messages in a steady
//!   stream). It writes the value, then publishes with `stamp.store(s + 1, Release)`.
//! - **Read**: the reader waits until the stamp of slot `s % depth` is `s + 1` (acquire: the
//!   value is written). The stamp is `s + 1 - depth` until then, since the writer cannot lap a
//!   reader that has not released `s`. It moves the value out, then stores
//!   `released = s + 1` (Release: the move happens before the writer's next write there).
//! - **Leaving**: each end's drop sets its flag (Release), after its last push or pop; the
//!   other end's [`is_abandoned`](Consumer::is_abandoned) reads it (Acquire), so a reader
//!   that sees the writer gone and pops once more gets every message sent before.
//! - **Drop**: the values published and not taken are those whose slot's stamp is above
//!   `released`; the queue drops them when both ends are gone.
//!
//! Waiting is not part of the queue: [`LocalTx`](super::LocalTx) and
//! [`LocalRx`](super::LocalRx) poll it from their [`WaitCell`](crate::channel::wait::WaitCell)
//! waits. `loom_tests.rs` models the protocol (a torn read or a lost value fails there); the
//! stress tests of `local` run it on real threads.

use std::mem::MaybeUninit;

use crate::channel::CachePadded;
use crate::sync::{Arc, AtomicU32, AtomicU64, Ordering, UnsafeCell};

/// One slot: the stamp and, right after it on the same line when `T` is small, the value.
/// Slots are 128 bytes apart, two cache lines: the line of the next slot is never the pair
/// of this one that the adjacent-line prefetcher fetches with it. With 64 bytes a ping-pong
/// through two queues ten deep took ~160 ns a round trip, with 128 ~140 ns (the floor, one
/// shared line: ~130 ns); the shared-memory ring spaces its slots so too.
#[repr(C, align(128))]
struct Slot<T> {
    /// `s + 1` once message `s` is in this slot; 0 before the first.
    stamp: AtomicU64,
    value: UnsafeCell<MaybeUninit<T>>,
}

struct Shared<T> {
    slots: Box<[Slot<T>]>,
    /// Messages the reader took out: every sequence below it. Written by the reader only.
    released: CachePadded<AtomicU64>,
    writer_left: AtomicU32,
    reader_left: AtomicU32,
}

// SAFETY: values move from the writer's thread to the reader's, hence `T: Send`. The protocol
// (module docs) gives each slot's value to one end at a time: the writer between its check of
// `released` and its stamp store, the reader between its stamp load and its `released` store;
// the release/acquire pairs on `stamp` and `released` order the two ends' accesses.
unsafe impl<T: Send> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Shared<T> {}

/// The slot after `slot` in a ring of `depth`: each end keeps its slot's index and steps it
/// so, instead of dividing its sequence number by the depth at every push, pop and poll (a
/// 64-bit division sits on the path from a message's landing to its reading: the next poll's
/// address waits for it).
fn following(slot: usize, depth: usize) -> usize {
    if slot + 1 == depth { 0 } else { slot + 1 }
}

impl<T> Drop for Shared<T> {
    fn drop(&mut self) {
        let released = self.released.load(Ordering::Acquire);
        for slot in self.slots.iter() {
            if slot.stamp.load(Ordering::Acquire) > released {
                // SAFETY: a stamp above `released` is a message published and never taken:
                // its value is initialised, and with both ends gone nobody else touches it.
                slot.value
                    .with_mut(|value| unsafe { (*value).assume_init_drop() });
            }
        }
    }
}

/// A queue of `depth` slots (at least 1), as its writing and reading ends.
pub(crate) fn queue<T: Send>(depth: usize) -> (Producer<T>, Consumer<T>) {
    let depth = depth.max(1);
    let shared = Arc::new(Shared {
        slots: (0..depth)
            .map(|_| Slot {
                stamp: AtomicU64::new(0),
                value: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect(),
        released: CachePadded(AtomicU64::new(0)),
        writer_left: AtomicU32::new(0),
        reader_left: AtomicU32::new(0),
    });
    (
        Producer {
            shared: shared.clone(),
            next: 0,
            slot: 0,
            released: 0,
        },
        Consumer {
            shared,
            next: 0,
            slot: 0,
        },
    )
}

/// The writing end.
pub(crate) struct Producer<T> {
    shared: Arc<Shared<T>>,
    /// Sequence of the next message.
    next: u64,
    /// Its slot: `next % depth`.
    slot: usize,
    /// The reader's `released` as last read: a lower bound.
    released: u64,
}

impl<T> Producer<T> {
    /// Appends `value`, or hands it back when the queue is full.
    pub(crate) fn push(&mut self, value: T) -> Result<(), T> {
        let depth = self.shared.slots.len() as u64;
        if self.next - self.released >= depth {
            self.released = self.shared.released.load(Ordering::Acquire);
            if self.next - self.released >= depth {
                return Err(value);
            }
        }
        let slot = &self.shared.slots[self.slot];
        // SAFETY: the reader released message `next - depth`, the last one in this slot, and
        // moved its value out before (acquire on `released`); it touches the slot's value
        // again only once it sees the stamp stored below, after this write.
        slot.value.with_mut(|cell| unsafe { (*cell).write(value) });
        slot.stamp.store(self.next + 1, Ordering::Release);
        self.next += 1;
        self.slot = following(self.slot, self.shared.slots.len());
        Ok(())
    }

    /// Whether the reader is gone.
    pub(crate) fn is_abandoned(&self) -> bool {
        self.shared.reader_left.load(Ordering::Acquire) != 0
    }
}

impl<T> Drop for Producer<T> {
    fn drop(&mut self) {
        self.shared.writer_left.store(1, Ordering::Release);
    }
}

/// The reading end.
pub(crate) struct Consumer<T> {
    shared: Arc<Shared<T>>,
    /// Sequence of the next message.
    next: u64,
    /// Its slot: `next % depth`.
    slot: usize,
}

impl<T> Consumer<T> {
    /// Takes the next message out, if it is there.
    pub(crate) fn pop(&mut self) -> Option<T> {
        let slot = &self.shared.slots[self.slot];
        if slot.stamp.load(Ordering::Acquire) != self.next + 1 {
            return None;
        }
        // SAFETY: the stamp says message `next` is in the slot, written before the stamp's
        // release store that this acquire load saw; the writer does not touch the slot again
        // until the `released` store below, after this move.
        let value = slot
            .value
            .with(|cell| unsafe { (*cell).assume_init_read() });
        self.next += 1;
        self.slot = following(self.slot, self.shared.slots.len());
        self.shared.released.store(self.next, Ordering::Release);
        Some(value)
    }

    /// Whether the writer is gone (after its last push: pop again to drain).
    pub(crate) fn is_abandoned(&self) -> bool {
        self.shared.writer_left.load(Ordering::Acquire) != 0
    }
}

impl<T> Drop for Consumer<T> {
    fn drop(&mut self) {
        self.shared.reader_left.store(1, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::channel::wait::watchdog::{WATCHDOG, with_watchdog};
    use std::sync::atomic::AtomicUsize;

    /// Counts its drops, to check that each value is dropped exactly once.
    struct Counted<'a>(u64, &'a AtomicUsize);

    impl Drop for Counted<'_> {
        fn drop(&mut self) {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn values_come_out_in_order_and_a_full_queue_hands_the_value_back() {
        let drops = AtomicUsize::new(0);
        let (mut tx, mut rx) = queue::<Counted>(3);
        for lap in 0..5u64 {
            for i in 0..3 {
                assert!(tx.push(Counted(lap * 3 + i, &drops)).is_ok());
            }
            let back = tx.push(Counted(99, &drops)).expect_err("full");
            assert_eq!(back.0, 99);
            drop(back);
            for i in 0..3 {
                assert_eq!(rx.pop().map(|c| c.0), Some(lap * 3 + i));
            }
            assert!(rx.pop().is_none());
        }
        assert_eq!(drops.load(std::sync::atomic::Ordering::Relaxed), 5 * 4);
    }

    #[test]
    fn values_left_in_the_queue_are_dropped_once_with_it() {
        let drops = AtomicUsize::new(0);
        let (mut tx, mut rx) = queue::<Counted>(3);
        for i in 0..6 {
            let _ = tx.push(Counted(i, &drops)).map_err(drop);
            if i % 2 == 1 {
                drop(rx.pop());
            }
        }
        // Six pushed, one refused (full), three popped: two still in the queue.
        assert_eq!(drops.load(std::sync::atomic::Ordering::Relaxed), 4);
        assert!(!tx.is_abandoned() && !rx.is_abandoned());
        drop(rx);
        assert!(tx.is_abandoned());
        drop(tx);
        assert_eq!(drops.load(std::sync::atomic::Ordering::Relaxed), 6);
    }

    /// Two threads, a queue one and two deep, values that own heap memory (a torn or
    /// repeated read shows as a wrong value or a double free).
    #[test]
    fn a_writer_and_a_reader_on_two_threads_lose_and_repeat_nothing() {
        with_watchdog(WATCHDOG, || {
            const MESSAGES: u64 = 200_000;
            for depth in [1, 2, 10] {
                let (mut tx, mut rx) = queue::<Box<(u64, u64)>>(depth);
                let reader = std::thread::spawn(move || {
                    let mut expected = 0;
                    while expected < MESSAGES {
                        match rx.pop() {
                            Some(v) => {
                                assert_eq!(*v, (expected, expected.wrapping_mul(31)));
                                expected += 1;
                            }
                            None => std::hint::spin_loop(),
                        }
                    }
                    assert!(rx.pop().is_none());
                });
                for seq in 0..MESSAGES {
                    let mut v = Box::new((seq, seq.wrapping_mul(31)));
                    while let Err(back) = tx.push(v) {
                        v = back;
                        std::hint::spin_loop();
                    }
                }
                reader.join().unwrap();
            }
        });
    }
}
