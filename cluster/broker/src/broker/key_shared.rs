//! Key_Shared: which consumer gets a message, by the hash of its key.
//!
//! A message's key is its `ordering_key`, else its `partition_key`, else (a batch without
//! either) the first item's; messages without a key share one. Its hash is Murmur3-32 of the
//! key's bytes modulo 65,536, as in Pulsar, so sticky ranges mean the same thing to clients
//! written for Pulsar.
//!
//! - **Auto-split**: consistent hashing; each consumer owns 100 points of the ring and a hash
//!   goes to the next point at or after it. A joining consumer takes over a share of the hashes
//!   and a leaving one hands its share to its neighbours; other hashes stay put.
//! - **Sticky**: each consumer declares ranges of hashes; overlaps are refused
//!   (ConsumerAssignError); a hash no range covers waits.
//!
//! Ordering while ownership moves is the dispatcher's part (`subscription.rs`): a hash is not
//! given to a consumer while another consumer still holds unacknowledged messages of it.

use std::collections::BTreeMap;

use meridian_protocol::batch::BatchIter;
use meridian_protocol::pb::MessageMetadata;
use meridian_protocol::Entry;

/// Hashes range over `0..HASH_RANGE`.
pub const HASH_RANGE: u32 = 65_536;
/// Ring points per consumer in auto-split mode.
const POINTS_PER_CONSUMER: u32 = 100;
/// The key of messages that have none.
pub const NONE_KEY: &[u8] = b"NONE_KEY";

/// (connection id, consumer id)
pub type ConsumerKey = (u64, u64);

/// Murmur3, 32-bit variant (x86_32), little-endian blocks.
pub fn murmur3_32(data: &[u8], seed: u32) -> u32 {
    const C1: u32 = 0xcc9e_2d51;
    const C2: u32 = 0x1b87_3593;
    let mut h = seed;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(C1).rotate_left(15).wrapping_mul(C2);
        h ^= k;
        h = h.rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64);
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        let mut k = 0u32;
        for (i, b) in tail.iter().enumerate() {
            k |= u32::from(*b) << (8 * i);
        }
        h ^= k.wrapping_mul(C1).rotate_left(15).wrapping_mul(C2);
    }
    h ^= data.len() as u32;
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// The hash of a key, `0..HASH_RANGE`.
pub fn key_hash(key: &[u8]) -> u16 {
    (murmur3_32(key, 0) % HASH_RANGE) as u16
}

/// The key an entry is routed by.
pub fn entry_key(entry: &Entry, meta: &MessageMetadata) -> Vec<u8> {
    if let Some(k) = meta.ordering_key.as_ref().filter(|k| !k.is_empty()) {
        return k.clone();
    }
    if let Some(k) = meta.partition_key.as_ref().filter(|k| !k.is_empty()) {
        return k.clone().into_bytes();
    }
    if meta.num_messages_in_batch.is_some() && meta.compression.unwrap_or(0) == 0 {
        let first = BatchIter::new(entry.payload())
            .next()
            .and_then(Result::ok)
            .and_then(|it| it.decode_metadata().ok());
        if let Some(m) = first {
            if let Some(k) = m.ordering_key.filter(|k| !k.is_empty()) {
                return k;
            }
            if let Some(k) = m.partition_key.filter(|k| !k.is_empty()) {
                return k.into_bytes();
            }
        }
    }
    NONE_KEY.to_vec()
}

/// What a Key_Shared consumer asked for (CommandSubscribe.keySharedMeta).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeySharedSpec {
    pub sticky: bool,
    /// Sticky mode: inclusive hash ranges.
    pub ranges: Vec<(u16, u16)>,
    pub allow_out_of_order: bool,
}

/// Maps hashes to consumers.
#[derive(Debug, Default)]
pub struct Selector {
    sticky: bool,
    /// Auto-split: (point, consumer) -> consumer; ordered, so lookups are a range query.
    ring: BTreeMap<(u16, ConsumerKey), ConsumerKey>,
    /// Sticky: (start, end inclusive, consumer), sorted by start.
    ranges: Vec<(u16, u16, ConsumerKey)>,
}

impl Selector {
    pub fn new(sticky: bool) -> Selector {
        Selector {
            sticky,
            ..Selector::default()
        }
    }

    /// Adds a consumer; in sticky mode its ranges must be valid and overlap no one's.
    pub fn add(
        &mut self,
        key: ConsumerKey,
        name: &str,
        ranges: &[(u16, u16)],
    ) -> Result<(), String> {
        if !self.sticky {
            for i in 0..POINTS_PER_CONSUMER {
                let point = key_hash(format!("{name}:{}:{}#{i}", key.0, key.1).as_bytes());
                self.ring.insert((point, key), key);
            }
            return Ok(());
        }
        if ranges.is_empty() {
            return Err("a sticky Key_Shared consumer must declare hash ranges".into());
        }
        for (i, &(s, e)) in ranges.iter().enumerate() {
            if s > e {
                return Err(format!("hash range [{s}, {e}] is empty"));
            }
            let clash = self
                .ranges
                .iter()
                .map(|&(a, b, _)| (a, b))
                .chain(ranges[..i].iter().copied())
                .find(|&(a, b)| s <= b && a <= e);
            if let Some((a, b)) = clash {
                return Err(format!(
                    "hash range [{s}, {e}] overlaps [{a}, {b}] of another consumer"
                ));
            }
        }
        for &(s, e) in ranges {
            self.ranges.push((s, e, key));
        }
        self.ranges.sort_unstable();
        Ok(())
    }

    pub fn remove(&mut self, key: ConsumerKey) {
        self.ring.retain(|_, v| *v != key);
        self.ranges.retain(|r| r.2 != key);
    }

    /// The consumer that owns `hash` now.
    pub fn owner(&self, hash: u16) -> Option<ConsumerKey> {
        if self.sticky {
            let i = self.ranges.partition_point(|r| r.0 <= hash);
            return self.ranges[..i].last().filter(|r| hash <= r.1).map(|r| r.2);
        }
        self.ring
            .range((hash, (0, 0))..)
            .next()
            .or_else(|| self.ring.iter().next())
            .map(|(_, v)| *v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn murmur3_matches_reference_vectors() {
        // Published test vectors of MurmurHash3_x86_32.
        assert_eq!(murmur3_32(b"", 0), 0);
        assert_eq!(murmur3_32(b"", 1), 0x514e_28b7);
        assert_eq!(murmur3_32(b"", 0xffff_ffff), 0x81f1_6f39);
        assert_eq!(murmur3_32(b"\xff\xff\xff\xff", 0), 0x7629_3b50);
        assert_eq!(murmur3_32(b"\x21\x43\x65\x87", 0), 0xf55b_516b);
        assert_eq!(murmur3_32(b"\x21\x43\x65", 0), 0x7e4a_8634);
        assert_eq!(murmur3_32(b"\x21\x43", 0), 0xa0f7_b07a);
        assert_eq!(murmur3_32(b"\x21", 0), 0x7266_1cf4);
        assert_eq!(murmur3_32(b"Hello, world!", 1234), 0xfaf6_cdb3);
        assert_eq!(
            murmur3_32(b"The quick brown fox jumps over the lazy dog", 0x9747_b28c),
            0x2fa8_26cd
        );
    }

    fn entry(meta: &MessageMetadata, payload: &[u8]) -> Entry {
        use prost::Message as _;
        Entry::build(&meta.encode_to_vec(), payload)
    }

    #[test]
    fn given_entries_then_the_key_is_ordering_key_partition_key_or_first_batch_item() {
        use meridian_protocol::pb::SingleMessageMetadata;
        use prost::Message as _;
        let base = MessageMetadata {
            producer_name: "p".into(),
            sequence_id: 1,
            publish_time: 1,
            ..Default::default()
        };
        let both = MessageMetadata {
            ordering_key: Some(b"ord".to_vec()),
            partition_key: Some("part".into()),
            ..base.clone()
        };
        assert_eq!(entry_key(&entry(&both, b"x"), &both), b"ord");
        let part = MessageMetadata {
            partition_key: Some("part".into()),
            ..base.clone()
        };
        assert_eq!(entry_key(&entry(&part, b"x"), &part), b"part");
        assert_eq!(entry_key(&entry(&base, b"x"), &base), NONE_KEY);
        // A batch whose outer metadata has no key: its first item's ordering key, else its
        // partition key.
        let item = |ordering: Option<&[u8]>, key: Option<&str>| {
            let m = SingleMessageMetadata {
                payload_size: 1,
                ordering_key: ordering.map(<[u8]>::to_vec),
                partition_key: key.map(str::to_string),
                ..Default::default()
            }
            .encode_to_vec();
            let mut b = (m.len() as u32).to_be_bytes().to_vec();
            b.extend_from_slice(&m);
            b.push(b'x');
            b
        };
        let batch = MessageMetadata {
            num_messages_in_batch: Some(2),
            ..base.clone()
        };
        let mut payload = item(None, Some("first"));
        payload.extend(item(None, Some("second")));
        assert_eq!(entry_key(&entry(&batch, &payload), &batch), b"first");
        let payload = item(Some(b"o1"), Some("k1"));
        assert_eq!(entry_key(&entry(&batch, &payload), &batch), b"o1");
    }

    #[test]
    fn given_auto_split_then_every_hash_has_one_owner_and_a_join_moves_only_some() {
        let mut s = Selector::new(false);
        for c in 0..8u64 {
            s.add((1, c), &format!("c{c}"), &[]).unwrap();
        }
        let before: Vec<ConsumerKey> = (0..=u16::MAX).map(|h| s.owner(h).unwrap()).collect();
        let mut share: HashMap<ConsumerKey, usize> = HashMap::new();
        for o in &before {
            *share.entry(*o).or_default() += 1;
        }
        assert_eq!(share.len(), 8);
        // Each of 8 consumers gets a fair share, within a wide margin.
        assert!(share.values().all(|n| *n > 65_536 / 8 / 3), "{share:?}");
        s.add((2, 0), "newcomer", &[]).unwrap();
        let moved = (0..=u16::MAX)
            .filter(|h| s.owner(*h) != Some(before[*h as usize]))
            .count();
        assert!(moved > 0 && moved < 65_536 / 4, "moved {moved}");
        assert!(
            (0..=u16::MAX)
                .filter(|h| s.owner(*h) != Some(before[*h as usize]))
                .all(|h| s.owner(h) == Some((2, 0))),
            "hashes move only to the newcomer"
        );
        s.remove((2, 0));
        assert!((0..=u16::MAX).all(|h| s.owner(h) == Some(before[h as usize])));
    }

    #[test]
    fn given_sticky_ranges_then_overlaps_are_refused_and_gaps_have_no_owner() {
        let mut s = Selector::new(true);
        s.add((1, 1), "a", &[(0, 100), (200, 300)]).unwrap();
        s.add((1, 2), "b", &[(101, 199)]).unwrap();
        assert!(s
            .add((1, 3), "c", &[(300, 400)])
            .unwrap_err()
            .contains("overlaps"));
        assert!(s.add((1, 3), "c", &[(500, 400)]).is_err());
        assert!(s.add((1, 3), "c", &[]).is_err());
        assert!(
            s.add((1, 3), "c", &[(400, 450), (440, 460)]).is_err(),
            "own overlap"
        );
        assert_eq!(s.owner(0), Some((1, 1)));
        assert_eq!(s.owner(150), Some((1, 2)));
        assert_eq!(s.owner(300), Some((1, 1)));
        assert_eq!(s.owner(301), None);
        s.remove((1, 1));
        assert_eq!(s.owner(0), None);
        s.add((1, 3), "c", &[(0, 100)]).unwrap();
        assert_eq!(s.owner(50), Some((1, 3)));
    }
}
