//! Method tables and the typed operations built from a schedule.
//!
//! `#[actor]` registers each method as a plain `fn(&mut A, Args) -> Result<R, MethodError>`; the
//! generic code here turns it into the operations of an actor's schedule. All type dispatch
//! happens once, when the schedule is installed: the loop then runs boxed closures over
//! typed slots and channels, with no lookup by name.
use super::call::{Between, CallFailure};
use super::channels::{ErasedReaderFn, GraphChannels, erased_reader};
use super::comm_ops::{self, CommCtx, ScheduleWiring};
use super::lend::{self, Lender};
use super::observe::BusyClock;
use super::op::Op;
use crate::channel::slot::LocalSlot;
use crate::channel::{ChanError, ChannelReader, ChannelWriter, FanOut, Holding, Msg, Reader};
use crate::compile::plan::{ArgSource, GraphPlan, Loc, OpSpec};
use crate::dag::MethodSig;
use crate::error::{MethodError, TaskError};
use crate::tensor::Tensor;
use crate::value::{TypeTag, Value, decode, encode};
use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;
use std::sync::Arc;

/// One exported method of an actor type.
pub struct MethodEntry<A> {
    pub(crate) name: &'static str,
    pub(crate) arg_names: &'static [&'static str],
    pub(crate) imp: Box<dyn ErasedMethod<A>>,
}

impl<A> MethodEntry<A> {
    pub(crate) fn sig(&self) -> MethodSig {
        MethodSig {
            names: self.arg_names,
            ..self.imp.sig()
        }
    }
}

pub(crate) trait ErasedMethod<A>: Send + Sync {
    fn sig(&self) -> MethodSig;
    fn call_any(
        &self,
        actor: &mut A,
        args: Box<dyn Any + Send>,
    ) -> Result<Box<dyn Any + Send>, CallFailure>;
    fn call_encoded(&self, actor: &mut A, args: &[u8]) -> Result<Vec<u8>, CallFailure>;
    fn build(
        &self,
        b: &mut TaskBuilder<'_, A>,
        node: u64,
        args: &[ArgSource],
    ) -> Result<Op<A>, String>;
    fn build_split(
        &self,
        b: &mut TaskBuilder<'_, A>,
        node: u64,
        source: u64,
        index: usize,
    ) -> Result<Op<A>, String>;
    /// One operation that reads the method's argument `edge` from its channel, runs the
    /// method and writes its result to its output channel, with no slot between the three
    /// (see [`fusable`]); `None`, with nothing built, when the result has no channel.
    fn build_fused(
        &self,
        b: &mut TaskBuilder<'_, A>,
        node: u64,
        args: &[ArgSource],
        edge: u64,
    ) -> Result<Option<Op<A>>, String>;
    /// Opens a driver's reader of the method's result, without the caller knowing its type
    /// (a by-name output).
    fn output_reader(&self) -> ErasedReaderFn;
    /// The same for element `index` of a tuple result; `None` when the result is not a
    /// tuple or has no such element.
    fn elem_reader(&self, index: usize) -> Option<ErasedReaderFn>;
}

struct Method<A, Args, R> {
    name: &'static str,
    f: fn(&mut A, Args) -> Result<R, MethodError>,
    split: Option<Split<A>>,
}

type SplitFn<A> = fn(&mut TaskBuilder<'_, A>, u64, u64, usize) -> Result<Op<A>, String>;

/// What a method returning a tuple knows of its elements, fixed where their types are known.
struct Split<A> {
    build: SplitFn<A>,
    tags: fn() -> Vec<TypeTag>,
    reader: fn(usize) -> Option<ErasedReaderFn>,
}

fn entry<A: 'static, Args: ArgTuple, R: Value>(
    name: &'static str,
    arg_names: &'static [&'static str],
    f: fn(&mut A, Args) -> Result<R, MethodError>,
    split: Option<Split<A>>,
) -> MethodEntry<A> {
    MethodEntry {
        name,
        arg_names,
        imp: Box::new(Method { name, f, split }),
    }
}

/// Register a method (used by `#[actor]`).
pub fn method<A: 'static, Args: ArgTuple, R: Value>(
    name: &'static str,
    arg_names: &'static [&'static str],
    f: fn(&mut A, Args) -> Result<R, MethodError>,
) -> MethodEntry<A> {
    entry(name, arg_names, f, None)
}

/// Register a method returning a tuple, whose elements the graph may split into nodes.
pub fn method_split<A: 'static, Args: ArgTuple, R: SplitTuple>(
    name: &'static str,
    arg_names: &'static [&'static str],
    f: fn(&mut A, Args) -> Result<R, MethodError>,
) -> MethodEntry<A> {
    entry(
        name,
        arg_names,
        f,
        Some(Split {
            build: R::build_split::<A>,
            tags: R::tags,
            reader: R::elem_reader,
        }),
    )
}

/// What a method's panic becomes: its text and, when `RUST_BACKTRACE` (or
/// `RUST_LIB_BACKTRACE`) asks for one, the backtrace the panic hook captured.
pub(crate) fn panic_failure(payload: Box<dyn Any + Send>) -> MethodError {
    MethodError {
        chain: vec![panic_text(payload)],
        error_type: None,
        backtrace: LAST_BACKTRACE.with(|b| b.borrow_mut().take()),
    }
}

thread_local! {
    /// The backtrace of this thread's latest panic (set by the hook of `capture_backtraces`).
    static LAST_BACKTRACE: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Install, once per process, a panic hook that keeps the panic's backtrace for
/// `panic_failure` and then runs the hook that was there before (by default the one that
/// prints the panic). `catch_unwind` hands over only the payload, so the hook is the one place
/// where the panicking stack can still be walked. `Backtrace::capture` costs nothing unless
/// the user's environment asks for backtraces.
pub(crate) fn capture_backtraces() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let bt = std::backtrace::Backtrace::capture();
            if bt.status() == std::backtrace::BacktraceStatus::Captured {
                LAST_BACKTRACE.with(|b| *b.borrow_mut() = Some(bt.to_string()));
            }
            previous(info)
        }));
    });
}

pub(crate) fn panic_text(payload: Box<dyn Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}

impl<A: 'static, Args: ArgTuple, R: Value> Method<A, Args, R> {
    /// The method's run inside a schedule, as the message its output carries: a failure or a
    /// panic becomes an error naming the actor and the method, and the method draws on the
    /// memory `node`'s output channel lends.
    fn runner(
        &self,
        b: &TaskBuilder<'_, A>,
        node: u64,
    ) -> impl FnMut(&mut A, Args) -> Msg<R> + use<A, Args, R> {
        let lender = b.lender(node);
        let f = self.f;
        let actor_name = b.actor_name.clone();
        let method = self.name;
        move |actor: &mut A, args: Args| match catch_unwind(AssertUnwindSafe(|| {
            lend::lending(lender.as_ref(), || f(actor, args))
        })) {
            Ok(Ok(v)) => Msg::Value(v),
            Ok(Err(cause)) => {
                Msg::Error(Arc::new(TaskError::of_method(&actor_name, method, cause)))
            }
            Err(p) => Msg::Error(Arc::new(TaskError::of_method(
                &actor_name,
                method,
                panic_failure(p),
            ))),
        }
    }

    fn invoke(&self, actor: &mut A, args: Args) -> Result<R, CallFailure> {
        capture_backtraces();
        match catch_unwind(AssertUnwindSafe(|| (self.f)(actor, args))) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(CallFailure::Task(e)),
            Err(p) => Err(CallFailure::Task(panic_failure(p))),
        }
    }
}

impl<A: 'static, Args: ArgTuple, R: Value> ErasedMethod<A> for Method<A, Args, R> {
    fn sig(&self) -> MethodSig {
        MethodSig {
            names: &[],
            args: Args::tags(),
            ret: TypeTag::of::<R>(),
            elems: self.split.as_ref().map(|s| (s.tags)()),
        }
    }

    fn call_any(
        &self,
        actor: &mut A,
        args: Box<dyn Any + Send>,
    ) -> Result<Box<dyn Any + Send>, CallFailure> {
        let args = args.downcast::<Args>().map_err(|_| {
            CallFailure::BadArgs(format!(
                "expected arguments {}",
                std::any::type_name::<Args>()
            ))
        })?;
        self.invoke(actor, *args)
            .map(|r| Box::new(r) as Box<dyn Any + Send>)
    }

    fn call_encoded(&self, actor: &mut A, args: &[u8]) -> Result<Vec<u8>, CallFailure> {
        let args: Args = decode(args).map_err(|e| {
            CallFailure::BadArgs(format!(
                "cannot decode arguments {}: {e}",
                std::any::type_name::<Args>()
            ))
        })?;
        let r = self.invoke(actor, args)?;
        encode(&r).map_err(|e| {
            CallFailure::Task(MethodError::message(format!(
                "cannot encode the result: {e}"
            )))
        })
    }

    fn build(
        &self,
        b: &mut TaskBuilder<'_, A>,
        node: u64,
        args: &[ArgSource],
    ) -> Result<Op<A>, String> {
        capture_backtraces();
        let mut readers = Args::build(b, args, None)?;
        let out = b.output::<R>(node, self.name)?;
        let mut run = self.runner(b, node);
        Ok(Box::new(move |actor: &mut A| {
            let msg = match Args::read(&mut readers)? {
                Err(upstream) => Msg::Error(upstream),
                Ok(args) => run(actor, args),
            };
            out.put(msg);
            Ok(())
        }))
    }

    fn build_fused(
        &self,
        b: &mut TaskBuilder<'_, A>,
        node: u64,
        args: &[ArgSource],
        edge: u64,
    ) -> Result<Option<Op<A>>, String> {
        capture_backtraces();
        let Some(send) = b.result_sender::<R>(node, self.name)? else {
            return Ok(None);
        };
        let mut readers = Args::build(b, args, Some(edge))?;
        let mut run = self.runner(b, node);
        let busy = b.busy.clone();
        Ok(Some(Box::new(move |actor: &mut A| {
            let msg = match Args::read(&mut readers)? {
                Err(upstream) => Msg::Error(upstream),
                Ok(args) => {
                    let start = busy.start();
                    let msg = run(actor, args);
                    busy.stop(start);
                    msg
                }
            };
            send.send(msg)
        })))
    }

    fn build_split(
        &self,
        b: &mut TaskBuilder<'_, A>,
        node: u64,
        source: u64,
        index: usize,
    ) -> Result<Op<A>, String> {
        match &self.split {
            Some(split) => (split.build)(b, node, source, index),
            None => Err(format!(
                "method {} does not return a tuple, so its result cannot be split",
                self.name
            )),
        }
    }

    fn output_reader(&self) -> ErasedReaderFn {
        erased_reader::<R>
    }

    fn elem_reader(&self, index: usize) -> Option<ErasedReaderFn> {
        self.split.as_ref().and_then(|s| (s.reader)(index))
    }
}

/// Where one argument of a compute operation comes from, once built.
pub enum ArgReader<T> {
    #[doc(hidden)]
    Slot(Rc<LocalSlot<T>>),
    #[doc(hidden)]
    Const(T),
    /// Straight from the edge's channel (a fused operation's argument).
    #[doc(hidden)]
    Channel(EdgeRead<T>),
}

impl<T: Clone> ArgReader<T> {
    #[inline]
    fn get(&mut self) -> Result<Msg<T>, ChanError> {
        match self {
            ArgReader::Slot(s) => Ok(s.take()),
            ArgReader::Const(v) => Ok(Msg::Value(v.clone())),
            ArgReader::Channel(read) => read.next(),
        }
    }
}

/// The argument list of a method, as a tuple (implemented for `()` to 8-tuples).
pub trait ArgTuple: Value {
    #[doc(hidden)]
    type Readers: 'static;
    #[doc(hidden)]
    fn tags() -> Vec<TypeTag>;
    /// The readers of the arguments `args`; the one of edge `direct`, if any, reads its
    /// channel itself (a fused operation), the others their slots.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn build<A>(
        b: &mut TaskBuilder<'_, A>,
        args: &[ArgSource],
        direct: Option<u64>,
    ) -> Result<Self::Readers, String>;
    /// The arguments, or the first upstream error among them; `Err` when a channel read
    /// directly failed.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn read(readers: &mut Self::Readers) -> Result<Result<Self, Arc<TaskError>>, ChanError>;
}

macro_rules! arg_tuple {
    ($n:literal; $($t:ident $i:tt),*) => {
        impl<$($t: Value),*> ArgTuple for ($($t,)*) {
            type Readers = ($(ArgReader<$t>,)*);
            fn tags() -> Vec<TypeTag> {
                vec![$(TypeTag::of::<$t>()),*]
            }
            #[allow(private_interfaces)]
            fn build<A>(
                b: &mut TaskBuilder<'_, A>,
                args: &[ArgSource],
                direct: Option<u64>,
            ) -> Result<Self::Readers, String> {
                if args.len() != $n {
                    return Err(format!("expected {} arguments, the plan has {}", $n, args.len()));
                }
                let _ = (&b, direct);
                Ok(($(b.arg::<$t>(&args[$i], direct)?,)*))
            }
            #[allow(private_interfaces)]
            fn read(readers: &mut Self::Readers) -> Result<Result<Self, Arc<TaskError>>, ChanError> {
                let _ = &readers;
                // Take every argument, even after an error, so every slot stays in step.
                let msgs = ($(readers.$i.get()?,)*);
                let _ = &msgs;
                let mut first_error: Option<Arc<TaskError>> = None;
                let _ = &mut first_error;
                $(let $t = match msgs.$i {
                    Msg::Value(v) => Some(v),
                    Msg::Error(e) => {
                        first_error.get_or_insert(e);
                        None
                    }
                };)*
                if let Some(e) = first_error {
                    return Ok(Err(e));
                }
                Ok(Ok(($($t.expect("checked above"),)*)))
            }
        }
    };
}

#[allow(non_snake_case)]
mod arg_tuples {
    use super::*;
    arg_tuple!(0;);
    arg_tuple!(1; T0 0);
    arg_tuple!(2; T0 0, T1 1);
    arg_tuple!(3; T0 0, T1 1, T2 2);
    arg_tuple!(4; T0 0, T1 1, T2 2, T3 3);
    arg_tuple!(5; T0 0, T1 1, T2 2, T3 3, T4 4);
    arg_tuple!(6; T0 0, T1 1, T2 2, T3 3, T4 4, T5 5);
    arg_tuple!(7; T0 0, T1 1, T2 2, T3 3, T4 4, T5 5, T6 6);
    arg_tuple!(8; T0 0, T1 1, T2 2, T3 3, T4 4, T5 5, T6 6, T7 7);
}

/// A tuple result that a graph may split into one node per element.
pub trait SplitTuple: Value {
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn build_split<A>(
        b: &mut TaskBuilder<'_, A>,
        node: u64,
        source: u64,
        index: usize,
    ) -> Result<Op<A>, String>;
    /// The element types, in order.
    #[doc(hidden)]
    fn tags() -> Vec<TypeTag>;
    /// A driver's reader of element `index` whose type the caller does not know.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn elem_reader(index: usize) -> Option<ErasedReaderFn>;
}

macro_rules! split_tuple {
    ($($t:ident $i:tt),+) => {
        impl<$($t: Value),+> SplitTuple for ($($t,)+) {
            #[allow(private_interfaces)]
            fn build_split<A>(b: &mut TaskBuilder<'_, A>, node: u64, source: u64, index: usize) -> Result<Op<A>, String> {
                match index {
                    $($i => b.split_op::<Self, $t>(node, source, |t: Self| t.$i),)+
                    _ => Err(format!("tuple has no element {index}")),
                }
            }
            fn tags() -> Vec<TypeTag> {
                vec![$(TypeTag::of::<$t>()),+]
            }
            #[allow(private_interfaces)]
            fn elem_reader(index: usize) -> Option<ErasedReaderFn> {
                match index {
                    $($i => Some(erased_reader::<$t> as ErasedReaderFn),)+
                    _ => None,
                }
            }
        }
    };
}
split_tuple!(T0 0, T1 1);
split_tuple!(T0 0, T1 1, T2 2);
split_tuple!(T0 0, T1 1, T2 2, T3 3);
split_tuple!(T0 0, T1 1, T2 2, T3 3, T4 4);
split_tuple!(T0 0, T1 1, T2 2, T3 3, T4 4, T5 5);
split_tuple!(T0 0, T1 1, T2 2, T3 3, T4 4, T5 5, T6 6);
split_tuple!(T0 0, T1 1, T2 2, T3 3, T4 4, T5 5, T6 6, T7 7);

/// Builds the typed operations of one actor's schedule.
pub(crate) struct TaskBuilder<'a, A> {
    pub(crate) plan: &'a GraphPlan,
    pub(crate) me: Loc,
    pub(crate) chans: &'a GraphChannels,
    pub(crate) actor_name: String,
    slots: HashMap<u64, Rc<dyn Any>>,
    pub(crate) reads: HashMap<u64, Op<A>>,
    pub(crate) writes: HashMap<u64, Op<A>>,
    /// Lenders of output channels' memory, by edge (see [`lend`]).
    lenders: HashMap<u64, Lender>,
    /// Communicator edges and collectives of this actor.
    pub(crate) comm: CommCtx<A>,
    /// The small frames this actor's network writers hold back (see [`Holding`]).
    pub(crate) holding: Arc<Holding>,
    /// Where the schedule's loop stands between two executions, for its reads.
    pub(crate) between: Rc<Between>,
    /// The busy time of the methods, shared with the schedule's loop.
    pub(crate) busy: Rc<BusyClock>,
}

impl<'a, A> TaskBuilder<'a, A> {
    pub(crate) fn new(
        plan: &'a GraphPlan,
        me: Loc,
        chans: &'a GraphChannels,
        actor_name: String,
    ) -> Self {
        TaskBuilder {
            plan,
            me,
            chans,
            actor_name,
            slots: HashMap::new(),
            reads: HashMap::new(),
            writes: HashMap::new(),
            lenders: HashMap::new(),
            comm: Default::default(),
            holding: Arc::default(),
            between: Rc::default(),
            busy: Rc::default(),
        }
    }

    /// What lends the memory of `edge`'s output channel to the method computing it
    /// ([`crate::output_buffer`]); `None` when the edge has no channel.
    pub(crate) fn lender(&self, edge: u64) -> Option<Lender> {
        self.lenders.get(&edge).cloned()
    }

    pub(crate) fn slots_insert(&mut self, edge: u64, slot: Rc<dyn Any>) {
        self.slots.insert(edge, slot);
    }

    pub(crate) fn slot<T: Value>(&mut self, edge: u64) -> Result<Option<Rc<LocalSlot<T>>>, String> {
        match self.slots.get(&edge) {
            None => Ok(None),
            Some(s) => s.clone().downcast::<LocalSlot<T>>().map(Some).map_err(|_| {
                format!(
                    "edge {edge} carries another type than {}",
                    std::any::type_name::<T>()
                )
            }),
        }
    }

    fn arg<T: Value>(
        &mut self,
        src: &ArgSource,
        direct: Option<u64>,
    ) -> Result<ArgReader<T>, String> {
        let edge = match src {
            ArgSource::Const(bytes) => {
                return decode::<T>(bytes).map(ArgReader::Const).map_err(|e| {
                    format!(
                        "cannot decode a constant argument of type {}: {e}",
                        std::any::type_name::<T>()
                    )
                });
            }
            ArgSource::Edge(edge) => *edge,
        };
        if direct == Some(edge) {
            return self.edge_read::<T>(edge).map(ArgReader::Channel);
        }
        let slot = self.read_slot::<T>(edge)?;
        slot.add_use();
        Ok(ArgReader::Slot(slot))
    }

    /// The slot holding an upstream edge's value, with the read operation that fills it.
    fn read_slot<T: Value>(&mut self, edge: u64) -> Result<Rc<LocalSlot<T>>, String> {
        if let Some(slot) = self.slot::<T>(edge)? {
            return Ok(slot);
        }
        if comm_ops::is_recv(&self.comm, edge) {
            return comm_ops::recv_slot::<A, T, _>(self, edge);
        }
        let plan = self.plan.edge(edge)?;
        let slot = Rc::new(LocalSlot::<T>::new(plan.label.clone()));
        let mut read = self.edge_read::<T>(edge)?;
        let mut fill = slot.clone();
        self.reads.insert(
            edge,
            Box::new(move |_: &mut A| fill.write(read.next()?, None)),
        );
        self.slots.insert(edge, slot.clone());
        Ok(slot)
    }

    /// The reading end of an upstream edge's channel, read as the schedule reads.
    pub(crate) fn edge_read<T: Value>(&mut self, edge: u64) -> Result<EdgeRead<T>, String> {
        Ok(EdgeRead {
            reader: self.chans.reader::<T>(self.plan, edge, self.me)?,
            holding: self.holding.clone(),
            between: self.between.clone(),
        })
    }

    /// What sends a method's result on `edge`'s channel, with the lender of that channel's
    /// memory registered for the method; `None` when the edge has no channel (its value stays
    /// in the actor) or goes to a communicator.
    pub(crate) fn result_sender<T: Value>(
        &mut self,
        edge: u64,
        method: &'static str,
    ) -> Result<Option<ResultSender<T>>, String> {
        if comm_ops::is_send(&self.comm, edge) {
            return Ok(None);
        }
        let plan = self.plan.edge(edge)?;
        if !plan.has_channel() {
            return Ok(None);
        }
        let label = plan.label.clone();
        // Shared by the sender and the lender of the method's run: they never overlap (the
        // send comes after the method returns, on the same thread).
        let mut writer = self.chans.writer::<T>(self.plan, edge, self.me)?;
        writer.hold_in(&self.holding);
        let writer = Rc::new(RefCell::new(writer));
        let lend_from = writer.clone();
        self.lenders.insert(
            edge,
            Rc::new(move |len| lend_from.borrow_mut().loan(len)) as Lender,
        );
        Ok(Some(ResultSender {
            writer,
            actor: self.actor_name.clone(),
            method,
            label,
        }))
    }

    /// See [`fusable`].
    pub(crate) fn fusable(&self, specs: &[OpSpec], at: usize) -> Option<(u64, u64)> {
        fusable(specs, at, |edge| {
            comm_ops::is_recv(&self.comm, edge) || comm_ops::is_send(&self.comm, edge)
        })
    }

    /// The slot a compute operation writes, with the write operation that sends it on.
    pub(crate) fn output<T: Value>(
        &mut self,
        edge: u64,
        method: &'static str,
    ) -> Result<Rc<LocalSlot<T>>, String> {
        if comm_ops::is_send(&self.comm, edge) {
            return comm_ops::send_slot::<A, T, _>(self, edge);
        }
        let plan = self.plan.edge(edge)?;
        let slot = Rc::new(LocalSlot::<T>::new(plan.label.clone()));
        if let Some(send) = self.result_sender::<T>(edge, method)? {
            slot.add_use();
            let mut take = slot.clone();
            self.writes
                .insert(edge, Box::new(move |_: &mut A| send.send(take.read(None)?)));
        }
        self.slots.insert(edge, slot.clone());
        Ok(slot)
    }

    fn split_op<S: Value, T: Value>(
        &mut self,
        node: u64,
        source: u64,
        pick: fn(S) -> T,
    ) -> Result<Op<A>, String> {
        let input = self
            .slot::<S>(source)?
            .ok_or_else(|| format!("split of edge {source} before its value exists"))?;
        input.add_use();
        let out = self.output::<T>(node, "split")?;
        Ok(Box::new(move |_: &mut A| {
            out.put(match input.take() {
                Msg::Value(v) => Msg::Value(pick(v)),
                Msg::Error(e) => Msg::Error(e),
            });
            Ok(())
        }))
    }
}

impl<A> ScheduleWiring<A> for TaskBuilder<'_, A> {
    fn plan(&self) -> &GraphPlan {
        self.plan
    }
    fn me(&self) -> Loc {
        self.me
    }
    fn chans(&self) -> &GraphChannels {
        self.chans
    }
    fn actor_name(&self) -> &str {
        &self.actor_name
    }
    fn comm(&mut self) -> &mut CommCtx<A> {
        &mut self.comm
    }
    fn slots_insert(&mut self, edge: u64, slot: Rc<dyn Any>) {
        TaskBuilder::slots_insert(self, edge, slot);
    }
    fn tensor_slot(&mut self, edge: u64) -> Result<Option<Rc<LocalSlot<Tensor>>>, String> {
        self.slot::<Tensor>(edge)
    }
    fn tensor_output(
        &mut self,
        edge: u64,
        method: &'static str,
    ) -> Result<Rc<LocalSlot<Tensor>>, String> {
        self.output::<Tensor>(edge, method)
    }
}

/// Whether the operations `specs[at..at + 3]` of an actor's schedule can run as one fused
/// operation: a read of an edge, a method whose only node argument is that edge (the others
/// constants, as every Python method's call), and the write of its result, with neither
/// value used by anything else of the actor (so neither needs a slot) nor carried by a
/// communicator (`by_comm`). Returns the method's node and the edge read.
fn fusable(specs: &[OpSpec], at: usize, by_comm: impl Fn(u64) -> bool) -> Option<(u64, u64)> {
    let [
        OpSpec::Read { edge },
        OpSpec::Compute { node, args, .. },
        OpSpec::Write { edge: written },
    ] = specs.get(at..at + 3)?
    else {
        return None;
    };
    let only_use = |value: u64, user: usize| {
        specs
            .iter()
            .enumerate()
            .all(|(i, op)| i == user || !op.consumes(value))
    };
    let mut edges = args.iter().filter(|a| matches!(a, ArgSource::Edge(_)));
    let one_edge =
        matches!(edges.next(), Some(ArgSource::Edge(arg)) if arg == edge) && edges.next().is_none();
    (one_edge
        && written == node
        && !by_comm(*edge)
        && !by_comm(*node)
        && only_use(*edge, at + 1)
        && only_use(*node, at + 2))
    .then_some((*node, *edge))
}

/// A schedule's read of one upstream edge, straight from its channel.
#[doc(hidden)]
pub struct EdgeRead<T> {
    reader: Reader<T>,
    holding: Arc<Holding>,
    between: Rc<Between>,
}

impl<T> EdgeRead<T> {
    #[inline]
    fn next(&mut self) -> Result<Msg<T>, ChanError> {
        if !self.reader.next_is_here() {
            // This read may wait: nothing stays held while it does.
            self.holding.release()?;
        }
        let msg = super::call::read_between(&self.between, &mut self.reader)?;
        self.holding.note_read(self.reader.next_is_here());
        Ok(msg)
    }
}

/// A method's result on its way into its output channel.
pub(crate) struct ResultSender<T> {
    writer: Rc<RefCell<FanOut<T>>>,
    actor: String,
    method: &'static str,
    label: String,
}

impl<T: Value> ResultSender<T> {
    #[inline]
    fn send(&self, msg: Msg<T>) -> Result<(), ChanError> {
        let mut writer = self.writer.borrow_mut();
        match writer.write(msg, None) {
            // The value cannot travel; its readers get an error instead.
            Err(ChanError::TooLarge { size, limit }) => writer.write(
                self.failure(format!(
                    "the output of {} is {size} bytes, over the ceiling of {limit} bytes; raise CompileOptions::max_message_bytes",
                    self.label
                )),
                None,
            ),
            Err(ChanError::Codec(reason)) => writer.write(
                self.failure(format!("the output of {} cannot be sent: {reason}", self.label)),
                None,
            ),
            other => other,
        }
    }

    fn failure(&self, message: String) -> Msg<T> {
        Msg::Error(Arc::new(TaskError::new(
            self.actor.clone(),
            self.method.to_string(),
            message,
        )))
    }
}

pub(crate) fn find<'m, A>(methods: &'m [MethodEntry<A>], name: &str) -> Option<&'m MethodEntry<A>> {
    methods.iter().find(|m| m.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(edge: u64) -> OpSpec {
        OpSpec::Read { edge }
    }
    fn write(edge: u64) -> OpSpec {
        OpSpec::Write { edge }
    }
    fn compute(node: u64, args: Vec<ArgSource>) -> OpSpec {
        OpSpec::Compute {
            node,
            method: "m".into(),
            args,
            label: None,
        }
    }

    #[test]
    fn a_read_a_one_argument_method_and_its_write_fuse_only_when_nothing_else_uses_them() {
        let none = |_| false;
        let chain = [read(1), compute(2, vec![ArgSource::Edge(1)]), write(2)];
        assert_eq!(fusable(&chain, 0, none), Some((2, 1)));
        // Not at the start of the pattern, or past the end.
        assert_eq!(fusable(&chain, 1, none), None);
        assert_eq!(fusable(&chain, 3, none), None);
        // Constant arguments beside it fuse; a second node argument does not.
        let with_const = [
            read(1),
            compute(2, vec![ArgSource::Const(vec![0]), ArgSource::Edge(1)]),
            write(2),
        ];
        assert_eq!(fusable(&with_const, 0, none), Some((2, 1)));
        let twice = [
            read(1),
            compute(2, vec![ArgSource::Edge(1), ArgSource::Edge(1)]),
            write(2),
        ];
        assert_eq!(fusable(&twice, 0, none), None);
        let two = [
            read(1),
            compute(2, vec![ArgSource::Edge(1), ArgSource::Edge(3)]),
            write(2),
        ];
        assert_eq!(fusable(&two, 0, none), None);
        // The method takes another edge than the one read.
        let other = [read(1), compute(2, vec![ArgSource::Edge(3)]), write(2)];
        assert_eq!(fusable(&other, 0, none), None);
        // The write is of another value.
        let elsewhere = [read(1), compute(2, vec![ArgSource::Edge(1)]), write(4)];
        assert_eq!(fusable(&elsewhere, 0, none), None);
        // The input is used again by a later method of the actor: it needs its slot.
        let mut reused = chain.to_vec();
        reused.push(compute(5, vec![ArgSource::Edge(1)]));
        assert_eq!(fusable(&reused, 0, none), None);
        // So is the result (a later method of the same actor reads it).
        let mut kept = chain.to_vec();
        kept.push(compute(5, vec![ArgSource::Edge(2)]));
        assert_eq!(fusable(&kept, 0, none), None);
        // A value carried by a communicator.
        assert_eq!(fusable(&chain, 0, |e| e == 1), None);
        assert_eq!(fusable(&chain, 0, |e| e == 2), None);
        // Two chains in one schedule fuse each.
        let mut both = chain.to_vec();
        both.extend([read(6), compute(7, vec![ArgSource::Edge(6)]), write(7)]);
        assert_eq!(fusable(&both, 0, none), Some((2, 1)));
        assert_eq!(fusable(&both, 3, none), Some((7, 6)));
    }
}
