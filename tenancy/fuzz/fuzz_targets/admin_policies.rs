//! Any bytes as an `UpdateNamespacePolicies` / `UpdateTopicPolicies` request body: it decodes
//! or is refused; its target name is checked or refused; and the update it asks for is refused
//! with a reason or yields policies that validate, survive the trip to an answer and back
//! unchanged, and do not change when applied again.
//! Run: `scripts/fuzz tenancy admin_policies`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_tenancy::model::{split_namespace, split_topic, NamespacePolicies};
use meridian_tenancy::pb::UpdatePoliciesRequest;
use meridian_tenancy::service::{policies_from, policies_to};
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(req) = UpdatePoliciesRequest::decode(data) else {
        return;
    };
    let _ = split_namespace(&req.namespace);
    let _ = split_topic(&req.namespace);
    let set = policies_from(req.set);
    let Ok(new) = NamespacePolicies::default().updated(&set, &req.clear) else {
        return;
    };
    new.validate().expect("an update's result validates");
    assert_eq!(policies_from(Some(policies_to(&new))), new);
    assert_eq!(new.updated(&set, &req.clear).expect("applies again"), new);
});
