//! NCCL and copy latency / bandwidth of adag-cuda, printed as tables.
//!
//! ```text
//! nccl-bench [--min BYTES] [--max BYTES] [--max-iters N] [--timeout-s S]
//! ```
//!
//! Sizes go from `--min` (1 KiB) to `--max` (256 MiB) by factors of 4. It measures:
//! - host <-> device copies (`to_device` / `to_host`, pageable host memory);
//! - with two ranks (two GPUs, or two ranks on one GPU where NCCL allows it): `allreduce`
//!   (f32 sum) and `send`/`recv` ping-pong through the adag `Communicator` API;
//! - with one rank (the fallback on one GPU): `allreduce` through the adag API (per call:
//!   output allocation, enqueue, wait), and NCCL itself through cudarc (allreduce and a
//!   send/recv to self in one NCCL group), timed with CUDA events over back-to-back calls.
//!
//! Exit status: 0 when everything that could run ran; 2 without CUDA; 3 without NCCL (the
//! copy table is still printed).
use adag::comm::{Communicator, ReduceOp};
use adag::tensor::{DType, Tensor};
use adag_cuda::{NcclCommunicator, NcclGroup, NcclOptions, to_device, to_host};
use std::sync::Barrier;
use std::time::{Duration, Instant};

struct Args {
    min: usize,
    max: usize,
    max_iters: usize,
    timeout: Duration,
}

fn parse_size(s: &str) -> usize {
    let s = s.trim();
    let (num, mul) = match s.to_ascii_lowercase() {
        x if x.ends_with("kib") || x.ends_with('k') => (
            x.trim_end_matches("kib").trim_end_matches('k').to_string(),
            1 << 10,
        ),
        x if x.ends_with("mib") || x.ends_with('m') => (
            x.trim_end_matches("mib").trim_end_matches('m').to_string(),
            1 << 20,
        ),
        x if x.ends_with("gib") || x.ends_with('g') => (
            x.trim_end_matches("gib").trim_end_matches('g').to_string(),
            1 << 30,
        ),
        x => (x, 1),
    };
    num.parse::<usize>()
        .unwrap_or_else(|_| panic!("bad size {s:?} (use 1024, 4K, 256M...)"))
        * mul
}

fn args() -> Args {
    let mut a = Args {
        min: 1 << 10,
        max: 256 << 20,
        max_iters: 200,
        timeout: Duration::from_secs(30),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--min" => a.min = parse_size(&v()),
            "--max" => a.max = parse_size(&v()),
            "--max-iters" => a.max_iters = v().parse().expect("--max-iters N"),
            "--timeout-s" => a.timeout = Duration::from_secs(v().parse().expect("--timeout-s S")),
            "-h" | "--help" => {
                println!("nccl-bench [--min BYTES] [--max BYTES] [--max-iters N] [--timeout-s S]");
                std::process::exit(0);
            }
            other => panic!("unknown argument {other:?}; see --help"),
        }
    }
    a.min = a.min.max(4);
    a
}

fn sizes(a: &Args) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = a.min;
    while s <= a.max {
        v.push(s);
        s *= 4;
    }
    v
}

/// Iterations for a size: many for small messages, a few for large ones; the same on every
/// rank.
fn iters(a: &Args, bytes: usize) -> usize {
    ((1usize << 30) / bytes.max(1)).clamp(5, a.max_iters.max(5))
}

struct Stats {
    avg: Duration,
    p50: Duration,
    min: Duration,
    n: usize,
}

fn stats(mut t: Vec<Duration>) -> Stats {
    t.sort();
    let n = t.len().max(1);
    Stats {
        avg: t.iter().sum::<Duration>() / n as u32,
        p50: t.get(t.len() / 2).copied().unwrap_or_default(),
        min: t.first().copied().unwrap_or_default(),
        n: t.len(),
    }
}

fn header() {
    println!(
        "{:<34} {:>5} {:>10} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "op", "ranks", "bytes", "iters", "avg_us", "p50_us", "min_us", "algbw_GB/s", "busbw_GB/s"
    );
}

fn row(op: &str, ranks: usize, bytes: usize, s: &Stats, bus_factor: f64) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let algbw = bytes as f64 / s.avg.as_secs_f64().max(1e-12) / 1e9;
    println!(
        "{:<34} {:>5} {:>10} {:>6} {:>11.2} {:>11.2} {:>11.2} {:>11.3} {:>11.3}",
        op,
        ranks,
        bytes,
        s.n,
        us(s.avg),
        us(s.p50),
        us(s.min),
        algbw,
        algbw * bus_factor
    );
}

fn measure(n: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<Stats, String> {
    for _ in 0..2 {
        f()?;
    }
    let mut t = Vec::with_capacity(n);
    for _ in 0..n {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed());
    }
    Ok(stats(t))
}

fn f32_tensor(bytes: usize, seed: f32) -> Tensor {
    Tensor::from_vec(vec![seed; bytes / 4], [bytes / 4]).expect("shape")
}

fn copy_bench(a: &Args) {
    println!("\n== host <-> device copies (adag_cuda::to_device / to_host, pageable memory)");
    header();
    for &b in &sizes(a) {
        let t = f32_tensor(b, 1.0);
        let n = iters(a, b);
        match measure(n, || to_device(&t, 0).map(drop).map_err(|e| e.to_string())) {
            Ok(s) => row("to_device (H2D)", 1, b, &s, 1.0),
            Err(e) => println!("to_device {b}: FAILED: {e}"),
        }
        let d = match to_device(&t, 0) {
            Ok(d) => d,
            Err(e) => {
                println!("to_device {b}: FAILED: {e}");
                continue;
            }
        };
        match measure(n, || to_host(&d).map(drop).map_err(|e| e.to_string())) {
            Ok(s) => row("to_host (D2H)", 1, b, &s, 1.0),
            Err(e) => println!("to_host {b}: FAILED: {e}"),
        }
    }
}

/// Two ranks through the adag API. Returns false when they could not join.
fn two_rank_bench(a: &Args, devices: Vec<u32>) -> bool {
    let opts = NcclOptions {
        timeout: a.timeout,
        devices: devices.clone(),
        ..NcclOptions::default()
    };
    let g = match NcclGroup::with_options(2, "bench-pair", &opts) {
        Ok(g) => g,
        Err(e) => {
            println!("two ranks: cannot make the group: {e}");
            return false;
        }
    };
    let comms: Vec<NcclCommunicator> = match (0..2).map(|r| g.communicator(r)).collect() {
        Ok(c) => c,
        Err(e) => {
            println!("two ranks: {e}");
            return false;
        }
    };
    let joined: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| c.init())).collect();
        hs.into_iter()
            .map(|h| h.join().expect("join thread"))
            .collect()
    });
    if let Some(Err(e)) = joined.iter().find(|r| r.is_err()) {
        println!("two ranks on devices {devices:?}: NCCL could not join them: {e}");
        g.destroy();
        return false;
    }
    println!("\n== two ranks on devices {devices:?} (adag Communicator API, one thread per rank)");
    header();
    let sz = sizes(a);
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        for (rank, c) in comms.iter().enumerate() {
            let (sz, barrier) = (&sz, &barrier);
            s.spawn(move || {
                for &b in sz {
                    let n = iters(a, b);
                    let t = match to_device(&f32_tensor(b, rank as f32 + 1.0), c.ordinal()) {
                        Ok(t) => t,
                        Err(e) => {
                            println!("rank {rank}: to_device {b}: {e}");
                            return;
                        }
                    };
                    barrier.wait();
                    let r = measure(n, || {
                        c.allreduce(&t, ReduceOp::Sum)
                            .map(drop)
                            .map_err(|e| e.to_string())
                    });
                    if rank == 0 {
                        match r {
                            Ok(s) => row("allreduce f32 sum", 2, b, &s, 1.0),
                            Err(e) => println!("allreduce {b}: FAILED: {e}"),
                        }
                    }
                    barrier.wait();
                    // Ping-pong: one round trip per iteration; latency = round trip / 2.
                    let peer = 1 - rank;
                    let shape = [b / 4];
                    let r = measure(n, || {
                        if rank == 0 {
                            c.send(&t, peer).map_err(|e| e.to_string())?;
                            c.recv(&shape, DType::F32, peer)
                                .map(drop)
                                .map_err(|e| e.to_string())
                        } else {
                            c.recv(&shape, DType::F32, peer)
                                .map_err(|e| e.to_string())?;
                            c.send(&t, peer).map_err(|e| e.to_string())
                        }
                    });
                    if rank == 0 {
                        match r {
                            Ok(mut s) => {
                                s.avg /= 2;
                                s.p50 /= 2;
                                s.min /= 2;
                                row("send/recv (half round trip)", 2, b, &s, 1.0);
                            }
                            Err(e) => println!("send/recv {b}: FAILED: {e}"),
                        }
                    }
                }
            });
        }
    });
    true
}

/// One rank: the adag API, and NCCL itself through cudarc.
fn one_rank_bench(a: &Args) {
    println!("\n== one rank on device 0");
    header();
    let g = match NcclGroup::with_options(
        1,
        "bench-single",
        &NcclOptions {
            timeout: a.timeout,
            ..NcclOptions::default()
        },
    ) {
        Ok(g) => g,
        Err(e) => {
            println!("one rank: {e}");
            return;
        }
    };
    let c = match g.communicator(0) {
        Ok(c) => c,
        Err(e) => {
            println!("one rank: {e}");
            return;
        }
    };
    for &b in &sizes(a) {
        let t = match to_device(&f32_tensor(b, 1.0), 0) {
            Ok(t) => t,
            Err(e) => {
                println!("to_device {b}: {e}");
                continue;
            }
        };
        match measure(iters(a, b), || {
            c.allreduce(&t, ReduceOp::Sum)
                .map(drop)
                .map_err(|e| e.to_string())
        }) {
            Ok(s) => row("allreduce f32 sum (adag, per call)", 1, b, &s, 0.0),
            Err(e) => println!("allreduce {b}: FAILED: {e}"),
        }
    }
    if let Err(e) = raw_nccl_bench(a) {
        println!("raw NCCL (cudarc) one-rank bench FAILED: {e}");
    }
}

/// NCCL through cudarc's safe API, one rank, timed with CUDA events over back-to-back calls.
fn raw_nccl_bench(a: &Args) -> Result<(), String> {
    use adag_cuda::cudarc::driver::sys::CUevent_flags;
    use adag_cuda::cudarc::nccl::{Comm, Id, ReduceOp as NcclOp, group_end, group_start};
    let ctx = adag_cuda::context(0).map_err(|e| e.to_string())?;
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let id = Id::new().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
    let comm = Comm::from_rank(stream.clone(), 0, 1, id)
        .map_err(|e| format!("ncclCommInitRank: {e:?}"))?;
    let ev = |_: ()| {
        ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| e.to_string())
    };
    let (start, end) = (ev(())?, ev(())?);
    println!("\n== one rank, NCCL via cudarc (CUDA-event time of back-to-back calls)");
    header();
    for &b in &sizes(a) {
        let n = iters(a, b);
        let src = stream.alloc_zeros::<u8>(b).map_err(|e| e.to_string())?;
        let mut dst = stream.alloc_zeros::<u8>(b).map_err(|e| e.to_string())?;
        let mut time = |what: &str,
                        f: &mut dyn FnMut(
            &mut adag_cuda::cudarc::driver::CudaSlice<u8>,
        ) -> Result<(), String>|
         -> Result<(), String> {
            for _ in 0..2 {
                f(&mut dst)?;
            }
            start.record(&stream).map_err(|e| e.to_string())?;
            for _ in 0..n {
                f(&mut dst)?;
            }
            end.record(&stream).map_err(|e| e.to_string())?;
            let ms = start.elapsed_ms(&end).map_err(|e| e.to_string())?;
            let per = Duration::from_secs_f64(ms as f64 / 1e3 / n as f64);
            let s = Stats {
                avg: per,
                p50: per,
                min: per,
                n,
            };
            row(what, 1, b, &s, 0.0);
            Ok(())
        };
        time("allreduce u8 sum (raw NCCL)", &mut |dst| {
            comm.all_reduce(&src, dst, &NcclOp::Sum)
                .map(drop)
                .map_err(|e| format!("ncclAllReduce: {e:?}"))
        })?;
        time("send+recv to self (raw NCCL)", &mut |dst| {
            group_start().map_err(|e| format!("ncclGroupStart: {e:?}"))?;
            comm.send(&src, 0).map_err(|e| format!("ncclSend: {e:?}"))?;
            comm.recv(dst, 0).map_err(|e| format!("ncclRecv: {e:?}"))?;
            group_end()
                .map(drop)
                .map_err(|e| format!("ncclGroupEnd: {e:?}"))
        })?;
    }
    stream.synchronize().map_err(|e| e.to_string())?;
    Ok(())
}

fn cuda_feature() -> &'static str {
    macro_rules! pick {
        ($($f:literal),*) => {{
            $( if cfg!(feature = $f) { return $f; } )*
            "none"
        }};
    }
    pick!(
        "cuda-11080",
        "cuda-12000",
        "cuda-12010",
        "cuda-12020",
        "cuda-12030",
        "cuda-12040",
        "cuda-12050",
        "cuda-12060",
        "cuda-12080",
        "cuda-12090",
        "cuda-13000",
        "cuda-13010",
        "cuda-13020"
    )
}

fn main() {
    let a = args();
    println!(
        "nccl-bench (adag-cuda {}, cudarc bindings {}), sizes {}..{} bytes",
        env!("CARGO_PKG_VERSION"),
        cuda_feature(),
        a.min,
        a.max
    );
    if let Err(e) = adag_cuda::check_cuda() {
        println!("CUDA: NOT AVAILABLE: {e}");
        std::process::exit(2);
    }
    let n = match adag_cuda::device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) => {
            println!("CUDA: no device visible");
            std::process::exit(2);
        }
        Err(e) => {
            println!("CUDA: {e}");
            std::process::exit(2);
        }
    };
    let driver = adag_cuda::driver_version()
        .map(|(a, b)| format!("{a}.{b}"))
        .unwrap_or_else(|e| e.to_string());
    println!(
        "CUDA driver API {driver}; libcuda {:?}; {n} device(s)",
        adag_cuda::loaded_library(adag_cuda::Library::Cuda)
    );
    for i in 0..n as u32 {
        if let Ok(ctx) = adag_cuda::context(i) {
            println!("  cuda:{i}: {}", ctx.name().unwrap_or_default());
        }
    }
    copy_bench(&a);
    if let Err(e) = adag_cuda::check_nccl() {
        println!("\nNCCL: NOT AVAILABLE: {e}");
        std::process::exit(3);
    }
    match adag_cuda::nccl_version() {
        Ok((x, y, z)) => println!(
            "\nNCCL {x}.{y}.{z} from {:?}",
            adag_cuda::loaded_library(adag_cuda::Library::Nccl)
        ),
        Err(e) => println!("\nNCCL version: {e}"),
    }
    let devices = if n >= 2 { vec![0, 1] } else { vec![0, 0] };
    let two = two_rank_bench(&a, devices);
    if !two {
        println!("falling back to one rank");
    }
    one_rank_bench(&a);
    println!(
        "\nsummary: two-rank tables {}; one-rank tables printed above",
        if two {
            "printed"
        } else {
            "NOT run (see reason above)"
        }
    );
}
