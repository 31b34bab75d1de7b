#![no_main]
//! Any byte stream: the decoder returns frames or an error, never panics, and every payload's
//! accessors, stored-entry form and batch items stay within bounds.
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
            let _ = parsed.metadata();
            for item in BatchIter::new(parsed.payload()) {
                if item.is_err() {
                    break;
                }
            }
        }
    }
});
