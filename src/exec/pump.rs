//! The result pump of an async graph: one thread per graph reads every execution's outputs
//! as they arrive, buffers them (up to `max_buffered_results`) and wakes the tasks awaiting
//! them. Futures therefore work on any executor and in any runtime, including one that did
//! not exist when the graph was compiled; no thread is blocked per pending execution.
use super::GraphShared;
use crate::error::{Error, Result};
use crate::value::Value;
use std::sync::{Arc, Weak};
use std::time::Duration;

pub(super) fn start<I: Value>(shared: &Arc<GraphShared<I>>) -> Result<()> {
    let edges = std::mem::take(&mut shared.reader.lock().edges);
    let weak: Weak<GraphShared<I>> = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name(format!("adag-pump-{}", shared.id))
        .spawn(move || run(weak, edges))
        .map(|_| ())
        .map_err(|e| Error::io("starting the async result pump", e))
}

/// Reads execution after execution straight from the output channels, whose waits (spin,
/// then futex) wake the pump when a result arrives: nothing else needs to tell it that an
/// execution was submitted. The graph is only borrowed (upgraded) between reads, so that an
/// idle pump never keeps a dropped graph alive; teardown closes the channels, which ends it.
fn run<I: Value>(weak: Weak<GraphShared<I>>, mut edges: Vec<super::OutputEdge>) {
    let n_outputs: usize = edges.iter().map(|e| e.outputs.len()).sum();
    loop {
        {
            let Some(shared) = weak.upgrade() else { return };
            // Wait for room in the result buffer: results stay in the channels meanwhile,
            // which counts them as in flight, as in sync mode.
            let mut r = shared.results.lock();
            while r.buffer.len() >= shared.opts.max_buffered_results
                && !shared.torn.load(std::sync::atomic::Ordering::Acquire)
            {
                shared.room.wait_for(&mut r, Duration::from_millis(100));
            }
        }
        let mut results: Vec<Option<Box<dyn std::any::Any + Send>>> =
            (0..n_outputs).map(|_| None).collect();
        for edge in edges.iter_mut() {
            // Blocks until the value arrives or the graph's channels close.
            match edge.reader.read(edge.outputs.len(), None) {
                Ok(values) => {
                    for (out, v) in edge.outputs.iter().zip(values) {
                        results[*out] = Some(v);
                    }
                }
                Err(_) => return,
            }
        }
        let Some(shared) = weak.upgrade() else { return };
        let exec = shared.next_read.load(std::sync::atomic::Ordering::Acquire);
        shared.store(exec, results, None);
    }
}
