//! A session's keep-alives against a metadata endpoint played by the test (real gRPC on loopback)
//! that can leave keep-alives unanswered for a while: what nodes paused or cut off look like to
//! a client (each attempt times out). Checks how soon the lease is renewed after a round in
//! which no keep-alive was answered.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meridian_config::ClientConfig;
use meridian_metadata::pb;
use meridian_metadata::pb::metadata_server::{Metadata, MetadataServer};
use meridian_metadata::MetadataClient;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

const TTL: Duration = Duration::from_secs(6);

#[derive(Default)]
struct State {
    /// The next keep-alive to arrive starts a silence this long.
    arm: Option<Duration>,
    /// Keep-alives arriving before this go unanswered.
    silent_until: Option<Instant>,
    /// When each answered keep-alive (and the session's creation) arrived: a lease renewal.
    renewals: Vec<Instant>,
    /// How many keep-alives went unanswered.
    silenced: usize,
}

#[derive(Clone, Default)]
struct Endpoint(Arc<Mutex<State>>);

type Watching = Pin<Box<dyn futures::Stream<Item = Result<pb::WatchResponse, Status>> + Send>>;

fn not_here<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("not played by this test"))
}

#[tonic::async_trait]
impl Metadata for Endpoint {
    async fn get(&self, _: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        not_here()
    }

    async fn list(
        &self,
        _: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        not_here()
    }

    async fn txn(&self, _: Request<pb::TxnRequest>) -> Result<Response<pb::TxnResponse>, Status> {
        not_here()
    }

    type WatchStream = Watching;

    async fn watch(&self, _: Request<pb::WatchRequest>) -> Result<Response<Watching>, Status> {
        not_here()
    }

    async fn session_create(
        &self,
        _: Request<pb::SessionCreateRequest>,
    ) -> Result<Response<pb::SessionCreateResponse>, Status> {
        self.0.lock().unwrap().renewals.push(Instant::now());
        Ok(Response::new(pb::SessionCreateResponse {
            session: 7,
            ttl_ms: TTL.as_millis() as u64,
        }))
    }

    async fn session_keep_alive(
        &self,
        _: Request<pb::SessionKeepAliveRequest>,
    ) -> Result<Response<pb::SessionKeepAliveResponse>, Status> {
        let now = Instant::now();
        let silent = {
            let mut s = self.0.lock().unwrap();
            if let Some(d) = s.arm.take() {
                s.silent_until = Some(now + d);
            }
            let silent = s.silent_until.is_some_and(|u| now < u);
            if silent {
                s.silenced += 1;
            } else {
                s.renewals.push(now);
            }
            silent
        };
        if silent {
            // No answer: the client gives up on this attempt at its own deadline.
            tokio::time::sleep(Duration::from_secs(60)).await;
            return Err(Status::unavailable("silent"));
        }
        Ok(Response::new(pb::SessionKeepAliveResponse {
            ttl_ms: TTL.as_millis() as u64,
        }))
    }

    async fn session_close(
        &self,
        _: Request<pb::SessionCloseRequest>,
    ) -> Result<Response<pb::SessionCloseResponse>, Status> {
        not_here()
    }

    async fn members(
        &self,
        _: Request<pb::MembersRequest>,
    ) -> Result<Response<pb::MembersResponse>, Status> {
        not_here()
    }

    async fn add_member(
        &self,
        _: Request<pb::AddMemberRequest>,
    ) -> Result<Response<pb::MembersResponse>, Status> {
        not_here()
    }

    async fn remove_member(
        &self,
        _: Request<pb::RemoveMemberRequest>,
    ) -> Result<Response<pb::MembersResponse>, Status> {
        not_here()
    }
}

/// A TTL of 6 s: keep-alive rounds every 2 s, each trying for up to 2 s (at most 667 ms per
/// attempt). The endpoint goes silent for 2.5 s from the second round's start, so that whole
/// round goes unanswered, and the first attempt of a round started 100 ms after it. The next
/// round must renew the lease well before it runs out: a round started a period after the
/// failed one ended (as the client did before) arrives when the lease has run out (6 s after
/// the last renewal), so the session's owner no longer counts it as surely alive, and the store
/// could have expired it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_keep_alive_round_left_unanswered_then_the_next_renews_the_lease_well_before_it_runs_out(
) {
    let endpoint = Endpoint::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(MetadataServer::new(endpoint.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let client = MetadataClient::new(&ClientConfig {
        endpoints: vec![addr.to_string()],
        ..ClientConfig::default()
    })
    .unwrap();
    let session = client.session(TTL.as_millis() as u64).await.unwrap();

    // After the first keep-alive is answered, the next one (the second round) starts a silence.
    let first = Instant::now() + Duration::from_secs(4);
    loop {
        {
            let mut s = endpoint.0.lock().unwrap();
            if s.renewals.len() >= 2 {
                s.arm = Some(Duration::from_millis(2_500));
                break;
            }
        }
        assert!(Instant::now() < first, "no keep-alive within 4 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // Through the silence and two rounds past it: how close the lease came to running out, as
    // the client counts it.
    let end = Instant::now() + Duration::from_secs(8);
    let mut headroom = TTL;
    while Instant::now() < end {
        let now = Instant::now();
        headroom = headroom.min(session.valid_until().saturating_duration_since(now));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.abort();

    let s = endpoint.0.lock().unwrap();
    assert!(s.silenced >= 1, "no keep-alive fell in the silence");
    let longest = s.renewals.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    // Counted from the session's creation.
    let at: Vec<Duration> = s.renewals.iter().map(|r| *r - s.renewals[0]).collect();
    assert!(s.renewals.len() >= 4, "renewals at {at:?}");
    // With the next round started 100 ms after the failed one: renewed by its second attempt,
    // about 4.8 s after the last renewal (1.2 s of lease left). A period later: 6 s after it,
    // no lease left.
    assert!(
        longest <= Duration::from_millis(5_700),
        "{longest:?} between two renewals of a {TTL:?} lease: {at:?}"
    );
    assert!(
        headroom >= Duration::from_millis(300),
        "the lease came within {headroom:?} of running out"
    );
}
