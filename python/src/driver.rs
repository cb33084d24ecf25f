//! The driver's side: spawning Python actors, compiling a graph described by `adag/_dag.py`,
//! executing it and claiming its refs. Every call that may wait releases the GIL.
use crate::actor::{CallSpec, MAX_NODE_ARGS, PyActor, PyInit};
use crate::value::{PyValue, dumps, loads};
use adag::{
    ActorHandle, CompileOptions, CompiledGraph, CompiledRef, Dag, ErasedArg, Error, Node,
    Placement, Runtime, SpawnOptions,
};
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The driver's input of one execution: one pickled value per input part the graph reads.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PyInput {
    parts: Vec<PyValue>,
}

fn runtime() -> PyResult<&'static Runtime> {
    static RT: OnceLock<Runtime> = OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = Runtime::without_env();
    Ok(RT.get_or_init(|| rt))
}

/// An `adag::Error` as the Python exception `adag/_errors.py` makes of it.
pub fn to_py_err(py: Python<'_>, e: Error) -> PyErr {
    let (kind, fields): (&str, Vec<PyObject>) = match &e {
        Error::Task {
            actor,
            method,
            message,
            chain,
            error_type,
            ..
        } => {
            let detail = match error_type.as_deref() {
                Some(t) if t.ends_with(crate::actor::FAILURE_TYPE) && chain.len() > 1 => {
                    Some(chain[chain.len() - 1].clone())
                }
                _ => None,
            };
            let text = match error_type.as_deref() {
                Some(t) if t.ends_with(crate::actor::FAILURE_TYPE) => {
                    chain.first().cloned().unwrap_or_default()
                }
                _ => message.clone(),
            };
            (
                "task",
                vec![
                    actor.into_pyobject(py).unwrap().into_any().unbind(),
                    method.into_pyobject(py).unwrap().into_any().unbind(),
                    text.into_pyobject(py).unwrap().into_any().unbind(),
                    detail.into_pyobject(py).unwrap().into_any().unbind(),
                ],
            )
        }
        Error::ActorDied { .. } | Error::Spawn { .. } => ("actor_died", vec![]),
        Error::Timeout { .. } => ("timeout", vec![]),
        Error::CapacityExceeded { capacity, limit } => (
            "capacity",
            vec![
                matches!(capacity, adag::Capacity::InflightExecutions)
                    .into_pyobject(py)
                    .unwrap()
                    .to_owned()
                    .into_any()
                    .unbind(),
                limit.into_pyobject(py).unwrap().into_any().unbind(),
            ],
        ),
        Error::TornDown { .. } => ("closed", vec![]),
        Error::WrongMode { .. } => ("wrong_mode", vec![]),
        Error::Compile { .. }
        | Error::Config { .. }
        | Error::Input { .. }
        | Error::InvalidArgument { .. } => ("value", vec![]),
        Error::AlreadyClaimed { .. } => ("claimed", vec![]),
        Error::ActorBusy { .. } => ("busy", vec![]),
        _ => ("other", vec![]),
    };
    let made = py
        .import("adag._errors")
        .and_then(|m| m.getattr("from_native"))
        .and_then(|f| f.call1((kind, e.to_string(), PyTuple::new(py, fields)?)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}

fn secs(name: &str, v: Option<f64>) -> PyResult<Option<Duration>> {
    match v {
        None => Ok(None),
        Some(s) if s < 0.0 => Ok(Some(Duration::MAX)),
        Some(s) if s.is_finite() => Ok(Some(Duration::from_secs_f64(s))),
        Some(_) => Err(PyValueError::new_err(format!(
            "{name} must be a number of seconds"
        ))),
    }
}

/// A Python actor: its worker process and the handle that binds and calls its methods.
#[pyclass(module = "adag._native", frozen)]
pub struct NativeActor {
    handle: ActorHandle<PyActor>,
    /// The host it runs on (0: the driver's).
    host: u64,
}

#[pymethods]
impl NativeActor {
    /// The actor's name.
    #[getter]
    fn name(&self) -> String {
        self.handle.name().to_string()
    }

    /// The worker's process id (on its host).
    #[getter]
    fn pid(&self) -> Option<u32> {
        self.handle.pid()
    }

    /// The id of the host the worker runs on (0: the driver's).
    #[getter]
    fn host(&self) -> u64 {
        self.host
    }

    /// Kill the worker process (SIGKILL); its graph, if any, is torn down.
    fn kill(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.handle.kill())
            .map_err(|e| to_py_err(py, e))
    }

    /// A one-off call: `method(*args, **kwargs)` in the worker, all arguments constants
    /// (a pickled template with no node argument).
    fn call(&self, py: Python<'_>, method: String, template: Vec<u8>) -> PyResult<PyObject> {
        let spec = CallSpec::new(
            crate::actor::ONE_OFF,
            crate::actor::ONE_OFF,
            method,
            template,
        );
        let r = py.allow_threads(|| self.handle.call().call0(spec));
        let v = r.map_err(|e| to_py_err(py, e))?;
        loads(py, &v)
    }
}

fn fresh_key() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    // From 1: 0 is `ONE_OFF`.
    static NEXT: AtomicU64 = AtomicU64::new(1);
    // Keys of one driver; a worker serves one driver.
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Spawn a Python actor in a worker process of its own, on host `host` (0 or `None`: the
/// driver's).
#[pyfunction]
#[pyo3(signature = (class_bytes, args, kwargs, sys_path, name=None, host=None))]
pub fn spawn(
    py: Python<'_>,
    class_bytes: Vec<u8>,
    args: Bound<'_, PyTuple>,
    kwargs: Bound<'_, PyDict>,
    sys_path: Vec<String>,
    name: Option<String>,
    host: Option<u64>,
) -> PyResult<NativeActor> {
    let init = PyInit {
        class: class_bytes,
        args: dumps(
            py,
            PyTuple::new(py, [args.into_any(), kwargs.into_any()])?.as_any(),
        )?,
        sys_path,
    };
    let rt = runtime()?;
    let mut options = SpawnOptions::default();
    if let Some(n) = name {
        options = options.name(n);
    }
    let host = host.unwrap_or(0);
    let placement = if host == 0 {
        Placement::Process
    } else {
        Placement::Host(host)
    };
    let handle = py
        .allow_threads(|| rt.spawn_with::<PyActor>(placement, options, init))
        .map_err(|e| to_py_err(py, e))?;
    Ok(NativeActor { handle, host })
}

/// A joined host as Python sees it: `(id, name, address, cores, agent pid)`.
type HostTuple = (u64, String, String, usize, u32);

fn host_tuple(h: &adag::cluster::HostInfo) -> HostTuple {
    (h.id, h.name.clone(), h.address.to_string(), h.cores, h.pid)
}

/// Listen for hosts joining this driver on `addr` (`ip:port`; port 0: any free one) with
/// the shared secret `token`; returns the address they join (`ADAG_JOIN`).
#[pyfunction]
#[pyo3(signature = (addr, token, heartbeat_timeout=None))]
pub fn listen(
    py: Python<'_>,
    addr: &str,
    token: String,
    heartbeat_timeout: Option<f64>,
) -> PyResult<String> {
    let addr: std::net::SocketAddr = addr.parse().map_err(|e| {
        PyValueError::new_err(format!(
            "listen={addr:?} is not an ip:port address ({e}); e.g. \"127.0.0.1:0\" or \"0.0.0.0:7070\""
        ))
    })?;
    if token.is_empty() {
        return Err(PyValueError::new_err(
            "the shared secret (token=, or ADAG_TOKEN) must not be empty",
        ));
    }
    let mut options = adag::cluster::ClusterOptions::new(token).addr(addr);
    if let Some(t) = secs("heartbeat_timeout", heartbeat_timeout)? {
        if t == Duration::MAX {
            return Err(PyValueError::new_err(
                "heartbeat_timeout must be a positive number of seconds",
            ));
        }
        options = options.heartbeat_timeout(t);
    }
    let rt = runtime()?;
    let bound = py
        .allow_threads(|| rt.listen(options))
        .map_err(|e| to_py_err(py, e))?;
    Ok(bound.to_string())
}

/// The hosts that joined and are alive, in joining order.
#[pyfunction]
pub fn hosts() -> PyResult<Vec<HostTuple>> {
    Ok(runtime()?
        .hosts()
        .iter()
        .filter(|h| h.is_alive())
        .map(host_tuple)
        .collect())
}

/// A host as `all_hosts` lists it: [`HostTuple`], then when it was lost (seconds since the
/// epoch) and why, both `None` while it is alive.
type ListedHost = (u64, String, String, usize, u32, Option<f64>, Option<String>);

/// Every host that joined, lost ones too.
#[pyfunction]
pub fn all_hosts() -> PyResult<Vec<ListedHost>> {
    Ok(runtime()?
        .hosts()
        .iter()
        .map(|h| {
            let (id, name, addr, cores, pid) = host_tuple(h);
            let at = h.lost.as_ref().map(|l| {
                l.at.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64())
            });
            let why = h.lost.as_ref().map(|l| l.reason.clone());
            (id, name, addr, cores, pid, at, why)
        })
        .collect())
}

/// Wait until `n` hosts have joined, up to `timeout` seconds; the hosts.
#[pyfunction]
pub fn wait_for_hosts(py: Python<'_>, n: usize, timeout: f64) -> PyResult<Vec<HostTuple>> {
    // For ever is a long time (an `Instant` cannot be `Duration::MAX` away).
    let t = secs("timeout", Some(timeout))?
        .unwrap_or(Duration::MAX)
        .min(Duration::from_secs(100 * 365 * 86_400));
    let rt = runtime()?;
    let got = py
        .allow_threads(|| rt.wait_for_hosts(n, t))
        .map_err(|e| to_py_err(py, e))?;
    Ok(got.iter().map(host_tuple).collect())
}

/// Which part of `execute(*args, **kwargs)` an input part is.
enum Selector {
    Whole,
    Index(usize),
    Key(String),
}

/// One method node as `adag/_dag.py` describes it: the actor, the Python method, the pickled
/// call template, the node arguments (`a >= 0`: node `a`; `a < 0`: input part `-a - 1`), and
/// what people see it called (the Python method's name).
type NodeSpec = (Py<NativeActor>, String, Vec<u8>, Vec<i64>, String);

type Graph = CompiledGraph<PyInput, Vec<Node<PyValue>>>;

/// A compiled graph of Python actors.
#[pyclass(module = "adag._native", frozen)]
pub struct NativeGraph {
    graph: Mutex<Option<Arc<Graph>>>,
    /// The graph after teardown, for its final statistics and timeline.
    last: Mutex<Option<Arc<Graph>>>,
    parts: Vec<Selector>,
    asyncio: bool,
    /// `execute` returns a list (a `MultiOutputNode`), not one ref.
    multi: bool,
    /// How many positional arguments `execute` takes, and which keywords it needs (Ray's
    /// checks).
    positional: usize,
    keywords: Vec<String>,
    /// How many outputs the graph has.
    outputs: usize,
    /// How long a ref's `get()` waits by default.
    get_timeout: Duration,
    /// The graph's id as `str(ref)` shows it (`CompiledDAG.get_id()`).
    id: Arc<str>,
    /// How `visualize()` names each node given to `new`, in that order (`Node::describe`),
    /// so that `adag/_dag.py` can name them by their Python methods and types.
    node_names: Vec<String>,
}

fn options_from(opts: &Bound<'_, PyDict>) -> PyResult<CompileOptions> {
    let mut o = CompileOptions::default();
    for (k, v) in opts.iter() {
        if v.is_none() {
            continue;
        }
        let key: String = k.extract()?;
        o = match key.as_str() {
            "submit_timeout" => o.submit_timeout(secs(&key, Some(v.extract()?))?.unwrap()),
            "get_timeout" => o.get_timeout(secs(&key, Some(v.extract()?))?.unwrap()),
            "buffer_size_bytes" => o.buffer_size_bytes(v.extract()?),
            "max_message_bytes" => o.max_message_bytes(v.extract()?),
            "enable_asyncio" => o.enable_asyncio(v.extract()?),
            "max_inflight_executions" => o.max_inflight_executions(v.extract()?),
            "max_buffered_results" => o.max_buffered_results(v.extract()?),
            "overlap_gpu_communication" => o.overlap_gpu_communication(v.extract()?),
            other => {
                return Err(PyTypeError::new_err(format!(
                    "unknown compile option {other}"
                )));
            }
        };
    }
    Ok(o)
}

#[pymethods]
impl NativeGraph {
    /// Compile a graph. `parts`: the input parts, each `("whole",)`, `("index", i)` or
    /// `("key", k)`; `nodes`: in an order where arguments come first, each
    /// `(actor, method, template, args)` where an argument `a >= 0` is node `a` and `a < 0`
    /// input part `-a - 1`; `outputs`: node indices.
    #[new]
    // The constructor's arguments are those `adag/_dag.py` passes, one for each part of the
    // described graph.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        parts: Vec<Bound<'_, PyTuple>>,
        nodes: Vec<NodeSpec>,
        outputs: Vec<usize>,
        multi: bool,
        options: Bound<'_, PyDict>,
        positional: usize,
        keywords: Vec<String>,
        id: String,
    ) -> PyResult<Self> {
        let opts = options_from(&options)?;
        let asyncio = opts.enable_asyncio;
        let get_timeout = opts.get_timeout;
        let mut selectors = Vec::with_capacity(parts.len());
        for p in &parts {
            let kind: String = p.get_item(0)?.extract()?;
            selectors.push(match kind.as_str() {
                "whole" => Selector::Whole,
                "index" => Selector::Index(p.get_item(1)?.extract()?),
                "key" => Selector::Key(p.get_item(1)?.extract()?),
                _ => return Err(PyValueError::new_err(format!("bad input part {kind}"))),
            });
        }
        let dag = Dag::<PyInput>::new();
        let input = dag.input();
        let part_nodes: Vec<Node<PyValue>> = (0..selectors.len())
            .map(|j| input.field(&format!("part{j}"), move |i: &PyInput| i.parts[j].clone()))
            .collect();
        let mut built: Vec<Node<PyValue>> = Vec::with_capacity(nodes.len());
        // Names the graph in its calls (see `CallSpec::graph`).
        let graph_key = fresh_key();
        for (actor, method, template, args, label) in nodes {
            if args.len() > MAX_NODE_ARGS {
                return Err(PyValueError::new_err(format!(
                    "{method}.bind(...) takes {} arguments that are nodes; at most {MAX_NODE_ARGS} are supported",
                    args.len()
                )));
            }
            let mut erased = vec![ErasedArg::constant(CallSpec::new(
                fresh_key(),
                graph_key,
                method.clone(),
                template,
            ))];
            for a in args {
                let n = if a >= 0 {
                    built.get(a as usize)
                } else {
                    part_nodes.get((-a - 1) as usize)
                }
                .ok_or_else(|| PyValueError::new_err("bad node argument"))?;
                erased.push(adag::Arg::from(n).erase());
            }
            let callee = format!("call{}", erased.len() - 1);
            let actor = actor.get();
            built.push(
                actor
                    .handle
                    .core()
                    .bind::<PyValue>(&callee, erased)
                    .label(label),
            );
        }
        let outs = outputs
            .iter()
            .map(|&i| {
                built
                    .get(i)
                    .cloned()
                    .ok_or_else(|| PyValueError::new_err("bad output"))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let node_names = built.iter().map(|n| n.describe()).collect();
        let graph = py
            .allow_threads(|| dag.compile(outs, opts))
            .map_err(|e| to_py_err(py, e))?;
        Ok(NativeGraph {
            graph: Mutex::new(Some(Arc::new(graph))),
            last: Mutex::new(None),
            parts: selectors,
            asyncio,
            multi,
            positional,
            keywords,
            outputs: outputs.len(),
            get_timeout,
            id: id.into(),
            node_names,
        })
    }

    /// Submit one execution (a graph compiled without `enable_asyncio`): one ref, or a list
    /// of refs for a graph of several outputs.
    #[pyo3(signature = (*args, **kwargs))]
    fn execute(
        &self,
        py: Python<'_>,
        args: Bound<'_, PyTuple>,
        kwargs: Option<Bound<'_, PyDict>>,
    ) -> PyResult<PyObject> {
        if self.asyncio {
            return Err(to_py_err(
                py,
                Error::WrongMode {
                    message: "this graph was compiled with enable_asyncio=True; use await execute_async(...)".into(),
                },
            ));
        }
        let input = self.input(py, &args, kwargs.as_ref())?;
        let g = self.live(py)?;
        match py.allow_threads(|| g.execute(input)) {
            Ok(refs) => self.wrap(py, refs),
            // An actor died before this execution could run: as in Ray, the execution's refs
            // raise the death when read (the graph is already torn down).
            Err(e @ Error::ActorDied { .. }) => self.failed(py, to_py_err(py, e)),
            Err(e) => Err(to_py_err(py, submit_error(e))),
        }
    }

    /// Submit one execution of an `enable_asyncio` graph if there is room now, without
    /// waiting (from the event loop's thread): one ref, a list of refs, or `None` when the
    /// graph is full (nothing was submitted: call `submit_async` from an executor).
    #[pyo3(signature = (*args, **kwargs))]
    fn try_submit_async(
        &self,
        py: Python<'_>,
        args: Bound<'_, PyTuple>,
        kwargs: Option<Bound<'_, PyDict>>,
    ) -> PyResult<Option<PyObject>> {
        let g = self.live(py)?;
        let input = self.input(py, &args, kwargs.as_ref())?;
        // Polled once: `execute_async` is ready at once when there is room (or no room will
        // come without a result being claimed), and dropping it pending submits nothing (it
        // is cancel-safe).
        match py.allow_threads(|| poll_once(g.execute_async(input))) {
            None => Ok(None),
            Some(r) => {
                let refs = r.map_err(|e| to_py_err(py, submit_error(e)))?;
                self.wrap(py, refs).map(Some)
            }
        }
    }

    /// Submit one execution of an `enable_asyncio` graph, waiting (up to the submit timeout)
    /// for the room that the results of dropped futures free once they arrive; called from a
    /// thread of the asyncio executor. One ref, or a list of refs.
    #[pyo3(signature = (*args, **kwargs))]
    fn submit_async(
        &self,
        py: Python<'_>,
        args: Bound<'_, PyTuple>,
        kwargs: Option<Bound<'_, PyDict>>,
    ) -> PyResult<PyObject> {
        let g = self.live(py)?;
        let input = self.input(py, &args, kwargs.as_ref())?;
        // A wait for room that outlasts the submit timeout ends in a timeout naming it.
        let refs = py
            .allow_threads(|| pollster::block_on(g.execute_async(input)))
            .map_err(|e| to_py_err(py, submit_error(e)))?;
        self.wrap(py, refs)
    }

    /// Whether the graph was compiled with `enable_asyncio`.
    #[getter]
    fn asyncio(&self) -> bool {
        self.asyncio
    }

    /// Stop the graph and release its actors (idempotent).
    fn teardown(&self, py: Python<'_>) -> PyResult<()> {
        let g = self.graph.lock().take();
        if let Some(g) = g {
            // Kept for `stats()` and `timeline()` after teardown (their final counters); it
            // holds no channel or thread once torn down, and goes with this object.
            *self.last.lock() = Some(g.clone());
            py.allow_threads(|| g.teardown())
                .map_err(|e| to_py_err(py, e))?;
        }
        Ok(())
    }

    /// The graph as Graphviz DOT.
    fn visualize(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.live(py)?.visualize())
    }

    /// How `visualize()` names each node given to `new`, in that order.
    fn node_names(&self) -> Vec<String> {
        self.node_names.clone()
    }

    /// The graph's statistics (`CompiledGraph::stats`) as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = self.graph.lock().clone();
        let Some(g) = g.or_else(|| self.last.lock().clone()) else {
            return Err(to_py_err(py, Error::TornDown { reason: None }));
        };
        let s = py.allow_threads(|| g.stats());
        let d = PyDict::new(py);
        d.set_item("graph", s.graph)?;
        d.set_item("executions_submitted", s.executions_submitted)?;
        d.set_item("executions_in_flight", s.executions_in_flight)?;
        d.set_item("results_buffered", s.results_buffered)?;
        let edges = pyo3::types::PyList::empty(py);
        for e in &s.edges {
            let x = PyDict::new(py);
            x.set_item("edge", e.edge)?;
            x.set_item("label", &e.label)?;
            x.set_item("messages", e.messages)?;
            x.set_item("bytes", e.bytes)?;
            x.set_item("growths", e.growths)?;
            edges.append(x)?;
        }
        d.set_item("edges", edges)?;
        let actors = pyo3::types::PyList::empty(py);
        for a in &s.actors {
            let x = PyDict::new(py);
            x.set_item("actor", &a.actor)?;
            x.set_item("pid", a.pid)?;
            x.set_item("executions", a.executions)?;
            x.set_item("busy_seconds", a.busy.as_secs_f64())?;
            x.set_item("log_lines_dropped", a.log_lines_dropped)?;
            x.set_item("events_dropped", a.events_dropped)?;
            x.set_item("reported", a.reported)?;
            actors.append(x)?;
        }
        d.set_item("actors", actors)?;
        Ok(d)
    }

    /// Every operation recorded (`CompiledGraph::timeline`), one dict each.
    fn timeline<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let g = self.graph.lock().clone();
        let Some(g) = g.or_else(|| self.last.lock().clone()) else {
            return Err(to_py_err(py, Error::TornDown { reason: None }));
        };
        let t = py.allow_threads(|| g.timeline());
        let out = pyo3::types::PyList::empty(py);
        for e in &t.events {
            let x = PyDict::new(py);
            x.set_item("actor", &e.actor)?;
            x.set_item("pid", e.pid)?;
            x.set_item("kind", format!("{:?}", e.kind).to_lowercase())?;
            x.set_item("name", &e.name)?;
            x.set_item("op", e.op)?;
            x.set_item("execution", e.exec)?;
            x.set_item("start_ns", e.start_ns)?;
            x.set_item("end_ns", e.end_ns)?;
            out.append(x)?;
        }
        Ok(out)
    }

    /// Write the timeline as Chrome-trace JSON.
    fn write_timeline(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        let g = self.graph.lock().clone();
        let Some(g) = g.or_else(|| self.last.lock().clone()) else {
            return Err(to_py_err(py, Error::TornDown { reason: None }));
        };
        py.allow_threads(|| g.write_timeline(path))
            .map_err(|e| to_py_err(py, e))
    }
}

impl NativeGraph {
    fn wrap(&self, py: Python<'_>, refs: Vec<CompiledRef<PyValue>>) -> PyResult<PyObject> {
        let multi = self.multi;
        let mut refs = refs.into_iter().map(|r| CompiledDAGRef {
            name: RefName {
                graph: self.id.clone(),
                execution: r.execution(),
                channel: multi.then(|| r.output()),
            },
            r: Mutex::new(Some(r)),
            failed: Mutex::new(None),
            default_timeout: self.get_timeout,
            asyncio: self.asyncio,
            polled: Mutex::new(None),
        });
        if self.multi {
            let list = refs
                .map(|r| Bound::new(py, r))
                .collect::<PyResult<Vec<_>>>()?;
            return Ok(pyo3::types::PyList::new(py, list)?.into_any().unbind());
        }
        let one = refs
            .next()
            .ok_or_else(|| PyValueError::new_err("the graph has no output"))?;
        Ok(Bound::new(py, one)?.into_any().unbind())
    }

    /// The refs of an execution that could not run: each raises `err` when read.
    fn failed<'py>(&self, py: Python<'py>, err: PyErr) -> PyResult<PyObject> {
        let n = self.outputs;
        let one = |py: Python<'py>| {
            Bound::new(
                py,
                CompiledDAGRef {
                    name: RefName {
                        graph: self.id.clone(),
                        execution: u64::MAX,
                        channel: None,
                    },
                    r: Mutex::new(None),
                    failed: Mutex::new(Some(err.clone_ref(py))),
                    default_timeout: self.get_timeout,
                    asyncio: self.asyncio,
                    polled: Mutex::new(None),
                },
            )
        };
        if self.multi {
            let list = (0..n).map(|_| one(py)).collect::<PyResult<Vec<_>>>()?;
            return Ok(pyo3::types::PyList::new(py, list)?.into_any().unbind());
        }
        Ok(one(py)?.into_any().unbind())
    }

    fn live(&self, py: Python<'_>) -> PyResult<Arc<Graph>> {
        self.graph
            .lock()
            .clone()
            .ok_or_else(|| to_py_err(py, Error::TornDown { reason: None }))
    }

    fn input(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyInput> {
        // Ray's checks, with Ray's words: the positional count, then each keyword.
        if args.len() != self.positional {
            return Err(PyValueError::new_err(format!(
                "dag.execute() or dag.execute_async() must be called with {} positional args, got {}{}",
                self.positional,
                args.len(),
                if self.positional == 1 && self.parts.iter().any(|p| matches!(p, Selector::Whole)) {
                    " (the graph reads the InputNode itself: pass one value; use inp[i] and inp.key for several)"
                } else {
                    " (one for each inp[i] up to the highest i the graph reads)"
                }
            )));
        }
        for k in &self.keywords {
            if !kwargs.is_some_and(|kw| kw.contains(k).unwrap_or(false)) {
                return Err(PyValueError::new_err(format!(
                    "dag.execute() or dag.execute_async() must be called with kwarg `{k}` (the graph reads inp.{k})"
                )));
            }
        }
        let mut parts = Vec::with_capacity(self.parts.len());
        for p in &self.parts {
            let obj = match p {
                Selector::Whole => args.get_item(0)?,
                Selector::Index(i) => args.get_item(*i).map_err(|_| {
                    PyTypeError::new_err(format!(
                        "the graph reads inp[{i}], but execute() got {} positional arguments",
                        args.len()
                    ))
                })?,
                Selector::Key(k) => kwargs
                    .and_then(|kw| kw.get_item(k).ok().flatten())
                    .ok_or_else(|| {
                        PyTypeError::new_err(format!(
                            "the graph reads inp.{k}, but execute() got no keyword argument {k}="
                        ))
                    })?,
            };
            parts.push(dumps(py, &obj)?);
        }
        Ok(PyInput { parts })
    }
}

/// An error of submitting an execution: every wait of a submission is bounded by the submit
/// timeout (room in the input channels, an earlier execution whose refs were dropped and whose
/// result must be read first, room among the executions in flight), so a timeout there names
/// that option, whatever the wait was.
fn submit_error(e: Error) -> Error {
    match e {
        Error::Timeout { what, timeout, .. } => Error::Timeout {
            what: if what.contains("submit") {
                what
            } else {
                format!("{what} while submitting an execution")
            },
            timeout,
            hint: "raise experimental_compile(_submit_timeout=...) if executions are expected to take that long, or get results before submitting more (experimental_compile(_max_inflight_executions=...) bounds how many are in flight)".into(),
        },
        e => e,
    }
}

/// Poll a future once (a waker that does nothing): its output if it is ready at once.
fn poll_once<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(f).poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

/// Wait for a ref's value (`timeout`: `None` for the graph's default), in slices of
/// [`SIGNAL_SLICE`] with the GIL released, looking for signals between them: Ctrl-C ends a
/// long wait within a slice with `KeyboardInterrupt` (the ref stays valid).
fn wait_interruptibly(
    py: Python<'_>,
    r: &CompiledRef<PyValue>,
    timeout: Option<Duration>,
    default_timeout: Duration,
) -> PyResult<adag::Result<PyValue>> {
    // A fast graph's result comes within a few microseconds of the submit: waited for
    // with the GIL held, it costs no release and retake of the GIL (a Python thread waits
    // no longer than this for it).
    if timeout.is_none_or(|t| t >= GIL_HELD_WAIT) {
        match r.get_timeout(GIL_HELD_WAIT) {
            Err(Error::Timeout { .. }) => {}
            done => return Ok(done),
        }
    }
    let limit = timeout.unwrap_or(default_timeout);
    let start = std::time::Instant::now();
    loop {
        let left = limit.saturating_sub(start.elapsed());
        let slice = left.min(SIGNAL_SLICE);
        match py.allow_threads(|| r.get_timeout(slice)) {
            Err(Error::Timeout { .. }) if slice < left => py.check_signals()?,
            // The whole budget is spent: the timeout names the full wait.
            Err(Error::Timeout { .. }) => {
                return Ok(py.allow_threads(|| r.get_timeout(Duration::ZERO)).map_err(
                    |e| match e {
                        Error::Timeout { what, hint, .. } => Error::Timeout {
                            what,
                            timeout: limit,
                            hint,
                        },
                        e => e,
                    },
                ));
            }
            done => return Ok(done),
        }
    }
}

/// How long a blocking `get` waits for a result before it releases the GIL.
const GIL_HELD_WAIT: Duration = Duration::from_micros(3);

/// The value of a ref, or the values of a list of refs, in order (Ray's `ray.get`).
///
/// `timeout` is in seconds for each ref (`None`: the graph's default for compiled-graph refs,
/// for ever for one-off calls). Raises `TaskError` (also an instance of the method's own
/// exception type) when a method failed, `GetTimeoutError` on timeout (the ref stays valid),
/// `ActorDiedError` when an actor died.
#[pyfunction]
#[pyo3(signature = (refs, timeout=None))]
pub fn get(py: Python<'_>, refs: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<PyObject> {
    // The hot path, one compiled-graph ref, without a Python frame; the rest in Python.
    if let Ok(r) = refs.downcast_exact::<CompiledDAGRef>() {
        return r.get().get(py, timeout);
    }
    static SLOW: pyo3::sync::GILOnceCell<PyObject> = pyo3::sync::GILOnceCell::new();
    SLOW.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.import("adag")?.getattr("_get")?.unbind())
    })?
    .call1(py, (refs, timeout))
}

/// The result of one output of one execution (Ray's `CompiledDAGRef`): claim it once with
/// `adag.get(ref)` or `ref.get()`.
#[pyclass(module = "adag", frozen)]
pub struct CompiledDAGRef {
    name: RefName,
    r: Mutex<Option<CompiledRef<PyValue>>>,
    /// The error this ref raises when read: its execution could not run (an actor died).
    failed: Mutex<Option<PyErr>>,
    /// How long `get()` waits without a timeout (the graph's `get_timeout`).
    default_timeout: Duration,
    asyncio: bool,
    /// The ref's future while an event loop awaits it (`_poll`).
    polled: Mutex<Option<Polled>>,
}

/// What `str(ref)` shows (Ray's form).
struct RefName {
    graph: Arc<str>,
    execution: u64,
    /// The output, when the graph has several (`None` for one).
    channel: Option<usize>,
}

/// Ray's words for a second `get`.
const GOT_ONCE: &str =
    "ray.get() can only be called once on a CompiledDAGRef, and it was already called.";

/// How long one wait of a blocking `get` lasts before it looks for a signal (Ctrl-C).
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

type RefFut = adag::RefFuture<PyValue>;

/// A ref being awaited: its future, and the eventfd its waker signals (the event loop watches
/// it with `add_reader`; waking needs no GIL).
struct Polled {
    fut: RefFut,
    wake: Arc<EventWake>,
}

/// The waker of an awaited ref: an eventfd the event loop watches, made only when the ref
/// is still pending after the first polls (most awaits of a fast graph find the value while
/// spinning, and an eventfd costs system calls to make, watch and close). A wake before the
/// eventfd exists is remembered and written to it when it is made.
#[derive(Default)]
struct EventWake {
    /// Set by every wake; the spinning poller clears it before it polls again.
    woken: std::sync::atomic::AtomicBool,
    fd: Mutex<Option<std::os::fd::OwnedFd>>,
}

impl EventWake {
    /// The eventfd, made now if need be (readable at once if a wake came first: a wake sets
    /// `woken` before it looks for the eventfd, under the same lock as this).
    fn fd(&self) -> std::io::Result<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        let mut fd = self.fd.lock();
        if fd.is_none() {
            let made = rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )?;
            if self.woken.load(std::sync::atomic::Ordering::Acquire) {
                let _ = rustix::io::write(&made, &1u64.to_ne_bytes());
            }
            *fd = Some(made);
        }
        Ok(fd.as_ref().expect("made above").as_raw_fd())
    }
}

impl std::task::Wake for EventWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, std::sync::atomic::Ordering::Release);
        if let Some(fd) = &*self.fd.lock() {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
    }
}

/// How long `_poll(spin=True)` polls a pending ref again before the event loop sleeps on its
/// eventfd: a wake from another core costs tens of microseconds here, a fast graph's result
/// comes sooner (the channels' own spin window).
const AWAIT_SPIN: Duration = Duration::from_micros(50);

#[pymethods]
impl CompiledDAGRef {
    /// Wait for the value, up to `timeout` seconds (`None`: the graph's default of 10 s; a
    /// negative number: for ever). On a timeout the ref stays valid. Raises the task's error
    /// if the method failed.
    #[pyo3(signature = (timeout=None))]
    fn get(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyObject> {
        if self.asyncio {
            return Err(to_py_err(
                py,
                Error::WrongMode {
                    message: "this graph was compiled with enable_asyncio=True: await the futures of execute_async(...) instead".into(),
                },
            ));
        }
        self.wait(py, timeout)
    }

    /// Poll the ref's future from the event loop's thread: `(True, value)` when it is
    /// ready, else `(False, fd)`: an eventfd that becomes readable when it is worth polling
    /// again (drain it with `os.read(fd, 8)`). With `spin`, a pending future is polled again
    /// for up to 50 µs first (the GIL released, yielding the core between looks): the caller
    /// passes it when the loop has no other callback ready, so the spin delays no one.
    #[pyo3(signature = (spin=false))]
    fn _poll(&self, py: Python<'_>, spin: bool) -> PyResult<(bool, PyObject)> {
        let mut polled = self.polled.lock();
        if polled.is_none() {
            if let Some(err) = self.failed.lock().take() {
                return Err(err);
            }
            let r = self
                .r
                .lock()
                .take()
                .ok_or_else(|| PyValueError::new_err(GOT_ONCE))?;
            *polled = Some(Polled {
                fut: std::future::IntoFuture::into_future(r),
                wake: Arc::new(EventWake::default()),
            });
        }
        let p = polled.as_mut().expect("set above");
        let wake = p.wake.clone();
        let waker = std::task::Waker::from(p.wake.clone());
        let fut = &mut p.fut;
        let got = py.allow_threads(|| {
            use std::sync::atomic::Ordering;
            let mut cx = std::task::Context::from_waker(&waker);
            wake.woken.store(false, Ordering::Relaxed);
            let start = std::time::Instant::now();
            // Read the result on this thread (spinning up to the budget when the loop is
            // idle): no hop through the graph's result pump.
            let first = std::pin::Pin::new(&mut *fut)
                .poll_reading(&mut cx, if spin { AWAIT_SPIN } else { Duration::ZERO });
            if !spin || first.is_ready() {
                return first;
            }
            // The pump held the channels: it delivers the result. Watch the wake flag, not
            // the future: polling takes the graph's locks, which the pump needs.
            loop {
                if wake.woken.swap(false, Ordering::AcqRel) {
                    let again = std::pin::Pin::new(&mut *fut).poll(&mut cx);
                    if again.is_ready() {
                        return again;
                    }
                }
                if start.elapsed() >= AWAIT_SPIN {
                    return std::task::Poll::Pending;
                }
                // Give the core away at each turn: the threads that deliver the result (the
                // driver's pump, the worker) may be waiting for this very core on a small
                // machine, and a spin that holds it only delays them. Measured (six runs of
                // `workloads.py --system adag --filter async` each): a pure spin gave 75 µs in
                // most runs and 4 µs in the others; yielding from the start 7.7-14 µs in all,
                // 5 µs of pure spin first 11.6-14.5, 20 µs 27-31.
                std::thread::yield_now();
            }
        });
        match got {
            std::task::Poll::Pending => {
                let fd = p
                    .wake
                    .fd()
                    .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("eventfd: {e}")))?;
                Ok((false, fd.into_pyobject(py)?.into_any().unbind()))
            }
            std::task::Poll::Ready(r) => {
                // Done: the future and its eventfd go (a late wake writes to the eventfd the
                // waker still holds, never to a reused fd number).
                *polled = None;
                let v = r.map_err(|e| to_py_err(py, e))?;
                Ok((true, loads(py, &v)?))
            }
        }
    }

    /// `get` for the futures of `enable_asyncio` graphs, from an executor's thread.
    #[pyo3(signature = (timeout=None))]
    fn _wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyObject> {
        self.wait(py, timeout)
    }

    fn __repr__(&self) -> String {
        let n = &self.name;
        let channel = n
            .channel
            .map_or_else(|| "None".to_string(), |c| c.to_string());
        if n.execution == u64::MAX {
            return format!(
                "CompiledDAGRef({}, execution_index=None, channel_index={channel})",
                n.graph
            );
        }
        format!(
            "CompiledDAGRef({}, execution_index={}, channel_index={channel})",
            n.graph, n.execution
        )
    }

    fn __str__(&self) -> String {
        self.__repr__()
    }

    fn __copy__(&self) -> PyResult<()> {
        Err(PyValueError::new_err("CompiledDAGRef cannot be copied."))
    }

    fn __deepcopy__(&self, _memo: &Bound<'_, PyAny>) -> PyResult<()> {
        Err(PyValueError::new_err(
            "CompiledDAGRef cannot be deep copied.",
        ))
    }

    fn __reduce__(&self) -> PyResult<()> {
        Err(PyValueError::new_err("CompiledDAGRef cannot be pickled."))
    }
}

impl CompiledDAGRef {
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyObject> {
        let timeout = secs("timeout", timeout)?;
        if let Some(err) = self.failed.lock().take() {
            return Err(err);
        }
        if self.r.lock().is_none() {
            // An await began with `_poll` and was cancelled: finish its future here.
            if let Some(p) = self.polled.lock().take() {
                let v = py
                    .allow_threads(|| pollster::block_on(p.fut))
                    .map_err(|e| to_py_err(py, e))?;
                return loads(py, &v);
            }
        }
        // Taken out for the wait (a clone would make the ref share its claim, an allocation
        // per get), and put back if the ref stays valid: a timeout or a signal.
        let r = self
            .r
            .lock()
            .take()
            .ok_or_else(|| PyValueError::new_err(GOT_ONCE))?;
        let got = if self.asyncio {
            // A future of an asyncio graph, awaited from an executor's thread (asyncio's own
            // `wait_for` bounds it).
            py.allow_threads(|| pollster::block_on(std::future::IntoFuture::into_future(r)))
        } else {
            match wait_interruptibly(py, &r, timeout, self.default_timeout) {
                Ok(Err(e)) if e.ref_stays_usable() => {
                    *self.r.lock() = Some(r);
                    Err(e)
                }
                Ok(got) => got,
                Err(signal) => {
                    *self.r.lock() = Some(r);
                    return Err(signal);
                }
            }
        };
        let v = got.map_err(|e| to_py_err(py, e))?;
        loads(py, &v)
    }
}
