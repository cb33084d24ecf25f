//! The communicator groups of a started graph: made (or taken from the user) before any actor
//! installs its schedule, handed to each actor as its rank, destroyed at teardown.
use crate::actor::HandleCore;
use crate::actor::wire::CommTicket;
use crate::comm::{self, CommId, Communicator, CommunicatorGroup, register_linked_factories};
use crate::compile::comms::{CommPlan, GroupSource, names};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

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
