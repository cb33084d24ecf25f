//! Communicators at compile time: which edges move their tensors through a communicator,
//! which group serves each such edge and each collective (`default_communicator`), and, when
//! the graph starts, making the groups and handing each actor its rank.
//!
//! Choice of groups (Ray's `_init_communicators`):
//! 1. A collective or edge that names its own communicator uses it. One custom group object
//!    is one communicator, however many nodes name it.
//! 2. Collectives without one: `Create` makes one group per distinct *set* of actors and
//!    reuses it for every other collective over the same set; `Custom` uses the default
//!    communicator (it must have exactly the collective's actors); `None` is an error.
//! 3. Point-to-point edges without one: `Create` reuses the first group made for a collective
//!    whose actors are a *superset* of the edge's writer and readers, else every such edge
//!    shares one new group over all their actors; `Custom` uses the default communicator (it
//!    must include the edge's actors); `None` is an error.
//!
//! Groups made by `Create` use the CPU backend (`"cpu"`), or `"nccl"` when every actor of the
//! group is on a CUDA device (that factory comes from the NCCL crate).
use crate::DefaultCommunicator;
use crate::actor::HandleCore;
use crate::actor::wire::CommTicket;
use crate::comm::{
    self, CommId, Communicator, CommunicatorFactory, CommunicatorGroup, SendCompletion,
};
use crate::compile::plan::Loc;
use crate::dag::collective::CollectiveGroup;
use crate::dag::{CustomCommunicator, NodeInner, NodeKind, Transport};
use crate::error::{Error, Result};
use crate::tensor::Device;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Once};

/// Communicator factories linked into this executable ([`communicator_factory!`]), registered
/// in every process (driver and workers) before a group is made or opened.
///
/// [`communicator_factory!`]: crate::communicator_factory
#[linkme::distributed_slice]
pub static COMM_FACTORIES: [fn() -> Arc<dyn CommunicatorFactory>];

/// Register a [`CommunicatorFactory`] at link time, so that worker processes (which never
/// reach `main`) can open ranks of its groups too. Takes a function
/// `fn() -> Arc<dyn CommunicatorFactory>`; the factory is registered (as with
/// [`register_factory`](crate::comm::register_factory)) the first time a graph with
/// communicators is compiled or installed in each process.
///
/// ```ignore
/// fn make() -> Arc<dyn adag::comm::CommunicatorFactory> { Arc::new(MyNcclFactory::default()) }
/// adag::communicator_factory!(make);
/// ```
#[macro_export]
macro_rules! communicator_factory {
    ($make:path) => {
        const _: () = {
            #[$crate::__private::linkme::distributed_slice($crate::__private::COMM_FACTORIES)]
            #[linkme(crate = $crate::__private::linkme)]
            static REGISTER: fn() -> ::std::sync::Arc<dyn $crate::comm::CommunicatorFactory> =
                $make;
        };
    };
}

/// Registers the link-time factories once per process.
pub(crate) fn register_linked_factories() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for make in COMM_FACTORIES {
            comm::register_factory(make());
        }
    });
}

/// Where a group comes from.
#[derive(Clone)]
pub(crate) enum GroupSource {
    /// Made by the driver when the graph starts, with the factory of this transport.
    Create { transport: String },
    /// The user's own.
    Custom(CustomCommunicator),
}

/// One communicator group of a graph.
#[derive(Clone)]
pub(crate) struct GroupPlan {
    pub index: u32,
    /// The actors in rank order.
    pub actors: Vec<HandleCore>,
    pub source: GroupSource,
    /// The nodes that use it.
    pub users: Vec<String>,
    /// Whether its sends complete without the receiver (from the custom group, or the
    /// factory that will make it): the scheduler places receives by it.
    pub sends: SendCompletion,
}

impl GroupPlan {
    fn rank(&self, actor: u64) -> Option<usize> {
        self.actors.iter().position(|a| a.id() == actor)
    }

    fn set(&self) -> BTreeSet<u64> {
        self.actors.iter().map(HandleCore::id).collect()
    }
}

/// An edge whose tensors move through a communicator.
#[derive(Clone, Debug)]
pub(crate) struct EdgeComm {
    pub group: u32,
    pub writer_rank: usize,
    /// The reading actors (other than the writer) and their ranks, in reader order.
    pub readers: Vec<(u64, usize)>,
}

/// The group of one collective.
#[derive(Clone, Debug)]
pub(crate) struct CollComm {
    pub group: u32,
    /// The group rank of the actor of each input, in input order.
    pub order: Vec<usize>,
}

/// The communicators of a graph.
#[derive(Clone, Default)]
pub(crate) struct CommPlan {
    pub groups: Vec<GroupPlan>,
    pub edges: BTreeMap<u64, EdgeComm>,
    /// By collective id.
    pub collectives: BTreeMap<u64, CollComm>,
}

/// What one communicator group of a compiled graph is (`CompiledGraph::communicators`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommunicatorInfo {
    /// The group's identity.
    pub id: CommId,
    /// Its transport (`"cpu"`, `"nccl"`...).
    pub transport: String,
    /// The actors' names in rank order.
    pub actors: Vec<String>,
    /// Whether the graph made it (`DefaultCommunicator::Create`) rather than the user.
    pub created: bool,
    /// The nodes that use it: collectives and edges.
    pub users: Vec<String>,
}

fn device_comm(writer: Device, readers: &[Device]) -> bool {
    matches!(writer, Device::Cuda(_))
        && !readers.is_empty()
        && readers
            .iter()
            .all(|d| matches!(d, Device::Cuda(_)) && *d != writer)
}

struct Builder<'a> {
    plan: CommPlan,
    default: &'a DefaultCommunicator,
    /// Custom groups by identity.
    custom: HashMap<usize, u32>,
}

impl Builder<'_> {
    fn custom(&mut self, c: &CustomCommunicator, user: &str) -> Result<u32> {
        if let Some(&i) = self.custom.get(&c.key()) {
            let g = &self.plan.groups[i as usize];
            let same = g.actors.len() == c.actors.len()
                && g.actors.iter().zip(&c.actors).all(|(a, b)| a.same(b));
            if !same {
                return Err(Error::compile(
                    user,
                    format!(
                        "communicator group {} is bound to different actors in two places ({:?} and {:?}); bind one group to one list of actors",
                        c.group.id(),
                        names(&g.actors),
                        names(&c.actors)
                    ),
                ));
            }
            self.plan.groups[i as usize].users.push(user.to_string());
            return Ok(i);
        }
        let i = self.push(c.actors.clone(), GroupSource::Custom(c.clone()), user);
        self.custom.insert(c.key(), i);
        Ok(i)
    }

    fn push(&mut self, actors: Vec<HandleCore>, source: GroupSource, user: &str) -> u32 {
        let index = self.plan.groups.len() as u32;
        let sends = match &source {
            GroupSource::Custom(c) => c.group.send_completion(),
            // No factory yet is an error at start; rendezvous is the safe assumption.
            GroupSource::Create { transport } => {
                comm::factory(transport).map_or(SendCompletion::Rendezvous, |f| f.send_completion())
            }
        };
        self.plan.groups.push(GroupPlan {
            index,
            actors,
            source,
            users: vec![user.to_string()],
            sends,
        });
        index
    }
}

fn names(actors: &[HandleCore]) -> Vec<String> {
    actors.iter().map(|a| a.name().to_string()).collect()
}

/// Decide the communicators of the graph made of `nodes`, whose edges are read by `readers`.
pub(crate) fn resolve(
    nodes: &BTreeMap<u64, Arc<NodeInner>>,
    readers: &BTreeMap<u64, BTreeSet<Loc>>,
    actors: &BTreeMap<u64, HandleCore>,
    default: &DefaultCommunicator,
) -> Result<CommPlan> {
    // Point-to-point edges: which ones use a communicator, and which one they name.
    struct P2p {
        edge: u64,
        label: String,
        writer: u64,
        readers: Vec<u64>,
        own: Option<CustomCommunicator>,
        auto: bool,
    }
    let mut p2p = Vec::new();
    for (id, n) in nodes {
        let Some(t) = n.transport() else { continue };
        if matches!(t, Transport::Shm) {
            continue;
        }
        let explicit = matches!(t, Transport::Communicator(_));
        let Some(writer) = n.actor() else {
            if explicit {
                return Err(Error::compile(
                    n.describe(),
                    "graph inputs cannot move through a communicator because the driver cannot take part in a communicator group; use Transport::Shm or Transport::Auto for the input",
                ));
            }
            continue;
        };
        let rs = &readers[id];
        if rs.contains(&Loc::Driver) {
            if explicit {
                return Err(Error::compile(
                    n.describe(),
                    "this node is an output of the graph, read by the driver, and the driver cannot take part in a communicator group; use Transport::Shm or Transport::Auto, or pass the tensor through an actor before the output",
                ));
            }
            continue;
        }
        let remote: Vec<u64> = rs
            .iter()
            .filter_map(|l| match l {
                Loc::Actor(a) if *a != writer.id() => Some(*a),
                _ => None,
            })
            .collect();
        if remote.is_empty() {
            // Only the writer itself reads it: the slot serves, no communicator needed.
            continue;
        }
        let own = match t {
            Transport::Communicator(c) => c,
            Transport::Auto => {
                let devices: Vec<Device> = remote.iter().map(|a| actors[a].device()).collect();
                if !device_comm(writer.device(), &devices) {
                    continue;
                }
                None
            }
            Transport::Shm => unreachable!("skipped above"),
        };
        p2p.push(P2p {
            edge: *id,
            label: n.describe(),
            writer: writer.id(),
            readers: remote,
            own,
            auto: !explicit,
        });
    }
    // Collectives, in bind order.
    let mut colls: BTreeMap<u64, (Arc<CollectiveGroup>, String)> = BTreeMap::new();
    for n in nodes.values() {
        if let NodeKind::Collective { group, .. } = &n.kind {
            colls
                .entry(group.id)
                .or_insert_with(|| (group.clone(), n.describe()));
        }
    }
    let mut b = Builder {
        plan: CommPlan::default(),
        default,
        custom: HashMap::new(),
    };
    let mut created_for_collectives: Vec<u32> = Vec::new();
    for (id, (group, label)) in &colls {
        let members: Vec<HandleCore> = group
            .inputs
            .iter()
            .map(|n| {
                n.actor()
                    .cloned()
                    .expect("checked: every collective input is on an actor")
            })
            .collect();
        let set: BTreeSet<u64> = members.iter().map(HandleCore::id).collect();
        let check_same = |c: &CustomCommunicator| -> Result<()> {
            let theirs: BTreeSet<u64> = c.actors.iter().map(HandleCore::id).collect();
            if theirs != set {
                return Err(Error::compile(
                    label.clone(),
                    format!(
                        "the communicator must have the same set of actors as the collective operation: the communicator has actors {:?} while the collective has {:?}",
                        names(&c.actors),
                        names(&members)
                    ),
                ));
            }
            Ok(())
        };
        let index = match (&group.comm, b.default) {
            (Some(c), _) | (None, DefaultCommunicator::Custom(c)) => {
                check_same(c)?;
                b.custom(c, label)?
            }
            (None, DefaultCommunicator::None) => {
                return Err(Error::compile(
                    label.clone(),
                    "this collective names no communicator and default_communicator is None, which forbids making one; pass one with allreduce_with / allgather_with / reducescatter_with, or compile with DefaultCommunicator::Create or a custom default",
                ));
            }
            (None, DefaultCommunicator::Create) => {
                let existing = created_for_collectives
                    .iter()
                    .copied()
                    .find(|&g| b.plan.groups[g as usize].set() == set);
                match existing {
                    Some(g) => {
                        b.plan.groups[g as usize].users.push(label.clone());
                        g
                    }
                    None => {
                        let transport = create_transport(&members, label)?;
                        let g = b.push(members.clone(), GroupSource::Create { transport }, label);
                        created_for_collectives.push(g);
                        g
                    }
                }
            }
        };
        let g = &b.plan.groups[index as usize];
        let order = members
            .iter()
            .map(|a| {
                g.rank(a.id())
                    .expect("the group holds every actor of the collective")
            })
            .collect();
        b.plan.collectives.insert(
            *id,
            CollComm {
                group: index,
                order,
            },
        );
    }
    // Point-to-point edges.
    let mut leftovers: Vec<usize> = Vec::new();
    for (k, e) in p2p.iter().enumerate() {
        let mut set: BTreeSet<u64> = e.readers.iter().copied().collect();
        set.insert(e.writer);
        let check_includes = |c: &CustomCommunicator| -> Result<()> {
            let theirs: BTreeSet<u64> = c.actors.iter().map(HandleCore::id).collect();
            if !set.is_subset(&theirs) {
                let mut ours = vec![actors[&e.writer].name().to_string()];
                ours.extend(e.readers.iter().map(|r| actors[r].name().to_string()));
                return Err(Error::compile(
                    e.label.clone(),
                    format!(
                        "the communicator must include all of the actors of the point-to-point edge: it has actors {:?} while the edge's writer and readers are {ours:?}",
                        names(&c.actors)
                    ),
                ));
            }
            Ok(())
        };
        let index = match (&e.own, b.default) {
            (Some(c), _) | (None, DefaultCommunicator::Custom(c)) => {
                check_includes(c)?;
                b.custom(c, &e.label)?
            }
            (None, DefaultCommunicator::None) => {
                let message = if e.auto {
                    "with_tensor_transport(Transport::Auto) chose a communicator for this edge (its ends are on distinct CUDA devices), which needs a default communicator, but default_communicator is None; compile with DefaultCommunicator::Create or a custom default, or use Transport::Shm"
                } else {
                    "this edge has no communicator of its own and default_communicator is None; give it one with Transport::custom(..), or compile with DefaultCommunicator::Create or a custom default"
                };
                return Err(Error::compile(e.label.clone(), message));
            }
            (None, DefaultCommunicator::Create) => {
                let reuse = created_for_collectives
                    .iter()
                    .copied()
                    .find(|&g| set.is_subset(&b.plan.groups[g as usize].set()));
                match reuse {
                    Some(g) => {
                        b.plan.groups[g as usize].users.push(e.label.clone());
                        g
                    }
                    None => {
                        leftovers.push(k);
                        continue;
                    }
                }
            }
        };
        insert_edge(&mut b.plan, e.edge, e.writer, &e.readers, index);
    }
    if !leftovers.is_empty() {
        let mut members: Vec<HandleCore> = Vec::new();
        for &k in &leftovers {
            let e = &p2p[k];
            for a in std::iter::once(&e.writer).chain(&e.readers) {
                if !members.iter().any(|m| m.id() == *a) {
                    members.push(actors[a].clone());
                }
            }
        }
        let first = &p2p[leftovers[0]].label;
        let transport = create_transport(&members, first)?;
        let index = b.push(members, GroupSource::Create { transport }, first);
        for &k in &leftovers[1..] {
            b.plan.groups[index as usize]
                .users
                .push(p2p[k].label.clone());
        }
        for &k in &leftovers {
            let e = &p2p[k];
            insert_edge(&mut b.plan, e.edge, e.writer, &e.readers, index);
        }
    }
    Ok(b.plan)
}

fn insert_edge(plan: &mut CommPlan, edge: u64, writer: u64, readers: &[u64], group: u32) {
    let g = &plan.groups[group as usize];
    let rank = |a: u64| g.rank(a).expect("the group holds every actor of the edge");
    plan.edges.insert(
        edge,
        EdgeComm {
            group,
            writer_rank: rank(writer),
            readers: readers.iter().map(|&r| (r, rank(r))).collect(),
        },
    );
}

/// The transport of a group made for these actors.
fn create_transport(actors: &[HandleCore], user: &str) -> Result<String> {
    register_linked_factories();
    let cuda = actors
        .iter()
        .filter(|a| matches!(a.device(), Device::Cuda(_)))
        .count();
    if cuda > 0 && cuda == actors.len() {
        if comm::factory("nccl").is_some() {
            return Ok("nccl".into());
        }
        return Err(Error::compile(
            user,
            format!(
                "actors {:?} are on CUDA devices, so their communicator would be NCCL, but no communicator factory for transport \"nccl\" is registered in this executable; link the adag NCCL crate (it registers one), or pass your own communicator",
                names(actors)
            ),
        ));
    }
    Ok(comm::cpu::TRANSPORT.into())
}

/// The groups of a started graph, in plan order.
pub(crate) struct CommSetup {
    pub groups: Vec<Arc<dyn CommunicatorGroup>>,
    pub plan: CommPlan,
}

impl CommSetup {
    /// Make the groups that `Create` asked for; take the custom ones as they are.
    pub(crate) fn start(plan: CommPlan, graph: u64) -> Result<CommSetup> {
        if !plan.groups.is_empty() {
            register_linked_factories();
        }
        let mut groups: Vec<Arc<dyn CommunicatorGroup>> = Vec::with_capacity(plan.groups.len());
        for g in &plan.groups {
            let made = match &g.source {
                GroupSource::Custom(c) => Ok(c.group.clone()),
                GroupSource::Create { transport } => {
                    let label = format!("adag-g{graph}-c{}", g.index);
                    match comm::factory(transport) {
                        None => Err(format!(
                            "no communicator factory for transport {transport:?} is registered"
                        )),
                        Some(f) => f
                            .create_group(g.actors.len(), &label)
                            .map_err(|e| e.to_string()),
                    }
                }
            };
            match made {
                Ok(group) => groups.push(group),
                Err(e) => {
                    for made in &groups {
                        made.destroy();
                    }
                    return Err(Error::compile(
                        g.users.first().cloned().unwrap_or_default(),
                        format!(
                            "cannot make the communicator group of actors {:?}: {e}",
                            names(&g.actors)
                        ),
                    ));
                }
            }
        }
        Ok(CommSetup { groups, plan })
    }

    /// The groups and ranks of one actor.
    fn memberships(&self, actor: u64) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.plan
            .groups
            .iter()
            .filter_map(move |g| g.rank(actor).map(|r| (g.index, r)))
    }

    /// The communicators of a thread actor, by group index.
    pub(crate) fn thread_comms(
        &self,
        actor: &HandleCore,
    ) -> Result<HashMap<u32, Arc<dyn Communicator>>> {
        let mut out = HashMap::new();
        for (g, rank) in self.memberships(actor.id()) {
            let c = self.groups[g as usize].communicator(rank).map_err(|e| {
                Error::compile(
                    actor.name(),
                    format!("cannot hand rank {rank} of its communicator group to the actor: {e}"),
                )
            })?;
            out.insert(g, c);
        }
        Ok(out)
    }

    /// The tickets of a process actor, with the descriptors to pass along, in order.
    pub(crate) fn tickets(
        &self,
        actor: &HandleCore,
    ) -> Result<(Vec<CommTicket>, Vec<BorrowedFd<'_>>)> {
        let mut tickets = Vec::new();
        let mut fds = Vec::new();
        for (g, rank) in self.memberships(actor.id()) {
            let group = &self.groups[g as usize];
            let ticket = group.ticket().map_err(|e| {
                Error::compile(
                    actor.name(),
                    format!(
                        "this process actor cannot open rank {rank} of its communicator group: {e}"
                    ),
                )
            })?;
            let these = group.fds();
            tickets.push(CommTicket {
                group: g,
                ticket,
                rank,
                fds: these.len(),
            });
            fds.extend(these);
        }
        Ok((tickets, fds))
    }

    /// What `CompiledGraph::communicators` shows.
    pub(crate) fn infos(&self) -> Vec<CommunicatorInfo> {
        self.plan
            .groups
            .iter()
            .zip(&self.groups)
            .map(|(p, g)| CommunicatorInfo {
                id: g.id(),
                transport: g.transport_name().to_string(),
                actors: names(&p.actors),
                created: matches!(p.source, GroupSource::Create { .. }),
                users: p.users.clone(),
            })
            .collect()
    }

    /// Destroy every group (teardown, or a failed start): wakes every rank blocked in one.
    pub(crate) fn destroy_all(&self) {
        for g in &self.groups {
            g.destroy();
        }
    }

    /// Graphviz lines describing the groups and the communicator edges.
    pub(crate) fn dot(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        for (info, p) in self.infos().iter().zip(&self.plan.groups) {
            let _ = writeln!(
                out,
                "  comm_{} [shape=component, label=\"communicator group {} ({}{})\\lranks: {}\\lused by: {}\\l\"];",
                p.index,
                p.index,
                info.transport,
                if info.created {
                    ", created"
                } else {
                    ", custom"
                },
                info.actors.join(", ").replace('"', "\\\""),
                info.users.join(", ").replace('"', "\\\""),
            );
        }
        for (edge, e) in &self.plan.edges {
            let _ = writeln!(
                out,
                "  n{edge} -> comm_{} [style=dashed, label=\"tensor via communicator {} (ranks {} -> {:?})\"];",
                e.group,
                e.group,
                e.writer_rank,
                e.readers.iter().map(|r| r.1).collect::<Vec<_>>()
            );
        }
        out
    }
}
