//! Tests of the typed read path of shared-memory edges: frames that do not decode as the
//! reader's type (a stale worker binary whose declared type differs), truncated frames and
//! random frame bytes (proptest). What is checked: a typed `ChanError::Codec` naming the
//! reader's type, and the channel still in step afterwards; never a panic, UB or a hang.
use super::shm::{Form, Room, ShmChannel, ShmConfig, ShmRx, ShmTx, Written};
use super::{ChanError, ChannelReader, ChannelWriter, Msg};
use crate::error::TaskError;
use crate::value::Value;
use proptest::prelude::*;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn chans(depth: u32) -> ShmChannel {
    let cfg = ShmConfig {
        depth,
        readers: 1,
        slot_bytes: 256,
        max_message_bytes: 1 << 20,
        ..ShmConfig::default()
    };
    ShmChannel::create(&cfg, "frame-tests").expect("create a shared-memory channel")
}

/// A writer of `W` and a reader of `R` on one shared-memory edge.
fn typed_pair<W: Value, R: Value>(pc: &ShmChannel) -> (ShmTx<W>, ShmRx<R>) {
    (ShmTx::new(pc.writer()), ShmRx::new(pc.reader(0)))
}

fn soon() -> Option<Instant> {
    Some(Instant::now() + Duration::from_secs(5))
}

#[track_caller]
fn codec_error<T: std::fmt::Debug>(r: Result<Msg<T>, ChanError>) -> String {
    match r {
        Err(ChanError::Codec(text)) => text,
        Ok(Msg::Value(v)) => panic!("decoded {v:?} instead of a codec error"),
        Ok(Msg::Error(e)) => panic!("decoded the task error {e:?} instead of a codec error"),
        Err(other) => panic!("expected ChanError::Codec, got {other:?}"),
    }
}

/// Version 1 of a value type, as an old worker binary declares it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct ReplyV1 {
    id: u64,
    name: String,
}

/// Version 2, as the driver declares it: one more field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct ReplyV2 {
    id: u64,
    name: String,
    scores: Vec<f32>,
}

#[test]
fn a_frame_of_another_type_is_a_codec_error_naming_the_type() {
    let pc = chans(4);
    let (mut w, mut r) = typed_pair::<u64, String>(&pc);
    // 300 is the varint [0xac, 0x02]: as a String it announces 300 bytes that are not there.
    w.write(Msg::Value(300), soon()).unwrap();
    let text = codec_error(r.read(soon()));
    assert!(text.contains("alloc::string::String"), "{text}");
    assert!(text.contains("stale worker binary"), "{text}");
    // The bad frame was released: the next ones arrive in order, and the writer can go round
    // the ring more than once.
    for v in [5u64, 1000, 77, 1 << 40, 9, 12] {
        w.write(Msg::Value(v), soon()).unwrap();
        let text = codec_error(r.read(soon()));
        assert!(text.contains("String"), "{v}: {text}");
    }
}

#[test]
fn a_stale_struct_layout_is_a_codec_error() {
    let pc = chans(4);
    let (mut w, mut r) = typed_pair::<ReplyV1, ReplyV2>(&pc);
    w.write(
        Msg::Value(ReplyV1 {
            id: 1,
            name: "x".into(),
        }),
        soon(),
    )
    .unwrap();
    let text = codec_error(r.read(soon()));
    assert!(text.contains("ReplyV2"), "{text}");
}

#[test]
fn task_error_frames_arrive_as_errors_and_values_still_decode() {
    let pc = chans(4);
    let (mut w, mut r) = typed_pair::<ReplyV2, ReplyV2>(&pc);
    let e = Arc::new(TaskError::new("a", "m", "boom"));
    let v = ReplyV2 {
        id: 3,
        name: "n".into(),
        scores: vec![1.5; 100],
    };
    w.write(Msg::Error(e.clone()), soon()).unwrap();
    w.write(Msg::Value(v.clone()), soon()).unwrap();
    match r.read(soon()).unwrap() {
        Msg::Error(got) => assert_eq!(*got, *e),
        Msg::Value(v) => panic!("expected the task error, got {v:?}"),
    }
    match r.read(soon()).unwrap() {
        Msg::Value(got) => assert_eq!(got, v),
        Msg::Error(e) => panic!("expected a value, got {e:?}"),
    }
}

#[test]
fn extra_trailing_bytes_are_not_detected() {
    // A limitation worth knowing: postcard is not self-describing and `from_bytes` ignores
    // trailing bytes, so a value whose encoding *starts* like the reader's type decodes
    // without error (here a (u64, String) read as a u64). Frames carry no type tag; the
    // by-name compile-time check (type names on both sides of the same executable) is what
    // prevents mismatches in a graph.
    let pc = chans(4);
    let (mut w, mut r) = typed_pair::<(u64, String), u64>(&pc);
    w.write(Msg::Value((7, "tail".into())), soon()).unwrap();
    assert!(matches!(r.read(soon()), Ok(Msg::Value(7))));
}

/// A value whose `Serialize` fails (a custom impl, a `RefCell` already borrowed, a type that
/// only serializes in some states).
#[derive(Clone, Debug)]
struct Unserializable;

impl Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "Unserializable refuses to be serialized",
        ))
    }
}

impl<'de> Deserialize<'de> for Unserializable {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <()>::deserialize(d).map(|()| Unserializable)
    }
}

#[test]
fn a_value_that_fails_to_encode_is_a_codec_error() {
    let pc = chans(4);
    let mut w = ShmTx::<Unserializable>::new(pc.writer());
    match w.write(Msg::Value(Unserializable), soon()) {
        // postcard keeps no custom serializer message; the error names the type instead.
        Err(ChanError::Codec(text)) => assert!(
            text.contains("cannot encode") && text.contains("Unserializable"),
            "{text}"
        ),
        other => panic!("expected ChanError::Codec, got {other:?}"),
    }
}

/// The frame of `value`, as the typed writer puts it in a slot.
fn frame_of<T: Serialize>(value: &T) -> Vec<u8> {
    let mut buf = vec![0; 64];
    match crate::value::frame::encode(value, &mut buf) {
        Ok(len) => buf.truncate(len),
        Err(crate::value::frame::EncodeError::TooSmall(needed)) => {
            buf = vec![0; needed];
            let len = crate::value::frame::encode(value, &mut buf)
                .expect("encode into the size asked for");
            assert_eq!(len, needed);
        }
        Err(e) => panic!("{e:?}"),
    }
    buf
}

/// Writes `bytes` as one frame of kind `tag`, bypassing the typed encoder.
fn write_raw(pc: &ShmChannel, w: &mut super::shm::ShmWriter, tag: u8, bytes: &[u8]) {
    let _ = pc;
    w.write_framed(
        tag,
        &mut |buf: &mut [u8]| {
            if buf.len() < bytes.len() {
                return Err(bytes.len());
            }
            buf[..bytes.len()].copy_from_slice(bytes);
            Ok(bytes.len())
        },
        soon(),
    )
    .expect("write a raw frame");
}

/// Writes `bytes` as a bare body of kind `tag` in the slot's line (they fit there, and the
/// channel's frames have all been small: its writer tries the line first).
fn write_raw_bare(w: &mut super::shm::ShmWriter, tag: u8, bytes: &[u8]) {
    w.write(
        tag,
        &mut |buf: &mut [u8], room: Room| {
            assert_eq!(
                room,
                Room::SlotLine,
                "a channel of small frames tries the line"
            );
            buf[..bytes.len()].copy_from_slice(bytes);
            Ok(Written {
                len: bytes.len(),
                form: Form::Bare,
            })
        },
        soon(),
    )
    .expect("write a raw bare body");
}

/// Every frame gives a value, a task error or a codec error naming `T`, at once; so does every
/// one small enough for a slot's line read as a bare body.
fn read_random_frames<T: Value + std::fmt::Debug>(
    frames: &[(u8, Vec<u8>)],
) -> Result<(), TestCaseError> {
    let (framed, bare) = (chans(2), chans(2));
    let (mut w, mut bare_w) = (framed.writer(), bare.writer());
    let mut r = ShmRx::<T>::new(framed.reader(0));
    let mut bare_r = ShmRx::<T>::new(bare.reader(0));
    for (tag, bytes) in frames {
        write_raw(&framed, &mut w, *tag, bytes);
        let mut reads = vec![&mut r];
        if bytes.len() <= SLOT_LINE_ROOM {
            write_raw_bare(&mut bare_w, *tag, bytes);
            reads.push(&mut bare_r);
        }
        for r in reads {
            let t = Instant::now();
            match r.read(soon()) {
                Ok(_) => {}
                Err(ChanError::Codec(text)) => {
                    prop_assert!(text.contains(std::any::type_name::<T>()), "{}", text);
                }
                Err(other) => prop_assert!(false, "frame {:?}: {:?}", bytes, other),
            }
            prop_assert!(t.elapsed() < Duration::from_secs(1));
        }
    }
    Ok(())
}

/// The room for a payload in a slot's own line.
const SLOT_LINE_ROOM: usize = 96;

/// The form each message of `reader` came in.
fn forms(reader: &mut super::shm::ShmReader, n: usize) -> Vec<Form> {
    (0..n).map(|_| reader.read(soon()).unwrap().form).collect()
}

#[test]
fn small_values_travel_bare_in_the_slot_line_and_large_ones_as_frames() {
    // Sizes around the line's room, a value with an attachment, then small ones again.
    let lens = [0usize, 1, 60, 94, 95, 96, 200, 8, 40_000, 3, 2, 90, 5];
    // A buffer's encoding: its variant (inline), its length (a varint), its bytes.
    let fits = |len: usize| 1 + if len < 128 { 1 } else { 2 } + len <= SLOT_LINE_ROOM;
    let value = |len: usize| crate::Buffer::from((0..len).map(|i| i as u8).collect::<Vec<_>>());
    // Typed both ways: every value comes back whole.
    let pc = chans(4);
    let (mut w, mut r) = typed_pair::<crate::Buffer, crate::Buffer>(&pc);
    for len in lens {
        w.write(Msg::Value(value(len)), soon()).unwrap();
        match r.read(soon()).unwrap() {
            Msg::Value(got) => assert_eq!(got, value(len), "{len} bytes"),
            Msg::Error(e) => panic!("{len} bytes: {e:?}"),
        }
    }
    // Read raw: the form of each. After a frame too large for the line the writer goes back
    // to the line one message later (the first small one still goes to its block).
    let pc = chans(4);
    let mut w = ShmTx::<crate::Buffer>::new(pc.writer());
    let mut raw = pc.reader(0);
    let mut expected = Vec::new();
    let mut line_first = true;
    for len in lens {
        w.write(Msg::Value(value(len)), soon()).unwrap();
        let bare = line_first && fits(len);
        expected.push(if bare { Form::Bare } else { Form::Framed });
        line_first = fits(len);
        assert_eq!(
            forms(&mut raw, 1),
            expected[expected.len() - 1..],
            "{len} bytes"
        );
    }
    assert!(expected.contains(&Form::Bare) && expected.contains(&Form::Framed));
    // A small task error travels bare too, and arrives as the error.
    let e = Arc::new(TaskError::new("a", "m", "boom"));
    assert!(postcard::to_allocvec(&*e).unwrap().len() <= SLOT_LINE_ROOM);
    for typed in [true, false] {
        let pc = chans(2);
        let mut w = ShmTx::<u64>::new(pc.writer());
        w.write(Msg::Error(e.clone()), soon()).unwrap();
        if typed {
            match ShmRx::<u64>::new(pc.reader(0)).read(soon()).unwrap() {
                Msg::Error(got) => assert_eq!(*got, *e),
                Msg::Value(v) => panic!("expected the task error, got {v}"),
            }
        } else {
            assert_eq!(forms(&mut pc.reader(0), 1), [Form::Bare]);
        }
    }
}

#[test]
fn a_bare_body_outside_a_slot_line_is_refused() {
    let pc = chans(2);
    let mut w = pc.writer();
    let mut r = ShmRx::<u64>::new(pc.reader(0));
    // A frame too large for the line sends the writer to the block, where a bare body is
    // refused before anything is published.
    write_raw(&pc, &mut w, 0, &frame_of(&(1u64, vec![7u8; 500])));
    assert!(matches!(r.read(soon()), Ok(Msg::Value(1))));
    let err = w
        .write(
            0,
            &mut |buf: &mut [u8], room: Room| {
                assert_eq!(room, Room::Block);
                buf[0] = 9;
                Ok(Written {
                    len: 1,
                    form: Form::Bare,
                })
            },
            soon(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("bare body into a block"), "{err}");
    // Nothing was published; the channel goes on.
    write_raw(&pc, &mut w, 0, &frame_of(&41u64));
    assert!(matches!(r.read(soon()), Ok(Msg::Value(41))));
}

/// Random frames: random bytes, or a random body behind a well-formed header with a random
/// table of attachments (`count` entries of random offsets and lengths, mostly in range).
fn frames() -> impl Strategy<Value = Vec<(u8, Vec<u8>)>> {
    let body = proptest::collection::vec(any::<u8>(), 0..600);
    let table = proptest::collection::vec((0u64..800, 0u64..300), 0..3);
    let framed = (body.clone(), table, any::<bool>()).prop_map(|(body, table, honest)| {
        let mut frame = Vec::new();
        frame.extend((body.len() as u64).to_le_bytes());
        frame.extend((table.len() as u64).to_le_bytes());
        frame.extend(&body);
        for (offset, len) in &table {
            frame.extend(offset.to_le_bytes());
            frame.extend(len.to_le_bytes());
        }
        if honest {
            frame.resize(frame.len() + 1100, 0xab);
        }
        frame
    });
    proptest::collection::vec(
        (
            prop_oneof![Just(0u8), Just(1u8), any::<u8>()],
            prop_oneof![body, framed],
        ),
        1..8,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random frame bytes and tags, read as several types (tag 0 is a value, any other tag
    /// a task error): a value, a task error or `ChanError::Codec`, never a panic or a hang.
    #[test]
    fn random_frames_never_crash(frames in frames()) {
        read_random_frames::<u64>(&frames)?;
        read_random_frames::<String>(&frames)?;
        read_random_frames::<Vec<u8>>(&frames)?;
        read_random_frames::<(u64, String, Vec<u8>)>(&frames)?;
        read_random_frames::<Vec<String>>(&frames)?;
        read_random_frames::<crate::Buffer>(&frames)?;
        read_random_frames::<(crate::Buffer, crate::Tensor)>(&frames)?;
        read_random_frames::<Option<f64>>(&frames)?;
        read_random_frames::<ReplyV2>(&frames)?;
    }

    /// A valid frame cut at any byte: `ChanError::Codec`, and the next whole frame decodes.
    #[test]
    fn truncated_frames_are_codec_errors(id in any::<u64>(), name in ".{0,40}", scores in proptest::collection::vec(any::<f32>(), 0..20), cut in any::<prop::sample::Index>()) {
        let v = ReplyV2 { id, name, scores };
        let bytes = frame_of(&v);
        let k = cut.index(bytes.len());
        let pc = chans(2);
        let mut w = pc.writer();
        let mut r = ShmRx::<ReplyV2>::new(pc.reader(0));
        write_raw(&pc, &mut w, 0, &bytes[..k]);
        match r.read(soon()) {
            Err(ChanError::Codec(text)) => prop_assert!(text.contains("ReplyV2"), "{}", text),
            other => prop_assert!(false, "cut at {} of {}: {:?}", k, bytes.len(), other.map(|_| ())),
        }
        write_raw(&pc, &mut w, 0, &bytes);
        match r.read(soon()) {
            Ok(Msg::Value(got)) => prop_assert!(got.id == v.id && got.name == v.name && got.scores.len() == v.scores.len()),
            other => prop_assert!(false, "the whole frame after a cut one: {:?}", other.map(|_| ())),
        }
    }
}

/// Byte `i` of the payload first sent as message `origin`.
fn payload_byte(origin: u64, i: usize) -> u8 {
    ((i as u64).wrapping_mul(31) ^ origin.wrapping_mul(0x9e37) ^ (i as u64 >> 9)) as u8
}

/// The payload first sent as message `origin`: between 150 and 300 kB, so that every one
/// travels out of band, the channels grow, and every one is read in place (at least a quarter
/// of its block).
fn payload(origin: u64) -> crate::Buffer {
    let len = 150_000 + (origin as usize * 7_919) % 150_000;
    crate::Buffer::from(
        (0..len)
            .map(|i| payload_byte(origin, i))
            .collect::<Vec<_>>(),
    )
}

/// A payload, as the bytes from `skip` on of the one first sent as message `origin`.
type Passed = (u64, u64, crate::Buffer);

#[track_caller]
fn check_passed((origin, skip, data): &Passed, what: &str) {
    let intact = data
        .iter()
        .enumerate()
        .all(|(i, b)| *b == payload_byte(*origin, *skip as usize + i));
    assert!(
        intact,
        "{what}: payload {origin} (from byte {skip}) changed"
    );
}

/// Payloads passed on by reference, as a driver and a process actor do: the "driver" writes
/// fresh payloads, and results it got back, into channel A; the "actor" reads them in place
/// and returns them (or a slice) on channel B, whose reader maps A (one group). The driver
/// keeps some results while the writers go on, and checks every payload whenever it is read
/// and again before it is dropped: a block reused while a reader still holds it shows as a
/// changed payload. At the end every pin was released (no leak, no pin dropped twice), and
/// channel B carried references only.
#[test]
fn payloads_passed_on_by_reference_stay_intact_until_dropped() {
    use super::EndCounters;
    use super::shm::ShmGroup;
    use super::wait::watchdog::{WATCHDOG, with_watchdog};
    use std::collections::VecDeque;
    use std::sync::mpsc;
    const MESSAGES: u64 = 600;
    const HELD: usize = 6;
    with_watchdog(WATCHDOG, || {
        let cfg = |readers_map_group| ShmConfig {
            depth: 2,
            readers: 1,
            slot_bytes: 64 << 10,
            max_message_bytes: 4 << 20,
            group: 0x5eed,
            readers_map_group,
            ..ShmConfig::default()
        };
        let a = ShmChannel::create(&cfg(false), "by-ref-a").unwrap();
        let b = ShmChannel::create(&cfg(true), "by-ref-b").unwrap();
        let group = ShmGroup::new([&a, &b]);
        let on_b = Arc::new(EndCounters::default());

        let mut actor_in = ShmRx::<Passed>::new(a.reader(0));
        let mut actor_out = ShmTx::<Passed>::new(b.writer()).counted(on_b.clone());
        let actor = std::thread::spawn(move || {
            loop {
                let (origin, skip, data) = match actor_in.read(None) {
                    Ok(Msg::Value(v)) => v,
                    Err(ChanError::Closed) => break,
                    other => panic!("actor: {:?}", other.map(|_| ())),
                };
                check_passed(&(origin, skip, data.clone()), "actor");
                // Every third one is passed on as a slice.
                let out = if origin % 3 == 0 {
                    (origin, skip + 16, data.slice(16..))
                } else {
                    (origin, skip, data)
                };
                actor_out.write(Msg::Value(out), None).unwrap();
            }
            actor_out
        });

        let (again_tx, again_rx) = mpsc::channel::<Passed>();
        let mut results = ShmRx::<Passed>::new(b.reader(0).in_group(group));
        let reader = std::thread::spawn(move || {
            let mut held = VecDeque::new();
            for n in 0..MESSAGES {
                let got = match results.read(None) {
                    Ok(Msg::Value(v)) => v,
                    other => panic!("driver: result {n}: {:?}", other.map(|_| ())),
                };
                check_passed(&got, "driver");
                if n % 4 == 1 {
                    // Sent again: by reference to the block it already lies in.
                    let _ = again_tx.send(got.clone());
                }
                held.push_back(got);
                if held.len() > HELD {
                    check_passed(&held.pop_front().unwrap(), "a kept result");
                }
            }
            for kept in &held {
                check_passed(kept, "a kept result, at the end");
            }
        });

        let mut writer = ShmTx::<Passed>::new(a.writer());
        for n in 0..MESSAGES {
            let next = match again_rx.try_recv() {
                Ok(again) if n % 2 == 0 => again,
                _ => (n, 0, payload(n)),
            };
            writer.write(Msg::Value(next), None).unwrap();
        }
        reader.join().unwrap();
        drop(again_rx);
        a.close();
        let actor_out = actor.join().unwrap();
        assert_eq!(writer.pinned_blocks(), 0, "channel A: pins left");
        assert_eq!(actor_out.pinned_blocks(), 0, "channel B: pins left");
        let bytes = on_b.bytes.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            bytes < MESSAGES * 256,
            "channel B carried {bytes} bytes for {MESSAGES} references"
        );
    });
}

/// A buffer built in a channel's lent memory travels by reference: the reader gets the very
/// bytes, in place; a loan still held is never lent again nor overwritten, memory given back is
/// lent again, and every pin is released at the end.
#[test]
fn lent_memory_is_written_by_reference_and_never_reused_while_held() {
    use super::EndCounters;
    const LEN: usize = 100_000;
    let pc = ShmChannel::create(
        &ShmConfig {
            depth: 2,
            readers: 1,
            slot_bytes: 4096,
            max_message_bytes: 1 << 20,
            ..ShmConfig::default()
        },
        "loans",
    )
    .unwrap();
    let counters = Arc::new(EndCounters::default());
    let mut tx = ShmTx::<Passed>::new(pc.writer()).counted(counters.clone());
    let mut rx = ShmRx::<Passed>::new(pc.reader(0));
    let mut held = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for n in 0..200u64 {
        let mut lent = tx.loan(LEN).expect("memory to lend");
        assert!(lent.is_loaned());
        for (i, b) in lent.iter_mut().enumerate() {
            *b = payload_byte(n, i);
        }
        let sent = lent.freeze();
        let at = sent.as_ptr();
        seen.insert(at as usize);
        tx.write(Msg::Value((n, 0, sent)), soon()).unwrap();
        let got = match rx.read(soon()) {
            Ok(Msg::Value(v)) => v,
            other => panic!("message {n}: {:?}", other.map(|_| ())),
        };
        assert_eq!(got.2.as_ptr(), at, "message {n} was copied");
        check_passed(&got, "a lent buffer");
        // Every fifth is kept to the end; the others are dropped at once.
        if n % 5 == 0 {
            held.push(got);
        }
    }
    for kept in &held {
        check_passed(kept, "a kept lent buffer, at the end");
    }
    assert!(
        seen.len() < 100,
        "{} distinct blocks for 200 loans: memory given back is not lent again",
        seen.len()
    );
    let bytes = counters.bytes.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        bytes < 200 * 256,
        "{bytes} bytes written for 200 references"
    );
    drop(held);
    assert_eq!(tx.pinned_blocks(), 0, "pins left");
}
