//! The `#[actor]` attribute of [adag](https://docs.rs/adag), re-exported as `adag::actor`.
//!
//! `#[adag::actor]` goes on the inherent `impl` block of a struct. It leaves the block as it
//! is and adds what turns the struct into an adag actor: an `adag::Actor` impl with the table
//! of its exported methods, a *binder* type whose methods add nodes to a graph, a *caller*
//! type whose methods make one-off calls, and the registration of the type so that worker
//! processes can build it by name. See [`macro@actor`] for the rules; the library's docs have
//! runnable examples.
//!
//! The expansion happens in three steps, one module each: `parse` reads and checks the
//! `impl` block, `model` is what it found, and `generate` writes the code. Code generated here
//! refers to the library only through `::adag` paths (`::adag::__private` is its hidden
//! support module), so it works in any crate that depends on `adag`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod generate;
mod model;
mod parse;
#[cfg(test)]
mod tests;

use proc_macro::TokenStream;

/// Makes the struct of an inherent `impl` block an adag actor.
///
/// ```
/// use adag::{actor, CompileOptions, Dag, Placement, Runtime};
///
/// #[derive(Default)]
/// pub struct Stage { scale: f32 }
///
/// #[actor]
/// impl Stage {
///     /// Optional constructor: its arguments become `Actor::Init` (here `f32`).
///     pub fn new(scale: f32) -> Self { Stage { scale } }
///
///     /// Exported: `&self` / `&mut self` methods with owned, `Value` arguments.
///     pub fn forward(&mut self, x: Vec<f32>) -> Vec<f32> {
///         x.into_iter().map(|v| v * self.scale).collect()
///     }
///
///     /// A tuple result can be split into one node per element in the graph.
///     pub fn stats(&self, x: Vec<f32>) -> (f32, f32) { (x[0], x[x.len() - 1]) }
///
///     /// A `Result` fails the task with the error's `Display`.
///     pub fn check(&self, v: u64) -> Result<u64, std::io::Error> { Ok(v) }
///
///     /// `async` methods are driven to completion on the actor's thread.
///     pub async fn fetch(&mut self, k: u32) -> u32 { k }
///
///     /// Not exported.
///     #[adag(skip)]
///     fn helper(&self) -> usize { 0 }
/// }
///
/// let rt = Runtime::new()?;
/// let stage = rt.spawn::<Stage>(Placement::Thread, 2.0)?;   // an ActorHandle<Stage>
/// let dag = Dag::<Vec<f32>>::new();
/// let out = stage.forward(dag.input());                     // a Node<Vec<f32>> in a graph
/// let (first, last) = stage.stats(&out).split();            // a tuple split into two nodes
/// let graph = dag.compile((first, last), CompileOptions::default())?;
/// assert_eq!(adag::get_all(graph.execute(vec![1.0, 2.0, 3.0])?)?, (2.0, 6.0));
/// graph.teardown()?;
/// assert_eq!(stage.call().check(7)?, 7);                    // a one-off call
/// assert_eq!(stage.call().fetch(9)?, 9);
/// # Ok::<(), adag::Error>(())
/// ```
///
/// # Exported methods
///
/// Every `fn` with a `&self` or `&mut self` receiver, unless marked `#[adag(skip)]`. Each one
/// gets a method of the same name on the binder (arguments `impl Into<adag::Arg<T>>`, returns
/// `adag::Node<R>`) and on the caller (arguments `T`, returns `Result<R, adag::Error>`), and an
/// entry in `Actor::methods()`. The user's doc comments, `#[cfg]` and `#[deprecated]` are
/// carried over.
///
/// * Arguments are passed by value and must be `Value`s (`Serialize + DeserializeOwned +
///   Clone + Send + Sync + 'static`): references, borrowed lifetimes, `impl Trait`, `Self`
///   and generic methods are errors. An argument written as a pattern (`(a, b): (u32, u32)`,
///   `_`) is fine; it is reported to the library as `arg{i}`.
/// * The result `R` is decided on the written return type: none or `()` gives `R = ()`;
///   `Result<T, E>` (any path ending in `Result`, with `E: Display`) or a one-argument
///   `Result<T>` alias such as `anyhow::Result<T>` gives `R = T`, an `Err` failing the task
///   with `e.to_string()`; anything else is `R` itself. When `R` is a tuple of 2 to 8
///   elements the entry is made with `method_split`, so that the graph can split the node
///   into one node per element. References, `impl Trait`, `!` and `Self` are errors.
/// * `async fn`s are run with `adag::__private::block_on` on the actor's thread.
/// * A by-value `self`, other receivers (`Box<Self>`, ...), `unsafe fn`, a `new` with a
///   receiver and the names `call`, `id`, `name`, `method`, `kill`, `core`, `pid` and `clone`
///   (used by `ActorHandle` itself, which derefs to the binder) are errors; rename the method
///   or mark it `#[adag(skip)]`.
///
/// Associated functions without a receiver, constants and types are left alone.
///
/// # Constructor
///
/// An associated `fn new` (no receiver) returning `Self` (or the type's name) or
/// `Result<Self, E>` builds the actor. Its arguments make up `Actor::Init`: `()` for none,
/// the type of a single one, a tuple of them for several. It may be `async`. Without a `new`
/// (or with `#[adag(skip)]` on it), `Init = ()` and the actor is built with `Default`.
///
/// # Restrictions on the impl block
///
/// The block must be inherent (`impl Stage`, not `impl Trait for Stage`) and non-generic, on
/// a named type. One `#[adag::actor]` block per type: it defines `__Adag{Type}Binder`,
/// `__Adag{Type}Caller` and `__ADAG_REGISTER_{TYPE}` in the enclosing module.
///
/// # Errors
///
/// Every rule above is checked at compile time with a message at the offending tokens; all
/// the errors of a block are reported together, and the block itself is still emitted so
/// that its other uses do not fail too.
#[proc_macro_attribute]
pub fn actor(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand(attr.into(), item.into()).into()
}

/// The whole expansion, on `proc_macro2` tokens so that it can be tested.
fn expand(
    attr: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    match parse::analyze(attr, item) {
        Ok(model) => generate::generate(&model),
        Err(failure) => {
            let mut out = failure.item.unwrap_or_default();
            out.extend(failure.error.to_compile_error());
            out
        }
    }
}
