//! Tensors over communicators: collectives (allreduce with every op, allgather,
//! reducescatter) between thread and process actors, point-to-point communicator edges,
//! `default_communicator` (create with group reuse, none, a custom one), a custom backend
//! (a slow wrapper of the CPU communicator), overlap of communication with compute, and the
//! compile-time deadlock check. Every test runs under a watchdog.
mod common;

use adag::collective::{allgather, allreduce, allreduce_with, reducescatter};
use adag::comm::cpu::{CpuCommunicator, CpuGroup};
use adag::comm::{
    CommError, CommId, Communicator, CommunicatorFactory, CommunicatorGroup, GroupTicket,
    LocalGroup, ReduceOp, SendCompletion, reduce_tensors,
};
use adag::tensor::{DType, Device};
use adag::{
    ActorHandle, CompileOptions, CustomCommunicator, Dag, DefaultCommunicator, Error, MultiOutput,
    Placement, Runtime, SpawnOptions, Tensor, Transport,
};
use common::{Rng, with_watchdog};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SECS: u64 = 120;

// ---------------------------------------------------------------------------------------
// Test actors
// ---------------------------------------------------------------------------------------

/// A data-parallel shard: makes tensors that depend on its rank and the input.
pub struct Shard {
    rank: u32,
}

/// What `Shard(rank).make(x)` returns: 6 floats, element i = (rank + 1) * (x + i) - 2 i.
fn made(rank: u32, x: u64) -> Tensor {
    Tensor::from(
        (0..6)
            .map(|i| (rank as f32 + 1.0) * (x as f32 + i as f32) - 2.0 * i as f32)
            .collect::<Vec<f32>>(),
    )
}

/// What `Shard(rank).make_i(x)` returns: 6 i32, element i = (rank + 1) * (x + i) - 3.
fn made_i(rank: u32, x: u64) -> Tensor {
    Tensor::from(
        (0..6)
            .map(|i| (rank as i32 + 1) * (x as i32 + i) - 3)
            .collect::<Vec<i32>>(),
    )
}

#[adag::actor]
impl Shard {
    pub fn new(rank: u32) -> Self {
        Shard { rank }
    }

    pub fn make(&mut self, x: u64) -> Tensor {
        made(self.rank, x)
    }

    pub fn make_i(&mut self, x: u64) -> Tensor {
        made_i(self.rank, x)
    }

    /// Like `make`, but fails for x == 7.
    pub fn make_checked(&mut self, x: u64) -> Result<Tensor, String> {
        if x == 7 {
            Err(format!("shard {} refuses 7", self.rank))
        } else {
            Ok(made(self.rank, x))
        }
    }

    /// The sum of a float tensor's elements.
    pub fn total(&mut self, t: Tensor) -> f64 {
        t.as_slice::<f32>().unwrap().iter().map(|v| *v as f64).sum()
    }

    /// Sleeps `ms`, returns x.
    pub fn work(&mut self, x: u64, ms: u64) -> u64 {
        std::thread::sleep(Duration::from_millis(ms));
        x
    }

    /// The sum of `t` plus `w`.
    pub fn combine(&mut self, t: Tensor, w: u64) -> f64 {
        t.as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|v| *v as f64)
            .sum::<f64>()
            + w as f64
    }

    /// `t` doubled.
    pub fn double(&mut self, t: Tensor) -> Tensor {
        Tensor::from(
            t.as_slice::<f32>()
                .unwrap()
                .iter()
                .map(|v| v * 2.0)
                .collect::<Vec<f32>>(),
        )
    }
}

fn shards(rt: &Runtime, p: Placement, n: u32) -> Vec<ActorHandle<Shard>> {
    (0..n)
        .map(|r| {
            rt.spawn_with::<Shard>(p, SpawnOptions::default().name(format!("s{r}")), r)
                .unwrap_or_else(|e| panic!("spawn shard {r} [{p:?}]: {e}"))
        })
        .collect()
}

fn compile_err<T>(r: adag::Result<T>) -> Error {
    match r {
        Ok(_) => panic!("expected a compile error"),
        Err(e) => e,
    }
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.as_slice::<f32>().unwrap().to_vec()
}

// ---------------------------------------------------------------------------------------
// A custom backend: the CPU communicator, slowed down
// ---------------------------------------------------------------------------------------

/// Delays every operation by `delay`, then delegates to an inner communicator: another
/// backend, as far as adag can tell.
#[derive(Debug)]
struct SlowCommunicator {
    inner: Arc<dyn Communicator>,
    delay: Duration,
}

impl Communicator for SlowCommunicator {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn send(&self, t: &Tensor, peer: usize) -> Result<(), CommError> {
        std::thread::sleep(self.delay);
        self.inner.send(t, peer)
    }
    fn recv(&self, shape: &[usize], dtype: DType, peer: usize) -> Result<Tensor, CommError> {
        std::thread::sleep(self.delay);
        self.inner.recv(shape, dtype, peer)
    }
    fn allreduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, CommError> {
        std::thread::sleep(self.delay);
        self.inner.allreduce(t, op)
    }
    fn allgather(&self, t: &Tensor) -> Result<Tensor, CommError> {
        std::thread::sleep(self.delay);
        self.inner.allgather(t)
    }
    fn reducescatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, CommError> {
        std::thread::sleep(self.delay);
        self.inner.reducescatter(t, op)
    }
    fn destroy(&self) -> Result<(), CommError> {
        self.inner.destroy()
    }
    fn transport_name(&self) -> &str {
        "slow-cpu"
    }
    fn comm_id(&self) -> Option<CommId> {
        self.inner.comm_id()
    }
}

/// A slow group for thread actors: one `SlowCommunicator` per rank, in this process.
fn slow_local(n: usize, delay: Duration) -> Arc<dyn CommunicatorGroup> {
    let cpu = CpuGroup::create(n, "slow").unwrap();
    let comms: Vec<Arc<dyn Communicator>> = (0..n)
        .map(|r| {
            Arc::new(SlowCommunicator {
                inner: Arc::new(cpu.communicator(r).unwrap()),
                delay,
            }) as Arc<dyn Communicator>
        })
        .collect();
    Arc::new(LocalGroup::new(comms).unwrap())
}

/// The same backend across processes: a group whose ticket names transport "slow-cpu" and
/// carries the delay; the factory (registered at link time, so workers have it too) opens a
/// CPU rank from the descriptor and wraps it.
#[derive(Debug)]
struct SlowGroup {
    cpu: CpuGroup,
    delay: Duration,
}

impl CommunicatorGroup for SlowGroup {
    fn id(&self) -> CommId {
        self.cpu.id()
    }
    fn world_size(&self) -> usize {
        self.cpu.world_size()
    }
    fn transport_name(&self) -> &str {
        "slow-cpu"
    }
    fn communicator(&self, rank: usize) -> Result<Arc<dyn Communicator>, CommError> {
        Ok(Arc::new(SlowCommunicator {
            inner: Arc::new(self.cpu.communicator(rank)?),
            delay: self.delay,
        }))
    }
    fn ticket(&self) -> Result<GroupTicket, CommError> {
        Ok(GroupTicket {
            id: self.cpu.id(),
            transport: "slow-cpu".into(),
            world_size: self.cpu.world_size(),
            payload: (self.delay.as_millis() as u64).to_le_bytes().to_vec(),
        })
    }
    fn fds(&self) -> Vec<BorrowedFd<'_>> {
        vec![self.cpu.fd()]
    }
    fn destroy(&self) {
        self.cpu.destroy();
    }
}

#[derive(Debug)]
struct SlowFactory;

impl CommunicatorFactory for SlowFactory {
    fn transport_name(&self) -> &str {
        "slow-cpu"
    }
    fn create_group(
        &self,
        world_size: usize,
        label: &str,
    ) -> Result<Arc<dyn CommunicatorGroup>, CommError> {
        Ok(Arc::new(SlowGroup {
            cpu: CpuGroup::create(world_size, label)?,
            delay: Duration::from_millis(1),
        }))
    }
    fn open(
        &self,
        ticket: &GroupTicket,
        fds: Vec<OwnedFd>,
        rank: usize,
    ) -> Result<Arc<dyn Communicator>, CommError> {
        let ms =
            u64::from_le_bytes(
                ticket.payload[..8]
                    .try_into()
                    .map_err(|_| CommError::Config {
                        message: "bad slow-cpu ticket".into(),
                    })?,
            );
        let fd = fds.first().ok_or(CommError::Config {
            message: "no descriptor".into(),
        })?;
        Ok(Arc::new(SlowCommunicator {
            inner: Arc::new(CpuCommunicator::open(fd, rank)?),
            delay: Duration::from_millis(ms),
        }))
    }
}

fn make_slow_factory() -> Arc<dyn CommunicatorFactory> {
    Arc::new(SlowFactory)
}
adag::communicator_factory!(make_slow_factory);

// ---------------------------------------------------------------------------------------
// Collectives
// ---------------------------------------------------------------------------------------

/// allreduce with every op over `n` actors of placement `p`, float and integer tensors.
fn allreduce_every_op(p: Placement, n: u32, overlap: bool) {
    let rt = Runtime::new().unwrap();
    let s = shards(&rt, p, n);
    for op in ReduceOp::ALL {
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let fl: Vec<_> = s.iter().map(|a| a.make(&x)).collect();
        let ints: Vec<_> = s.iter().map(|a| a.make_i(&x)).collect();
        let mut outs = allreduce(&fl, op);
        outs.extend(allreduce(&ints, op));
        let g = dag
            .compile(
                MultiOutput(outs),
                CompileOptions::default().overlap_gpu_communication(overlap),
            )
            .unwrap_or_else(|e| panic!("[{p:?} n={n} {op}] compile: {e}"));
        // Both allreduces use one group: same actor set.
        assert_eq!(g.communicators().len(), 1, "{:?}", g.communicators());
        for x in 1..4u64 {
            let want_f =
                reduce_tensors(&(0..n).map(|r| made(r, x)).collect::<Vec<_>>(), op).unwrap();
            let want_i =
                reduce_tensors(&(0..n).map(|r| made_i(r, x)).collect::<Vec<_>>(), op).unwrap();
            let refs = g.execute(x).unwrap();
            for (i, r) in refs.into_iter().enumerate() {
                let got = r
                    .get()
                    .unwrap_or_else(|e| panic!("[{p:?} n={n} {op} x={x}] get {i}: {e}"));
                let want = if i < n as usize { &want_f } else { &want_i };
                assert_eq!(&got, want, "[{p:?} n={n} {op} x={x}] output {i}");
            }
        }
        g.teardown().unwrap();
    }
}

#[test]
fn allreduce_every_op_two_and_three_threads() {
    with_watchdog("allreduce threads", SECS, || {
        allreduce_every_op(Placement::Thread, 2, false);
        allreduce_every_op(Placement::Thread, 3, false);
    });
}

#[test]
fn allreduce_every_op_two_processes() {
    with_watchdog("allreduce processes", SECS, || {
        allreduce_every_op(Placement::Process, 2, false)
    });
}

#[test]
fn allreduce_overlapped_threads_and_processes() {
    with_watchdog("allreduce overlapped", SECS, || {
        allreduce_every_op(Placement::Thread, 3, true);
        allreduce_every_op(Placement::Process, 2, true);
    });
}

/// allgather and reducescatter, in input order even when it differs from the rank order of
/// the group they share with an allreduce over the same actors.
fn gather_scatter(p: Placement, n: u32) {
    let rt = Runtime::new().unwrap();
    let s = shards(&rt, p, n);
    let dag = Dag::<u64>::new();
    let x = dag.input();
    let inputs: Vec<_> = s.iter().map(|a| a.make(&x)).collect();
    let summed = allreduce(&inputs, ReduceOp::Sum);
    // The same actors in reverse order.
    let rev: Vec<_> = inputs.iter().rev().cloned().collect();
    let gathered = allgather(&rev);
    let scattered = reducescatter(&rev, ReduceOp::Max);
    let n_us = n as usize;
    let mut outs = summed;
    outs.extend(gathered);
    outs.extend(scattered);
    let g = dag
        .compile(MultiOutput(outs), CompileOptions::default())
        .unwrap();
    let infos = g.communicators();
    assert_eq!(infos.len(), 1, "one group for one actor set: {infos:?}");
    assert_eq!(infos[0].users.len(), 3, "{infos:?}");
    assert!(infos[0].created);
    for x in [2u64, 5] {
        let refs = g.execute(x).unwrap();
        let got: Vec<Tensor> = refs.into_iter().map(|r| r.get().unwrap()).collect();
        let all: Vec<Tensor> = (0..n).map(|r| made(r, x)).collect();
        let sum = reduce_tensors(&all, ReduceOp::Sum).unwrap();
        for t in &got[..n_us] {
            assert_eq!(t, &sum);
        }
        // allgather over rev: shard n-1 first.
        let rev_all: Vec<Tensor> = all.iter().rev().cloned().collect();
        let cat = Tensor::cat(&rev_all).unwrap();
        for t in &got[n_us..2 * n_us] {
            assert_eq!(t.shape(), &[6 * n_us]);
            assert_eq!(t, &cat, "[{p:?}] allgather in input order");
        }
        // reducescatter over rev: input i (shard n-1-i) gets part i of the max (6 divides by n).
        let max = reduce_tensors(&all, ReduceOp::Max).unwrap();
        let part = 6 / n_us;
        for (i, t) in got[2 * n_us..].iter().enumerate() {
            assert_eq!(
                f32s(t),
                f32s(&max.narrow(i * part, part).unwrap()),
                "[{p:?}] reducescatter part {i}"
            );
        }
    }
    g.teardown().unwrap();
}

#[test]
fn allgather_and_reducescatter_threads() {
    with_watchdog("gather/scatter threads", SECS, || {
        gather_scatter(Placement::Thread, 2);
        gather_scatter(Placement::Thread, 3);
    });
}

#[test]
fn allgather_and_reducescatter_processes() {
    with_watchdog("gather/scatter processes", SECS, || {
        gather_scatter(Placement::Process, 2)
    });
}

#[test]
fn a_failed_input_fails_every_rank_and_the_next_execution_works() {
    with_watchdog("collective error", SECS, || {
        for p in [Placement::Thread, Placement::Process] {
            let rt = Runtime::new().unwrap();
            let s = shards(&rt, p, 2);
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let a = s[0].make_checked(&x);
            let b = s[1].make(&x);
            let outs = allreduce(&[a, b], ReduceOp::Sum);
            let g = dag
                .compile(MultiOutput(outs), CompileOptions::default())
                .unwrap();
            let mut refs = g.execute(7).unwrap().into_iter();
            // Fast fail (issue 12): every ref of a failed execution carries the first error
            // the driver read, as Ray's `[err] * n`: rank 0's (the root cause) or rank 1's
            // (which names the allreduce), whichever arrived first; the other is not waited
            // for.
            let e0 = refs.next().unwrap().get().unwrap_err().to_string();
            assert!(
                e0.contains("refuses 7") || e0.contains("allreduce"),
                "[{p:?}] {e0}"
            );
            let e1 = refs.next().unwrap().get().unwrap_err().to_string();
            assert_eq!(e1, e0, "[{p:?}] every rank fails with the same error");
            let want = reduce_tensors(&[made(0, 3), made(1, 3)], ReduceOp::Sum).unwrap();
            for r in g.execute(3).unwrap() {
                assert_eq!(r.get().unwrap(), want, "[{p:?}] after the error");
            }
        }
    });
}

#[test]
fn collective_bind_errors_name_the_node() {
    with_watchdog("collective bind errors", SECS, || {
        let rt = Runtime::new().unwrap();
        let s = shards(&rt, Placement::Thread, 2);
        // Two inputs on one actor.
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let outs = allreduce(&[s[0].make(&x), s[0].make_i(&x)], ReduceOp::Sum);
        let e = compile_err(dag.compile(MultiOutput(outs), CompileOptions::default())).to_string();
        assert!(
            e.contains("same actor") && e.contains("allreduce.sum"),
            "{e}"
        );
        // One output unused.
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let outs = allreduce(&[s[0].make(&x), s[1].make(&x)], ReduceOp::Sum);
        let e = compile_err(dag.compile(outs[0].clone(), CompileOptions::default())).to_string();
        assert!(
            e.contains("every actor of a collective must take part"),
            "{e}"
        );
        drop(outs);
        // A custom communicator over other actors.
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let t = s.iter().map(|a| a.make(&x)).collect::<Vec<_>>();
        let other = shards(&rt, Placement::Thread, 1);
        let comm = CustomCommunicator::new(
            Arc::new(CpuGroup::create(2, "x").unwrap()),
            [s[0].core(), other[0].core()],
        )
        .unwrap();
        let outs = allreduce_with(&t, ReduceOp::Sum, comm);
        let e = compile_err(dag.compile(MultiOutput(outs), CompileOptions::default())).to_string();
        assert!(e.contains("same set of actors"), "{e}");
    });
}

// ---------------------------------------------------------------------------------------
// Point-to-point communicator edges
// ---------------------------------------------------------------------------------------

fn p2p(p: Placement, overlap: bool) {
    let rt = Runtime::new().unwrap();
    let s = shards(&rt, p, 2);
    let dag = Dag::<u64>::new();
    let x = dag.input();
    let t = s[0]
        .make(&x)
        .with_tensor_transport(Transport::communicator());
    // The writer's own reader gets it through the slot; the other through the communicator.
    let mine = s[0].total(&t);
    let theirs = s[1].total(&t);
    let doubled = s[1]
        .double(&t)
        .with_tensor_transport(Transport::communicator());
    let back = s[0].total(&doubled);
    let g = dag
        .compile(
            (mine, theirs, back),
            CompileOptions::default().overlap_gpu_communication(overlap),
        )
        .unwrap();
    let infos = g.communicators();
    assert_eq!(infos.len(), 1, "{infos:?}");
    assert_eq!(infos[0].actors, vec!["s0", "s1"]);
    assert_eq!(infos[0].users.len(), 2);
    assert!(g.visualize().contains("communicator"), "{}", g.visualize());
    for x in 0..20u64 {
        let want: f64 = f32s(&made(0, x)).iter().map(|v| *v as f64).sum();
        let (a, b, c) = g.execute(x).unwrap();
        assert_eq!(a.get().unwrap(), want);
        assert_eq!(b.get().unwrap(), want);
        assert_eq!(c.get().unwrap(), 2.0 * want);
    }
    // Pipelined: several in flight.
    let refs: Vec<_> = (0..8u64).map(|x| g.execute(x).unwrap()).collect();
    for (x, (_, b, _)) in refs.into_iter().enumerate() {
        let want: f64 = f32s(&made(0, x as u64)).iter().map(|v| *v as f64).sum();
        assert_eq!(b.get().unwrap(), want);
    }
    g.teardown().unwrap();
    // Each communicator edge counts its messages and the bytes of its tensors (6 f32, sent
    // to its one reader on another actor), besides the few bytes of their metadata.
    let stats = g.stats();
    for method in ["make", "double"] {
        let e = stats
            .edges
            .iter()
            .find(|e| e.label.contains(method))
            .unwrap_or_else(|| panic!("no edge of {method}: {stats:?}"));
        assert_eq!(e.messages, 28, "{e:?}");
        let tensors = 28 * 24;
        assert!(
            e.bytes >= tensors && e.bytes <= tensors + 28 * 32,
            "{method}: {} bytes, not {tensors} of tensors and their metadata: {e:?}",
            e.bytes
        );
    }
}

#[test]
fn p2p_communicator_edge_between_processes() {
    with_watchdog("p2p processes", SECS, || {
        p2p(Placement::Process, false);
        p2p(Placement::Process, true);
    });
}

#[test]
fn p2p_communicator_edge_between_threads() {
    with_watchdog("p2p threads", SECS, || {
        p2p(Placement::Thread, false);
        p2p(Placement::Thread, true);
    });
}

#[test]
fn p2p_error_reaches_the_reader() {
    with_watchdog("p2p error", SECS, || {
        let rt = Runtime::new().unwrap();
        let s = shards(&rt, Placement::Process, 2);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let t = s[0]
            .make_checked(&x)
            .with_tensor_transport(Transport::communicator());
        let g = dag
            .compile(s[1].total(&t), CompileOptions::default())
            .unwrap();
        let e = g.execute(7).unwrap().get().unwrap_err().to_string();
        assert!(e.contains("refuses 7"), "{e}");
        assert!(g.execute(1).unwrap().get().is_ok());
    });
}

#[test]
fn the_driver_cannot_take_part_in_a_communicator() {
    with_watchdog("driver and communicators", SECS, || {
        let rt = Runtime::new().unwrap();
        let s = shards(&rt, Placement::Thread, 1);
        // An input.
        let dag = Dag::<Tensor>::new();
        let x = dag.input();
        x.with_tensor_transport(Transport::communicator());
        let e = compile_err(dag.compile(s[0].total(&*x), CompileOptions::default()));
        assert!(
            matches!(&e, Error::Compile { node, .. } if node == "input"),
            "{e}"
        );
        assert!(e.to_string().contains("driver"), "{e}");
        // An output read by the driver.
        let dag = Dag::<u64>::new();
        let t = s[0]
            .make(dag.input())
            .with_tensor_transport(Transport::communicator());
        let e = compile_err(dag.compile(t.clone(), CompileOptions::default()));
        assert!(
            matches!(&e, Error::Compile { node, .. } if *node == t.describe()),
            "{e}"
        );
        assert!(e.to_string().contains("driver"), "{e}");
        // Auto falls back to shared memory for both, and for CPU actors.
        let dag = Dag::<u64>::new();
        let t = s[0]
            .make(dag.input())
            .with_tensor_transport(Transport::Auto);
        let g = dag.compile(t, CompileOptions::default()).unwrap();
        assert!(g.communicators().is_empty());
        assert_eq!(g.execute(1).unwrap().get().unwrap(), made(0, 1));
    });
}

#[test]
fn auto_picks_a_communicator_between_distinct_cuda_devices_only() {
    with_watchdog("auto transport", SECS, || {
        let rt = Runtime::new().unwrap();
        let spawn = |name: &str, d: Device, r: u32| {
            rt.spawn_with::<Shard>(
                Placement::Thread,
                SpawnOptions::default().name(name).device(d),
                r,
            )
            .unwrap()
        };
        let (a, b) = (
            spawn("gpu0", Device::Cuda(0), 0),
            spawn("gpu1", Device::Cuda(1), 1),
        );
        let c = spawn("cpu", Device::Cpu, 2);
        assert_eq!(a.device(), Device::Cuda(0));
        // The tensors here are CPU tensors: a CPU communicator of our own serves them.
        let comm =
            CustomCommunicator::new(Arc::new(CpuGroup::create(2, "auto").unwrap()), [&a, &b])
                .unwrap();
        let dag = Dag::<u64>::new();
        let t = a.make(dag.input()).with_tensor_transport(Transport::Auto);
        let out = b.total(&t);
        let g = dag
            .compile(
                out,
                CompileOptions::default().default_communicator(DefaultCommunicator::Custom(comm)),
            )
            .unwrap();
        assert_eq!(
            g.communicators().len(),
            1,
            "distinct CUDA devices: a communicator"
        );
        assert!(!g.communicators()[0].created);
        assert_eq!(
            g.execute(2).unwrap().get().unwrap(),
            f32s(&made(0, 2)).iter().map(|v| *v as f64).sum::<f64>()
        );
        g.teardown().unwrap();
        // CUDA to CPU: shared memory.
        let dag = Dag::<u64>::new();
        let t = a.make(dag.input()).with_tensor_transport(Transport::Auto);
        let g = dag.compile(c.total(&t), CompileOptions::default()).unwrap();
        assert!(g.communicators().is_empty());
        g.teardown().unwrap();
        // CUDA to CUDA with Create and no NCCL crate linked: a clear error.
        let dag = Dag::<u64>::new();
        let t = a.make(dag.input()).with_tensor_transport(Transport::Auto);
        let e = compile_err(dag.compile(b.total(&t), CompileOptions::default())).to_string();
        assert!(e.contains("nccl"), "{e}");
    });
}

// ---------------------------------------------------------------------------------------
// default_communicator
// ---------------------------------------------------------------------------------------

#[test]
fn default_communicator_none_is_a_compile_error_naming_the_node() {
    with_watchdog("default none", SECS, || {
        let rt = Runtime::new().unwrap();
        let s = shards(&rt, Placement::Thread, 2);
        let none = || CompileOptions::default().default_communicator(DefaultCommunicator::None);
        let dag = Dag::<u64>::new();
        let t = s[0]
            .make(dag.input())
            .with_tensor_transport(Transport::communicator());
        let e = compile_err(dag.compile(s[1].total(&t), none()));
        assert!(
            matches!(&e, Error::Compile { node, .. } if *node == t.describe()),
            "{e}"
        );
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let outs = allreduce(&[s[0].make(&x), s[1].make(&x)], ReduceOp::Sum);
        let e = compile_err(dag.compile(MultiOutput(outs.clone()), none()));
        assert!(
            matches!(&e, Error::Compile { node, .. } if *node == outs[0].describe()),
            "{e}"
        );
        assert!(e.to_string().contains("None"), "{e}");
        // With its own communicator, None is fine.
        drop(outs);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let comm = CustomCommunicator::new(
            Arc::new(CpuGroup::create(2, "own").unwrap()),
            [&s[0], &s[1]],
        )
        .unwrap();
        let outs = allreduce_with(&[s[0].make(&x), s[1].make(&x)], ReduceOp::Max, comm);
        let g = dag.compile(MultiOutput(outs), none()).unwrap();
        let want = reduce_tensors(&[made(0, 4), made(1, 4)], ReduceOp::Max).unwrap();
        assert_eq!(g.execute(4).unwrap().pop().unwrap().get().unwrap(), want);
    });
}

#[test]
fn create_reuses_groups_for_the_same_set_and_supersets() {
    with_watchdog("group reuse", SECS, || {
        let rt = Runtime::new().unwrap();
        let s = shards(&rt, Placement::Thread, 4);
        let (a, b, c, d) = (&s[0], &s[1], &s[2], &s[3]);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        // Two allreduces over {a, b}, one over {a, b, c}.
        let r1 = allreduce(&[a.make(&x), b.make(&x)], ReduceOp::Sum);
        let r2 = allreduce(&[b.make(&x), a.make(&x)], ReduceOp::Max);
        let r3 = allreduce(&[a.make(&x), b.make(&x), c.make(&x)], ReduceOp::Min);
        // a -> c: inside {a, b, c}. c -> d and d -> b: no superset; they share one new group.
        let ac = a.make(&x).with_tensor_transport(Transport::communicator());
        let cd = c
            .double(&ac)
            .with_tensor_transport(Transport::communicator());
        let db = d
            .double(&cd)
            .with_tensor_transport(Transport::communicator());
        let dag_outs: Vec<_> = vec![
            a.total(&r1[0]),
            b.total(&r1[1]),
            a.total(&r2[1]),
            b.total(&r2[0]),
            a.total(&r3[0]),
            b.total(&r3[1]),
            c.total(&r3[2]),
            b.total(&db),
        ];
        let g = dag
            .compile(MultiOutput(dag_outs), CompileOptions::default())
            .unwrap();
        let infos = g.communicators();
        assert_eq!(infos.len(), 3, "{infos:#?}");
        assert_eq!(infos[0].actors, vec!["s0", "s1"]);
        assert_eq!(
            infos[0].users.len(),
            2,
            "both allreduces over {{a, b}}: {infos:#?}"
        );
        assert_eq!(infos[1].actors, vec!["s0", "s1", "s2"]);
        assert!(
            infos[1].users.contains(&ac.describe()),
            "a -> c reuses the superset {{a, b, c}}: {infos:#?}"
        );
        assert_eq!(infos[2].actors, vec!["s2", "s3", "s1"]);
        assert!(infos[2].users.contains(&cd.describe()) && infos[2].users.contains(&db.describe()));
        assert!(infos.iter().all(|i| i.created && i.transport == "cpu"));
        let dot = g.visualize();
        assert_eq!(dot.matches("shape=component").count(), 3, "{dot}");
        let got: Vec<f64> = g
            .execute(1)
            .unwrap()
            .into_iter()
            .map(|r| r.get().unwrap())
            .collect();
        let total = |t: Tensor| f32s(&t).iter().map(|v| *v as f64).sum::<f64>();
        let sum2 = total(reduce_tensors(&[made(0, 1), made(1, 1)], ReduceOp::Sum).unwrap());
        let max2 = total(reduce_tensors(&[made(1, 1), made(0, 1)], ReduceOp::Max).unwrap());
        let min3 =
            total(reduce_tensors(&[made(0, 1), made(1, 1), made(2, 1)], ReduceOp::Min).unwrap());
        assert_eq!(
            got,
            vec![
                sum2,
                sum2,
                max2,
                max2,
                min3,
                min3,
                min3,
                4.0 * total(made(0, 1))
            ]
        );
    });
}

#[test]
fn a_custom_communicator_is_the_default() {
    with_watchdog("custom default", SECS, || {
        let rt = Runtime::new().unwrap();
        let s = shards(&rt, Placement::Thread, 2);
        let delay = Duration::from_millis(30);
        let comm = CustomCommunicator::new(slow_local(2, delay), [&s[0], &s[1]]).unwrap();
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let outs = allreduce(&[s[0].make(&x), s[1].make(&x)], ReduceOp::Average);
        let t = s[0]
            .double(&outs[0])
            .with_tensor_transport(Transport::communicator());
        let g = dag
            .compile(
                (s[1].total(&outs[1]), s[1].total(&t)),
                CompileOptions::default().default_communicator(DefaultCommunicator::Custom(comm)),
            )
            .unwrap();
        let infos = g.communicators();
        assert_eq!(infos.len(), 1, "{infos:?}");
        assert!(!infos[0].created);
        assert_eq!(infos[0].transport, "slow-cpu");
        assert_eq!(infos[0].users.len(), 2);
        let avg = reduce_tensors(&[made(0, 3), made(1, 3)], ReduceOp::Average).unwrap();
        let total = f32s(&avg).iter().map(|v| *v as f64).sum::<f64>();
        let start = Instant::now();
        let (r1, r2) = g.execute(3).unwrap();
        assert_eq!(r1.get().unwrap(), total);
        assert_eq!(r2.get().unwrap(), 2.0 * total);
        // The allreduce and the send/recv each went through the slow backend.
        assert!(start.elapsed() >= 2 * delay, "{:?}", start.elapsed());
    });
}

#[test]
fn a_custom_backend_across_processes() {
    with_watchdog("custom backend in processes", SECS, || {
        let rt = Runtime::new().unwrap();
        let s = shards(&rt, Placement::Process, 3);
        let group: Arc<dyn CommunicatorGroup> = Arc::new(SlowGroup {
            cpu: CpuGroup::create(3, "slow-procs").unwrap(),
            delay: Duration::from_millis(5),
        });
        let comm = CustomCommunicator::new(group, [&s[0], &s[1], &s[2]]).unwrap();
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let outs = allreduce(
            &s.iter().map(|a| a.make(&x)).collect::<Vec<_>>(),
            ReduceOp::Sum,
        );
        let t = s[2]
            .double(&outs[2])
            .with_tensor_transport(Transport::communicator());
        let g = dag
            .compile(
                (MultiOutput(outs.clone()), s[0].total(&t)),
                CompileOptions::default().default_communicator(DefaultCommunicator::Custom(comm)),
            )
            .unwrap();
        assert_eq!(g.communicators()[0].transport, "slow-cpu");
        for x in 0..5 {
            let want = reduce_tensors(
                &(0..3).map(|r| made(r, x)).collect::<Vec<_>>(),
                ReduceOp::Sum,
            )
            .unwrap();
            let (sums, total) = g.execute(x).unwrap();
            for r in sums {
                assert_eq!(r.get().unwrap(), want);
            }
            assert_eq!(
                total.get().unwrap(),
                2.0 * f32s(&want).iter().map(|v| *v as f64).sum::<f64>()
            );
        }
        // A LocalGroup cannot reach a process actor: said at compile time.
        g.teardown().unwrap();
        let comm =
            CustomCommunicator::new(slow_local(3, Duration::ZERO), [&s[0], &s[1], &s[2]]).unwrap();
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let outs = allreduce_with(
            &s.iter().map(|a| a.make(&x)).collect::<Vec<_>>(),
            ReduceOp::Sum,
            comm,
        );
        let e = compile_err(dag.compile(MultiOutput(outs), CompileOptions::default())).to_string();
        assert!(e.contains("LocalGroup") || e.contains("one process"), "{e}");
    });
}

// ---------------------------------------------------------------------------------------
// Overlap and deadlocks
// ---------------------------------------------------------------------------------------

/// Wall time of `k` executions of: a.make -> (communicator) -> b.combine(t, b.work(x)).
fn pipeline_time(overlap: bool, k: u64, delay: Duration) -> Duration {
    let rt = Runtime::new().unwrap();
    let s = shards(&rt, Placement::Thread, 2);
    let comm = CustomCommunicator::new(slow_local(2, delay), [&s[0], &s[1]]).unwrap();
    let dag = Dag::<u64>::new();
    let x = dag.input();
    let t = s[0]
        .make(&x)
        .with_tensor_transport(Transport::communicator());
    let w = s[1].work(&x, delay.as_millis() as u64);
    let out = s[1].combine(&t, &w);
    let g = dag
        .compile(
            out,
            CompileOptions::default()
                .overlap_gpu_communication(overlap)
                .default_communicator(DefaultCommunicator::Custom(comm)),
        )
        .unwrap();
    if overlap {
        let dot = g.visualize();
        assert!(dot.contains("issue") && dot.contains("wait"), "{dot}");
    }
    // Warm up.
    g.execute(0).unwrap().get().unwrap();
    let start = Instant::now();
    for x in 0..k {
        let want = f32s(&made(0, x)).iter().map(|v| *v as f64).sum::<f64>() + x as f64;
        assert_eq!(g.execute(x).unwrap().get().unwrap(), want);
    }
    let took = start.elapsed();
    g.teardown().unwrap();
    took
}

#[test]
fn overlap_finishes_sooner_with_a_slow_communicator() {
    with_watchdog("overlap", SECS, || {
        let delay = Duration::from_millis(20);
        let plain = pipeline_time(false, 15, delay);
        let overlapped = pipeline_time(true, 15, delay);
        println!("plain {plain:?}, overlapped {overlapped:?}");
        assert!(
            overlapped.as_secs_f64() < 0.85 * plain.as_secs_f64(),
            "overlapped {overlapped:?} vs plain {plain:?}"
        );
    });
}

#[test]
fn a_member_dying_in_a_collective_wakes_the_others() {
    with_watchdog("death in a collective", SECS, || {
        let rt = Runtime::new().unwrap();
        let s = shards(&rt, Placement::Process, 2);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        // s1 works 300 ms before its part: s0 waits in the allreduce meanwhile.
        let slow = s[1].work(&x, 300);
        let outs = allreduce(&[s[0].make(&x), s[1].make(&slow)], ReduceOp::Sum);
        let g = dag
            .compile(MultiOutput(outs), CompileOptions::default())
            .unwrap();
        for r in g.execute(1).unwrap() {
            r.get().unwrap();
        }
        let refs = g.execute(2).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        s[1].kill().unwrap();
        let start = Instant::now();
        for r in refs {
            let e = r.get().unwrap_err();
            assert!(matches!(e, Error::ActorDied { .. }), "{e}");
        }
        let t = Instant::now();
        g.teardown().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "teardown took {:?}",
            t.elapsed()
        );
        // s0 left the collective and takes calls again.
        assert_eq!(s[0].call().make(1).unwrap(), made(0, 1));
    });
}

// ---------------------------------------------------------------------------------------
// Ordering of communicator operations (issue 14): rendezvous and buffered communicators
// ---------------------------------------------------------------------------------------

/// How long a rendezvous send waits for its receive before failing: turns a scheduling bug
/// into an error instead of a hang.
const RDV_TIMEOUT: Duration = Duration::from_secs(15);

/// Receives started, per (sender rank, receiver rank), shared by the ranks of one group.
type Counts = (std::collections::HashMap<(usize, usize), (u64, u64)>, bool);

#[derive(Debug, Default)]
struct RdvState {
    /// Sends and receives started per (sender, receiver); whether the group was destroyed.
    counts: std::sync::Mutex<Counts>,
    cond: std::sync::Condvar,
}

impl RdvState {
    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A rendezvous communicator (NCCL's semantics, without a GPU): the CPU communicator, whose
/// sends are buffered, wrapped so that a send blocks until the peer has started the
/// matching receive. Its group keeps the default `SendCompletion::Rendezvous`.
#[derive(Debug)]
struct RdvCommunicator {
    inner: Arc<dyn Communicator>,
    state: Arc<RdvState>,
}

impl Communicator for RdvCommunicator {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn send(&self, t: &Tensor, peer: usize) -> Result<(), CommError> {
        let me = self.rank();
        let deadline = Instant::now() + RDV_TIMEOUT;
        let mut g = self.state.lock();
        let n = {
            let c = g.0.entry((me, peer)).or_default();
            c.0 += 1;
            c.0
        };
        while g.0[&(me, peer)].1 < n {
            if g.1 {
                return Err(CommError::Config {
                    message: "rendezvous group destroyed".into(),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let (next, timeout) = self
                .state
                .cond
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner());
            g = next;
            if timeout.timed_out() && g.0[&(me, peer)].1 < n {
                return Err(CommError::Config {
                    message: format!(
                        "rendezvous send {n} from rank {me} to rank {peer}: the receive never started"
                    ),
                });
            }
        }
        drop(g);
        self.inner.send(t, peer)
    }
    fn recv(&self, shape: &[usize], dtype: DType, peer: usize) -> Result<Tensor, CommError> {
        {
            let mut g = self.state.lock();
            g.0.entry((peer, self.rank())).or_default().1 += 1;
            self.state.cond.notify_all();
        }
        self.inner.recv(shape, dtype, peer)
    }
    fn allreduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, CommError> {
        self.inner.allreduce(t, op)
    }
    fn allgather(&self, t: &Tensor) -> Result<Tensor, CommError> {
        self.inner.allgather(t)
    }
    fn reducescatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, CommError> {
        self.inner.reducescatter(t, op)
    }
    fn destroy(&self) -> Result<(), CommError> {
        self.state.lock().1 = true;
        self.state.cond.notify_all();
        self.inner.destroy()
    }
    fn transport_name(&self) -> &str {
        "rendezvous-cpu"
    }
    fn comm_id(&self) -> Option<CommId> {
        self.inner.comm_id()
    }
}

/// A rendezvous group of `n` ranks for thread actors.
fn rendezvous_group(n: usize) -> Arc<dyn CommunicatorGroup> {
    let cpu = CpuGroup::with_options(
        n,
        "rendezvous",
        &adag::comm::cpu::CpuGroupOptions {
            timeout: RDV_TIMEOUT,
            ..Default::default()
        },
    )
    .unwrap();
    let state = Arc::new(RdvState::default());
    let comms: Vec<Arc<dyn Communicator>> = (0..n)
        .map(|r| {
            Arc::new(RdvCommunicator {
                inner: Arc::new(cpu.communicator(r).unwrap()),
                state: state.clone(),
            }) as Arc<dyn Communicator>
        })
        .collect();
    let g = LocalGroup::new(comms).unwrap();
    assert_eq!(g.send_completion(), SendCompletion::Rendezvous);
    Arc::new(g)
}

/// Which communicator a test runs on.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Comm {
    /// `rendezvous_group` as the default communicator (thread actors only).
    Rendezvous,
    /// `DefaultCommunicator::Create`: the CPU communicator, buffered.
    Cpu,
}

fn options_for<A: adag::Actor>(
    comm: Comm,
    actors: &[&ActorHandle<A>],
    overlap: bool,
) -> CompileOptions {
    let opts = CompileOptions::default().overlap_gpu_communication(overlap);
    match comm {
        Comm::Cpu => opts,
        Comm::Rendezvous => {
            let c = CustomCommunicator::new(rendezvous_group(actors.len()), actors.iter().copied())
                .unwrap();
            opts.default_communicator(DefaultCommunicator::Custom(c))
        }
    }
}

/// Each actor's schedule from `visualize()`: actor name -> its steps.
fn schedules(dot: &str) -> std::collections::HashMap<String, Vec<String>> {
    let mut out = std::collections::HashMap::new();
    for line in dot.lines() {
        let Some(at) = line.find("label=\"schedule of ") else {
            continue;
        };
        let body = &line[at + "label=\"schedule of ".len()..];
        let body = body.trim_end_matches("\"];").trim_end_matches("\\l");
        let mut parts = body.split("\\l");
        let name = parts.next().unwrap().to_string();
        let steps = parts
            .map(|p| p.split_once(". ").map_or(p, |x| x.1).to_string())
            .collect();
        out.insert(name, steps);
    }
    out
}

/// The position of the first step that is exactly `what`, or a failure showing the schedule.
fn pos(steps: &[String], what: &str) -> usize {
    steps
        .iter()
        .position(|s| s == what)
        .unwrap_or_else(|| panic!("`{what}` not in the schedule {steps:#?}"))
}

/// The node id in a node's description (`s0.make#12`).
fn id_of(describe: &str) -> u64 {
    describe.rsplit('#').next().unwrap().parse().unwrap()
}

fn sum(t: &Tensor) -> f64 {
    f32s(t).iter().map(|v| *v as f64).sum()
}

/// An allreduce between two actors beside a point-to-point communicator edge between the
/// same two actors, the edge's reader binding its use after the allreduce: in bind order a
/// rendezvous send would wait for s1, which waits in the allreduce for s0.
fn allreduce_beside_p2p(p: Placement, comm: Comm, overlap: bool) {
    let rt = Runtime::new().unwrap();
    let s = shards(&rt, p, 2);
    let dag = Dag::<u64>::new();
    let x = dag.input();
    let t = s[0]
        .make(&x)
        .with_tensor_transport(Transport::communicator());
    let m = s[1].make(&x);
    let outs = allreduce(&[t.clone(), m.clone()], ReduceOp::Sum);
    let v = s[1].total(&t);
    let w0 = s[0].total(&outs[0]);
    let w1 = s[1].total(&outs[1]);
    let v_name = v.describe();
    let g = dag
        .compile((v, w0, w1), options_for(comm, &[&s[0], &s[1]], overlap))
        .unwrap_or_else(|e| panic!("{comm:?} {p:?} overlap {overlap}: {e}"));
    let sch = schedules(&g.visualize());
    let s1 = &sch["s1"];
    let recv = s1
        .iter()
        .position(|l| l.starts_with(&format!("recv {} ", t.describe())))
        .unwrap();
    let ar = s1
        .iter()
        .position(|l| l.starts_with(&outs[1].describe()))
        .unwrap();
    if !overlap {
        match comm {
            // The receive meets the send, before s1's own make and the allreduce.
            Comm::Rendezvous => {
                assert_eq!(recv, 0, "{s1:#?}");
            }
            // Buffered: where the tensor is used, after the allreduce.
            Comm::Cpu => assert!(recv > ar, "{s1:#?}"),
        }
        // Computes keep bind order.
        assert!(
            pos(s1, &format!("compute {}", m.describe())) < ar
                && ar < pos(s1, &format!("compute {v_name}")),
            "{s1:#?}"
        );
    }
    for x in 0..4 {
        let (v, w0, w1) = g.execute(x).unwrap();
        let want = sum(&made(0, x)) + sum(&made(1, x));
        assert_eq!(v.get().unwrap(), sum(&made(0, x)));
        assert_eq!(w0.get().unwrap(), want);
        assert_eq!(w1.get().unwrap(), want);
    }
    g.teardown().unwrap();
}

#[test]
fn allreduce_beside_a_p2p_edge_between_the_same_actors() {
    with_watchdog("allreduce beside p2p", SECS, || {
        for overlap in [false, true] {
            allreduce_beside_p2p(Placement::Thread, Comm::Rendezvous, overlap);
            allreduce_beside_p2p(Placement::Thread, Comm::Cpu, overlap);
        }
        allreduce_beside_p2p(Placement::Process, Comm::Cpu, false);
    });
}

/// Crossed sends: s0 sends t1 to s1 and uses t2; s1 sends t2 to s0 and uses t1, each bound
/// make first (Ray's example that deadlocks in bind order with rendezvous sends).
fn crossed(p: Placement, comm: Comm, overlap: bool) {
    let rt = Runtime::new().unwrap();
    let s = shards(&rt, p, 2);
    let dag = Dag::<u64>::new();
    let x = dag.input();
    let t1 = s[0]
        .make(&x)
        .with_tensor_transport(Transport::communicator());
    let t2 = s[1]
        .make(&x)
        .with_tensor_transport(Transport::communicator());
    let u = s[0].total(&t2);
    let v = s[1].total(&t1);
    let g = dag
        .compile((u, v), options_for(comm, &[&s[0], &s[1]], overlap))
        .unwrap_or_else(|e| panic!("{comm:?} {p:?} overlap {overlap}: {e}"));
    let sch = schedules(&g.visualize());
    if !overlap {
        let recv_t1 = pos(
            &sch["s1"],
            &format!("recv {} (communicator)", t1.describe()),
        );
        let make_t2 = pos(&sch["s1"], &format!("compute {}", t2.describe()));
        match comm {
            Comm::Rendezvous => assert!(recv_t1 < make_t2, "{:#?}", sch["s1"]),
            Comm::Cpu => assert!(recv_t1 > make_t2, "{:#?}", sch["s1"]),
        }
    }
    for x in 0..4 {
        let (u, v) = g.execute(x).unwrap();
        assert_eq!(u.get().unwrap(), sum(&made(1, x)));
        assert_eq!(v.get().unwrap(), sum(&made(0, x)));
    }
    g.teardown().unwrap();
}

#[test]
fn crossed_communicator_sends_compile_and_run() {
    with_watchdog("crossed sends", SECS, || {
        for overlap in [false, true] {
            crossed(Placement::Thread, Comm::Rendezvous, overlap);
            crossed(Placement::Thread, Comm::Cpu, overlap);
            crossed(Placement::Process, Comm::Cpu, overlap);
        }
    });
}

/// A pipeline stage: forward `t * (rank + 2) + 1`, backward `g * (rank + 2)`; it records
/// the order in which its computes ran.
pub struct Stage {
    rank: u32,
    log: Vec<String>,
}

fn scale(t: &Tensor, k: f32, b: f32) -> Tensor {
    Tensor::from(f32s(t).iter().map(|v| v * k + b).collect::<Vec<f32>>())
}

#[adag::actor]
impl Stage {
    pub fn new(rank: u32) -> Self {
        Stage {
            rank,
            log: Vec::new(),
        }
    }

    /// Stage 0's forward of micro-batch `mb` of input `x`.
    pub fn first(&mut self, x: u64, mb: u64) -> Tensor {
        self.log.push(format!("F{mb}"));
        let t = Tensor::from((0..4).map(|i| (x + mb + i) as f32).collect::<Vec<f32>>());
        scale(&t, self.rank as f32 + 2.0, 1.0)
    }

    pub fn fwd(&mut self, t: Tensor, mb: u64) -> Tensor {
        self.log.push(format!("F{mb}"));
        scale(&t, self.rank as f32 + 2.0, 1.0)
    }

    /// The last stage's backward: the loss gradient of its own forward.
    pub fn loss(&mut self, t: Tensor, mb: u64) -> Tensor {
        self.log.push(format!("B{mb}"));
        scale(&t, 1.0, -1.0)
    }

    pub fn bwd(&mut self, g: Tensor, mb: u64) -> Tensor {
        self.log.push(format!("B{mb}"));
        scale(&g, self.rank as f32 + 2.0, 0.0)
    }

    /// Stage 0's backward: the micro-batch's result.
    pub fn done(&mut self, g: Tensor, mb: u64) -> f64 {
        self.log.push(format!("B{mb}"));
        sum(&scale(&g, self.rank as f32 + 2.0, 0.0))
    }

    pub fn log(&mut self) -> Vec<String> {
        std::mem::take(&mut self.log)
    }
}

/// What a `stages`-stage pipeline returns for micro-batch `mb` of input `x`.
fn pipeline_reference(stages: u32, x: u64, mb: u64) -> f64 {
    let mut t: Vec<f32> = (0..4).map(|i| (x + mb + i) as f32).collect();
    for r in 0..stages {
        t = t.iter().map(|v| v * (r as f32 + 2.0) + 1.0).collect();
    }
    let mut g: Vec<f32> = t.iter().map(|v| v - 1.0).collect();
    for r in (0..stages - 1).rev() {
        g = g.iter().map(|v| v * (r as f32 + 2.0)).collect();
    }
    g.iter().map(|v| *v as f64).sum()
}

/// A 1F1B pipeline bound the way a training loop would: each stage's own order is
/// `stages - rank - 1` warm-up forwards, then one forward and one backward in turn, then the
/// remaining backwards; the stages bind round-robin, each its next task once its input
/// exists. Returns the graph's outputs (one per micro-batch), each stage's bind order, and
/// the description of every node as (stage, "F3"/"B3").
#[allow(clippy::type_complexity)]
fn one_f_one_b(
    dag: &Dag<u64>,
    st: &[ActorHandle<Stage>],
    mbs: u64,
) -> (
    Vec<adag::Node<f64>>,
    Vec<Vec<String>>,
    std::collections::HashMap<String, (usize, String)>,
) {
    let n = st.len();
    let x = dag.input();
    let comm = || Transport::communicator();
    let mut order: Vec<Vec<(bool, u64)>> = (0..n)
        .map(|r| {
            let warm = ((n - r - 1) as u64).min(mbs);
            let mut o: Vec<(bool, u64)> = (0..warm).map(|m| (true, m)).collect();
            for i in 0..mbs - warm {
                o.push((true, warm + i));
                o.push((false, i));
            }
            o.extend((mbs - warm..mbs).map(|m| (false, m)));
            o
        })
        .collect();
    for o in &mut order {
        o.reverse();
    }
    let mut act: Vec<Vec<Option<adag::Node<Tensor>>>> = vec![vec![None; mbs as usize]; n];
    let mut grad: Vec<Vec<Option<adag::Node<Tensor>>>> = vec![vec![None; mbs as usize]; n];
    let mut outs: Vec<Option<adag::Node<f64>>> = vec![None; mbs as usize];
    let mut bound: Vec<Vec<String>> = vec![Vec::new(); n];
    let mut names = std::collections::HashMap::new();
    while order.iter().any(|o| !o.is_empty()) {
        for r in 0..n {
            let Some(&(fwd, mb)) = order[r].last() else {
                continue;
            };
            let m = mb as usize;
            let desc = if fwd {
                let node = if r == 0 {
                    st[r].first(&x, mb)
                } else if let Some(a) = &act[r - 1][m] {
                    st[r].fwd(a, mb)
                } else {
                    continue;
                };
                let node = if r + 1 < n {
                    node.with_tensor_transport(comm())
                } else {
                    node
                };
                let d = node.describe();
                act[r][m] = Some(node);
                d
            } else {
                let Some(g) = (if r + 1 == n {
                    act[r][m].clone()
                } else {
                    grad[r + 1][m].clone()
                }) else {
                    continue;
                };
                if r == 0 {
                    let o = st[r].done(&g, mb);
                    let d = o.describe();
                    outs[m] = Some(o);
                    d
                } else {
                    let node = if r + 1 == n {
                        st[r].loss(&g, mb)
                    } else {
                        st[r].bwd(&g, mb)
                    }
                    .with_tensor_transport(comm());
                    let d = node.describe();
                    grad[r][m] = Some(node);
                    d
                }
            };
            let what = format!("{}{mb}", if fwd { "F" } else { "B" });
            names.insert(desc, (r, what.clone()));
            bound[r].push(what);
            order[r].pop();
        }
    }
    (outs.into_iter().map(Option::unwrap).collect(), bound, names)
}

/// One stage's schedule in short form: `F3`/`B3` for a compute, `recv F3`/`send B3` for a
/// communicator operation on that task's tensor (`issue`/`wait` appended with overlap).
fn short_schedule(
    steps: &[String],
    names: &std::collections::HashMap<String, (usize, String)>,
) -> Vec<String> {
    steps
        .iter()
        .map(|s| {
            let (verb, rest) = s.split_once(' ').unwrap();
            let node = rest.split(' ').next().unwrap();
            let short = names.get(node).map_or(node.to_string(), |n| n.1.clone());
            let stage = if s.contains("issue") {
                " issue"
            } else if s.contains("wait") {
                " wait"
            } else {
                ""
            };
            match verb {
                "compute" => short,
                _ => format!("{verb} {short}{stage}"),
            }
        })
        .collect()
}

fn run_1f1b(p: Placement, comm: Comm, stages: usize, mbs: u64, overlap: bool) {
    let what =
        format!("1F1B {stages} stages, {mbs} micro-batches, {comm:?}, {p:?}, overlap {overlap}");
    let rt = Runtime::new().unwrap();
    let st: Vec<ActorHandle<Stage>> = (0..stages)
        .map(|r| {
            rt.spawn_with::<Stage>(p, SpawnOptions::default().name(format!("st{r}")), r as u32)
                .unwrap()
        })
        .collect();
    let dag = Dag::<u64>::new();
    let (outs, bound, names) = one_f_one_b(&dag, &st, mbs);
    let refs: Vec<&ActorHandle<Stage>> = st.iter().collect();
    let g = dag
        .compile(MultiOutput(outs), options_for(comm, &refs, overlap))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let dot = g.visualize();
    let sch = schedules(&dot);
    let short: Vec<Vec<String>> = (0..stages)
        .map(|r| short_schedule(&sch[&format!("st{r}")], &names))
        .collect();
    for r in 0..stages {
        let s = &short[r];
        // Computes in bind order.
        let computes: Vec<&String> = s.iter().filter(|l| !l.contains(' ')).collect();
        assert_eq!(
            computes,
            bound[r].iter().collect::<Vec<_>>(),
            "{what}: st{r} {s:#?}"
        );
        // What r receives from a neighbour, it receives in the order the neighbour sent it.
        for (from, kind) in [(r.wrapping_sub(1), "F"), (r + 1, "B")] {
            if from >= stages {
                continue;
            }
            let sent: Vec<String> = short[from]
                .iter()
                .filter(|l| l.starts_with(&format!("send {kind}")) && !l.ends_with("wait"))
                .map(|l| l.trim_end_matches(" issue")[5..].to_string())
                .collect();
            let got: Vec<String> = s
                .iter()
                .filter(|l| l.starts_with(&format!("recv {kind}")) && !l.ends_with("wait"))
                .map(|l| l.trim_end_matches(" issue")[5..].to_string())
                .collect();
            assert_eq!(sent, got, "{what}: st{from} -> st{r}");
        }
        if overlap {
            continue;
        }
        // Where each receive is.
        for (i, l) in s.iter().enumerate() {
            let Some(t) = l.strip_prefix("recv ") else {
                continue;
            };
            let next = s[i + 1..].iter().find(|l| !l.starts_with("recv ")).unwrap();
            let (kind, mb) = t.split_at(1);
            let consumer = format!("{}{mb}", kind);
            match comm {
                // Buffered: right before the task that uses it.
                Comm::Cpu => assert_eq!(*next, consumer, "{what}: st{r} {s:#?}"),
                // Rendezvous: where its sender sends it. Every compute before the receive was
                // bound before the sending task, every one after it later.
                Comm::Rendezvous => {
                    let sender = names
                        .iter()
                        .find(|(_, v)| v.1 == t && v.0 == if kind == "F" { r - 1 } else { r + 1 })
                        .map(|(k, _)| id_of(k))
                        .unwrap();
                    let id = |c: &String| {
                        names
                            .iter()
                            .find(|(_, v)| v.0 == r && &v.1 == c)
                            .map(|(k, _)| id_of(k))
                            .unwrap()
                    };
                    for c in s[..i].iter().filter(|l| !l.contains(' ')) {
                        assert!(id(c) < sender, "{what}: st{r} {c} before recv {t}: {s:#?}");
                    }
                    for c in s[i..].iter().filter(|l| !l.contains(' ')) {
                        assert!(id(c) > sender, "{what}: st{r} {c} after recv {t}: {s:#?}");
                    }
                }
            }
        }
    }
    if stages == 2 && mbs == 4 && !overlap {
        // The whole schedule of the last stage (its own order is F0 B0 F1 B1 ...).
        let want: &[&str] = match comm {
            Comm::Rendezvous => &[
                "recv F0", "F0", "recv F1", "B0", "send B0", "F1", "recv F2", "B1", "send B1",
                "F2", "recv F3", "B2", "send B2", "F3", "B3", "send B3",
            ],
            Comm::Cpu => &[
                "recv F0", "F0", "B0", "send B0", "recv F1", "F1", "B1", "send B1", "recv F2",
                "F2", "B2", "send B2", "recv F3", "F3", "B3", "send B3",
            ],
        };
        assert_eq!(short[1], want, "{what}");
    }
    let runs = 3;
    for x in 0..runs {
        let got: Vec<f64> = g
            .execute(x)
            .unwrap()
            .into_iter()
            .map(|r| r.get().unwrap())
            .collect();
        let want: Vec<f64> = (0..mbs)
            .map(|mb| pipeline_reference(stages as u32, x, mb))
            .collect();
        assert_eq!(got, want, "{what}, input {x}");
    }
    g.teardown().unwrap();
    // The actors ran their tasks in bind order, execution after execution.
    for (r, s) in st.iter().enumerate() {
        let log = s.call().log().unwrap();
        let want: Vec<String> = (0..runs).flat_map(|_| bound[r].iter().cloned()).collect();
        assert_eq!(log, want, "{what}: st{r}");
    }
    if stages == 2 && mbs == 4 && p == Placement::Thread && !overlap && comm == Comm::Rendezvous {
        // For docs/communicators.md: ADAG_WRITE_1F1B_DOT=path writes this graph's DOT there.
        if let Ok(path) = std::env::var("ADAG_WRITE_1F1B_DOT") {
            std::fs::write(path, &dot).unwrap();
        }
    }
}

#[test]
fn one_f_one_b_on_a_rendezvous_communicator() {
    with_watchdog("1F1B rendezvous", 300, || {
        for (stages, mbs) in [(2, 4), (2, 8), (4, 4), (4, 8)] {
            run_1f1b(Placement::Thread, Comm::Rendezvous, stages, mbs, false);
        }
        run_1f1b(Placement::Thread, Comm::Rendezvous, 2, 4, true);
        run_1f1b(Placement::Thread, Comm::Rendezvous, 4, 8, true);
    });
}

#[test]
fn one_f_one_b_on_the_cpu_communicator() {
    with_watchdog("1F1B cpu", 300, || {
        for (stages, mbs) in [(2, 4), (2, 8), (4, 4), (4, 8)] {
            run_1f1b(Placement::Thread, Comm::Cpu, stages, mbs, false);
            run_1f1b(Placement::Process, Comm::Cpu, stages, mbs, false);
        }
        run_1f1b(Placement::Thread, Comm::Cpu, 4, 8, true);
        run_1f1b(Placement::Process, Comm::Cpu, 2, 4, true);
    });
}

// ---------------------------------------------------------------------------------------
// Random graphs of communicator operations against a reference interpreter
// ---------------------------------------------------------------------------------------

/// One tensor of a random graph: its node, its actor, and how to compute it.
struct RandTensor {
    node: adag::Node<Tensor>,
    actor: usize,
    eval: Box<dyn Fn(u64) -> Vec<f32>>,
    used: bool,
}

/// Builds a random graph over `s`: tensors made from the input, doubled on another actor
/// (a communicator edge, often crossing another one the other way), allreduces over every
/// actor, and one `total` output for each tensor that nothing else reads. Returns the
/// outputs and, for each, its reference value as a function of the input.
#[allow(clippy::type_complexity)]
fn random_graph(
    rng: &mut Rng,
    dag: &Dag<u64>,
    s: &[ActorHandle<Shard>],
) -> (Vec<adag::Node<f64>>, Vec<Box<dyn Fn(u64) -> f64>>) {
    let x = dag.input();
    let n = s.len();
    let comm = Transport::communicator;
    let mut ts: Vec<RandTensor> = Vec::new();
    let steps = 3 + rng.below(8);
    for _ in 0..steps {
        match rng.below(4) {
            0 => {
                let a = rng.below(n as u64) as usize;
                let r = a as u32;
                ts.push(RandTensor {
                    node: s[a].make(&x).with_tensor_transport(comm()),
                    actor: a,
                    eval: Box::new(move |x| f32s(&made(r, x))),
                    used: false,
                });
            }
            1 | 2 if !ts.is_empty() => {
                // Double a tensor on another actor; sometimes its own actor doubles one of
                // the new actor's tensors too (crossed edges).
                let pick = rng.below(ts.len() as u64) as usize;
                let from = ts[pick].actor;
                let to = (from + 1 + rng.below(n as u64 - 1) as usize) % n;
                let cross = ts.iter().rposition(|t| t.actor == to);
                for (src, dst) in [(Some(pick), to), (cross, from)] {
                    let Some(src) = src else { continue };
                    if src == pick && dst == from {
                        continue;
                    }
                    ts[src].used = true;
                    let node = s[dst].double(&ts[src].node).with_tensor_transport(comm());
                    let f = std::rc::Rc::new(std::mem::replace(
                        &mut ts[src].eval,
                        Box::new(|_| Vec::new()),
                    ));
                    let g = f.clone();
                    ts[src].eval = Box::new(move |x| f(x));
                    ts.push(RandTensor {
                        node,
                        actor: dst,
                        eval: Box::new(move |x| g(x).iter().map(|v| v * 2.0).collect()),
                        used: false,
                    });
                    if rng.below(2) == 0 {
                        break;
                    }
                }
            }
            _ => {
                // An allreduce over every actor, of each actor's latest tensor.
                let mut inputs = Vec::new();
                for (a, actor) in s.iter().enumerate() {
                    let i = match ts.iter().rposition(|t| t.actor == a) {
                        Some(i) => i,
                        None => {
                            let r = a as u32;
                            ts.push(RandTensor {
                                node: actor.make(&x).with_tensor_transport(comm()),
                                actor: a,
                                eval: Box::new(move |x| f32s(&made(r, x))),
                                used: false,
                            });
                            ts.len() - 1
                        }
                    };
                    ts[i].used = true;
                    inputs.push(i);
                }
                let nodes: Vec<adag::Node<Tensor>> =
                    inputs.iter().map(|&i| ts[i].node.clone()).collect();
                let evals: Vec<std::rc::Rc<Box<dyn Fn(u64) -> Vec<f32>>>> = inputs
                    .iter()
                    .map(|&i| {
                        let f = std::rc::Rc::new(std::mem::replace(
                            &mut ts[i].eval,
                            Box::new(|_| Vec::new()),
                        ));
                        let g = f.clone();
                        ts[i].eval = Box::new(move |x| f(x));
                        g
                    })
                    .collect();
                let sum_of = std::rc::Rc::new(move |x: u64| {
                    let parts: Vec<Vec<f32>> = evals.iter().map(|f| f(x)).collect();
                    (0..parts[0].len())
                        .map(|k| parts.iter().map(|p| p[k]).sum::<f32>())
                        .collect::<Vec<f32>>()
                });
                for (a, out) in allreduce(&nodes, ReduceOp::Sum).into_iter().enumerate() {
                    let f = sum_of.clone();
                    ts.push(RandTensor {
                        node: out.with_tensor_transport(comm()),
                        actor: a,
                        eval: Box::new(move |x| f(x)),
                        used: false,
                    });
                }
            }
        }
    }
    let mut outs = Vec::new();
    let mut want: Vec<Box<dyn Fn(u64) -> f64>> = Vec::new();
    for t in ts.into_iter().filter(|t| !t.used) {
        outs.push(s[t.actor].total(&t.node));
        let f = t.eval;
        want.push(Box::new(move |x| f(x).iter().map(|v| *v as f64).sum()));
    }
    (outs, want)
}

fn random_graphs(p: Placement, comm: Comm, n_graphs: u64) {
    let seed: u64 = std::env::var("ADAG_COMM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
        .max(1);
    eprintln!("random communicator graphs {comm:?} {p:?}: seed {seed} (ADAG_COMM_SEED replays)");
    let mut rng = Rng(seed);
    let rt = Runtime::new().unwrap();
    let s = shards(&rt, p, 3);
    let mut refused = 0;
    for i in 0..n_graphs {
        let n = 2 + rng.below(2) as usize;
        let s = &s[..n];
        let dag = Dag::<u64>::new();
        let (outs, want) = random_graph(&mut rng, &dag, s);
        let overlap = rng.below(2) == 1;
        let refs: Vec<&ActorHandle<Shard>> = s.iter().collect();
        let what = format!("seed {seed}, graph {i} ({n} actors, overlap {overlap})");
        let g = match dag.compile(MultiOutput(outs), options_for(comm, &refs, overlap)) {
            Ok(g) => g,
            Err(e) => {
                // Refused only as a deadlock, naming the cycle.
                let text = e.to_string();
                assert!(
                    matches!(e, Error::Compile { .. }) && text.contains("cycle"),
                    "{what}: {text}"
                );
                refused += 1;
                continue;
            }
        };
        for x in 0..3 {
            let got: Vec<f64> = g
                .execute(x)
                .unwrap()
                .into_iter()
                .map(|r| r.get().unwrap_or_else(|e| panic!("{what}: {e}")))
                .collect();
            let expect: Vec<f64> = want.iter().map(|f| f(x)).collect();
            assert_eq!(got, expect, "{what}, input {x}\n{}", g.visualize());
        }
        g.teardown().unwrap();
    }
    // The derived order never deadlocks: every operation waits only on operations earlier in
    // one global order of the graph (order.rs), so nothing should be refused at all.
    assert_eq!(
        refused, 0,
        "seed {seed}: {refused} of {n_graphs} graphs refused"
    );
}

#[test]
fn random_communicator_graphs_match_the_reference() {
    with_watchdog("random communicator graphs", 300, || {
        random_graphs(Placement::Thread, Comm::Rendezvous, 40);
        random_graphs(Placement::Thread, Comm::Cpu, 40);
        random_graphs(Placement::Process, Comm::Cpu, 8);
    });
}
