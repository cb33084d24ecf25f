//! What a graph returns: one node, a tuple of nodes, or a list (Ray's `MultiOutputNode`).
//! Which refs `execute` hands back for each shape is the driver's business
//! ([`IntoOutputs`](crate::IntoOutputs)).
use super::Node;

/// Several outputs of one type, read in order (Ray's `MultiOutputNode`).
pub struct MultiOutput<T>(pub Vec<Node<T>>);
