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
use crossbeam_channel::{Sender, TrySendError};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
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

/// The level the driver's subscriber lets through, to tell each worker.
pub(crate) fn driver_level() -> String {
    LevelFilter::current().to_string()
}

#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// The one thread that writes forwarded lines to the driver's output (it alone may block).
fn line_queue() -> &'static Sender<(Stream, String)> {
    static QUEUE: OnceLock<Sender<(Stream, String)>> = OnceLock::new();
    QUEUE.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::bounded::<(Stream, String)>(LINE_QUEUE);
        let started = std::thread::Builder::new()
            .name("adag-log-writer".into())
            .spawn(move || {
                while let Ok((stream, line)) = rx.recv() {
                    let _ = match stream {
                        Stream::Stdout => std::io::stdout().lock().write_all(line.as_bytes()),
                        Stream::Stderr => std::io::stderr().lock().write_all(line.as_bytes()),
                    };
                }
            });
        if let Err(e) = started {
            // Lines then pile up in the queue and are dropped once it is full: counted, no hang.
            tracing::warn!(error = %e, "no thread to write worker logs; they will be dropped");
        }
        tx
    })
}

/// Start forwarding one worker's stdout, stderr and tracing events to the driver. Returns
/// the count of lines dropped because the driver's output was too slow.
pub(crate) fn forward(
    name: &str,
    pid: u32,
    stdout: Option<impl Read + Send + 'static>,
    stderr: Option<impl Read + Send + 'static>,
    events: OwnedFd,
) -> Arc<AtomicU64> {
    let dropped = Arc::new(AtomicU64::new(0));
    let prefix = format!("({name} pid={pid}) ");
    if let Some(out) = stdout {
        pump_lines(name, out, Stream::Stdout, prefix.clone(), dropped.clone());
    }
    if let Some(err) = stderr {
        pump_lines(name, err, Stream::Stderr, prefix, dropped.clone());
    }
    let actor = name.to_string();
    let spawned = std::thread::Builder::new()
        .name(format!("adag-events-{name}"))
        .spawn(move || pump_events(&actor, pid, events));
    if let Err(e) = spawned {
        tracing::warn!(actor = name, error = %e, "cannot forward the worker's tracing events");
    }
    dropped
}

fn pump_lines(
    name: &str,
    pipe: impl Read + Send + 'static,
    stream: Stream,
    prefix: String,
    dropped: Arc<AtomicU64>,
) {
    let spawned = std::thread::Builder::new()
        .name(format!("adag-log-{name}"))
        .spawn(move || {
            let queue = line_queue();
            let mut pipe = BufReader::with_capacity(64 * 1024, pipe);
            let mut raw = Vec::new();
            // Dropped since the last line that got through: said once the queue has room.
            let mut unsaid = 0u64;
            loop {
                raw.clear();
                match pipe.read_until(b'\n', &mut raw) {
                    Ok(0) | Err(_) => {
                        // The worker is gone: nothing left to stall, so the count may wait a
                        // little for room.
                        if unsaid > 0 {
                            let note = format!(
                                "{prefix}[adag: {unsaid} lines of this actor dropped: the driver's output was too slow]\n"
                            );
                            let _ = queue.send_timeout((stream, note), Duration::from_secs(5));
                        }
                        return;
                    }
                    Ok(_) => {}
                }
                if !raw.ends_with(b"\n") {
                    raw.push(b'\n');
                }
                if unsaid > 0 {
                    let note = format!(
                        "{prefix}[adag: {unsaid} lines of this actor dropped: the driver's output was too slow]\n"
                    );
                    if queue.try_send((stream, note)).is_ok() {
                        unsaid = 0;
                    }
                }
                let mut line = String::with_capacity(prefix.len() + raw.len());
                line.push_str(&prefix);
                line.push_str(&String::from_utf8_lossy(&raw));
                match queue.try_send((stream, line)) {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) => {
                        unsaid += 1;
                        dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(TrySendError::Disconnected(_)) => return,
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(actor = name, error = %e, "cannot forward the worker's output");
    }
}

fn pump_events(actor: &str, pid: u32, sock: OwnedFd) {
    let mut buf = vec![0u8; 2 * MAX_EVENT_TEXT + 4096];
    loop {
        let n = match rustix::net::recv(sock.as_fd(), &mut buf, rustix::net::RecvFlags::empty()) {
            Ok((0, _)) | Err(_) => return,
            Ok((n, _)) => n,
        };
        let Ok(rec) = postcard::from_bytes::<EventRecord>(&buf[..n]) else {
            continue;
        };
        emit(actor, pid, &rec);
    }
}

/// Emit a worker's event in the driver. `tracing` needs the level at compile time: one arm
/// per level.
fn emit(actor: &str, pid: u32, rec: &EventRecord) {
    macro_rules! at {
        ($level:expr) => {
            tracing::event!(
                target: "adag::worker",
                $level,
                actor,
                pid,
                origin = %rec.target,
                spans = %rec.spans,
                "{}{}",
                rec.message,
                rec.fields
            )
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
