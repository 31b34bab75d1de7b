//! Frames: length-prefixed `BaseCommand`s, optionally followed by a checksummed message.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message as _;

use crate::pb::BaseCommand;
use crate::{MAGIC_BROKER_ENTRY_METADATA, MAGIC_CRC32C};

/// Why a byte stream is not a valid frame. Every variant means the connection must close.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("frame of {size} bytes exceeds the limit of {max} bytes")]
    TooLarge { size: usize, max: usize },
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("undecodable command: {0}")]
    Command(String),
}

/// The message part of a payload frame (SEND or MESSAGE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    /// The checksum the sender put in the frame, if it sent one.
    pub checksum: Option<u32>,
    /// `[metaSize u32][MessageMetadata][payload]`: exactly the bytes the checksum covers.
    pub body: Bytes,
    /// Length of the MessageMetadata inside `body`.
    pub metadata_len: usize,
    /// From the magic on (`[0x0e01][crc][body]`) when a checksum was sent: a stored entry as
    /// it is, without a copy.
    pub with_checksum: Option<Bytes>,
}

impl Payload {
    /// Whether the sent checksum matches the body (true when none was sent).
    pub fn checksum_ok(&self) -> bool {
        self.checksum
            .is_none_or(|c| c == crc32c::crc32c(&self.body))
    }

    /// The raw MessageMetadata bytes, as the producer encoded them.
    pub fn metadata_bytes(&self) -> Bytes {
        self.body.slice(4..4 + self.metadata_len)
    }

    /// Whether the metadata carries Meridian's origin ([`crate::Entry::claims_origin`]).
    pub fn claims_origin(&self) -> bool {
        crate::wire_fields::has_field(&self.metadata_bytes(), crate::entry::ORIGIN_FIELD)
    }

    /// The application payload (for a batch: the items back to back).
    pub fn data(&self) -> Bytes {
        self.body.slice(4 + self.metadata_len..)
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub command: BaseCommand,
    pub payload: Option<Payload>,
}

/// Decodes the next frame from `buf` if it is complete, consuming it. `Ok(None)`: more bytes
/// are needed. A frame whose announced size exceeds `max_frame_bytes` is refused before its
/// bytes arrive.
pub fn decode_frame(
    buf: &mut BytesMut,
    max_frame_bytes: usize,
) -> Result<Option<Frame>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let total = u32::from_be_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if total > max_frame_bytes {
        return Err(FrameError::TooLarge {
            size: total,
            max: max_frame_bytes,
        });
    }
    if total < 4 {
        return Err(FrameError::Malformed(format!(
            "total size {total} is smaller than the command size field"
        )));
    }
    if buf.len() < 4 + total {
        buf.reserve(4 + total - buf.len());
        return Ok(None);
    }
    buf.advance(4);
    let frame = buf.split_to(total).freeze();
    parse_frame(frame).map(Some)
}

/// Parses the bytes after the total-size field.
fn parse_frame(mut frame: Bytes) -> Result<Frame, FrameError> {
    let total = frame.len();
    let cmd_size = frame.get_u32() as usize;
    if cmd_size > frame.len() {
        return Err(FrameError::Malformed(format!(
            "command size {cmd_size} exceeds the frame's remaining {} bytes",
            total - 4
        )));
    }
    let cmd_bytes = frame.split_to(cmd_size);
    let command = BaseCommand::decode(cmd_bytes).map_err(|e| FrameError::Command(e.to_string()))?;
    if frame.is_empty() {
        return Ok(Frame {
            command,
            payload: None,
        });
    }
    let payload = parse_payload(frame)?;
    Ok(Frame {
        command,
        payload: Some(payload),
    })
}

/// Parses `[magic crc]? [metaSize][meta][payload]`, skipping a broker-entry-metadata prefix.
fn parse_payload(mut rest: Bytes) -> Result<Payload, FrameError> {
    if rest.len() >= 2 && u16::from_be_bytes([rest[0], rest[1]]) == MAGIC_BROKER_ENTRY_METADATA {
        rest.advance(2);
        if rest.len() < 4 {
            return Err(FrameError::Malformed(
                "truncated broker entry metadata".into(),
            ));
        }
        let n = rest.get_u32() as usize;
        if n > rest.len() {
            return Err(FrameError::Malformed(format!(
                "broker entry metadata of {n} bytes exceeds the frame"
            )));
        }
        rest.advance(n);
    }
    let mut checksum = None;
    let mut with_checksum = None;
    if rest.len() >= 2 && u16::from_be_bytes([rest[0], rest[1]]) == MAGIC_CRC32C {
        with_checksum = Some(rest.clone());
        if rest.len() < 6 {
            return Err(FrameError::Malformed("truncated checksum".into()));
        }
        rest.advance(2);
        checksum = Some(rest.get_u32());
    }
    if rest.len() < 4 {
        return Err(FrameError::Malformed(
            "payload section without a metadata size".into(),
        ));
    }
    let metadata_len = u32::from_be_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
    if metadata_len > rest.len() - 4 {
        return Err(FrameError::Malformed(format!(
            "metadata size {metadata_len} exceeds the frame's remaining {} bytes",
            rest.len() - 4
        )));
    }
    Ok(Payload {
        checksum,
        body: rest,
        metadata_len,
        with_checksum,
    })
}

/// Appends a simple frame holding `cmd`.
pub fn encode_command(out: &mut BytesMut, cmd: &BaseCommand) {
    let n = cmd.encoded_len();
    out.reserve(8 + n);
    out.put_u32((4 + n) as u32);
    out.put_u32(n as u32);
    cmd.encode(out).expect("reserved");
}

/// Appends a payload frame: `cmd` followed by a stored entry (magic, checksum, metadata size,
/// metadata, payload), which is copied as it is.
pub fn encode_message(out: &mut BytesMut, cmd: &BaseCommand, entry: &[u8]) {
    let n = cmd.encoded_len();
    out.reserve(8 + n + entry.len());
    out.put_u32((4 + n + entry.len()) as u32);
    out.put_u32(n as u32);
    cmd.encode(out).expect("reserved");
    out.put_slice(entry);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{cmd, entry::Entry, pb};
    use rand::{Rng, SeedableRng};

    fn metadata(name: &str, seq: u64) -> Vec<u8> {
        pb::MessageMetadata {
            producer_name: name.into(),
            sequence_id: seq,
            publish_time: 1,
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn given_a_stream_of_frames_cut_anywhere_then_each_decodes_once_whole() {
        let mut wire = BytesMut::new();
        encode_command(&mut wire, &cmd::ping());
        let entry = Entry::build(&metadata("p", 7), b"hello");
        encode_message(&mut wire, &cmd::message(3, 9, 4, 0), entry.as_bytes());
        encode_command(&mut wire, &cmd::pong());
        let wire = wire.freeze();
        for cut in 0..wire.len() {
            let mut buf = BytesMut::from(&wire[..cut]);
            let mut frames = Vec::new();
            while let Some(f) = decode_frame(&mut buf, 1 << 20).unwrap() {
                frames.push(f);
            }
            buf.extend_from_slice(&wire[cut..]);
            while let Some(f) = decode_frame(&mut buf, 1 << 20).unwrap() {
                frames.push(f);
            }
            assert_eq!(frames.len(), 3, "cut at {cut}");
            let p = frames[1].payload.as_ref().unwrap();
            assert!(p.checksum_ok());
            assert_eq!(&p.data()[..], b"hello");
            // The stored entry is the frame's tail as sent, byte for byte.
            assert_eq!(Entry::from_payload(p), entry);
            assert_eq!(p.metadata_bytes(), Bytes::from(metadata("p", 7)));
            assert_eq!(frames[1].command.message.as_ref().unwrap().consumer_id, 3);
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn given_a_frame_over_the_limit_then_it_is_refused_before_its_bytes_arrive() {
        let mut buf = BytesMut::new();
        buf.put_u32(5 * 1024 * 1024 + 1);
        assert_eq!(
            decode_frame(&mut buf, 5 * 1024 * 1024),
            Err(FrameError::TooLarge {
                size: 5 * 1024 * 1024 + 1,
                max: 5 * 1024 * 1024
            })
        );
    }

    #[test]
    fn given_a_flipped_payload_byte_then_the_checksum_fails_and_the_frame_still_parses() {
        let mut wire = BytesMut::new();
        let entry = Entry::build(&metadata("p", 1), b"payload");
        encode_message(&mut wire, &cmd::message(1, 1, 1, 0), entry.as_bytes());
        let last = wire.len() - 1;
        wire[last] ^= 1;
        let f = decode_frame(&mut wire, 1 << 20).unwrap().unwrap();
        assert!(!f.payload.unwrap().checksum_ok());
    }

    #[test]
    fn given_payload_without_magic_then_it_is_accepted_without_a_checksum() {
        let meta = metadata("p", 1);
        let cmd = cmd::ping();
        let n = cmd.encoded_len();
        let mut wire = BytesMut::new();
        wire.put_u32((4 + n + 4 + meta.len() + 3) as u32);
        wire.put_u32(n as u32);
        cmd.encode(&mut wire).unwrap();
        wire.put_u32(meta.len() as u32);
        wire.put_slice(&meta);
        wire.put_slice(b"abc");
        let p = decode_frame(&mut wire, 1 << 20)
            .unwrap()
            .unwrap()
            .payload
            .unwrap();
        assert_eq!(p.checksum, None);
        assert!(p.checksum_ok());
        assert_eq!(&p.data()[..], b"abc");
        let e = Entry::from_payload(&p);
        assert_eq!(e.payload(), Bytes::from_static(b"abc"));
        assert!(e.verify());
    }

    #[test]
    fn given_bad_sizes_then_errors_name_them_and_nothing_panics() {
        // command size past the frame
        let mut buf = BytesMut::new();
        buf.put_u32(8);
        buf.put_u32(100);
        buf.put_u32(0);
        assert!(matches!(
            decode_frame(&mut buf, 1 << 20),
            Err(FrameError::Malformed(m)) if m.contains("command size 100")
        ));
        // metadata size past the frame
        let cmd = cmd::ping();
        let n = cmd.encoded_len();
        let mut buf = BytesMut::new();
        buf.put_u32((4 + n + 6 + 4) as u32);
        buf.put_u32(n as u32);
        cmd.encode(&mut buf).unwrap();
        buf.put_u16(MAGIC_CRC32C);
        buf.put_u32(0);
        buf.put_u32(1000);
        assert!(matches!(
            decode_frame(&mut buf, 1 << 20),
            Err(FrameError::Malformed(m)) if m.contains("metadata size 1000")
        ));
        // total smaller than the command-size field
        let mut buf = BytesMut::new();
        buf.put_u32(2);
        buf.put_u16(0);
        assert!(decode_frame(&mut buf, 1 << 20).is_err());
    }

    #[test]
    fn given_random_bytes_then_the_decoder_never_panics() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut good = BytesMut::new();
        let entry = Entry::build(&metadata("p", 1), b"x");
        encode_message(&mut good, &cmd::message(1, 1, 1, 0), entry.as_bytes());
        for _ in 0..20_000 {
            let mut b = if rng.gen_bool(0.5) {
                let mut g = good.clone();
                for _ in 0..rng.gen_range(1..4) {
                    let i = rng.gen_range(0..g.len());
                    g[i] = rng.gen();
                }
                g
            } else {
                let n = rng.gen_range(0..64);
                BytesMut::from(&(0..n).map(|_| rng.gen::<u8>()).collect::<Vec<_>>()[..])
            };
            while let Ok(Some(_)) = decode_frame(&mut b, 1 << 16) {}
        }
    }
}
