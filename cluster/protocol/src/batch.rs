//! Batches: N items in one payload, each `[len u32][SingleMessageMetadata][data]`, read in place.

use bytes::Bytes;
use prost::Message as _;

use crate::pb::SingleMessageMetadata;

/// One item of a batch: its metadata bytes and its data, both slices of the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchItem {
    pub metadata: Bytes,
    pub data: Bytes,
}

impl BatchItem {
    pub fn decode_metadata(&self) -> Result<SingleMessageMetadata, prost::DecodeError> {
        SingleMessageMetadata::decode(self.metadata.clone())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed batch at byte {offset}: {reason}")]
pub struct BatchError {
    pub offset: usize,
    pub reason: String,
}

/// Iterates over the items of an uncompressed batch payload without copying them.
pub struct BatchIter {
    payload: Bytes,
    offset: usize,
    failed: bool,
}

impl BatchIter {
    pub fn new(payload: Bytes) -> BatchIter {
        BatchIter {
            payload,
            offset: 0,
            failed: false,
        }
    }

    fn fail(&mut self, reason: String) -> Option<Result<BatchItem, BatchError>> {
        self.failed = true;
        Some(Err(BatchError {
            offset: self.offset,
            reason,
        }))
    }
}

impl Iterator for BatchIter {
    type Item = Result<BatchItem, BatchError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.offset >= self.payload.len() {
            return None;
        }
        let rest = &self.payload[self.offset..];
        if rest.len() < 4 {
            return self.fail("truncated item length".into());
        }
        let m = u32::from_be_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        if m > rest.len() - 4 {
            return self.fail(format!("item metadata of {m} bytes exceeds the payload"));
        }
        let metadata = self.payload.slice(self.offset + 4..self.offset + 4 + m);
        let size = match SingleMessageMetadata::decode(metadata.clone()) {
            Ok(s) => s.payload_size,
            Err(e) => return self.fail(format!("item metadata: {e}")),
        };
        let start = self.offset + 4 + m;
        let Ok(size) = usize::try_from(size) else {
            return self.fail(format!("negative payload size {size}"));
        };
        if size > self.payload.len() - start {
            return self.fail(format!("item payload of {size} bytes exceeds the payload"));
        }
        let data = self.payload.slice(start..start + size);
        self.offset = start + size;
        Some(Ok(BatchItem { metadata, data }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};

    fn item(out: &mut BytesMut, key: &str, data: &[u8]) {
        let m = SingleMessageMetadata {
            partition_key: Some(key.into()),
            payload_size: data.len() as i32,
            ..Default::default()
        }
        .encode_to_vec();
        out.put_u32(m.len() as u32);
        out.put_slice(&m);
        out.put_slice(data);
    }

    #[test]
    fn given_a_batch_then_items_are_slices_of_the_payload() {
        let mut b = BytesMut::new();
        item(&mut b, "k0", b"batched-0");
        item(&mut b, "k1", b"");
        item(&mut b, "k2", b"batched-2");
        let payload = b.freeze();
        let items: Vec<_> = BatchIter::new(payload.clone())
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(items.len(), 3);
        assert_eq!(&items[0].data[..], b"batched-0");
        assert_eq!(&items[1].data[..], b"");
        assert_eq!(
            items[2].decode_metadata().unwrap().partition_key.as_deref(),
            Some("k2")
        );
        // no copy: the data points into the payload's buffer
        let base = payload.as_ptr() as usize;
        let p = items[2].data.as_ptr() as usize;
        assert!(p >= base && p < base + payload.len());
    }

    #[test]
    fn given_truncated_batches_then_iteration_stops_with_an_error() {
        let mut b = BytesMut::new();
        item(&mut b, "k", b"0123456789");
        let full = b.freeze();
        for cut in 1..full.len() {
            let r: Vec<_> = BatchIter::new(full.slice(..cut)).collect();
            assert_eq!(r.len(), 1, "cut {cut}");
            assert!(r[0].is_err(), "cut {cut}");
        }
    }
}
