//! Reading a frame off a topic's stream, an Entries frame's entries shaped as their bytes come.
//!
//! ```text
//!  quinn's chunks (a packet's worth each) ──► Pull ──► kind, count, (position, length)*
//!                                                 └──► each entry's bytes, piece by piece,
//!                                                      to the site's EntryBuild (its stored form)
//! ```
//!
//! The site keeps a replicated entry in a form of its own (Meridian adds the entry's origin to
//! its metadata), so a frame copied whole first would be copied again entry by entry. Here
//! each piece goes straight from quinn's buffer to the entry's own, and quinn's buffers are
//! let go as soon as they are read (holding them would keep whole datagram buffers alive
//! outside flow control). A frame of another kind is read into one buffer and decoded as a
//! whole ([`Frame::decode_body`]); both ways refuse the same malformed frames.

use bytes::{BufMut, Bytes, BytesMut};

use crate::frame::{Frame, FrameError, OriginPosition, ReplicatedEntry, ENTRIES_KIND};
use crate::link::StreamError;

/// What a topic's entries become at this site, made as their bytes come off the stream.
pub trait EntryShaper: Send + Sync {
    /// A builder for the entry at origin position `at`, `len` bytes as sent.
    fn begin(&self, at: OriginPosition, len: usize) -> Box<dyn EntryBuild>;
}

/// One entry being made.
pub trait EntryBuild: Send {
    /// The entry's next bytes; `Err` with the reason the entry is refused.
    fn push(&mut self, piece: &[u8]) -> Result<(), String>;
    /// Every byte came: the entry as this site keeps it, or why it is refused.
    fn finish(self: Box<Self>) -> Result<Bytes, String>;
}

/// Keeps each entry as it was sent, in a buffer of its own.
pub struct AsSent;

struct AsSentBuild(BytesMut);

impl EntryShaper for AsSent {
    fn begin(&self, _at: OriginPosition, len: usize) -> Box<dyn EntryBuild> {
        Box::new(AsSentBuild(BytesMut::with_capacity(len)))
    }
}

impl EntryBuild for AsSentBuild {
    fn push(&mut self, piece: &[u8]) -> Result<(), String> {
        self.0.put_slice(piece);
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<Bytes, String> {
        Ok(self.0.freeze())
    }
}

/// A frame as read: whole, or stopped at an entry the site refused (what came before it in
/// the frame is dropped with it).
#[derive(Debug)]
pub enum Shaped {
    Frame(Frame),
    Refused { at: OriginPosition, reason: String },
}

/// Where a frame's bytes come from, a chunk at a time (a QUIC stream; a list in tests).
pub(crate) trait Chunks {
    /// The next chunk of at most `max` bytes; `None` at the stream's end.
    async fn chunk(&mut self, max: usize) -> Result<Option<Bytes>, StreamError>;
}

impl Chunks for quinn::RecvStream {
    async fn chunk(&mut self, max: usize) -> Result<Option<Bytes>, StreamError> {
        match self.read_chunk(max, true).await {
            Ok(c) => Ok(c.map(|c| c.bytes)),
            Err(quinn::ReadError::ConnectionLost(c)) => Err(StreamError::Connection(c)),
            Err(e) => Err(StreamError::Stream(e.to_string())),
        }
    }
}

/// A frame's body of `len` bytes, taken from its source a chunk at a time, never past its end.
struct Pull<'a, C> {
    src: &'a mut C,
    /// What is left of the chunk last read.
    chunk: Bytes,
    /// The frame's bytes not yet read from the source.
    unread: usize,
    len: usize,
}

impl<C: Chunks> Pull<'_, C> {
    /// The frame's bytes not yet taken.
    fn remaining(&self) -> usize {
        self.chunk.len() + self.unread
    }

    /// The next piece of at most `max` bytes (call only with bytes remaining).
    async fn piece(&mut self, max: usize) -> Result<Bytes, StreamError> {
        if self.chunk.is_empty() {
            match self.src.chunk(self.unread).await? {
                Some(c) if !c.is_empty() => {
                    self.unread -= c.len().min(self.unread);
                    self.chunk = c;
                }
                Some(_) | None => {
                    return Err(StreamError::Stream(format!(
                        "the stream ended {} bytes into a frame of {}",
                        self.len - self.unread,
                        self.len
                    )))
                }
            }
        }
        Ok(self.chunk.split_to(max.min(self.chunk.len())))
    }

    async fn fixed<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], StreamError> {
        if self.remaining() < N {
            return Err(FrameError::Truncated(what).into());
        }
        let mut out = [0u8; N];
        let mut at = 0;
        while at < N {
            let p = self.piece(N - at).await?;
            out[at..at + p.len()].copy_from_slice(&p);
            at += p.len();
        }
        Ok(out)
    }
}

/// Reads the body of a frame of `len` bytes (its length prefix read and checked), shaping an
/// Entries frame's entries with `shaper` as their bytes come.
pub(crate) async fn read_shaped<C: Chunks>(
    src: &mut C,
    len: usize,
    shaper: &dyn EntryShaper,
) -> Result<Shaped, StreamError> {
    let mut r = Pull {
        src,
        chunk: Bytes::new(),
        unread: len,
        len,
    };
    let [kind] = r.fixed::<1>("frame kind").await?;
    if kind != ENTRIES_KIND {
        let mut body = BytesMut::with_capacity(len);
        body.put_u8(kind);
        body.put_slice(&r.chunk);
        return Ok(Shaped::Frame(read_body(r.src, len, body).await?));
    }
    let count = u32::from_be_bytes(r.fixed("entry count").await?) as usize;
    // Each entry takes at least 20 bytes: a count past that is a lie.
    if count > r.remaining() / 20 {
        return Err(FrameError::Truncated("entries").into());
    }
    let mut items = Vec::with_capacity(count);
    for _ in 0..count {
        let at = OriginPosition {
            ledger: u64::from_be_bytes(r.fixed("position").await?),
            entry: u64::from_be_bytes(r.fixed("position").await?),
        };
        let n = u32::from_be_bytes(r.fixed("entry length").await?) as usize;
        if r.remaining() < n {
            return Err(FrameError::Truncated("entry").into());
        }
        let mut entry = shaper.begin(at, n);
        let mut left = n;
        while left > 0 {
            let piece = r.piece(left).await?;
            left -= piece.len();
            if let Err(reason) = entry.push(&piece) {
                return Ok(Shaped::Refused { at, reason });
            }
        }
        match entry.finish() {
            Ok(bytes) => items.push(ReplicatedEntry { at, bytes }),
            Err(reason) => return Ok(Shaped::Refused { at, reason }),
        }
    }
    if r.remaining() > 0 {
        return Err(FrameError::Trailing(r.remaining()).into());
    }
    Ok(Shaped::Frame(Frame::Entries { items }))
}

/// Reads the rest of a frame of `len` bytes into `body` (which holds its start) and decodes it.
pub(crate) async fn read_body<C: Chunks>(
    src: &mut C,
    len: usize,
    mut body: BytesMut,
) -> Result<Frame, StreamError> {
    while body.len() < len {
        match src.chunk(len - body.len()).await? {
            Some(c) if !c.is_empty() => body.extend_from_slice(&c),
            Some(_) | None => {
                return Err(StreamError::Stream(format!(
                    "the stream ended {} bytes into a frame of {len}",
                    body.len()
                )))
            }
        }
    }
    Ok(Frame::decode_body(body.freeze())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame's bytes cut into chunks of `size` (the last shorter).
    struct Cut(std::collections::VecDeque<Bytes>);

    impl Cut {
        fn new(bytes: &[u8], size: usize) -> Self {
            Cut(bytes.chunks(size).map(Bytes::copy_from_slice).collect())
        }
    }

    impl Chunks for Cut {
        async fn chunk(&mut self, max: usize) -> Result<Option<Bytes>, StreamError> {
            let Some(mut c) = self.0.pop_front() else {
                return Ok(None);
            };
            if c.len() > max {
                self.0.push_front(c.split_off(max));
            }
            Ok(Some(c))
        }
    }

    /// Refuses an entry whose first byte is 0xff; keeps the rest as sent.
    struct Picky;
    struct PickyBuild(BytesMut);

    impl EntryShaper for Picky {
        fn begin(&self, _at: OriginPosition, _len: usize) -> Box<dyn EntryBuild> {
            Box::new(PickyBuild(BytesMut::new()))
        }
    }

    impl EntryBuild for PickyBuild {
        fn push(&mut self, piece: &[u8]) -> Result<(), String> {
            if self.0.is_empty() && piece.first() == Some(&0xff) {
                return Err("begins with 0xff".into());
            }
            self.0.put_slice(piece);
            Ok(())
        }

        fn finish(self: Box<Self>) -> Result<Bytes, String> {
            Ok(self.0.freeze())
        }
    }

    fn entries(sizes: &[usize], first: u8) -> Frame {
        Frame::Entries {
            items: sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| ReplicatedEntry {
                    at: OriginPosition {
                        ledger: 3,
                        entry: i as u64,
                    },
                    bytes: Bytes::from(
                        (0..n)
                            .map(|j| if j == 0 { first } else { (i * 7 + j) as u8 })
                            .collect::<Vec<u8>>(),
                    ),
                })
                .collect(),
        }
    }

    fn body(f: &Frame) -> Vec<u8> {
        let mut out = BytesMut::new();
        f.encode(&mut out);
        out[4..].to_vec()
    }

    fn read(bytes: &[u8], size: usize, shaper: &dyn EntryShaper) -> Result<Shaped, String> {
        let mut src = Cut::new(bytes, size);
        futures::executor::block_on(read_shaped(&mut src, bytes.len(), shaper))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn given_frames_cut_anywhere_then_they_read_as_decoded_whole() {
        let frames = [
            entries(&[0, 1, 20, 3000, 70_000], 1),
            entries(&[], 1),
            Frame::Open {
                topic: "persistent://acme/g/t".into(),
                partitions: 4,
            },
            Frame::Ack {
                up_to: OriginPosition {
                    ledger: 1,
                    entry: 2,
                },
            },
        ];
        for f in &frames {
            let b = body(f);
            for size in [1, 2, 5, 19, 20, 21, 1452, 1 << 20] {
                match read(&b, size, &AsSent) {
                    Ok(Shaped::Frame(got)) => assert_eq!(&got, f, "chunks of {size}"),
                    other => panic!("chunks of {size}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn given_malformed_frames_then_both_readers_refuse_them() {
        let good = body(&entries(&[10, 20], 1));
        let mut cases: Vec<(Vec<u8>, &str)> = Vec::new();
        // A count larger than the bytes could hold; an entry longer than what is left; bytes
        // left over; a frame cut inside a position.
        let mut b = good.clone();
        b[1..5].copy_from_slice(&1000u32.to_be_bytes());
        cases.push((b, "truncated entries")); // (the count)
        let mut b = good.clone();
        b[21..25].copy_from_slice(&1000u32.to_be_bytes());
        cases.push((b, "truncated entry")); // (the bytes)
        let mut b = good.clone();
        b.extend_from_slice(&[0; 3]);
        cases.push((b, "3 bytes left over after the frame's fields"));
        cases.push((good[..10].to_vec(), "truncated entries"));
        cases.push((vec![42], "unknown frame kind 42"));
        for (b, want) in cases {
            let whole = Frame::decode_body(Bytes::from(b.clone())).unwrap_err();
            assert_eq!(whole.to_string(), want);
            for size in [1, 7, 1 << 20] {
                assert_eq!(
                    read(&b, size, &AsSent).unwrap_err(),
                    want,
                    "chunks of {size}"
                );
            }
        }
    }

    #[test]
    fn given_an_entry_the_site_refuses_then_the_frame_stops_there_with_its_reason() {
        let mut f = entries(&[10, 20, 30], 1);
        if let Frame::Entries { items } = &mut f {
            let mut b = items[1].bytes.to_vec();
            b[0] = 0xff;
            items[1].bytes = Bytes::from(b);
        }
        for size in [1, 9, 1 << 20] {
            match read(&body(&f), size, &Picky) {
                Ok(Shaped::Refused { at, reason }) => {
                    assert_eq!((at.ledger, at.entry), (3, 1));
                    assert_eq!(reason, "begins with 0xff");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn given_frames_damaged_at_random_then_the_chunked_reader_agrees_with_the_whole_decoder() {
        // xorshift: the same cases every run.
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let frames = [
            body(&entries(&[0, 5, 40, 300], 1)),
            body(&Frame::Refused {
                code: crate::frame::RefusalCode::Moved,
                reason: "quic://127.0.0.1:1".into(),
            }),
            body(&Frame::Sync {
                doc: Bytes::from_static(b"{}"),
            }),
        ];
        for round in 0..20_000 {
            let mut b = frames[round % frames.len()].clone();
            for _ in 0..1 + next() % 3 {
                let at = (next() % b.len() as u64) as usize;
                b[at] = next() as u8;
            }
            if next() % 4 == 0 {
                b.truncate((next() % b.len() as u64) as usize + 1);
            }
            let whole = Frame::decode_body(Bytes::from(b.clone()));
            let size = 1 + (next() % 64) as usize;
            match (whole, read(&b, size, &AsSent)) {
                (Ok(w), Ok(Shaped::Frame(c))) => assert_eq!(w, c, "{b:?}"),
                (Err(w), Err(c)) => assert_eq!(w.to_string(), c, "{b:?}"),
                (w, c) => panic!("whole {w:?}, in chunks of {size} {c:?}: {b:?}"),
            }
        }
    }

    #[test]
    fn given_a_stream_that_ends_inside_a_frame_then_it_says_where() {
        let b = body(&entries(&[100], 1));
        let mut src = Cut::new(&b[..50], 7);
        let got = futures::executor::block_on(read_shaped(&mut src, b.len(), &AsSent))
            .unwrap_err()
            .to_string();
        assert!(got.contains("ended 50 bytes into a frame of"), "{got}");
    }
}
