//! The input node and its parts (Ray's `inp[0]`, `inp.key`).
use super::{DagInner, InputKind, Node, NodeInner, NodeKind};
use crate::channel::endpoint::{ChanError, EdgeWriter, Msg};
use crate::compile::plan::GraphPlan;
use crate::exec::DriverIo;
use crate::value::{TypeTag, Value};
use std::any::Any;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

/// The input of a graph: a node holding the whole value given to `execute`, with accessors
/// for its parts. Each part used by the graph gets its own input channel.
pub struct InputNode<I> {
    pub(crate) node: Node<I>,
}

impl<I> Clone for InputNode<I> {
    fn clone(&self) -> Self {
        InputNode {
            node: self.node.clone(),
        }
    }
}

impl<I> Deref for InputNode<I> {
    type Target = Node<I>;
    fn deref(&self) -> &Node<I> {
        &self.node
    }
}

/// Positional access into a tuple input: `input.arg::<0>()`.
pub trait TupleArg<const N: usize> {
    /// The element's type.
    type Out: Value;
    /// Extract element `N`.
    fn get(&self) -> Self::Out;
}

macro_rules! tuple_arg_one {
    ([$($all:ident),+]; $i:tt => $t:ident) => {
        impl<$($all: Value),+> TupleArg<$i> for ($($all,)+) {
            type Out = $t;
            fn get(&self) -> $t {
                self.$i.clone()
            }
        }
    };
}

macro_rules! tuple_arg {
    ($all:tt; $($i:tt => $t:ident),+) => {
        $(tuple_arg_one!($all; $i => $t);)+
    };
}
tuple_arg!([A]; 0 => A);
tuple_arg!([A, B]; 0 => A, 1 => B);
tuple_arg!([A, B, C]; 0 => A, 1 => B, 2 => C);
tuple_arg!([A, B, C, D]; 0 => A, 1 => B, 2 => C, 3 => D);
tuple_arg!([A, B, C, D, E]; 0 => A, 1 => B, 2 => C, 3 => D, 4 => E);
tuple_arg!([A, B, C, D, E, F]; 0 => A, 1 => B, 2 => C, 3 => D, 4 => E, 5 => F);

impl<I: Value> InputNode<I> {
    pub(crate) fn new(node: Node<I>) -> Self {
        InputNode { node }
    }

    fn dag(&self) -> &Arc<DagInner> {
        self.node
            .inner
            .dag
            .as_ref()
            .expect("an input node always belongs to its graph")
    }

    fn part<T: Value>(
        &self,
        key: InputKind,
        f: impl Fn(&I) -> T + Send + Sync + 'static,
    ) -> Node<T> {
        let dag = self.dag();
        let existing = dag
            .nodes
            .lock()
            .iter()
            .filter_map(|w| w.upgrade())
            .find(|n| {
                matches!(&n.kind, NodeKind::Input(k) if *k == key) && n.ty == TypeTag::of::<T>()
            });
        if let Some(n) = existing {
            return Node::from_inner(n);
        }
        Node::from_inner(NodeInner::new(
            Some(dag.clone()),
            NodeKind::Input(key),
            TypeTag::of::<T>(),
            Some(feed::<I, T>(f)),
        ))
    }

    /// Positional part `N` of a tuple input (Ray's `inp[N]`): `execute((a, b))` sends `a` to
    /// the readers of `arg::<0>()` and `b` to those of `arg::<1>()`.
    pub fn arg<const N: usize>(&self) -> Node<<I as TupleArg<N>>::Out>
    where
        I: TupleArg<N>,
    {
        self.part(InputKind::Index(N), |i: &I| i.get())
    }

    /// Named part of the input (Ray's `inp.key`): `access` picks the field out of the input.
    /// The same `name` returns the same node.
    pub fn field<T: Value>(
        &self,
        name: &str,
        access: impl Fn(&I) -> T + Send + Sync + 'static,
    ) -> Node<T> {
        self.part(InputKind::Field(name.to_string()), access)
    }
}

/// How the driver writes one input channel from the whole input value.
pub(crate) trait InputFeed<I>: Send + Sync {
    fn feeder(
        &self,
        io: &DriverIo,
        plan: &GraphPlan,
        edge: u64,
    ) -> crate::Result<Box<dyn Feeder<I>>>;
}

/// Writes one part of each execution's input.
pub(crate) trait Feeder<I>: Send {
    fn feed(&mut self, input: &I, deadline: Option<Instant>) -> Result<(), ChanError>;
}

struct Feed<I, T>(Arc<dyn Fn(&I) -> T + Send + Sync>);

pub(crate) fn feed<I: Value, T: Value>(
    f: impl Fn(&I) -> T + Send + Sync + 'static,
) -> Box<dyn Any + Send + Sync> {
    let feed: Arc<dyn InputFeed<I>> = Arc::new(Feed::<I, T>(Arc::new(f)));
    Box::new(feed)
}

/// The whole input: written by reference, so shared-memory readers cost no clone of it.
struct WholeFeed;

pub(crate) fn whole_feed<I: Value>() -> Box<dyn Any + Send + Sync> {
    let feed: Arc<dyn InputFeed<I>> = Arc::new(WholeFeed);
    Box::new(feed)
}

impl<I: Value> InputFeed<I> for WholeFeed {
    fn feeder(
        &self,
        io: &DriverIo,
        plan: &GraphPlan,
        edge: u64,
    ) -> crate::Result<Box<dyn Feeder<I>>> {
        Ok(Box::new(WholeFeeder(io.writer::<I>(plan, edge)?)))
    }
}

struct WholeFeeder<I>(EdgeWriter<I>);

impl<I: Value> Feeder<I> for WholeFeeder<I> {
    fn feed(&mut self, input: &I, deadline: Option<Instant>) -> Result<(), ChanError> {
        self.0.write_ref(input, deadline)
    }
}

impl<I: Value, T: Value> InputFeed<I> for Feed<I, T> {
    fn feeder(
        &self,
        io: &DriverIo,
        plan: &GraphPlan,
        edge: u64,
    ) -> crate::Result<Box<dyn Feeder<I>>> {
        let writer = io.writer::<T>(plan, edge)?;
        Ok(Box::new(PartFeeder {
            access: self.0.clone(),
            writer,
        }))
    }
}

struct PartFeeder<I, T> {
    access: Arc<dyn Fn(&I) -> T + Send + Sync>,
    writer: EdgeWriter<T>,
}

impl<I: Value, T: Value> Feeder<I> for PartFeeder<I, T> {
    fn feed(&mut self, input: &I, deadline: Option<Instant>) -> Result<(), ChanError> {
        self.writer
            .write(Msg::Value((self.access)(input)), deadline)
    }
}
