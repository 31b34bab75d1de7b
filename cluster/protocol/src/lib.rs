//! The Pulsar binary protocol as Meridian's broker speaks it, without sockets or a runtime.
//!
//! ```text
//!  simple frame:  [totalSize u32][cmdSize u32][BaseCommand]
//!  payload frame: [totalSize u32][cmdSize u32][BaseCommand][0x0e01][crc32c u32][metaSize u32][MessageMetadata][payload]
//!                                                                   └───────── crc covers ─────────────────────────┘
//! ```
//!
//! Owns: frame encoding and decoding with a size limit ([`frame`]), the command types
//! ([`pb`], generated from our own `proto/pulsar.proto`), stored entries (the checksummed tail
//! of a payload frame, kept byte for byte: [`entry`]; a replicated one's stored form made as its
//! bytes arrive: [`replica_form`]), batches read in place ([`batch`]), a
//! message's top-level fields read without decoding it ([`wire_fields`]), and constructors for
//! the commands a broker sends ([`cmd`]).
//!
//! Does not know about: sockets, tokio, topics, storage.

pub mod batch;
pub mod cmd;
pub mod crc_combine;
pub mod entry;
pub mod frame;
pub mod replica_form;
pub mod wire_fields;

/// Types generated from `proto/pulsar.proto` (field numbers as upstream Pulsar).
#[allow(clippy::all, missing_docs)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/pulsar.proto.rs"));
}

pub use entry::Entry;
pub use frame::{decode_frame, encode_command, encode_message, Frame, FrameError, Payload};

/// Magic that precedes a checksum in a payload frame.
pub const MAGIC_CRC32C: u16 = 0x0e01;
/// Magic that precedes an optional broker-entry-metadata prefix.
pub const MAGIC_BROKER_ENTRY_METADATA: u16 = 0x0e02;
/// The highest protocol version this codec speaks (v19 plus the v20 fields we do not use).
pub const PROTOCOL_VERSION_MAX: i32 = 19;

/// A position that clients send as "−1": earliest (u64 all-ones).
pub const ID_NONE: u64 = u64::MAX;
