//! Input feeding: the parts of the input node (Ray's `inp[0]`, `inp.key`) and the code that
//! writes each part's channel from the whole value given to `execute`.
use super::DriverIo;
use crate::channel::{ChanError, ChannelWriter, FanOut, Msg};
use crate::compile::plan::GraphPlan;
use crate::dag::{InputKind, InputNode, Node, NodeInner, NodeKind, TupleArg};
use crate::error::{Error, Result};
use crate::value::{TypeTag, Value};
use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

impl<I: Value> InputNode<I> {
    /// Positional part `N` of a tuple input (Ray's `inp[N]`): `execute((a, b))` sends `a` to
    /// the readers of `arg::<0>()` and `b` to those of `arg::<1>()`.
    pub fn arg<const N: usize>(&self) -> Node<<I as TupleArg<N>>::Out>
    where
        I: TupleArg<N>,
    {
        self.part(InputKind::Index(N), || feed(|i: &I| i.get()))
    }

    /// Named part of the input (Ray's `inp.key`): `access` picks the field out of the input.
    /// The same `name` returns the same node.
    pub fn field<T: Value>(
        &self,
        name: &str,
        access: impl Fn(&I) -> T + Send + Sync + 'static,
    ) -> Node<T> {
        self.part(InputKind::Field(name.to_string()), || feed(access))
    }
}

/// How the driver writes one input channel from the whole input value (what an input part
/// carries in the graph).
trait InputFeed<I>: Send + Sync {
    fn feeder(&self, io: &DriverIo, plan: &GraphPlan, edge: u64) -> Result<Box<dyn Feeder<I>>>;
}

/// Writes one part of each execution's input.
pub(crate) trait Feeder<I>: Send {
    fn feed(&mut self, input: &I, deadline: Option<Instant>) -> Result<(), ChanError>;
}

struct Feed<I, T>(Arc<dyn Fn(&I) -> T + Send + Sync>);

fn feed<I: Value, T: Value>(
    f: impl Fn(&I) -> T + Send + Sync + 'static,
) -> Box<dyn Any + Send + Sync> {
    let feed: Arc<dyn InputFeed<I>> = Arc::new(Feed::<I, T>(Arc::new(f)));
    Box::new(feed)
}

impl<I: Value, T: Value> InputFeed<I> for Feed<I, T> {
    fn feeder(&self, io: &DriverIo, plan: &GraphPlan, edge: u64) -> Result<Box<dyn Feeder<I>>> {
        let writer = io.writer::<T>(plan, edge)?;
        Ok(Box::new(PartFeeder {
            access: self.0.clone(),
            writer,
        }))
    }
}

struct PartFeeder<I, T> {
    access: Arc<dyn Fn(&I) -> T + Send + Sync>,
    writer: FanOut<T>,
}

impl<I: Value, T: Value> Feeder<I> for PartFeeder<I, T> {
    fn feed(&mut self, input: &I, deadline: Option<Instant>) -> Result<(), ChanError> {
        self.writer
            .write(Msg::Value((self.access)(input)), deadline)
    }
}

/// The whole input: written by reference, so shared-memory readers cost no clone of it.
struct WholeFeeder<I>(FanOut<I>);

impl<I: Value> Feeder<I> for WholeFeeder<I> {
    fn feed(&mut self, input: &I, deadline: Option<Instant>) -> Result<(), ChanError> {
        self.0.write_ref(input, deadline)
    }
}

/// The feeder of input node `node` (edge `edge` of `plan`) of a graph whose input is `I`.
pub(crate) fn feeder<I: Value>(
    node: &NodeInner,
    io: &DriverIo,
    plan: &GraphPlan,
    edge: u64,
) -> Result<Box<dyn Feeder<I>>> {
    let other_type = || Error::compile(node.describe(), "input node of another input type");
    if let NodeKind::Input(InputKind::Whole) = node.kind {
        if node.ty != TypeTag::of::<I>() {
            return Err(other_type());
        }
        return Ok(Box::new(WholeFeeder(io.writer::<I>(plan, edge)?)));
    }
    node.feed
        .as_ref()
        .and_then(|f| f.downcast_ref::<Arc<dyn InputFeed<I>>>())
        .ok_or_else(other_type)?
        .feeder(io, plan, edge)
}
