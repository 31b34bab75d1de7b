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
    pub async fn start(mut cfg: MetadataConfig) -> Result<Self, String> {
        let listener = TcpListener::bind(&cfg.listen)
            .await
            .map_err(|e| format!("metadata.listen {}: {e}", cfg.listen))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        cfg.advertise = addr.to_string();
        cfg.initial_members = vec![format!("{}={addr}", cfg.node_id)];
        let node = MetadataNode::start(&cfg, listener).await?;
        let client = MetadataClient::new(&ClientConfig {
            endpoints: vec![addr.to_string()],
            ..ClientConfig::default()
        })
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
