//! Worker logs reach the driver: every line a worker writes to stdout or stderr comes out of
//! the driver's stdout or stderr prefixed `(Actor pid=1234) `, and every `tracing` event a
//! worker emits is emitted again in the driver (target `adag::worker`) with the actor and pid
//! as fields, through whatever subscriber the driver installed.
//!
//! Nothing here may stall an actor. A worker's stdout and stderr are pipes that one driver
//! thread each drains at once into a bounded queue; one writer thread empties the queue into
//! the driver's own output. When that output is slow (a full terminal, a reader that stopped
//! reading) the queue fills and lines are dropped and counted, while the pipes keep draining.
//! Tracing events go over a datagram socket written without blocking: an event that does not
//! fit the socket's buffer is dropped and counted in the worker. The worker is told the
//! driver's maximum level, so that events the driver would drop are never sent.
//!
//! Workers on other hosts: their agent forwards the same way, but its writer thread sends the
//! lines (prefixed `(Actor pid=1234, host=node-3) `) and its event threads send the events to
//! the driver over the agent's connection ([`LogReporter`]), where they join the driver's own
//! queue and events ([`RemoteLogs`]). The same rule holds: a slow network or driver fills the
//! agent's queue and lines are dropped and counted there; the driver drops, counts and says so
//! when its own output is slow; no actor ever waits.
use crate::cluster::agent::LogReporter;
use crate::cluster::driver::LogSink;
use crossbeam_channel::{Sender, TrySendError};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tracing::Level;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// Lines waiting for the driver's output, all workers together.
const LINE_QUEUE: usize = 4096;
/// The longest message (and field text) an event carries; the rest is cut.
const MAX_EVENT_TEXT: usize = 16 * 1024;

/// One `tracing` event of a worker, as it crosses to the driver.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct EventRecord {
    /// 0 = error .. 4 = trace.
    pub level: u8,
    pub target: String,
    pub message: String,
    /// The event's other fields, ` name=value` each.
    pub fields: String,
    /// The spans the event is in, outermost first: `name{fields}:name{fields}`.
    pub spans: String,
}

/// In an agent: where its workers' lines and events go (the driver, over the agent's
/// connection). Unset in a driver.
static TO_DRIVER: std::sync::OnceLock<LogReporter> = std::sync::OnceLock::new();

/// In an agent: send every worker's output and events to the driver through `reporter`.
pub(crate) fn send_to_driver(reporter: LogReporter) {
    let _ = TO_DRIVER.set(reporter);
}

/// The level the driver's subscriber lets through, to tell each worker (in an agent: the
/// level the driver told it).
pub(crate) fn driver_level() -> String {
    match TO_DRIVER.get() {
        Some(r) => r.level.clone(),
        None => LevelFilter::current().to_string(),
    }
}

/// Lines sent to the driver in one message, at most (and bytes, about).
const BATCH_LINES: usize = 512;
const BATCH_BYTES: usize = 256 * 1024;

#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

type Line = (Stream, String);

/// The thread that writes forwarded lines to the driver's output (it alone may block on it),
/// shared by every worker while any is alive: it ends once the last forwarder has gone and the
/// queue is empty, so that nothing of a worker outlives it.
struct LineWriter {
    tx: Option<Sender<Line>>,
    live: usize,
}

static LINE_WRITER: std::sync::Mutex<LineWriter> =
    std::sync::Mutex::new(LineWriter { tx: None, live: 0 });

fn line_writer() -> std::sync::MutexGuard<'static, LineWriter> {
    LINE_WRITER.lock().unwrap_or_else(|p| p.into_inner())
}

/// A sender to the writer thread, starting it if none runs.
fn register_lines() -> Sender<Line> {
    let mut w = line_writer();
    w.live += 1;
    if let Some(tx) = &w.tx {
        return tx.clone();
    }
    let (tx, rx) = crossbeam_channel::bounded::<Line>(LINE_QUEUE);
    let started = std::thread::Builder::new()
        .name("adag-log-writer".into())
        .spawn(move || {
            // Ends when every sender is gone, after the lines still queued.
            while let Ok((stream, line)) = rx.recv() {
                let Some(driver) = TO_DRIVER.get() else {
                    let _ = match stream {
                        Stream::Stdout => std::io::stdout().lock().write_all(line.as_bytes()),
                        Stream::Stderr => std::io::stderr().lock().write_all(line.as_bytes()),
                    };
                    continue;
                };
                // In an agent: what is queued now, in one message (a network write may wait
                // for the driver; meanwhile the queue takes the lines, or drops and counts).
                let mut bytes = line.len();
                let mut batch = vec![(matches!(stream, Stream::Stderr), line)];
                while batch.len() < BATCH_LINES && bytes < BATCH_BYTES {
                    match rx.try_recv() {
                        Ok((stream, line)) => {
                            bytes += line.len();
                            batch.push((matches!(stream, Stream::Stderr), line));
                        }
                        Err(_) => break,
                    }
                }
                driver.lines(batch);
            }
        });
    if let Err(e) = started {
        // Lines then fill the queue and are dropped: counted, never a hang.
        tracing::warn!(error = %e, "no thread to write worker logs; they will be dropped");
    }
    w.tx = Some(tx.clone());
    tx
}

fn unregister_lines() {
    let mut w = line_writer();
    w.live -= 1;
    if w.live == 0 {
        w.tx = None;
    }
}

/// Start forwarding one worker's stdout, stderr and tracing events to the driver. Returns
/// the count of lines dropped because the driver's output was too slow, and the stop handle:
/// drop it once the worker has exited; the forwarders then pass on what is left in the pipes
/// and end, even if a process the worker launched still holds them.
pub(crate) fn forward(
    name: &str,
    pid: u32,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    events: OwnedFd,
) -> std::io::Result<(Arc<AtomicU64>, OwnedFd)> {
    let (stop_rx, stop_tx) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let stop = Arc::new(stop_rx);
    let dropped = Arc::new(AtomicU64::new(0));
    let mut pipes = Vec::new();
    for (fd, stream) in [(stdout, Stream::Stdout), (stderr, Stream::Stderr)] {
        if let Some(fd) = fd {
            set_nonblocking(&fd)?;
            pipes.push(Pipe {
                fd,
                stream,
                partial: Vec::new(),
                open: true,
            });
        }
    }
    set_nonblocking(&events)?;
    let lines = Lines {
        prefix: match TO_DRIVER.get() {
            Some(r) => format!("({name} pid={pid}, host={}) ", r.host_name),
            None => format!("({name} pid={pid}) "),
        },
        queue: register_lines(),
        dropped: dropped.clone(),
        unsaid: 0,
    };
    let stop_lines = stop.clone();
    if let Err(e) = std::thread::Builder::new()
        .name(format!("adag-log-{name}"))
        .spawn(move || pump_lines(pipes, lines, &stop_lines))
    {
        unregister_lines();
        return Err(e);
    }
    let actor = name.to_string();
    std::thread::Builder::new()
        .name(format!("adag-events-{name}"))
        .spawn(move || pump_events(&actor, pid, &events, &stop))?;
    Ok((dropped, stop_tx))
}

fn set_nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    fcntl_setfl(fd, fcntl_getfl(fd)? | OFlags::NONBLOCK)?;
    Ok(())
}

struct Pipe {
    fd: OwnedFd,
    stream: Stream,
    /// The start of a line whose end has not arrived yet.
    partial: Vec<u8>,
    open: bool,
}

struct Lines {
    prefix: String,
    queue: Sender<Line>,
    dropped: Arc<AtomicU64>,
    /// Dropped since the last line that got through: said once the queue has room.
    unsaid: u64,
}

impl Lines {
    fn note(&self) -> String {
        format!(
            "{}[adag: {} lines of this actor dropped: the driver's output was too slow]\n",
            self.prefix, self.unsaid
        )
    }

    /// Queue one line without ever waiting.
    fn deliver(&mut self, stream: Stream, raw: &[u8]) {
        if self.unsaid > 0 && self.queue.try_send((stream, self.note())).is_ok() {
            self.unsaid = 0;
        }
        let mut line = String::with_capacity(self.prefix.len() + raw.len() + 1);
        line.push_str(&self.prefix);
        line.push_str(&String::from_utf8_lossy(raw));
        line.push('\n');
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.queue.try_send((stream, line))
        {
            self.unsaid += 1;
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Pipe {
    /// Read what the pipe holds now (it never blocks), queueing each whole line.
    fn drain(&mut self, buf: &mut [u8], lines: &mut Lines) {
        while self.open {
            match rustix::io::read(&self.fd, &mut *buf) {
                Ok(0) => self.open = false,
                Ok(n) => {
                    let mut rest = &buf[..n];
                    while let Some(at) = rest.iter().position(|b| *b == b'\n') {
                        if self.partial.is_empty() {
                            lines.deliver(self.stream, &rest[..at]);
                        } else {
                            self.partial.extend_from_slice(&rest[..at]);
                            let whole = std::mem::take(&mut self.partial);
                            lines.deliver(self.stream, &whole);
                        }
                        rest = &rest[at + 1..];
                    }
                    self.partial.extend_from_slice(rest);
                    if self.partial.len() > MAX_LINE {
                        // A line without end: pass it on in pieces.
                        let piece = std::mem::take(&mut self.partial);
                        lines.deliver(self.stream, &piece);
                    }
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => return,
                Err(_) => self.open = false,
            }
        }
    }

    fn finish(&mut self, lines: &mut Lines) {
        if !self.partial.is_empty() {
            let last = std::mem::take(&mut self.partial);
            lines.deliver(self.stream, &last);
        }
    }
}

/// The longest line passed on whole; longer ones are cut in pieces of this size.
const MAX_LINE: usize = 64 * 1024;

fn pump_lines(mut pipes: Vec<Pipe>, mut lines: Lines, stop: &OwnedFd) {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let (stopping, ready) = {
            let mut fds = vec![PollFd::new(stop, PollFlags::IN)];
            fds.extend(
                pipes
                    .iter()
                    .filter(|p| p.open)
                    .map(|p| PollFd::new(&p.fd, PollFlags::IN)),
            );
            if fds.len() == 1 {
                break; // both pipes closed: the worker and everything it launched are gone
            }
            match poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => break,
            }
            let stopping = !fds[0].revents().is_empty();
            let ready: Vec<bool> = fds[1..].iter().map(|f| !f.revents().is_empty()).collect();
            (stopping, ready)
        };
        let mut ready = ready.into_iter();
        for pipe in pipes.iter_mut().filter(|p| p.open) {
            if stopping || ready.next().unwrap_or(false) {
                pipe.drain(&mut buf, &mut lines);
            }
        }
        if stopping {
            break;
        }
    }
    for pipe in &mut pipes {
        pipe.finish(&mut lines);
    }
    if lines.unsaid > 0 {
        // The worker is gone: nothing is left to stall, so the count may wait for room.
        let note = lines.note();
        let _ = lines
            .queue
            .send_timeout((Stream::Stderr, note), Duration::from_secs(5));
    }
    drop(lines);
    unregister_lines();
}

fn pump_events(actor: &str, pid: u32, sock: &OwnedFd, stop: &OwnedFd) {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut buf = vec![0u8; 2 * MAX_EVENT_TEXT + 4096];
    loop {
        let stopping = {
            let mut fds = [
                PollFd::new(stop, PollFlags::IN),
                PollFd::new(sock, PollFlags::IN),
            ];
            match poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => return,
            }
            !fds[0].revents().is_empty()
        };
        // Everything the socket holds now, then (if the worker is gone) stop.
        loop {
            match rustix::net::recv(sock, &mut buf, rustix::net::RecvFlags::DONTWAIT) {
                Ok((n, _)) if n > 0 => match TO_DRIVER.get() {
                    Some(driver) => {
                        driver.event(actor, pid, buf[..n].to_vec());
                    }
                    None => {
                        if let Ok(rec) = postcard::from_bytes::<EventRecord>(&buf[..n]) {
                            emit(actor, pid, None, &rec);
                        }
                    }
                },
                Err(rustix::io::Errno::INTR) => {}
                _ => break,
            }
        }
        if stopping {
            return;
        }
    }
}

/// Emit a worker's event in the driver. `tracing` needs the level at compile time: one arm
/// per level.
fn emit(actor: &str, pid: u32, host: Option<&str>, rec: &EventRecord) {
    macro_rules! at {
        ($level:expr) => {
            match host {
                None => tracing::event!(
                    target: "adag::worker",
                    $level,
                    actor,
                    pid,
                    origin = %rec.target,
                    spans = %rec.spans,
                    "{}{}",
                    rec.message,
                    rec.fields
                ),
                Some(host) => tracing::event!(
                    target: "adag::worker",
                    $level,
                    actor,
                    pid,
                    host,
                    origin = %rec.target,
                    spans = %rec.spans,
                    "{}{}",
                    rec.message,
                    rec.fields
                ),
            }
        };
    }
    match rec.level {
        0 => at!(Level::ERROR),
        1 => at!(Level::WARN),
        2 => at!(Level::INFO),
        3 => at!(Level::DEBUG),
        _ => at!(Level::TRACE),
    }
}

/// In the driver: where the lines and events of workers on other hosts go: the lines into the
/// same queue as local workers' (never waiting: a full queue drops and counts, and says so
/// once there is room), the events through the driver's subscriber with the host as a field.
pub(crate) struct RemoteLogs {
    queue: Sender<Line>,
    dropped: AtomicU64,
}

impl RemoteLogs {
    pub(crate) fn new() -> Arc<RemoteLogs> {
        Arc::new(RemoteLogs {
            queue: register_lines(),
            dropped: AtomicU64::new(0),
        })
    }
}

impl Drop for RemoteLogs {
    fn drop(&mut self) {
        unregister_lines();
    }
}

impl LogSink for RemoteLogs {
    fn lines(&self, host: &str, lines: Vec<(bool, String)>) {
        let unsaid = self.dropped.load(Ordering::Relaxed);
        if unsaid > 0
            && self
                .queue
                .try_send((
                    Stream::Stderr,
                    format!("(host={host}) [adag: {unsaid} lines of workers on other hosts dropped: the driver's output was too slow]\n"),
                ))
                .is_ok()
        {
            self.dropped.fetch_sub(unsaid, Ordering::Relaxed);
        }
        for (stderr, line) in lines {
            let stream = if stderr {
                Stream::Stderr
            } else {
                Stream::Stdout
            };
            if self.queue.try_send((stream, line)).is_err() {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn event(&self, host: &str, actor: &str, pid: u32, record: &[u8]) {
        if let Ok(rec) = postcard::from_bytes::<EventRecord>(record) {
            emit(actor, pid, Some(host), &rec);
        }
    }
}

/// Tracing events of this worker that did not fit its socket to the driver.
static EVENTS_DROPPED: AtomicU64 = AtomicU64::new(0);

/// In a worker: events dropped so far (0 in a driver).
pub(crate) fn events_dropped() -> u64 {
    EVENTS_DROPPED.load(Ordering::Relaxed)
}

/// In a worker: send every `tracing` event at `level` or more severe to the driver over
/// `sock`. Does nothing if the driver lets no event through, or if the actor's code already
/// installed a subscriber of its own.
pub(crate) fn init_worker(sock: OwnedFd, level: &str) {
    let level: LevelFilter = level.parse().unwrap_or(LevelFilter::OFF);
    if level == LevelFilter::OFF {
        return;
    }
    let subscriber = tracing_subscriber::registry().with(Forward { sock }.with_filter(level));
    let _ = tracing::subscriber::set_global_default(subscriber);
}

struct Forward {
    sock: OwnedFd,
}

/// The fields of a span, formatted once when it is created.
struct SpanText(String);

#[derive(Default)]
struct FieldText {
    message: String,
    fields: String,
}

impl tracing::field::Visit for FieldText {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

fn cut(s: &mut String) {
    if s.len() > MAX_EVENT_TEXT {
        let mut at = MAX_EVENT_TEXT;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
        s.push_str("[cut]");
    }
}

impl<S> Layer<S> for Forward
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: Context<'_, S>,
    ) {
        let mut text = FieldText::default();
        attrs.record(&mut text);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut()
                .insert(SpanText(text.fields.trim_start().to_string()));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut text = FieldText::default();
        event.record(&mut text);
        cut(&mut text.message);
        cut(&mut text.fields);
        let mut spans = String::new();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if !spans.is_empty() {
                    spans.push(':');
                }
                spans.push_str(span.name());
                if let Some(t) = span.extensions().get::<SpanText>() {
                    let _ = write!(spans, "{{{}}}", t.0);
                }
            }
        }
        let level = match *meta.level() {
            Level::ERROR => 0,
            Level::WARN => 1,
            Level::INFO => 2,
            Level::DEBUG => 3,
            Level::TRACE => 4,
        };
        let rec = EventRecord {
            level,
            target: meta.target().to_string(),
            message: text.message,
            fields: text.fields,
            spans,
        };
        let sent = postcard::to_stdvec(&rec).ok().and_then(|bytes| {
            rustix::net::send(
                self.sock.as_fd(),
                &bytes,
                rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
            )
            .ok()
        });
        if sent.is_none() {
            EVENTS_DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The socket pair a worker's events travel over: datagrams, so that each event arrives whole
/// or not at all.
pub(crate) fn event_socket() -> std::io::Result<(OwnedFd, OwnedFd)> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType, socketpair};
    Ok(socketpair(
        AddressFamily::UNIX,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?)
}
