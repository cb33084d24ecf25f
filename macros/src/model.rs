//! The actor as the generator sees it: what `parse` extracts from the `impl` block and
//! `generate` turns into code. Everything here is already validated.

use proc_macro2::Ident;
use syn::{Attribute, ItemImpl, Type};

/// One `#[adag::actor] impl Type { ... }` block.
pub(crate) struct ActorModel {
    /// The impl block to emit again, with the `#[adag(...)]` helper attributes removed.
    pub item: ItemImpl,
    /// The actor type as written after `impl` (`Stage`, or a path to it).
    pub self_ty: Type,
    /// The last identifier of that type (`Stage`), from which generated names derive.
    pub ident: Ident,
    /// How the actor is built from its `Init`.
    pub ctor: Constructor,
    /// The exported methods, in source order.
    pub methods: Vec<Method>,
}

/// How `Actor::construct` builds the actor.
pub(crate) enum Constructor {
    /// No `new`: `Init = ()` and the actor comes from `Default`.
    Default,
    /// An associated `fn new(..) -> Self` or `-> Result<Self, E>`.
    New {
        /// Its arguments, which make up `Init`.
        args: Vec<Arg>,
        /// Whether it returns a `Result` (its error becomes the construction error).
        fallible: bool,
        /// Whether it is an `async fn` (driven with `block_on`).
        is_async: bool,
    },
}

/// One argument of an exported method or of the constructor.
pub(crate) struct Arg {
    /// The identifier used in generated code (the user's, or `__adag_arg{i}` for a pattern).
    pub ident: Ident,
    /// The name reported to the library (the user's identifier, or `arg{i}`).
    pub name: String,
    /// The argument type as written.
    pub ty: Type,
}

/// One exported method.
pub(crate) struct Method {
    /// The method identifier (kept with its span, raw if written raw).
    pub ident: Ident,
    /// The method name reported to the library (the identifier without `r#`).
    pub name: String,
    /// The arguments after the receiver.
    pub args: Vec<Arg>,
    /// What the method returns to the graph.
    pub output: Output,
    /// Whether it is an `async fn` (driven with `block_on`).
    pub is_async: bool,
    /// The user's `///` docs, copied onto the binder and caller methods.
    pub docs: Vec<Attribute>,
    /// `#[cfg(..)]` attributes, copied onto everything generated for it.
    pub cfgs: Vec<Attribute>,
    /// `#[deprecated]` attributes, copied onto the binder and caller methods.
    pub deprecated: Vec<Attribute>,
}

/// The result type `R` of a method node and how the method's return value becomes it.
pub(crate) struct Output {
    /// `R`: the value the node carries (`()` for a unit method).
    pub ty: Type,
    /// The method returns nothing (`R = ()`).
    pub unit: bool,
    /// The method returns a `Result` whose `Ok` value is `R`; its error is reported with `to_string`.
    pub fallible: bool,
    /// `R` is a tuple of 2..=8 elements, so the entry is built with `method_split`.
    pub split: bool,
}
