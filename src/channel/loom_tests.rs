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

use super::ring::test_slots::Slots;
use super::ring::{HeapRing, RingError, RingMemory, RingReader, RingWriter};
use crate::sync::{Arc, thread};

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
        let seq = reader.acquire(None).unwrap();
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

/// A message kept as a lease and released on another thread, while the reader goes on.
#[test]
fn lease_released_on_another_thread() {
    loom::model(|| {
        let ring = HeapRing::new(2, 1);
        let slots = Arc::new(Slots::new(2));
        let mut reader = RingReader::attach(ring.clone(), 0, SPIN).unwrap();
        let consumer = {
            let slots = slots.clone();
            thread::spawn(move || {
                let seq = reader.acquire(None).unwrap();
                let lease = reader.lease(seq);
                let dropper = {
                    let slots = slots.clone();
                    thread::spawn(move || {
                        assert_eq!(slots.read(0), value(0));
                        drop(lease);
                    })
                };
                let seq = reader.acquire(None).unwrap();
                assert_eq!(slots.read(seq), value(seq));
                reader.release(seq);
                dropper.join().unwrap();
                reader
            })
        };
        let mut writer = RingWriter::attach(ring, SPIN).unwrap();
        // The third message needs slot 0 back: released by the lease, on the other thread.
        write(&mut writer, &slots, 3);
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
