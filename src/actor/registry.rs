//! Link-time registry of actor types, so that a worker process can build any actor by name
//! from serialized init arguments.
use super::Actor;
use super::host::{ErasedHost, Host};
use crate::value::decode;

/// One registered actor type (emitted by `#[actor]` into the link-time list `ACTOR_TYPES`).
pub struct ActorTypeEntry {
    pub(crate) name: fn() -> &'static str,
    pub(crate) build: BuildHost,
}

type BuildHost = fn(&[u8], u64, String) -> Result<Box<dyn ErasedHost>, String>;

impl ActorTypeEntry {
    /// The entry of actor type `A`.
    pub const fn of<A: Actor>() -> Self {
        ActorTypeEntry {
            name: A::type_name,
            build: build::<A>,
        }
    }
}

fn build<A: Actor>(init: &[u8], id: u64, name: String) -> Result<Box<dyn ErasedHost>, String> {
    let init: A::Init = decode(init).map_err(|e| {
        format!(
            "cannot decode the init arguments of {} ({}): {e}",
            A::type_name(),
            std::any::type_name::<A::Init>()
        )
    })?;
    let actor = A::construct(init)?;
    Ok(Box::new(Host { actor, id, name }))
}

/// Every actor type linked into this executable.
#[linkme::distributed_slice]
pub static ACTOR_TYPES: [ActorTypeEntry];

pub(crate) fn lookup(type_name: &str) -> Option<&'static ActorTypeEntry> {
    ACTOR_TYPES.iter().find(|e| (e.name)() == type_name)
}
