//! The 1F1B pipeline of `tests/collectives.rs` (2 stages, 4 micro-batches) on the NCCL
//! communicator: activations and gradients move between thread actors on CUDA devices with
//! `DefaultCommunicator::Create`, which picks NCCL, whose sends are rendezvous; the compiler
//! must order every receive to meet its send. `#[ignore]`d: run by `scripts/gpu/run.sh` on a
//! GPU machine with NCCL. With one GPU both stages share device 0, which NCCL may refuse
//! ("duplicate GPU"): the test then says so and passes without running the pipeline.
use adag::cluster::{ClusterOptions, LocalHosts};
use adag::tensor::{Device, Tensor};
use adag::{CompileOptions, Dag, MultiOutput, Placement, Runtime, SpawnOptions, Transport};
use std::time::Duration;

/// A stage on a CUDA device: forward `t * (rank + 2) + 1`, backward `g * (rank + 2)`.
pub struct GpuStage {
    rank: u32,
    device: u32,
}

fn host(t: &Tensor) -> Vec<f32> {
    adag_cuda::to_host(t)
        .unwrap()
        .as_slice::<f32>()
        .unwrap()
        .to_vec()
}

impl GpuStage {
    fn on_device(&self, v: Vec<f32>) -> Tensor {
        adag_cuda::to_device(&Tensor::from(v), self.device).unwrap()
    }
    fn k(&self) -> f32 {
        self.rank as f32 + 2.0
    }
}

#[adag::actor]
impl GpuStage {
    pub fn new(rank: u32, device: u32) -> Self {
        // In a worker process (an actor on another host) the NCCL factory is registered here.
        adag_cuda::register();
        GpuStage { rank, device }
    }
    pub fn first(&mut self, x: u64, mb: u64) -> Tensor {
        let k = self.k();
        self.on_device((0..4).map(|i| (x + mb + i) as f32 * k + 1.0).collect())
    }
    pub fn fwd(&mut self, t: Tensor, mb: u64) -> Tensor {
        let _ = mb;
        let k = self.k();
        self.on_device(host(&t).iter().map(|v| v * k + 1.0).collect())
    }
    pub fn loss(&mut self, t: Tensor, mb: u64) -> Tensor {
        let _ = mb;
        self.on_device(host(&t).iter().map(|v| v - 1.0).collect())
    }
    pub fn done(&mut self, g: Tensor, mb: u64) -> f64 {
        let _ = mb;
        let k = self.k();
        host(&g).iter().map(|v| (v * k) as f64).sum()
    }
}

fn reference(x: u64, mb: u64) -> f64 {
    let t: Vec<f32> = (0..4)
        .map(|i| ((x + mb + i) as f32 * 2.0 + 1.0) * 3.0 + 1.0)
        .collect();
    t.iter().map(|v| ((v - 1.0) * 2.0) as f64).sum()
}

/// How many GPUs there are, once CUDA and NCCL are checked and NCCL's factory registered.
fn gpus_with_nccl() -> u32 {
    adag_cuda::check_cuda().expect("this test needs CUDA");
    adag_cuda::check_nccl().expect("this test needs NCCL");
    adag_cuda::register();
    adag_cuda::device_count().unwrap() as u32
}

/// Stages 0 and 1, named `{prefix}0` and `{prefix}1`, on devices 0 and 1 (both on 0 with one
/// GPU), placed by `place(rank)`.
fn two_stages(
    rt: &Runtime,
    gpus: u32,
    prefix: &str,
    place: impl Fn(usize) -> Placement,
) -> Vec<adag::ActorHandle<GpuStage>> {
    (0..2u32)
        .map(|r| {
            let dev = r % gpus;
            rt.spawn_with::<GpuStage>(
                place(r as usize),
                SpawnOptions::default()
                    .name(format!("{prefix}{r}"))
                    .device(Device::Cuda(dev)),
                (r, dev),
            )
            .unwrap()
        })
        .collect()
}

#[test]
#[ignore = "needs GPUs and NCCL: run scripts/gpu/run.sh"]
fn gpu_nccl_1f1b_pipeline() {
    let gpus = gpus_with_nccl();
    let rt = Runtime::new().unwrap();
    let st = two_stages(&rt, gpus, "st", |_| Placement::Thread);
    let dag = Dag::<u64>::new();
    let x = dag.input();
    let comm = Transport::communicator;
    // Bound in the round-robin 1F1B order of tests/collectives.rs: st0 F0 | st1 F0 | st0 F1 |
    // st1 B0 | st0 B0 | st1 F1 | ...
    let mbs = 4;
    let a: Vec<_> = (0..mbs)
        .map(|_| None)
        .collect::<Vec<Option<adag::Node<Tensor>>>>();
    let mut act0 = a.clone();
    let mut act1 = a.clone();
    let mut grad1 = a;
    let mut outs: Vec<Option<adag::Node<f64>>> = vec![None; mbs as usize];
    act0[0] = Some(st[0].first(&x, 0).with_tensor_transport(comm()));
    act1[0] = Some(st[1].fwd(act0[0].as_ref().unwrap(), 0));
    for mb in 0..mbs as usize {
        if mb + 1 < mbs as usize {
            act0[mb + 1] = Some(st[0].first(&x, mb as u64 + 1).with_tensor_transport(comm()));
        }
        grad1[mb] = Some(
            st[1]
                .loss(act1[mb].as_ref().unwrap(), mb as u64)
                .with_tensor_transport(comm()),
        );
        outs[mb] = Some(st[0].done(grad1[mb].as_ref().unwrap(), mb as u64));
        if mb + 1 < mbs as usize {
            act1[mb + 1] = Some(st[1].fwd(act0[mb + 1].as_ref().unwrap(), mb as u64 + 1));
        }
    }
    let outs: Vec<_> = outs.into_iter().map(Option::unwrap).collect();
    let g = match dag.compile(MultiOutput(outs), CompileOptions::default()) {
        Ok(g) => g,
        Err(e) if gpus < 2 => {
            eprintln!("SKIPPED: one GPU, and NCCL would not put two ranks on it: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let infos = g.communicators();
    assert!(infos.iter().all(|c| c.transport == "nccl"), "{infos:?}");
    eprintln!("{}", g.visualize());
    for x in 0..3 {
        let refs = match g.execute(x) {
            Ok(r) => r,
            Err(e) if gpus < 2 => {
                eprintln!("SKIPPED: one GPU: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let got: Result<Vec<f64>, _> = refs.into_iter().map(|r| r.get()).collect();
        let got = match got {
            Ok(v) => v,
            Err(e) if gpus < 2 => {
                eprintln!("SKIPPED: one GPU, and NCCL would not put two ranks on it: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let want: Vec<f64> = (0..mbs).map(|mb| reference(x, mb)).collect();
        assert_eq!(got, want, "input {x}");
    }
    g.teardown().unwrap();
}

/// An NCCL tensor edge between actors on two hosts (separate process trees joined over
/// loopback): the group's NCCL unique id reaches the remote rank through the driver, with its
/// host's part of the graph, and the two ranks form one communicator. With one GPU both ranks
/// are on device 0, which NCCL refuses only after its ranks met through that unique id
/// ("Duplicate GPU"): the test then says so and passes, that refusal being the evidence that
/// the remote rank joined.
#[test]
#[ignore = "needs GPUs and NCCL: run scripts/gpu/run.sh"]
fn gpu_nccl_across_hosts() {
    let gpus = gpus_with_nccl();
    let rt = Runtime::new().unwrap();
    let secret = "gpu-nccl-across-hosts";
    let addr = rt.listen(ClusterOptions::new(secret)).unwrap();
    let _hosts = LocalHosts::start(2, addr, secret).unwrap();
    let mut hosts = rt.wait_for_hosts(2, Duration::from_secs(60)).unwrap();
    hosts.sort_by(|a, b| a.name.cmp(&b.name));
    let st = two_stages(&rt, gpus, "host", |r| Placement::Host(hosts[r].id));
    let dag = Dag::<u64>::new();
    let x = dag.input();
    let t = st[0]
        .first(&x, 0)
        .with_tensor_transport(Transport::communicator());
    let out = st[1].done(&t, 0);
    let skip = |e: &dyn std::fmt::Display| {
        let e = e.to_string();
        assert!(
            gpus < 2 && e.to_lowercase().contains("duplicate gpu"),
            "the NCCL group across hosts failed otherwise than by NCCL's duplicate-GPU check: {e}"
        );
        eprintln!(
            "SKIPPED: one GPU; the ranks on two hosts met through the unique id and NCCL refused to share device 0: {e}"
        );
    };
    let g = match dag.compile(out, CompileOptions::default()) {
        Ok(g) => g,
        Err(e) => return skip(&e),
    };
    let infos = g.communicators();
    assert!(infos.iter().all(|c| c.transport == "nccl"), "{infos:?}");
    for x in 0..3u64 {
        let got = match g.execute(x).and_then(|r| r.get()) {
            Ok(v) => v,
            Err(e) => return skip(&e),
        };
        let want: f64 = (0..4)
            .map(|i| ((x + i) as f32 * 2.0 + 1.0) * 3.0)
            .map(f64::from)
            .sum();
        assert_eq!(got, want, "input {x}");
    }
    g.teardown().unwrap();
}
