//! Global objects between two sites' metadata stores: what one site exports, the other
//! merges; changes made apart converge; deletions travel; a peer changes only what it takes
//! part in.

use std::sync::Mutex;

use futures::future::BoxFuture;
use meridian_metadata::embedded::EmbeddedStore;
use meridian_tenancy::federation::NamespaceData;
use meridian_tenancy::model::{ClusterData, NamespacePolicies, TenantInfo};
use meridian_tenancy::{AdminError, TenancyStore};

struct Site {
    _dir: tempfile::TempDir,
    _store: EmbeddedStore,
    t: TenancyStore,
    data: Topics,
}

/// The site's topics, as far as the merge reaches them: which namespaces' were deleted.
#[derive(Default)]
struct Topics {
    deleted_topics_of: Mutex<Vec<String>>,
}

impl NamespaceData for Topics {
    fn delete_topics<'a>(&'a self, ns: &'a str) -> BoxFuture<'a, Result<(), AdminError>> {
        self.deleted_topics_of.lock().unwrap().push(ns.to_string());
        Box::pin(async { Ok(()) })
    }
}

async fn site(name: &str) -> Site {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::start(meridian_config::MetadataConfig {
        listen: "127.0.0.1:0".into(),
        data_dir: dir.path().join("meta").display().to_string(),
        ..Default::default()
    })
    .await
    .unwrap();
    let t = TenancyStore::for_site(store.client.clone(), name);
    t.bootstrap_standalone(
        name,
        &ClusterData {
            service_url: format!("pulsar://{name}:6650"),
            admin_url: format!("http://{name}:8081"),
            geo_url: format!("quic://{name}:7000"),
        },
    )
    .await
    .unwrap();
    Site {
        _dir: dir,
        _store: store,
        t,
        data: Topics::default(),
    }
}

/// `from` sends `to` what it takes part in; what changed at `to`.
async fn sync(from: &Site, from_name: &str, to: &Site, to_name: &str) -> Vec<String> {
    let items = from.t.export_for(to_name).await.unwrap();
    let r = to.t.merge_from(from_name, items, &to.data).await.unwrap();
    r.changed
}

fn cluster(name: &str) -> ClusterData {
    ClusterData {
        service_url: format!("pulsar://{name}:6650"),
        admin_url: format!("http://{name}:8081"),
        geo_url: format!("quic://{name}:7000"),
    }
}

#[tokio::test]
async fn given_objects_made_at_one_site_then_the_other_takes_them_and_changes_made_apart_converge()
{
    let east = site("east").await;
    let west = site("west").await;
    east.t
        .create_cluster("west", &cluster("west"))
        .await
        .unwrap();
    west.t
        .create_cluster("east", &cluster("east"))
        .await
        .unwrap();
    // The registry: a third site made known at east only reaches west.
    east.t
        .create_cluster("north", &cluster("north"))
        .await
        .unwrap();
    let tenant = TenantInfo {
        admin_roles: vec!["acme-admin".into()],
        allowed_clusters: vec!["east".into(), "west".into()],
        storage_quota_bytes: None,
    };
    east.t.create_tenant("acme", &tenant).await.unwrap();
    let g = NamespacePolicies {
        replication_clusters: Some(vec!["east".into(), "west".into()]),
        message_ttl_seconds: Some(60),
        ..Default::default()
    };
    east.t.create_namespace("acme/g", &g).await.unwrap();
    // A namespace of east alone stays at east.
    let local = NamespacePolicies {
        replication_clusters: Some(vec!["east".into()]),
        ..Default::default()
    };
    east.t.create_namespace("acme/local", &local).await.unwrap();

    let changed = sync(&east, "east", &west, "west").await;
    assert!(
        changed.contains(&"/admin/clusters/north".to_string()),
        "{changed:?}"
    );
    assert_eq!(west.t.cluster("north").await.unwrap(), cluster("north"));
    assert_eq!(west.t.tenant("acme").await.unwrap(), tenant);
    assert_eq!(west.t.policies("acme/g").await.unwrap().0, g);
    assert!(west.t.policies("acme/local").await.is_err());
    assert!(
        sync(&east, "east", &west, "west").await.is_empty(),
        "idempotent"
    );

    // Apart: east changes the TTL, west the retention and the TTL a moment before east.
    let ttl = |s| NamespacePolicies {
        message_ttl_seconds: Some(s),
        ..Default::default()
    };
    west.t
        .update_policies("acme/g", &ttl(5), &[])
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    east.t
        .update_policies("acme/g", &ttl(30), &[])
        .await
        .unwrap();
    let dedup = NamespacePolicies {
        deduplication_enabled: Some(true),
        ..Default::default()
    };
    west.t.update_policies("acme/g", &dedup, &[]).await.unwrap();
    sync(&east, "east", &west, "west").await;
    sync(&west, "west", &east, "east").await;
    let (at_east, _) = east.t.policies("acme/g").await.unwrap();
    let (at_west, _) = west.t.policies("acme/g").await.unwrap();
    assert_eq!(at_east, at_west);
    assert_eq!(
        at_east.message_ttl_seconds,
        Some(30),
        "east's change is the later"
    );
    assert_eq!(
        at_east.deduplication_enabled,
        Some(true),
        "west's field is kept"
    );
    assert!(sync(&east, "east", &west, "west").await.is_empty());
    assert!(sync(&west, "west", &east, "east").await.is_empty());

    // A deletion at east deletes west's copy (its topics first) and stays a deletion when an
    // older copy comes back.
    let before = west.t.export_for("east").await.unwrap();
    east.t.delete_namespace("acme/g", &[], false).await.unwrap();
    let changed = sync(&east, "east", &west, "west").await;
    assert_eq!(changed, vec!["/admin/namespaces/acme/g".to_string()]);
    assert!(west.t.policies("acme/g").await.is_err());
    assert_eq!(
        *west.data.deleted_topics_of.lock().unwrap(),
        vec!["acme/g".to_string()]
    );
    let stale = east.t.merge_from("west", before, &east.data).await.unwrap();
    assert!(
        !stale.changed.iter().any(|k| k.contains("acme/g")),
        "{stale:?}"
    );
    assert!(east.t.policies("acme/g").await.is_err());
    // Created again, it lives at both without the deleted one's fields.
    east.t
        .create_namespace(
            "acme/g",
            &NamespacePolicies {
                replication_clusters: Some(vec!["east".into(), "west".into()]),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    sync(&east, "east", &west, "west").await;
    assert_eq!(
        west.t
            .policies("acme/g")
            .await
            .unwrap()
            .0
            .message_ttl_seconds,
        None
    );
}

#[tokio::test]
async fn given_a_peer_then_it_changes_only_what_it_takes_part_in() {
    let east = site("east").await;
    let west = site("west").await;
    for s in ["west", "north"] {
        east.t.create_cluster(s, &cluster(s)).await.unwrap();
    }
    west.t
        .create_cluster("east", &cluster("east"))
        .await
        .unwrap();
    west.t
        .create_cluster("north", &cluster("north"))
        .await
        .unwrap();
    // A tenant of east and north only is not west's to take, nor north's to change at west.
    let en = TenantInfo {
        allowed_clusters: vec!["east".into(), "north".into()],
        ..Default::default()
    };
    east.t.create_tenant("other", &en).await.unwrap();
    let items = east.t.export_for("north").await.unwrap();
    let r = west
        .t
        .merge_from("east", items.clone(), &west.data)
        .await
        .unwrap();
    assert!(
        r.skipped.iter().any(|(k, _)| k == "/admin/tenants/other"),
        "{r:?}"
    );
    assert!(west.t.tenant("other").await.is_err());
    // No peer deletes this site's own record.
    east.t.delete_cluster("west", false).await.unwrap();
    sync(&east, "east", &west, "west").await;
    assert!(west.t.cluster("west").await.is_ok());
    // Every tenant is sent (a peer takes only what allows it, above), the namespaces of a
    // tenant that does not allow the peer are not.
    let ns = NamespacePolicies {
        replication_clusters: Some(vec!["east".into()]),
        ..Default::default()
    };
    east.t.create_namespace("other/ns", &ns).await.unwrap();
    let sent = east.t.export_for("west").await.unwrap();
    assert!(sent.iter().any(|i| i.key == "/admin/tenants/other"));
    assert!(!sent.iter().any(|i| i.key == "/admin/namespaces/other/ns"));
}

#[tokio::test]
async fn given_a_site_removed_from_a_tenant_then_refused_while_a_namespace_lists_it_and_the_removed_site_converges(
) {
    let (east, west) = (site("east").await, site("west").await);
    east.t
        .create_cluster("west", &cluster("west"))
        .await
        .unwrap();
    west.t
        .create_cluster("east", &cluster("east"))
        .await
        .unwrap();
    let both = TenantInfo {
        allowed_clusters: vec!["east".into(), "west".into()],
        ..Default::default()
    };
    east.t.create_tenant("acme", &both).await.unwrap();
    let g = NamespacePolicies {
        replication_clusters: Some(vec!["east".into(), "west".into()]),
        ..Default::default()
    };
    east.t.create_namespace("acme/g", &g).await.unwrap();
    sync(&east, "east", &west, "west").await;
    assert_eq!(west.t.tenant("acme").await.unwrap(), both);
    let east_only = TenantInfo {
        allowed_clusters: vec!["east".into()],
        ..Default::default()
    };
    let err = east.t.update_tenant("acme", &east_only).await.unwrap_err();
    assert!(
        matches!(&err, AdminError::FailedPrecondition(m) if m.contains("acme/g") && m.contains("west")),
        "{err:?}"
    );
    let g_east = NamespacePolicies {
        replication_clusters: Some(vec!["east".into()]),
        ..Default::default()
    };
    east.t
        .update_policies("acme/g", &g_east, &[])
        .await
        .unwrap();
    east.t.update_tenant("acme", &east_only).await.unwrap();
    sync(&east, "east", &west, "west").await;
    assert_eq!(west.t.tenant("acme").await.unwrap(), east_only);
}
