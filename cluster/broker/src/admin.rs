//! The broker's side of the admin API: topic operations for the tenancy crate's gRPC service
//! ([`meridian_tenancy::service::TopicOps`]), and starting that service next to the broker.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use meridian_protocol::pb::ServerError;
use meridian_tenancy::model::ClusterData;
use meridian_tenancy::pb;
use meridian_tenancy::service::{AdminService, RunningAdmin, TopicOps};
use meridian_tenancy::{AdminError, TenancyStore};

use crate::broker::{Broker, BrokerError, TopicStats};
use crate::topic_name::TopicName;

/// The admin API's view of a broker error.
fn admin_error(e: BrokerError) -> AdminError {
    match e.code {
        ServerError::TopicNotFound | ServerError::SubscriptionNotFound => {
            AdminError::NotFound(e.message)
        }
        ServerError::InvalidTopicName => AdminError::Invalid(e.message),
        ServerError::MetadataError
        | ServerError::ServiceNotReady
        | ServerError::PersistenceError => AdminError::Unavailable(e.message),
        ServerError::AuthenticationError => AdminError::Unauthenticated(e.message),
        ServerError::AuthorizationError => AdminError::PermissionDenied(e.message),
        _ => AdminError::FailedPrecondition(e.message),
    }
}

fn to_pb(s: TopicStats, terminated: bool) -> pb::TopicStats {
    pb::TopicStats {
        topic: s.topic,
        msg_rate_in: s.msg_rate_in,
        msg_rate_out: s.msg_rate_out,
        bytes_rate_in: s.bytes_rate_in,
        bytes_rate_out: s.bytes_rate_out,
        msgs_in_total: s.msgs_in_total,
        msgs_out_total: s.msgs_out_total,
        storage_entries: s.storage_entries,
        storage_bytes: s.storage_bytes,
        producers: s.producers as u32,
        terminated,
        subscriptions: s
            .subscriptions
            .into_iter()
            .map(|x| pb::SubscriptionStats {
                name: x.name,
                sub_type: x.sub_type,
                durable: x.durable,
                consumers: x.consumers as u32,
                msg_rate_out: x.msg_rate_out,
                msgs_out_total: x.msgs_out_total,
                backlog_entries: x.backlog_entries,
                backlog_bytes: x.backlog_bytes,
                unacked_entries: x.unacked_entries as u64,
                delayed_entries: x.delayed_entries as u64,
                properties: x.properties.into_iter().collect(),
            })
            .collect(),
    }
}

/// [`TopicOps`] over a broker.
pub struct BrokerTopics(pub Arc<Broker>);

impl BrokerTopics {
    fn name(&self, topic: &str) -> Result<TopicName, AdminError> {
        self.0.check_topic(topic).map_err(admin_error)
    }
}

impl TopicOps for BrokerTopics {
    fn list(&self, namespace: String) -> BoxFuture<'_, Result<Vec<(String, u32)>, AdminError>> {
        async move {
            let b = &self.0;
            let partitioned = b
                .partitioned_topics_of_namespace(&namespace)
                .await
                .map_err(admin_error)?;
            let mut out: Vec<(String, u32)> = partitioned
                .iter()
                .map(|(t, n)| (t.to_string(), *n))
                .collect();
            for t in b
                .topics_of_namespace(&namespace)
                .await
                .map_err(admin_error)?
            {
                let name = TopicName::parse(&t).map_err(|e| admin_error(e.into()))?;
                // Partitions are listed through their topic.
                let is_partition = name
                    .parent()
                    .is_some_and(|p| partitioned.iter().any(|(q, _)| *q == p));
                if !is_partition {
                    out.push((t, 0));
                }
            }
            out.sort();
            Ok(out)
        }
        .boxed()
    }

    fn create(&self, topic: String, partitions: u32) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            let name = self.name(&topic)?;
            let b = &self.0;
            if partitions > 0 {
                return b
                    .create_partitioned_topic(&name, partitions)
                    .await
                    .map_err(admin_error);
            }
            if b.topic_exists(&name).await.map_err(admin_error)? {
                return Err(AdminError::AlreadyExists(format!(
                    "topic {name} already exists"
                )));
            }
            if b.partitions_of(&name).await.map_err(admin_error)?.is_some() {
                return Err(AdminError::AlreadyExists(format!(
                    "{name} already exists as a partitioned topic"
                )));
            }
            b.topic_for_broker(&name).await.map_err(admin_error)?;
            Ok(())
        }
        .boxed()
    }

    fn update_partitions(
        &self,
        topic: String,
        partitions: u32,
    ) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            let name = self.name(&topic)?;
            self.0
                .update_partitions(&name, partitions)
                .await
                .map_err(admin_error)
        }
        .boxed()
    }

    fn stats(&self, topic: String) -> BoxFuture<'_, Result<pb::TopicStats, AdminError>> {
        async move {
            let name = self.name(&topic)?;
            let t = self.0.topic(&name, false).await.map_err(admin_error)?;
            let terminated = t.ml.is_terminated().await;
            Ok(to_pb(t.stats().await, terminated))
        }
        .boxed()
    }

    fn terminate(&self, topic: String) -> BoxFuture<'_, Result<String, AdminError>> {
        async move {
            let name = self.name(&topic)?;
            if self
                .0
                .partitions_of(&name)
                .await
                .map_err(admin_error)?
                .is_some()
            {
                return Err(AdminError::FailedPrecondition(format!(
                    "{name} is partitioned: terminate its partitions ({name}-partition-<i>)"
                )));
            }
            let t = self.0.topic(&name, false).await.map_err(admin_error)?;
            let last = t.terminate().await.map_err(admin_error)?;
            Ok(last.map_or_else(String::new, |p| format!("{}:{}", p.ledger_id, p.entry_id)))
        }
        .boxed()
    }
}

/// Records the site's tenancy defaults (this cluster, tenant `public`, namespace
/// `public/default`) and starts the admin API on `listener`.
pub async fn start(
    broker: &Arc<Broker>,
    listener: tokio::net::TcpListener,
) -> anyhow::Result<RunningAdmin> {
    let store = TenancyStore::new(broker.meta.clone());
    let addr = listener.local_addr()?;
    store
        .bootstrap_standalone(
            &broker.cfg.cluster_name,
            &ClusterData {
                service_url: broker.service_url.clone(),
                admin_url: format!("http://{addr}"),
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("recording the site's tenancy defaults: {e}"))?;
    let service = AdminService::new(store, Arc::new(BrokerTopics(Arc::clone(broker))));
    meridian_tenancy::service::serve(listener, service)
}
