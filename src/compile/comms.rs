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
use super::DefaultCommunicator;
use crate::comm::{self, SendCompletion, register_linked_factories};
use crate::compile::plan::Loc;
use crate::dag::collective::CollectiveGroup;
use crate::dag::{ActorRef, CustomCommunicator, NodeInner, NodeKind, Transport};
use crate::error::{Error, Result};
use crate::tensor::Device;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

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
    pub actors: Vec<ActorRef>,
    pub source: GroupSource,
    /// The nodes that use it.
    pub users: Vec<String>,
    /// Whether its sends complete without the receiver (from the custom group, or the
    /// factory that will make it): the scheduler places receives by it.
    pub sends: SendCompletion,
}

impl GroupPlan {
    pub(crate) fn rank(&self, actor: u64) -> Option<usize> {
        self.actors.iter().position(|a| a.id() == actor)
    }

    fn set(&self) -> BTreeSet<u64> {
        self.actors.iter().map(ActorRef::id).collect()
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

    fn push(&mut self, actors: Vec<ActorRef>, source: GroupSource, user: &str) -> u32 {
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

pub(crate) fn names(actors: &[ActorRef]) -> Vec<String> {
    actors.iter().map(|a| a.name().to_string()).collect()
}

/// Decide the communicators of the graph made of `nodes`, whose edges are read by `readers`.
pub(crate) fn resolve(
    nodes: &BTreeMap<u64, Arc<NodeInner>>,
    readers: &BTreeMap<u64, BTreeSet<Loc>>,
    actors: &BTreeMap<u64, ActorRef>,
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
        let members: Vec<ActorRef> = group
            .inputs
            .iter()
            .map(|n| {
                n.actor()
                    .cloned()
                    .expect("checked: every collective input is on an actor")
            })
            .collect();
        let set: BTreeSet<u64> = members.iter().map(ActorRef::id).collect();
        let check_same = |c: &CustomCommunicator| -> Result<()> {
            let theirs: BTreeSet<u64> = c.actors.iter().map(ActorRef::id).collect();
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
            let theirs: BTreeSet<u64> = c.actors.iter().map(ActorRef::id).collect();
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
        let mut members: Vec<ActorRef> = Vec::new();
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
fn create_transport(actors: &[ActorRef], user: &str) -> Result<String> {
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
