//! The frame of an encoded value, with large byte strings *out of band*: how a value is laid
//! out in a channel slot (shared memory, and later the network) so that its large payloads
//! can be read in place.
//!
//! A value is encoded with postcard, except the byte strings of [`Buffer`](crate::Buffer)s and
//! [`Tensor`](crate::Tensor)s of at least [`OUT_OF_BAND_MIN`] bytes: those are copied once,
//! 64-byte aligned, after the encoding, and the encoding refers to them by index. A reader then
//! hands them to the decoded value in place, as [`Bytes`] over memory the channel keeps alive
//! for them (zero copy: a pinned shared-memory block, see the shared-memory channel's pins).
//!
//! ```text
//! 0        body length n (u64, little endian)
//! 8        attachments k (u64)
//! 16       body: the value in postcard (n bytes)
//! 16 + n   table: k × (offset, length) (u64 pairs); offsets from the frame's start
//! ...      attachments, each 64-byte aligned
//! ```
//!
//! An attachment whose bytes already lie in memory that every reader of the channel maps (a
//! buffer read in place from a channel of the same graph, passed on unchanged or sliced) is
//! not copied: the frame carries a *reference* to it instead ([`Sharing`], chosen by the
//! channel). Its table entry has [`REFERENCE`] set in its offset, which then points to a
//! 64-byte record in the frame:
//!
//! ```text
//! record   REF_MAGIC, then the channel's words: memory id, block, offset, length (u64 each)
//! ```
//!
//! The channel that writes a reference takes one pin of the referenced memory for each of its
//! readers ([`Sharing::commit`]) before it publishes the frame; each reader adopts one when it
//! decodes the frame, and releases it when its value drops the bytes.
//!
//! A value small enough for a shared-memory slot's own line travels as a *bare* body instead
//! ([`encode_bare`]): the postcard body alone, no header, no table, since it cannot hold an
//! attachment; the slot says which of the two it holds.
//!
//! Encoders and decoders find the attachments through a thread-local scope that the frame
//! functions open around postcard, so serde impls need no extra arguments and a value encoded
//! anywhere else (a one-off call, a user's own serializer) simply carries its bytes inline.
use bytes::Bytes;
use serde::de::{self, DeserializeOwned, Deserializer, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};
use std::cell::{Cell, RefCell};
use std::fmt;

/// Byte strings at least this long travel out of band; shorter ones are cheaper inline.
pub(crate) const OUT_OF_BAND_MIN: usize = 16 * 1024;

/// A reader keeps an attachment in place only if it fills at least this fraction of its block:
/// a value kept by the user then never holds more than 4 × its size of shared memory. Smaller
/// attachments are copied.
const IN_PLACE_MIN_FILL: usize = 4;

/// Copies of at least this many bytes are split over several threads: one thread copies about
/// 8 GB/s on this kind of machine, two about 14 GB/s (a 100 MiB copy: 12.6 ms against 7.3 ms),
/// while starting a scoped thread costs some tens of microseconds.
const PARALLEL_COPY_MIN: usize = 8 << 20;
/// More copying threads than this gain nothing (memory bandwidth; 4 were slower than 2 here).
const MAX_COPY_THREADS: usize = 4;

const HEADER: usize = 16;
const TABLE_ENTRY: usize = 16;
const ALIGN: usize = 64;

/// Set in a table entry's offset: the entry is a reference, and the offset (without this bit)
/// points to its record.
const REFERENCE: u64 = 1 << 63;
/// The first word of a reference record (a broken frame is unlikely to carry it by chance).
const REF_MAGIC: u64 = u64::from_le_bytes(*b"adag-ref");
/// Bytes of a reference record in the frame: the magic and four words, padded.
const REF_RECORD: usize = 64;

/// Where an attachment already lies in memory that a channel's readers map: four words that
/// only the channel interprets (which memory, which block, where, how long).
pub(crate) type Location = [u64; 4];

/// How a channel takes part in encoding and decoding frames by reference. The default does not:
/// every attachment is copied, and a frame holding a reference fails to decode.
pub(crate) trait Sharing {
    /// Where `bytes` lie, if every reader of the channel maps that memory and the bytes are
    /// kept alive (pinned) by `bytes` itself. Called while encoding, maybe more than once per
    /// attachment; must not change anything.
    fn locate(&self, _bytes: &Bytes) -> Option<Location> {
        None
    }

    /// Called once per reference of a frame that will be published, before the publish, while
    /// `bytes` is still alive: takes one pin of the memory for each reader of the channel.
    fn commit(&self, _bytes: &Bytes, _at: &Location) {}

    /// A reader adopts one pin of the memory at `at` (taken by the writer's
    /// [`commit`](Self::commit)) and returns its bytes, which release it when dropped.
    fn adopt(&self, _at: &Location) -> Result<Bytes, String> {
        Err("a reference to shared memory outside of a shared-memory channel".into())
    }
}

/// No sharing: every attachment is copied, and a frame holding a reference does not decode
/// (the network's frames: a reference names memory only the writer's host maps).
pub(crate) struct Copied;

impl Sharing for Copied {}

/// What the frame functions keep per thread. One thread-local for all of it, looked up once
/// per encoding or decoding: in the Python extension each look is a call into the dynamic
/// loader (`__tls_get_addr`), and an encoding looked four times.
struct Frames {
    /// While a frame is encoded on this thread: the attachments so far.
    encoding: RefCell<Option<Vec<Bytes>>>,
    /// While a frame is decoded on this thread: its attachments, by index.
    decoding: RefCell<Option<Vec<Bytes>>>,
    /// Why adag's own `Serialize` impls (a device tensor) last failed on this thread:
    /// postcard keeps no custom error text (it reports "Serde Serialization Error"), so the
    /// impl notes it here for the encoder to report.
    failure: Cell<Option<String>>,
}

thread_local! {
    static FRAMES: Frames = const {
        Frames {
            encoding: RefCell::new(None),
            decoding: RefCell::new(None),
            failure: Cell::new(None),
        }
    };
}

/// Note why a `Serialize` impl fails (see [`Frames::failure`]); returns the text for the
/// serializer's own error.
pub(crate) fn note_serialize_failure(text: String) -> String {
    FRAMES.with(|frames| frames.failure.set(Some(text.clone())));
    text
}

/// Opens a scope on `cell` holding `value`; the previous state comes back on drop (also when
/// a serde impl panics), so scopes nest.
struct Scope<'a> {
    cell: &'a RefCell<Option<Vec<Bytes>>>,
    previous: Option<Vec<Bytes>>,
}

impl<'a> Scope<'a> {
    fn open(cell: &'a RefCell<Option<Vec<Bytes>>>, value: Vec<Bytes>) -> Self {
        let previous = cell.replace(Some(value));
        Scope { cell, previous }
    }

    /// Empties the scope's list (a failed attempt is encoded again).
    fn reset(&self) {
        if let Some(list) = self.cell.borrow_mut().as_mut() {
            list.clear();
        }
    }

    fn take(&self) -> Vec<Bytes> {
        self.cell
            .borrow_mut()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        *self.cell.borrow_mut() = self.previous.take();
    }
}

/// Turns a postcard error into why an encoding failed (the reason an adag type noted, if any).
type Failed<'a> = &'a dyn Fn(postcard::Error) -> EncodeError;

/// Runs `encode` (postcard over a value) in an encoding scope, with no failure reason left
/// over from before (a reason noted for a failure reported elsewhere must not be taken for
/// this one); returns its answer and the attachments it set aside. `encode` gets the scope
/// (to reset it before a second attempt) and what turns a postcard error into the reason.
fn encoding<R>(
    encode: impl FnOnce(&Scope<'_>, Failed<'_>) -> Result<R, EncodeError>,
) -> Result<(R, Vec<Bytes>), EncodeError> {
    FRAMES.with(|frames| {
        frames.failure.take();
        let scope = Scope::open(&frames.encoding, Vec::new());
        let failed = |e: postcard::Error| {
            EncodeError::Failed(frames.failure.take().unwrap_or_else(|| e.to_string()))
        };
        let answer = encode(&scope, &failed)?;
        Ok((answer, scope.take()))
    })
}

/// How a byte string is written: inline, or as the index of an attachment.
#[derive(Serialize)]
enum Wire<'a> {
    Inline(#[serde(with = "serde_bytes")] &'a [u8]),
    Attached(u32),
}

/// Serializes `bytes` out of band when a frame is being encoded and they are large enough,
/// else inline.
pub(crate) fn serialize_bytes<S: Serializer>(
    bytes: &Bytes,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let index = if bytes.len() >= OUT_OF_BAND_MIN {
        FRAMES.with(|frames| {
            frames.encoding.borrow_mut().as_mut().map(|list| {
                list.push(bytes.clone());
                list.len() as u32 - 1
            })
        })
    } else {
        None
    };
    match index {
        Some(index) => Wire::Attached(index).serialize(serializer),
        None => Wire::Inline(bytes.as_ref()).serialize(serializer),
    }
}

/// Deserializes what [`serialize_bytes`] wrote: an attachment of the frame being decoded (in
/// place when it is), or inline bytes copied to the heap.
/// Also reads a plain byte string or a sequence of bytes.
pub(crate) fn deserialize_bytes<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Bytes, D::Error> {
    struct WireVisitor;
    impl<'de> Visitor<'de> for WireVisitor {
        type Value = Bytes;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a byte string, inline or out of band")
        }
        fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<Bytes, A::Error> {
            use de::VariantAccess;
            #[derive(Deserialize)]
            enum Kind {
                Inline,
                Attached,
            }
            let (kind, variant) = data.variant::<Kind>()?;
            match kind {
                Kind::Inline => variant.newtype_variant_seed(InlineSeed),
                Kind::Attached => {
                    let index: u32 = variant.newtype_variant()?;
                    attachment(index).map_err(de::Error::custom)
                }
            }
        }
        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Bytes, E> {
            InlineVisitor.visit_bytes(v)
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Bytes, A::Error> {
            InlineVisitor.visit_seq(seq)
        }
    }
    deserializer.deserialize_enum("Wire", &["Inline", "Attached"], WireVisitor)
}

struct InlineSeed;

impl<'de> de::DeserializeSeed<'de> for InlineSeed {
    type Value = Bytes;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Bytes, D::Error> {
        d.deserialize_bytes(InlineVisitor)
    }
}

struct InlineVisitor;

impl<'de> Visitor<'de> for InlineVisitor {
    type Value = Bytes;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte string")
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Bytes, E> {
        Ok(heap_copy(v))
    }
    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
        Ok(Bytes::from(v))
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Bytes, A::Error> {
        let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        while let Some(b) = seq.next_element::<u8>()? {
            v.push(b);
        }
        self.visit_byte_buf(v)
    }
}

/// A copy of `data` on the heap. One allocation, not zeroed: the allocator's alignment (16
/// bytes with glibc) suits every tensor dtype, and a tensor made from a less aligned buffer
/// copies it again (`Tensor::from_bytes`), so alignment is never wrong, only rarely slower.
fn heap_copy(data: &[u8]) -> Bytes {
    Bytes::copy_from_slice(data)
}

fn attachment(index: u32) -> Result<Bytes, String> {
    FRAMES.with(|frames| match frames.decoding.borrow().as_ref() {
        None => Err(format!(
            "attachment {index} referred to outside of a shared-memory frame"
        )),
        Some(list) => list.get(index as usize).cloned().ok_or_else(|| {
            format!(
                "attachment {index} of a frame with {} attachments",
                list.len()
            )
        }),
    })
}

/// Why a value could not be encoded into a buffer.
#[derive(Debug)]
pub(crate) enum EncodeError {
    /// The frame needs this many bytes.
    TooSmall(usize),
    /// The value cannot be encoded at all: why (the reason an adag type noted, else the
    /// encoder's text).
    Failed(String),
}

/// Where the table and each attachment of a frame go (a reference takes its record's bytes);
/// returns the frame's total length.
fn place(
    body: usize,
    attachments: &[Bytes],
    located: &[Option<Location>],
    mut at: impl FnMut(usize, usize),
) -> usize {
    let table = HEADER + body;
    let mut end = table + attachments.len() * TABLE_ENTRY;
    for (index, data) in attachments.iter().enumerate() {
        let offset = end.next_multiple_of(ALIGN);
        at(index, offset);
        let len = match located[index] {
            Some(_) => REF_RECORD,
            None => data.len(),
        };
        end = offset + len;
    }
    end
}

/// Encodes `value` as a frame into `buf`, copying every attachment; returns the frame's length.
#[cfg(all(test, not(loom)))]
pub(crate) fn encode<T: Serialize + ?Sized>(
    value: &T,
    buf: &mut [u8],
) -> Result<usize, EncodeError> {
    encode_in(value, buf, &Copied)
}

/// Encodes `value` as a frame into `buf` for a channel that shares memory as `sharing` says
/// (attachments it locates travel by reference); returns the frame's length. On success the
/// frame's references are committed: publish it.
pub(crate) fn encode_in<T: Serialize + ?Sized>(
    value: &T,
    buf: &mut [u8],
    sharing: &dyn Sharing,
) -> Result<usize, EncodeError> {
    // `Ok(written)`, or `Err(needed)`: the body's length when it does not fit.
    let (body, attachments) = encoding(|scope, failed| {
        let written = match buf.get_mut(HEADER..) {
            Some(room) => match postcard::to_slice(value, room) {
                Ok(body) => Some(body.len()),
                Err(postcard::Error::SerializeBufferFull) => None,
                Err(e) => return Err(failed(e)),
            },
            None => None,
        };
        match written {
            Some(len) => Ok(Ok(len)),
            None => {
                scope.reset();
                Ok(Err(
                    postcard::experimental::serialized_size(value).map_err(failed)?
                ))
            }
        }
    })?;
    let body = match body {
        Ok(len) => len,
        Err(needed) => {
            let located: Vec<_> = attachments.iter().map(|b| sharing.locate(b)).collect();
            return Err(EncodeError::TooSmall(place(
                needed,
                &attachments,
                &located,
                |_, _| (),
            )));
        }
    };
    let located: Vec<_> = attachments.iter().map(|b| sharing.locate(b)).collect();
    let total = place(body, &attachments, &located, |_, _| ());
    if total > buf.len() {
        return Err(EncodeError::TooSmall(total));
    }
    buf[..8].copy_from_slice(&(body as u64).to_le_bytes());
    buf[8..HEADER].copy_from_slice(&(attachments.len() as u64).to_le_bytes());
    let table = HEADER + body;
    place(body, &attachments, &located, |index, offset| {
        let data = &attachments[index];
        let entry = table + index * TABLE_ENTRY;
        let tagged = match &located[index] {
            Some(at) => {
                let words = [REF_MAGIC, at[0], at[1], at[2], at[3]];
                for (i, word) in words.iter().enumerate() {
                    buf[offset + i * 8..offset + i * 8 + 8].copy_from_slice(&word.to_le_bytes());
                }
                offset as u64 | REFERENCE
            }
            None => {
                copy(&mut buf[offset..offset + data.len()], data);
                offset as u64
            }
        };
        buf[entry..entry + 8].copy_from_slice(&tagged.to_le_bytes());
        buf[entry + 8..entry + TABLE_ENTRY].copy_from_slice(&(data.len() as u64).to_le_bytes());
    });
    // The frame is complete: take the readers' pins of what it refers to.
    for (data, at) in attachments.iter().zip(&located) {
        if let Some(at) = at {
            sharing.commit(data, at);
        }
    }
    Ok(total)
}

/// Encodes `value` into `buf` as a frame's *bare body*: its postcard encoding alone, with no
/// header and no table, for a channel slot's own line (a few dozen bytes), where no attachment
/// fits anyway (an attachment is at least [`OUT_OF_BAND_MIN`] bytes, a reference's record
/// alone [`REF_RECORD`]). Returns its length, or `None` when it does not fit, fails to encode,
/// or an encoding scope is open on this thread (its byte strings would be attached): the
/// caller then encodes a whole frame, which tells the size or the reason.
pub(crate) fn encode_bare<T: Serialize + ?Sized>(value: &T, buf: &mut [u8]) -> Option<usize> {
    // No scope here, so byte strings go inline: a large one does not fit, and a small one is
    // inline in a frame too.
    if FRAMES.with(|frames| frames.encoding.borrow().is_some()) {
        return None;
    }
    postcard::serialize_with_flavor(value, Line { buf, len: 0 }).ok()
}

/// Postcard's output into a slot line's few dozen bytes. Postcard hands most of a small value
/// over in runs of 1 to 10 bytes (its varints), which its `Slice` output copies with a call
/// to `memmove` each, a tenth of a small message's whole write and read; short runs are
/// copied here byte by byte.
struct Line<'a> {
    buf: &'a mut [u8],
    len: usize,
}

/// Runs up to this long are copied byte by byte.
const SHORT_RUN: usize = 16;

impl postcard::ser_flavors::Flavor for Line<'_> {
    type Output = usize;

    #[inline(always)]
    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        let at = self
            .buf
            .get_mut(self.len)
            .ok_or(postcard::Error::SerializeBufferFull)?;
        *at = byte;
        self.len += 1;
        Ok(())
    }

    #[inline(always)]
    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        if data.len() <= SHORT_RUN {
            return data.iter().try_for_each(|byte| self.try_push(*byte));
        }
        let end = self.len + data.len();
        self.buf
            .get_mut(self.len..end)
            .ok_or(postcard::Error::SerializeBufferFull)?
            .copy_from_slice(data);
        self.len = end;
        Ok(())
    }

    fn finalize(self) -> postcard::Result<usize> {
        Ok(self.len)
    }
}

/// Decodes a bare body ([`encode_bare`]).
pub(crate) fn decode_bare<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    postcard::from_bytes(body).map_err(|e| e.to_string())
}

/// A frame encoded for a stream (the network): its head (header, body and table) in one
/// buffer, and its attachments where they already are, each after the zero padding that
/// aligns it. Written in order they are the bytes [`encode`] would place in a slot; nothing
/// large is copied to build it.
pub(crate) struct Gathered {
    pub head: Vec<u8>,
    /// (padding before it, the attachment).
    pub attachments: Vec<(usize, Bytes)>,
    pub total: usize,
}

/// Encodes `value` as a [`Gathered`] frame.
pub(crate) fn encode_gathered<T: Serialize + ?Sized>(value: &T) -> Result<Gathered, EncodeError> {
    let (head, attachments) =
        encoding(|_, failed| postcard::to_extend(value, vec![0u8; HEADER]).map_err(failed))?;
    let body = head.len() - HEADER;
    let mut head = head;
    head[..8].copy_from_slice(&(body as u64).to_le_bytes());
    head[8..HEADER].copy_from_slice(&(attachments.len() as u64).to_le_bytes());
    let mut offsets = Vec::with_capacity(attachments.len());
    // Nothing by reference over a stream: its readers map none of the writer's memory.
    let copied = vec![None; attachments.len()];
    let total = place(body, &attachments, &copied, |_, offset| {
        offsets.push(offset)
    });
    for (data, offset) in attachments.iter().zip(&offsets) {
        head.extend_from_slice(&(*offset as u64).to_le_bytes());
        head.extend_from_slice(&(data.len() as u64).to_le_bytes());
    }
    let mut end = head.len();
    let attachments = attachments
        .into_iter()
        .zip(offsets)
        .map(|(data, offset)| {
            let pad = offset - end;
            end = offset + data.len();
            (pad, data)
        })
        .collect();
    Ok(Gathered {
        head,
        attachments,
        total,
    })
}

/// `dst.copy_from_slice(src)`, on several threads for a large copy. The threads are scoped:
/// joined before this returns (so the copy happens before the caller publishes it), and none
/// outlives the call.
fn copy(dst: &mut [u8], src: &[u8]) {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let threads = if src.len() >= PARALLEL_COPY_MIN {
        *THREADS.get_or_init(|| {
            std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(MAX_COPY_THREADS)
        })
    } else {
        1
    };
    if threads <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    let chunk = src.len().div_ceil(threads).next_multiple_of(4096);
    // Each thread, this one included, takes chunks until none is left: a thread that cannot
    // start leaves its share to the others.
    let chunks = parking_lot::Mutex::new(
        dst.chunks_mut(chunk)
            .zip(src.chunks(chunk))
            .collect::<Vec<_>>(),
    );
    let work = || {
        loop {
            // Its own statement: the lock is not held during the copy.
            let next = chunks.lock().pop();
            let Some((to, from)) = next else { break };
            to.copy_from_slice(from);
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            let spawned = std::thread::Builder::new()
                .name("adag-copy".into())
                .spawn_scoped(scope, work);
            if let Err(err) = spawned {
                tracing::debug!(%err, "no thread for a parallel copy; copying here");
                break;
            }
        }
        work();
    });
}

/// A frame's parts, checked against its length.
struct Parts<'a> {
    body: &'a [u8],
    /// Each attachment: in the frame, or a reference to memory elsewhere.
    table: Vec<Entry>,
}

/// One attachment of a frame.
#[derive(Debug, Clone, Copy)]
enum Entry {
    /// (offset, length) of bytes in the frame.
    Inline(usize, usize),
    /// Bytes in memory the channel's readers map, and their length.
    Reference(Location, usize),
}

fn word(data: &[u8], at: usize) -> Option<usize> {
    let bytes = data.get(at..at + 8)?;
    usize::try_from(u64::from_le_bytes(bytes.try_into().ok()?)).ok()
}

fn parts(data: &[u8]) -> Result<Parts<'_>, String> {
    let broken = |what: &str| format!("a broken frame of {} bytes: {what}", data.len());
    let body_len = word(data, 0).ok_or_else(|| broken("no header"))?;
    let count = word(data, 8).ok_or_else(|| broken("no header"))?;
    let table_at = HEADER
        .checked_add(body_len)
        .filter(|end| *end <= data.len())
        .ok_or_else(|| broken("the body runs past the end"))?;
    let table_len = count
        .checked_mul(TABLE_ENTRY)
        .filter(|len| *len <= data.len() - table_at)
        .ok_or_else(|| broken("the table runs past the end"))?;
    let table = (0..count)
        .map(|index| {
            let entry = table_at + index * TABLE_ENTRY;
            let (offset, len) = (word(data, entry), word(data, entry + 8));
            let reference = offset.filter(|o| *o as u64 & REFERENCE != 0);
            if let (Some(tagged), Some(len)) = (reference, len) {
                let at = (tagged as u64 & !REFERENCE) as usize;
                let record = (at >= table_at + table_len)
                    .then(|| {
                        (0..5)
                            .map(|i| word(data, at + i * 8))
                            .collect::<Option<Vec<_>>>()
                    })
                    .flatten()
                    .filter(|words| words[0] as u64 == REF_MAGIC);
                return match record {
                    Some(w) => Ok(Entry::Reference(
                        [w[1] as u64, w[2] as u64, w[3] as u64, w[4] as u64],
                        len,
                    )),
                    None => Err(broken(&format!("reference {index} has no record"))),
                };
            }
            match (offset, len) {
                (Some(offset), Some(len))
                    if offset >= table_at + table_len
                        && offset.checked_add(len).is_some_and(|end| end <= data.len()) =>
                {
                    Ok(Entry::Inline(offset, len))
                }
                _ => Err(broken(&format!(
                    "attachment {index} lies outside the frame"
                ))),
            }
        })
        .collect::<Result<_, _>>()?;
    Ok(Parts {
        body: &data[HEADER..table_at],
        table,
    })
}

/// Decodes a frame read in place from a channel's memory: `data` is the frame, `capacity` the
/// bytes of the block it lies in (what keeping it in place holds), and `keep` returns the whole
/// of `data` as [`Bytes`] that stay valid after the channel's slot is released (a pin). Large
/// attachments are handed to the value in place, keeping `keep`'s bytes for as long as the
/// value keeps them; `keep` is called only when one is.
///
/// References are adopted through `sharing` (each takes over one pin, released when the value
/// drops the bytes), every one of them even when the value turns out not to decode.
pub(crate) fn decode<T: DeserializeOwned>(
    data: &[u8],
    capacity: usize,
    keep: impl FnOnce() -> Bytes,
    sharing: &dyn Sharing,
) -> Result<T, String> {
    let Parts { body, table } = parts(data)?;
    if table.is_empty() {
        // The common case: no attachment, so no scope to open.
        return postcard::from_bytes(body).map_err(|e| e.to_string());
    }
    let in_place = |len: usize| len >= OUT_OF_BAND_MIN && len * IN_PLACE_MIN_FILL >= capacity;
    let pinned = table
        .iter()
        .any(|entry| matches!(entry, Entry::Inline(_, len) if in_place(*len)))
        .then(keep);
    // Every reference is adopted before any error is returned: each holds a pin.
    let attachments: Vec<Result<Bytes, String>> = table
        .iter()
        .map(|entry| match *entry {
            Entry::Inline(offset, len) => Ok(match &pinned {
                Some(whole) if in_place(len) => whole.slice(offset..offset + len),
                _ => heap_copy(&data[offset..offset + len]),
            }),
            Entry::Reference(at, len) => sharing.adopt(&at).and_then(|bytes| {
                if bytes.len() == len {
                    Ok(bytes)
                } else {
                    Err(format!(
                        "a reference of {len} bytes to {} bytes",
                        bytes.len()
                    ))
                }
            }),
        })
        .collect();
    let attachments = attachments.into_iter().collect::<Result<_, _>>()?;
    decode_body(body, attachments)
}

/// Decodes a frame's body, its attachments at hand for the values that refer to them.
fn decode_body<T: DeserializeOwned>(body: &[u8], attachments: Vec<Bytes>) -> Result<T, String> {
    FRAMES.with(|frames| {
        let _scope = Scope::open(&frames.decoding, attachments);
        postcard::from_bytes(body).map_err(|e| e.to_string())
    })
}

/// Decodes a frame held in ordinary memory (tests): attachments are copied.
#[cfg(all(test, not(loom)))]
pub(crate) fn decode_slice<T: DeserializeOwned>(data: &[u8]) -> Result<T, String> {
    let Parts { body, table } = parts(data)?;
    let attachments = table
        .iter()
        .map(|entry| match *entry {
            Entry::Inline(offset, len) => Ok(heap_copy(&data[offset..offset + len])),
            Entry::Reference(at, _) => Copied.adopt(&at),
        })
        .collect::<Result<_, _>>()?;
    decode_body(body, attachments)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{Buffer, Tensor};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Mixed {
        small: Buffer,
        large: Buffer,
        tensor: Tensor,
        label: String,
    }

    fn mixed() -> Mixed {
        Mixed {
            small: Buffer::from(vec![1u8; 100]),
            large: Buffer::from((0..100_000u32).map(|i| i as u8).collect::<Vec<_>>()),
            tensor: Tensor::from_vec((0..9_000).map(|i| i as f64).collect(), [90, 100]).unwrap(),
            label: "mixed".into(),
        }
    }

    /// Encodes into a buffer of exactly the size the encoder asks for.
    fn encode_fitted<T: Serialize>(value: &T) -> Vec<u8> {
        let needed = match encode(value, &mut []) {
            Err(EncodeError::TooSmall(needed)) => needed,
            other => panic!("an empty buffer should be too small: {other:?}"),
        };
        let mut buf = vec![0; needed];
        assert_eq!(encode(value, &mut buf).unwrap(), needed);
        // One byte less does not fit, and says so with the same size.
        let mut short = vec![0; needed - 1];
        assert!(matches!(encode(value, &mut short), Err(EncodeError::TooSmall(n)) if n == needed));
        buf
    }

    #[test]
    fn a_bare_body_round_trips_and_declines_what_needs_a_frame() {
        let mut line = [0u8; 96];
        let value = (7u64, "seven".to_string(), Buffer::from(vec![3u8; 40]));
        let len = encode_bare(&value, &mut line).expect("fits the line");
        assert_eq!(len, postcard::to_allocvec(&value).unwrap().len());
        assert_eq!(
            decode_bare::<(u64, String, Buffer)>(&line[..len]).unwrap(),
            value
        );
        // Too long for the line; a buffer that would be an attachment in a frame.
        assert_eq!(encode_bare(&vec![1u8; 200], &mut line), None);
        assert_eq!(
            encode_bare(&Buffer::from(vec![1u8; OUT_OF_BAND_MIN]), &mut line),
            None
        );
        // Inside an encoding scope a large buffer would be attached: a frame it is.
        let inside = encoding(|_, _| Ok(encode_bare(&5u64, &mut line)))
            .unwrap()
            .0;
        assert_eq!(inside, None);
        assert!(
            encode_bare(&5u64, &mut line).is_some(),
            "the scope is closed again"
        );
        // A failing value declines too (the frame's encoding says why).
        struct Refuses;
        impl Serialize for Refuses {
            fn serialize<S: Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(serde::ser::Error::custom("no"))
            }
        }
        assert_eq!(encode_bare(&Refuses, &mut line), None);
    }

    #[test]
    fn large_byte_strings_travel_out_of_band_aligned() {
        let value = mixed();
        let frame = encode_fitted(&value);
        let Parts { body, table } = parts(&frame).unwrap();
        // The large buffer and the tensor's 72,000 bytes; the small buffer is inline.
        assert_eq!(table.len(), 2, "{table:?}");
        assert!(body.len() < 200, "body of {} bytes", body.len());
        let inline: Vec<(usize, usize)> = table
            .iter()
            .map(|entry| match *entry {
                Entry::Inline(offset, len) => (offset, len),
                Entry::Reference(..) => panic!("a reference without sharing"),
            })
            .collect();
        assert_eq!(inline[0].1, 100_000);
        assert_eq!(inline[1].1, 72_000);
        assert!(inline.iter().all(|(offset, _)| offset % ALIGN == 0));
        assert_eq!(&frame[inline[0].0..][..100_000], &value.large[..]);
        assert_eq!(decode_slice::<Mixed>(&frame).unwrap(), value);
    }

    #[test]
    fn values_without_large_bytes_have_no_attachments() {
        let value = (7u64, Buffer::from(vec![3u8; 10]), "x".to_string());
        let frame = encode_fitted(&value);
        assert!(parts(&frame).unwrap().table.is_empty());
        assert_eq!(
            decode_slice::<(u64, Buffer, String)>(&frame).unwrap(),
            value
        );
    }

    #[test]
    fn an_attachment_index_outside_a_frame_is_an_error() {
        let attached = postcard::to_stdvec(&Wire::Attached(0)).unwrap();
        let err = postcard::from_bytes::<Buffer>(&attached).unwrap_err();
        assert!(matches!(err, postcard::Error::SerdeDeCustom), "{err:?}");
        // Inside a frame, an index past its table.
        let mut frame = Vec::new();
        frame.extend((attached.len() as u64).to_le_bytes());
        frame.extend(0u64.to_le_bytes());
        frame.extend(&attached);
        // (postcard keeps no custom message: the error is its generic one.)
        assert!(decode_slice::<Buffer>(&frame).is_err());
        frame[8..16].copy_from_slice(&1u64.to_le_bytes());
        assert!(
            decode_slice::<Buffer>(&frame).is_err(),
            "a table past the frame's end"
        );
    }

    /// Large copies are split over threads; every byte lands where it belongs, whatever the
    /// size's remainder.
    #[test]
    fn large_copies_are_exact() {
        for len in [
            PARALLEL_COPY_MIN - 1,
            PARALLEL_COPY_MIN,
            3 * PARALLEL_COPY_MIN + 12_345,
        ] {
            let src: Vec<u8> = (0..len as u64).map(|i| (i ^ (i >> 11)) as u8).collect();
            let mut dst = vec![0u8; len + 2];
            copy(&mut dst[1..=len], &src);
            assert!(dst[1..=len] == src[..], "a copy of {len} bytes differs");
            assert_eq!(
                (dst[0], dst[len + 1]),
                (0, 0),
                "a copy of {len} bytes overran"
            );
        }
        let value = Buffer::from(
            (0..20u32 << 20)
                .map(|i| (i % 253) as u8)
                .collect::<Vec<_>>(),
        );
        let frame = encode_fitted(&value);
        assert_eq!(decode_slice::<Buffer>(&frame).unwrap(), value);
    }

    #[test]
    fn scopes_nest_and_end_with_a_panic() {
        FRAMES.with(|frames| {
            let outer = Scope::open(&frames.encoding, Vec::new());
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _inner = Scope::open(&frames.decoding, vec![Bytes::from_static(b"x")]);
                panic!("a serde impl panics");
            }));
            assert!(result.is_err());
            assert!(frames.decoding.borrow().is_none());
            assert!(frames.encoding.borrow().is_some());
            drop(outer);
            assert!(frames.encoding.borrow().is_none());
        });
    }
}
