//! Refs to the results of executions.
use super::RefOwner;
use crate::channel::Msg;
use crate::error::{Error, Result};
use crate::value::Value;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// One submitted execution, shared by the refs of its outputs.
#[doc(hidden)]
#[derive(Clone)]
pub struct ExecToken {
    owner: Arc<dyn RefOwner>,
    exec: u64,
}

impl ExecToken {
    pub(crate) fn new(owner: Arc<dyn RefOwner>, exec: u64) -> Self {
        ExecToken { owner, exec }
    }
}

struct RefInner {
    owner: Arc<dyn RefOwner>,
    exec: u64,
    output: usize,
    claimed: AtomicBool,
}

impl Drop for RefInner {
    fn drop(&mut self) {
        if !self.claimed.load(Ordering::Acquire) {
            self.owner.release(self.exec, self.output);
        }
    }
}

/// The future result of one output of one execution (Ray's `CompiledDAGRef`).
///
/// `get` consumes the ref; clones share one result, so a second `get` through a clone is
/// [`Error::AlreadyClaimed`]. Dropping every clone unclaimed frees the result's place.
#[must_use = "a ref holds its execution's result until claimed (get, await) or dropped"]
pub struct CompiledRef<T> {
    inner: Arc<RefInner>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for CompiledRef<T> {
    fn clone(&self) -> Self {
        CompiledRef {
            inner: self.inner.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for CompiledRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CompiledRef(execution {}, output {}: {})",
            self.inner.exec,
            self.inner.output,
            self.inner.owner.describe_output(self.inner.output)
        )
    }
}

impl<T: Value> CompiledRef<T> {
    pub(crate) fn new(token: &ExecToken, output: usize) -> Self {
        CompiledRef {
            inner: Arc::new(RefInner {
                owner: token.owner.clone(),
                exec: token.exec,
                output,
                claimed: AtomicBool::new(false),
            }),
            _t: PhantomData,
        }
    }

    /// The execution's index (0 for the first `execute`).
    pub fn execution(&self) -> u64 {
        self.inner.exec
    }

    /// Wait for the result, up to the graph's `get_timeout`.
    pub fn get(self) -> Result<T> {
        self.fetch(None)
    }

    /// Wait for the result up to `timeout`. On a timeout the ref stays valid: call again.
    pub fn get_timeout(&self, timeout: Duration) -> Result<T> {
        self.fetch(Some(timeout))
    }

    fn fetch(&self, timeout: Option<Duration>) -> Result<T> {
        let inner = &self.inner;
        if inner.claimed.swap(true, Ordering::AcqRel) {
            return Err(Error::AlreadyClaimed {
                execution: inner.exec,
                output: inner.output,
            });
        }
        let value = match inner.owner.fetch(inner.exec, inner.output, timeout) {
            Ok(v) => v,
            Err(e) => {
                if matches!(
                    e,
                    Error::Timeout { .. }
                        | Error::CapacityExceeded { .. }
                        | Error::WrongMode { .. }
                ) {
                    inner.claimed.store(false, Ordering::Release);
                }
                return Err(e);
            }
        };
        self.unpack(value)
    }

    fn unpack(&self, value: Box<dyn std::any::Any + Send>) -> Result<T> {
        let inner = &self.inner;
        match value.downcast::<Msg<T>>() {
            Ok(msg) => match *msg {
                Msg::Value(v) => Ok(v),
                Msg::Error(e) => Err(Error::from(&*e)),
            },
            Err(_) => Err(Error::Codec {
                op: "decode",
                ty: std::any::type_name::<T>().into(),
                place: inner.owner.describe_output(inner.output),
                message: "the output carries another type".into(),
            }),
        }
    }
}

/// The future of a ref in a graph compiled with `enable_asyncio` (Ray's `CompiledDAGFuture`).
/// Dropping it before it resolves frees the result's place and loses nothing for the other
/// executions.
pub struct RefFuture<T> {
    r: CompiledRef<T>,
    started: bool,
    finished: bool,
}

impl<T: Value> std::future::Future for RefFuture<T> {
    type Output = Result<T>;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<T>> {
        let this = &mut *self;
        let inner = &this.r.inner;
        if !this.started {
            if inner.claimed.swap(true, Ordering::AcqRel) {
                return std::task::Poll::Ready(Err(Error::AlreadyClaimed {
                    execution: inner.exec,
                    output: inner.output,
                }));
            }
            this.started = true;
        }
        match inner.owner.poll_fetch(inner.exec, inner.output, cx) {
            std::task::Poll::Pending => std::task::Poll::Pending,
            std::task::Poll::Ready(Err(e @ Error::WrongMode { .. })) => {
                // Nothing was claimed: the ref stays usable through get().
                inner.claimed.store(false, Ordering::Release);
                this.started = false;
                std::task::Poll::Ready(Err(e))
            }
            std::task::Poll::Ready(r) => {
                this.finished = true;
                std::task::Poll::Ready(r.and_then(|v| this.r.unpack(v)))
            }
        }
    }
}

impl<T> Drop for RefFuture<T> {
    fn drop(&mut self) {
        // A future dropped before it resolved gives its result up (the claim was taken, so
        // the ref's own drop would not).
        if self.started && !self.finished {
            self.r
                .inner
                .owner
                .release(self.r.inner.exec, self.r.inner.output);
        }
    }
}

impl<T: Value> std::future::IntoFuture for CompiledRef<T> {
    type Output = Result<T>;
    type IntoFuture = RefFuture<T>;
    fn into_future(self) -> RefFuture<T> {
        RefFuture {
            r: self,
            started: false,
            finished: false,
        }
    }
}

/// Getting several refs at once: a `Vec` of refs or a tuple of refs.
pub trait RefSet {
    /// The values.
    type Output;
    /// Wait for all of them, each up to the graph's `get_timeout`.
    fn get(self) -> Result<Self::Output>;
}

impl<T: Value> RefSet for CompiledRef<T> {
    type Output = T;
    fn get(self) -> Result<T> {
        CompiledRef::get(self)
    }
}

impl<R: RefSet> RefSet for Vec<R> {
    type Output = Vec<R::Output>;
    fn get(self) -> Result<Self::Output> {
        self.into_iter().map(RefSet::get).collect()
    }
}

macro_rules! tuple_refs {
    ($($t:ident $i:tt),+) => {
        impl<$($t: RefSet),+> RefSet for ($($t,)+) {
            type Output = ($($t::Output,)+);
            fn get(self) -> Result<Self::Output> {
                Ok(($(self.$i.get()?,)+))
            }
        }
    };
}
tuple_refs!(A 0, B 1);
tuple_refs!(A 0, B 1, C 2);
tuple_refs!(A 0, B 1, C 2, D 3);
tuple_refs!(A 0, B 1, C 2, D 3, E 4);
tuple_refs!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_refs!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_refs!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);

/// Wait for every ref of a list (Ray's `ray.get([refs])`).
pub fn get_all<R: RefSet>(refs: R) -> Result<R::Output> {
    refs.get()
}
