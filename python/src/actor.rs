//! The one Rust actor type behind every Python actor: it builds the user's class from its
//! pickled form in the worker process and calls its methods by name.
//!
//! adag's method tables are static, so `PyActor` exports `call0` .. `call7`: `callN` takes a
//! [`CallSpec`] (a constant argument of the node: the Python method's name and its constant
//! arguments) and `N` node arguments, each a [`PyValue`].
use crate::value::{PyValue, dumps_to, in_argument, loads, loads_to};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// How a Python actor is built in its worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PyInit {
    /// The class, cloudpickled.
    #[serde(with = "serde_bytes")]
    pub class: Vec<u8>,
    /// `(args, kwargs)` of the constructor, pickled.
    pub args: PyValue,
    /// The driver's `sys.path`, so that classes pickled by reference import in the worker.
    pub sys_path: Vec<String>,
}

/// The key of a one-off call (`actor.method.remote(...)`): prepared for that call only, not
/// cached (a long-lived actor serves any number of them).
pub const ONE_OFF: u64 = 0;

/// One bound method call: the constant part of a node. A node's constant arguments are
/// cloned for every call, so the body is shared (one reference count, no copy).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CallSpec {
    /// Unique per bound node: the worker caches the looked-up method and arguments under it
    /// ([`ONE_OFF`] for a one-off call).
    pub key: u64,
    /// The compiled graph the call belongs to (its first key; [`ONE_OFF`] for a one-off
    /// call). A worker keeps what it prepared for the calls of one graph at a time: an actor
    /// serves one graph at a time, so the first call of another graph drops the last one's
    /// (its bound methods and constant arguments), and compiling graph after graph over the
    /// same actors does not grow the worker.
    pub graph: u64,
    /// The method and its arguments.
    pub body: Arc<CallBody>,
}

/// What a [`CallSpec`] calls.
#[derive(Debug, Serialize, Deserialize)]
pub struct CallBody {
    /// The Python method's name.
    pub method: String,
    /// The arguments as a pickled template (see `adag/_dag.py`, `_template`): the constant
    /// arguments, and where each node argument goes.
    #[serde(with = "serde_bytes")]
    pub template: Vec<u8>,
}

impl CallSpec {
    /// A call of `method` with the pickled `template`, under a key of its own, in graph
    /// `graph`.
    pub fn new(key: u64, graph: u64, method: String, template: Vec<u8>) -> CallSpec {
        CallSpec {
            key,
            graph,
            body: Arc::new(CallBody { method, template }),
        }
    }
}

/// A Python exception raised by a method, as it travels to the driver: its text, and (as its
/// `source`, the second element of the error's chain) the hex of a pickle of
/// `(method name, traceback text, the exception or None)`.
#[derive(Debug)]
pub struct PyFailure {
    text: String,
    detail: Detail,
}

/// The hex-encoded pickle of a [`PyFailure`]'s details.
#[derive(Debug)]
pub struct Detail(pub String);

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Detail {}

impl fmt::Display for PyFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::error::Error for PyFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.detail)
    }
}

/// Marks a task error's `error_type` as one of a Python method (see [`PyFailure`]).
pub const FAILURE_TYPE: &str = "PyFailure";

pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

impl PyFailure {
    fn of(py: Python<'_>, err: PyErr, method: &str) -> PyFailure {
        if let Some(tb) = err.traceback(py) {
            let _ = err.value(py).setattr("__traceback__", tb);
        }
        let described = py
            .import("adag._errors")
            .and_then(|m| m.getattr("describe_exception"))
            .and_then(|f| f.call1((err.value(py), method)))
            .and_then(|r| r.extract::<(String, Vec<u8>)>());
        match described {
            Ok((text, detail)) => PyFailure {
                text,
                detail: Detail(hex(&detail)),
            },
            Err(_) => PyFailure {
                text: err.to_string(),
                detail: Detail(String::new()),
            },
        }
    }
}

/// A call template as pickled by `adag/_dag.py`: positional constants, `(position, node
/// argument)` pairs, keyword constants, `(keyword, node argument)` pairs, how many values
/// the method returns (`num_returns`), the device its result's tensors go to (the node's
/// `with_tensor_transport(device=...)`), and per node argument the node it comes from and the
/// device its tensors go to (that node's annotation).
type Template<'py> = (
    Bound<'py, PyList>,
    Vec<(usize, usize)>,
    Option<Bound<'py, PyDict>>,
    Vec<(String, usize)>,
    usize,
    Option<String>,
    Vec<(String, Option<String>)>,
);

/// The worker's view of one bound call, built the first time it runs.
struct Bound_ {
    method: PyObject,
    /// Positional constants, with `None` where a node argument goes.
    args: Vec<PyObject>,
    /// Which positions take which node argument.
    arg_slots: Vec<(usize, usize)>,
    kwargs: Option<Py<PyDict>>,
    kw_slots: Vec<(String, usize)>,
    /// The arguments are exactly the node arguments, in order (`method(a, b)` of nodes `a`,
    /// `b`): the call is made straight from the values.
    plain: bool,
    /// The method returns this many values (Ray's `num_returns`): checked on every call when
    /// more than one.
    num_returns: usize,
    /// Where the readers place the tensors of the result (`None`: each tensor's own device).
    out_device: Option<String>,
    /// Per node argument: the node it is the value of (for errors), and where its tensors
    /// are placed (`None`: where the value says).
    edges: Vec<(String, Option<String>)>,
}

impl Bound_ {
    /// Node argument `i`, its tensors placed as its edge says.
    fn decode(&self, py: Python<'_>, method: &str, i: usize, v: &PyValue) -> PyResult<PyObject> {
        let (source, device) = match self.edges.get(i) {
            Some((s, d)) => (s.as_str(), d.as_deref()),
            None => ("", None),
        };
        let decoded = match device {
            None => loads(py, v),
            Some(_) => loads_to(py, v, device),
        };
        decoded.map_err(|e| in_argument(py, e, method, i, source))
    }
}

/// A Python actor: an instance of the user's class in this worker process.
pub struct PyActor {
    instance: PyObject,
    /// The prepared calls of the graph `calls_graph`, by key (see [`CallSpec::graph`]).
    calls: HashMap<u64, Bound_>,
    calls_graph: u64,
}

fn spawn_error(py: Python<'_>, e: PyErr) -> String {
    // The traceback lives on the error, not yet on its value: format_exception reads it there.
    if let Some(tb) = e.traceback(py) {
        let _ = e.value(py).setattr("__traceback__", tb);
    }
    let tb = py
        .import("adag._errors")
        .and_then(|m| m.getattr("format_exception"))
        .and_then(|f| f.call1((e.value(py),)))
        .and_then(|s| s.extract::<String>());
    tb.unwrap_or_else(|_| e.to_string())
}

impl PyActor {
    fn call(&mut self, spec: CallSpec, values: &[PyValue]) -> Result<PyValue, PyFailure> {
        Python::with_gil(|py| {
            self.call_in(py, &spec, values)
                .map_err(|e| PyFailure::of(py, e, &spec.body.method))
        })
    }

    fn call_in(
        &mut self,
        py: Python<'_>,
        spec: &CallSpec,
        values: &[PyValue],
    ) -> PyResult<PyValue> {
        let once;
        let b = if spec.key == ONE_OFF {
            once = prepare(&self.instance, py, spec)?;
            &once
        } else {
            if spec.graph != self.calls_graph {
                // The last graph is over (one at a time): its calls go, with the GIL held.
                self.calls.clear();
                self.calls_graph = spec.graph;
            }
            match self.calls.entry(spec.key) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(prepare(&self.instance, py, spec)?)
                }
            }
        };
        let method = b.method.bind(py);
        let name = spec.body.method.as_str();
        if b.plain {
            let out = match values {
                [] => method.call0()?,
                [a] => method.call1((b.decode(py, name, 0, a)?,))?,
                _ => {
                    let args = values
                        .iter()
                        .enumerate()
                        .map(|(i, v)| b.decode(py, name, i, v))
                        .collect::<PyResult<Vec<_>>>()?;
                    method.call1(PyTuple::new(py, args)?)?
                }
            };
            let out = awaited(py, out)?;
            check_returns(&out, b.num_returns)?;
            return dumps_to(py, &out, b.out_device.as_deref());
        }
        let mut args: Vec<PyObject> = b.args.iter().map(|a| a.clone_ref(py)).collect();
        let mut values: Vec<Option<PyObject>> = values
            .iter()
            .enumerate()
            .map(|(i, v)| b.decode(py, name, i, v).map(Some))
            .collect::<PyResult<_>>()?;
        for &(pos, i) in &b.arg_slots {
            args[pos] = take(py, &mut values, i);
        }
        let args = PyTuple::new(py, args)?;
        let kwargs = match &b.kwargs {
            None => None,
            Some(k) => {
                let k = k.bind(py).copy()?;
                for (name, i) in &b.kw_slots {
                    k.set_item(name, take(py, &mut values, *i))?;
                }
                Some(k)
            }
        };
        let out = awaited(py, method.call(args, kwargs.as_ref())?)?;
        check_returns(&out, b.num_returns)?;
        dumps_to(py, &out, b.out_device.as_deref())
    }
}

/// The result of an `async def` method (a coroutine) run on the actor's event loop, the
/// task waiting for it (`adag/_async_actor.py`); any other result as it is.
fn awaited<'py>(py: Python<'py>, out: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    static ASYNC: pyo3::sync::GILOnceCell<(PyObject, PyObject)> = pyo3::sync::GILOnceCell::new();
    let (coroutine, run) = ASYNC.get_or_try_init(py, || {
        Ok::<_, PyErr>((
            py.import("types")?.getattr("CoroutineType")?.unbind(),
            py.import("adag._async_actor")?.getattr("run")?.unbind(),
        ))
    })?;
    if !out.get_type().is(coroutine.bind(py)) {
        return Ok(out);
    }
    // The loop runs on its own thread; waiting for its result releases the GIL.
    run.bind(py).call1((out,))
}

/// A method with `num_returns` of `n` > 1 must return `n` values (Ray's check, with Ray's
/// first words).
fn check_returns(out: &Bound<'_, PyAny>, n: usize) -> PyResult<()> {
    if n <= 1 {
        return Ok(());
    }
    match out.len() {
        Ok(got) if got == n => Ok(()),
        Ok(got) => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "Expected {n} outputs, but got {got} outputs: the method has num_returns={n}, so it \
             returns a tuple or list of {n} values (or change num_returns)"
        ))),
        Err(_) => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "Expected {n} outputs, but got one {}: the method has num_returns={n}, so it returns \
             a tuple or list of {n} values (or change num_returns)",
            out.get_type()
                .name()
                .map_or_else(|_| "value".into(), |t| t.to_string())
        ))),
    }
}

fn prepare(instance: &PyObject, py: Python<'_>, spec: &CallSpec) -> PyResult<Bound_> {
    // adag's own steps (the values of a `num_returns` method, collectives) are functions of
    // `adag._steps` (see that module).
    let name = spec.body.method.as_str();
    let method = match name.strip_prefix(STEP_PREFIX) {
        Some(f) => py.import("adag._steps")?.getattr(f)?,
        None => instance.bind(py).getattr(name)?,
    };
    let t = py
        .import("pickle")?
        .getattr("loads")?
        .call1((pyo3::types::PyBytes::new(py, &spec.body.template),))?;
    // (args, arg_slots, kwargs or None, kw_slots, num_returns, out_device, edges): see
    // adag/_dag.py.
    let (args, arg_slots, kwargs, kw_slots, num_returns, out_device, edges): Template<'_> =
        t.extract()?;
    let args: Vec<PyObject> = args.iter().map(Bound::unbind).collect();
    let plain = kwargs.is_none()
        && kw_slots.is_empty()
        && arg_slots.len() == args.len()
        && arg_slots
            .iter()
            .enumerate()
            .all(|(i, &(pos, n))| pos == i && n == i);
    Ok(Bound_ {
        method: method.unbind(),
        args,
        arg_slots,
        kwargs: kwargs.map(Bound::unbind),
        kw_slots,
        plain,
        num_returns,
        out_device,
        edges,
    })
}

/// Give the actor's thread a Python thread state for good, so that each call's
/// `Python::with_gil` finds it: otherwise every call creates and destroys one (with its frame
/// stack, mapped and unmapped each time), which costs more than the call itself.
fn keep_thread_state() {
    // SAFETY: the interpreter is initialized (this is a worker started by `python`), and this
    // thread holds no GIL yet: PyGILState_Ensure creates its thread state and takes the GIL,
    // PyEval_SaveThread releases the GIL and keeps the state. The state is never released, so
    // the Ensure is never unmatched by a release that would destroy it under a later caller.
    unsafe {
        let _ = pyo3::ffi::PyGILState_Ensure();
        let _ = pyo3::ffi::PyEval_SaveThread();
    }
}

/// Node argument `i` (a new reference: one node may fill several places).
fn take(py: Python<'_>, values: &mut [Option<PyObject>], i: usize) -> PyObject {
    match values.get_mut(i) {
        Some(v) => v.as_ref().map_or_else(|| py.None(), |o| o.clone_ref(py)),
        None => py.None(),
    }
}

#[adag::actor]
impl PyActor {
    /// Build the user's class in this worker.
    pub fn new(init: PyInit) -> Result<Self, String> {
        keep_thread_state();
        Python::with_gil(|py| {
            let built = (|| -> PyResult<PyObject> {
                let sys_path = py.import("sys")?.getattr("path")?;
                for p in init.sys_path.iter().rev() {
                    if !sys_path.contains(p)? {
                        sys_path.call_method1("insert", (0, p))?;
                    }
                }
                // The class, with the source of code pickled by value registered for
                // tracebacks (`adag._actor._load_class`).
                let class = py
                    .import("adag._actor")?
                    .getattr("_load_class")?
                    .call1((pyo3::types::PyBytes::new(py, &init.class),))?;
                let (args, kwargs): (Bound<'_, PyTuple>, Bound<'_, PyDict>) =
                    loads(py, &init.args)?.bind(py).extract()?;
                Ok(class.call(args, Some(&kwargs))?.unbind())
            })();
            match built {
                Ok(instance) => Ok(PyActor {
                    instance,
                    calls: HashMap::new(),
                    calls_graph: ONE_OFF,
                }),
                Err(e) => Err(spawn_error(py, e)),
            }
        })
    }

    /// A method with no node argument.
    pub fn call0(&mut self, spec: CallSpec) -> Result<PyValue, PyFailure> {
        self.call(spec, &[])
    }

    /// A method with one node argument.
    pub fn call1(&mut self, spec: CallSpec, a: PyValue) -> Result<PyValue, PyFailure> {
        self.call(spec, &[a])
    }

    /// A method with two node arguments.
    pub fn call2(&mut self, spec: CallSpec, a: PyValue, b: PyValue) -> Result<PyValue, PyFailure> {
        self.call(spec, &[a, b])
    }

    /// A method with three node arguments.
    pub fn call3(
        &mut self,
        spec: CallSpec,
        a: PyValue,
        b: PyValue,
        c: PyValue,
    ) -> Result<PyValue, PyFailure> {
        self.call(spec, &[a, b, c])
    }

    /// A method with four node arguments.
    pub fn call4(
        &mut self,
        spec: CallSpec,
        a: PyValue,
        b: PyValue,
        c: PyValue,
        d: PyValue,
    ) -> Result<PyValue, PyFailure> {
        self.call(spec, &[a, b, c, d])
    }

    /// A method with five node arguments.
    pub fn call5(
        &mut self,
        spec: CallSpec,
        a: PyValue,
        b: PyValue,
        c: PyValue,
        d: PyValue,
        e: PyValue,
    ) -> Result<PyValue, PyFailure> {
        self.call(spec, &[a, b, c, d, e])
    }

    /// A method with six node arguments.
    #[allow(clippy::too_many_arguments)]
    pub fn call6(
        &mut self,
        spec: CallSpec,
        a: PyValue,
        b: PyValue,
        c: PyValue,
        d: PyValue,
        e: PyValue,
        f: PyValue,
    ) -> Result<PyValue, PyFailure> {
        self.call(spec, &[a, b, c, d, e, f])
    }

    /// A method with seven node arguments.
    #[allow(clippy::too_many_arguments)]
    pub fn call7(
        &mut self,
        spec: CallSpec,
        a: PyValue,
        b: PyValue,
        c: PyValue,
        d: PyValue,
        e: PyValue,
        f: PyValue,
        g: PyValue,
    ) -> Result<PyValue, PyFailure> {
        self.call(spec, &[a, b, c, d, e, f, g])
    }
}

/// The method name prefix of adag's own steps, functions of `adag._steps` (`adag/_dag.py`).
pub const STEP_PREFIX: &str = "__adag_step__.";

/// The most node arguments one bound call may take.
pub const MAX_NODE_ARGS: usize = 7;
