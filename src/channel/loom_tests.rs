//! Loom models of the ring protocol, over a [`HeapRing`] with tiny constants (depth 1–2, one or
//! two readers, two or three messages).
//!
//! Slot contents are loom `UnsafeCell`s, so a read that races with the writer's next write into
//! the same slot (a torn read) fails the model. The futex is modelled without a timeout
//! (`wait.rs`), so a lost wake-up leaves a thread blocked for ever, which loom reports as a
//! deadlock. The waits take no deadline here: the model has no clock.
//!
//! ```text
//! RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --lib --release channel::
//! ```

use std::time::Duration;

use super::shm::ring::test_slots::Slots;
use super::shm::ring::{self, HeapRing, RingError, RingMemory, RingReader, RingWriter};
use crate::sync::{Arc, AtomicU32, UnsafeCell, thread};

/// Under loom the backoff yields once and then sleeps, whatever the budget.
const SPIN: Duration = Duration::ZERO;

fn value(seq: u64) -> u64 {
    seq * 10 + 7
}

fn write(writer: &mut RingWriter<Arc<HeapRing>>, slots: &Slots, messages: u64) {
    for expected in 0..messages {
        let seq = writer.reserve(None).unwrap();
        assert_eq!(seq, expected);
        slots.write(seq, value(seq));
        writer.publish();
    }
}

fn read(reader: &mut RingReader<Arc<HeapRing>>, slots: &Slots, messages: u64) {
    for expected in 0..messages {
        let seq = reader.acquire(None).unwrap().0;
        assert_eq!(seq, expected);
        assert_eq!(slots.read(seq), value(seq));
        reader.release(seq);
    }
}

/// The writer laps a depth-2 ring, so it must sleep until the reader releases; the reader
/// sleeps until data comes; the writer's drop (close) wakes the reader's last wait.
#[test]
fn one_reader_three_messages() {
    loom::model(|| {
        let ring = HeapRing::new(2, 1);
        let slots = Arc::new(Slots::new(2));
        let mut reader = RingReader::attach(ring.clone(), 0, SPIN).unwrap();
        let consumer = {
            let slots = slots.clone();
            thread::spawn(move || {
                read(&mut reader, &slots, 3);
                assert!(matches!(reader.acquire(None), Err(RingError::Closed)));
            })
        };
        let mut writer = RingWriter::attach(ring, SPIN).unwrap();
        write(&mut writer, &slots, 3);
        drop(writer);
        consumer.join().unwrap();
    });
}

/// With one slot, message 1 may be written only after *both* readers released message 0.
#[test]
fn two_readers_two_messages() {
    loom::model(|| {
        let ring = HeapRing::new(1, 2);
        let slots = Arc::new(Slots::new(1));
        let consumers: Vec<_> = (0..2)
            .map(|index| {
                let mut reader = RingReader::attach(ring.clone(), index, SPIN).unwrap();
                let slots = slots.clone();
                thread::spawn(move || {
                    read(&mut reader, &slots, 2);
                    // Keep the reader (its drop closes the ring) until the writer is done.
                    reader
                })
            })
            .collect();
        let mut writer = RingWriter::attach(ring, SPIN).unwrap();
        write(&mut writer, &slots, 2);
        for consumer in consumers {
            drop(consumer.join().unwrap());
        }
    });
}

/// Payload memory with a pin count, as the shared-memory channel's blocks have.
struct Block {
    pins: AtomicU32,
    data: UnsafeCell<u64>,
}

// SAFETY: the pin protocol under test orders every access to `data`; the model checks it.
unsafe impl Sync for Block {}

/// A reader pins message 0's payload, releases the slot and hands the payload to another
/// thread that reads it later; meanwhile the writer reuses the slot for message 1. The writer
/// must put message 1 in another block while the pin holds (else the late read is torn, which
/// loom reports as a race on `data`), and may reuse the first block once it is unpinned.
#[test]
fn pinned_payload_outlives_its_slot() {
    loom::model(|| {
        let ring = HeapRing::new(1, 1);
        // Slot contents: the index of the block holding the slot's message.
        let slots = Arc::new(Slots::new(1));
        let blocks: Arc<[Block; 2]> = Arc::new(std::array::from_fn(|_| Block {
            pins: AtomicU32::new(0),
            data: UnsafeCell::new(0),
        }));
        let mut reader = RingReader::attach(ring.clone(), 0, SPIN).unwrap();
        let consumer = {
            let (slots, blocks) = (slots.clone(), blocks.clone());
            thread::spawn(move || {
                let seq = reader.acquire(None).unwrap().0;
                let kept = slots.read(seq) as usize;
                ring::pin(&blocks[kept].pins);
                reader.release(seq);
                let holder = {
                    let blocks = blocks.clone();
                    thread::spawn(move || {
                        // SAFETY: pinned: the writer does not write this block until unpinned.
                        let v = blocks[kept].data.with(|d| unsafe { *d });
                        assert_eq!(v, value(0));
                        ring::unpin(&blocks[kept].pins);
                    })
                };
                let seq = reader.acquire(None).unwrap().0;
                let block = slots.read(seq) as usize;
                // SAFETY: the slot is acquired and its block was written before the publish.
                let v = blocks[block].data.with(|d| unsafe { *d });
                assert_eq!(v, value(seq));
                reader.release(seq);
                holder.join().unwrap();
                reader
            })
        };
        let mut writer = RingWriter::attach(ring, SPIN).unwrap();
        let mut current = 0;
        for seq in 0..2 {
            assert_eq!(writer.reserve(None).unwrap(), seq);
            if ring::is_pinned(&blocks[current].pins) {
                current = 1 - current;
                assert!(!ring::is_pinned(&blocks[current].pins));
            }
            // SAFETY: the block is unpinned and its slot reserved: nobody reads it.
            blocks[current]
                .data
                .with_mut(|d| unsafe { *d = value(seq) });
            slots.write(seq, current as u64);
            writer.publish();
        }
        drop(consumer.join().unwrap());
    });
}

/// A writer asleep on a full ring is woken by a close from another thread.
#[test]
fn close_wakes_a_blocked_writer() {
    loom::model(|| {
        let ring = HeapRing::new(1, 1);
        let reader = RingReader::attach(ring.clone(), 0, SPIN).unwrap();
        let mut writer = RingWriter::attach(ring.clone(), SPIN).unwrap();
        writer.reserve(None).unwrap();
        writer.publish();
        let closer = thread::spawn(move || drop(reader));
        assert!(matches!(writer.reserve(None), Err(RingError::Closed)));
        closer.join().unwrap();
    });
}

/// A reader asleep on an empty ring is woken by a close from another thread.
#[test]
fn close_wakes_a_blocked_reader() {
    loom::model(|| {
        let ring = HeapRing::new(1, 1);
        let mut reader = RingReader::attach(ring.clone(), 0, SPIN).unwrap();
        let closer = thread::spawn(move || ring.control().close());
        assert!(matches!(reader.acquire(None), Err(RingError::Closed)));
        closer.join().unwrap();
    });
}

/// The in-process queue: the writer laps a one-slot queue while the reader takes two values
/// out; the third stays in the queue and is dropped with it. A torn read (the writer's next
/// write racing the reader's move) is a race on the slot's cell; a value dropped twice or
/// never is a double drop or a leaked `Arc`, which loom reports.
#[test]
fn local_queue_hands_over_every_value_once() {
    loom::model(|| {
        let (mut tx, mut rx) = super::local::ring::queue::<Arc<u64>>(1);
        let consumer = thread::spawn(move || {
            let mut got = Vec::new();
            while got.len() < 2 {
                match rx.pop() {
                    Some(v) => got.push(*v),
                    None => thread::yield_now(),
                }
            }
            got
        });
        for seq in 0..3 {
            let mut v = Arc::new(value(seq));
            while let Err(back) = tx.push(v) {
                v = back;
                thread::yield_now();
            }
        }
        assert_eq!(consumer.join().unwrap(), vec![value(0), value(1)]);
    });
}

/// A reader that sees the writer gone and pops once more gets the writer's last value.
#[test]
fn local_queue_drains_after_the_writer_left() {
    loom::model(|| {
        let (mut tx, mut rx) = super::local::ring::queue::<u64>(2);
        let producer = thread::spawn(move || {
            tx.push(value(0)).unwrap();
            tx.push(value(1)).unwrap();
        });
        let mut got = Vec::new();
        loop {
            if let Some(v) = rx.pop() {
                got.push(v);
            } else if rx.is_abandoned() {
                break;
            } else {
                thread::yield_now();
            }
        }
        // Seeing the writer gone (acquire), the reader sees every value it pushed.
        while let Some(v) = rx.pop() {
            got.push(v);
        }
        assert_eq!(got, vec![value(0), value(1)]);
        producer.join().unwrap();
    });
}
