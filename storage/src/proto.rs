//! The bookie protocol, sans-IO: frames, requests, responses, and the entry envelope.
//!
//! ```text
//! frame    = len: u32 BE (bytes after this field, <= frame_bytes_max) | body
//! body     = version: u8 (1) | op: u8 | request_id: u64 BE | fields of op
//! request  ops 1..=6, response op = request op | 0x80, response fields start with status: u8
//! ```
//!
//! Requests are pipelined: a client sends many without waiting, and matches responses by
//! request id (a bookie may answer out of order).
//!
//! The **entry envelope** is what a writer sends, a bookie stores and a reader gets back:
//!
//! ```text
//! ledger_id u64 BE | entry_id u64 BE | lac u64 BE (u64::MAX = none) | crc32c u32 BE | payload
//! crc32c covers the 24 bytes before it and the payload
//! ```
//!
//! The writer computes the checksum, the bookie verifies it before journaling, the reader
//! verifies it again: an entry damaged anywhere on the way is never taken for data.

use bytes::{Buf, BufMut, Bytes};

pub const VERSION: u8 = 1;
/// Bytes of the frame's length prefix.
pub const LEN_BYTES: usize = 4;
/// Longest master key a writer may present.
pub const MASTER_KEY_BYTES_MAX: usize = 64;
/// `lac` or `last_entry` when there is none.
pub const NONE: u64 = u64::MAX;
pub const ENVELOPE_HEADER_BYTES: usize = 28;

const OP_ADD: u8 = 1;
const OP_READ: u8 = 2;
const OP_READ_RANGE: u8 = 3;
const OP_READ_LAC: u8 = 4;
const OP_FENCE: u8 = 5;
const OP_DELETE: u8 = 6;
const RESPONSE: u8 = 0x80;

/// Add flag: a recovery add, accepted on a fenced ledger (the recovering client rewrites
/// entries it read back, under the same master key).
pub const ADD_RECOVERY: u8 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Add {
        ledger_id: u64,
        entry_id: u64,
        flags: u8,
        master_key: Bytes,
        /// The entry envelope.
        entry: Bytes,
    },
    Read {
        ledger_id: u64,
        entry_id: u64,
    },
    /// Entries `first..` in order, stopping at the first missing one, after `count_max`
    /// entries, or before the total would pass `bytes_max` (at least one entry is returned).
    ReadRange {
        ledger_id: u64,
        first_entry: u64,
        count_max: u32,
        bytes_max: u32,
    },
    ReadLac {
        ledger_id: u64,
    },
    /// Fences the ledger (later adds without [`ADD_RECOVERY`] are refused) and answers like
    /// `ReadLac`. The key must match the one the ledger was written with.
    Fence {
        ledger_id: u64,
        master_key: Bytes,
    },
    Delete {
        ledger_id: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    NoSuchLedger = 1,
    NoSuchEntry = 2,
    /// The ledger is fenced and the add is not a recovery add.
    Fenced = 3,
    /// The master key does not match the ledger's.
    Unauthorized = 4,
    /// The entry's checksum does not verify (or its envelope names another ledger or entry).
    BadChecksum = 5,
    /// The bookie takes no writes (disk above its threshold, or a failed write).
    ReadOnly = 6,
    BadRequest = 7,
    Internal = 8,
    /// The connection's certificate does not allow this request (TLS between roles: adds,
    /// fences and deletes are for brokers; reads for brokers, bookies and admin tools).
    Forbidden = 9,
}

impl Status {
    fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::NoSuchLedger,
            2 => Status::NoSuchEntry,
            3 => Status::Fenced,
            4 => Status::Unauthorized,
            5 => Status::BadChecksum,
            6 => Status::ReadOnly,
            7 => Status::BadRequest,
            8 => Status::Internal,
            9 => Status::Forbidden,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Add {
        status: Status,
        ledger_id: u64,
        entry_id: u64,
    },
    Read {
        status: Status,
        ledger_id: u64,
        entry_id: u64,
        /// The envelope; empty unless `status` is `Ok`.
        entry: Bytes,
    },
    ReadRange {
        status: Status,
        ledger_id: u64,
        entries: Vec<Bytes>,
    },
    /// Answer to `ReadLac` and `Fence`: the highest LAC the bookie has seen for the ledger
    /// and the highest entry id it stores, each [`NONE`] when there is none.
    Lac {
        status: Status,
        ledger_id: u64,
        lac: u64,
        last_entry: u64,
        fence: bool,
    },
    Delete {
        status: Status,
        ledger_id: u64,
    },
}

impl Request {
    /// Whether the request changes what a bookie stores (add, fence, delete), as opposed to
    /// reading it.
    pub fn is_write(&self) -> bool {
        matches!(
            self,
            Request::Add { .. } | Request::Fence { .. } | Request::Delete { .. }
        )
    }

    /// The answer to this request that carries only `status` (a refusal).
    pub fn refused(&self, status: Status) -> Response {
        match *self {
            Request::Add {
                ledger_id,
                entry_id,
                ..
            } => Response::Add {
                status,
                ledger_id,
                entry_id,
            },
            Request::Read {
                ledger_id,
                entry_id,
            } => Response::Read {
                status,
                ledger_id,
                entry_id,
                entry: Bytes::new(),
            },
            Request::ReadRange { ledger_id, .. } => Response::ReadRange {
                status,
                ledger_id,
                entries: Vec::new(),
            },
            Request::ReadLac { ledger_id } | Request::Fence { ledger_id, .. } => Response::Lac {
                status,
                ledger_id,
                lac: NONE,
                last_entry: NONE,
                fence: matches!(self, Request::Fence { .. }),
            },
            Request::Delete { ledger_id } => Response::Delete { status, ledger_id },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Request { id: u64, request: Request },
    Response { id: u64, response: Response },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("frame of {len} bytes is over the limit of {max} (bookie.frame_bytes_max)")]
    TooLarge { len: usize, max: usize },
    #[error("unsupported protocol version {0}")]
    Version(u8),
    #[error("unknown op {0:#x}")]
    UnknownOp(u8),
    #[error("unknown status {0}")]
    UnknownStatus(u8),
    #[error("frame body ends early ({0})")]
    Truncated(&'static str),
    #[error("{0}")]
    Invalid(&'static str),
}

/// Decodes one frame from the front of `buf` if it holds a whole one. `Ok(None)`: more bytes
/// are needed. An error means the stream is broken: close the connection.
pub fn decode(
    buf: &mut bytes::BytesMut,
    frame_bytes_max: usize,
) -> Result<Option<Frame>, ProtoError> {
    if buf.len() < LEN_BYTES {
        return Ok(None);
    }
    let len = u32::from_be_bytes(buf[..LEN_BYTES].try_into().expect("4 bytes")) as usize;
    if len > frame_bytes_max {
        return Err(ProtoError::TooLarge {
            len,
            max: frame_bytes_max,
        });
    }
    if buf.len() < LEN_BYTES + len {
        buf.reserve(LEN_BYTES + len - buf.len());
        return Ok(None);
    }
    buf.advance(LEN_BYTES);
    let body = buf.split_to(len).freeze();
    decode_body(body).map(Some)
}

fn need(b: &Bytes, n: usize, what: &'static str) -> Result<(), ProtoError> {
    if b.remaining() < n {
        Err(ProtoError::Truncated(what))
    } else {
        Ok(())
    }
}

fn u64_of(b: &mut Bytes, what: &'static str) -> Result<u64, ProtoError> {
    need(b, 8, what)?;
    Ok(b.get_u64())
}

fn u32_of(b: &mut Bytes, what: &'static str) -> Result<u32, ProtoError> {
    need(b, 4, what)?;
    Ok(b.get_u32())
}

fn u8_of(b: &mut Bytes, what: &'static str) -> Result<u8, ProtoError> {
    need(b, 1, what)?;
    Ok(b.get_u8())
}

fn key_of(b: &mut Bytes) -> Result<Bytes, ProtoError> {
    need(b, 2, "master key length")?;
    let n = b.get_u16() as usize;
    if n > MASTER_KEY_BYTES_MAX {
        return Err(ProtoError::Invalid("master key longer than 64 bytes"));
    }
    need(b, n, "master key")?;
    Ok(b.split_to(n))
}

fn status_of(b: &mut Bytes) -> Result<Status, ProtoError> {
    let v = u8_of(b, "status")?;
    Status::from_u8(v).ok_or(ProtoError::UnknownStatus(v))
}

fn done(b: &Bytes) -> Result<(), ProtoError> {
    if b.has_remaining() {
        Err(ProtoError::Invalid(
            "trailing bytes after the frame's fields",
        ))
    } else {
        Ok(())
    }
}

/// Decodes a frame body (what follows the length prefix).
pub fn decode_body(mut b: Bytes) -> Result<Frame, ProtoError> {
    let version = u8_of(&mut b, "version")?;
    if version != VERSION {
        return Err(ProtoError::Version(version));
    }
    let op = u8_of(&mut b, "op")?;
    let id = u64_of(&mut b, "request id")?;
    let frame = if op & RESPONSE == 0 {
        let request = match op {
            OP_ADD => {
                let ledger_id = u64_of(&mut b, "ledger id")?;
                let entry_id = u64_of(&mut b, "entry id")?;
                let flags = u8_of(&mut b, "flags")?;
                let master_key = key_of(&mut b)?;
                let entry = b.split_to(b.remaining());
                Request::Add {
                    ledger_id,
                    entry_id,
                    flags,
                    master_key,
                    entry,
                }
            }
            OP_READ => Request::Read {
                ledger_id: u64_of(&mut b, "ledger id")?,
                entry_id: u64_of(&mut b, "entry id")?,
            },
            OP_READ_RANGE => Request::ReadRange {
                ledger_id: u64_of(&mut b, "ledger id")?,
                first_entry: u64_of(&mut b, "first entry")?,
                count_max: u32_of(&mut b, "count")?,
                bytes_max: u32_of(&mut b, "bytes")?,
            },
            OP_READ_LAC => Request::ReadLac {
                ledger_id: u64_of(&mut b, "ledger id")?,
            },
            OP_FENCE => Request::Fence {
                ledger_id: u64_of(&mut b, "ledger id")?,
                master_key: key_of(&mut b)?,
            },
            OP_DELETE => Request::Delete {
                ledger_id: u64_of(&mut b, "ledger id")?,
            },
            other => return Err(ProtoError::UnknownOp(other)),
        };
        Frame::Request { id, request }
    } else {
        let status = status_of(&mut b)?;
        let response = match op & !RESPONSE {
            OP_ADD => Response::Add {
                status,
                ledger_id: u64_of(&mut b, "ledger id")?,
                entry_id: u64_of(&mut b, "entry id")?,
            },
            OP_READ => {
                let ledger_id = u64_of(&mut b, "ledger id")?;
                let entry_id = u64_of(&mut b, "entry id")?;
                let entry = b.split_to(b.remaining());
                Response::Read {
                    status,
                    ledger_id,
                    entry_id,
                    entry,
                }
            }
            OP_READ_RANGE => {
                let ledger_id = u64_of(&mut b, "ledger id")?;
                let count = u32_of(&mut b, "entry count")? as usize;
                // Every entry costs at least its 4-byte length: a count the body cannot hold is
                // refused before anything is allocated for it.
                if count > b.remaining() / 4 {
                    return Err(ProtoError::Truncated("entries"));
                }
                let mut entries = Vec::with_capacity(count);
                for _ in 0..count {
                    let n = u32_of(&mut b, "entry length")? as usize;
                    need(&b, n, "entry")?;
                    entries.push(b.split_to(n));
                }
                Response::ReadRange {
                    status,
                    ledger_id,
                    entries,
                }
            }
            op @ (OP_READ_LAC | OP_FENCE) => Response::Lac {
                status,
                ledger_id: u64_of(&mut b, "ledger id")?,
                lac: u64_of(&mut b, "lac")?,
                last_entry: u64_of(&mut b, "last entry")?,
                fence: op == OP_FENCE,
            },
            OP_DELETE => Response::Delete {
                status,
                ledger_id: u64_of(&mut b, "ledger id")?,
            },
            other => return Err(ProtoError::UnknownOp(other | RESPONSE)),
        };
        Frame::Response { id, response }
    };
    done(&b)?;
    Ok(frame)
}

/// An add request's fields after the version byte, up to its entry.
fn put_add_fields(
    out: &mut Vec<u8>,
    id: u64,
    ledger_id: u64,
    entry_id: u64,
    flags: u8,
    master_key: &[u8],
) {
    out.put_u8(OP_ADD);
    out.put_u64(id);
    out.put_u64(ledger_id);
    out.put_u64(entry_id);
    out.put_u8(flags);
    put_key(out, master_key);
}

fn put_key(out: &mut Vec<u8>, key: &[u8]) {
    debug_assert!(key.len() <= MASTER_KEY_BYTES_MAX);
    out.put_u16(key.len() as u16);
    out.put_slice(key);
}

/// An upper bound of the frame's encoded size, to size a buffer once.
pub fn encoded_len_hint(frame: &Frame) -> usize {
    let payload = match frame {
        Frame::Request {
            request: Request::Add {
                master_key, entry, ..
            },
            ..
        } => master_key.len() + entry.len(),
        Frame::Response {
            response: Response::Read { entry, .. },
            ..
        } => entry.len(),
        Frame::Response {
            response: Response::ReadRange { entries, .. },
            ..
        } => entries.iter().map(|e| e.len() + 4).sum(),
        _ => 0,
    };
    64 + payload
}

/// Appends the frame's bytes (length prefix included) to `out`.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) {
    let start = out.len();
    out.put_u32(0);
    out.put_u8(VERSION);
    match frame {
        Frame::Request { id, request } => match request {
            Request::Add {
                ledger_id,
                entry_id,
                flags,
                master_key,
                entry,
            } => {
                put_add_fields(out, *id, *ledger_id, *entry_id, *flags, master_key);
                out.put_slice(entry);
            }
            Request::Read {
                ledger_id,
                entry_id,
            } => {
                out.put_u8(OP_READ);
                out.put_u64(*id);
                out.put_u64(*ledger_id);
                out.put_u64(*entry_id);
            }
            Request::ReadRange {
                ledger_id,
                first_entry,
                count_max,
                bytes_max,
            } => {
                out.put_u8(OP_READ_RANGE);
                out.put_u64(*id);
                out.put_u64(*ledger_id);
                out.put_u64(*first_entry);
                out.put_u32(*count_max);
                out.put_u32(*bytes_max);
            }
            Request::ReadLac { ledger_id } => {
                out.put_u8(OP_READ_LAC);
                out.put_u64(*id);
                out.put_u64(*ledger_id);
            }
            Request::Fence {
                ledger_id,
                master_key,
            } => {
                out.put_u8(OP_FENCE);
                out.put_u64(*id);
                out.put_u64(*ledger_id);
                put_key(out, master_key);
            }
            Request::Delete { ledger_id } => {
                out.put_u8(OP_DELETE);
                out.put_u64(*id);
                out.put_u64(*ledger_id);
            }
        },
        Frame::Response { id, response } => match response {
            Response::Add {
                status,
                ledger_id,
                entry_id,
            } => {
                out.put_u8(OP_ADD | RESPONSE);
                out.put_u64(*id);
                out.put_u8(*status as u8);
                out.put_u64(*ledger_id);
                out.put_u64(*entry_id);
            }
            Response::Read {
                status,
                ledger_id,
                entry_id,
                entry,
            } => {
                out.put_u8(OP_READ | RESPONSE);
                out.put_u64(*id);
                out.put_u8(*status as u8);
                out.put_u64(*ledger_id);
                out.put_u64(*entry_id);
                out.put_slice(entry);
            }
            Response::ReadRange {
                status,
                ledger_id,
                entries,
            } => {
                out.put_u8(OP_READ_RANGE | RESPONSE);
                out.put_u64(*id);
                out.put_u8(*status as u8);
                out.put_u64(*ledger_id);
                out.put_u32(entries.len() as u32);
                for e in entries {
                    out.put_u32(e.len() as u32);
                    out.put_slice(e);
                }
            }
            Response::Lac {
                status,
                ledger_id,
                lac,
                last_entry,
                fence,
            } => {
                out.put_u8(if *fence { OP_FENCE } else { OP_READ_LAC } | RESPONSE);
                out.put_u64(*id);
                out.put_u8(*status as u8);
                out.put_u64(*ledger_id);
                out.put_u64(*lac);
                out.put_u64(*last_entry);
            }
            Response::Delete { status, ledger_id } => {
                out.put_u8(OP_DELETE | RESPONSE);
                out.put_u64(*id);
                out.put_u8(*status as u8);
                out.put_u64(*ledger_id);
            }
        },
    }
    let len = (out.len() - start - LEN_BYTES) as u32;
    out[start..start + LEN_BYTES].copy_from_slice(&len.to_be_bytes());
}

/// A verified entry envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub ledger_id: u64,
    pub entry_id: u64,
    /// The writer's LastAddConfirmed when it sent this entry ([`NONE`] if none).
    pub lac: u64,
    pub payload: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("entry of {0} bytes is shorter than its 28-byte header")]
    Short(usize),
    #[error("entry checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum { stored: u32, computed: u32 },
}

fn envelope_crc(header: &[u8], payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&header[..24]), payload)
}

/// An envelope as the writer holds it: its header, and the payload it covers, not copied
/// behind the header. On the wire the two are one entry (see [`encode_add`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub header: [u8; ENVELOPE_HEADER_BYTES],
    pub payload: Bytes,
}

impl Sealed {
    /// The envelope in one buffer (a copy).
    pub fn to_bytes(&self) -> Bytes {
        let mut out = Vec::with_capacity(ENVELOPE_HEADER_BYTES + self.payload.len());
        out.put_slice(&self.header);
        out.put_slice(&self.payload);
        Bytes::from(out)
    }
}

/// The envelope header of `payload`: position, LAC, and the checksum of those 24 bytes and the
/// payload.
fn envelope_header(
    ledger_id: u64,
    entry_id: u64,
    lac: u64,
    payload: &[u8],
) -> [u8; ENVELOPE_HEADER_BYTES] {
    let mut header = [0u8; ENVELOPE_HEADER_BYTES];
    header[0..8].copy_from_slice(&ledger_id.to_be_bytes());
    header[8..16].copy_from_slice(&entry_id.to_be_bytes());
    header[16..24].copy_from_slice(&lac.to_be_bytes());
    let crc = envelope_crc(&header, payload);
    header[24..28].copy_from_slice(&crc.to_be_bytes());
    header
}

/// Builds an envelope: the writer's side. The payload is shared, not copied.
pub fn seal_parts(ledger_id: u64, entry_id: u64, lac: u64, payload: Bytes) -> Sealed {
    let header = envelope_header(ledger_id, entry_id, lac, &payload);
    Sealed { header, payload }
}

/// An envelope in one buffer.
pub fn seal(ledger_id: u64, entry_id: u64, lac: u64, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(ENVELOPE_HEADER_BYTES + payload.len());
    out.put_slice(&envelope_header(ledger_id, entry_id, lac, payload));
    out.put_slice(payload);
    Bytes::from(out)
}

/// Appends the bytes of an add request frame up to its entry's payload (length prefix,
/// fields, master key, envelope header) to `out`; the frame is complete once
/// `sealed.payload` follows. The same bytes as [`encode`] of a [`Request::Add`] whose entry is
/// `sealed.to_bytes()`, without copying the payload: the writer sends the two as one vectored
/// write.
pub fn encode_add(
    id: u64,
    ledger_id: u64,
    entry_id: u64,
    flags: u8,
    master_key: &[u8],
    sealed: &Sealed,
    out: &mut Vec<u8>,
) {
    let start = out.len();
    out.put_u32(0);
    out.put_u8(VERSION);
    put_add_fields(out, id, ledger_id, entry_id, flags, master_key);
    out.put_slice(&sealed.header);
    let len = (out.len() - start - LEN_BYTES + sealed.payload.len()) as u32;
    out[start..start + LEN_BYTES].copy_from_slice(&len.to_be_bytes());
}

/// Checks an envelope's checksum and splits it: the bookie's and the reader's side.
pub fn open(entry: &Bytes) -> Result<Envelope, EnvelopeError> {
    if entry.len() < ENVELOPE_HEADER_BYTES {
        return Err(EnvelopeError::Short(entry.len()));
    }
    let header: &[u8; ENVELOPE_HEADER_BYTES] = entry[..ENVELOPE_HEADER_BYTES]
        .try_into()
        .expect("header bytes");
    open_sealed(header, entry.slice(ENVELOPE_HEADER_BYTES..))
}

/// [`open`] of an envelope whose header and payload are apart (a [`Sealed`]).
pub fn open_sealed(
    header: &[u8; ENVELOPE_HEADER_BYTES],
    payload: Bytes,
) -> Result<Envelope, EnvelopeError> {
    let h = header;
    let stored = u32::from_be_bytes(h[24..28].try_into().expect("4 bytes"));
    let computed = envelope_crc(h, &payload);
    if stored != computed {
        return Err(EnvelopeError::Checksum { stored, computed });
    }
    Ok(Envelope {
        ledger_id: u64::from_be_bytes(h[0..8].try_into().expect("8 bytes")),
        entry_id: u64::from_be_bytes(h[8..16].try_into().expect("8 bytes")),
        lac: u64::from_be_bytes(h[16..24].try_into().expect("8 bytes")),
        payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use rand::{Rng, SeedableRng};

    #[test]
    fn given_an_add_encoded_in_parts_then_its_bytes_are_those_of_the_whole_frame() {
        for payload in [&b""[..], b"x", &[7u8; 5000][..]] {
            let sealed = seal_parts(9, 4, 3, Bytes::copy_from_slice(payload));
            assert_eq!(sealed.to_bytes(), seal(9, 4, 3, payload));
            let mut whole = Vec::new();
            encode(
                &Frame::Request {
                    id: 77,
                    request: Request::Add {
                        ledger_id: 9,
                        entry_id: 4,
                        flags: ADD_RECOVERY,
                        master_key: Bytes::from_static(b"key"),
                        entry: sealed.to_bytes(),
                    },
                },
                &mut whole,
            );
            let mut parts = Vec::new();
            encode_add(77, 9, 4, ADD_RECOVERY, b"key", &sealed, &mut parts);
            parts.extend_from_slice(&sealed.payload);
            assert_eq!(parts, whole);
            let env = open(&sealed.to_bytes()).expect("verifies");
            assert_eq!((env.ledger_id, env.entry_id, env.lac), (9, 4, 3));
            assert_eq!(env.payload, payload);
        }
    }

    fn frames() -> Vec<Frame> {
        let key = Bytes::from_static(b"secret");
        let entry = seal(7, 3, 2, b"hello");
        vec![
            Frame::Request {
                id: 1,
                request: Request::Add {
                    ledger_id: 7,
                    entry_id: 3,
                    flags: ADD_RECOVERY,
                    master_key: key.clone(),
                    entry: entry.clone(),
                },
            },
            Frame::Request {
                id: 2,
                request: Request::Read {
                    ledger_id: 7,
                    entry_id: 3,
                },
            },
            Frame::Request {
                id: 3,
                request: Request::ReadRange {
                    ledger_id: 7,
                    first_entry: 0,
                    count_max: 100,
                    bytes_max: 1 << 20,
                },
            },
            Frame::Request {
                id: 4,
                request: Request::ReadLac { ledger_id: 7 },
            },
            Frame::Request {
                id: 5,
                request: Request::Fence {
                    ledger_id: 7,
                    master_key: key,
                },
            },
            Frame::Request {
                id: 6,
                request: Request::Delete { ledger_id: 7 },
            },
            Frame::Response {
                id: 1,
                response: Response::Add {
                    status: Status::Fenced,
                    ledger_id: 7,
                    entry_id: 3,
                },
            },
            Frame::Response {
                id: 2,
                response: Response::Read {
                    status: Status::Ok,
                    ledger_id: 7,
                    entry_id: 3,
                    entry: entry.clone(),
                },
            },
            Frame::Response {
                id: 3,
                response: Response::ReadRange {
                    status: Status::Ok,
                    ledger_id: 7,
                    entries: vec![entry.clone(), seal(7, 4, 3, b"")],
                },
            },
            Frame::Response {
                id: 4,
                response: Response::Lac {
                    status: Status::Ok,
                    ledger_id: 7,
                    lac: NONE,
                    last_entry: 4,
                    fence: false,
                },
            },
            Frame::Response {
                id: 5,
                response: Response::Lac {
                    status: Status::Unauthorized,
                    ledger_id: 7,
                    lac: 2,
                    last_entry: 4,
                    fence: true,
                },
            },
            Frame::Response {
                id: 6,
                response: Response::Delete {
                    status: Status::NoSuchLedger,
                    ledger_id: 7,
                },
            },
        ]
    }

    #[test]
    fn given_every_frame_kind_when_encoded_then_it_decodes_to_itself_even_byte_by_byte() {
        let mut wire = Vec::new();
        let all = frames();
        for f in &all {
            encode(f, &mut wire);
        }
        // Fed one byte at a time: partial frames wait for more.
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for b in wire {
            buf.put_u8(b);
            while let Some(f) = decode(&mut buf, 1 << 20).expect("valid frames") {
                got.push(f);
            }
        }
        assert_eq!(got, all);
        assert!(buf.is_empty());
    }

    #[test]
    fn given_bad_frames_then_errors_say_what_is_wrong() {
        let check = |bytes: &[u8], max: usize, expect: &str| {
            let mut buf = BytesMut::from(bytes);
            let err = decode(&mut buf, max).expect_err("bad frame");
            assert_eq!(err.to_string(), expect);
        };
        check(
            &[0, 0, 0, 200],
            100,
            "frame of 200 bytes is over the limit of 100 (bookie.frame_bytes_max)",
        );
        check(&[0, 0, 0, 2, 9, 1], 100, "unsupported protocol version 9");
        check(
            &[0, 0, 0, 10, 1, 0x33, 0, 0, 0, 0, 0, 0, 0, 1],
            100,
            "unknown op 0x33",
        );
        check(
            &[0, 0, 0, 12, 1, 4, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
            100,
            "frame body ends early (ledger id)",
        );
        let mut delete = Vec::new();
        encode(
            &Frame::Request {
                id: 1,
                request: Request::Delete { ledger_id: 1 },
            },
            &mut delete,
        );
        delete.push(0);
        delete[3] += 1;
        check(&delete, 100, "trailing bytes after the frame's fields");
    }

    #[test]
    fn given_envelope_then_any_flipped_bit_is_caught() {
        let e = seal(1, 2, NONE, b"payload bytes");
        let opened = open(&e).expect("verifies");
        assert_eq!(
            (opened.ledger_id, opened.entry_id, opened.lac),
            (1, 2, NONE)
        );
        assert_eq!(&opened.payload[..], b"payload bytes");
        for i in 0..e.len() * 8 {
            let mut bad = e.to_vec();
            bad[i / 8] ^= 1 << (i % 8);
            assert!(open(&Bytes::from(bad)).is_err(), "bit {i} flip undetected");
        }
        assert_eq!(
            open(&Bytes::from_static(b"short")),
            Err(EnvelopeError::Short(5))
        );
    }

    #[test]
    fn given_random_bytes_then_decode_never_panics() {
        let seed: u64 = rand::random();
        println!("seed {seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut valid = Vec::new();
        for f in frames() {
            encode(&f, &mut valid);
        }
        for _ in 0..20_000 {
            let mut bytes = valid.clone();
            for _ in 0..rng.gen_range(1..8) {
                let at = rng.gen_range(0..bytes.len());
                bytes[at] = rng.gen();
            }
            bytes.truncate(rng.gen_range(0..=bytes.len()));
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(_)) = decode(&mut buf, 1 << 16) {}
        }
    }
}
