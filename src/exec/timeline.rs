//! The timeline of a compiled graph: every read, compute, write and communicator operation of
//! every actor, with its execution, start and end on the host's monotonic clock, exported as
//! Chrome-trace JSON (Perfetto, `chrome://tracing`). See `docs/observability.md`.
use crate::error::{Error, Result};
use serde_json::json;
use std::path::Path;

/// What an operation of an actor's schedule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Take the execution's value of an edge from its channel (includes waiting for it).
    Read,
    /// Run the actor's method.
    Compute,
    /// Send a result to its channels (includes waiting for room).
    Write,
    /// A communicator operation: a tensor send or receive, or a collective.
    Comm,
}

impl OpKind {
    pub(crate) fn from_name(kind: &str) -> OpKind {
        match kind {
            "read" => OpKind::Read,
            "compute" => OpKind::Compute,
            "write" => OpKind::Write,
            _ => OpKind::Comm,
        }
    }

    /// `read`, `compute`, `write` or `comm`.
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Compute => "compute",
            OpKind::Write => "write",
            OpKind::Comm => "comm",
        }
    }
}

/// One operation of one actor for one execution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimelineEvent {
    /// The actor's name.
    pub actor: String,
    /// The actor's id (its track).
    pub actor_id: u64,
    /// The process it ran in (the driver's for thread actors), on its host.
    pub pid: u32,
    /// Its host (0: the driver's).
    pub host: u64,
    /// What the operation does.
    pub kind: OpKind,
    /// The method (compute), or the node whose value is read or written.
    pub name: String,
    /// Its index in the actor's schedule.
    pub op: u32,
    /// The execution (0 for the first `execute`).
    pub exec: u64,
    /// Start, in nanoseconds of the driver's `CLOCK_MONOTONIC` (one clock for every process
    /// of a host; another host's records are shifted by its estimated offset, see
    /// [`Timeline::clocks`]).
    pub start_ns: u64,
    /// End, on the same clock.
    pub end_ns: u64,
}

/// The recorded operations of a graph, ordered by start.
///
/// ```
/// use adag::{CompileOptions, Dag, Placement, Runtime};
///
/// struct Inc;
/// #[adag::actor]
/// impl Inc {
///     fn new() -> Self { Inc }
///     fn inc(&mut self, x: u64) -> u64 { x + 1 }
/// }
///
/// let rt = Runtime::new().unwrap();
/// let a = rt.spawn::<Inc>(Placement::Thread, ()).unwrap();
/// let dag = Dag::<u64>::new();
/// let graph = dag.compile(a.inc(dag.input()), CompileOptions::default().timeline(true)).unwrap();
/// for i in 0..3 {
///     graph.execute(i).unwrap().get().unwrap();
/// }
/// // Teardown waits for every loop to stop: every operation is recorded by then.
/// graph.teardown().unwrap();
/// let timeline = graph.timeline();
/// // One read, one compute and one write per execution.
/// assert_eq!(timeline.events.len(), 9);
/// let json = timeline.to_chrome_json();
/// assert!(json.contains("\"traceEvents\""));
/// ```
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// Every operation recorded, ordered by start.
    pub events: Vec<TimelineEvent>,
    /// Operations that did not fit an actor's buffer (the first ones are kept), and those of
    /// a host whose clock offset was not estimated yet.
    pub dropped: u64,
    /// The clock of each other host whose actors are on the timeline: how far it is from the
    /// driver's (subtracted from their records) and how sure that is.
    pub clocks: Vec<HostClock>,
}

/// Another host's clock on a timeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostClock {
    /// The host's id.
    pub host: u64,
    /// Its name.
    pub name: String,
    /// Its clock minus the driver's, in nanoseconds (least-delay sample of the heartbeats).
    pub offset_ns: i64,
    /// The true offset lies within `offset_ns ± bound_ns`: slices of that host are placed
    /// this exactly against the driver's.
    pub bound_ns: u64,
}

impl Timeline {
    /// The timeline as Chrome-trace JSON: one process per OS process, one thread (track) per
    /// actor, one complete slice (`"ph": "X"`) per operation, named `actor.method` for a
    /// compute and `read node` / `write node` for the others, with the execution in `args`.
    /// Times are microseconds since the first operation.
    pub fn to_chrome_json(&self) -> String {
        let base = self.events.iter().map(|e| e.start_ns).min().unwrap_or(0);
        let us = |ns: u64| (ns - base) as f64 / 1000.0;
        let mut out = Vec::with_capacity(self.events.len() + 8);
        let mut named = std::collections::BTreeSet::new();
        let driver = std::process::id();
        // Process ids of other hosts may equal this host's: each host's get a range of their own.
        let track = |e: &TimelineEvent| (e.host << 32) | u64::from(e.pid);
        for e in &self.events {
            if named.insert((track(e), e.actor_id)) {
                out.push(
                    json!({"ph": "M", "name": "thread_name", "pid": track(e), "tid": e.actor_id,
                    "args": {"name": e.actor}}),
                );
                let process = match self.clocks.iter().find(|c| c.host == e.host) {
                    _ if e.host == 0 && e.pid == driver => format!("driver (pid {})", e.pid),
                    None => format!("worker {} (pid {})", e.actor, e.pid),
                    Some(c) => format!(
                        "worker {} (pid {}) on host {}, clock {:+.3} ms ± {:.3} ms",
                        e.actor,
                        e.pid,
                        c.name,
                        c.offset_ns as f64 / 1e6,
                        c.bound_ns as f64 / 1e6
                    ),
                };
                out.push(json!({"ph": "M", "name": "process_name", "pid": track(e),
                    "args": {"name": process}}));
            }
            let name = match e.kind {
                OpKind::Compute => format!("{}.{}", e.actor, e.name),
                kind => format!("{} {}", kind.as_str(), e.name),
            };
            out.push(json!({
                "ph": "X", "name": name, "cat": e.kind.as_str(),
                "pid": track(e), "tid": e.actor_id,
                "ts": us(e.start_ns), "dur": (e.end_ns.saturating_sub(e.start_ns)) as f64 / 1000.0,
                "args": {"exec": e.exec, "actor": e.actor, "op": e.op},
            }));
        }
        json!({
            "traceEvents": out,
            "displayTimeUnit": "ns",
            "otherData": {
                "clock": "CLOCK_MONOTONIC of the driver's host",
                "base_ns": base,
                "dropped": self.dropped,
                "host_clocks": self.clocks.iter().map(|c| json!({
                    "host": c.host, "name": c.name,
                    "offset_ns": c.offset_ns, "bound_ns": c.bound_ns,
                })).collect::<Vec<_>>(),
            },
        })
        .to_string()
    }

    /// Write [`Timeline::to_chrome_json`] to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_chrome_json())
            .map_err(|e| Error::io(format!("writing the timeline to {}", path.display()), e))
    }
}
