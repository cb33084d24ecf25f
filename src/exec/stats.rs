//! Where a graph's time and messages went: the statistics of `CompiledGraph::stats()` and the
//! driver's side of the timeline. Actors keep their own counters (`actor/observe.rs`); thread
//! actors' are read in place, worker processes' are asked for over the control socket, and
//! those of workers on other hosts through their host's agent (both collected once more at
//! teardown, so that a torn-down graph still reports them).
use super::timeline::{HostClock, OpKind, Timeline, TimelineEvent};
use crate::actor::HandleCore;
use crate::actor::channels::GraphChannels;
use crate::actor::host::op_name;
use crate::actor::link::ActorLink;
use crate::actor::observe::{EdgeCount, Observation, Recorder};
use crate::compile::plan::GraphPlan;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How long the driver waits for a worker to report its counters.
const OBSERVE_WAIT: Duration = Duration::from_secs(2);

/// A worker's report, asked for over its control socket or through its host's agent; `None`
/// for a thread actor (read in place) and for a worker that is dead or silent past the wait.
fn ask_worker(link: &ActorLink) -> Option<Observation> {
    match link {
        ActorLink::Process(link) => link.observe(OBSERVE_WAIT),
        ActorLink::Remote(link) => link.observe(OBSERVE_WAIT),
        ActorLink::Thread(_) => None,
    }
}

/// A snapshot of a compiled graph's activity ([`CompiledGraph::stats`](crate::CompiledGraph::stats)).
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
/// let graph = dag.compile(a.inc(dag.input()), CompileOptions::default()).unwrap();
/// for i in 0..5 {
///     graph.execute(i).unwrap().get().unwrap();
/// }
/// let stats = graph.stats();
/// assert_eq!(stats.executions_submitted, 5);
/// assert_eq!(stats.executions_in_flight, 0);
/// // The input edge and the output edge carried one message per execution.
/// assert!(stats.edges.iter().all(|e| e.messages == 5));
/// // An actor counts an execution once its last operation is done: final after teardown.
/// graph.teardown().unwrap();
/// assert_eq!(graph.stats().actors[0].executions, 5);
/// ```
#[derive(Debug, Clone, Default)]
pub struct GraphStats {
    /// The graph's id.
    pub graph: u64,
    /// Executions submitted so far.
    pub executions_submitted: u64,
    /// Executions submitted whose results the driver has not read from the output channels.
    pub executions_in_flight: u64,
    /// Results read but not yet claimed by their refs.
    pub results_buffered: usize,
    /// Every edge that has a channel, in the plan's order.
    pub edges: Vec<EdgeStats>,
    /// Every actor of the graph.
    pub actors: Vec<ActorStats>,
}

/// What one edge carried.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EdgeStats {
    /// The edge's id.
    pub edge: u64,
    /// The node that produces it (`input`, `Actor.method`, ...).
    pub label: String,
    /// Messages written (one per execution).
    pub messages: u64,
    /// Bytes its writer sent, counted by the writer: for a channel edge, the bytes encoded
    /// into shared memory or onto the network (0 for edges between threads: values move as
    /// they are); for a communicator edge (`Transport::communicator()`, `Transport::custom`),
    /// the tensor's bytes once for each reader it was sent to through the communicator
    /// (whether the readers are threads or processes), plus the metadata encoded into its
    /// channel. A reader on the writer's own actor adds nothing.
    pub bytes: u64,
    /// Times its shared-memory channel grew for a larger message.
    pub growths: u64,
}

/// What one actor did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActorStats {
    /// The actor's name.
    pub actor: String,
    /// Its worker's pid (`None` for thread actors; for an actor on another host, the pid
    /// there).
    pub pid: Option<u32>,
    /// Executions it completed.
    pub executions: u64,
    /// Time spent in its methods (compute operations). Without a timeline the methods of one
    /// execution in 16 are timed and the sum is scaled to all executions (two clock reads per
    /// call would show in a microsecond round trip); with a timeline every call is timed
    /// (actors on other hosts record no timeline, so theirs is always sampled).
    pub busy: Duration,
    /// Lines of its worker's output dropped because the driver's output was too slow (0 for
    /// an actor on another host: its output goes to its agent's, not the driver's).
    pub log_lines_dropped: u64,
    /// Tracing events of its worker dropped because the socket to its driver (for an actor on
    /// another host, its agent) was full.
    pub events_dropped: u64,
    /// Whether the counters are known: false for a worker that is dead or did not answer
    /// (on another host: also when its host is lost or silent).
    pub reported: bool,
}

/// The driver's side of a graph's observability.
pub(crate) struct Observers {
    plan: Arc<GraphPlan>,
    pub(crate) timeline: bool,
    /// `ADAG_TIMELINE`: where to write the timeline at teardown.
    pub(crate) timeline_path: Option<PathBuf>,
    /// Thread actors' recorders, by actor id.
    local: HashMap<u64, Recorder>,
    /// Worker processes' last reports, by actor id (collected at teardown).
    last: Mutex<HashMap<u64, Observation>>,
}

impl Observers {
    pub(crate) fn new(plan: Arc<GraphPlan>, actors: &[HandleCore], timeline: bool) -> Self {
        let timeline_path = std::env::var_os("ADAG_TIMELINE")
            .filter(|p| !p.is_empty())
            .map(|p| {
                let p = p
                    .to_string_lossy()
                    .replace("{graph}", &plan.graph.to_string());
                PathBuf::from(p)
            });
        let timeline = timeline || timeline_path.is_some();
        let local = actors
            .iter()
            .filter(|a| matches!(a.0.link, ActorLink::Thread(_)))
            .map(|a| (a.id(), Recorder::new(timeline)))
            .collect();
        Observers {
            plan,
            timeline,
            timeline_path,
            local,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// The recorder a thread actor's loop writes.
    pub(crate) fn recorder(&self, actor: u64) -> Recorder {
        self.local.get(&actor).cloned().unwrap_or_default()
    }

    /// One report per actor: read in place for threads, asked for from workers (or the last
    /// report, once the graph is torn down).
    fn reports(&self, actors: &[HandleCore], live: bool) -> Vec<Option<Observation>> {
        actors
            .iter()
            .map(|a| match &a.0.link {
                ActorLink::Thread(_) => self.local.get(&a.id()).map(|r| r.observe(None)),
                ActorLink::Process(_) | ActorLink::Remote(_) => {
                    if live && let Some(o) = ask_worker(&a.0.link) {
                        return Some(o);
                    }
                    self.last.lock().get(&a.id()).cloned()
                }
            })
            .collect()
    }

    /// At teardown, once the loops stopped: keep the workers' final reports.
    pub(crate) fn collect_final(&self, actors: &[HandleCore]) {
        for a in actors {
            if let Some(o) = ask_worker(&a.0.link) {
                self.last.lock().insert(a.id(), o);
            }
        }
        if let Some(path) = &self.timeline_path {
            match self.timeline(actors, false).write(path) {
                Ok(()) => {
                    tracing::info!(graph = self.plan.graph, path = %path.display(), "timeline written")
                }
                Err(e) => {
                    tracing::warn!(graph = self.plan.graph, error = %e, "cannot write the timeline")
                }
            }
        }
    }

    pub(crate) fn stats(
        &self,
        actors: &[HandleCore],
        chans: &GraphChannels,
        live: bool,
    ) -> (Vec<EdgeStats>, Vec<ActorStats>) {
        let reports = self.reports(actors, live);
        let mut counts: HashMap<u64, EdgeCount> = HashMap::new();
        let mut add = |(edge, c): &(u64, EdgeCount)| {
            let e = counts.entry(*edge).or_default();
            e.messages += c.messages;
            e.bytes += c.bytes;
            e.growths += c.growths;
        };
        // The driver's own writers (inputs) and thread actors' share the driver's channels.
        chans.counters().counts().iter().for_each(&mut add);
        // Workers (here or on other hosts) count the writers they opened; no writer is counted
        // twice, as each edge has one writer and relays count nothing.
        for (a, r) in actors.iter().zip(&reports) {
            if let (ActorLink::Process(_) | ActorLink::Remote(_), Some(r)) = (&a.0.link, r) {
                r.edges.iter().for_each(&mut add);
            }
        }
        let edges = self
            .plan
            .edges
            .values()
            .filter(|e| e.has_channel())
            .map(|e| {
                let c = counts.get(&e.id).copied().unwrap_or_default();
                EdgeStats {
                    edge: e.id,
                    label: e.label.clone(),
                    messages: c.messages,
                    bytes: c.bytes,
                    growths: c.growths,
                }
            })
            .collect();
        let actors = actors
            .iter()
            .zip(reports)
            .map(|(a, r)| {
                let (pid, log_lines_dropped) = match &a.0.link {
                    ActorLink::Process(link) => (Some(link.pid()), link.log_lines_dropped()),
                    ActorLink::Remote(link) => (Some(link.pid()), 0),
                    ActorLink::Thread(_) => (None, 0),
                };
                let r_ok = r.is_some();
                let r = r.unwrap_or_default();
                ActorStats {
                    actor: a.name().to_string(),
                    pid,
                    executions: r.executions,
                    busy: Duration::from_nanos(r.busy_ns),
                    log_lines_dropped,
                    events_dropped: r.events_dropped,
                    reported: r_ok,
                }
            })
            .collect();
        (edges, actors)
    }

    pub(crate) fn timeline(&self, actors: &[HandleCore], live: bool) -> Timeline {
        let mut t = Timeline::default();
        if !self.timeline {
            return t;
        }
        let reports = self.reports(actors, live);
        for (a, r) in actors.iter().zip(reports) {
            let Some(r) = r else { continue };
            let Some(mine) = self.plan.actors.iter().find(|p| p.actor == a.id()) else {
                continue;
            };
            let names: Vec<(&'static str, String)> =
                mine.ops.iter().map(|op| op_name(&self.plan, op)).collect();
            // Another host's records are on its own clock: shifted by its offset to the
            // driver's, estimated over the heartbeats (the estimate and its bound go in the
            // timeline). A host without an estimate yet (its first heartbeat not answered) is
            // left out rather than misplaced.
            let (pid, host, shift) = match &a.0.link {
                ActorLink::Process(link) => (link.pid(), 0, 0),
                ActorLink::Thread(_) => (std::process::id(), 0, 0),
                ActorLink::Remote(link) => {
                    let host = link.host();
                    let (name, clock) = link.cluster().clock_of(host);
                    let Some(clock) = clock else {
                        t.dropped += r.timeline.len() as u64 + r.timeline_dropped;
                        continue;
                    };
                    if !t.clocks.iter().any(|c| c.host == host) {
                        t.clocks.push(HostClock {
                            host,
                            name,
                            offset_ns: clock.offset_ns,
                            bound_ns: clock.bound_ns,
                        });
                    }
                    (link.pid(), host, clock.offset_ns)
                }
            };
            let on_driver_clock = |ns: u64| ns.saturating_add_signed(shift.saturating_neg());
            t.dropped += r.timeline_dropped;
            for rec in r.timeline {
                let Some((kind, name)) = names.get(rec.op as usize) else {
                    continue;
                };
                t.events.push(TimelineEvent {
                    actor: a.name().to_string(),
                    actor_id: a.id(),
                    pid,
                    host,
                    kind: OpKind::from_name(kind),
                    name: name.clone(),
                    op: rec.op,
                    exec: rec.exec,
                    start_ns: on_driver_clock(rec.start),
                    end_ns: on_driver_clock(rec.end),
                });
            }
        }
        t.events.sort_by_key(|e| (e.start_ns, e.actor_id, e.op));
        t
    }
}
