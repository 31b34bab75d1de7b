//! The form a replicated entry is stored in at the site it was replicated to, made as its
//! bytes arrive.
//!
//! ```text
//!  as sent:   [0x0e01][crc][metaSize][MessageMetadata            ][payload]
//!  as stored: [0x0e01][crc'][metaSize'][MessageMetadata|from|origin][payload]
//!             └── head: gathered first (a few dozen bytes) ──┘ └ each piece copied once as
//!                                                                it comes, checksummed in
//!                                                                32 KiB runs once copied ┘
//! ```
//!
//! `replicated_from` (what stock clients read as a message's origin cluster) and Meridian's
//! origin (site and position, field 1001, which stock clients skip) are appended to the
//! metadata bytes, nothing re-encoded. The sent checksum is checked and the stored one made
//! from the payload's one pass (CRC32-C combined from the head's and the payload's), so a
//! received entry is read once and written once: no copy of the whole entry (or of the frame
//! it came in) is made first.

use bytes::{BufMut, Bytes, BytesMut};

use crate::crc_combine::crc32c_combine;
use crate::entry::{Entry, EntryError, HEADER, ORIGIN_FIELD, REPLICATED_FROM_FIELD};
use crate::pb::MeridianOrigin;
use crate::MAGIC_CRC32C;

/// Makes one replicated entry's stored form from its pieces, in order.
#[derive(Debug)]
pub struct ReplicaForm {
    origin: MeridianOrigin,
    /// The entry's length as sent.
    len: usize,
    /// The head as sent (magic, checksum, metadata size, metadata) while it is gathered.
    head: Vec<u8>,
    /// The stored form once the head was whole: its head written, the payload coming.
    out: Option<Started>,
}

#[derive(Debug)]
struct Started {
    buf: BytesMut,
    /// The sent head's length.
    head_len: usize,
    /// The sent checksum, and the CRC of what it covers in the head.
    sent_crc: u32,
    sent_head_crc: u32,
    /// The stored head's CRC (what the stored checksum covers before the payload).
    stored_head_crc: u32,
    payload_crc: u32,
    payload_len: usize,
    /// Payload bytes the CRC covers so far: it is taken over runs of [`CRC_RUN`] bytes once
    /// they are in `buf` (still in cache), not piece by piece (a packet's worth each, where
    /// the checksum's setup costs as much as the bytes).
    crc_len: usize,
}

/// Payload bytes checksummed at a time.
const CRC_RUN: usize = 32 * 1024;

impl ReplicaForm {
    /// For an entry of `len` bytes (as sent) written at `origin`.
    pub fn new(origin: MeridianOrigin, len: usize) -> Self {
        ReplicaForm {
            origin,
            len,
            head: Vec::with_capacity(HEADER + 128),
            out: None,
        }
    }

    /// Takes the entry's next bytes.
    pub fn push(&mut self, mut piece: &[u8]) -> Result<(), EntryError> {
        while self.out.is_none() && !piece.is_empty() {
            let want = self.head_len()? - self.head.len();
            let n = want.min(piece.len());
            self.head.extend_from_slice(&piece[..n]);
            piece = &piece[n..];
            if self.head.len() == self.head_len()? {
                self.start()?;
            }
        }
        if piece.is_empty() {
            return Ok(());
        }
        let s = self.out.as_mut().expect("started");
        if s.payload_len + piece.len() > self.len - s.head_len {
            return Err(EntryError(format!(
                "more than the {} bytes announced",
                self.len
            )));
        }
        s.payload_len += piece.len();
        s.buf.put_slice(piece);
        if s.payload_len - s.crc_len >= CRC_RUN {
            s.crc_rest();
        }
        Ok(())
    }

    /// The stored form, once every byte came: `Err` if the entry is malformed, fails its
    /// checksum, or already names an origin (it arrived where it was sent from by
    /// replication, and is not to be sent on).
    pub fn finish(self) -> Result<Entry, EntryError> {
        let Some(mut s) = self.out else {
            return Err(EntryError(format!(
                "ended {} bytes into its head",
                self.head.len()
            )));
        };
        s.crc_rest();
        if s.head_len + s.payload_len != self.len {
            return Err(EntryError(format!(
                "{} of its {} bytes came",
                s.head_len + s.payload_len,
                self.len
            )));
        }
        if crc32c_combine(s.sent_head_crc, s.payload_crc, s.payload_len) != s.sent_crc {
            return Err(EntryError("fails its checksum".into()));
        }
        let crc = crc32c_combine(s.stored_head_crc, s.payload_crc, s.payload_len);
        s.buf[2..6].copy_from_slice(&crc.to_be_bytes());
        Ok(Entry::from_stored(s.buf.freeze()))
    }

    /// The head's length: the fixed header until it is there, then with the metadata.
    fn head_len(&self) -> Result<usize, EntryError> {
        if self.len < HEADER {
            return Err(EntryError(format!(
                "{} bytes is shorter than a header",
                self.len
            )));
        }
        if self.head.len() < HEADER {
            return Ok(HEADER);
        }
        let m = u32::from_be_bytes(self.head[6..10].try_into().expect("4 bytes")) as usize;
        if m > self.len - HEADER {
            return Err(EntryError(format!(
                "metadata size {m} exceeds the entry's {} bytes",
                self.len
            )));
        }
        Ok(HEADER + m)
    }

    /// The head is whole: check it, write the stored head.
    fn start(&mut self) -> Result<(), EntryError> {
        let head = std::mem::take(&mut self.head);
        if u16::from_be_bytes([head[0], head[1]]) != MAGIC_CRC32C {
            return Err(EntryError("no checksum magic".into()));
        }
        let meta_sent = &head[HEADER..];
        // Whole fields only: metadata that ended inside a field could take the fields
        // appended here into it (and so hide its origin).
        let mut origin_named = false;
        for field in crate::wire_fields::fields(meta_sent) {
            match field {
                Ok((number, _)) => origin_named |= number == ORIGIN_FIELD,
                Err(()) => return Err(EntryError("has malformed metadata".into())),
            }
        }
        if origin_named {
            return Err(EntryError(
                "arrived there by replication and is not to be sent on".into(),
            ));
        }
        let mut meta = Vec::with_capacity(meta_sent.len() + self.origin.site.len() * 2 + 32);
        meta.extend_from_slice(meta_sent);
        prost::encoding::string::encode(REPLICATED_FROM_FIELD, &self.origin.site, &mut meta);
        prost::encoding::message::encode(ORIGIN_FIELD, &self.origin, &mut meta);
        let payload_len = self.len - head.len();
        let mut buf = BytesMut::with_capacity(HEADER + meta.len() + payload_len);
        buf.put_u16(MAGIC_CRC32C);
        buf.put_u32(0);
        buf.put_u32(meta.len() as u32);
        buf.put_slice(&meta);
        self.out = Some(Started {
            head_len: head.len(),
            sent_crc: u32::from_be_bytes(head[2..6].try_into().expect("4 bytes")),
            sent_head_crc: crc32c::crc32c(&head[6..]),
            stored_head_crc: crc32c::crc32c(&buf[6..]),
            buf,
            payload_crc: 0,
            payload_len: 0,
            crc_len: 0,
        });
        Ok(())
    }
}

impl Started {
    /// Extends the payload's CRC over what came since it was last taken.
    fn crc_rest(&mut self) {
        let end = self.buf.len();
        let from = end - (self.payload_len - self.crc_len);
        self.payload_crc = crc32c::crc32c_append(self.payload_crc, &self.buf[from..end]);
        self.crc_len = self.payload_len;
    }
}

/// An entry's stored form in one go (its bytes in one piece).
pub fn replicated(sent: &Bytes, origin: &MeridianOrigin) -> Result<Entry, EntryError> {
    let mut f = ReplicaForm::new(origin.clone(), sent.len());
    f.push(sent)?;
    f.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::MessageMetadata;
    use prost::Message as _;

    fn origin() -> MeridianOrigin {
        MeridianOrigin {
            site: "east".into(),
            ledger_id: 12,
            entry_id: 34,
        }
    }

    fn sent(payload_len: usize) -> Entry {
        let meta = MessageMetadata {
            producer_name: "p".into(),
            sequence_id: 7,
            publish_time: 99,
            ..Default::default()
        };
        let payload: Vec<u8> = (0..payload_len).map(|i| (i * 31 % 251) as u8).collect();
        Entry::build(&meta.encode_to_vec(), &payload)
    }

    fn in_pieces(sent: &[u8], size: usize) -> Result<Entry, EntryError> {
        let mut f = ReplicaForm::new(origin(), sent.len());
        for piece in sent.chunks(size) {
            f.push(piece)?;
        }
        f.finish()
    }

    #[test]
    fn given_an_entry_in_pieces_of_any_size_then_its_stored_form_is_the_same_as_whole() {
        for payload_len in [0, 1, 1000, 70_000] {
            let e = sent(payload_len);
            let whole = replicated(e.as_bytes(), &origin()).expect("verifies");
            assert!(whole.verify());
            assert_eq!(whole.payload(), e.payload());
            assert_eq!(whole.origin(), Ok(Some(origin())));
            for size in [1, 3, 9, 10, 11, 1452, 65_536] {
                let got = in_pieces(e.as_bytes(), size).expect("verifies");
                assert_eq!(got, whole, "payload {payload_len}, pieces of {size}");
            }
        }
    }

    #[test]
    fn given_a_damaged_short_long_or_already_replicated_entry_then_no_stored_form_is_made() {
        let e = sent(5000);
        let bytes = e.as_bytes().to_vec();
        for at in [0, 1, 2, 5, 9, 12, bytes.len() / 2, bytes.len() - 1] {
            let mut b = bytes.clone();
            b[at] ^= 0x10;
            assert!(in_pieces(&b, 1452).is_err(), "byte {at} damaged");
        }
        // Fewer bytes than announced, more, or fewer than a header.
        let mut f = ReplicaForm::new(origin(), bytes.len() + 1);
        f.push(&bytes).unwrap();
        assert!(f.finish().unwrap_err().0.contains("came"));
        let mut f = ReplicaForm::new(origin(), bytes.len() - 1);
        assert!(f.push(&bytes).is_err());
        let mut f = ReplicaForm::new(origin(), 6);
        assert!(f.push(&bytes[..6]).is_err());
        // A metadata size past the entry's end.
        let mut b = bytes.clone();
        b[6..10].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(in_pieces(&b, 3).unwrap_err().0.contains("metadata size"));
        // Metadata that ends inside a field (one whose length would take in the fields added
        // here, hiding the origin in it) is refused.
        let mut meta = MessageMetadata {
            producer_name: "p".into(),
            ..Default::default()
        }
        .encode_to_vec();
        prost::encoding::encode_key(2000, prost::encoding::WireType::LengthDelimited, &mut meta);
        prost::encoding::encode_varint(40, &mut meta);
        let swallowing = Entry::build(&meta, &[1u8; 100]);
        let err = in_pieces(swallowing.as_bytes(), 7).unwrap_err();
        assert_eq!(err.0, "has malformed metadata");
        // An entry that came here by replication is not taken again.
        let stored = replicated(e.as_bytes(), &origin()).unwrap();
        let err = in_pieces(stored.as_bytes(), 100).unwrap_err();
        assert!(err.0.contains("not to be sent on"), "{err}");
    }
}
