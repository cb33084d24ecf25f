//! The agent of a host: the user's own executable started by a cluster launcher with
//! `ADAG_JOIN` and `ADAG_TOKEN` in its environment. It joins the driver and stays until the
//! driver goes (connection closed, or silent past the heartbeat timeout), then exits.
use super::wire::{self, Hello, ToAgent, ToDriver, WireError};
use super::{ENV_HOST_NAME, ENV_JOIN, ENV_TOKEN};
use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Exit status of an agent that could not join (wrong secret, no driver, bad address).
pub const EXIT_JOIN_FAILED: i32 = 3;

/// How long an agent keeps trying to reach a driver that is not listening yet (launchers
/// may start hosts before the driver): 60 attempts, 0.5 s apart.
const CONNECT_ATTEMPTS: u32 = 60;
const CONNECT_PAUSE: Duration = Duration::from_millis(500);

/// If this process was started as a host's agent, run it and exit; otherwise return at once.
pub(crate) fn maybe_run_agent() {
    let Ok(join) = std::env::var(ENV_JOIN) else {
        return;
    };
    let code = match run(&join) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("adag agent: {e}");
            EXIT_JOIN_FAILED
        }
    };
    std::process::exit(code);
}

fn host_name() -> String {
    if let Ok(name) = std::env::var(ENV_HOST_NAME)
        && !name.is_empty()
    {
        return name;
    }
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

fn connect(join: &str) -> Result<TcpStream, String> {
    let mut last = String::new();
    for attempt in 0..CONNECT_ATTEMPTS {
        if attempt > 0 {
            std::thread::sleep(CONNECT_PAUSE);
        }
        let addrs = join.to_socket_addrs().map_err(|e| {
            format!("{ENV_JOIN}={join} is not an address (host:port) that resolves: {e}")
        })?;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, wire::HANDSHAKE_TIMEOUT) {
                Ok(s) => return Ok(s),
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
    }
    Err(format!(
        "cannot reach the driver at {join} after {CONNECT_ATTEMPTS} attempts ({last}); is the driver listening there?"
    ))
}

fn run(join: &str) -> Result<(), String> {
    let token = std::env::var(ENV_TOKEN)
        .ok()
        .filter(|t| !t.is_empty())
        .ok_or_else(|| format!("{ENV_JOIN} is set but {ENV_TOKEN} is not: set the driver's shared secret in {ENV_TOKEN}"))?;
    let mut stream = connect(join)?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    wire::agent_handshake(&mut stream, token.as_bytes())
        .map_err(|e| format!("joining {join}: {e}"))?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    wire::write_frame(
        &mut stream,
        &Hello {
            name: host_name(),
            cores,
            pid: std::process::id(),
        },
    )
    .map_err(|e| format!("joining {join}: {e}"))?;
    let (host, interval, timeout) = match wire::read_frame::<ToAgent>(&mut stream) {
        Ok(ToAgent::Welcome {
            host,
            interval_ms,
            timeout_ms,
        }) => (
            host,
            Duration::from_millis(interval_ms.max(1)),
            Duration::from_millis(timeout_ms.max(1)),
        ),
        Ok(ToAgent::Refused { reason }) => return Err(format!("the driver refused: {reason}")),
        Ok(other) => return Err(format!("the driver answered {other:?} to a join")),
        Err(e) => return Err(format!("joining {join}: {e}")),
    };
    serve(stream, host, interval, timeout);
    Ok(())
}

/// Heartbeats both ways until the driver goes.
fn serve(mut stream: TcpStream, host: u64, interval: Duration, timeout: Duration) {
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let Ok(mut beat) = stream.try_clone() else {
        return;
    };
    std::thread::Builder::new()
        .name("adag-agent-heartbeat".into())
        .spawn(move || {
            while wire::write_frame(&mut beat, &ToDriver::Heartbeat).is_ok() {
                std::thread::sleep(interval);
            }
        })
        .ok();
    let started = Instant::now();
    loop {
        match wire::read_frame::<ToAgent>(&mut stream) {
            Ok(ToAgent::Heartbeat) => {}
            Ok(ToAgent::Shutdown) => return,
            Ok(other) => {
                eprintln!("adag agent (host {host}): unexpected {other:?}; ignored");
            }
            Err(WireError::Io(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                eprintln!(
                    "adag agent (host {host}): the driver sent nothing for {timeout:?} (up {:?}); leaving",
                    started.elapsed()
                );
                return;
            }
            Err(_) => return,
        }
    }
}
