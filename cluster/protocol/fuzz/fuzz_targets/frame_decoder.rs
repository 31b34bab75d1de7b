#![no_main]
//! Any byte stream: the decoder returns frames or an error, never panics, and every payload's
//! accessors, stored-entry form and batch items stay within bounds. Metadata that decodes with
//! Meridian's origin is always seen to claim it (the publish path refuses those by scanning),
//! and a copy with properties of decodable metadata never carries it.
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use meridian_protocol::{batch::BatchIter, decode_frame, Entry};

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    while let Ok(Some(frame)) = decode_frame(&mut buf, 64 * 1024) {
        if let Some(p) = frame.payload {
            let _ = p.checksum_ok();
            let _ = p.metadata_bytes();
            let entry = Entry::from_payload(&p);
            let parsed = Entry::parse(entry.as_bytes().clone()).expect("own entries parse");
            if let Ok(m) = parsed.metadata() {
                if m.meridian_origin.is_some() {
                    assert!(parsed.claims_origin());
                }
                let copy = parsed.with_properties(&[("k", "v")]);
                assert!(!copy.claims_origin());
            }
            for item in BatchIter::new(parsed.payload()) {
                if item.is_err() {
                    break;
                }
            }
        }
    }
});
