//! The broker's failures as a client sees them: a `ServerError` and a message.

use meridian_protocol::pb::ServerError;
use meridian_storage::cursor::CursorError;
use meridian_storage::managed_ledger::ManagedLedgerError;

use crate::topic_name::TopicNameError;

/// A failure that a client sees as a `ServerError` and a message.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct BrokerError {
    pub code: ServerError,
    pub message: String,
}

impl BrokerError {
    pub fn new(code: ServerError, message: impl Into<String>) -> Self {
        BrokerError {
            code,
            message: message.into(),
        }
    }
}

impl From<TopicNameError> for BrokerError {
    fn from(e: TopicNameError) -> Self {
        BrokerError::new(ServerError::InvalidTopicName, e.to_string())
    }
}

impl From<ManagedLedgerError> for BrokerError {
    fn from(e: ManagedLedgerError) -> Self {
        let code = match &e {
            ManagedLedgerError::Fenced { .. } | ManagedLedgerError::Closed { .. } => {
                ServerError::ServiceNotReady
            }
            ManagedLedgerError::Terminated { .. } => ServerError::TopicTerminatedError,
            _ => ServerError::PersistenceError,
        };
        BrokerError::new(code, e.to_string())
    }
}

impl From<CursorError> for BrokerError {
    fn from(e: CursorError) -> Self {
        let code = match &e {
            CursorError::Fenced(_) | CursorError::Closed(_) => ServerError::ServiceNotReady,
            CursorError::BadName(_) => ServerError::NotAllowedError,
            _ => ServerError::PersistenceError,
        };
        BrokerError::new(code, e.to_string())
    }
}

impl From<meridian_metadata::client::ClientError> for BrokerError {
    fn from(e: meridian_metadata::client::ClientError) -> Self {
        BrokerError::new(ServerError::MetadataError, e.to_string())
    }
}
