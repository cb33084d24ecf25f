//! [`AnyValue`]: a value whose type is known only at run time (the results of by-name
//! outputs, for tools and other languages).
use std::any::Any;
use std::fmt;

/// A value whose Rust type is known only at run time: what the ref of a by-name output
/// ([`AnyNode`](crate::AnyNode) as an output) yields. Recover the value with
/// [`downcast`](AnyValue::downcast) or look at it with [`downcast_ref`](AnyValue::downcast_ref);
/// [`type_name`](AnyValue::type_name) says what it holds.
///
/// ```
/// use adag::AnyValue;
/// let v = AnyValue::new(42u64);
/// assert_eq!(v.type_name(), "u64");
/// assert!(v.is::<u64>());
/// assert_eq!(v.downcast_ref::<u64>(), Some(&42));
/// let v = v.downcast::<String>().unwrap_err();   // not a String: the value comes back
/// assert_eq!(v.downcast::<u64>().unwrap(), 42);
/// ```
///
/// `AnyValue` lives on the driver: it implements serde only so that refs and pipelines
/// treat it like any other result, and encoding or decoding one is an error (it cannot cross
/// a process).
pub struct AnyValue {
    value: Box<dyn Any + Send>,
    type_name: &'static str,
    clone: fn(&(dyn Any + Send)) -> Box<dyn Any + Send>,
}

fn clone_as<T: Clone + Send + 'static>(v: &(dyn Any + Send)) -> Box<dyn Any + Send> {
    // Only ever called on the value `AnyValue::new::<T>` stored.
    Box::new(
        v.downcast_ref::<T>()
            .expect("AnyValue holds the type it was made with")
            .clone(),
    )
}

impl AnyValue {
    /// Wrap a value.
    pub fn new<T: Clone + Send + 'static>(value: T) -> Self {
        AnyValue {
            value: Box::new(value),
            type_name: std::any::type_name::<T>(),
            clone: clone_as::<T>,
        }
    }

    /// The held value's type as `std::any::type_name` spells it.
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }

    /// Whether the value is a `T`.
    pub fn is<T: 'static>(&self) -> bool {
        self.value.is::<T>()
    }

    /// The value as a `T`, or `None` when it holds another type.
    pub fn downcast_ref<T: 'static>(&self) -> Option<&T> {
        self.value.downcast_ref::<T>()
    }

    /// Take the value out as a `T`; when it holds another type, the `AnyValue` comes back
    /// unchanged (its [`type_name`](AnyValue::type_name) says which).
    pub fn downcast<T: 'static>(self) -> Result<T, AnyValue> {
        if !self.value.is::<T>() {
            return Err(self);
        }
        match self.value.downcast::<T>() {
            Ok(v) => Ok(*v),
            Err(_) => unreachable!("checked with is::<T>() above"),
        }
    }
}

impl Clone for AnyValue {
    fn clone(&self) -> Self {
        AnyValue {
            value: (self.clone)(&*self.value),
            type_name: self.type_name,
            clone: self.clone,
        }
    }
}

impl fmt::Debug for AnyValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AnyValue({})", self.type_name)
    }
}

impl serde::Serialize for AnyValue {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(format!(
            "an AnyValue (holding {}) cannot be encoded: it is the driver's view of a by-name result; downcast it first",
            self.type_name
        )))
    }
}

impl<'de> serde::Deserialize<'de> for AnyValue {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Err(serde::de::Error::custom(
            "an AnyValue cannot be decoded: its type is not known to the reader",
        ))
    }
}
