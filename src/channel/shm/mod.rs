//! The shared-memory kind: readers in other processes of the writer's host share one ring in
//! a memfd ([`memory`]), whose protocol is [`ring`]. The writer encodes each message once,
//! straight into a slot (a [frame](crate::value::frame), large byte strings out of band); a
//! reader decodes it in place and keeps large payloads there (pinned) without copying them.
use super::{ChanError, ChannelReader, ChannelWriter, EndCounters, Msg, bump};
use crate::buffer::BufferMut;
use crate::error::TaskError;
use crate::value::frame;
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Instant;

pub(crate) mod memory;
pub(crate) mod ring;

pub(crate) use memory::{
    Form, RingError, Room, ShmChannel, ShmConfig, ShmGroup, ShmReader, ShmWriter, WriteSharing,
    Written,
};

impl From<RingError> for ChanError {
    fn from(e: RingError) -> Self {
        match e {
            RingError::Closed => ChanError::Closed,
            RingError::Timeout => ChanError::Timeout,
            RingError::TooLarge { size, limit } => ChanError::TooLarge { size, limit },
            other => ChanError::Codec(other.to_string()),
        }
    }
}

/// The tag of a slot that holds a value.
pub(crate) const TAG_VALUE: u8 = 0;
/// The tag of a slot that holds a [`TaskError`].
pub(crate) const TAG_ERROR: u8 = 1;

/// Encode `value` straight into a slot of `shm`: in the slot's own line as a bare body when it
/// is that small (no frame header to write or check: the common small message), else as a
/// frame in the slot's block (large byte strings out of band, by reference where `sharing`
/// locates them), growing the channel when the block is too small, and telling that apart
/// from a value that cannot be encoded at all.
pub(crate) fn write_encoded<T: Serialize + ?Sized>(
    shm: &mut ShmWriter,
    sharing: &WriteSharing,
    tag: u8,
    value: &T,
    deadline: Option<Instant>,
    counters: Option<&EndCounters>,
) -> Result<(), ChanError> {
    let mut failure: Option<String> = None;
    let mut bytes = 0u64;
    let written = shm.write(
        tag,
        &mut |buf: &mut [u8], room: Room| {
            if room == Room::SlotLine {
                return match frame::encode_bare(value, buf) {
                    Some(len) => {
                        bytes = len as u64;
                        Ok(Written {
                            len,
                            form: Form::Bare,
                        })
                    }
                    // Not in the line: the block's attempt tells the size, or why it fails.
                    None => Err(buf.len() + 1),
                };
            }
            match frame::encode_in(value, buf, sharing) {
                Ok(len) => {
                    bytes = len as u64;
                    Ok(Written {
                        len,
                        form: Form::Framed,
                    })
                }
                Err(frame::EncodeError::TooSmall(needed)) => Err(needed),
                Err(frame::EncodeError::Failed(e)) => {
                    failure = Some(e);
                    // Over any ceiling: the writer gives up at once, without growing.
                    Err(usize::MAX)
                }
            }
        },
        deadline,
    );
    if let Some(e) = failure {
        return Err(ChanError::Codec(format!(
            "cannot encode a value of type {}: {e}",
            std::any::type_name::<T>()
        )));
    }
    let growths = written?;
    if let Some(c) = counters {
        bump(&c.bytes, bytes);
        bump(&c.growths, growths);
    }
    Ok(())
}

/// The writer's end of a shared-memory channel, for values of type `T`.
pub(crate) struct ShmTx<T> {
    shm: ShmWriter,
    sharing: WriteSharing,
    /// Bytes written and growths, shared with whoever reads the graph's statistics.
    counters: Option<Arc<EndCounters>>,
    _t: PhantomData<fn(T)>,
}

impl<T> ShmTx<T> {
    pub(crate) fn new(shm: ShmWriter) -> Self {
        ShmTx {
            sharing: shm.sharing(),
            shm,
            counters: None,
            _t: PhantomData,
        }
    }

    /// Count the bytes this end writes and the times it grows its channel in `counters`.
    pub(crate) fn counted(mut self, counters: Arc<EndCounters>) -> Self {
        self.counters = Some(counters);
        self
    }
}

#[cfg(all(test, not(loom)))]
impl<T> ShmTx<T> {
    /// See [`ShmWriter::pinned_blocks`].
    pub(crate) fn pinned_blocks(&self) -> usize {
        self.shm.pinned_blocks()
    }
}

impl<T: Serialize> ChannelWriter<T> for ShmTx<T> {
    fn write(&mut self, msg: Msg<T>, deadline: Option<Instant>) -> Result<(), ChanError> {
        // Encoded straight into the slot: no allocation per message.
        match &msg {
            Msg::Value(v) => write_encoded(
                &mut self.shm,
                &self.sharing,
                TAG_VALUE,
                v,
                deadline,
                self.counters.as_deref(),
            ),
            Msg::Error(e) => write_encoded(
                &mut self.shm,
                &self.sharing,
                TAG_ERROR,
                &**e,
                deadline,
                self.counters.as_deref(),
            ),
        }
    }

    fn write_ref(&mut self, value: &T, deadline: Option<Instant>) -> Result<(), ChanError> {
        write_encoded(
            &mut self.shm,
            &self.sharing,
            TAG_VALUE,
            value,
            deadline,
            self.counters.as_deref(),
        )
    }

    fn moves_values(&self) -> bool {
        false
    }

    fn loan(&mut self, len: usize) -> Option<BufferMut> {
        match self.shm.loan(len) {
            Ok(memory) => Some(BufferMut::loaned(Box::new(memory))),
            Err(err) => {
                tracing::debug!(%err, len, "no shared memory to lend; a heap buffer instead");
                None
            }
        }
    }
}

/// One reader's end of a shared-memory channel, for values of type `T`.
pub(crate) struct ShmRx<T> {
    shm: ShmReader,
    _t: PhantomData<fn() -> T>,
}

impl<T> ShmRx<T> {
    pub(crate) fn new(shm: ShmReader) -> Self {
        ShmRx {
            shm,
            _t: PhantomData,
        }
    }
}

impl<T: DeserializeOwned> ChannelReader<T> for ShmRx<T> {
    fn read(&mut self, deadline: Option<Instant>) -> Result<Msg<T>, ChanError> {
        let slot = self.shm.read(deadline)?;
        let data = slot.data();
        let decoded = match (slot.form, slot.tag) {
            (Form::Bare, TAG_VALUE) => frame::decode_bare::<T>(data).map(Msg::Value),
            (Form::Bare, _) => {
                frame::decode_bare::<TaskError>(data).map(|e| Msg::Error(Arc::new(e)))
            }
            (Form::Framed, tag) => {
                let capacity = slot.block_capacity();
                let keep = || Bytes::from_owner(slot.pin());
                let sharing = slot.sharing();
                match tag {
                    TAG_VALUE => frame::decode::<T>(data, capacity, keep, &sharing).map(Msg::Value),
                    _ => frame::decode::<TaskError>(data, capacity, keep, &sharing)
                        .map(|e| Msg::Error(Arc::new(e))),
                }
            }
        };
        decoded.map_err(|e| {
            ChanError::Codec(format!(
                "cannot decode a {} from {} bytes: {e}; the writer and reader disagree on the type (a stale worker binary?)",
                std::any::type_name::<T>(),
                data.len()
            ))
        })
    }
}
