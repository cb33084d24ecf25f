//! Hosts joining a driver: three agents started on this machine as separate process trees
//! (what a cluster launcher does on real hosts, see docs/multi-host.md), listed by the driver,
//! then one killed and noticed.
//!
//! Run: `cargo run --release --example hosts`
use adag::Runtime;
use adag::cluster::{ClusterOptions, LocalHosts};
use std::time::{Duration, Instant};

fn main() -> anyhow::Result<()> {
    let rt = Runtime::new()?;
    let secret = format!("demo-{}", std::process::id());
    let addr = rt.listen(ClusterOptions::new(secret.clone()))?;
    println!("driver listening on {addr} (loopback)");
    let start = Instant::now();
    let mut hosts = LocalHosts::start(3, addr, &secret)?;
    for h in rt.wait_for_hosts(3, Duration::from_secs(60))? {
        println!(
            "  host {} {:<8} from {} ({} cores, agent pid {})",
            h.id, h.name, h.address, h.cores, h.pid
        );
    }
    println!("3 hosts joined in {:?}", start.elapsed());
    hosts.kill(1)?;
    let killed = Instant::now();
    while rt.hosts().len() == 3 && killed.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    println!(
        "killed local-1: the driver lists {} hosts after {:?}",
        rt.hosts().len(),
        killed.elapsed()
    );
    Ok(())
}
