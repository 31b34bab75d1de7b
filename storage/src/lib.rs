//! Meridian's storage layer, after BookKeeper: a topic's log is a chain of ledgers, each striped
//! over an ensemble of bookies.
//!
//! Owns: the bookie's journal ([`journal`]), the compact range sets cursors are made of
//! ([`rangeset`]), the striping arithmetic of ledgers ([`striping`]), and the ledgers a
//! topic's compaction writes ([`compacted`]).
//!
//! Does not know about: the Pulsar wire protocol, topics as clients see them, tenants, geo.

pub mod autorecovery;
pub mod bookie;
pub mod client;
pub mod compacted;
pub mod cursor;
pub mod failpoint;
pub mod io_priority;
pub mod journal;
pub mod ledger;
pub mod managed_ledger;
pub mod placement;
pub mod proto;
pub mod rangeset;
pub mod striping;
