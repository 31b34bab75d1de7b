//! A failover drill's probe clients: for one topic, at a site's service URL, what a stock
//! client does to be served there: LOOKUP (following Redirect), then a producer attached and
//! a consumer subscribed (a non-durable subscription of its own, from the latest message),
//! both closed again. Nothing is sent or acknowledged, so the topic is left as it was.
//!
//! Served: both were answered by the topic's owner, with success or with a refusal that is
//! the topic's own policy (an exclusive producer attached, a quota, a limit): the site serves
//! the topic then. Not served (yet): a refusal that says the topic is not served there
//! (ServiceNotReady, as at a cut site or a broker that does not own it), a failed lookup, or
//! no answer.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use meridian_protocol::pb::{self, base_command::Type, ServerError};
use meridian_protocol::{decode_frame, encode_command};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The probe's subscription (non-durable: it leaves nothing behind).
pub const PROBE_SUBSCRIPTION: &str = "meridian-drill-probe";

/// Redirects followed at most.
const MAX_REDIRECTS: usize = 8;

/// Probes `topic` at the site whose service URL is `service_url` (`pulsar://HOST:PORT`,
/// the first host of a list), within `timeout`. `Err`: why it is not served.
pub async fn probe_topic(
    service_url: &str,
    topic: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<(), String> {
    tokio::time::timeout(timeout, probe(service_url, topic, token))
        .await
        .map_err(|_| format!("{topic}: no answer within {timeout:?}"))?
}

async fn probe(service_url: &str, topic: &str, token: Option<&str>) -> Result<(), String> {
    let mut url = first_host(service_url)?;
    let mut wire = Wire::open(&url, token).await?;
    let mut authoritative = false;
    for _ in 0..MAX_REDIRECTS {
        let id = wire.next_id();
        let mut c = base(Type::Lookup);
        c.lookup_topic = Some(pb::CommandLookupTopic {
            topic: topic.to_string(),
            request_id: id,
            authoritative: Some(authoritative),
            ..Default::default()
        });
        let answer = wire.request(c, id).await?;
        let Some(r) = answer.lookup_topic_response else {
            return Err(refused(topic, "LOOKUP", &answer));
        };
        use pb::command_lookup_topic_response::LookupType;
        let to = r.broker_service_url.clone().unwrap_or_default();
        match LookupType::try_from(r.response.unwrap_or(0)) {
            Ok(LookupType::Connect) => {
                if !to.is_empty() && first_host(&to)? != url {
                    url = first_host(&to)?;
                    wire = Wire::open(&url, token).await?;
                }
                return attach(&mut wire, topic).await;
            }
            Ok(LookupType::Redirect) => {
                url = first_host(&to)?;
                authoritative = r.authoritative.unwrap_or(false);
                wire = Wire::open(&url, token).await?;
            }
            _ => {
                return Err(format!(
                    "{topic}: lookup failed: {}",
                    r.message.unwrap_or_default()
                ))
            }
        }
    }
    Err(format!("{topic}: more than {MAX_REDIRECTS} redirects"))
}

/// A producer attached and a consumer subscribed at the owner, then both closed.
async fn attach(wire: &mut Wire, topic: &str) -> Result<(), String> {
    let id = wire.next_id();
    let mut c = base(Type::Producer);
    c.producer = Some(pb::CommandProducer {
        topic: topic.to_string(),
        producer_id: 1,
        request_id: id,
        ..Default::default()
    });
    let answer = wire.request(c, id).await?;
    if answer.producer_success.is_some() {
        let id = wire.next_id();
        let mut c = base(Type::CloseProducer);
        c.close_producer = Some(pb::CommandCloseProducer {
            producer_id: 1,
            request_id: id,
        });
        wire.request(c, id).await?;
    } else if !policy_refusal(&answer) {
        return Err(refused(topic, "PRODUCER", &answer));
    }
    let id = wire.next_id();
    let mut c = base(Type::Subscribe);
    c.subscribe = Some(pb::CommandSubscribe {
        topic: topic.to_string(),
        subscription: PROBE_SUBSCRIPTION.to_string(),
        sub_type: pb::command_subscribe::SubType::Exclusive as i32,
        consumer_id: 1,
        request_id: id,
        durable: Some(false),
        initial_position: Some(pb::command_subscribe::InitialPosition::Latest as i32),
        ..Default::default()
    });
    let answer = wire.request(c, id).await?;
    if answer.success.is_some() {
        let id = wire.next_id();
        let mut c = base(Type::CloseConsumer);
        c.close_consumer = Some(pb::CommandCloseConsumer {
            consumer_id: 1,
            request_id: id,
        });
        wire.request(c, id).await?;
        Ok(())
    } else if policy_refusal(&answer) {
        Ok(())
    } else {
        Err(refused(topic, "SUBSCRIBE", &answer))
    }
}

/// A refusal by the topic's own policy: the owner answered, so the topic is served.
fn policy_refusal(c: &pb::BaseCommand) -> bool {
    let Some(e) = &c.error else {
        return false;
    };
    !matches!(
        ServerError::try_from(e.error),
        Ok(ServerError::ServiceNotReady
            | ServerError::MetadataError
            | ServerError::PersistenceError
            | ServerError::UnknownError
            | ServerError::TopicNotFound
            | ServerError::AuthenticationError
            | ServerError::AuthorizationError)
            | Err(_)
    )
}

fn refused(topic: &str, what: &str, c: &pb::BaseCommand) -> String {
    match &c.error {
        Some(e) => format!("{topic}: {what} refused: {}", e.message),
        None => format!("{topic}: {what}: unexpected answer {:?}", c.r#type),
    }
}

/// `HOST:PORT` of the first host of a `pulsar://` URL.
fn first_host(url: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("pulsar://")
        .ok_or_else(|| format!("{url}: the probe needs a pulsar://HOST:PORT service URL"))?;
    let first = rest.split(',').next().unwrap_or_default();
    let first = first.trim_end_matches('/');
    if first.is_empty() {
        return Err(format!("{url}: no host"));
    }
    Ok(first.to_string())
}

fn base(t: Type) -> pb::BaseCommand {
    pb::BaseCommand {
        r#type: t as i32,
        ..Default::default()
    }
}

/// One connection, one request at a time.
struct Wire {
    stream: TcpStream,
    buf: BytesMut,
    next: u64,
}

impl Wire {
    async fn open(addr: &str, token: Option<&str>) -> Result<Wire, String> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connecting to {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let mut w = Wire {
            stream,
            buf: BytesMut::with_capacity(8 << 10),
            next: 1,
        };
        let mut c = base(Type::Connect);
        c.connect = Some(pb::CommandConnect {
            client_version: concat!("meridian-drill-probe-", env!("CARGO_PKG_VERSION")).into(),
            protocol_version: Some(19),
            auth_method_name: token.map(|_| "token".to_string()),
            auth_data: token.map(|t| t.as_bytes().to_vec()),
            ..Default::default()
        });
        w.send(&c).await?;
        loop {
            let f = w.frame().await?;
            if f.connected.is_some() {
                return Ok(w);
            }
            if let Some(e) = f.error {
                return Err(format!("{addr} refused the connection: {}", e.message));
            }
        }
    }

    fn next_id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    async fn send(&mut self, c: &pb::BaseCommand) -> Result<(), String> {
        let mut b = BytesMut::new();
        encode_command(&mut b, c);
        let b: Bytes = b.freeze();
        self.stream
            .write_all(&b)
            .await
            .map_err(|e| format!("writing: {e}"))
    }

    /// The next command (PINGs answered on the way).
    async fn frame(&mut self) -> Result<pb::BaseCommand, String> {
        loop {
            match decode_frame(&mut self.buf, 16 << 20) {
                Ok(Some(f)) => {
                    if f.command.ping.is_some() {
                        let mut p = base(Type::Pong);
                        p.pong = Some(pb::CommandPong {});
                        self.send(&p).await?;
                        continue;
                    }
                    return Ok(f.command);
                }
                Ok(None) => {}
                Err(e) => return Err(format!("a bad frame: {e}")),
            }
            let n = self
                .stream
                .read_buf(&mut self.buf)
                .await
                .map_err(|e| format!("reading: {e}"))?;
            if n == 0 {
                return Err("the connection closed".into());
            }
        }
    }

    /// Sends `c` and waits for the answer with request id `id`.
    async fn request(&mut self, c: pb::BaseCommand, id: u64) -> Result<pb::BaseCommand, String> {
        self.send(&c).await?;
        loop {
            let f = self.frame().await?;
            if request_id(&f) == Some(id) {
                return Ok(f);
            }
        }
    }
}

fn request_id(c: &pb::BaseCommand) -> Option<u64> {
    c.lookup_topic_response
        .as_ref()
        .map(|r| r.request_id)
        .or(c.producer_success.as_ref().map(|r| r.request_id))
        .or(c.success.as_ref().map(|r| r.request_id))
        .or(c.error.as_ref().map(|r| r.request_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_service_urls_then_the_first_host_is_probed() {
        assert_eq!(first_host("pulsar://a:6650").unwrap(), "a:6650");
        assert_eq!(first_host("pulsar://a:6650,b:6650").unwrap(), "a:6650");
        assert!(first_host("pulsar+ssl://a:6651").is_err());
        assert!(first_host("pulsar://").is_err());
    }

    #[test]
    fn given_refusals_then_only_the_topic_s_own_policy_counts_as_served() {
        let err = |e: ServerError| pb::BaseCommand {
            error: Some(pb::CommandError {
                request_id: 1,
                error: e as i32,
                message: String::new(),
            }),
            ..base(Type::Error)
        };
        assert!(policy_refusal(&err(ServerError::ProducerBusy)));
        assert!(policy_refusal(&err(
            ServerError::ProducerBlockedQuotaExceededError
        )));
        assert!(!policy_refusal(&err(ServerError::ServiceNotReady)));
        assert!(!policy_refusal(&err(ServerError::TopicNotFound)));
        assert!(!policy_refusal(&base(Type::Success)));
    }
}
