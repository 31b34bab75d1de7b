//! Stored entries: what a topic's log holds for one SEND.
//!
//! An entry is the checksummed tail of a payload frame, kept byte for byte:
//! `[0x0e01][crc32c u32][metaSize u32][MessageMetadata][payload]`. Storing the magic and the
//! checksum means dispatch copies the entry after a MESSAGE command with no re-encoding and no
//! checksum to compute, and consumers verify the producer's own checksum end to end.

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message as _;

use crate::frame::Payload;
use crate::pb::{MeridianOrigin, MessageMetadata};
use crate::MAGIC_CRC32C;

pub(crate) const HEADER: usize = 2 + 4 + 4;
/// `MessageMetadata.replicated_from`: the cluster stock clients read as a message's origin.
pub(crate) const REPLICATED_FROM_FIELD: u32 = 5;
/// `MessageMetadata.meridian_origin`: where an entry that arrived by replication was written.
pub const ORIGIN_FIELD: u32 = 1001;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry(Bytes);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("stored entry is corrupt: {0}")]
pub struct EntryError(pub String);

impl Entry {
    /// Builds an entry from a metadata encoding and a payload, computing the checksum.
    pub fn build(metadata: &[u8], payload: &[u8]) -> Entry {
        let mut b = BytesMut::with_capacity(HEADER + metadata.len() + payload.len());
        b.put_u16(MAGIC_CRC32C);
        b.put_u32(0);
        b.put_u32(metadata.len() as u32);
        b.put_slice(metadata);
        b.put_slice(payload);
        let crc = crc32c::crc32c(&b[6..]);
        b[2..6].copy_from_slice(&crc.to_be_bytes());
        Entry(b.freeze())
    }

    /// The same message with `properties` added to its metadata, as a message of this site: a
    /// copy (a dead letter) is written here, so where the original arrived from by replication
    /// (`replicated_from`, Meridian's origin) is left out. The other metadata bytes are kept
    /// and the properties appended as further occurrences of the repeated field, which
    /// protobuf readers merge; nothing is re-encoded. The checksum is computed anew.
    pub fn with_properties(&self, properties: &[(&str, &str)]) -> Entry {
        let original = self.metadata_bytes();
        let mut meta =
            crate::wire_fields::without_fields(&original, &[REPLICATED_FROM_FIELD, ORIGIN_FIELD])
                .unwrap_or_else(|| original.to_vec());
        for (k, v) in properties {
            let kv = crate::pb::KeyValue {
                key: (*k).to_string(),
                value: (*v).to_string(),
            };
            // Field 4 (properties), wire type 2 (length-delimited).
            prost::encoding::encode_key(4, prost::encoding::WireType::LengthDelimited, &mut meta);
            prost::encoding::encode_varint(prost::Message::encoded_len(&kv) as u64, &mut meta);
            prost::Message::encode_raw(&kv, &mut meta);
        }
        Entry::build(&meta, &self.payload())
    }

    /// The entry as stored at a site it was replicated to (see [`crate::replica_form`], which
    /// makes it as a received entry's bytes arrive). `None` if this entry fails its checksum
    /// or already names an origin.
    pub fn replicated(&self, origin: &MeridianOrigin) -> Option<Entry> {
        crate::replica_form::replicated(&self.0, origin).ok()
    }

    /// Bytes [`crate::replica_form`] made whole and checked.
    pub(crate) fn from_stored(bytes: Bytes) -> Entry {
        Entry(bytes)
    }

    /// Where an entry that arrived by replication was first written; `None` for an entry
    /// produced at this site.
    pub fn origin(&self) -> Result<Option<MeridianOrigin>, EntryError> {
        Ok(self.metadata()?.meridian_origin)
    }

    /// Whether the metadata carries Meridian's origin, which only the site's own receiving of
    /// replicated entries may write (a producer's message that carried one would be taken for
    /// a replicated entry: not sent on, and its claimed origin believed).
    pub fn claims_origin(&self) -> bool {
        crate::wire_fields::has_field(&self.metadata_bytes(), ORIGIN_FIELD)
    }

    /// The entry for a received payload. Call only after [`Payload::checksum_ok`]; a payload
    /// sent without a checksum gets one computed here.
    pub fn from_payload(p: &Payload) -> Entry {
        if let Some(raw) = &p.with_checksum {
            return Entry(raw.clone());
        }
        let crc = p.checksum.unwrap_or_else(|| crc32c::crc32c(&p.body));
        let mut b = BytesMut::with_capacity(6 + p.body.len());
        b.put_u16(MAGIC_CRC32C);
        b.put_u32(crc);
        b.put_slice(&p.body);
        Entry(b.freeze())
    }

    /// Wraps bytes read back from storage, checking the structure (not the checksum).
    pub fn parse(bytes: Bytes) -> Result<Entry, EntryError> {
        if bytes.len() < HEADER {
            return Err(EntryError(format!(
                "{} bytes is shorter than a header",
                bytes.len()
            )));
        }
        if u16::from_be_bytes([bytes[0], bytes[1]]) != MAGIC_CRC32C {
            return Err(EntryError("no checksum magic".into()));
        }
        let m = u32::from_be_bytes(bytes[6..10].try_into().expect("4 bytes")) as usize;
        if m > bytes.len() - HEADER {
            return Err(EntryError(format!(
                "metadata size {m} exceeds the entry's {} bytes",
                bytes.len()
            )));
        }
        Ok(Entry(bytes))
    }

    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }

    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    pub fn verify(&self) -> bool {
        let crc = u32::from_be_bytes(self.0[2..6].try_into().expect("4 bytes"));
        crc == crc32c::crc32c(&self.0[6..])
    }

    fn metadata_len(&self) -> usize {
        u32::from_be_bytes(self.0[6..10].try_into().expect("4 bytes")) as usize
    }

    pub fn metadata_bytes(&self) -> Bytes {
        self.0.slice(HEADER..HEADER + self.metadata_len())
    }

    /// Decodes the fields of the metadata the broker reads.
    pub fn metadata(&self) -> Result<MessageMetadata, EntryError> {
        MessageMetadata::decode(self.metadata_bytes()).map_err(|e| EntryError(e.to_string()))
    }

    pub fn payload(&self) -> Bytes {
        self.0.slice(HEADER + self.metadata_len()..)
    }
}

/// Messages an entry counts for (a batch counts each item), from decoded metadata. Consumers
/// recognise a batch by the field's presence, so presence with any value is a batch.
pub fn message_count(meta: &MessageMetadata) -> u32 {
    meta.num_messages_in_batch.map_or(1, |n| n.max(1) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{KeyValue, MessageMetadata};

    #[test]
    fn given_a_replicated_entry_then_it_names_its_origin_and_keeps_everything_else() {
        let meta = MessageMetadata {
            producer_name: "p".into(),
            sequence_id: 7,
            publish_time: 99,
            properties: vec![KeyValue {
                key: "k".into(),
                value: "v".into(),
            }],
            event_time: Some(5),
            ..Default::default()
        };
        let original = Entry::build(&meta.encode_to_vec(), b"payload");
        assert_eq!(original.origin(), Ok(None));
        let origin = MeridianOrigin {
            site: "east".into(),
            ledger_id: 12,
            entry_id: 34,
        };
        let stored = original.replicated(&origin).expect("the original verifies");
        assert!(stored.verify());
        assert_eq!(stored.origin(), Ok(Some(origin)));
        assert_eq!(stored.payload(), original.payload());
        // The original metadata bytes come first, unchanged.
        assert!(stored
            .metadata_bytes()
            .starts_with(&original.metadata_bytes()));
        let got = stored.metadata().unwrap();
        assert_eq!(got.replicated_from.as_deref(), Some("east"));
        assert_eq!(
            (
                got.producer_name.as_str(),
                got.sequence_id,
                got.publish_time
            ),
            ("p", 7, 99)
        );
        assert_eq!(got.properties, meta.properties);
        assert_eq!(got.event_time, Some(5));
    }

    #[test]
    fn given_an_entry_damaged_anywhere_then_no_replicated_copy_is_made() {
        let meta = MessageMetadata {
            producer_name: "p".into(),
            ..Default::default()
        };
        let original = Entry::build(&meta.encode_to_vec(), &[7u8; 300]);
        let origin = MeridianOrigin {
            site: "east".into(),
            ledger_id: 1,
            entry_id: 2,
        };
        let len = original.as_bytes().len();
        // The checksum, the metadata's size and bytes, and the payload's first and last.
        for at in [2, 9, 10, 12, len - 300, len - 1] {
            let mut b = original.as_bytes().to_vec();
            b[at] ^= 0x01;
            let damaged = Entry::parse(Bytes::from(b)).expect("the structure holds");
            assert!(damaged.replicated(&origin).is_none(), "byte {at}");
        }
        assert!(original.replicated(&origin).is_some());
    }

    #[test]
    fn given_properties_added_then_old_and_new_ones_read_back_and_the_checksum_verifies() {
        let meta = MessageMetadata {
            producer_name: "p".into(),
            sequence_id: 3,
            publish_time: 9,
            properties: vec![KeyValue {
                key: "a".into(),
                value: "1".into(),
            }],
            ..Default::default()
        };
        let e = Entry::build(&meta.encode_to_vec(), b"payload");
        let d = e.with_properties(&[("REAL_TOPIC", "persistent://t/n/x"), ("b", "2")]);
        assert!(d.verify());
        assert_eq!(d.payload().as_ref(), b"payload");
        let m = d.metadata().unwrap();
        assert_eq!((m.producer_name.as_str(), m.sequence_id), ("p", 3));
        let props: Vec<(&str, &str)> = m
            .properties
            .iter()
            .map(|kv| (kv.key.as_str(), kv.value.as_str()))
            .collect();
        assert_eq!(
            props,
            vec![("a", "1"), ("REAL_TOPIC", "persistent://t/n/x"), ("b", "2")]
        );
        // The original metadata bytes are a prefix: nothing was re-encoded.
        assert!(d.metadata_bytes().starts_with(&e.metadata_bytes()));
    }

    #[test]
    fn given_a_replicated_entry_copied_with_properties_then_the_copy_is_this_site_s_own() {
        let meta = MessageMetadata {
            producer_name: "p".into(),
            sequence_id: 3,
            ..Default::default()
        };
        let e = Entry::build(&meta.encode_to_vec(), b"payload");
        assert!(!e.claims_origin());
        let origin = MeridianOrigin {
            site: "east".into(),
            ledger_id: 4,
            entry_id: 5,
        };
        let r = e.replicated(&origin).unwrap();
        assert!(r.claims_origin());
        let d = r.with_properties(&[("REAL_TOPIC", "persistent://t/n/x")]);
        assert!(d.verify());
        assert!(!d.claims_origin());
        let m = d.metadata().unwrap();
        assert_eq!((m.meridian_origin, m.replicated_from), (None, None));
        assert_eq!((m.producer_name.as_str(), m.sequence_id), ("p", 3));
        assert_eq!(m.properties.len(), 1);
    }
}
