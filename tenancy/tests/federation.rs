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

/// Tenant `acme`, allowed at both.
fn acme() -> TenantInfo {
    TenantInfo {
        allowed_clusters: vec!["east".into(), "west".into()],
        ..Default::default()
    }
}

/// Sites east and west, each with the other's record, and `acme` made at east.
async fn east_and_west_with_acme() -> (Site, Site) {
    let (east, west) = (site("east").await, site("west").await);
    east.t
        .create_cluster("west", &cluster("west"))
        .await
        .unwrap();
    west.t
        .create_cluster("east", &cluster("east"))
        .await
        .unwrap();
    east.t.create_tenant("acme", &acme()).await.unwrap();
    (east, west)
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
    let (east, west) = east_and_west_with_acme().await;
    let g = NamespacePolicies {
        replication_clusters: Some(vec!["east".into(), "west".into()]),
        ..Default::default()
    };
    east.t.create_namespace("acme/g", &g).await.unwrap();
    sync(&east, "east", &west, "west").await;
    assert_eq!(west.t.tenant("acme").await.unwrap(), acme());
    let east_only = TenantInfo {
        allowed_clusters: vec!["east".into()],
        ..Default::default()
    };
    let err = east
        .t
        .update_tenant("acme", &east_only, false)
        .await
        .unwrap_err();
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
    // A topic of it replicated to west on its own binds the tenant as a namespace does.
    let topic = "persistent://acme/g/a/b%c";
    east.t.update_topic_policies(topic, &g, &[]).await.unwrap();
    let err = east
        .t
        .update_tenant("acme", &east_only, false)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AdminError::FailedPrecondition(m) if m.contains(topic) && m.contains("west")),
        "{err:?}"
    );
    east.t
        .update_topic_policies(topic, &g_east, &[])
        .await
        .unwrap();
    east.t
        .update_tenant("acme", &east_only, false)
        .await
        .unwrap();
    sync(&east, "east", &west, "west").await;
    assert_eq!(west.t.tenant("acme").await.unwrap(), east_only);
}

#[tokio::test]
async fn given_a_topic_s_own_policies_then_they_go_to_its_namespace_s_sites_and_so_does_their_removal(
) {
    let (east, west) = east_and_west_with_acme().await;
    let clusters = |c: &[&str]| NamespacePolicies {
        replication_clusters: Some(c.iter().map(|s| s.to_string()).collect()),
        ..Default::default()
    };
    east.t
        .create_namespace("acme/g", &clusters(&["east", "west"]))
        .await
        .unwrap();
    east.t
        .create_namespace("acme/local", &clusters(&["east"]))
        .await
        .unwrap();
    sync(&east, "east", &west, "west").await;

    let (orders, local) = ("persistent://acme/g/orders", "persistent://acme/local/x");
    let ttl = |s: u32| NamespacePolicies {
        message_ttl_seconds: Some(s),
        ..Default::default()
    };
    east.t
        .update_topic_policies(orders, &ttl(120), &[])
        .await
        .unwrap();
    east.t
        .update_topic_policies(local, &ttl(5), &[])
        .await
        .unwrap();
    let sent = east.t.export_for("west").await.unwrap();
    let key = |t: &str, n: &str, x: &str| meridian_tenancy::model::topic_policies_key(t, n, x);
    assert!(sent.iter().any(|i| i.key == key("acme", "g", "orders")));
    assert!(
        !sent.iter().any(|i| i.key == key("acme", "local", "x")),
        "a namespace of east alone keeps its topics' policies"
    );
    sync(&east, "east", &west, "west").await;
    let (p, _) = west.t.topic_policies(orders).await.unwrap();
    assert_eq!(p.message_ttl_seconds, Some(120));

    // A field changed at west comes back to east beside east's.
    let producers = NamespacePolicies {
        max_producers_per_topic: Some(3),
        ..Default::default()
    };
    west.t
        .update_topic_policies(orders, &producers, &[])
        .await
        .unwrap();
    sync(&west, "west", &east, "east").await;
    let (p, _) = east.t.topic_policies(orders).await.unwrap();
    assert_eq!(
        (p.message_ttl_seconds, p.max_producers_per_topic),
        (Some(120), Some(3))
    );

    // Removed at east (every field cleared: the record goes, with a tombstone), gone at
    // west, and west's older copy does not bring it back.
    let stale = west.t.export_for("east").await.unwrap();
    let all = [
        "message_ttl_seconds".to_string(),
        "max_producers_per_topic".to_string(),
    ];
    east.t
        .update_topic_policies(orders, &NamespacePolicies::default(), &all)
        .await
        .unwrap();
    assert_eq!(east.t.topic_policies(orders).await.unwrap().1, 0);
    sync(&east, "east", &west, "west").await;
    assert_eq!(
        west.t.topic_policies(orders).await.unwrap().1,
        0,
        "gone at west"
    );
    east.t.merge_from("west", stale, &east.data).await.unwrap();
    assert_eq!(
        east.t.topic_policies(orders).await.unwrap().1,
        0,
        "an older copy does not bring them back"
    );
    // A topic deleted here (each site deletes its own copy of a topic deleted everywhere;
    // a site removed from a namespace deletes its data alone) leaves a tombstone that keeps
    // older copies out here and goes nowhere.
    east.t
        .update_topic_policies(orders, &ttl(7), &[])
        .await
        .unwrap();
    sync(&east, "east", &west, "west").await;
    let stale = west.t.export_for("east").await.unwrap();
    east.t
        .delete_topic_policies_record(&key("acme", "g", "orders"))
        .await
        .unwrap();
    east.t.merge_from("west", stale, &east.data).await.unwrap();
    assert_eq!(east.t.topic_policies(orders).await.unwrap().1, 0);
    assert!(!east
        .t
        .export_for("west")
        .await
        .unwrap()
        .iter()
        .any(|i| i.key == key("acme", "g", "orders")));
    sync(&east, "east", &west, "west").await;
    let (p, _) = west.t.topic_policies(orders).await.unwrap();
    assert_eq!(
        p.message_ttl_seconds,
        Some(7),
        "west's copy is its own to delete"
    );
}

/// Changes made at one site while a peer's copies are merged into the same record and
/// another admin changes it too: each change is made (the store makes again one that lost
/// the race to another) and none is lost. Before, the loser was refused ("changed
/// meanwhile; retry"), as `namespaces set-clusters` once was in CI while a merge landed.
#[tokio::test]
async fn given_merges_and_other_changes_racing_an_admin_s_then_every_change_is_made_and_kept() {
    let (east, west) = east_and_west_with_acme().await;
    let g = NamespacePolicies {
        replication_clusters: Some(vec!["east".into(), "west".into()]),
        ..Default::default()
    };
    east.t.create_namespace("acme/g", &g).await.unwrap();
    sync(&east, "east", &west, "west").await;

    const N: u32 = 30;
    // Two admins at east, each changing its own field of acme/g.
    let grants = async {
        for i in 0..N {
            east.t
                .set_permission("acme/g", &format!("role-{i}"), Some(vec!["consume".into()]))
                .await
                .map_err(|e| format!("grant {i}: {e}"))?;
        }
        Ok::<_, String>(())
    };
    let ttls = async {
        for i in 1..=N {
            let ttl = NamespacePolicies {
                message_ttl_seconds: Some(i),
                ..Default::default()
            };
            east.t
                .update_policies("acme/g", &ttl, &[])
                .await
                .map_err(|e| format!("ttl {i}: {e}"))?;
        }
        Ok::<_, String>(())
    };
    // And west's changes of a third field merged into east meanwhile.
    let merges = async {
        for i in 1..=N {
            let limit = NamespacePolicies {
                max_producers_per_topic: Some(i),
                ..Default::default()
            };
            west.t.update_policies("acme/g", &limit, &[]).await.unwrap();
            let items = west.t.export_for("east").await.unwrap();
            let r = east.t.merge_from("west", items, &east.data).await.unwrap();
            // A merge that lost races to the admins' changes is made again too.
            let lost: Vec<_> = r
                .skipped
                .iter()
                .filter(|(k, _)| k.ends_with("acme/g"))
                .collect();
            assert!(lost.is_empty(), "merge {i}: {lost:?}");
        }
    };
    let (grants, ttls, ()) = tokio::join!(grants, ttls, merges);
    grants.unwrap();
    ttls.unwrap();
    sync(&west, "west", &east, "east").await;

    let (p, _) = east.t.policies("acme/g").await.unwrap();
    let roles: Vec<String> = p.permissions.keys().cloned().collect();
    let mut want: Vec<String> = (0..N).map(|i| format!("role-{i}")).collect();
    want.sort();
    assert_eq!(roles, want, "every grant is kept");
    assert_eq!(p.message_ttl_seconds, Some(N));
    assert_eq!(p.max_producers_per_topic, Some(N));
}

/// A tenant's update that leaves its storage quota out keeps the quota the record has when
/// the update is made; one that replaces the whole record is not made on top of a change of
/// a field it did not know of.
#[tokio::test]
async fn given_a_tenant_update_without_a_quota_then_the_quota_stays() {
    let (east, _west) = east_and_west_with_acme().await;
    let quota = TenantInfo {
        storage_quota_bytes: Some(1 << 30),
        ..acme()
    };
    east.t.update_tenant("acme", &quota, false).await.unwrap();
    let roles = TenantInfo {
        admin_roles: vec!["ops".into()],
        ..acme()
    };
    east.t.update_tenant("acme", &roles, true).await.unwrap();
    let t = east.t.tenant("acme").await.unwrap();
    assert_eq!(t.admin_roles, vec!["ops".to_string()]);
    assert_eq!(t.storage_quota_bytes, Some(1 << 30));
    east.t.update_tenant("acme", &roles, false).await.unwrap();
    assert_eq!(
        east.t.tenant("acme").await.unwrap().storage_quota_bytes,
        None
    );
}
