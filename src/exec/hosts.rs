//! The parts of a graph on other hosts: the driver sends each host its part (through the
//! host's agent, which makes the channels there, connects the network channels written there,
//! takes those read there and installs its actors' schedules), and closes it at teardown.
use crate::actor::HandleCore;
use crate::actor::channels::ChannelSizes;
use crate::actor::link::ActorLink;
use crate::actor::remote::{HostPart, close_on_host, install_on_host};
use crate::cluster::driver::ClusterDriver;
use crate::compile::plan::GraphPlan;
use crossbeam_channel::Sender;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// One host's install: its outcome once known, and who waits for it.
#[derive(Default)]
struct HostState {
    result: Option<Result<(), String>>,
    installed: Vec<Sender<Result<(), String>>>,
    done: Vec<Sender<String>>,
}

/// The parts of one graph on other hosts.
pub(crate) struct RemoteParts {
    pub cluster: Arc<ClusterDriver>,
    hosts: Arc<Mutex<HashMap<u64, HostState>>>,
}

impl RemoteParts {
    /// Sends each other host of `plan` its part, each on a thread of its own; `None` when the
    /// graph runs on the driver's host only.
    pub(crate) fn start(
        plan: &Arc<GraphPlan>,
        actors: &[HandleCore],
        sizes: &ChannelSizes,
        timeline: bool,
    ) -> Option<RemoteParts> {
        let cluster = actors.iter().find_map(|a| match &a.0.link {
            ActorLink::Remote(link) => Some(link.cluster().clone()),
            _ => None,
        })?;
        let parts = RemoteParts {
            cluster: cluster.clone(),
            hosts: Arc::new(Mutex::new(HashMap::new())),
        };
        let addrs = cluster.data_addrs();
        for host in plan.remote_hosts() {
            parts.hosts.lock().insert(host, HostState::default());
            let part = HostPart {
                plan: (**plan).clone(),
                host,
                slot_bytes: sizes.slot_bytes as u64,
                max_message_bytes: sizes.max_message_bytes as u64,
                spin_ns: sizes.spin.as_nanos() as u64,
                // Recorded on the host's clock; the driver shifts them by the host's estimated
                // offset when it builds the timeline.
                timeline,
                addrs: addrs.clone(),
            };
            let (cluster, hosts) = (cluster.clone(), parts.hosts.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("adag-install-host-{host}"))
                .spawn(move || {
                    let result = install_on_host(&cluster, &part).map_err(|e| e.to_string());
                    let waiting = {
                        let mut hosts = hosts.lock();
                        let state = hosts.entry(host).or_default();
                        state.result = Some(result.clone());
                        std::mem::take(&mut state.installed)
                    };
                    for w in waiting {
                        let _ = w.send(result.clone());
                    }
                });
            if let Err(e) = spawned {
                parts.hosts.lock().entry(host).or_default().result = Some(Err(format!(
                    "no thread to install the graph on host {host}: {e}"
                )));
            }
        }
        Some(parts)
    }

    /// `installed` hears how the install on `host` went; `done`, when the host closed the
    /// graph at teardown.
    pub(crate) fn waiting(
        &self,
        host: u64,
        installed: Sender<Result<(), String>>,
        done: Sender<String>,
    ) {
        let mut hosts = self.hosts.lock();
        let state = hosts.entry(host).or_default();
        state.done.push(done);
        match &state.result {
            Some(r) => {
                let _ = installed.send(r.clone());
            }
            None => state.installed.push(installed),
        }
    }

    /// Closes the graph on every host, each on a thread of its own; each host's actors are
    /// told done once their host closed it.
    pub(crate) fn close(&self, graph: u64) {
        let hosts: Vec<(u64, Vec<Sender<String>>)> = self
            .hosts
            .lock()
            .iter_mut()
            .map(|(h, s)| (*h, std::mem::take(&mut s.done)))
            .collect();
        for (host, done) in hosts {
            let cluster = self.cluster.clone();
            let _ = std::thread::Builder::new()
                .name(format!("adag-close-host-{host}"))
                .spawn(move || {
                    close_on_host(&cluster, host, graph);
                    for d in done {
                        let _ = d.send("closed by its host".into());
                    }
                });
        }
    }
}
