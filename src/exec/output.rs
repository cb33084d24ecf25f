//! What `execute` hands back: one [`CompiledRef`] per output, shaped like the outputs (a node,
//! a tuple, a `Vec` or a [`MultiOutput`]), and the typed readers of the output channels.
use super::DriverIo;
use super::refs::{CompiledRef, ExecToken};
use crate::channel::{ChanError, Msg, Reader};
use crate::compile::plan::GraphPlan;
use crate::dag::{AnyNode, MultiOutput, Node};
use crate::error::{Result, TaskError};
use crate::value::Value;
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
    fn make_refs(&self, token: &ExecToken, first: usize) -> (Self::Refs, usize);
}

impl<T: Value> IntoOutputs for Node<T> {
    type Refs = CompiledRef<T>;
    fn output_specs(&self) -> Vec<OutputSpec> {
        vec![OutputSpec::of::<T>(self.erase())]
    }
    fn make_refs(&self, token: &ExecToken, first: usize) -> (Self::Refs, usize) {
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
    fn make_refs(&self, token: &ExecToken, first: usize) -> (Self::Refs, usize) {
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
    fn make_refs(&self, token: &ExecToken, first: usize) -> (Self::Refs, usize) {
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
            fn make_refs(&self, token: &ExecToken, first: usize) -> (Self::Refs, usize) {
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

/// Reads one output edge and hands one copy of each value to every output that names it.
pub(crate) trait OutputReader: Send {
    fn read(&mut self, copies: usize, deadline: Option<Instant>) -> Result<EdgeRead, ChanError>;
}

struct TypedOutput<T>(Reader<T>);

impl<T: Value> OutputReader for TypedOutput<T> {
    fn read(&mut self, copies: usize, deadline: Option<Instant>) -> Result<EdgeRead, ChanError> {
        let msg = self.0.read(deadline)?;
        let error = match &msg {
            Msg::Error(e) => Some(e.clone()),
            Msg::Value(_) => None,
        };
        let mut values: Vec<Box<dyn Any + Send>> = (1..copies)
            .map(|_| Box::new(msg.clone()) as Box<dyn Any + Send>)
            .collect();
        values.push(Box::new(msg));
        Ok(EdgeRead { values, error })
    }
}

/// One output of a graph with the typed code that reads it (built by [`IntoOutputs`]).
#[doc(hidden)]
pub struct OutputSpec {
    pub(crate) node: AnyNode,
    pub(crate) make: fn(&DriverIo, &GraphPlan, u64) -> Result<Box<dyn OutputReader>>,
}

impl OutputSpec {
    pub(crate) fn of<T: Value>(node: AnyNode) -> Self {
        OutputSpec {
            node,
            make: |io, plan, edge| Ok(Box::new(TypedOutput::<T>(io.reader::<T>(plan, edge)?))),
        }
    }
}
