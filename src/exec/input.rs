//! Input feeding: the parts of the input node (Ray's `inp[0]`, `inp.key`) and the code that
//! writes each part's channel from the whole value given to `execute`.
use super::DriverIo;
use crate::buffer::BufferMut;
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
    #[must_use = "an input part does nothing unless it is bound into a task"]
    pub fn arg<const N: usize>(&self) -> Node<<I as TupleArg<N>>::Out>
    where
        I: TupleArg<N>,
    {
        self.part(InputKind::Index(N), || feed(|i: &I| i.get()))
    }

    /// Named part of the input (Ray's `inp.key`): `access` picks the field out of the input.
    /// The same `name` returns the same node.
    #[must_use = "an input part does nothing unless it is bound into a task"]
    pub fn field<T: Value>(
        &self,
        name: &str,
        access: impl Fn(&I) -> T + Send + Sync + 'static,
    ) -> Node<T> {
        self.part(InputKind::Field(name.to_string()), || feed(access))
    }
}

/// An input whose parts are reached by position: a `Vec` or an array.
pub trait IndexedInput: Value {
    /// The element type.
    type Elem: Value;
    /// How many elements this input has.
    fn count(&self) -> usize;
    /// Element `index` (below [`count`](IndexedInput::count)).
    fn at(&self, index: usize) -> &Self::Elem;
}

impl<T: Value> IndexedInput for Vec<T> {
    type Elem = T;
    fn count(&self) -> usize {
        self.len()
    }
    fn at(&self, index: usize) -> &T {
        &self[index]
    }
}

impl<T: Value, const N: usize> IndexedInput for [T; N]
where
    [T; N]: Value,
{
    type Elem = T;
    fn count(&self) -> usize {
        N
    }
    fn at(&self, index: usize) -> &T {
        &self[index]
    }
}

impl<I: IndexedInput> InputNode<I> {
    /// Element `index` of a `Vec` or array input (Ray's `inp[i]` on a list): only that element
    /// is cloned for its readers, not the whole input. An execution whose input has no element
    /// `index` is refused with [`Error::Input`] before anything of it is sent.
    ///
    /// ```
    /// use adag::{CompileOptions, Dag, Error, Placement, Runtime};
    /// # pub struct Sum;
    /// # #[adag::actor]
    /// # impl Sum { pub fn new() -> Self { Sum } pub fn add(&mut self, a: u64, b: u64) -> u64 { a + b } }
    /// let rt = Runtime::new()?;
    /// let s = rt.spawn::<Sum>(Placement::Thread, ())?;
    /// let dag = Dag::<Vec<u64>>::new();
    /// let input = dag.input();
    /// let graph = dag.compile(s.add(input.index(0), input.index(11)), CompileOptions::default())?;
    /// assert_eq!(graph.execute((0..12).collect())?.get()?, 11);
    /// assert!(matches!(graph.execute(vec![1, 2]), Err(Error::Input { .. })));
    /// # Ok::<(), adag::Error>(())
    /// ```
    #[must_use = "an input part does nothing unless it is bound into a task"]
    pub fn index(&self, index: usize) -> Node<I::Elem> {
        self.part(InputKind::Index(index), || {
            let feed: Arc<dyn InputFeed<I>> = Arc::new(Feed::<I, I::Elem> {
                access: Arc::new(move |i: &I| i.at(index).clone()),
                check: Some(Arc::new(move |i: &I| {
                    (index < i.count()).then_some(()).ok_or_else(|| {
                        format!(
                            "the graph reads element {index}, but this input has {} elements; pass at least {}",
                            i.count(),
                            index + 1
                        )
                    })
                })),
            });
            Box::new(feed) as Box<dyn Any + Send + Sync>
        })
    }
}

/// How the driver writes one input channel from the whole input value (what an input part
/// carries in the graph).
trait InputFeed<I>: Send + Sync {
    fn feeder(&self, io: &DriverIo, plan: &GraphPlan, edge: u64) -> Result<Box<dyn Feeder<I>>>;
}

/// Writes one part of each execution's input.
pub(crate) trait Feeder<I>: Send {
    /// Whether this input has the part at all (checked for every part before any is sent, so
    /// that a refused input leaves the channels in step).
    fn check(&self, _input: &I) -> std::result::Result<(), String> {
        Ok(())
    }
    fn feed(&mut self, input: &I, deadline: Option<Instant>) -> Result<(), ChanError>;
    /// The input part it writes, as errors name it: `input`, `input[0]`, `input.key`.
    fn part(&self) -> &str;
    /// The Rust type of that part.
    fn type_name(&self) -> &'static str;
    /// `len` bytes lent by one of its channels (see [`FanOut::loan`]).
    fn loan(&mut self, len: usize) -> Option<BufferMut>;
}

type Access<I, T> = Arc<dyn Fn(&I) -> T + Send + Sync>;
type Check<I> = Arc<dyn Fn(&I) -> std::result::Result<(), String> + Send + Sync>;

struct Feed<I, T> {
    access: Access<I, T>,
    check: Option<Check<I>>,
}

fn feed<I: Value, T: Value>(
    f: impl Fn(&I) -> T + Send + Sync + 'static,
) -> Box<dyn Any + Send + Sync> {
    let feed: Arc<dyn InputFeed<I>> = Arc::new(Feed::<I, T> {
        access: Arc::new(f),
        check: None,
    });
    Box::new(feed)
}

impl<I: Value, T: Value> InputFeed<I> for Feed<I, T> {
    fn feeder(&self, io: &DriverIo, plan: &GraphPlan, edge: u64) -> Result<Box<dyn Feeder<I>>> {
        let writer = io.writer::<T>(plan, edge)?;
        Ok(Box::new(PartFeeder {
            access: self.access.clone(),
            check: self.check.clone(),
            writer,
            part: plan
                .edge(edge)
                .map_or_else(|_| format!("input#{edge}"), |e| e.label.clone()),
        }))
    }
}

struct PartFeeder<I, T> {
    access: Access<I, T>,
    check: Option<Check<I>>,
    writer: FanOut<T>,
    part: String,
}

impl<I: Value, T: Value> Feeder<I> for PartFeeder<I, T> {
    fn check(&self, input: &I) -> std::result::Result<(), String> {
        self.check.as_ref().map_or(Ok(()), |check| check(input))
    }

    fn feed(&mut self, input: &I, deadline: Option<Instant>) -> Result<(), ChanError> {
        self.writer
            .write(Msg::Value((self.access)(input)), deadline)
    }
    fn part(&self) -> &str {
        &self.part
    }
    fn loan(&mut self, len: usize) -> Option<BufferMut> {
        self.writer.loan(len)
    }
    fn type_name(&self) -> &'static str {
        std::any::type_name::<T>()
    }
}

/// The whole input: written by reference, so shared-memory readers cost no clone of it.
struct WholeFeeder<I>(FanOut<I>);

impl<I: Value> Feeder<I> for WholeFeeder<I> {
    fn feed(&mut self, input: &I, deadline: Option<Instant>) -> Result<(), ChanError> {
        self.0.write_ref(input, deadline)
    }
    fn part(&self) -> &str {
        "input"
    }
    fn loan(&mut self, len: usize) -> Option<BufferMut> {
        self.0.loan(len)
    }
    fn type_name(&self) -> &'static str {
        std::any::type_name::<I>()
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
