//! The in-actor kind: a value that its own actor reads again stays in a slot of the actor,
//! with no copy and no synchronisation (the actor's loop runs its operations one at a time).
//! Its readers take it in turn: all but the last get a clone, the last gets the value itself.
use super::{ChanError, ChannelReader, ChannelWriter, Msg};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Instant;

/// A value held by an actor between the operations of one execution.
#[doc(hidden)]
pub struct LocalSlot<T> {
    value: RefCell<Option<Msg<T>>>,
    uses: Cell<usize>,
    left: Cell<usize>,
    label: String,
}

impl<T: Clone> LocalSlot<T> {
    pub(crate) fn new(label: String) -> Self {
        LocalSlot {
            value: RefCell::new(None),
            uses: Cell::new(0),
            left: Cell::new(0),
            label,
        }
    }

    /// One more reader will take each value.
    pub(crate) fn add_use(&self) {
        self.uses.set(self.uses.get() + 1);
    }

    pub(crate) fn put(&self, msg: Msg<T>) {
        self.left.set(self.uses.get());
        if self.uses.get() > 0 {
            *self.value.borrow_mut() = Some(msg);
        }
    }

    pub(crate) fn take(&self) -> Msg<T> {
        let left = self.left.get();
        assert!(
            left > 0,
            "schedule bug: slot {} read more often than planned",
            self.label
        );
        self.left.set(left - 1);
        let mut value = self.value.borrow_mut();
        if left == 1 {
            value.take()
        } else {
            value.clone()
        }
        .unwrap_or_else(|| {
            panic!(
                "schedule bug: slot {} read before it was written",
                self.label
            )
        })
    }
}

impl<T: Clone> ChannelWriter<T> for Rc<LocalSlot<T>> {
    fn write(&mut self, msg: Msg<T>, _deadline: Option<Instant>) -> Result<(), ChanError> {
        self.put(msg);
        Ok(())
    }

    fn moves_values(&self) -> bool {
        true
    }
}

impl<T: Clone> ChannelReader<T> for Rc<LocalSlot<T>> {
    fn read(&mut self, _deadline: Option<Instant>) -> Result<Msg<T>, ChanError> {
        Ok(self.take())
    }
}
