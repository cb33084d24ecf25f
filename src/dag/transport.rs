//! Tensor transports of edges (Ray's `with_tensor_transport`) and the user's own
//! communicators.
//!
//! An edge that carries a [`Tensor`] moves, by default, like any other value: through memory
//! within a process and through shared memory between processes. Annotated with
//! [`Transport::Communicator`], the tensor's data moves through a [`Communicator`] instead
//! (`send` on the writer, `recv` on each reader); only a small metadata message (shape and
//! dtype, or the upstream error) goes through the ordinary channel, as in Ray. Readers on the
//! writer's own actor always get the value through its slot.
//!
//! [`Communicator`]: crate::comm::Communicator
use super::{ActorRef, Node, NodeInner};
use crate::comm::{CommError, CommunicatorGroup};
use crate::tensor::Tensor;
use std::fmt;
use std::sync::Arc;

/// How the tensors of one edge travel from the writer to its readers on other actors.
#[derive(Clone, Default)]
pub enum Transport {
    /// A communicator when the writer and every reader on another actor are on distinct
    /// CUDA devices (a device-to-device move a communicator can serve), shared memory (or
    /// memory within a process) otherwise. CPU-only actors always get shared memory, and so
    /// does an edge that the driver writes or reads.
    #[default]
    Auto,
    /// The ordinary channel: memory within a process, shared memory between processes, even
    /// when both ends have devices.
    Shm,
    /// A communicator: this one (`Some`), or the default one of the compile options
    /// (`None`, see [`DefaultCommunicator`](crate::DefaultCommunicator)). The driver cannot
    /// take part in a communicator: an input node, or an output read by the driver, with this
    /// transport is a compile error naming the node.
    Communicator(Option<CustomCommunicator>),
}

impl Transport {
    /// A communicator chosen by the compile options' default communicator.
    pub fn communicator() -> Transport {
        Transport::Communicator(None)
    }

    /// This communicator.
    pub fn custom(comm: CustomCommunicator) -> Transport {
        Transport::Communicator(Some(comm))
    }
}

impl fmt::Debug for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transport::Auto => f.write_str("Auto"),
            Transport::Shm => f.write_str("Shm"),
            Transport::Communicator(None) => f.write_str("Communicator(default)"),
            Transport::Communicator(Some(c)) => write!(f, "Communicator({c:?})"),
        }
    }
}

/// A user's own communicator group, bound to the actors that hold its ranks (rank `r` is
/// `actors[r]`): what [`Transport::custom`], the collectives' `*_with` forms and
/// [`DefaultCommunicator::Custom`](crate::DefaultCommunicator::Custom) take.
///
/// The group reaches each actor the way [`CommunicatorGroup`] hands out ranks: an actor on a
/// thread of the driver gets [`CommunicatorGroup::communicator`]`(rank)`; an actor in a worker
/// process gets the group's [`ticket`](CommunicatorGroup::ticket) and
/// [`fds`](CommunicatorGroup::fds) and opens its rank with the factory registered for the
/// ticket's transport in that process ([`crate::comm::open_ticket`]; see
/// [`communicator_factory!`](crate::communicator_factory) for registering one in workers). A
/// group that lives in one process only (a [`LocalGroup`](crate::comm::LocalGroup)) serves
/// thread actors only; with a process actor, compiling fails and says so.
///
/// The compiled graph destroys the group at teardown (waking any rank still blocked in it),
/// as Ray does with the communicators it initialized: make a new group for the next graph.
#[derive(Clone)]
pub struct CustomCommunicator {
    pub(crate) group: Arc<dyn CommunicatorGroup>,
    pub(crate) actors: Vec<ActorRef>,
}

impl CustomCommunicator {
    /// Binds `group` to `actors` in rank order. The number of actors must be the group's world
    /// size and each actor may appear once.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use adag::comm::cpu::CpuGroup;
    /// use adag::{CustomCommunicator, Placement, Runtime};
    ///
    /// struct W;
    /// #[adag::actor]
    /// impl W {
    ///     fn new() -> Self { W }
    ///     fn same(&mut self, t: adag::Tensor) -> adag::Tensor { t }
    /// }
    /// let rt = Runtime::new()?;
    /// let (a, b) = (rt.spawn::<W>(Placement::Thread, ())?, rt.spawn::<W>(Placement::Thread, ())?);
    /// let comm = CustomCommunicator::new(Arc::new(CpuGroup::create(2, "mine")?), [&a, &b])?;
    /// assert_eq!(comm.world_size(), 2);
    /// assert!(CustomCommunicator::new(Arc::new(CpuGroup::create(2, "x")?), [&a, &a]).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new<H: Into<ActorRef>>(
        group: Arc<dyn CommunicatorGroup>,
        actors: impl IntoIterator<Item = H>,
    ) -> Result<CustomCommunicator, CommError> {
        let actors: Vec<ActorRef> = actors.into_iter().map(Into::into).collect();
        if actors.len() != group.world_size() {
            return Err(CommError::Config {
                message: format!(
                    "communicator group {} has {} ranks but {} actors were given; give one actor per rank, in rank order",
                    group.id(),
                    group.world_size(),
                    actors.len()
                ),
            });
        }
        for (i, a) in actors.iter().enumerate() {
            if actors[..i].iter().any(|b| b.same(a)) {
                return Err(CommError::Config {
                    message: format!(
                        "actor {} holds two ranks of communicator group {}; each actor holds one",
                        a.name(),
                        group.id()
                    ),
                });
            }
        }
        Ok(CustomCommunicator { group, actors })
    }

    /// The group.
    pub fn group(&self) -> &Arc<dyn CommunicatorGroup> {
        &self.group
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.actors.len()
    }

    /// The rank of `actor`, if it is a member.
    pub fn rank_of(&self, actor: &ActorRef) -> Option<usize> {
        self.actors.iter().position(|a| a.same(actor))
    }

    /// The identity of the group object (two bindings of one group are the same communicator).
    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.group) as *const () as usize
    }
}

impl fmt::Debug for CustomCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.actors.iter().map(|a| a.name()).collect();
        write!(
            f,
            "CustomCommunicator({} {}, ranks {:?})",
            self.group.transport_name(),
            self.group.id(),
            names
        )
    }
}

impl Node<Tensor> {
    /// Choose how this node's tensor travels to readers on other actors (Ray's
    /// `with_tensor_transport`); returns the node, so calls chain. The last annotation wins.
    pub fn with_tensor_transport(&self, transport: Transport) -> Node<Tensor> {
        *self.inner.transport.lock() = Some(transport);
        self.clone()
    }

    /// The transport annotation, if any.
    pub fn tensor_transport(&self) -> Option<Transport> {
        self.inner.transport.lock().clone()
    }
}

impl NodeInner {
    pub(crate) fn transport(&self) -> Option<Transport> {
        self.transport.lock().clone()
    }
}
