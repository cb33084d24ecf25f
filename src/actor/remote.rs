//! Actors on other hosts: the driver's link to an actor whose worker runs on a joined host
//! ([`RemoteLink`]), and what a host's agent does for the driver ([`AgentWorkers`]): start
//! workers there with the same rules as here, serve one-off calls, report deaths.
use super::call::{CallFailure, call_failure, decode_result, encode_args};
use super::channels::{ChannelSizes, GraphChannels};
use super::observe::Observation;
use super::worker::{ProcessLink, graphs};
use crate::cluster::agent::{AgentContext, AgentServices};
use crate::cluster::data::DataPlane;
use crate::cluster::driver::ClusterDriver;
use crate::cluster::wire::{AgentReply, AgentRequest, RemoteFailure};
use crate::compile::plan::{GraphPlan, Loc};
use crate::error::{Error, Result};
use crate::value::Value;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long a host waits for the connections and actors of a graph it installs.
pub(crate) const INSTALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a host waits at teardown for its actors to stop their loops.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// What the driver waits for an actor's report beyond the wait its agent gives the worker:
/// the round trip and the encoding of a few counters.
const OBSERVE_MARGIN: Duration = Duration::from_secs(2);

/// One host's part of a graph, as the driver sends it to that host's agent.
#[derive(Serialize, Deserialize)]
pub(crate) struct HostPart {
    pub plan: GraphPlan,
    pub host: u64,
    pub slot_bytes: u64,
    pub max_message_bytes: u64,
    pub spin_ns: u64,
    pub timeline: bool,
    /// Each host's data port (host 0's address may be unspecified: the driver's address as
    /// the agent reaches it, then).
    pub addrs: Vec<(u64, SocketAddr)>,
}

/// Install `part` on its host through the host's agent: returns once every actor of the
/// graph there installed its schedule.
pub(crate) fn install_on_host(cluster: &ClusterDriver, part: &HostPart) -> Result<()> {
    let host = part.host;
    let bytes = postcard::to_stdvec(part)
        .map_err(|e| Error::io(format!("encoding the part of host {host}"), e.to_string()))?;
    match cluster.request(
        host,
        AgentRequest::Install {
            graph: part.plan.graph,
            part: bytes,
        },
    ) {
        Ok(_) => Ok(()),
        Err(f) => Err(Error::compile(
            format!("the actors on {}", cluster.describe_host(host)),
            format!(
                "installing the graph there failed: {}",
                match f {
                    RemoteFailure::Spawn(m)
                    | RemoteFailure::Died(m)
                    | RemoteFailure::HostLost(m) => m,
                    other => format!("{other:?}"),
                }
            ),
        )),
    }
}

/// Close graph `graph` on host `host`; returns once its actors there stopped (or the host is
/// gone).
pub(crate) fn close_on_host(cluster: &ClusterDriver, host: u64, graph: u64) {
    let _ = cluster.request(host, AgentRequest::CloseGraph { graph });
}

/// The driver's link to an actor on another host.
pub(crate) struct RemoteLink {
    cluster: Arc<ClusterDriver>,
    host: u64,
    actor: u64,
    name: String,
    pid: u32,
    /// Why the worker died (or its host was lost), once it did.
    dead: Arc<Mutex<Option<String>>>,
}

fn remote_error(actor: &str, method: &str, failure: RemoteFailure) -> Error {
    match failure {
        RemoteFailure::NoSuchMethod => call_failure(actor, method, CallFailure::NoSuchMethod),
        RemoteFailure::BadArgs(m) => call_failure(actor, method, CallFailure::BadArgs(m)),
        RemoteFailure::Task(m) => call_failure(actor, method, CallFailure::Task(m)),
        RemoteFailure::Busy => call_failure(actor, method, CallFailure::Busy),
        RemoteFailure::Died(reason) | RemoteFailure::HostLost(reason) => Error::ActorDied {
            actor: actor.to_string(),
            reason,
        },
        RemoteFailure::NoSuchActor => Error::ActorDied {
            actor: actor.to_string(),
            reason: "its host no longer runs it".into(),
        },
        RemoteFailure::Spawn(message) => Error::Spawn {
            actor: actor.to_string(),
            message,
        },
        RemoteFailure::TimedOut(timeout) => Error::Timeout {
            what: format!("the host of actor {actor} to answer ({method})"),
            timeout,
            hint: "the host or its network is stalled; it is declared lost after the heartbeat timeout".into(),
        },
    }
}

impl RemoteLink {
    /// Start actor `id` on host `host` through its agent.
    pub(crate) fn spawn(
        cluster: Arc<ClusterDriver>,
        host: u64,
        id: u64,
        name: &str,
        type_name: &str,
        init: Vec<u8>,
        live_graph: Arc<Mutex<Option<u64>>>,
    ) -> Result<Self> {
        let dead = Arc::new(Mutex::new(None));
        // Told before the spawn is asked for, so that no early death goes unseen.
        let (flag, actor_name) = (dead.clone(), name.to_string());
        cluster.on_death(
            host,
            id,
            Box::new(move |why: &str| {
                *flag.lock() = Some(why.to_string());
                let graph = *live_graph.lock();
                if let Some(g) = graph {
                    let sink = graphs().lock().get(&g).and_then(Weak::upgrade);
                    if let Some(sink) = sink {
                        sink.actor_died(&actor_name, why);
                    }
                }
            }),
        );
        let reply = cluster.request(
            host,
            AgentRequest::Spawn {
                actor: id,
                name: name.to_string(),
                type_name: type_name.to_string(),
                init,
            },
        );
        match reply {
            Ok(AgentReply::Spawned { pid }) => Ok(RemoteLink {
                cluster,
                host,
                actor: id,
                name: name.to_string(),
                pid,
                dead,
            }),
            Ok(other) => {
                cluster.forget(host, id);
                Err(Error::Spawn {
                    actor: name.to_string(),
                    message: format!(
                        "{} answered {other:?} to a spawn",
                        cluster.describe_host(host)
                    ),
                })
            }
            Err(f) => {
                cluster.forget(host, id);
                Err(Error::Spawn {
                    actor: name.to_string(),
                    message: format!(
                        "on {}: {}",
                        cluster.describe_host(host),
                        remote_error(name, "new", f)
                    ),
                })
            }
        }
    }

    pub(crate) fn call<Args: Value, R: Value>(
        &self,
        actor: &str,
        method: &str,
        args: Args,
    ) -> Result<R> {
        if let Some(why) = self.dead.lock().clone() {
            return Err(Error::ActorDied {
                actor: actor.to_string(),
                reason: why,
            });
        }
        let args = encode_args(actor, method, &args)?;
        let reply = self.cluster.request(
            self.host,
            AgentRequest::Call {
                actor: self.actor,
                method: method.to_string(),
                args,
            },
        );
        let bytes = match reply {
            Ok(AgentReply::Returned(bytes)) => bytes,
            Ok(other) => {
                return Err(Error::Call {
                    actor: actor.to_string(),
                    method: method.to_string(),
                    message: format!("its host answered {other:?} to a call"),
                });
            }
            Err(f) => return Err(remote_error(actor, method, f)),
        };
        decode_result(
            actor,
            method,
            &bytes,
            "the host's worker returns another type (a stale binary there?)",
        )
    }

    pub(crate) fn kill(&self) -> Result<()> {
        match self
            .cluster
            .request(self.host, AgentRequest::Kill { actor: self.actor })
        {
            Ok(_) => Ok(()),
            // Already gone: killing it is done.
            Err(RemoteFailure::HostLost(_) | RemoteFailure::NoSuchActor) => Ok(()),
            Err(f) => Err(remote_error(&self.name, "kill", f)),
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The worker's counters of its current (or last) graph, through its host's agent;
    /// `None` if it is dead, its host is lost, or no answer came within `wait` (plus the
    /// round trip).
    pub(crate) fn observe(&self, wait: Duration) -> Option<Observation> {
        if self.dead.lock().is_some() {
            return None;
        }
        let request = AgentRequest::Observe {
            actor: self.actor,
            wait_ms: wait.as_millis() as u64,
        };
        let bytes = match self
            .cluster
            .request_within(self.host, request, wait + OBSERVE_MARGIN)
        {
            Ok(AgentReply::Observed(bytes)) => bytes?,
            Ok(other) => {
                tracing::debug!(actor = %self.name, reply = ?other, "unexpected answer to observe");
                return None;
            }
            Err(f) => {
                tracing::debug!(actor = %self.name, failure = ?f, "no report from the actor's host");
                return None;
            }
        };
        postcard::from_bytes(&bytes)
            .map_err(|e| {
                tracing::warn!(actor = %self.name, error = %e, "a report from another host does not decode (a different binary there?)");
            })
            .ok()
    }

    /// The host the actor runs on.
    pub(crate) fn host(&self) -> u64 {
        self.host
    }

    /// The cluster the actor's host joined.
    pub(crate) fn cluster(&self) -> &Arc<ClusterDriver> {
        &self.cluster
    }

    /// Why the actor is gone (its worker died or its host was lost), once it is.
    pub(crate) fn died(&self) -> Option<Error> {
        self.dead.lock().clone().map(|reason| Error::ActorDied {
            actor: self.name.clone(),
            reason,
        })
    }
}

impl Drop for RemoteLink {
    fn drop(&mut self) {
        self.cluster.forget(self.host, self.actor);
        self.cluster
            .notify(self.host, AgentRequest::Release { actor: self.actor });
    }
}

/// The workers a host's agent started for the driver.
pub(crate) struct AgentWorkers {
    workers: Mutex<HashMap<u64, Arc<ProcessLink>>>,
    reporter: crate::cluster::agent::DeathReporter,
    data: Arc<DataPlane>,
    driver_ip: IpAddr,
    /// The graphs installed on this host, by id.
    graphs: Arc<Mutex<HashMap<u64, HostGraph>>>,
}

/// A graph's part on this host: its channels here, and a signal (disconnected) once every
/// actor of it here stopped its schedule.
struct HostGraph {
    chans: Arc<GraphChannels>,
    stopped: crossbeam_channel::Receiver<()>,
}

/// The agent's services (see `cluster::agent`).
pub(crate) fn agent_services(ctx: AgentContext) -> Box<dyn AgentServices> {
    super::logs::send_to_driver(ctx.logs.clone());
    Box::new(AgentWorkers {
        workers: Mutex::new(HashMap::new()),
        reporter: ctx.deaths,
        data: ctx.data,
        driver_ip: ctx.driver_ip,
        graphs: Arc::new(Mutex::new(HashMap::new())),
    })
}

impl AgentWorkers {
    fn link(&self, actor: u64) -> std::result::Result<Arc<ProcessLink>, RemoteFailure> {
        self.workers
            .lock()
            .get(&actor)
            .cloned()
            .ok_or(RemoteFailure::NoSuchActor)
    }
}

impl AgentServices for AgentWorkers {
    fn spawn(
        &self,
        actor: u64,
        name: &str,
        type_name: &str,
        init: Vec<u8>,
    ) -> std::result::Result<u32, String> {
        let link = ProcessLink::spawn(actor, name, type_name, init, Arc::new(Mutex::new(None)))
            .map_err(|e| e.to_string())?;
        let link = Arc::new(link);
        let pid = link.pid();
        let exited = link.exit_signal();
        let weak = Arc::downgrade(&link);
        let reporter = self.reporter.clone();
        // Reports the worker's death, unless the driver released it first.
        std::thread::Builder::new()
            .name(format!("adag-agent-watch-{actor}"))
            .spawn(move || {
                let _ = exited.recv();
                if let Some(link) = weak.upgrade() {
                    let reason = link
                        .death_within(std::time::Duration::from_millis(500))
                        .map_or_else(
                            || "its process ended".to_string(),
                            |e| match e {
                                Error::ActorDied { reason, .. } => reason,
                                other => other.to_string(),
                            },
                        );
                    reporter.died(actor, &reason);
                }
            })
            .map_err(|e| format!("cannot start a watcher thread: {e}"))?;
        self.workers.lock().insert(actor, link);
        Ok(pid)
    }

    fn call(
        &self,
        actor: u64,
        method: &str,
        args: Vec<u8>,
    ) -> std::result::Result<Vec<u8>, RemoteFailure> {
        let link = self.link(actor)?;
        match link.call_bytes(method, args) {
            Ok(Ok(bytes)) => Ok(bytes),
            Ok(Err(CallFailure::NoSuchMethod)) => Err(RemoteFailure::NoSuchMethod),
            Ok(Err(CallFailure::BadArgs(m))) => Err(RemoteFailure::BadArgs(m)),
            Ok(Err(CallFailure::Task(m))) => Err(RemoteFailure::Task(m)),
            Ok(Err(CallFailure::Busy)) => Err(RemoteFailure::Busy),
            Err(Error::ActorDied { reason, .. }) => Err(RemoteFailure::Died(reason)),
            Err(e) => Err(RemoteFailure::Died(e.to_string())),
        }
    }

    fn kill(&self, actor: u64) -> std::result::Result<(), String> {
        self.link(actor)
            .map_err(|_| "no such actor".to_string())?
            .kill()
            .map_err(|e| e.to_string())
    }

    fn release(&self, actor: u64) {
        // Dropped off this thread: the link's drop waits for the worker to leave.
        let link = self.workers.lock().remove(&actor);
        drop(link);
    }

    fn install(&self, graph: u64, part: Vec<u8>) -> std::result::Result<(), String> {
        let part: HostPart = postcard::from_bytes(&part)
            .map_err(|e| format!("the driver sent a graph this host cannot read ({e}): run the same binary on every host"))?;
        let host = part.host;
        let plan = Arc::new(part.plan);
        let sizes = ChannelSizes {
            slot_bytes: part.slot_bytes as usize,
            max_message_bytes: part.max_message_bytes as usize,
            spin: Duration::from_nanos(part.spin_ns),
        };
        let addrs: HashMap<u64, SocketAddr> = part
            .addrs
            .into_iter()
            .map(|(h, a)| {
                if a.ip().is_unspecified() {
                    (h, SocketAddr::new(self.driver_ip, a.port()))
                } else {
                    (h, a)
                }
            })
            .collect();
        let deadline = Instant::now() + INSTALL_TIMEOUT;
        let chans =
            Arc::new(GraphChannels::create(&plan, &sizes, host).map_err(|e| e.to_string())?);
        let fail = |e: String| {
            chans.close_all();
            self.data.forget_graph(graph);
            e
        };
        chans
            .connect_network(&plan, host, &self.data, &addrs, deadline)
            .map_err(|e| fail(e.to_string()))?;
        let mut installing = Vec::new();
        let mut done = Vec::new();
        for a in plan
            .actors
            .iter()
            .filter(|a| plan.host_of(Loc::Actor(a.actor)) == host)
        {
            let link = self
                .link(a.actor)
                .map_err(|_| fail(format!("actor {} does not run on this host", a.name)))?;
            let (installed, installed_rx) = crossbeam_channel::bounded(1);
            let (done_tx, done_rx) = crossbeam_channel::bounded(1);
            link.install(
                a.actor,
                plan.clone(),
                &chans,
                installed,
                done_tx,
                (Vec::new(), Vec::new()),
                part.timeline,
            )
            .map_err(|e| fail(e.to_string()))?;
            installing.push((a.name.clone(), installed_rx));
            done.push((a.name.clone(), done_rx));
        }
        for (name, rx) in installing {
            match rx.recv_deadline(deadline) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(fail(format!("actor {name}: {e}"))),
                Err(_) => {
                    return Err(fail(format!(
                        "actor {name} did not install its schedule within {INSTALL_TIMEOUT:?}"
                    )));
                }
            }
        }
        let (stopped_tx, stopped) = crossbeam_channel::bounded::<()>(0);
        self.graphs.lock().insert(
            graph,
            HostGraph {
                chans: chans.clone(),
                stopped,
            },
        );
        let (graphs, reporter) = (self.graphs.clone(), self.reporter.clone());
        // Watches the schedules here: one that stops before the driver closed the graph (a
        // connection broke) ends the graph on this host and is reported to the driver.
        std::thread::Builder::new()
            .name(format!("adag-graph-watch-{graph}"))
            .spawn(move || {
                let mut select = crossbeam_channel::Select::new();
                for (_, rx) in &done {
                    select.recv(rx);
                }
                let mut reported = false;
                for _ in 0..done.len() {
                    let op = select.select();
                    let at = op.index();
                    let (name, rx) = &done[at];
                    let why = op.recv(rx);
                    select.remove(at);
                    if let Ok(why) = why
                        && !reported
                        && graphs.lock().contains_key(&graph)
                    {
                        reported = true;
                        chans.close_all();
                        reporter.graph_fault(graph, name, &why);
                    }
                }
                drop(stopped_tx);
            })
            .map_err(|e| format!("cannot start a watcher thread: {e}"))?;
        Ok(())
    }

    fn observe(&self, actor: u64, wait: Duration) -> Option<Vec<u8>> {
        let observation = self.link(actor).ok()?.observe(wait)?;
        postcard::to_stdvec(&observation)
            .map_err(|e| tracing::warn!(actor, error = %e, "cannot encode an actor's report"))
            .ok()
    }

    fn close_graph(&self, graph: u64) {
        self.data.forget_graph(graph);
        let Some(g) = self.graphs.lock().remove(&graph) else {
            return;
        };
        g.chans.close_all();
        let _ = g.stopped.recv_timeout(CLOSE_TIMEOUT);
    }

    fn shutdown(&self) {
        let graphs: Vec<u64> = self.graphs.lock().keys().copied().collect();
        for g in graphs {
            self.close_graph(g);
        }
        let all: Vec<Arc<ProcessLink>> = self.workers.lock().drain().map(|(_, l)| l).collect();
        drop(all);
    }
}
