//! Frames of the link's streams, sans-IO.
//!
//! ```text
//!  frame = length: u32 BE (of what follows) | kind: u8 | body
//!  str   = length: u16 BE | UTF-8 bytes
//!  Hello   (1) = version: u16 | site: str      the dialer, first on the control stream
//!  Welcome (2) = version: u16 | site: str      the listener's answer
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// The dialer names itself (its certificate already did; they must agree).
    Hello { version: u16, site: String },
    /// The listener's answer.
    Welcome { version: u16, site: String },
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
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => 1,
            Frame::Welcome { .. } => 2,
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
        }
        let len = (out.len() - start - LENGTH_BYTES) as u32;
        out[start..start + LENGTH_BYTES].copy_from_slice(&len.to_be_bytes());
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

    /// Decodes one frame's body (what follows the length prefix).
    pub fn decode_body(mut body: &[u8]) -> Result<Frame, FrameError> {
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
        ] {
            let bytes = encoded(&f);
            assert_eq!(Frame::decode(&bytes, 1 << 20), Ok(Some((f, bytes.len()))));
            for cut in 0..bytes.len() {
                assert_eq!(Frame::decode(&bytes[..cut], 1 << 20), Ok(None));
            }
        }
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
        let mut long = hello.clone();
        long[3] += 1;
        long.push(0);
        assert_eq!(Frame::decode(&long, 64), Err(FrameError::Trailing(1)));
    }
}
