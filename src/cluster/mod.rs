//! Hosts of a cluster: other machines (or process trees) that join the driver.
//!
//! A host joins by running the user's own executable with the driver's address and a shared
//! secret in its environment, which is what cluster launchers do (SLURM `srun`, a Kubernetes
//! Job, `ssh`, `mpirun`): `ADAG_JOIN=addr:port ADAG_TOKEN=secret ./app`. A hook that runs
//! before `main` turns that process into the host's *agent*: it authenticates (mutual
//! challenge–response: the secret never crosses the wire), stays while the driver lives, and
//! exits when it loses the driver. The driver listens with [`Runtime::listen`], waits for the
//! hosts it expects ([`Runtime::wait_for_hosts`]) and lists them ([`Runtime::hosts`]). adag
//! does not schedule a cluster: the launcher decides where processes run.
//!
//! [`LocalHosts`] starts hosts as separate process trees on this machine (tests, examples).
//!
//! ```
//! use adag::cluster::{ClusterOptions, LocalHosts};
//! use std::time::Duration;
//!
//! let rt = adag::Runtime::new()?;
//! let addr = rt.listen(ClusterOptions::new("s3cret"))?;          // 127.0.0.1, any port
//! let _hosts = LocalHosts::start(2, addr, "s3cret")?;              // two agents, here
//! let joined = rt.wait_for_hosts(2, Duration::from_secs(30))?;
//! assert_eq!(joined.len(), 2);
//! assert!(joined.iter().all(|h| h.address.ip().is_loopback()));
//! # Ok::<(), adag::Error>(())
//! ```
//!
//! [`Runtime::listen`]: crate::Runtime::listen
//! [`Runtime::wait_for_hosts`]: crate::Runtime::wait_for_hosts
//! [`Runtime::hosts`]: crate::Runtime::hosts
use std::net::SocketAddr;
use std::time::Duration;

pub(crate) mod agent;
mod clock;
pub(crate) mod data;
pub(crate) mod driver;
mod gate;
mod launch;
pub(crate) mod wire;

pub use agent::{ENV_DATA_ADDR, ENV_DATA_ADVERTISE, EXIT_JOIN_FAILED};
pub use clock::ClockOffset;
pub use launch::LocalHosts;

/// The driver's address, `host:port`, in a joining host's environment.
pub const ENV_JOIN: &str = "ADAG_JOIN";
/// The shared secret, in the environment of the driver's launcher and of every host.
pub const ENV_TOKEN: &str = "ADAG_TOKEN";
/// The host's name as the driver lists it (default: the machine's host name).
pub const ENV_HOST_NAME: &str = "ADAG_HOST_NAME";
/// Where a driver listens for hosts (`ip:port`, or `name:port`), read by
/// [`Runtime::new`](crate::Runtime::new) with [`ENV_TOKEN`]: a launcher configures the driver
/// without code of the user's.
pub const ENV_LISTEN: &str = "ADAG_LISTEN";
/// How long a joining host keeps trying to reach its driver, in seconds (default 30): set it
/// to cover a driver that starts late (a Kubernetes pod waiting for its image).
pub const ENV_JOIN_TIMEOUT: &str = "ADAG_JOIN_TIMEOUT";

/// A host that joined the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostInfo {
    /// Its id (the driver's own host is 0; joined hosts count from 1).
    pub id: u64,
    /// Its name (`ADAG_HOST_NAME`, else the machine's host name).
    pub name: String,
    /// The address its connection comes from.
    pub address: SocketAddr,
    /// Its processors.
    pub cores: usize,
    /// The agent's process id on that host.
    pub pid: u32,
    /// Where its data port is reached (the network channels read there connect to it).
    pub data_address: SocketAddr,
    /// `None` while it is alive; once lost, when and why (a lost host stays listed, as Ray
    /// lists a dead node with `Alive: False`).
    pub lost: Option<HostLoss>,
    /// Its clock against the driver's, estimated over the heartbeats (`None` until the first
    /// answer): what the timeline subtracts from its actors' records, and how sure it is.
    pub clock: Option<ClockOffset>,
}

impl HostInfo {
    /// Whether the host is still connected (not lost).
    pub fn is_alive(&self) -> bool {
        self.lost.is_none()
    }
}

/// When and why a host was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLoss {
    /// When the driver counted it lost.
    pub at: std::time::SystemTime,
    /// Why: its connection closed or broke, it fell silent past the heartbeat timeout, ...
    pub reason: String,
}

/// How the driver listens for hosts ([`Runtime::listen`](crate::Runtime::listen)).
#[derive(Clone)]
#[non_exhaustive]
pub struct ClusterOptions {
    /// Where to listen (default `127.0.0.1:0`: loopback, any free port). Name an interface's
    /// address (or `0.0.0.0`) for hosts on other machines.
    pub addr: SocketAddr,
    /// The shared secret every host repeats in `ADAG_TOKEN`.
    pub token: String,
    /// How often each side sends a heartbeat (default 500 ms).
    pub heartbeat_interval: Duration,
    /// A host (or, on the host, the driver) silent for this long is lost (default 5 s): long
    /// enough to ride out network stalls, short enough to fail a graph well before a user's
    /// usual timeouts.
    pub heartbeat_timeout: Duration,
}

impl std::fmt::Debug for ClusterOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterOptions")
            .field("addr", &self.addr)
            .field("token", &"<secret>")
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("heartbeat_timeout", &self.heartbeat_timeout)
            .finish()
    }
}

impl ClusterOptions {
    /// Listen on loopback, any free port, with the shared secret `token`.
    pub fn new(token: impl Into<String>) -> Self {
        ClusterOptions {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: token.into(),
            heartbeat_interval: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_secs(5),
        }
    }

    /// Set [`ClusterOptions::addr`].
    pub fn addr(mut self, addr: SocketAddr) -> Self {
        self.addr = addr;
        self
    }

    /// Set [`ClusterOptions::heartbeat_interval`].
    pub fn heartbeat_interval(mut self, d: Duration) -> Self {
        self.heartbeat_interval = d;
        self
    }

    /// Set [`ClusterOptions::heartbeat_timeout`].
    pub fn heartbeat_timeout(mut self, d: Duration) -> Self {
        self.heartbeat_timeout = d;
        self
    }

    /// The options a launcher put in the environment: `None` without [`ENV_LISTEN`]; with
    /// it, listen there with the secret of [`ENV_TOKEN`] (required then).
    ///
    /// ```
    /// use adag::cluster::ClusterOptions;
    /// // SAFETY: no other thread of this example reads the environment.
    /// unsafe {
    ///     std::env::set_var("ADAG_LISTEN", "127.0.0.1:0");
    ///     std::env::set_var("ADAG_TOKEN", "s3cret");
    /// }
    /// let o = ClusterOptions::from_env()?.expect("ADAG_LISTEN is set");
    /// assert!(o.addr.ip().is_loopback());
    /// # Ok::<(), adag::Error>(())
    /// ```
    pub fn from_env() -> crate::Result<Option<ClusterOptions>> {
        let Some(listen) = std::env::var(ENV_LISTEN).ok().filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let what = || format!("listening where {ENV_LISTEN} says ({listen})");
        let token = std::env::var(ENV_TOKEN)
            .ok()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                crate::Error::io(
                    what(),
                    format!("{ENV_TOKEN} is not set: set the cluster's shared secret in {ENV_TOKEN} beside {ENV_LISTEN}"),
                )
            })?;
        let addr = std::net::ToSocketAddrs::to_socket_addrs(listen.as_str())
            .map_err(|e| {
                crate::Error::io(
                    what(),
                    format!("not an address (ip:port or name:port) that resolves: {e}"),
                )
            })?
            .next()
            .ok_or_else(|| crate::Error::io(what(), "the name resolves to no address"))?;
        Ok(Some(ClusterOptions::new(token).addr(addr)))
    }
}
