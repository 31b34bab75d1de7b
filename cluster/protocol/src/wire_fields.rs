//! The top-level fields of a protobuf message's bytes, read without decoding the message.
//!
//! The broker keeps a message's metadata byte for byte (decoding and re-encoding would drop
//! fields it does not know); what it must know of those bytes without decoding them (is a
//! field present; the bytes without some fields) it learns here.

use std::ops::Range;

/// Iterates over the top-level fields: each field's number and the range of its bytes (key
/// included). Stops at the first malformed field with `Err(())`.
pub struct Fields<'a> {
    bytes: &'a [u8],
    at: usize,
    failed: bool,
}

pub fn fields(bytes: &[u8]) -> Fields<'_> {
    Fields {
        bytes,
        at: 0,
        failed: false,
    }
}

impl Iterator for Fields<'_> {
    type Item = Result<(u32, Range<usize>), ()>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.at >= self.bytes.len() {
            return None;
        }
        let start = self.at;
        match skip_field(self.bytes, &mut self.at) {
            Ok(number) => Some(Ok((number, start..self.at))),
            Err(()) => {
                self.failed = true;
                Some(Err(()))
            }
        }
    }
}

/// Whether field `number` occurs at the top level, before anything malformed (bytes that are
/// malformed from the start have no field).
pub fn has_field(bytes: &[u8], number: u32) -> bool {
    fields(bytes).any(|f| matches!(f, Ok((n, _)) if n == number))
}

/// The bytes without any occurrence of the fields `numbers`, every other byte kept in order.
/// `None` if the bytes are not a protobuf message.
pub fn without_fields(bytes: &[u8], numbers: &[u32]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(bytes.len());
    for f in fields(bytes) {
        let (n, range) = f.ok()?;
        if !numbers.contains(&n) {
            out.extend_from_slice(&bytes[range]);
        }
    }
    Some(out)
}

fn varint(bytes: &[u8], at: &mut usize) -> Result<u64, ()> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *bytes.get(*at).ok_or(())?;
        *at += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(())
}

/// Groups nested deeper than this are refused (prost decodes 100 levels at most, so a field
/// any decoder reads is never missed here).
const GROUP_DEPTH_MAX: usize = 128;

/// Skips one top-level field from `at`, returning its number: a group with everything up to
/// its end-group key. Iterative (a message of nested groups costs no stack), and a group
/// nested deeper than [`GROUP_DEPTH_MAX`] is malformed.
fn skip_field(bytes: &[u8], at: &mut usize) -> Result<u32, ()> {
    let advance = |at: &mut usize, n: u64| -> Result<(), ()> {
        let end = at
            .checked_add(usize::try_from(n).map_err(|_| ())?)
            .ok_or(())?;
        if end > bytes.len() {
            return Err(());
        }
        *at = end;
        Ok(())
    };
    // The groups entered, innermost last.
    let mut open: Vec<u32> = Vec::new();
    let mut field = None;
    loop {
        let key = varint(bytes, at)?;
        let number = u32::try_from(key >> 3).map_err(|_| ())?;
        if number == 0 {
            return Err(());
        }
        match key & 7 {
            0 => {
                varint(bytes, at)?;
            }
            1 => advance(at, 8)?,
            2 => {
                let len = varint(bytes, at)?;
                advance(at, len)?;
            }
            3 => {
                if open.len() >= GROUP_DEPTH_MAX {
                    return Err(());
                }
                open.push(number);
            }
            // An end-group key closes the innermost group, of the same number.
            4 => {
                if open.pop() != Some(number) {
                    return Err(());
                }
            }
            5 => advance(at, 4)?,
            _ => return Err(()),
        }
        let top = *field.get_or_insert(number);
        if open.is_empty() {
            return Ok(top);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{KeyValue, MeridianOrigin, MessageMetadata};
    use prost::Message as _;

    fn meta(origin: bool) -> MessageMetadata {
        MessageMetadata {
            producer_name: "p".into(),
            sequence_id: 300,
            publish_time: 1 << 40,
            properties: vec![KeyValue {
                key: "k".into(),
                value: "v".into(),
            }],
            replicated_from: origin.then(|| "east".into()),
            meridian_origin: origin.then(|| MeridianOrigin {
                site: "east".into(),
                ledger_id: 9,
                entry_id: 10,
            }),
            num_messages_in_batch: Some(3),
            ..Default::default()
        }
    }

    #[test]
    fn given_metadata_then_its_fields_are_found_and_removed_without_touching_the_rest() {
        let plain = meta(false).encode_to_vec();
        assert!(!has_field(&plain, 1001));
        assert!(has_field(&plain, 1));
        let with = meta(true).encode_to_vec();
        assert!(has_field(&with, 1001));
        let stripped = without_fields(&with, &[5, 1001]).unwrap();
        assert!(!has_field(&stripped, 1001));
        assert_eq!(
            MessageMetadata::decode(stripped.as_slice()).unwrap(),
            meta(false)
        );
        // Every field's bytes, in order, make up the whole.
        let total: usize = fields(&with).map(|f| f.unwrap().1.len()).sum();
        assert_eq!(total, with.len());
    }

    #[test]
    fn given_a_group_or_fixed_width_fields_then_they_are_skipped_whole() {
        // Field 7 fixed64, field 8 fixed32, group 9 holding field 1001 (varint), then 1001 at
        // the top level is absent.
        let mut b = vec![7 << 3 | 1];
        b.extend_from_slice(&[0xff; 8]);
        b.push(8 << 3 | 5);
        b.extend_from_slice(&[0xff; 4]);
        b.push(9 << 3 | 3);
        prost::encoding::encode_key(1001, prost::encoding::WireType::Varint, &mut b);
        b.push(1);
        b.push(9 << 3 | 4);
        let numbers: Vec<u32> = fields(&b).map(|f| f.unwrap().0).collect();
        assert_eq!(numbers, vec![7, 8, 9]);
        assert!(!has_field(&b, 1001));
    }

    #[test]
    fn given_groups_nested_deeply_then_nothing_overflows_and_a_decodable_field_is_still_found() {
        // A megabyte of start-group keys: malformed, and no stack is used for the depth.
        let deep = vec![0x0bu8; 1 << 20];
        assert!(!has_field(&deep, 1001));
        assert!(fields(&deep).any(|f| f.is_err()));
        // 100 nested groups (as deep as prost reads), closed, then field 1001.
        let mut b = Vec::new();
        for _ in 0..100 {
            b.push(1 << 3 | 3);
        }
        for _ in 0..100 {
            b.push(1 << 3 | 4);
        }
        prost::encoding::message::encode(
            1001,
            &MeridianOrigin {
                site: "west".into(),
                ledger_id: 1,
                entry_id: 2,
            },
            &mut b,
        );
        assert!(has_field(&b, 1001));
        let numbers: Vec<u32> = fields(&b).map(|f| f.unwrap().0).collect();
        assert_eq!(numbers, vec![1, 1001]);
        // Past the depth limit: malformed.
        let mut b = vec![1 << 3 | 3; GROUP_DEPTH_MAX + 1];
        b.extend(std::iter::repeat_n(1 << 3 | 4, GROUP_DEPTH_MAX + 1));
        assert!(fields(&b).any(|f| f.is_err()));
    }

    #[test]
    fn given_bytes_that_are_not_a_message_then_nothing_is_found_and_nothing_panics() {
        for bad in [
            &[0x08][..],             // a varint field cut short
            &[0x0a, 0x05, 1, 2][..], // a length past the end
            &[0x00, 0x01][..],       // field number 0
            &[0x0c][..],             // an end-group with no group
            &[0x0b, 0x08, 0x01][..], // a group never ended
            &[0xff; 11][..],         // a key longer than a varint
            &[
                0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ][..],
        ] {
            assert!(fields(bad).any(|f| f.is_err()), "{bad:?}");
            assert!(without_fields(bad, &[1]).is_none());
            assert!(!has_field(bad, 1001));
        }
    }
}
