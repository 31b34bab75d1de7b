//! The broker's side of the geo link (`meridian-geo`): the registry the link checks peers
//! against (this site's cluster records), and the link's start on `geo.listen`.

use std::sync::Arc;

use crate::broker::replication::GeoSink;
use crate::broker::Broker;
use futures::future::BoxFuture;
use meridian_config::GeoConfig;
use meridian_geo::{GeoLink, SiteDirectory};
use meridian_tenancy::{AdminError, TenancyStore};

/// This site's registry: a site is known when it has a cluster record
/// (`clusters create NAME ...`, or one carried over the link from a site that knows it).
pub struct Registry(TenancyStore);

impl SiteDirectory for Registry {
    fn knows<'a>(&'a self, site: &'a str) -> BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            match self.0.cluster(site).await {
                Ok(_) => Ok(true),
                Err(AdminError::NotFound(_)) | Err(AdminError::Invalid(_)) => Ok(false),
                Err(e) => Err(e.to_string()),
            }
        })
    }

    fn locate<'a>(&'a self, site: &'a str) -> BoxFuture<'a, Result<Option<String>, String>> {
        Box::pin(async move {
            match self.0.cluster(site).await {
                Ok(c) if !c.geo_url.is_empty() => Ok(Some(c.geo_url)),
                Ok(_) | Err(AdminError::NotFound(_)) | Err(AdminError::Invalid(_)) => Ok(None),
                Err(e) => Err(e.to_string()),
            }
        })
    }
}

/// Starts the link when `geo.listen` is set (the site is `broker.cluster_name`): peers'
/// topic streams go to `broker`, and its topics replicate over it.
pub async fn start_link(
    cfg: &GeoConfig,
    broker: &Arc<Broker>,
) -> anyhow::Result<Option<Arc<GeoLink>>> {
    if !cfg.enabled() {
        return Ok(None);
    }
    let registry = Arc::new(Registry(TenancyStore::new(broker.meta.clone())));
    let sink = Arc::new(GeoSink(Arc::downgrade(broker)));
    let link = Arc::new(GeoLink::start(cfg, &broker.cfg.cluster_name, registry, Some(sink)).await?);
    let _ = broker.geo.set(Arc::clone(&link));
    // Where other sites open the streams of this broker's topics: an unspecified address
    // (0.0.0.0) would send them nowhere, so then only the site's own URL is used.
    let advertise = link.advertise().to_string();
    if advertise.starts_with("0.0.0.0:") || advertise.starts_with("[::]:") {
        tracing::warn!(
            advertise,
            "geo.advertise is not set and geo.listen is an unspecified address: other sites cannot be sent to this broker for the topics it owns; set geo.advertise"
        );
    } else {
        broker.ownership.set_geo_url(&format!("quic://{advertise}"));
    }
    tokio::spawn(Arc::clone(broker).tombstone_loop());
    tokio::spawn(Arc::clone(broker).meta_sync_loop());
    Ok(Some(link))
}

/// What a start-up banner says of the link: `, geo link on quic://ADDR (site NAME)`, or
/// nothing.
pub fn banner(link: Option<&Arc<GeoLink>>, site: &str) -> String {
    link.map(|l| format!(", geo link on quic://{} (site {site})", l.local_addr()))
        .unwrap_or_default()
}

/// The geo URL of this site's cluster record: `quic://` and the link's advertised address.
pub fn geo_url(link: Option<&Arc<GeoLink>>) -> String {
    link.map(|l| format!("quic://{}", l.advertise()))
        .unwrap_or_default()
}
