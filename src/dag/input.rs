//! The input node and its parts (Ray's `inp[0]`, `inp.key`).
//!
//! The parts are made by `arg` and `field` (in the driver's input module, since each part
//! carries the code the driver writes it with); the graph keeps one node per part.
use super::{DagInner, InputKind, Node, NodeInner, NodeKind};
use crate::value::{TypeTag, Value};
use std::any::Any;
use std::ops::Deref;
use std::sync::Arc;

/// The input of a graph: a node holding the whole value given to `execute`, with accessors
/// for its parts. Each part used by the graph gets its own input channel.
#[must_use = "the input node does nothing unless it (or a part of it) is bound into a task"]
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
tuple_arg!([A, B, C, D, E, F, G]; 0 => A, 1 => B, 2 => C, 3 => D, 4 => E, 5 => F, 6 => G);
tuple_arg!([A, B, C, D, E, F, G, H]; 0 => A, 1 => B, 2 => C, 3 => D, 4 => E, 5 => F, 6 => G, 7 => H);
tuple_arg!([A, B, C, D, E, F, G, H, J]; 0 => A, 1 => B, 2 => C, 3 => D, 4 => E, 5 => F, 6 => G, 7 => H, 8 => J);
tuple_arg!([A, B, C, D, E, F, G, H, J, K]; 0 => A, 1 => B, 2 => C, 3 => D, 4 => E, 5 => F, 6 => G, 7 => H, 8 => J, 9 => K);
tuple_arg!([A, B, C, D, E, F, G, H, J, K, L]; 0 => A, 1 => B, 2 => C, 3 => D, 4 => E, 5 => F, 6 => G, 7 => H, 8 => J, 9 => K, 10 => L);
tuple_arg!([A, B, C, D, E, F, G, H, J, K, L, M]; 0 => A, 1 => B, 2 => C, 3 => D, 4 => E, 5 => F, 6 => G, 7 => H, 8 => J, 9 => K, 10 => L, 11 => M);

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

    /// The node of part `key` of type `T`: the existing one, or a new one carrying `feed`
    /// (made only when needed), the driver's code that writes it.
    pub(crate) fn part<T: Value>(
        &self,
        key: InputKind,
        feed: impl FnOnce() -> Box<dyn Any + Send + Sync>,
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
            Some(feed()),
        ))
    }
}
