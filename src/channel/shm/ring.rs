//! The ring protocol: one writer, many readers, `depth` slots, independent of where the memory
//! lives (a shared mapping in [`shm`](super::shm), a heap allocation in tests and loom models).
//!
//! # State
//!
//! All shared state is atomics in a [`RingControl`], one [`Cursor`] per reader and one stamp per
//! slot, each hot word on its own 128-byte line. Sequence numbers are `u64` and never wrap in
//! practice.
//!
//! | word | written by | meaning |
//! |---|---|---|
//! | `stamp[s % depth]` | writer | `s + 1` once message `s` is published in that slot |
//! | `cursor[r]` | reader `r` | reader `r` has released every sequence `< cursor[r]` |
//! | `closed` | anybody | the channel is closed (idempotent, never reset) |
//! | `data` | readers sleep here | [`WaitCell`]: futex word and sleeper count |
//! | `space` | the writer sleeps here | [`WaitCell`]: futex word and sleeper count |
//!
//! Message `s` lives in slot `s % depth`. The slot's contents are not part of this module: the
//! caller writes them between [`RingWriter::reserve`] and [`RingWriter::publish`], and reads
//! them between [`RingReader::acquire`] and the release. The memory puts each slot's stamp on
//! the line of the slot's own description ([`RingMemory::stamp`]), so that a reader waiting for
//! a message polls the line it reads next anyway: one line moves from the writer's core per
//! message, where a shared published-count word moved two (that word, then the slot).
//!
//! # Protocol
//!
//! - **Write**: the writer may fill slot `s % depth` once every reader released `s - depth`, i.e.
//!   `s - min(cursor) < depth` (it caches `min(cursor)` so that the fast path reads no cursor).
//!   Otherwise it waits on `space`. It then writes the slot and publishes with
//!   `stamp[s % depth].store(s + 1, Release)` followed by `data.notify()`.
//! - **Read**: reader `r` waits on `data` until `stamp[s % depth] == s + 1` (acquire, so the
//!   slot's contents are visible; the stamp of the slot's earlier message is `s + 1 - depth`,
//!   and the writer cannot get to `s + depth` before this reader released `s`), reads the
//!   slot, and releases with `cursor[r].store(s + 1, Release)` followed by `space.notify()`.
//!   A slot is reused only after *every* reader released it; the acquire load of the cursors
//!   orders the writer's next write after every reader's last read.
//! - **Close** sets `closed` and wakes both cells unconditionally. A blocked writer returns
//!   [`RingError::Closed`] at once; readers first drain what was published, then return
//!   `Closed`. Dropping a [`RingWriter`] or [`RingReader`] closes the ring, so nobody waits for
//!   a peer that left.
//! - **Pins**: a reader that keeps a message's payload past its release (a zero-copy read)
//!   pins the payload's memory with [`pin`] *before* it releases the slot, and [`unpin`]s it
//!   when done, from any thread. The writer, once the slot is free, reuses that memory only
//!   if [`is_pinned`] says no; otherwise it writes the slot's next message elsewhere. The
//!   slot itself is never held, so a kept payload never stalls the writer.
//!
//! # Why no wake-up is lost
//!
//! Every waiter polls its condition *and* `closed` after registering as a sleeper, and every
//! state change (a stamp, a cursor, `closed`) is followed by a notify of the cell its
//! waiters sleep on; [`WaitCell`] turns that pair into a Dekker-style handshake with two SeqCst
//! fences (see [`wait`](super::wait)), so either the waiter sees the change or the waker sees
//! the sleeper and bumps the futex word before waking it. The loom models in `loom_tests.rs`
//! check this with a futex model that has no timeout, so a lost wake-up is a deadlock there.
//! The 100 ms bound on each real futex sleep only guards against peers that die.
//!
//! # Why a pinned payload is never overwritten
//!
//! The reader's `pin` (relaxed) comes before its release of the slot (release store of its
//! cursor); the writer's acquire load of that cursor precedes its `is_pinned` check, so the
//! check sees the pin. The `unpin` is a release decrement and `is_pinned` an acquire load, so
//! once the writer sees the count at zero, every read of the payload happened before its
//! next write. A pin left by a process that died is never undone: the memory stays with the
//! channel, which is torn down with the graph anyway.

use std::time::{Duration, Instant};

use crate::channel::CachePadded;
use crate::channel::wait::{SpinPolicy, WaitCell};
#[cfg(test)]
use crate::sync::Arc;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// Errors of the ring and of the shared-memory channel built on it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RingError {
    #[error("the channel is closed")]
    Closed,
    #[error(
        "timed out waiting on the channel (for a free slot when writing, a message when reading)"
    )]
    Timeout,
    #[error(
        "a message of {size} bytes exceeds the channel's limit of {limit} bytes (max_message_bytes)"
    )]
    TooLarge { size: usize, limit: usize },
    #[error("shared-memory channel: {0}")]
    Io(#[from] std::io::Error),
    #[error("shared-memory channel is corrupt or incompatible: {0}")]
    Corrupt(String),
}

/// Shared state of a ring, except the readers' cursors. Only atomics, and all-zero bytes are
/// a valid (empty, unconfigured) state, so it can live in a fresh shared mapping (`shm` views
/// it in place; keep it atomics-only); [`init`](Self::init) sets the shape.
#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct RingControl {
    /// Readers sleep here until a stamp moves or the ring closes.
    data: CachePadded<WaitCell>,
    /// The writer sleeps here until a cursor moves or the ring closes.
    space: CachePadded<WaitCell>,
    /// Read-mostly words.
    meta: CachePadded<Meta>,
}

#[repr(C)]
#[derive(Debug, Default)]
struct Meta {
    depth: AtomicU32,
    readers: AtomicU32,
    closed: AtomicU32,
    writer_attached: AtomicU32,
}

impl RingControl {
    /// Sets the shape; called once, before the memory is shared.
    pub(crate) fn init(&self, depth: u32, readers: u32) {
        assert!(depth > 0 && readers > 0, "a ring needs a slot and a reader");
        self.meta.depth.store(depth, Ordering::Relaxed);
        self.meta.readers.store(readers, Ordering::Relaxed);
    }

    pub(crate) fn depth(&self) -> u32 {
        self.meta.depth.load(Ordering::Relaxed)
    }

    pub(crate) fn readers(&self) -> u32 {
        self.meta.readers.load(Ordering::Relaxed)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.meta.closed.load(Ordering::Acquire) != 0
    }

    /// Closes the ring and wakes every sleeper. Idempotent.
    pub(crate) fn close(&self) {
        // Release: a reader that sees `closed` also sees the writer's last stamp, when the
        // writer closed after publishing.
        self.meta.closed.store(1, Ordering::Release);
        self.data.wake();
        self.space.wake();
    }
}

/// One reader's position: every sequence below `released` was released by that reader.
/// Atomics only, like [`RingControl`].
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub(crate) struct Cursor {
    released: AtomicU64,
    attached: AtomicU32,
}

/// Where a ring's shared words live. Cloning must be cheap (an `Arc`).
pub(crate) trait RingMemory: Clone {
    fn control(&self) -> &RingControl;
    /// The cursor of reader `index`; `index < control().readers()`.
    fn cursor(&self, index: u32) -> &Cursor;
    /// The stamp of slot `slot` (that of every sequence `seq` with `seq % depth == slot`): on
    /// the line that the reader of the message reads first.
    fn stamp(&self, slot: usize) -> &AtomicU64;
}

/// A ring in ordinary memory, for the loom models and threaded tests (loom cannot model a
/// shared mapping). Widen the `cfg` to build an in-process channel kind on it.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct HeapRing {
    control: RingControl,
    cursors: Box<[Cursor]>,
    stamps: Box<[CachePadded<AtomicU64>]>,
}

#[cfg(test)]
impl HeapRing {
    pub(crate) fn new(depth: u32, readers: u32) -> Arc<Self> {
        let ring = Self {
            control: RingControl::default(),
            cursors: (0..readers).map(|_| Cursor::default()).collect(),
            stamps: (0..depth).map(|_| CachePadded::default()).collect(),
        };
        ring.control.init(depth, readers);
        Arc::new(ring)
    }
}

#[cfg(test)]
impl RingMemory for Arc<HeapRing> {
    fn control(&self) -> &RingControl {
        &self.control
    }
    fn cursor(&self, index: u32) -> &Cursor {
        &self.cursors[index as usize]
    }
    fn stamp(&self, slot: usize) -> &AtomicU64 {
        &self.stamps[slot]
    }
}

/// The writing end. At most one per ring ([`attach`](Self::attach) refuses a second).
#[derive(Debug)]
pub(crate) struct RingWriter<M: RingMemory> {
    mem: M,
    depth: u64,
    policy: SpinPolicy,
    /// Sequence number of the next message.
    next: u64,
    /// Its slot, `next % depth`, kept in step instead of divided out per message.
    slot: usize,
    /// A lower bound of every reader's cursor, cached so that the fast path reads no cursor.
    min_released: u64,
}

/// The slot after `slot` in a ring of `depth` slots.
fn following(slot: usize, depth: u64) -> usize {
    if slot as u64 + 1 == depth {
        0
    } else {
        slot + 1
    }
}

impl<M: RingMemory> RingWriter<M> {
    /// The writer of the ring in `mem`, or `None` if it was attached before.
    pub(crate) fn attach(mem: M, spin: Duration) -> Option<Self> {
        let ctl = mem.control();
        if ctl.meta.writer_attached.swap(1, Ordering::AcqRel) != 0 {
            return None;
        }
        // The only writer there ever is (`writer_attached` is never reset) starts at 0.
        let next = 0;
        let depth = u64::from(ctl.depth());
        let min_released = min_cursor(&mem);
        Some(Self {
            mem,
            depth,
            policy: SpinPolicy::new(spin),
            next,
            slot: 0,
            min_released,
        })
    }

    pub(crate) fn memory(&self) -> &M {
        &self.mem
    }

    /// The slot of the sequence [`reserve`](Self::reserve) returns.
    pub(crate) fn slot(&self) -> usize {
        self.slot
    }

    /// Waits until slot `next % depth` is free and returns `next`, the sequence number the
    /// caller may now write into that slot. Changes no shared state, so it may be called again
    /// (e.g. after the caller gave up on a message) before [`publish`](Self::publish).
    pub(crate) fn reserve(&mut self, deadline: Option<Instant>) -> Result<u64, RingError> {
        let ctl = self.mem.control();
        if ctl.is_closed() {
            return Err(RingError::Closed);
        }
        let (next, depth) = (self.next, self.depth);
        if next - self.min_released < depth {
            return Ok(next);
        }
        let mem = &self.mem;
        let ready = ctl.space.wait(&mut self.policy, deadline, || {
            if ctl.is_closed() {
                return Some(Err(RingError::Closed));
            }
            let min = min_cursor(mem);
            (next - min < depth).then_some(Ok(min))
        });
        self.min_released = ready.ok_or(RingError::Timeout)??;
        Ok(next)
    }

    /// Publishes the reserved slot: readers may read it once this returns.
    pub(crate) fn publish(&mut self) {
        debug_assert!(
            self.next - self.min_released < self.depth,
            "publish without reserve"
        );
        let (seq, slot) = (self.next, self.slot);
        self.next += 1;
        self.slot = following(slot, self.depth);
        self.mem.stamp(slot).store(seq + 1, Ordering::Release);
        self.mem.control().data.notify();
    }
}

impl<M: RingMemory> Drop for RingWriter<M> {
    fn drop(&mut self) {
        self.mem.control().close();
    }
}

fn min_cursor(mem: &impl RingMemory) -> u64 {
    (0..mem.control().readers())
        .map(|index| mem.cursor(index).released.load(Ordering::Acquire))
        .min()
        .unwrap_or(u64::MAX)
}

/// Stores a reader's new cursor and tells the writer.
fn publish_cursor(mem: &impl RingMemory, index: u32, released: u64) {
    mem.cursor(index)
        .released
        .store(released, Ordering::Release);
    mem.control().space.notify();
}

/// A reading end. One per reader index ([`attach`](Self::attach) refuses a second).
#[derive(Debug)]
pub(crate) struct RingReader<M: RingMemory> {
    mem: M,
    index: u32,
    policy: SpinPolicy,
    /// Sequence number of the next message to acquire.
    next: u64,
    /// Its slot, `next % depth`.
    slot: usize,
    depth: u64,
}

impl<M: RingMemory> RingReader<M> {
    /// Reader `index` of the ring in `mem`, or `None` if the index is out of range or was
    /// attached before.
    pub(crate) fn attach(mem: M, index: u32, spin: Duration) -> Option<Self> {
        let ctl = mem.control();
        if index >= ctl.readers() {
            return None;
        }
        let cursor = mem.cursor(index);
        if cursor.attached.swap(1, Ordering::AcqRel) != 0 {
            return None;
        }
        let next = cursor.released.load(Ordering::Acquire);
        let depth = u64::from(ctl.depth());
        Some(Self {
            index,
            policy: SpinPolicy::new(spin),
            next,
            slot: (next % depth) as usize,
            depth,
            mem,
        })
    }

    pub(crate) fn memory(&self) -> &M {
        &self.mem
    }

    /// Waits for the next message and returns its sequence number and slot (`seq % depth`);
    /// the caller reads the slot and then calls [`release`](Self::release).
    /// After a close, messages already published are still returned, then `Closed`.
    pub(crate) fn acquire(&mut self, deadline: Option<Instant>) -> Result<(u64, usize), RingError> {
        let (ctl, next, slot) = (self.mem.control(), self.next, self.slot);
        let stamp = self.mem.stamp(slot);
        let ready = ctl.data.wait(&mut self.policy, deadline, || {
            // `closed` first: if the writer closed after its last publish, seeing the close
            // (acquire) implies seeing that publish.
            let closed = ctl.is_closed();
            if stamp.load(Ordering::Acquire) == next + 1 {
                Some(Ok(()))
            } else if closed {
                Some(Err(RingError::Closed))
            } else {
                None
            }
        });
        ready.ok_or(RingError::Timeout)??;
        self.next += 1;
        self.slot = following(slot, self.depth);
        Ok((next, slot))
    }

    /// Releases `seq`, the latest sequence acquired: its slot may be reused once every reader
    /// released it.
    pub(crate) fn release(&mut self, seq: u64) {
        debug_assert_eq!(
            seq + 1,
            self.next,
            "release of a sequence that is not the latest"
        );
        publish_cursor(&self.mem, self.index, seq + 1);
    }
}

impl<M: RingMemory> Drop for RingReader<M> {
    fn drop(&mut self) {
        self.mem.control().close();
    }
}

/// Pins the payload memory whose pin count is `count`; call before releasing the slot.
pub(crate) fn pin(count: &AtomicU32) {
    // Relaxed: the release of the slot that follows publishes it to the writer.
    count.fetch_add(1, Ordering::Relaxed);
}

/// Undoes one [`pin`], after the last read of the payload, from any thread.
pub(crate) fn unpin(count: &AtomicU32) {
    // Release: every read of the payload happens before the writer sees the count drop.
    count.fetch_sub(1, Ordering::Release);
}

/// Whether some reader still reads the payload memory whose pin count is `count`. The
/// writer asks after reserving the slot whose message last used that memory.
pub(crate) fn is_pinned(count: &AtomicU32) -> bool {
    count.load(Ordering::Acquire) != 0
}

/// Slot contents for the ring tests: one `u64` per slot with no synchronisation of its own, so
/// that only the ring protocol orders the writer's and the readers' accesses (loom fails a model
/// in which two of them race).
#[cfg(test)]
pub(crate) mod test_slots {
    use crate::sync::UnsafeCell;

    pub(crate) struct Slots(Box<[UnsafeCell<u64>]>);

    // SAFETY: the protocol under test orders every access; the loom models check that it does.
    unsafe impl Sync for Slots {}

    impl Slots {
        pub(crate) fn new(depth: u32) -> Self {
            Self((0..depth).map(|_| UnsafeCell::new(0)).collect())
        }

        fn cell(&self, seq: u64) -> &UnsafeCell<u64> {
            &self.0[(seq % self.0.len() as u64) as usize]
        }

        /// Writes message `seq`'s value; call between `reserve` and `publish`.
        pub(crate) fn write(&self, seq: u64, value: u64) {
            // SAFETY: the writer owns the slot between `reserve` and `publish`.
            self.cell(seq).with_mut(|slot| unsafe { *slot = value });
        }

        /// Reads message `seq`'s value; call between `acquire` and the release.
        pub(crate) fn read(&self, seq: u64) -> u64 {
            // SAFETY: readers share the slot between `acquire` and the release.
            self.cell(seq).with(|slot| unsafe { *slot })
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::test_slots::Slots;
    use super::*;
    use crate::channel::wait::DEFAULT_SPIN;
    use crate::channel::wait::watchdog::{WATCHDOG, with_watchdog};
    use crate::sync::thread;

    /// Writer and readers on threads over a heap ring, one value per slot.
    #[test]
    fn every_reader_sees_every_message_in_order() {
        with_watchdog(WATCHDOG, || {
            const DEPTH: u32 = 4;
            const READERS: u32 = 3;
            const MESSAGES: u64 = 20_000;
            let ring = HeapRing::new(DEPTH, READERS);
            let slots = Arc::new(Slots::new(DEPTH));
            let readers: Vec<_> = (0..READERS)
                .map(|index| {
                    let mut reader = RingReader::attach(ring.clone(), index, DEFAULT_SPIN).unwrap();
                    let slots = slots.clone();
                    thread::spawn(move || {
                        for expected in 0..MESSAGES {
                            let (seq, slot) = reader.acquire(None).unwrap();
                            assert_eq!(seq, expected);
                            assert_eq!(slot as u64, seq % u64::from(DEPTH));
                            assert_eq!(slots.read(seq), seq * 7 + 1);
                            reader.release(seq);
                        }
                        // The writer closes after the last message.
                        assert!(matches!(reader.acquire(None), Err(RingError::Closed)));
                    })
                })
                .collect();
            let mut writer = RingWriter::attach(ring.clone(), DEFAULT_SPIN).unwrap();
            assert!(RingWriter::attach(ring.clone(), DEFAULT_SPIN).is_none());
            for seq in 0..MESSAGES {
                assert_eq!(writer.reserve(None).unwrap(), seq);
                slots.write(seq, seq * 7 + 1);
                writer.publish();
            }
            drop(writer);
            for reader in readers {
                reader.join().unwrap();
            }
        });
    }

    #[test]
    fn reserve_times_out_when_full_and_fails_when_closed() {
        with_watchdog(WATCHDOG, || {
            let ring = HeapRing::new(1, 1);
            let mut writer = RingWriter::attach(ring.clone(), DEFAULT_SPIN).unwrap();
            let _reader = RingReader::attach(ring.clone(), 0, DEFAULT_SPIN).unwrap();
            assert!(RingReader::attach(ring.clone(), 0, DEFAULT_SPIN).is_none());
            assert!(RingReader::attach(ring.clone(), 1, DEFAULT_SPIN).is_none());
            writer.reserve(None).unwrap();
            writer.publish();
            let deadline = Instant::now() + Duration::from_millis(20);
            assert!(matches!(
                writer.reserve(Some(deadline)),
                Err(RingError::Timeout)
            ));
            ring.control().close();
            assert!(matches!(writer.reserve(None), Err(RingError::Closed)));
        });
    }
}
