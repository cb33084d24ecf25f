//! The result pump of an async graph: one thread per graph reads every execution's outputs
//! as they arrive, buffers them (up to `max_buffered_results`) and wakes the tasks awaiting
//! them. Futures therefore work on any executor and in any runtime, including one that did
//! not exist when the graph was compiled; no thread is blocked per pending execution.
use super::GraphShared;
use super::gather::Gather;
use crate::channel::ChanError;
use crate::error::{Error, Result};
use crate::value::Value;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

pub(super) fn start<I: Value>(shared: &Arc<GraphShared<I>>) -> Result<()> {
    let edges = std::mem::take(&mut shared.reader.lock().edges);
    let weak: Weak<GraphShared<I>> = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name(format!("adag-pump-{}", shared.id))
        .spawn(move || run(weak, Gather::new(edges)))
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
/// once when one of them carries an error (see `gather`). The graph is only borrowed
/// (upgraded) between reads, so that an idle pump never keeps a dropped graph alive;
/// teardown closes the channels, which ends it.
fn run<I: Value>(weak: Weak<GraphShared<I>>, mut gather: Gather) {
    loop {
        let exec = {
            let Some(shared) = weak.upgrade() else { return };
            // Wait for room in the result buffer: results stay in the channels meanwhile,
            // which counts them as in flight, as in sync mode.
            let mut r = shared.results.lock();
            while r.buffer.len() >= shared.opts.max_buffered_results
                && !shared.torn.load(Ordering::Acquire)
            {
                shared.room.wait_for(&mut r, LOOK_AGAIN);
                // Those waiting for a place look at their deadline again.
                for w in std::mem::take(&mut r.room_wakers) {
                    w.wake();
                }
            }
            drop(r);
            shared.next_read.load(Ordering::Acquire)
        };
        let results = loop {
            match gather.read(exec, Some(Instant::now() + LOOK_AGAIN)) {
                Ok(results) => break results,
                Err((_, ChanError::Timeout)) => {
                    let Some(shared) = weak.upgrade() else { return };
                    shared.drained.store(gather.drained(), Ordering::Release);
                    shared.wake_room();
                }
                // Closed: the graph was torn down.
                Err(_) => return,
            }
        };
        let Some(shared) = weak.upgrade() else { return };
        shared.store(exec, results, None, gather.drained());
    }
}
