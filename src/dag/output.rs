//! What a graph returns: one node, a tuple of nodes, or a list (Ray's `MultiOutputNode`).
use super::Node;
use crate::exec::{CompiledRef, ExecToken, OutputSpec};
use crate::value::Value;

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

/// Several outputs of one type, read in order (Ray's `MultiOutputNode`).
pub struct MultiOutput<T>(pub Vec<Node<T>>);

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
