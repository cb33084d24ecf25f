//! Tests of the control protocol (`wire`): round trips of every message with chunking and fd
//! passing, and malformed, truncated or lying input, some of it driven by proptest. What is
//! checked: a typed error (or a clean `Ok(None)` for a closed peer), never a panic, an abort,
//! a hang or a leaked fd.
use super::wire::{self, FromWorker, ToWorker, WireFailure};
use crate::compile::plan::{
    ActorPlan, ArgSource, ChannelKind, ChannelPlan, EdgePlan, GraphPlan, Loc, OpSpec,
};
use proptest::prelude::*;
use rustix::net::SendFlags;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

/// A connected pair whose sends and receives give up after 5 s, so that a protocol bug (or
/// a test) that would wait for ever fails instead.
fn pair() -> (OwnedFd, OwnedFd) {
    use rustix::net::sockopt::{Timeout, set_socket_timeout};
    let (a, b) = wire::socket_pair().expect("socketpair");
    for s in [&a, &b] {
        set_socket_timeout(s, Timeout::Recv, Some(Duration::from_secs(5))).expect("SO_RCVTIMEO");
        set_socket_timeout(s, Timeout::Send, Some(Duration::from_secs(5))).expect("SO_SNDTIMEO");
    }
    (a, b)
}

/// Send one raw packet, as a foreign or broken peer would.
fn raw(sock: BorrowedFd<'_>, bytes: &[u8]) {
    rustix::net::send(sock, bytes, SendFlags::NOSIGNAL).expect("send a raw packet");
}

fn header(total: u64) -> [u8; 8] {
    total.to_le_bytes()
}

fn plan() -> GraphPlan {
    let mut edges = BTreeMap::new();
    edges.insert(
        7,
        EdgePlan {
            id: 7,
            label: "a.f#7".into(),
            ty: "u64".into(),
            writer: Loc::Actor(1),
            same_actor: false,
            channels: vec![
                ChannelPlan {
                    id: 7,
                    kind: ChannelKind::InProcess,
                    readers: vec![Loc::Driver],
                    host: 0,
                },
                ChannelPlan {
                    id: 3,
                    kind: ChannelKind::SharedMemory,
                    readers: vec![Loc::Actor(2)],
                    host: 0,
                },
            ],
        },
    );
    GraphPlan {
        graph: 42,
        depth: 10,
        edges,
        actors: vec![ActorPlan {
            actor: 1,
            name: "a".into(),
            ops: vec![
                OpSpec::Compute {
                    node: 7,
                    method: "f".into(),
                    label: None,
                    args: vec![ArgSource::Edge(1), ArgSource::Const(vec![1, 2, 3])],
                },
                OpSpec::Write { edge: 7 },
            ],
        }],
        inputs: vec![1],
        outputs: vec![7],
        comm_groups: vec![],
        hosts: Default::default(),
    }
}

/// Receive until the peer's close (`Ok(None)`) or an error; returns how many messages came.
/// The sender is closed before this runs, so it must finish, and quickly.
fn drain<T: for<'de> serde::Deserialize<'de>>(
    sock: BorrowedFd<'_>,
    max: usize,
) -> Result<usize, std::io::Error> {
    let t = Instant::now();
    let mut n = 0;
    loop {
        assert!(n <= max, "more messages than packets");
        match wire::recv::<T>(sock)? {
            None => return Ok(n),
            Some(_) => n += 1,
        }
        assert!(
            t.elapsed() < Duration::from_secs(4),
            "recv took {:?}",
            t.elapsed()
        );
    }
}

#[test]
fn every_message_round_trips() {
    let (a, b) = pair();
    let big_args: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    let msgs = vec![
        ToWorker::Spawn {
            id: 9,
            name: "w".into(),
            type_name: "crate::W".into(),
            init: vec![1, 2, 3],
            log_level: "info".into(),
        },
        ToWorker::Call {
            method: "m".into(),
            args: Vec::new(),
        },
        // Larger than one packet: split into chunks.
        ToWorker::Call {
            method: "big".into(),
            args: big_args.clone(),
        },
        ToWorker::Install {
            plan: plan(),
            chans: vec![3],
            net: vec![],
            max_message_bytes: 1 << 20,
            timeline: false,
        },
        ToWorker::Shutdown,
    ];
    // Sent from another thread: more than the socket buffer holds is in flight.
    let sent: Vec<String> = msgs.iter().map(|m| format!("{m:?}")).collect();
    let sender = std::thread::spawn(move || {
        for m in &msgs {
            wire::send(a.as_fd(), m, &[]).unwrap();
        }
        a
    });
    for m in &sent {
        let (got, fds) = wire::recv::<ToWorker>(b.as_fd())
            .unwrap()
            .expect("a message");
        assert!(fds.is_empty());
        assert_eq!(&format!("{got:?}"), m);
    }
    let a = sender.join().unwrap();
    let replies = vec![
        FromWorker::Spawned(Ok(())),
        FromWorker::Spawned(Err("new() failed".into())),
        FromWorker::CallResult(Ok(big_args)),
        FromWorker::CallResult(Err(WireFailure::NoSuchMethod)),
        FromWorker::CallResult(Err(WireFailure::BadArgs("x".into()))),
        FromWorker::CallResult(Err(WireFailure::Task(crate::error::MethodError::message(
            "panicked",
        )))),
        FromWorker::CallResult(Err(WireFailure::Busy)),
        FromWorker::Installed(Err("no".into())),
        FromWorker::GraphDone("closed".into()),
    ];
    let sent: Vec<String> = replies.iter().map(|m| format!("{m:?}")).collect();
    let sender = std::thread::spawn(move || {
        for m in &replies {
            wire::send(b.as_fd(), m, &[]).unwrap();
        }
        b
    });
    for m in &sent {
        let (got, _) = wire::recv::<FromWorker>(a.as_fd())
            .unwrap()
            .expect("a reply");
        assert_eq!(&format!("{got:?}"), m);
    }
    let b = sender.join().unwrap();
    drop(a);
    assert!(
        wire::recv::<ToWorker>(b.as_fd()).unwrap().is_none(),
        "a closed peer is Ok(None)"
    );
}

#[test]
fn fds_travel_with_their_message() {
    let (a, b) = pair();
    let (r1, w1) = rustix::pipe::pipe().unwrap();
    let (r2, w2) = rustix::pipe::pipe().unwrap();
    wire::send(
        a.as_fd(),
        &ToWorker::Install {
            plan: plan(),
            chans: vec![3, 4],
            net: vec![],
            max_message_bytes: 1 << 20,
            timeline: false,
        },
        &[w1.as_fd(), w2.as_fd()],
    )
    .unwrap();
    let (_, fds) = wire::recv::<ToWorker>(b.as_fd()).unwrap().unwrap();
    assert_eq!(fds.len(), 2);
    // The received fds are the pipes' write ends: writing to them reaches our read ends.
    rustix::io::write(&fds[0], b"1").unwrap();
    rustix::io::write(&fds[1], b"2").unwrap();
    let mut buf = [0u8; 1];
    rustix::io::read(&r1, &mut buf).unwrap();
    assert_eq!(&buf, b"1");
    rustix::io::read(&r2, &mut buf).unwrap();
    assert_eq!(&buf, b"2");
    // Too many fds for one message: refused by the sender, not sent half.
    let many: Vec<BorrowedFd<'_>> = (0..65).map(|_| w1.as_fd()).collect();
    assert!(wire::send(a.as_fd(), &ToWorker::Shutdown, &many).is_err());
}

#[test]
fn fds_of_a_malformed_message_are_closed() {
    let (a, b) = pair();
    let (r, w) = rustix::pipe::pipe().unwrap();
    // A packet too short to hold the header, carrying the pipe's write end.
    let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = rustix::net::SendAncillaryBuffer::new(&mut space);
    let fds = [w.as_fd()];
    assert!(anc.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
    rustix::net::sendmsg(
        a.as_fd(),
        &[std::io::IoSlice::new(&[1, 2, 3])],
        &mut anc,
        SendFlags::NOSIGNAL,
    )
    .unwrap();
    drop(w);
    assert!(
        wire::recv::<ToWorker>(b.as_fd()).is_err(),
        "a 3-byte packet is malformed"
    );
    // If the received copy of the write end were still open, this read would block (and time
    // out); EOF means it was closed with the malformed message.
    rustix::fs::fcntl_setfl(&r, rustix::fs::OFlags::NONBLOCK).expect("O_NONBLOCK");
    let mut buf = [0u8; 1];
    assert_eq!(rustix::io::read(&r, &mut buf).expect("EOF, not EAGAIN"), 0);
}

#[test]
fn a_header_announcing_a_huge_body_is_an_error_not_an_abort() {
    // Before the fix, `recv` reserved the announced length up front: 2^40 bytes and more
    // aborted the process (allocation failure), `u64::MAX` panicked (capacity overflow).
    for total in [u64::MAX, 1 << 62, 1 << 40, 1 << 33, (64 * 1024 + 1) as u64] {
        let (a, b) = pair();
        let mut p = header(total).to_vec();
        p.extend_from_slice(b"\x01abc");
        raw(a.as_fd(), &p);
        drop(a);
        let t = Instant::now();
        let e = wire::recv::<ToWorker>(b.as_fd()).expect_err("a body shorter than announced");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "total {total}: {:?}",
            t.elapsed()
        );
        assert!(e.to_string().contains("cut short"), "total {total}: {e}");
    }
}

#[test]
fn a_lying_header_is_an_error() {
    // Shorter than the body that came.
    let (a, b) = pair();
    let body = postcard::to_stdvec(&ToWorker::Shutdown).unwrap();
    let mut p = header(0).to_vec();
    p.extend_from_slice(&body);
    p.extend_from_slice(&body);
    raw(a.as_fd(), &p);
    let e = wire::recv::<ToWorker>(b.as_fd()).expect_err("body longer than its header");
    assert!(e.to_string().contains("longer"), "{e}");
    // A short packet.
    raw(a.as_fd(), &[1, 2, 3, 4, 5, 6, 7]);
    let e = wire::recv::<ToWorker>(b.as_fd()).expect_err("7 bytes");
    assert!(e.to_string().contains("truncated"), "{e}");
    // A well-framed body that is no message.
    let mut p = header(3).to_vec();
    p.extend_from_slice(&[0xff, 0xff, 0xff]);
    raw(a.as_fd(), &p);
    let e = wire::recv::<ToWorker>(b.as_fd()).expect_err("garbage body");
    assert!(e.to_string().contains("malformed control message"), "{e}");
    // The connection is still usable for the next, well-formed message.
    wire::send(a.as_fd(), &ToWorker::Shutdown, &[]).unwrap();
    assert!(matches!(
        wire::recv::<ToWorker>(b.as_fd()).unwrap(),
        Some((ToWorker::Shutdown, _))
    ));
}

#[test]
fn a_silent_live_peer_times_out_instead_of_hanging() {
    // The header announces more than was sent and the peer stays connected: the receiver
    // waits for the rest (the protocol has no deadline of its own; the socket timeout set by
    // `pair` bounds it here, and the driver's monitor notices a dead worker independently).
    let (a, b) = pair();
    rustix::net::sockopt::set_socket_timeout(
        &b,
        rustix::net::sockopt::Timeout::Recv,
        Some(Duration::from_millis(200)),
    )
    .unwrap();
    let mut p = header(100).to_vec();
    p.extend_from_slice(&[0; 10]);
    raw(a.as_fd(), &p);
    let t = Instant::now();
    assert!(wire::recv::<ToWorker>(b.as_fd()).is_err());
    assert!(t.elapsed() < Duration::from_secs(2));
    drop(a);
}

fn packet() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // Arbitrary bytes, header included.
        proptest::collection::vec(any::<u8>(), 0..200),
        // A truthful header over a random body: exercises the postcard decoder.
        proptest::collection::vec(any::<u8>(), 0..200).prop_map(|body| {
            let mut p = header(body.len() as u64).to_vec();
            p.extend(body);
            p
        }),
        // A valid message with a few bytes changed.
        (
            0usize..4,
            proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4)
        )
            .prop_map(|(which, flips)| {
                let msg = match which {
                    0 => ToWorker::Call {
                        method: "echo".into(),
                        args: vec![1, 2, 3],
                    },
                    1 => ToWorker::Install {
                        plan: plan(),
                        chans: vec![3],
                        net: vec![1 << 48],
                        max_message_bytes: 1 << 20,
                        timeline: false,
                    },
                    2 => ToWorker::Spawn {
                        id: 1,
                        name: "n".into(),
                        type_name: "t".into(),
                        init: vec![0; 5],
                        log_level: "info".into(),
                    },
                    _ => ToWorker::Shutdown,
                };
                let body = postcard::to_stdvec(&msg).unwrap();
                let mut p = header(body.len() as u64).to_vec();
                p.extend(body);
                for (at, v) in flips {
                    let i = at % p.len();
                    p[i] ^= v;
                }
                p
            }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random packets from a peer that then closes: `recv` returns messages, errors or the
    /// close, each at once, and never panics.
    #[test]
    fn random_packets_never_crash_or_hang(packets in proptest::collection::vec(packet(), 1..5)) {
        for as_reply in [false, true] {
            let (a, b) = pair();
            for p in &packets {
                raw(a.as_fd(), p);
            }
            drop(a);
            let t = Instant::now();
            let _ = if as_reply {
                drain::<FromWorker>(b.as_fd(), packets.len())
            } else {
                drain::<ToWorker>(b.as_fd(), packets.len())
            };
            prop_assert!(t.elapsed() < Duration::from_secs(4));
        }
    }

    /// A valid message (up to several chunks long) cut at any byte, its header kept or made
    /// to match the cut: always an error, never a wrong message or a hang.
    #[test]
    fn truncated_messages_are_errors(args_len in 0usize..200_000, cut in any::<prop::sample::Index>(), fix_header in any::<bool>()) {
        let msg = ToWorker::Call { method: "m".into(), args: vec![7; args_len] };
        let body = postcard::to_stdvec(&msg).unwrap();
        let k = cut.index(body.len());
        let total = if fix_header { k } else { body.len() };
        let (a, b) = pair();
        let mut first = header(total as u64).to_vec();
        let head = k.min(64 * 1024);
        first.extend_from_slice(&body[..head]);
        let rest = body[head..k].to_vec();
        // From another thread: more than the socket buffer holds may be in flight.
        let sender = std::thread::spawn(move || {
            raw(a.as_fd(), &first);
            for chunk in rest.chunks(64 * 1024) {
                raw(a.as_fd(), chunk);
            }
        });
        let t = Instant::now();
        let r = wire::recv::<ToWorker>(b.as_fd());
        sender.join().unwrap();
        prop_assert!(t.elapsed() < Duration::from_secs(4));
        prop_assert!(r.is_err(), "a message cut at {} of {} bytes was accepted", k, body.len());
    }

    /// postcard decoding of arbitrary bytes as either message: Ok or a typed error.
    #[test]
    fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = postcard::from_bytes::<ToWorker>(&bytes);
        let _ = postcard::from_bytes::<FromWorker>(&bytes);
        let _ = postcard::from_bytes::<GraphPlan>(&bytes);
    }
}

#[test]
fn an_empty_packet_reads_as_a_close() {
    // SOCK_SEQPACKET delivers an empty record as a 0-byte read, which `recv` cannot tell from
    // the peer's close: a peer that sends one is treated as gone (the worker exits, the
    // driver's monitor sees it). Documented here so that a change of this is deliberate.
    let (a, b) = pair();
    raw(a.as_fd(), &[]);
    assert!(wire::recv::<ToWorker>(b.as_fd()).unwrap().is_none());
}
