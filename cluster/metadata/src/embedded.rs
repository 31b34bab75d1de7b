//! Embedded mode: a single-node metadata store inside another process (`meridian standalone`),
//! reached through the same [`MetadataClient`] API as a cluster. It is a real node (RocksDB,
//! openraft, gRPC on a loopback port), initialized as a one-member cluster.

use meridian_config::{ClientConfig, MetadataConfig};
use tokio::net::TcpListener;

use crate::client::MetadataClient;
use crate::node::{MetadataNode, RunningNode};

pub struct EmbeddedStore {
    pub node: RunningNode,
    pub client: MetadataClient,
}

impl EmbeddedStore {
    /// Starts a single-node store with `cfg` (its `listen` may use port 0) and waits until it
    /// has elected itself and answers.
    pub async fn start(cfg: MetadataConfig) -> Result<Self, String> {
        Self::start_with_tls(cfg, None).await
    }

    /// As [`EmbeddedStore::start`], serving TLS between roles with `tls` (its client presents
    /// the same certificate). The node's certificate check is skipped: a standalone holds one
    /// certificate for all its parts.
    pub async fn start_with_tls(
        mut cfg: MetadataConfig,
        tls: Option<std::sync::Arc<crate::tls::SiteTls>>,
    ) -> Result<Self, String> {
        let listener = TcpListener::bind(&cfg.listen)
            .await
            .map_err(|e| format!("metadata.listen {}: {e}", cfg.listen))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        cfg.advertise = addr.to_string();
        cfg.initial_members = vec![format!("{}={addr}", cfg.node_id)];
        let node = MetadataNode::start_embedded(&cfg, tls.clone(), listener).await?;
        let client = MetadataClient::with_tls(
            &ClientConfig {
                endpoints: vec![addr.to_string()],
                ..ClientConfig::default()
            },
            tls,
        )
        .map_err(|e| e.to_string())?;
        // Wait for the single node to lead; a linearizable read proves it.
        client
            .get("/")
            .await
            .map_err(|e| format!("embedded metadata store did not become ready: {e}"))?;
        Ok(Self { node, client })
    }

    pub async fn shutdown(self) {
        self.node.shutdown().await;
    }
}
