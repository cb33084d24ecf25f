//! The result pump of an async graph: one thread per graph reads every execution's outputs
//! as they arrive, buffers them (up to `max_buffered_results`) and wakes the tasks awaiting
//! them. Futures therefore work on any executor and in any runtime, including one that did
//! not exist when the graph was compiled; no thread is blocked per pending execution.
use super::GraphShared;
use crate::channel::ChanError;
use crate::error::{Error, Result};
use crate::value::Value;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

pub(super) fn start<I: Value>(shared: &Arc<GraphShared<I>>) -> Result<()> {
    let weak: Weak<GraphShared<I>> = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name(format!("adag-pump-{}", shared.id))
        .spawn(move || run(weak))
        .map(|_| ())
        .map_err(|e| Error::io("starting the async result pump", e))
}

/// How long the pump waits on the channels before it looks at the graph again (and lets
/// `execute_async` calls waiting for a place check their deadline): the channels' own sleep
/// slice, so an idle pump wakes no more often than before.
const LOOK_AGAIN: Duration = Duration::from_millis(100);

/// Reads execution after execution straight from the output channels, whose waits (spin,
/// then futex) wake the pump when a result arrives: nothing else needs to tell it that an
/// execution was submitted. Outputs are read as they become ready and an execution fails at
/// once when one of them carries an error (see `gather`).
///
/// The channels are shared (`GraphShared::reader`) with threads that await a result and read
/// it themselves (`RefOwner::poll_reading`): while they do, the pump stands aside, unless a
/// future or a submission waits on it. The graph is borrowed (upgraded) for one read at a
/// time, so an idle pump never keeps a dropped graph alive past one [`LOOK_AGAIN`]; teardown
/// closes the channels, which ends it.
fn run<I: Value>(weak: Weak<GraphShared<I>>) {
    loop {
        let Some(shared) = weak.upgrade() else { return };
        {
            // Wait for room in the result buffer (results stay in the channels meanwhile,
            // which counts them as in flight, as in sync mode), and for readers on other
            // threads to be done.
            let mut r = shared.results.lock();
            loop {
                if shared.torn.load(Ordering::Acquire) {
                    return;
                }
                if r.buffer.len() >= shared.opts.max_buffered_results {
                    shared.room.wait_for(&mut r, LOOK_AGAIN);
                    // Those waiting for a place look at their deadline again.
                    for w in std::mem::take(&mut r.room_wakers) {
                        w.wake();
                    }
                } else if let Some(aside) = shared.pump_stands_aside(&r) {
                    shared.room.wait_for(&mut r, aside.min(LOOK_AGAIN));
                } else {
                    break;
                }
            }
        }
        let mut gather = shared.reader.lock();
        // Teardown clears the channels under this lock, after marking the graph torn.
        if shared.torn.load(Ordering::Acquire) {
            return;
        }
        // A thread reading directly may have moved on since the look above.
        let exec = shared.next_read.load(Ordering::Acquire);
        match shared.read_exec(&mut gather, exec, Some(Instant::now() + LOOK_AGAIN), None) {
            Ok(_) => {}
            Err((_, ChanError::Timeout)) => {
                drop(gather);
                shared.wake_room();
            }
            // Closed: the graph was torn down.
            Err(_) => return,
        }
    }
}
