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
    LocalGroup, ReduceOp, reduce_tensors,
};
use adag::tensor::{DType, Device};
use adag::{
    ActorHandle, CompileOptions, CustomCommunicator, Dag, DefaultCommunicator, Error, MultiOutput,
    Placement, Runtime, SpawnOptions, Tensor, Transport,
};
use common::with_watchdog;
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
fn crossed_communicator_sends_are_refused_with_the_cycle() {
    with_watchdog("deadlock", SECS, || {
        let rt = Runtime::new().unwrap();
        let s = shards(&rt, Placement::Thread, 2);
        let (a, b) = (&s[0], &s[1]);
        for overlap in [false, true] {
            let dag = Dag::<u64>::new();
            let x = dag.input();
            // A writes t1 to B, then reads t2 from B; B writes t2 to A, then reads t1.
            let t1 = a.make(&x).with_tensor_transport(Transport::communicator());
            let t2 = b.make(&x).with_tensor_transport(Transport::communicator());
            let u = a.total(&t2);
            let v = b.total(&t1);
            let e = compile_err(dag.compile(
                (u, v),
                CompileOptions::default().overlap_gpu_communication(overlap),
            ));
            let text = e.to_string();
            assert!(matches!(e, Error::Compile { .. }), "{text}");
            assert!(
                matches!(&e, Error::Compile { node, .. } if *node == t1.describe()),
                "{text}"
            );
            assert!(
                text.contains("deadlock") && text.contains("cycle"),
                "{text}"
            );
            assert!(
                text.contains(&format!("send {} to s1", t1.describe())),
                "{text}"
            );
            assert!(
                text.contains(&format!("send {} to s0", t2.describe())),
                "{text}"
            );
            // The actors are free again.
            assert_eq!(
                a.call().total(made(0, 1)).unwrap(),
                f32s(&made(0, 1)).iter().map(|v| *v as f64).sum::<f64>()
            );
        }
        // The same exchange bound in a compatible order compiles and runs.
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let t1 = a.make(&x).with_tensor_transport(Transport::communicator());
        let v = b.total(&t1);
        let t2 = b.make(&x).with_tensor_transport(Transport::communicator());
        let u = a.total(&t2);
        let g = dag.compile((u, v), CompileOptions::default()).unwrap();
        let (u, v) = g.execute(1).unwrap();
        assert!(u.get().is_ok() && v.get().is_ok());
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
