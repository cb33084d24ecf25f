//! Reading one execution's outputs as they become ready, with fast fail.
//!
//! An execution's outputs arrive on several edges, in no particular order. Reading them in
//! output order would make an error on the second output wait behind a slow first one (and
//! hand the slow output's value out although its execution failed). So the driver waits on
//! the first unread edge in short slices and, whenever a slice passes, tries every other
//! unread edge once: the first error seen fails the whole execution at once, every one of its
//! outputs carrying that error ([`Failed`]). The messages of that execution still on their way
//! are *leftovers*: each edge remembers which execution its next message belongs to
//! ([`OutputEdge::next`]), and later reads discard the messages of executions already settled.
//!
//! A graph with one output edge (the common case) reads it with the caller's whole deadline:
//! no slices, no tries, nothing added to the fast path.
use super::output::{EdgeRead, OutputReader};
use super::refs::Failed;
use crate::channel::ChanError;
use crate::error::TaskError;
use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// First wait on one edge while others are unread: an error on another edge is seen at most
/// this late at first; the slice doubles while nothing arrives, up to [`SLICE_MAX`], so that a
/// long wait costs a wake-up only every [`SLICE_MAX`].
const SLICE_MIN: Duration = Duration::from_millis(1);
const SLICE_MAX: Duration = Duration::from_millis(20);

/// One output edge of the graph and where its reader stands.
pub(crate) struct OutputEdge {
    pub(crate) reader: Box<dyn OutputReader>,
    /// The output indices this edge feeds.
    pub(crate) outputs: Vec<usize>,
    /// The execution the edge's next message belongs to: behind the execution being read
    /// while leftovers of a failed execution are still on their way.
    pub(crate) next: u64,
}

/// One execution's outputs, by output index.
pub(crate) type Results = Vec<Option<Box<dyn Any + Send>>>;

/// The output edges and the outputs of the execution being read (kept across timeouts).
pub(crate) struct Gather {
    pub(crate) edges: Vec<OutputEdge>,
    partial: Results,
    n_outputs: usize,
}

impl Gather {
    pub(crate) fn new(edges: Vec<OutputEdge>) -> Self {
        let n_outputs = edges.iter().map(|e| e.outputs.len()).sum();
        Gather {
            edges,
            partial: Vec::new(),
            n_outputs,
        }
    }

    /// The oldest execution with a message still in an output channel (its leftovers
    /// included): executions from there on count as in flight.
    pub(crate) fn drained(&self) -> u64 {
        self.edges.iter().map(|e| e.next).min().unwrap_or(u64::MAX)
    }

    /// Whether an execution was read part of the way (and waits to be finished).
    pub(crate) fn reading(&self) -> bool {
        !self.partial.is_empty()
    }

    /// Stop: drop the readers and whatever was read.
    pub(crate) fn clear(&mut self) {
        self.edges.clear();
        self.partial.clear();
    }

    /// Reads the outputs of execution `exec` (the oldest unsettled one) until all are in, or
    /// one carries an error (then every output is a [`Failed`] with it), or `deadline` passes.
    /// What was read is kept across a timeout. A channel error names the edge it came from.
    pub(crate) fn read(
        &mut self,
        exec: u64,
        deadline: Option<Instant>,
    ) -> Result<Results, (usize, ChanError)> {
        if self.partial.is_empty() {
            self.partial = (0..self.n_outputs).map(|_| None).collect();
        }
        let mut slice = SLICE_MIN;
        loop {
            let mut unread = (0..self.edges.len()).filter(|i| self.edges[*i].next <= exec);
            let Some(first) = unread.next() else { break };
            let alone = unread.next().is_none();
            let wait = if alone {
                deadline
            } else {
                let end = Instant::now() + slice;
                Some(deadline.map_or(end, |d| d.min(end)))
            };
            match self.read_edge(first, exec, wait) {
                Ok(Some(error)) => return Ok(self.fail(error)),
                Ok(None) => slice = SLICE_MIN,
                Err(ChanError::Timeout) if !alone => {
                    // The slice passed: look at every other unread edge once (also when the
                    // whole deadline passed, so that a try sees an error wherever it is).
                    let now = Instant::now();
                    for i in (0..self.edges.len()).filter(|i| *i != first) {
                        while self.edges[i].next <= exec {
                            match self.read_edge(i, exec, Some(crate::channel::passed())) {
                                Ok(Some(error)) => return Ok(self.fail(error)),
                                Ok(None) => {}
                                Err(ChanError::Timeout) => break,
                                Err(e) => return Err((i, e)),
                            }
                        }
                    }
                    if deadline.is_some_and(|d| now >= d) {
                        return Err((first, ChanError::Timeout));
                    }
                    slice = (slice * 2).min(SLICE_MAX);
                }
                Err(e) => return Err((first, e)),
            }
        }
        Ok(std::mem::take(&mut self.partial))
    }

    /// The fast path of a graph with one output: reads execution `exec`'s message straight
    /// into `slot` (an `Option<Msg<T>>`, see [`OutputReader::read_into`]), with no list, no
    /// box and no filing. `None` where it does not apply (several outputs, an execution read
    /// part of the way, leftovers ahead of `exec`, another type in `slot`): read as usual.
    pub(crate) fn read_alone(
        &mut self,
        exec: u64,
        slot: &mut dyn Any,
        deadline: Option<Instant>,
    ) -> Option<Result<(), ChanError>> {
        let [edge] = &mut self.edges[..] else {
            return None;
        };
        if self.n_outputs != 1 || !self.partial.is_empty() || edge.next != exec {
            return None;
        }
        match edge.reader.read_into(slot, deadline) {
            Ok(false) => None,
            Ok(true) => {
                edge.next += 1;
                Some(Ok(()))
            }
            Err(e) => Some(Err(e)),
        }
    }

    /// Reads the leftovers of executions before `upto` (waiting up to `deadline`), so that
    /// their places in the channels come free.
    pub(crate) fn drain(
        &mut self,
        upto: u64,
        deadline: Option<Instant>,
    ) -> Result<(), (usize, ChanError)> {
        for i in 0..self.edges.len() {
            while self.edges[i].next < upto {
                self.read_edge(i, upto, deadline).map_err(|e| (i, e))?;
            }
        }
        Ok(())
    }

    /// Reads edge `i`'s next message: a leftover of a settled execution is dropped; a message
    /// of `exec` is kept. Returns the message's error, if it carries one.
    fn read_edge(
        &mut self,
        i: usize,
        exec: u64,
        deadline: Option<Instant>,
    ) -> Result<Option<Arc<TaskError>>, ChanError> {
        let edge = &mut self.edges[i];
        let EdgeRead { values, error } = edge.reader.read(edge.outputs.len(), deadline)?;
        let of = edge.next;
        edge.next += 1;
        if of < exec {
            return Ok(None);
        }
        for (out, v) in edge.outputs.iter().zip(values) {
            self.partial[*out] = Some(v);
        }
        Ok(error)
    }

    /// Settles execution `exec` as failed with `error`: every output carries it, the values
    /// read are dropped, and the edges not read yet keep their messages as leftovers.
    fn fail(&mut self, error: Arc<TaskError>) -> Results {
        self.partial.clear();
        (0..self.n_outputs)
            .map(|_| Some(Box::new(Failed(error.clone())) as Box<dyn Any + Send>))
            .collect()
    }
}
