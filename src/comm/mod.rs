//! Communicators (placeholder until the communicator module lands).
/// A group communicator for tensors.
pub trait Communicator: Send + Sync + std::fmt::Debug {}
