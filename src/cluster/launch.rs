//! Hosts started on this machine, each a separate process tree (its own process group): what
//! the tests, an example and the benchmark use in place of a cluster launcher.
use super::{ENV_HOST_NAME, ENV_JOIN, ENV_TOKEN};
use crate::error::{Error, Result};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

/// Agents started on this machine with this executable; killed (and reaped) on drop.
#[derive(Debug)]
pub struct LocalHosts {
    children: Vec<Child>,
}

impl LocalHosts {
    /// Start `count` hosts named `local-0`, `local-1`, ... that join the driver at `addr`
    /// with the secret `token`.
    pub fn start(count: usize, addr: SocketAddr, token: &str) -> Result<LocalHosts> {
        let mut hosts = LocalHosts {
            children: Vec::new(),
        };
        for i in 0..count {
            hosts
                .children
                .push(spawn(addr, token, &format!("local-{i}"), Vec::new())?);
        }
        Ok(hosts)
    }

    /// Start one host per entry of `env`, named `local-0`, `local-1`, ..., each with the
    /// extra environment variables of its entry (where its data port listens and what it
    /// advertises, [`ENV_DATA_ADDR`](super::ENV_DATA_ADDR) and
    /// [`ENV_DATA_ADVERTISE`](super::ENV_DATA_ADVERTISE), say).
    pub fn start_with_env(
        addr: SocketAddr,
        token: &str,
        env: Vec<Vec<(String, String)>>,
    ) -> Result<LocalHosts> {
        let mut hosts = LocalHosts {
            children: Vec::new(),
        };
        for (i, vars) in env.into_iter().enumerate() {
            hosts
                .children
                .push(spawn(addr, token, &format!("local-{i}"), vars)?);
        }
        Ok(hosts)
    }

    /// The agents' process ids.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// Kill host `index`'s agent and everything it started (its whole process group).
    pub fn kill(&mut self, index: usize) -> Result<()> {
        let child = self.children.get_mut(index).ok_or_else(|| {
            Error::io(
                format!("killing local host {index}"),
                "there is no such host",
            )
        })?;
        kill_group(child);
        let _ = child.wait();
        Ok(())
    }

    /// Wait for host `index`'s agent to exit by itself; its exit code.
    pub fn wait(&mut self, index: usize) -> Result<Option<i32>> {
        let child = self.children.get_mut(index).ok_or_else(|| {
            Error::io(
                format!("waiting for local host {index}"),
                "there is no such host",
            )
        })?;
        child
            .wait()
            .map(|s| s.code())
            .map_err(|e| Error::io(format!("waiting for local host {index}"), e))
    }
}

fn spawn(addr: SocketAddr, token: &str, name: &str, vars: Vec<(String, String)>) -> Result<Child> {
    let exe = std::env::current_exe().map_err(|e| Error::io("finding this executable", e))?;
    Command::new(exe)
        .envs(vars)
        .env_remove(super::ENV_LISTEN)
        .env(ENV_JOIN, addr.to_string())
        .env(ENV_TOKEN, token)
        .env(ENV_HOST_NAME, name)
        .stdin(Stdio::null())
        // A process tree of its own, as on another machine.
        .process_group(0)
        .spawn()
        .map_err(|e| Error::io(format!("starting local host {name}"), e))
}

fn kill_group(child: &Child) {
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
}

impl Drop for LocalHosts {
    fn drop(&mut self) {
        for child in &mut self.children {
            if let Ok(None) = child.try_wait() {
                kill_group(child);
            }
            let _ = child.wait();
        }
    }
}
