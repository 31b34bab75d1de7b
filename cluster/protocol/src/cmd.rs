//! Constructors for the commands a broker sends. Each sets both `type` and the matching
//! sub-message: the C++ client switches on the type, the Rust client on the sub-message.

use crate::pb::base_command::Type;
use crate::pb::*;

fn base(t: Type) -> BaseCommand {
    BaseCommand {
        r#type: t as i32,
        ..Default::default()
    }
}

pub fn message_id(ledger_id: u64, entry_id: u64) -> MessageIdData {
    MessageIdData {
        ledger_id,
        entry_id,
        ..Default::default()
    }
}

/// AUTH_CHALLENGE: the client is to send fresh credentials of `method` (AUTH_RESPONSE).
pub fn auth_challenge(server_version: &str, protocol_version: i32, method: &str) -> BaseCommand {
    let mut c = base(Type::AuthChallenge);
    c.auth_challenge = Some(CommandAuthChallenge {
        server_version: Some(server_version.into()),
        challenge: Some(AuthData {
            auth_method_name: Some(method.into()),
            auth_data: Some(b"refresh".to_vec()),
        }),
        protocol_version: Some(protocol_version),
    });
    c
}

pub fn connected(
    server_version: &str,
    protocol_version: i32,
    max_message_size: i32,
) -> BaseCommand {
    let mut c = base(Type::Connected);
    c.connected = Some(CommandConnected {
        server_version: server_version.into(),
        protocol_version: Some(protocol_version),
        max_message_size: Some(max_message_size),
    });
    c
}

pub fn ping() -> BaseCommand {
    let mut c = base(Type::Ping);
    c.ping = Some(CommandPing {});
    c
}

pub fn pong() -> BaseCommand {
    let mut c = base(Type::Pong);
    c.pong = Some(CommandPong {});
    c
}

pub fn error(request_id: u64, error: ServerError, message: impl Into<String>) -> BaseCommand {
    let mut c = base(Type::Error);
    c.error = Some(CommandError {
        request_id,
        error: error as i32,
        message: message.into(),
    });
    c
}

pub fn success(request_id: u64) -> BaseCommand {
    let mut c = base(Type::Success);
    c.success = Some(CommandSuccess {
        request_id,
        schema: None,
    });
    c
}

pub fn partitioned_metadata(request_id: u64, partitions: u32) -> BaseCommand {
    let mut c = base(Type::PartitionedMetadataResponse);
    c.partition_metadata_response = Some(CommandPartitionedTopicMetadataResponse {
        partitions: Some(partitions),
        request_id,
        response: Some(command_partitioned_topic_metadata_response::LookupType::Success as i32),
        error: None,
        message: None,
    });
    c
}

pub fn partitioned_metadata_error(
    request_id: u64,
    error: ServerError,
    message: impl Into<String>,
) -> BaseCommand {
    let mut c = base(Type::PartitionedMetadataResponse);
    c.partition_metadata_response = Some(CommandPartitionedTopicMetadataResponse {
        partitions: None,
        request_id,
        response: Some(command_partitioned_topic_metadata_response::LookupType::Failed as i32),
        error: Some(error as i32),
        message: Some(message.into()),
    });
    c
}

pub fn lookup_connect(request_id: u64, url: &str, url_tls: Option<&str>) -> BaseCommand {
    let mut c = base(Type::LookupResponse);
    c.lookup_topic_response = Some(CommandLookupTopicResponse {
        broker_service_url: Some(url.into()),
        broker_service_url_tls: url_tls.map(Into::into),
        response: Some(command_lookup_topic_response::LookupType::Connect as i32),
        request_id,
        authoritative: Some(true),
        error: None,
        message: None,
        proxy_through_service_url: Some(false),
    });
    c
}

/// LOOKUP answered "ask that broker": its URLs; `authoritative` tells the client to say so in
/// its next LOOKUP (the broker was chosen to own the topic and takes it then).
pub fn lookup_redirect(
    request_id: u64,
    url: &str,
    url_tls: Option<&str>,
    authoritative: bool,
) -> BaseCommand {
    let mut c = base(Type::LookupResponse);
    c.lookup_topic_response = Some(CommandLookupTopicResponse {
        broker_service_url: Some(url.into()),
        broker_service_url_tls: url_tls.map(Into::into),
        response: Some(command_lookup_topic_response::LookupType::Redirect as i32),
        request_id,
        authoritative: Some(authoritative),
        error: None,
        message: None,
        proxy_through_service_url: Some(false),
    });
    c
}

pub fn lookup_error(
    request_id: u64,
    error: ServerError,
    message: impl Into<String>,
) -> BaseCommand {
    let mut c = base(Type::LookupResponse);
    c.lookup_topic_response = Some(CommandLookupTopicResponse {
        response: Some(command_lookup_topic_response::LookupType::Failed as i32),
        request_id,
        error: Some(error as i32),
        message: Some(message.into()),
        ..Default::default()
    });
    c
}

pub fn producer_success(
    request_id: u64,
    producer_name: &str,
    last_sequence_id: i64,
) -> BaseCommand {
    let mut c = base(Type::ProducerSuccess);
    c.producer_success = Some(CommandProducerSuccess {
        request_id,
        producer_name: producer_name.into(),
        last_sequence_id: Some(last_sequence_id),
        schema_version: None,
        topic_epoch: None,
        producer_ready: Some(true),
    });
    c
}

pub fn send_receipt(
    producer_id: u64,
    sequence_id: u64,
    ledger_id: u64,
    entry_id: u64,
) -> BaseCommand {
    let mut c = base(Type::SendReceipt);
    c.send_receipt = Some(CommandSendReceipt {
        producer_id,
        sequence_id,
        message_id: Some(message_id(ledger_id, entry_id)),
        highest_sequence_id: None,
    });
    c
}

pub fn send_error(
    producer_id: u64,
    sequence_id: u64,
    error: ServerError,
    message: impl Into<String>,
) -> BaseCommand {
    let mut c = base(Type::SendError);
    c.send_error = Some(CommandSendError {
        producer_id,
        sequence_id,
        error: error as i32,
        message: message.into(),
    });
    c
}

pub fn message(
    consumer_id: u64,
    ledger_id: u64,
    entry_id: u64,
    redelivery_count: u32,
) -> BaseCommand {
    let mut c = base(Type::Message);
    c.message = Some(CommandMessage {
        consumer_id,
        message_id: message_id(ledger_id, entry_id),
        redelivery_count: (redelivery_count > 0).then_some(redelivery_count),
        ack_set: Vec::new(),
        consumer_epoch: None,
    });
    c
}

pub fn close_producer(producer_id: u64, request_id: u64) -> BaseCommand {
    let mut c = base(Type::CloseProducer);
    c.close_producer = Some(CommandCloseProducer {
        producer_id,
        request_id,
    });
    c
}

pub fn reached_end_of_topic(consumer_id: u64) -> BaseCommand {
    let mut c = base(Type::ReachedEndOfTopic);
    c.reached_end_of_topic = Some(CommandReachedEndOfTopic { consumer_id });
    c
}

pub fn close_consumer(consumer_id: u64, request_id: u64) -> BaseCommand {
    let mut c = base(Type::CloseConsumer);
    c.close_consumer = Some(CommandCloseConsumer {
        consumer_id,
        request_id,
    });
    c
}

pub fn active_consumer_change(consumer_id: u64, is_active: bool) -> BaseCommand {
    let mut c = base(Type::ActiveConsumerChange);
    c.active_consumer_change = Some(CommandActiveConsumerChange {
        consumer_id,
        is_active: Some(is_active),
    });
    c
}

pub fn last_message_id(
    request_id: u64,
    last: MessageIdData,
    mark_delete: Option<MessageIdData>,
) -> BaseCommand {
    let mut c = base(Type::GetLastMessageIdResponse);
    c.get_last_message_id_response = Some(CommandGetLastMessageIdResponse {
        last_message_id: last,
        request_id,
        consumer_mark_delete_position: mark_delete,
    });
    c
}

pub fn topics_of_namespace(request_id: u64, topics: Vec<String>) -> BaseCommand {
    let mut c = base(Type::GetTopicsOfNamespaceResponse);
    c.get_topics_of_namespace_response = Some(CommandGetTopicsOfNamespaceResponse {
        request_id,
        topics,
        filtered: Some(false),
        topics_hash: None,
        changed: Some(true),
    });
    c
}

pub fn get_schema_error(
    request_id: u64,
    error: ServerError,
    message: impl Into<String>,
) -> BaseCommand {
    let mut c = base(Type::GetSchemaResponse);
    c.get_schema_response = Some(CommandGetSchemaResponse {
        request_id,
        error_code: Some(error as i32),
        error_message: Some(message.into()),
        schema: None,
        schema_version: None,
    });
    c
}

pub fn get_schema(request_id: u64, schema: Schema, version: Vec<u8>) -> BaseCommand {
    let mut c = base(Type::GetSchemaResponse);
    c.get_schema_response = Some(CommandGetSchemaResponse {
        request_id,
        error_code: None,
        error_message: None,
        schema: Some(schema),
        schema_version: Some(version),
    });
    c
}

pub fn get_or_create_schema(request_id: u64, version: Vec<u8>) -> BaseCommand {
    let mut c = base(Type::GetOrCreateSchemaResponse);
    c.get_or_create_schema_response = Some(CommandGetOrCreateSchemaResponse {
        request_id,
        error_code: None,
        error_message: None,
        schema_version: Some(version),
    });
    c
}

pub fn get_or_create_schema_error(
    request_id: u64,
    error: ServerError,
    message: impl Into<String>,
) -> BaseCommand {
    let mut c = base(Type::GetOrCreateSchemaResponse);
    c.get_or_create_schema_response = Some(CommandGetOrCreateSchemaResponse {
        request_id,
        error_code: Some(error as i32),
        error_message: Some(message.into()),
        schema_version: None,
    });
    c
}

pub fn consumer_stats_error(
    request_id: u64,
    error: ServerError,
    message: impl Into<String>,
) -> BaseCommand {
    let mut c = base(Type::ConsumerStatsResponse);
    c.consumer_stats_response = Some(CommandConsumerStatsResponse {
        request_id,
        error_code: Some(error as i32),
        error_message: Some(message.into()),
        ..Default::default()
    });
    c
}

/// A CONSUMER_STATS_RESPONSE without an error; the caller fills in the figures.
pub fn consumer_stats(request_id: u64) -> BaseCommand {
    let mut c = base(Type::ConsumerStatsResponse);
    c.consumer_stats_response = Some(CommandConsumerStatsResponse {
        request_id,
        ..Default::default()
    });
    c
}

pub fn ack_response(consumer_id: u64, request_id: u64) -> BaseCommand {
    let mut c = base(Type::AckResponse);
    c.ack_response = Some(CommandAckResponse {
        consumer_id,
        error: None,
        message: None,
        request_id: Some(request_id),
    });
    c
}
