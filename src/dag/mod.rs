//! Graph building: the input node and its parts, method-call nodes, split tuple results,
//! multi-output sets and by-name binding.
//!
//! Nodes are cheap handles (`Arc`) that point at their arguments, so a graph is the set of
//! nodes reachable from its outputs. Every node gets a global creation number: bind order,
//! which is a topological order, and which fixes the order in which one actor runs its tasks.
use crate::error::{Error, Result};
use crate::value::{TypeTag, Value, encode};
use parking_lot::Mutex;
use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

mod actor_ref;
pub mod collective;
pub(crate) mod input;
mod output;
pub(crate) mod transport;
pub use actor_ref::ActorRef;
pub(crate) use actor_ref::{ActorInfo, MethodSig};
pub use input::{InputNode, TupleArg};
pub use output::MultiOutput;
pub use transport::{CustomCommunicator, Transport};

static NEXT_NODE_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_DAG_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_GRAPH_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_graph_id() -> u64 {
    NEXT_GRAPH_ID.fetch_add(1, Ordering::Relaxed)
}

/// A graph under construction. `I` is the type of the value passed to `execute`.
///
/// ```
/// use adag::{Dag, CompileOptions};
/// let dag = Dag::<(u32, String)>::new();
/// let input = dag.input();
/// let first = input.arg::<0>();
/// assert_eq!(first.describe(), "input[0]");
/// ```
pub struct Dag<I> {
    pub(crate) inner: Arc<DagInner>,
    _input: PhantomData<fn(I)>,
}

pub(crate) struct DagInner {
    pub(crate) id: u64,
    /// Every node created in this graph, for the leaf check at compile time.
    pub(crate) nodes: Mutex<Vec<Weak<NodeInner>>>,
    pub(crate) input: Mutex<Option<Arc<NodeInner>>>,
    /// The graphs compiled from this one (id, and whether it still runs), so that compiling
    /// it again while one is live says so, and which.
    pub(crate) compiled: Mutex<Vec<(u64, Weak<dyn Liveness>)>>,
}

/// Whether a compiled graph still runs (implemented by the driver's graph).
pub(crate) trait Liveness: Send + Sync {
    fn is_live(&self) -> bool;
}

impl DagInner {
    /// Remember graph `id`, compiled from this one; forget those gone or torn down.
    pub(crate) fn record_compiled(&self, id: u64, graph: Weak<dyn Liveness>) {
        let mut compiled = self.compiled.lock();
        compiled.retain(|(_, g)| g.upgrade().is_some_and(|g| g.is_live()));
        compiled.push((id, graph));
    }

    /// The id of a live graph compiled from this one, if any.
    pub(crate) fn live_compiled(&self) -> Option<u64> {
        self.compiled
            .lock()
            .iter()
            .find(|(_, g)| g.upgrade().is_some_and(|g| g.is_live()))
            .map(|(id, _)| *id)
    }
}

impl<I> Drop for Dag<I> {
    /// The input node points back at its graph (`NodeInner::dag`) and the graph keeps the
    /// input node for `input()`: without cutting that circle here, every graph would stay
    /// in memory for ever (a driver compiling a graph per request grew by ~2 KiB a graph).
    /// Nodes still held elsewhere keep what they need through their own handles.
    fn drop(&mut self) {
        self.inner.input.lock().take();
    }
}

impl<I: Value> Default for Dag<I> {
    fn default() -> Self {
        Self::new()
    }
}

impl<I: Value> Dag<I> {
    /// A new, empty graph.
    pub fn new() -> Self {
        Dag {
            inner: Arc::new(DagInner {
                id: NEXT_DAG_ID.fetch_add(1, Ordering::Relaxed),
                nodes: Mutex::new(Vec::new()),
                input: Mutex::new(None),
                compiled: Mutex::new(Vec::new()),
            }),
            _input: PhantomData,
        }
    }

    /// The input node: the value given to `execute`. Calling it again returns the same node.
    pub fn input(&self) -> InputNode<I> {
        let mut slot = self.inner.input.lock();
        let node = slot
            .get_or_insert_with(|| {
                NodeInner::new(
                    Some(self.inner.clone()),
                    NodeKind::Input(InputKind::Whole),
                    TypeTag::of::<I>(),
                    None,
                )
            })
            .clone();
        InputNode::new(Node::from_inner(node))
    }

    /// The graph's identity, shown in errors.
    pub fn id(&self) -> u64 {
        self.inner.id
    }
}

/// Where a part of the input comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum InputKind {
    Whole,
    Index(usize),
    Field(String),
}

pub(crate) enum NodeKind {
    Input(InputKind),
    Method {
        actor: ActorRef,
        method: String,
        args: Vec<ErasedArg>,
    },
    /// Element `index` of a tuple returned by `source`.
    Split {
        source: Arc<NodeInner>,
        index: usize,
    },
    /// The part of collective `group` that runs on the actor of `input` (its `index`-th input).
    Collective {
        input: Arc<NodeInner>,
        group: Arc<collective::CollectiveGroup>,
        index: usize,
    },
}

/// A node of the graph whose value has type `T`.
pub struct Node<T> {
    pub(crate) inner: Arc<NodeInner>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Node<T> {
    fn clone(&self) -> Self {
        Node {
            inner: self.inner.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Node<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Node({})", self.inner.describe())
    }
}

pub(crate) struct NodeInner {
    pub(crate) id: u64,
    pub(crate) dag: Option<Arc<DagInner>>,
    /// Set when the arguments come from several graphs: the compile error names them.
    pub(crate) foreign: Option<u64>,
    pub(crate) kind: NodeKind,
    pub(crate) ty: TypeTag,
    /// For input parts: how the driver computes this part from the whole input (the driver's
    /// own object, which the graph only carries).
    pub(crate) feed: Option<Box<dyn Any + Send + Sync>>,
    /// How a tensor value travels to readers on other actors (`with_tensor_transport`).
    pub(crate) transport: Mutex<Option<Transport>>,
    /// What errors, pictures, the timeline and statistics call a method node instead of its
    /// method (`Node::label`): the name of the user's own function when the method is a
    /// dispatcher (the Python package's `call1`).
    pub(crate) label: Mutex<Option<String>>,
}

impl NodeInner {
    pub(crate) fn new(
        dag: Option<Arc<DagInner>>,
        kind: NodeKind,
        ty: TypeTag,
        feed: Option<Box<dyn Any + Send + Sync>>,
    ) -> Arc<Self> {
        Self::with_foreign(dag, None, kind, ty, feed)
    }

    pub(crate) fn with_foreign(
        dag: Option<Arc<DagInner>>,
        foreign: Option<u64>,
        kind: NodeKind,
        ty: TypeTag,
        feed: Option<Box<dyn Any + Send + Sync>>,
    ) -> Arc<Self> {
        let node = Arc::new(NodeInner {
            id: NEXT_NODE_ID.fetch_add(1, Ordering::Relaxed),
            dag: dag.clone(),
            foreign,
            kind,
            ty,
            feed,
            transport: Mutex::new(None),
            label: Mutex::new(None),
        });
        if let Some(dag) = dag {
            let mut nodes = dag.nodes.lock();
            // A graph built and rebuilt for a long time (nodes made, dropped, made again)
            // would keep one dead entry per node ever made: drop the dead ones whenever the
            // list doubles, so it stays within twice the nodes alive.
            if nodes.len() == nodes.capacity() && nodes.len() >= 16 {
                nodes.retain(|w| w.strong_count() > 0);
            }
            nodes.push(Arc::downgrade(&node));
        }
        node
    }

    /// How errors and pictures name this node: `actor.method#id`, `input`, `input[0]`, `input.k`.
    pub(crate) fn describe(&self) -> String {
        match &self.kind {
            NodeKind::Input(InputKind::Whole) => "input".to_string(),
            NodeKind::Input(InputKind::Index(i)) => format!("input[{i}]"),
            NodeKind::Input(InputKind::Field(k)) => format!("input.{k}"),
            NodeKind::Method { actor, method, .. } => {
                let label = self.label.lock();
                let shown = label.as_deref().unwrap_or(method);
                format!("{}.{}#{}", actor.name(), shown, self.id)
            }
            NodeKind::Split { source, index } => format!("{}[{}]", source.describe(), index),
            NodeKind::Collective { input, group, .. } => match input.actor() {
                Some(a) => format!("{}.{}#{}", a.name(), group.kind, self.id),
                None => format!("{}.{}#{}", input.describe(), group.kind, self.id),
            },
        }
    }

    /// The actor whose schedule runs this node, if any.
    pub(crate) fn actor(&self) -> Option<&ActorRef> {
        match &self.kind {
            NodeKind::Method { actor, .. } => Some(actor),
            NodeKind::Split { source, .. } => source.actor(),
            NodeKind::Collective { input, .. } => input.actor(),
            NodeKind::Input(_) => None,
        }
    }

    pub(crate) fn upstream(&self) -> Vec<&Arc<NodeInner>> {
        match &self.kind {
            NodeKind::Input(_) => Vec::new(),
            NodeKind::Method { args, .. } => args
                .iter()
                .filter_map(|a| match &a.0 {
                    ArgInner::Node(n) => Some(n),
                    ArgInner::Const(_) => None,
                })
                .collect(),
            NodeKind::Split { source, .. } => vec![source],
            NodeKind::Collective { input, .. } => vec![input],
        }
    }
}

impl<T> Node<T> {
    pub(crate) fn from_inner(inner: Arc<NodeInner>) -> Self {
        Node {
            inner,
            _t: PhantomData,
        }
    }

    /// The node's name as errors and `visualize()` show it.
    pub fn describe(&self) -> String {
        self.inner.describe()
    }

    /// Name this method node for people: errors, `visualize()`, the timeline and
    /// statistics show `label` where they would show the method's name (the node still
    /// calls its method). For dispatching methods, such as one that runs a function chosen
    /// by an argument, this shows the function.
    ///
    /// ```
    /// # use adag::{CompileOptions, Dag, Placement, Runtime};
    /// # pub struct Worker;
    /// # #[adag::actor]
    /// # impl Worker {
    /// #     pub fn new() -> Self { Worker }
    /// #     pub fn run(&mut self, x: u64) -> u64 { x * 2 }
    /// # }
    /// let rt = Runtime::new()?;
    /// let a = rt.spawn::<Worker>(Placement::Thread, ())?;
    /// let dag = Dag::<u64>::new();
    /// let y = a.run(dag.input()).label("double");
    /// assert!(y.describe().contains(".double#"), "{}", y.describe());
    /// let graph = dag.compile(y, CompileOptions::default())?;
    /// assert!(graph.visualize().contains(".double#"));
    /// assert_eq!(graph.execute(21)?.get()?, 42);
    /// # Ok::<(), adag::Error>(())
    /// ```
    #[must_use = "the node is returned for chaining"]
    pub fn label(self, label: impl Into<String>) -> Self {
        *self.inner.label.lock() = Some(label.into());
        self
    }

    /// Forget the static type (for by-name binding and tools); checked again at compile time.
    pub fn erase(&self) -> AnyNode {
        AnyNode {
            inner: self.inner.clone(),
        }
    }
}

/// A node whose type is checked when the graph is compiled (by-name binding).
#[derive(Clone)]
pub struct AnyNode {
    pub(crate) inner: Arc<NodeInner>,
}

impl fmt::Debug for AnyNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "AnyNode({}: {})",
            self.inner.describe(),
            self.inner.ty.name
        )
    }
}

impl AnyNode {
    /// The node's value type.
    pub fn type_name(&self) -> &'static str {
        self.inner.ty.name
    }

    /// Recover a typed node; `None` when the node's type is not `T`.
    pub fn typed<T: 'static>(&self) -> Option<Node<T>> {
        (self.inner.ty == TypeTag::of::<T>()).then(|| Node::from_inner(self.inner.clone()))
    }

    /// The node's name as errors show it.
    pub fn describe(&self) -> String {
        self.inner.describe()
    }

    /// [`Node::label`] of a by-name node.
    #[must_use = "the node is returned for chaining"]
    pub fn label(self, label: impl Into<String>) -> Self {
        *self.inner.label.lock() = Some(label.into());
        self
    }

    /// Split the tuple result of a by-name method into one node per element (the by-name
    /// [`Node::split`]), each typed like its element.
    ///
    /// Only the node of a method returning a tuple (of 2 to 8 elements) splits; any other
    /// node is an [`Error::Compile`] naming the node and the method.
    ///
    /// ```
    /// # use adag::{Dag, ErasedArg, Placement, Runtime};
    /// # pub struct M;
    /// # #[adag::actor]
    /// # impl M {
    /// #     pub fn new() -> Self { M }
    /// #     pub fn divmod(&mut self, a: u64) -> (u64, String) { (a / 2, format!("{}", a % 2)) }
    /// #     pub fn twice(&mut self, a: u64) -> u64 { 2 * a }
    /// # }
    /// let rt = Runtime::new()?;
    /// let m = rt.spawn::<M>(Placement::Thread, ())?;
    /// let dag = Dag::<u64>::new();
    /// let x = ErasedArg::from(dag.input().erase());
    /// let parts = m.method("divmod")?.bind([x.clone()]).split()?;
    /// assert_eq!(parts.len(), 2);
    /// assert_eq!(parts[1].type_name(), "alloc::string::String");
    /// let err = m.method("twice")?.bind([x]).split().unwrap_err().to_string();
    /// assert!(err.contains("twice") && err.contains("not a tuple"), "{err}");
    /// # Ok::<(), adag::Error>(())
    /// ```
    pub fn split(&self) -> Result<Vec<AnyNode>> {
        let NodeKind::Method { actor, method, .. } = &self.inner.kind else {
            return Err(Error::compile(
                self.describe(),
                format!(
                    "only the result of a method can be split, and this node is not a method call (its type is {})",
                    self.type_name()
                ),
            ));
        };
        let Some(sig) = actor.signature(method) else {
            return Err(Error::compile(
                self.describe(),
                format!("actor {} has no method `{method}`", actor.name()),
            ));
        };
        let Some(elems) = sig.elems else {
            return Err(Error::compile(
                self.describe(),
                format!(
                    "method `{method}` of actor {} returns {}, not a tuple; only a method returning a tuple of 2 to 8 elements can be split (use the node itself as the output or argument)",
                    actor.name(),
                    sig.ret.name()
                ),
            ));
        };
        Ok(elems
            .into_iter()
            .enumerate()
            .map(|(index, ty)| AnyNode {
                inner: NodeInner::with_foreign(
                    self.inner.dag.clone(),
                    self.inner.foreign,
                    NodeKind::Split {
                        source: self.inner.clone(),
                        index,
                    },
                    ty,
                    None,
                ),
            })
            .collect())
    }
}

/// An argument of a bound method: a node of the graph or a constant.
pub struct Arg<T> {
    inner: ArgInner,
    _t: PhantomData<fn() -> T>,
}

#[derive(Clone)]
pub(crate) enum ArgInner {
    Node(Arc<NodeInner>),
    Const(ConstArg),
}

/// A constant argument, encoded once when bound.
#[derive(Clone)]
pub(crate) struct ConstArg {
    pub(crate) ty: TypeTag,
    pub(crate) bytes: Result<Arc<[u8]>, String>,
}

/// An argument with its type erased (by-name binding and generated code).
#[derive(Clone)]
pub struct ErasedArg(pub(crate) ArgInner);

impl ErasedArg {
    /// A constant argument for by-name binding.
    pub fn constant<T: Value>(value: T) -> Self {
        Arg::<T>::from(value).erase()
    }

    pub(crate) fn type_tag(&self) -> TypeTag {
        match &self.0 {
            ArgInner::Node(n) => n.ty,
            ArgInner::Const(c) => c.ty,
        }
    }
}

impl From<AnyNode> for ErasedArg {
    fn from(node: AnyNode) -> Self {
        ErasedArg(ArgInner::Node(node.inner))
    }
}

impl From<&AnyNode> for ErasedArg {
    fn from(node: &AnyNode) -> Self {
        ErasedArg(ArgInner::Node(node.inner.clone()))
    }
}

impl<T> Arg<T> {
    /// Forget the static type (used by the code `#[actor]` generates).
    pub fn erase(self) -> ErasedArg {
        ErasedArg(self.inner)
    }
}

impl<T: Value> From<T> for Arg<T> {
    fn from(value: T) -> Self {
        Arg {
            inner: ArgInner::Const(ConstArg {
                ty: TypeTag::of::<T>(),
                bytes: encode(&value).map(Into::into).map_err(|e| e.to_string()),
            }),
            _t: PhantomData,
        }
    }
}

impl<T> From<Node<T>> for Arg<T> {
    fn from(node: Node<T>) -> Self {
        Arg {
            inner: ArgInner::Node(node.inner),
            _t: PhantomData,
        }
    }
}

impl<T> From<&Node<T>> for Arg<T> {
    fn from(node: &Node<T>) -> Self {
        Arg {
            inner: ArgInner::Node(node.inner.clone()),
            _t: PhantomData,
        }
    }
}

impl<T> From<InputNode<T>> for Arg<T> {
    fn from(node: InputNode<T>) -> Self {
        Arg::from(node.node)
    }
}

impl<T> From<&InputNode<T>> for Arg<T> {
    fn from(node: &InputNode<T>) -> Self {
        Arg::from(&node.node)
    }
}

/// Create a method-call node (used by the actor handles' binding methods).
pub(crate) fn method_node(
    actor: ActorRef,
    method: &str,
    args: Vec<ErasedArg>,
    ty: TypeTag,
) -> Arc<NodeInner> {
    let mut dag: Option<Arc<DagInner>> = None;
    let mut foreign = None;
    for arg in &args {
        if let ArgInner::Node(n) = &arg.0 {
            match (&dag, &n.dag) {
                (None, Some(d)) => dag = Some(d.clone()),
                (Some(a), Some(b)) if a.id != b.id => foreign = Some(b.id),
                _ => {}
            }
            foreign = foreign.or(n.foreign);
        }
    }
    let kind = NodeKind::Method {
        actor,
        method: method.to_string(),
        args,
    };
    NodeInner::with_foreign(dag, foreign, kind, ty, None)
}

macro_rules! impl_split {
    ($n:literal => $($t:ident $i:tt),+) => {
        impl<$($t: Value),+> Node<($($t,)+)> {
            /// Split a tuple result into one node per element (Ray's `num_returns`).
            #[must_use = "the nodes do nothing unless they are bound into tasks or are outputs"]
            pub fn split(&self) -> ($(Node<$t>,)+) {
                ($(Node::from_inner(NodeInner::with_foreign(
                    self.inner.dag.clone(),
                    self.inner.foreign,
                    NodeKind::Split { source: self.inner.clone(), index: $i },
                    TypeTag::of::<$t>(),
                    None,
                )),)+)
            }
        }
    };
}
impl_split!(2 => A 0, B 1);
impl_split!(3 => A 0, B 1, C 2);
impl_split!(4 => A 0, B 1, C 2, D 3);
impl_split!(5 => A 0, B 1, C 2, D 3, E 4);
impl_split!(6 => A 0, B 1, C 2, D 3, E 4, F 5);
impl_split!(7 => A 0, B 1, C 2, D 3, E 4, F 5, G 6);
impl_split!(8 => A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);
