//! The plan of a compiled graph: one channel per edge, chosen by where writer and readers
//! live, and one schedule of operations per actor. Plans are plain data so that they can be
//! sent to worker processes.
use crate::dag::collective::CollectiveKind;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Where an endpoint lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) enum Loc {
    Driver,
    Actor(u64),
}

/// One edge: the output of one node, written by one endpoint and read by several.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct EdgePlan {
    pub id: u64,
    /// The producing node as errors name it.
    pub label: String,
    pub ty: String,
    pub writer: Loc,
    /// The writing actor itself reads the value: it stays in the actor's slot (the in-actor
    /// kind), with no channel.
    pub same_actor: bool,
    /// The channels to the other readers, at most one per kind.
    pub channels: Vec<ChannelPlan>,
}

/// How a channel moves values, chosen by where its ends live ([`ChannelKind::between`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) enum ChannelKind {
    /// Readers on other threads of the writer's process: in memory, no serialization.
    InProcess,
    /// Readers in other processes of the writer's host: one shared-memory ring for all.
    SharedMemory,
    /// Readers on another host: one TCP connection per reading host. One reader there reads
    /// the connection itself; several share one shared-memory ring there, which that host's
    /// agent (the driver, on the driver's host) fills from the connection (one copy over the
    /// network per host).
    Network,
}

impl ChannelKind {
    /// The kind of channel from a writer to a reader on another actor (or the driver), by
    /// where each lives: the only place that chooses a kind.
    pub(crate) fn between(writer: Place, reader: Place) -> ChannelKind {
        if writer.host != reader.host {
            ChannelKind::Network
        } else if writer.process == reader.process {
            ChannelKind::InProcess
        } else {
            ChannelKind::SharedMemory
        }
    }
}

/// Where an endpoint runs: which host (0 = the driver's) and which process (0 = the
/// driver's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct Place {
    pub host: u64,
    pub process: u64,
}

/// One channel of an edge: its kind and its readers, in reader order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChannelPlan {
    /// The channel's identity among the channels of one graph.
    pub id: u64,
    pub kind: ChannelKind,
    pub readers: Vec<Loc>,
    /// The host its readers run on.
    pub host: u64,
}

impl ChannelPlan {
    /// A network channel whose readers on its host share a ring that the host fills from
    /// the connection (rather than one reader reading the connection itself).
    pub(crate) fn relayed(&self) -> bool {
        self.kind == ChannelKind::Network && self.readers.len() > 1
    }
}

impl EdgePlan {
    /// Whether the value leaves its writer at all.
    pub(crate) fn has_channel(&self) -> bool {
        !self.channels.is_empty()
    }

    /// Every reader outside the writing actor.
    pub(crate) fn channel_readers(&self) -> impl Iterator<Item = &Loc> {
        self.channels.iter().flat_map(|c| c.readers.iter())
    }

    /// The edge's network channels (one per reading host).
    pub(crate) fn network_channels(&self) -> impl Iterator<Item = &ChannelPlan> {
        self.channels
            .iter()
            .filter(|c| c.kind == ChannelKind::Network)
    }

    /// The channel that `reader` reads, and its index among that channel's readers.
    pub(crate) fn read_by(&self, reader: Loc) -> Option<(&ChannelPlan, usize)> {
        self.channels.iter().find_map(|c| {
            c.readers
                .iter()
                .position(|r| *r == reader)
                .map(|index| (c, index))
        })
    }
}

/// Where one argument of a task comes from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum ArgSource {
    Edge(u64),
    Const(Vec<u8>),
}

/// One operation of an actor's schedule.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum OpSpec {
    /// Read one execution's value of an edge from its channel into the actor's slot.
    Read { edge: u64 },
    /// Run a method on values in slots; the result goes to the slot of edge `node`.
    Compute {
        node: u64,
        method: String,
        /// What the timeline calls it when the node has a label (`Node::label`).
        label: Option<String>,
        args: Vec<ArgSource>,
    },
    /// Take element `index` of the tuple in `source`'s slot into the slot of edge `node`.
    Split {
        node: u64,
        source: u64,
        method: String,
        index: usize,
    },
    /// Write the slot of an edge to its channels.
    Write { edge: u64 },
    /// Receive a tensor over communicator `group` from rank `peer`: its metadata (shape and
    /// dtype, or the writer's error) from the edge's channel, its data from the communicator.
    Recv {
        edge: u64,
        group: u32,
        peer: usize,
        stage: Stage,
    },
    /// Send the tensor in the edge's slot: metadata to the edge's channel, data to each of
    /// `peers` (ranks of `group`).
    Send {
        edge: u64,
        group: u32,
        peers: Vec<usize>,
        stage: Stage,
    },
    /// This actor's part of collective `coll`: the tensor in `input`'s slot goes in, the
    /// result goes to the slot of `node`. `order[i]` is the group rank of the actor of the
    /// collective's `i`-th input; `index` is this actor's input position.
    Collective {
        node: u64,
        input: u64,
        coll: u64,
        kind: CollectiveKind,
        group: u32,
        order: Vec<usize>,
        index: usize,
        stage: Stage,
    },
}

/// When a communicator operation runs. Without overlap every one is `Inline` (it blocks the
/// actor's loop). With `overlap_gpu_communication` it is split: `Issue` hands it to the
/// actor's communication thread, `Wait` joins it where the value is first needed (a send has
/// no `Wait`: the next `Issue` of the same edge joins the previous send).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) enum Stage {
    Inline,
    Issue,
    Wait,
}

impl OpSpec {
    /// Whether this operation uses the value of edge `edge` in this actor's slot.
    pub(crate) fn consumes(&self, edge: u64) -> bool {
        match self {
            OpSpec::Compute { args, .. } => args
                .iter()
                .any(|a| matches!(a, ArgSource::Edge(e) if *e == edge)),
            OpSpec::Split { source, .. } => *source == edge,
            OpSpec::Write { edge: e } => *e == edge,
            OpSpec::Send { edge: e, stage, .. } => *e == edge && *stage != Stage::Wait,
            OpSpec::Collective { input, stage, .. } => *input == edge && *stage != Stage::Wait,
            OpSpec::Read { .. } | OpSpec::Recv { .. } => false,
        }
    }

    /// The stage of a communicator operation, `None` for the others.
    pub(crate) fn comm_stage(&self) -> Option<Stage> {
        match self {
            OpSpec::Recv { stage, .. }
            | OpSpec::Send { stage, .. }
            | OpSpec::Collective { stage, .. } => Some(*stage),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ActorPlan {
    pub actor: u64,
    pub name: String,
    pub ops: Vec<OpSpec>,
}

/// Everything an endpoint needs to build its part of a compiled graph.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct GraphPlan {
    pub graph: u64,
    pub depth: usize,
    pub edges: BTreeMap<u64, EdgePlan>,
    pub actors: Vec<ActorPlan>,
    /// Input edges in the order the driver writes them.
    pub inputs: Vec<u64>,
    /// Output edges in the user's order (an edge may appear twice).
    pub outputs: Vec<u64>,
    /// How the sends of each communicator group complete, by group index (`group` of
    /// `Recv`, `Send` and `Collective`): the schedule and the deadlock check depend on it.
    pub comm_groups: Vec<crate::comm::SendCompletion>,
    /// The host of each actor on another host than the driver's, by actor id (absent: the
    /// driver's host, 0).
    pub hosts: BTreeMap<u64, u64>,
}

impl GraphPlan {
    /// The host an endpoint runs on.
    pub(crate) fn host_of(&self, loc: Loc) -> u64 {
        match loc {
            Loc::Driver => 0,
            Loc::Actor(id) => self.hosts.get(&id).copied().unwrap_or(0),
        }
    }

    /// The hosts other than the driver's that run a part of the graph.
    pub(crate) fn remote_hosts(&self) -> std::collections::BTreeSet<u64> {
        self.hosts.values().copied().collect()
    }

    /// Network channels that share one TCP connection, as `(first, second)` channel ids: a
    /// channel from endpoint A to endpoint B and one from B back to A (each read by its
    /// endpoint alone) go both ways over the connection made for the first, the one with the
    /// lower id. On two one-way connections every message costs a bare ACK segment besides
    /// its own (the reader never sends anything to carry it); on one connection the reply
    /// carries it, as in a request/response protocol: an echo across hosts measured 10.9 µs
    /// on two loopback connections against 6.8 µs on one. Each channel is in one pair at
    /// most; every host derives the same pairs from the same plan.
    pub(crate) fn shared_connections(&self) -> Vec<(u64, u64)> {
        // (writer, reader) -> the direct network channels between them, by id.
        let mut between: BTreeMap<(Loc, Loc), Vec<u64>> = BTreeMap::new();
        for e in self.edges.values() {
            for c in e.network_channels() {
                if let [reader] = c.readers[..] {
                    between.entry((e.writer, reader)).or_default().push(c.id);
                }
            }
        }
        let mut pairs = Vec::new();
        for (&(a, b), ids) in &between {
            if a >= b {
                continue;
            }
            let Some(back) = between.get(&(b, a)) else {
                continue;
            };
            let mut ours = ids.clone();
            let mut theirs = back.clone();
            ours.sort_unstable();
            theirs.sort_unstable();
            pairs.extend(
                ours.into_iter()
                    .zip(theirs)
                    .map(|(x, y)| (x.min(y), x.max(y))),
            );
        }
        pairs.sort_unstable();
        pairs
    }

    pub(crate) fn edge(&self, id: u64) -> Result<&EdgePlan, String> {
        self.edges
            .get(&id)
            .ok_or_else(|| format!("edge {id} is not part of graph #{}", self.graph))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edge(id: u64, writer: Loc, channels: Vec<(u64, Vec<Loc>)>) -> (u64, EdgePlan) {
        let channels = channels
            .into_iter()
            .map(|(chan, readers)| ChannelPlan {
                id: chan,
                kind: ChannelKind::Network,
                readers,
                host: 1,
            })
            .collect();
        let e = EdgePlan {
            id,
            label: format!("edge {id}"),
            ty: "u64".into(),
            writer,
            same_actor: false,
            channels,
        };
        (id, e)
    }

    fn plan(edges: Vec<(u64, EdgePlan)>) -> GraphPlan {
        GraphPlan {
            graph: 1,
            depth: 1,
            edges: edges.into_iter().collect(),
            actors: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            comm_groups: Vec::new(),
            hosts: BTreeMap::new(),
        }
    }

    #[test]
    fn channels_going_back_share_the_connection_of_the_way_out_one_for_one() {
        let (d, a, b) = (Loc::Driver, Loc::Actor(1), Loc::Actor(2));
        let p = plan(vec![
            // Two edges driver -> a, one a -> driver: one pair, the second edge keeps its own.
            edge(1, d, vec![(10, vec![a])]),
            edge(2, d, vec![(11, vec![a])]),
            edge(3, a, vec![(12, vec![d])]),
            // a -> b with no way back: alone.
            edge(4, a, vec![(13, vec![b])]),
            // b -> driver read by two endpoints there (relayed): never paired.
            edge(5, d, vec![(14, vec![b])]),
            edge(6, b, vec![(15, vec![d, Loc::Actor(3)])]),
        ]);
        assert_eq!(p.shared_connections(), vec![(10, 12)]);
    }

    #[test]
    fn pairs_do_not_depend_on_which_way_has_the_lower_ids() {
        let (a, b) = (Loc::Actor(1), Loc::Actor(2));
        let p = plan(vec![
            edge(1, b, vec![(20, vec![a])]),
            edge(2, b, vec![(21, vec![a])]),
            edge(3, a, vec![(30, vec![b])]),
            edge(4, a, vec![(31, vec![b])]),
        ]);
        assert_eq!(p.shared_connections(), vec![(20, 30), (21, 31)]);
    }
}
