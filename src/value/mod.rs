//! Values that travel along edges, and how they are encoded between processes.
use serde::{Serialize, de::DeserializeOwned};
use std::any::TypeId;

mod any;
pub(crate) mod frame;

pub use any::AnyValue;

/// A value that can travel along an edge of a compiled graph.
///
/// Within one process values move without serialization; between processes they are encoded
/// with postcard. Fan-out to several readers clones the value for all but the last reader.
pub trait Value: Serialize + DeserializeOwned + Clone + Send + 'static {}
impl<T: Serialize + DeserializeOwned + Clone + Send + 'static> Value for T {}

/// The identity of a Rust type, comparable within a process (`id`) and across processes of the
/// same executable (`name`).
#[derive(Debug, Clone, Copy)]
pub struct TypeTag {
    pub(crate) name: &'static str,
    pub(crate) id: TypeId,
}

impl TypeTag {
    pub(crate) fn of<T: 'static>() -> Self {
        TypeTag {
            name: std::any::type_name::<T>(),
            id: TypeId::of::<T>(),
        }
    }

    /// The type's name as `std::any::type_name` spells it.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

impl PartialEq for TypeTag {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

pub(crate) use frame::note_serialize_failure;

pub(crate) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_stdvec(value)
}

pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(bytes)
}
