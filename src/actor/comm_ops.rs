//! The communicator operations of an actor's schedule: receive and send the tensors of
//! communicator edges, run this actor's part of collectives, and (with
//! `overlap_gpu_communication`) the actor's communication thread.
//!
//! A communicator edge carries, on its ordinary channel, only a [`TensorMeta`] (shape and
//! dtype) or the writer's error; the data follows through the communicator. An error in the
//! value reaches every reader without touching the communicator. A rank whose collective
//! input is an error still takes part, with a tensor that no backend accepts (more
//! dimensions than any supports), so that every rank fails that call together and the group
//! stays in step; the failed rank passes its own error on, the others the communicator's.
//!
//! A communicator failure that can leave the ranks out of step (a timeout, an abort, a send
//! or receive that failed half way) destroys the group: every rank then fails at once, each
//! later execution returns the error, and nothing waits for a peer that will never come.
use super::channels::GraphChannels;
use super::observe::bump;
use super::op::Op;
use crate::channel::slot::LocalSlot;
use crate::channel::{ChanError, ChannelWriter, EndCounters, FanOut, Msg, Reader};
use crate::comm::{CommError, Communicator, cpu::MAX_DIMS};
use crate::compile::plan::{GraphPlan, Loc, OpSpec, Stage};
use crate::dag::collective::CollectiveKind;
use crate::error::TaskError;
use crate::tensor::{DType, Tensor};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The communicators of one actor in one graph, by group index of the plan.
pub(crate) type CommMap = HashMap<u32, Arc<dyn Communicator>>;

/// What a communicator edge's ordinary channel carries: how to receive the tensor.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TensorMeta {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Recv(u64),
    Send(u64),
    Coll(u64),
}

fn key(op: &OpSpec) -> Option<(Key, Stage)> {
    match op {
        OpSpec::Recv { edge, stage, .. } => Some((Key::Recv(*edge), *stage)),
        OpSpec::Send { edge, stage, .. } => Some((Key::Send(*edge), *stage)),
        OpSpec::Collective { node, stage, .. } => Some((Key::Coll(*node), *stage)),
        _ => None,
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// What building a communicator operation needs from the builder of the actor's schedule
/// (`method::TaskBuilder`): the graph, this actor's place and channels, its communicator
/// side, and the tensors its other operations produce and consume. A trait, so that this
/// module does not import the builder that calls it.
pub(crate) trait ScheduleWiring<A> {
    fn plan(&self) -> &GraphPlan;
    fn me(&self) -> Loc;
    fn chans(&self) -> &GraphChannels;
    fn actor_name(&self) -> &str;
    fn comm(&mut self) -> &mut CommCtx<A>;
    fn slots_insert(&mut self, edge: u64, slot: Rc<dyn Any>);
    /// The slot of a tensor computed earlier in the schedule, if any.
    fn tensor_slot(&mut self, edge: u64) -> Result<Option<Rc<LocalSlot<Tensor>>>, String>;
    /// The slot a tensor-producing operation writes, with the writes that send it on.
    fn tensor_output(
        &mut self,
        edge: u64,
        method: &'static str,
    ) -> Result<Rc<LocalSlot<Tensor>>, String>;
}

/// The communicator side of the schedule's builder (see [`ScheduleWiring`]).
pub(crate) struct CommCtx<A> {
    comms: CommMap,
    /// This actor's communicator ops, by what they move, with the stages they appear in.
    specs: HashMap<Key, OpSpec>,
    stages: HashMap<Key, Vec<Stage>>,
    built: HashMap<(Key, Stage), Op<A>>,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl<A> Default for CommCtx<A> {
    fn default() -> Self {
        CommCtx {
            comms: HashMap::new(),
            specs: HashMap::new(),
            stages: HashMap::new(),
            built: HashMap::new(),
            jobs: None,
            thread: None,
        }
    }
}

impl<A> CommCtx<A> {
    pub(crate) fn new(comms: CommMap, ops: &[OpSpec]) -> Self {
        let mut specs = HashMap::new();
        let mut stages: HashMap<Key, Vec<Stage>> = HashMap::new();
        for op in ops {
            if let Some((k, s)) = key(op) {
                specs.entry(k).or_insert_with(|| op.clone());
                stages.entry(k).or_default().push(s);
            }
        }
        CommCtx {
            comms,
            specs,
            stages,
            ..Default::default()
        }
    }

    /// The built operation of `op` (a communicator op of the schedule).
    pub(crate) fn take(&mut self, op: &OpSpec) -> Option<Op<A>> {
        key(op).and_then(|k| self.built.remove(&k))
    }

    fn comm(&self, group: u32) -> Result<Arc<dyn Communicator>, String> {
        self.comms
            .get(&group)
            .cloned()
            .ok_or_else(|| format!("communicator group {group} was not handed to this actor"))
    }

    fn stages(&self, k: Key) -> Vec<Stage> {
        self.stages.get(&k).cloned().unwrap_or_default()
    }

    /// The communication thread's queue, started on first use.
    fn jobs(&mut self, actor: &str) -> Result<Sender<Job>, String> {
        if let Some(tx) = &self.jobs {
            return Ok(tx.clone());
        }
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let handle = std::thread::Builder::new()
            .name(format!("adag-comm-{actor}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    job();
                }
            })
            .map_err(|e| format!("cannot start the communication thread: {e}"))?;
        self.thread = Some(handle);
        self.jobs = Some(tx.clone());
        Ok(tx)
    }

    /// What must outlive the schedule's loop: the communicators to destroy and the thread to
    /// join once the loop's operations are dropped.
    pub(crate) fn guard(&mut self) -> CommGuard {
        self.jobs = None;
        CommGuard {
            comms: self.comms.values().cloned().collect(),
            thread: self.thread.take(),
        }
    }
}

/// Destroys an actor's communicators when its loop ends (waking any peer still blocked in
/// one) and joins its communication thread. Drop it after the loop's operations.
pub(crate) struct CommGuard {
    comms: Vec<Arc<dyn Communicator>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for CommGuard {
    fn drop(&mut self) {
        for c in &self.comms {
            let _ = c.destroy();
        }
        if let Some(t) = self.thread.take() {
            // Its job wakes: the channels are closed and the groups destroyed. Bounded anyway.
            let deadline = Instant::now() + Duration::from_secs(5);
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

fn task_error(actor: &str, method: impl Into<String>, message: String) -> Msg<Tensor> {
    Msg::Error(Arc::new(TaskError::new(actor, method, message)))
}

/// Whether a failed call may have left the ranks out of step.
fn breaks_group(e: &CommError) -> bool {
    !matches!(
        e,
        CommError::Mismatch { .. }
            | CommError::Uneven { .. }
            | CommError::PeerFailed { .. }
            | CommError::Tensor { .. }
            | CommError::Unsupported { .. }
            | CommError::InvalidPeer { .. }
    )
}

fn fail(comm: &dyn Communicator, e: &CommError, always: bool) {
    if always || breaks_group(e) {
        tracing::warn!(error = %e, "communicator failure: destroying its group");
        let _ = comm.destroy();
    }
}

/// Receive one execution's tensor of an edge: metadata, then data.
fn recv_one(
    reader: &mut Reader<TensorMeta>,
    comm: &dyn Communicator,
    peer: usize,
    actor: &str,
    label: &str,
) -> Result<Msg<Tensor>, ChanError> {
    Ok(match reader.read(None)? {
        Msg::Error(e) => Msg::Error(e),
        Msg::Value(meta) => match comm.recv(&meta.shape, meta.dtype, peer) {
            Ok(t) => Msg::Value(t),
            Err(e) => {
                fail(comm, &e, false);
                task_error(
                    actor,
                    "recv",
                    format!("receiving {label} through the communicator: {e}"),
                )
            }
        },
    })
}

/// The writing end of a communicator edge: its channel (the metadata) and the counters of
/// the edge's statistics, which count the tensor's bytes once for each reader it is sent to.
struct MetaWriter {
    chan: FanOut<TensorMeta>,
    counters: Arc<EndCounters>,
}

/// Send one execution's tensor of an edge: metadata to every reader, then data to each.
fn send_one(
    writer: &mut MetaWriter,
    comm: &dyn Communicator,
    peers: &[usize],
    msg: Msg<Tensor>,
    actor: &str,
    label: &str,
) -> Result<(), ChanError> {
    let t = match msg {
        Msg::Error(e) => return writer.chan.write(Msg::Error(e), None),
        Msg::Value(t) => t,
    };
    if t.device() != comm.device() {
        let e = task_error(
            actor,
            "send",
            format!(
                "the tensor of {label} is on {} but its communicator ({}) moves tensors on {}; move it there first, or use Transport::Shm",
                t.device(),
                comm.transport_name(),
                comm.device()
            ),
        );
        let Msg::Error(e) = e else { unreachable!() };
        return writer.chan.write(Msg::Error(e), None);
    }
    writer.chan.write(
        Msg::Value(TensorMeta {
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
        }),
        None,
    )?;
    for &p in peers {
        if let Err(e) = comm.send(&t, p) {
            // Its reader waits for data that will not come: wake it (and every rank).
            fail(comm, &e, true);
            break;
        }
        // Only this edge's sends write its counters (one thread at a time: the loop's, or
        // the communication thread's with overlap).
        bump(&writer.counters.bytes, t.nbytes() as u64);
    }
    Ok(())
}

/// A tensor that no backend takes, for a rank whose input is an error.
fn poison() -> Tensor {
    Tensor::zeros(vec![0usize; MAX_DIMS + 1], DType::U8)
}

fn permute_chunks(
    t: &Tensor,
    parts: usize,
    from: impl Fn(usize) -> usize,
) -> Result<Tensor, String> {
    let d0 = *t
        .shape()
        .first()
        .ok_or("a 0-dimensional tensor cannot be split")?;
    if d0 % parts != 0 {
        return Err(format!(
            "dimension 0 ({d0}) does not divide into {parts} parts"
        ));
    }
    let p = d0 / parts;
    let chunks: Result<Vec<Tensor>, _> = (0..parts).map(|j| t.narrow(from(j) * p, p)).collect();
    Tensor::cat(&chunks.map_err(|e| e.to_string())?).map_err(|e| e.to_string())
}

/// This rank's part of a collective, in input order (see `dag::collective`).
fn run_collective(
    comm: &dyn Communicator,
    kind: CollectiveKind,
    order: &[usize],
    msg: Msg<Tensor>,
    actor: &str,
) -> Msg<Tensor> {
    let identity = order.iter().enumerate().all(|(i, r)| i == *r);
    let (mut input, mut own_error) = match msg {
        Msg::Value(t) => (t, None),
        Msg::Error(e) => (poison(), Some(Msg::Error(e))),
    };
    if own_error.is_none()
        && !identity
        && let CollectiveKind::ReduceScatter(_) = kind
        && input.shape().first().is_some_and(|d| d % order.len() == 0)
    {
        // Rank order[i] must receive the part that input i's actor expects: part i.
        let mut inv = vec![0; order.len()];
        for (i, r) in order.iter().enumerate() {
            inv[*r] = i;
        }
        match permute_chunks(&input, order.len(), |j| inv[j]) {
            Ok(t) => input = t,
            Err(e) => {
                own_error = Some(task_error(
                    actor,
                    kind.to_string(),
                    format!("cannot reorder the input: {e}"),
                ));
                input = poison();
            }
        }
    }
    let result = match kind {
        CollectiveKind::AllReduce(op) => comm.allreduce(&input, op),
        CollectiveKind::AllGather => comm.allgather(&input),
        CollectiveKind::ReduceScatter(op) => comm.reducescatter(&input, op),
    };
    if let Some(e) = own_error {
        if let Err(ce) = &result {
            fail(comm, ce, false);
        }
        return e;
    }
    match result {
        Ok(t) if !identity && kind == CollectiveKind::AllGather => {
            // Concatenated in rank order: put it in input order.
            match permute_chunks(&t, order.len(), |i| order[i]) {
                Ok(t) => Msg::Value(t),
                Err(e) => task_error(
                    actor,
                    kind.to_string(),
                    format!("cannot reorder the result: {e}"),
                ),
            }
        }
        Ok(t) => Msg::Value(t),
        Err(e) => {
            fail(comm, &e, false);
            task_error(actor, kind.to_string(), e.to_string())
        }
    }
}

fn typed<T: 'static>(slot: Rc<dyn Any>, edge: u64) -> Result<Rc<LocalSlot<T>>, String> {
    slot.downcast::<LocalSlot<T>>().map_err(|_| {
        format!(
            "edge {edge} moves through a communicator, so it must carry a Tensor, not a {}",
            std::any::type_name::<T>()
        )
    })
}

fn check_tensor<T: 'static>(edge: u64) -> Result<(), String> {
    if TypeId::of::<T>() == TypeId::of::<Tensor>() {
        Ok(())
    } else {
        Err(format!(
            "edge {edge} moves through a communicator, so it must carry a Tensor, not a {}",
            std::any::type_name::<T>()
        ))
    }
}

/// The slot of a communicator edge read by this actor, with its receive operation(s).
pub(crate) fn recv_slot<A, T: 'static, B: ScheduleWiring<A>>(
    b: &mut B,
    edge: u64,
) -> Result<Rc<LocalSlot<T>>, String> {
    check_tensor::<T>(edge)?;
    let Some(OpSpec::Recv { group, peer, .. }) = b.comm().specs.get(&Key::Recv(edge)).cloned()
    else {
        return Err(format!(
            "edge {edge} has no receive in this actor's schedule"
        ));
    };
    let plan = b.plan().edge(edge)?;
    let label = plan.label.clone();
    let slot = Rc::new(LocalSlot::<Tensor>::new(label.clone()));
    let comm = b.comm().comm(group)?;
    let mut reader: Reader<TensorMeta> = b.chans().reader(b.plan(), edge, b.me())?;
    let actor = b.actor_name().to_string();
    let stages = b.comm().stages(Key::Recv(edge));
    if stages.contains(&Stage::Inline) {
        let fill = slot.clone();
        b.comm().built.insert(
            (Key::Recv(edge), Stage::Inline),
            Box::new(move |_: &mut A| {
                fill.put(recv_one(&mut reader, &*comm, peer, &actor, &label)?);
                Ok(())
            }),
        );
    } else {
        let jobs = b.comm().jobs(&actor)?;
        let reader = Arc::new(Mutex::new(reader));
        let (done_tx, done_rx) = crossbeam_channel::bounded::<Result<Msg<Tensor>, ChanError>>(2);
        let (actor, label): (Arc<str>, Arc<str>) = (actor.into(), label.into());
        b.comm().built.insert(
            (Key::Recv(edge), Stage::Issue),
            Box::new(move |_: &mut A| {
                let (reader, comm, done, actor, label) = (
                    reader.clone(),
                    comm.clone(),
                    done_tx.clone(),
                    actor.clone(),
                    label.clone(),
                );
                jobs.send(Box::new(move || {
                    let r = recv_one(&mut reader.lock(), &*comm, peer, &actor, &label);
                    let _ = done.send(r);
                }))
                .map_err(|_| ChanError::Closed)
            }),
        );
        let fill = slot.clone();
        b.comm()
            .built
            .insert((Key::Recv(edge), Stage::Wait), wait_op(done_rx, fill));
    }
    b.slots_insert(edge, slot.clone());
    typed::<T>(slot, edge)
}

fn wait_op<A>(
    done: Receiver<Result<Msg<Tensor>, ChanError>>,
    fill: Rc<LocalSlot<Tensor>>,
) -> Op<A> {
    Box::new(move |_: &mut A| {
        let msg = done.recv().map_err(|_| ChanError::Closed)??;
        fill.put(msg);
        Ok(())
    })
}

/// The slot of a tensor this actor computes and sends through a communicator, with its send
/// operation.
pub(crate) fn send_slot<A, T: 'static, B: ScheduleWiring<A>>(
    b: &mut B,
    edge: u64,
) -> Result<Rc<LocalSlot<T>>, String> {
    check_tensor::<T>(edge)?;
    let Some(OpSpec::Send { group, peers, .. }) = b.comm().specs.get(&Key::Send(edge)).cloned()
    else {
        return Err(format!("edge {edge} has no send in this actor's schedule"));
    };
    let plan = b.plan().edge(edge)?;
    let label = plan.label.clone();
    let slot = Rc::new(LocalSlot::<Tensor>::new(label.clone()));
    slot.add_use();
    let comm = b.comm().comm(group)?;
    let (chan, counters) = b
        .chans()
        .writer_counted::<TensorMeta>(b.plan(), edge, b.me())?;
    let mut writer = MetaWriter { chan, counters };
    let actor = b.actor_name().to_string();
    let take = slot.clone();
    let stages = b.comm().stages(Key::Send(edge));
    if stages.contains(&Stage::Inline) {
        b.comm().built.insert(
            (Key::Send(edge), Stage::Inline),
            Box::new(move |_: &mut A| {
                send_one(&mut writer, &*comm, &peers, take.take(), &actor, &label)
            }),
        );
    } else {
        let jobs = b.comm().jobs(&actor)?;
        let writer = Arc::new(Mutex::new(writer));
        let (done_tx, done_rx) = crossbeam_channel::bounded::<Result<(), ChanError>>(2);
        let peers: Arc<[usize]> = peers.into();
        let (actor, label): (Arc<str>, Arc<str>) = (actor.into(), label.into());
        let mut pending = false;
        b.comm().built.insert(
            (Key::Send(edge), Stage::Issue),
            Box::new(move |_: &mut A| {
                let msg = take.take();
                if pending {
                    // The previous execution's send of this edge: done before the next.
                    done_rx.recv().map_err(|_| ChanError::Closed)??;
                }
                let (writer, comm, done, peers, actor, label) = (
                    writer.clone(),
                    comm.clone(),
                    done_tx.clone(),
                    peers.clone(),
                    actor.clone(),
                    label.clone(),
                );
                jobs.send(Box::new(move || {
                    let r = send_one(&mut writer.lock(), &*comm, &peers, msg, &actor, &label);
                    let _ = done.send(r);
                }))
                .map_err(|_| ChanError::Closed)?;
                pending = true;
                Ok(())
            }),
        );
    }
    b.slots_insert(edge, slot.clone());
    typed::<T>(slot, edge)
}

/// This actor's part of a collective (`op` is an `OpSpec::Collective`).
pub(crate) fn build_collective<A>(
    b: &mut impl ScheduleWiring<A>,
    op: &OpSpec,
) -> Result<(), String> {
    let OpSpec::Collective {
        node,
        input,
        kind,
        group,
        order,
        stage,
        ..
    } = op
    else {
        return Err("not a collective".into());
    };
    let (node, kind) = (*node, *kind);
    let inp = b.tensor_slot(*input)?.ok_or_else(|| {
        format!(
            "the input of collective {} is not computed before it on this actor",
            kind
        )
    })?;
    inp.add_use();
    let out = b.tensor_output(node, "collective")?;
    let comm = b.comm().comm(*group)?;
    let order: Arc<[usize]> = order.clone().into();
    let actor = b.actor_name().to_string();
    match stage {
        Stage::Inline => {
            b.comm().built.insert(
                (Key::Coll(node), Stage::Inline),
                Box::new(move |_: &mut A| {
                    out.put(run_collective(&*comm, kind, &order, inp.take(), &actor));
                    Ok(())
                }),
            );
        }
        _ => {
            let jobs = b.comm().jobs(&actor)?;
            let (done_tx, done_rx) =
                crossbeam_channel::bounded::<Result<Msg<Tensor>, ChanError>>(2);
            let actor: Arc<str> = actor.into();
            b.comm().built.insert(
                (Key::Coll(node), Stage::Issue),
                Box::new(move |_: &mut A| {
                    let msg = inp.take();
                    let (comm, order, done, actor) =
                        (comm.clone(), order.clone(), done_tx.clone(), actor.clone());
                    jobs.send(Box::new(move || {
                        let _ = done.send(Ok(run_collective(&*comm, kind, &order, msg, &actor)));
                    }))
                    .map_err(|_| ChanError::Closed)
                }),
            );
            b.comm()
                .built
                .insert((Key::Coll(node), Stage::Wait), wait_op(done_rx, out));
        }
    }
    Ok(())
}

/// Whether `edge` is received (`Recv`) or sent (`Send`) through a communicator by this actor.
pub(crate) fn is_recv<A>(ctx: &CommCtx<A>, edge: u64) -> bool {
    ctx.specs.contains_key(&Key::Recv(edge))
}

/// See [`is_recv`].
pub(crate) fn is_send<A>(ctx: &CommCtx<A>, edge: u64) -> bool {
    ctx.specs.contains_key(&Key::Send(edge))
}

/// In a worker: open the ranks of `tickets` with the descriptors that came with them.
pub(crate) fn open_tickets(
    tickets: Vec<super::wire::CommTicket>,
    fds: Vec<std::os::fd::OwnedFd>,
) -> Result<CommMap, String> {
    crate::comm::register_linked_factories();
    let want: usize = tickets.iter().map(|t| t.fds).sum();
    if want != fds.len() {
        return Err(format!(
            "expected {want} communicator descriptors, got {}",
            fds.len()
        ));
    }
    let mut fds = fds.into_iter();
    let mut out = CommMap::new();
    for t in tickets {
        let these: Vec<_> = fds.by_ref().take(t.fds).collect();
        let c = crate::comm::open_ticket(&t.ticket, these, t.rank).map_err(|e| {
            format!(
                "cannot open rank {} of communicator group {}: {e}",
                t.rank, t.ticket.id
            )
        })?;
        out.insert(t.group, c);
    }
    Ok(out)
}
