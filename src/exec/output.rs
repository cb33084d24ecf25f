//! What `execute` hands back: one [`CompiledRef`] per output, shaped like the outputs (a node,
//! a tuple, a `Vec` or a [`MultiOutput`]), and the typed readers of the output channels.
use super::DriverIo;
use super::refs::{CompiledRef, ExecToken};
use crate::actor::HandleCore;
use crate::actor::channels::{ErasedReader, ErasedReaderFn, erased_reader};
use crate::channel::{ChanError, Msg, Reader};
use crate::compile::plan::{GraphPlan, Loc};
use crate::dag::{AnyNode, MultiOutput, Node, NodeKind};
use crate::error::{Error, Result, TaskError};
use crate::tensor::Tensor;
use crate::value::{AnyValue, TypeTag, Value};
use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

/// The outputs of a graph and the refs `execute` returns for them.
pub trait IntoOutputs {
    /// What `execute` returns: one [`CompiledRef`] per output, shaped like the outputs.
    type Refs;
    #[doc(hidden)]
    fn output_specs(&self) -> Vec<OutputSpec>;
    /// Refs for outputs `first..`; returns them with the index after the last.
    #[doc(hidden)]
    fn make_refs(&self, token: &ExecToken<'_>, first: usize) -> (Self::Refs, usize);
}

impl<T: Value> IntoOutputs for Node<T> {
    type Refs = CompiledRef<T>;
    fn output_specs(&self) -> Vec<OutputSpec> {
        vec![OutputSpec::of::<T>(self.erase())]
    }
    fn make_refs(&self, token: &ExecToken<'_>, first: usize) -> (Self::Refs, usize) {
        (CompiledRef::new(token, first), first + 1)
    }
}

impl<T: Value> IntoOutputs for Vec<Node<T>> {
    type Refs = Vec<CompiledRef<T>>;
    fn output_specs(&self) -> Vec<OutputSpec> {
        self.iter()
            .map(|n| OutputSpec::of::<T>(n.erase()))
            .collect()
    }
    fn make_refs(&self, token: &ExecToken<'_>, first: usize) -> (Self::Refs, usize) {
        let end = first + self.len();
        (
            (first..end).map(|i| CompiledRef::new(token, i)).collect(),
            end,
        )
    }
}

impl<T: Value> IntoOutputs for MultiOutput<T> {
    type Refs = Vec<CompiledRef<T>>;
    fn output_specs(&self) -> Vec<OutputSpec> {
        self.0.output_specs()
    }
    fn make_refs(&self, token: &ExecToken<'_>, first: usize) -> (Self::Refs, usize) {
        self.0.make_refs(token, first)
    }
}

macro_rules! tuple_outputs {
    ($($t:ident $i:tt),+) => {
        #[allow(non_snake_case)]
        impl<$($t: IntoOutputs),+> IntoOutputs for ($($t,)+) {
            type Refs = ($($t::Refs,)+);
            fn output_specs(&self) -> Vec<OutputSpec> {
                let mut v = Vec::new();
                $(v.extend(self.$i.output_specs());)+
                v
            }
            fn make_refs(&self, token: &ExecToken<'_>, first: usize) -> (Self::Refs, usize) {
                let at = first;
                $(let ($t, at) = self.$i.make_refs(token, at);)+
                (($($t,)+), at)
            }
        }
    };
}
tuple_outputs!(A 0, B 1);
tuple_outputs!(A 0, B 1, C 2);
tuple_outputs!(A 0, B 1, C 2, D 3);
tuple_outputs!(A 0, B 1, C 2, D 3, E 4);
tuple_outputs!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_outputs!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_outputs!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);

/// One message of an output edge: a copy for every output that names the edge, and the
/// task's error when the message carries one (so that the driver can fail the execution's
/// other refs at once without knowing the edge's type).
pub(crate) struct EdgeRead {
    pub(crate) values: Vec<Box<dyn Any + Send>>,
    pub(crate) error: Option<Arc<TaskError>>,
}

impl EdgeRead {
    /// `copies` copies of `msg` (cloned for all but the last), with its error if it carries one.
    fn of<T: Clone + Send + 'static>(msg: Msg<T>, copies: usize) -> Self {
        let error = match &msg {
            Msg::Error(e) => Some(e.clone()),
            Msg::Value(_) => None,
        };
        let mut values: Vec<Box<dyn Any + Send>> = (1..copies)
            .map(|_| Box::new(msg.clone()) as Box<dyn Any + Send>)
            .collect();
        values.push(Box::new(msg));
        EdgeRead { values, error }
    }
}

/// Reads one output edge and hands one copy of each value to every output that names it.
pub(crate) trait OutputReader: Send {
    fn read(&mut self, copies: usize, deadline: Option<Instant>) -> Result<EdgeRead, ChanError>;

    /// Reads the next message into `slot`, an `Option<Msg<T>>` of the caller's `T`, with no
    /// allocation on the way. `Ok(false)`: the edge carries another type, and nothing was read.
    fn read_into(
        &mut self,
        slot: &mut dyn Any,
        deadline: Option<Instant>,
    ) -> Result<bool, ChanError>;
}

/// The message `read` returns, into `slot`, if `slot` holds messages of `T` (else nothing is read).
fn read_into<T: Value>(
    slot: &mut dyn Any,
    read: impl FnOnce() -> Result<Msg<T>, ChanError>,
) -> Result<bool, ChanError> {
    let Some(slot) = slot.downcast_mut::<Option<Msg<T>>>() else {
        return Ok(false);
    };
    *slot = Some(read()?);
    Ok(true)
}

struct TypedOutput<T>(Reader<T>);

impl<T: Value> OutputReader for TypedOutput<T> {
    fn read(&mut self, copies: usize, deadline: Option<Instant>) -> Result<EdgeRead, ChanError> {
        Ok(EdgeRead::of(self.0.read(deadline)?, copies))
    }

    fn read_into(
        &mut self,
        slot: &mut dyn Any,
        deadline: Option<Instant>,
    ) -> Result<bool, ChanError> {
        read_into(slot, || self.0.read(deadline))
    }
}

/// Reads an output edge whose type is known only to the method table (a by-name output).
struct ErasedOutput(Box<dyn ErasedReader>);

impl OutputReader for ErasedOutput {
    fn read(&mut self, copies: usize, deadline: Option<Instant>) -> Result<EdgeRead, ChanError> {
        Ok(EdgeRead::of(self.0.read(deadline)?, copies))
    }

    fn read_into(
        &mut self,
        slot: &mut dyn Any,
        deadline: Option<Instant>,
    ) -> Result<bool, ChanError> {
        read_into::<AnyValue>(slot, || self.0.read(deadline))
    }
}

type MakeReader = dyn Fn(&DriverIo, &GraphPlan, u64) -> Result<Box<dyn OutputReader>> + Send + Sync;

/// One output of a graph with the typed code that reads it (built by [`IntoOutputs`]).
#[doc(hidden)]
pub struct OutputSpec {
    pub(crate) node: AnyNode,
    pub(crate) make: Box<MakeReader>,
}

impl OutputSpec {
    pub(crate) fn of<T: Value>(node: AnyNode) -> Self {
        OutputSpec {
            node,
            make: Box::new(|io, plan, edge| {
                Ok(Box::new(TypedOutput::<T>(io.reader::<T>(plan, edge)?)))
            }),
        }
    }

    /// An output whose type the caller does not know: its reader comes from the method
    /// table of the actor that computes it, and yields [`AnyValue`]s.
    pub(crate) fn erased(node: AnyNode) -> Self {
        let at = node.clone();
        OutputSpec {
            node,
            make: Box::new(move |io, plan, edge| {
                let open = erased_reader_of(&at)?;
                let reader = open(&io.chans, plan, edge, Loc::Driver)
                    .map_err(|e| Error::compile(at.describe(), e))?;
                Ok(Box::new(ErasedOutput(reader)))
            }),
        }
    }
}

/// How the driver reads a by-name node's value: found in the method table of its actor for
/// a method call or an element of its tuple result; collectives carry tensors.
fn erased_reader_of(node: &AnyNode) -> Result<ErasedReaderFn> {
    let (actor, method, elem) = match &node.inner.kind {
        NodeKind::Method { actor, method, .. } => (actor, method, None),
        NodeKind::Split { source, index } => match &source.kind {
            NodeKind::Method { actor, method, .. } => (actor, method, Some(*index)),
            _ => {
                return Err(Error::compile(
                    node.describe(),
                    "only the result of a method can be split",
                ));
            }
        },
        NodeKind::Collective { .. } if node.inner.ty == TypeTag::of::<Tensor>() => {
            return Ok(erased_reader::<Tensor>);
        }
        _ => {
            return Err(Error::compile(
                node.describe(),
                format!(
                    "this node ({}) cannot be a by-name output: only method calls, their split elements and collectives can; use the typed node as the output",
                    node.type_name()
                ),
            ));
        }
    };
    let handle = HandleCore::of(actor).ok_or_else(|| {
        Error::compile(
            node.describe(),
            "its actor was not spawned by an adag Runtime; spawn it with Runtime::spawn",
        )
    })?;
    handle.output_reader(method, elem).ok_or_else(|| {
        Error::compile(
            node.describe(),
            match elem {
                None => format!("actor {} has no method `{method}`", handle.name()),
                Some(i) => format!(
                    "method `{method}` of actor {} has no tuple element {i} to read",
                    handle.name()
                ),
            },
        )
    })
}

/// A by-name node as an output: its ref yields an [`AnyValue`] (downcast it to the method's
/// return type).
///
/// ```
/// # use adag::{AnyValue, CompileOptions, Dag, ErasedArg, Placement, Runtime};
/// # pub struct W;
/// # #[adag::actor]
/// # impl W { pub fn new() -> Self { W } pub fn twice(&mut self, x: u64) -> u64 { 2 * x } }
/// let rt = Runtime::new()?;
/// let w = rt.spawn::<W>(Placement::Thread, ())?;
/// let dag = Dag::<u64>::new();
/// let y = w.method("twice")?.bind([ErasedArg::from(dag.input().erase())]);
/// let graph = dag.compile(y, CompileOptions::default())?;
/// let value: AnyValue = graph.execute(21)?.get()?;
/// assert_eq!(value.type_name(), "u64");
/// assert_eq!(value.downcast::<u64>().ok(), Some(42));
/// # Ok::<(), adag::Error>(())
/// ```
impl IntoOutputs for AnyNode {
    type Refs = CompiledRef<AnyValue>;
    fn output_specs(&self) -> Vec<OutputSpec> {
        vec![OutputSpec::erased(self.clone())]
    }
    fn make_refs(&self, token: &ExecToken<'_>, first: usize) -> (Self::Refs, usize) {
        (CompiledRef::new(token, first), first + 1)
    }
}

/// Several by-name outputs: one ref per node, in order.
impl IntoOutputs for Vec<AnyNode> {
    type Refs = Vec<CompiledRef<AnyValue>>;
    fn output_specs(&self) -> Vec<OutputSpec> {
        self.iter().cloned().map(OutputSpec::erased).collect()
    }
    fn make_refs(&self, token: &ExecToken<'_>, first: usize) -> (Self::Refs, usize) {
        let end = first + self.len();
        (
            (first..end).map(|i| CompiledRef::new(token, i)).collect(),
            end,
        )
    }
}
