//! Memory of a method's output channel, lent to the method while it runs
//! ([`output_buffer`]): a result built there is written once, where its readers read it.
//!
//! The schedule loop sets the lender of the running compute operation in a thread-local
//! (methods, async ones included, run on their actor's thread) and takes it away when the
//! method returns; outside a method, or when the output has no shared memory, the buffer
//! is on the heap.
use crate::buffer::BufferMut;
use std::cell::Cell;
use std::ptr::NonNull;
use std::rc::Rc;

/// Lends `len` bytes of an output channel's memory; `None` when it has none free.
pub(crate) type Lender = Rc<dyn Fn(usize) -> Option<BufferMut>>;

thread_local! {
    /// The lender of the method running on this thread, borrowed from [`lending`]'s caller
    /// for the length of the call. A plain pointer in a `Cell`, not a counted `Rc` in a
    /// `RefCell`: setting and restoring it are two stores to a thread-local without a
    /// destructor, where the counted form (a clone, two borrows, a drop per call) cost
    /// ~20 ns of a 0.44 µs `echo/thread` round trip.
    static CURRENT: Cell<Option<NonNull<Lender>>> = const { Cell::new(None) };
}

/// Runs `f` (a method) with `lender` as what [`output_buffer`] draws on.
pub(crate) fn lending<R>(lender: Option<&Lender>, f: impl FnOnce() -> R) -> R {
    let Some(lender) = lender else {
        return f();
    };
    /// Puts the previous lender back, also when the method panics.
    struct Restore(Option<NonNull<Lender>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.set(self.0);
        }
    }
    let _restore = Restore(CURRENT.replace(Some(NonNull::from(lender))));
    f()
}

/// `len` bytes for the result of the running actor method, in the shared memory of the
/// method's output channel when it has one: a [`Buffer`](crate::Buffer) (or a
/// [`Tensor`](crate::Tensor)) frozen from it and returned is then written once, where the
/// readers read it, instead of being copied into the channel after the method. Elsewhere
/// (outside a method, a result read only by actors of the same process, no memory free
/// now) the bytes are on the heap; [`BufferMut::is_loaned`] tells which.
///
/// The bytes hold whatever the memory held before (a lent block is reused, not cleared):
/// write every byte you return. The counterpart for a graph's input is
/// [`CompiledGraph::input_buffer`](crate::CompiledGraph::input_buffer).
///
/// ```
/// use adag::{Buffer, CompileOptions, Dag, Placement, Runtime};
///
/// struct Xor;
///
/// #[adag::actor]
/// impl Xor {
///     pub fn new() -> Self { Xor }
///     /// A new buffer computed from the input, built in the output channel's memory.
///     pub fn transform(&mut self, input: Buffer) -> Buffer {
///         let mut out = adag::output_buffer(input.len());
///         for (o, i) in out.iter_mut().zip(input.iter()) {
///             *o = i ^ 0x5a;
///         }
///         out.freeze()
///     }
/// }
///
/// # fn main() -> adag::Result<()> {
/// let rt = Runtime::new()?;
/// let actor = rt.spawn::<Xor>(Placement::Process, ())?;
/// let dag = Dag::<Buffer>::new();
/// let graph = dag.compile(actor.transform(dag.input()), CompileOptions::default())?;
/// let out = graph.execute(Buffer::from(vec![0u8; 1 << 20]))?.get()?;
/// assert!(out.iter().all(|&b| b == 0x5a));
/// # Ok(())
/// # }
/// ```
pub fn output_buffer(len: usize) -> BufferMut {
    let lender = CURRENT.get().map(|lender| {
        // SAFETY: the pointer was made from a `&Lender` by `lending`, whose frame holds that
        // borrow until `Restore` takes the pointer out again, on return and on unwind alike;
        // only this thread reads it, and only from inside `f`, within that frame.
        unsafe { lender.as_ref() }.clone()
    });
    lender
        .and_then(|lend| lend(len))
        .unwrap_or_else(|| BufferMut::zeroed(len))
}
