//! Frames of the link's streams, sans-IO.
//!
//! ```text
//!  frame = length: u32 BE (of what follows) | kind: u8 | body
//!  str   = length: u16 BE | UTF-8 bytes
//!  Hello   (1) = version: u16 | site: str      the dialer, first on the control stream
//!  Welcome (2) = version: u16 | site: str      the listener's answer
//!
//!  on a topic's own stream, opened by the sending site:
//!  Open    (3) = topic: str | partitions: u32  (0: not partitioned)
//!  Opened  (4) = has: u8 | ledger: u64 | entry: u64 | frame_bytes_max: u64
//!                the highest origin position the receiver holds from the sender (has = 0:
//!                none), and the largest frame it takes
//!  Entries (5) = count: u32 | (ledger: u64 | entry: u64 | len: u32 | bytes)*count
//!  Ack     (6) = ledger: u64 | entry: u64      durably appended up to this origin position
//!  Refused (7) = code: u8 | reason: str        the stream is not served (then it ends);
//!                code 4 (Moved): the reason is the geo URL of the broker that serves it
//!
//!  on a stream of its own, opened by either site:
//!  Delete  (8) = topic: str | deleted_at_ms: u64  a global topic's deletion
//!  Deleted (9) =                                 the receiver deleted it
//!  Sync   (10) = len: u32 | bytes                the sender's copies of the global objects
//!                                                the receiver takes part in (JSON)
//!  Synced (11) = changed: u32 | skipped: u32     merged: how many changed here, not taken
//!  SubSync   (12) = topic: str | len: u32 | bytes  the acknowledgements of the sender's
//!                   replicated subscriptions of a topic (a document the site reads)
//!  SubSynced (13) = len: u32 | bytes              what the receiver applied and holds
//! ```
//!
//! A frame longer than the limit (`geo.frame_bytes_max`) is refused from its length alone,
//! before its bytes are read. Unknown kinds, truncated bodies, bytes left over and invalid
//! UTF-8 are errors, never panics (fuzz target `link_frame` in `geo/fuzz/`).

use bytes::{Buf, BufMut, BytesMut};

/// The link protocol's version; a peer of another version is refused at hello.
pub const PROTOCOL_VERSION: u16 = 1;

/// Bytes of a frame's length prefix.
pub const LENGTH_BYTES: usize = 4;

/// The kind byte of an Entries frame (read apart: [`crate::inflow`]).
pub(crate) const ENTRIES_KIND: u8 = 5;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// The dialer names itself (its certificate already did; they must agree).
    Hello { version: u16, site: String },
    /// The listener's answer.
    Welcome { version: u16, site: String },
    /// A topic's stream begins: the sender's topic (a partition of a partitioned topic is
    /// named as such) and its partition count.
    Open { topic: String, partitions: u32 },
    /// The receiver serves the stream; the highest origin position it holds from the sender,
    /// and the largest frame it takes.
    Opened {
        last: Option<OriginPosition>,
        frame_bytes_max: u64,
    },
    /// Entries in the origin's log order, each as stored at the origin.
    Entries { items: Vec<ReplicatedEntry> },
    /// Everything up to this origin position is durably appended at the receiver.
    Ack { up_to: OriginPosition },
    /// The receiver does not serve the stream, and why.
    Refused { code: RefusalCode, reason: String },
    /// A stream's first frame: the sender's site deleted this topic (a global topic is
    /// deleted at every site of its replication clusters), at this time (ms since the epoch).
    Delete { topic: String, deleted_at_ms: u64 },
    /// The receiver deleted the topic (or never had it) and keeps a tombstone for it.
    Deleted,
    /// A stream's first frame: the sender's copies of the global objects (cluster records,
    /// tenants, namespaces) the receiver takes part in, as JSON the site's registry reads.
    Sync { doc: bytes::Bytes },
    /// The receiver merged them: how many objects changed there, how many it did not take.
    Synced { changed: u32, skipped: u32 },
    /// A stream's first frame: the acknowledgement state of the sender's replicated
    /// subscriptions of `topic` (a document the site reads), sent to the topic's owner.
    SubSync { topic: String, doc: bytes::Bytes },
    /// The receiver applied it: what it applied and what it holds for entries to come.
    SubSynced { doc: bytes::Bytes },
}

/// A position in the origin site's log of a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OriginPosition {
    pub ledger: u64,
    pub entry: u64,
}

/// One entry on its way, byte for byte as its origin stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicatedEntry {
    pub at: OriginPosition,
    pub bytes: bytes::Bytes,
}

/// Why a receiver refuses a topic's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalCode {
    /// Not for this site: the namespace does not list the sender's site, or the topic's
    /// partitions differ. Retrying will not help until the configuration changes.
    NotAllowed,
    /// Try again later (the topic is moving, the site is busy).
    Retry,
    /// The stream broke the protocol (a bad entry, a frame out of place).
    Protocol,
    /// Another broker of the site serves the topic: the reason is its geo URL
    /// (`quic://HOST:PORT`), where the sender opens the stream again.
    Moved,
}

impl RefusalCode {
    fn to_u8(self) -> u8 {
        match self {
            RefusalCode::NotAllowed => 1,
            RefusalCode::Retry => 2,
            RefusalCode::Protocol => 3,
            RefusalCode::Moved => 4,
        }
    }

    fn from_u8(b: u8) -> Result<Self, FrameError> {
        Ok(match b {
            1 => RefusalCode::NotAllowed,
            2 => RefusalCode::Retry,
            3 => RefusalCode::Protocol,
            4 => RefusalCode::Moved,
            _ => return Err(FrameError::UnknownRefusal(b)),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes is over the limit of {max} (geo.frame_bytes_max)")]
    TooLarge { len: u64, max: u64 },
    #[error("empty frame")]
    Empty,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("truncated {0}")]
    Truncated(&'static str),
    #[error("{0} bytes left over after the frame's fields")]
    Trailing(usize),
    #[error("{0} is not UTF-8")]
    NotUtf8(&'static str),
    #[error("unknown refusal code {0}")]
    UnknownRefusal(u8),
    #[error("{0}")]
    Invalid(&'static str),
}

/// An entry at least this large is not copied into an encoded frame's pieces.
pub const SHARED_ENTRY_BYTES: usize = 16 * 1024;

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => 1,
            Frame::Welcome { .. } => 2,
            Frame::Open { .. } => 3,
            Frame::Opened { .. } => 4,
            Frame::Entries { .. } => ENTRIES_KIND,
            Frame::Ack { .. } => 6,
            Frame::Refused { .. } => 7,
            Frame::Delete { .. } => 8,
            Frame::Deleted => 9,
            Frame::Sync { .. } => 10,
            Frame::Synced { .. } => 11,
            Frame::SubSync { .. } => 12,
            Frame::SubSynced { .. } => 13,
        }
    }

    /// Appends the frame, length prefix included.
    pub fn encode(&self, out: &mut BytesMut) {
        let start = out.len();
        out.put_u32(0);
        out.put_u8(self.kind());
        match self {
            Frame::Hello { version, site } | Frame::Welcome { version, site } => {
                out.put_u16(*version);
                put_str(out, site);
            }
            Frame::Open { topic, partitions } => {
                put_str(out, topic);
                out.put_u32(*partitions);
            }
            Frame::Opened {
                last,
                frame_bytes_max,
            } => {
                out.put_u8(u8::from(last.is_some()));
                let p = last.unwrap_or(OriginPosition {
                    ledger: 0,
                    entry: 0,
                });
                out.put_u64(p.ledger);
                out.put_u64(p.entry);
                out.put_u64(*frame_bytes_max);
            }
            Frame::Entries { items } => {
                out.put_u32(items.len() as u32);
                for e in items {
                    out.put_u64(e.at.ledger);
                    out.put_u64(e.at.entry);
                    out.put_u32(e.bytes.len() as u32);
                    out.put_slice(&e.bytes);
                }
            }
            Frame::Ack { up_to } => {
                out.put_u64(up_to.ledger);
                out.put_u64(up_to.entry);
            }
            Frame::Refused { code, reason } => {
                out.put_u8(code.to_u8());
                put_str(out, reason);
            }
            Frame::Delete {
                topic,
                deleted_at_ms,
            } => {
                put_str(out, topic);
                out.put_u64(*deleted_at_ms);
            }
            Frame::Deleted => {}
            Frame::Sync { doc } | Frame::SubSynced { doc } => {
                out.put_u32(doc.len() as u32);
                out.put_slice(doc);
            }
            Frame::SubSync { topic, doc } => {
                put_str(out, topic);
                out.put_u32(doc.len() as u32);
                out.put_slice(doc);
            }
            Frame::Synced { changed, skipped } => {
                out.put_u32(*changed);
                out.put_u32(*skipped);
            }
        }
        let len = (out.len() - start - LENGTH_BYTES) as u32;
        out[start..start + LENGTH_BYTES].copy_from_slice(&len.to_be_bytes());
    }

    /// The same bytes as [`encode`](Self::encode), in pieces: an Entries frame's entries of
    /// at least [`SHARED_ENTRY_BYTES`] are pieces of their own, shared with the caller rather
    /// than copied; everything between them is copied into pieces of its own.
    pub fn encode_pieces(&self) -> Vec<bytes::Bytes> {
        let Frame::Entries { items } = self else {
            let mut out = BytesMut::new();
            self.encode(&mut out);
            return vec![out.freeze()];
        };
        let body: usize = items.iter().map(|e| 20 + e.bytes.len()).sum::<usize>() + 1 + 4;
        // Exactly what is copied: the pieces stay alive until the peer acknowledges them.
        let copied: usize = items
            .iter()
            .map(|e| {
                20 + if e.bytes.len() >= SHARED_ENTRY_BYTES {
                    0
                } else {
                    e.bytes.len()
                }
            })
            .sum::<usize>()
            + LENGTH_BYTES
            + 1
            + 4;
        let mut pieces = Vec::new();
        let mut out = BytesMut::with_capacity(copied);
        out.put_u32(body as u32);
        out.put_u8(self.kind());
        out.put_u32(items.len() as u32);
        for e in items {
            out.put_u64(e.at.ledger);
            out.put_u64(e.at.entry);
            out.put_u32(e.bytes.len() as u32);
            if e.bytes.len() >= SHARED_ENTRY_BYTES {
                pieces.push(out.split().freeze());
                pieces.push(e.bytes.clone());
            } else {
                out.put_slice(&e.bytes);
            }
        }
        if !out.is_empty() {
            pieces.push(out.freeze());
        }
        pieces
    }

    /// The length a prefix announces, checked against `max` (call once 4 bytes are there).
    pub fn announced_len(prefix: [u8; LENGTH_BYTES], max: u64) -> Result<usize, FrameError> {
        let len = u64::from(u32::from_be_bytes(prefix));
        if len > max {
            return Err(FrameError::TooLarge { len, max });
        }
        if len == 0 {
            return Err(FrameError::Empty);
        }
        Ok(len as usize)
    }

    /// Decodes one frame's body (what follows the length prefix). Entries and documents
    /// are slices of `whole`, not copies.
    pub fn decode_body(whole: bytes::Bytes) -> Result<Frame, FrameError> {
        let mut body: &[u8] = &whole;
        // Where `body` (what is left) begins in `whole`.
        let offset = |rest: &[u8]| whole.len() - rest.len();
        let kind = get_u8(&mut body, "frame kind")?;
        let frame = match kind {
            1 | 2 => {
                let version = get_u16(&mut body, "version")?;
                let site = get_str(&mut body, "site")?;
                if kind == 1 {
                    Frame::Hello { version, site }
                } else {
                    Frame::Welcome { version, site }
                }
            }
            3 => Frame::Open {
                topic: get_str(&mut body, "topic")?,
                partitions: get_u32(&mut body, "partitions")?,
            },
            4 => {
                let has = get_u8(&mut body, "opened")?;
                let at = get_position(&mut body)?;
                let last = match has {
                    0 if at.ledger == 0 && at.entry == 0 => None,
                    0 => return Err(FrameError::Invalid("opened without a position has one")),
                    1 => Some(at),
                    _ => return Err(FrameError::Invalid("opened flag is not 0 or 1")),
                };
                if body.remaining() < 8 {
                    return Err(FrameError::Truncated("frame_bytes_max"));
                }
                Frame::Opened {
                    last,
                    frame_bytes_max: body.get_u64(),
                }
            }
            ENTRIES_KIND => {
                let count = get_u32(&mut body, "entry count")? as usize;
                // Each entry takes at least 20 bytes: a count past that is a lie.
                if count > body.remaining() / 20 {
                    return Err(FrameError::Truncated("entries"));
                }
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    let at = get_position(&mut body)?;
                    let len = get_u32(&mut body, "entry length")? as usize;
                    if body.remaining() < len {
                        return Err(FrameError::Truncated("entry"));
                    }
                    let from = offset(body);
                    items.push(ReplicatedEntry {
                        at,
                        bytes: whole.slice(from..from + len),
                    });
                    body.advance(len);
                }
                Frame::Entries { items }
            }
            6 => Frame::Ack {
                up_to: get_position(&mut body)?,
            },
            7 => Frame::Refused {
                code: RefusalCode::from_u8(get_u8(&mut body, "refusal code")?)?,
                reason: get_str(&mut body, "reason")?,
            },
            8 => {
                let topic = get_str(&mut body, "topic")?;
                if body.remaining() < 8 {
                    return Err(FrameError::Truncated("deleted_at_ms"));
                }
                Frame::Delete {
                    topic,
                    deleted_at_ms: body.get_u64(),
                }
            }
            9 => Frame::Deleted,
            10 | 13 => {
                let doc = get_doc(&whole, &mut body)?;
                if kind == 10 {
                    Frame::Sync { doc }
                } else {
                    Frame::SubSynced { doc }
                }
            }
            12 => {
                let topic = get_str(&mut body, "topic")?;
                Frame::SubSync {
                    topic,
                    doc: get_doc(&whole, &mut body)?,
                }
            }
            11 => Frame::Synced {
                changed: get_u32(&mut body, "changed")?,
                skipped: get_u32(&mut body, "skipped")?,
            },
            k => return Err(FrameError::UnknownKind(k)),
        };
        if !body.is_empty() {
            return Err(FrameError::Trailing(body.len()));
        }
        Ok(frame)
    }

    /// Decodes the first frame of `buf`: `None` until it is whole, else the frame and the
    /// bytes it took. A frame over `max` is refused from its length prefix alone.
    pub fn decode(buf: &[u8], max: u64) -> Result<Option<(Frame, usize)>, FrameError> {
        let Some(prefix) = buf.get(..LENGTH_BYTES) else {
            return Ok(None);
        };
        let len = Self::announced_len(prefix.try_into().expect("4 bytes"), max)?;
        let Some(body) = buf.get(LENGTH_BYTES..LENGTH_BYTES + len) else {
            return Ok(None);
        };
        let body = bytes::Bytes::copy_from_slice(body);
        Ok(Some((Self::decode_body(body)?, LENGTH_BYTES + len)))
    }
}

fn put_str(out: &mut BytesMut, s: &str) {
    // Strings are names (sites, topics): far under 64 KiB, which the callers check.
    let bytes = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.put_u16(bytes.len() as u16);
    out.put_slice(bytes);
}

fn get_u8(buf: &mut &[u8], what: &'static str) -> Result<u8, FrameError> {
    if buf.remaining() < 1 {
        return Err(FrameError::Truncated(what));
    }
    Ok(buf.get_u8())
}

fn get_u16(buf: &mut &[u8], what: &'static str) -> Result<u16, FrameError> {
    if buf.remaining() < 2 {
        return Err(FrameError::Truncated(what));
    }
    Ok(buf.get_u16())
}

fn get_u32(buf: &mut &[u8], what: &'static str) -> Result<u32, FrameError> {
    if buf.remaining() < 4 {
        return Err(FrameError::Truncated(what));
    }
    Ok(buf.get_u32())
}

/// A document (`len: u32 | bytes`) as a slice of `whole`, which `buf` is the rest of.
fn get_doc(whole: &bytes::Bytes, buf: &mut &[u8]) -> Result<bytes::Bytes, FrameError> {
    let len = get_u32(buf, "document length")? as usize;
    if buf.remaining() < len {
        return Err(FrameError::Truncated("document"));
    }
    let from = whole.len() - buf.len();
    buf.advance(len);
    Ok(whole.slice(from..from + len))
}

fn get_position(buf: &mut &[u8]) -> Result<OriginPosition, FrameError> {
    if buf.remaining() < 16 {
        return Err(FrameError::Truncated("position"));
    }
    Ok(OriginPosition {
        ledger: buf.get_u64(),
        entry: buf.get_u64(),
    })
}

fn get_str(buf: &mut &[u8], what: &'static str) -> Result<String, FrameError> {
    let len = get_u16(buf, what)? as usize;
    if buf.remaining() < len {
        return Err(FrameError::Truncated(what));
    }
    let s = std::str::from_utf8(&buf[..len]).map_err(|_| FrameError::NotUtf8(what))?;
    let s = s.to_string();
    buf.advance(len);
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(f: &Frame) -> Vec<u8> {
        let mut b = BytesMut::new();
        f.encode(&mut b);
        b.to_vec()
    }

    #[test]
    fn given_frames_then_they_round_trip_and_wait_for_their_last_byte() {
        for f in [
            Frame::Hello {
                version: PROTOCOL_VERSION,
                site: "east".into(),
            },
            Frame::Welcome {
                version: 7,
                site: String::new(),
            },
            Frame::Open {
                topic: "persistent://acme/g/orders-partition-3".into(),
                partitions: 8,
            },
            Frame::Opened {
                last: None,
                frame_bytes_max: 0,
            },
            Frame::Opened {
                frame_bytes_max: 16 << 20,
                last: Some(OriginPosition {
                    ledger: u64::MAX,
                    entry: 3,
                }),
            },
            Frame::Entries { items: vec![] },
            Frame::Entries {
                items: vec![
                    ReplicatedEntry {
                        at: OriginPosition {
                            ledger: 5,
                            entry: 0,
                        },
                        bytes: bytes::Bytes::from_static(b"one"),
                    },
                    ReplicatedEntry {
                        at: OriginPosition {
                            ledger: 5,
                            entry: 1,
                        },
                        bytes: bytes::Bytes::new(),
                    },
                ],
            },
            Frame::Ack {
                up_to: OriginPosition {
                    ledger: 1,
                    entry: 2,
                },
            },
            Frame::Refused {
                code: RefusalCode::NotAllowed,
                reason: "namespace acme/g does not list site north".into(),
            },
            Frame::Delete {
                topic: "persistent://acme/g/orders".into(),
                deleted_at_ms: 1_796_000_000_000,
            },
            Frame::Deleted,
            Frame::Sync {
                doc: bytes::Bytes::from_static(br#"[{"key":"/admin/tenants/acme"}]"#),
            },
            Frame::Synced {
                changed: 2,
                skipped: 1,
            },
            Frame::SubSync {
                topic: "persistent://acme/g/orders-partition-1".into(),
                doc: bytes::Bytes::from_static(br#"{"subs":[]}"#),
            },
            Frame::SubSync {
                topic: String::new(),
                doc: bytes::Bytes::new(),
            },
            Frame::SubSynced {
                doc: bytes::Bytes::from_static(br#"{"applied":[]}"#),
            },
        ] {
            let bytes = encoded(&f);
            assert_eq!(f.encode_pieces().concat(), bytes);
            assert_eq!(Frame::decode(&bytes, 1 << 20), Ok(Some((f, bytes.len()))));
            for cut in 0..bytes.len() {
                assert_eq!(Frame::decode(&bytes[..cut], 1 << 20), Ok(None));
            }
        }
    }

    #[test]
    fn given_large_and_small_entries_then_the_pieces_share_the_large_ones_and_make_the_frame() {
        let entry = |n: u64, len: usize| ReplicatedEntry {
            at: OriginPosition {
                ledger: 3,
                entry: n,
            },
            bytes: bytes::Bytes::from(vec![n as u8; len]),
        };
        let items = vec![
            entry(0, 10),
            entry(1, SHARED_ENTRY_BYTES),
            entry(2, SHARED_ENTRY_BYTES + 1),
            entry(3, SHARED_ENTRY_BYTES - 1),
            entry(4, 100_000),
        ];
        let large: Vec<*const u8> = [1, 2, 4].iter().map(|&i| items[i].bytes.as_ptr()).collect();
        let f = Frame::Entries { items };
        let pieces = f.encode_pieces();
        let bytes = encoded(&f);
        assert_eq!(pieces.concat(), bytes);
        for p in large {
            assert!(
                pieces.iter().any(|c| c.as_ptr() == p),
                "a large entry was copied"
            );
        }
        let decoded = Frame::decode(&bytes, 1 << 20).unwrap().unwrap();
        assert_eq!(decoded, (f, bytes.len()));
    }

    #[test]
    fn given_bad_frames_then_each_is_refused_with_its_reason() {
        let hello = encoded(&Frame::Hello {
            version: 1,
            site: "east".into(),
        });
        assert_eq!(
            Frame::decode(&hello, 4),
            Err(FrameError::TooLarge {
                len: hello.len() as u64 - 4,
                max: 4
            })
        );
        // The length alone is refused: the bytes need not be there.
        assert!(matches!(
            Frame::decode(&[0xff, 0xff, 0xff, 0xff], 1 << 20),
            Err(FrameError::TooLarge { .. })
        ));
        assert_eq!(Frame::decode(&[0, 0, 0, 0], 64), Err(FrameError::Empty));
        assert_eq!(
            Frame::decode(&[0, 0, 0, 1, 99], 64),
            Err(FrameError::UnknownKind(99))
        );
        assert_eq!(
            Frame::decode(&[0, 0, 0, 2, 1, 0], 64),
            Err(FrameError::Truncated("version"))
        );
        assert_eq!(
            Frame::decode(&[0, 0, 0, 6, 1, 0, 1, 0, 9, b'x'], 64),
            Err(FrameError::Truncated("site"))
        );
        assert_eq!(
            Frame::decode(&[0, 0, 0, 7, 1, 0, 1, 0, 1, 0xff, 0], 64),
            Err(FrameError::NotUtf8("site"))
        );
        // An entry count larger than the bytes could hold is refused before any allocation.
        assert_eq!(
            Frame::decode(&[0, 0, 0, 5, 5, 0xff, 0xff, 0xff, 0xff], 64),
            Err(FrameError::Truncated("entries"))
        );
        assert_eq!(
            Frame::decode(&[0, 0, 0, 2, 7, 9], 64),
            Err(FrameError::UnknownRefusal(9))
        );
        let mut opened = vec![0, 0, 0, 26, 4, 2];
        opened.extend_from_slice(&[0; 24]);
        assert_eq!(
            Frame::decode(&opened, 64),
            Err(FrameError::Invalid("opened flag is not 0 or 1"))
        );
        let mut long = hello.clone();
        long[3] += 1;
        long.push(0);
        assert_eq!(Frame::decode(&long, 64), Err(FrameError::Trailing(1)));
    }
}
