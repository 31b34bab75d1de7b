//! Authorization of clients' topic operations: superusers, tenant admins, namespace grants.

use meridian_protocol::pb::ServerError;

use super::{Broker, BrokerError};

impl Broker {
    /// Whether `role` is one of `broker.superuser_roles`.
    pub fn is_superuser(&self, role: &str) -> bool {
        self.cfg
            .superuser_roles
            .split(',')
            .map(str::trim)
            .any(|r| !r.is_empty() && r == role)
    }

    /// With authentication on: may `role` do `action` ("produce", "consume", or `None` for
    /// either, as a lookup needs) on topics of `namespace`? Superusers and the tenant's admin
    /// roles may; others need a grant in the namespace. The refusal says nothing of whether
    /// the topic exists.
    pub async fn authorize(
        &self,
        role: Option<&str>,
        namespace: &str,
        action: Option<&str>,
    ) -> Result<(), BrokerError> {
        if self.auth.is_none() {
            return Ok(());
        }
        let Some(role) = role else {
            return Err(BrokerError::new(
                ServerError::AuthorizationError,
                "not authenticated",
            ));
        };
        if self.is_superuser(role) {
            return Ok(());
        }
        let tenant = namespace.split('/').next().unwrap_or(namespace);
        let store = meridian_tenancy::TenancyStore::new(self.meta.clone());
        if let Ok(t) = store.tenant(tenant).await {
            if t.admin_roles.iter().any(|r| r == role) {
                return Ok(());
            }
        }
        let granted = self
            .namespace_policies(namespace)
            .await?
            .permissions
            .get(role)
            .is_some_and(|acts| match action {
                Some(a) => acts.iter().any(|x| x == a),
                None => !acts.is_empty(),
            });
        if granted {
            Ok(())
        } else {
            Err(BrokerError::new(
                ServerError::AuthorizationError,
                format!(
                    "role {role} may not {} in namespace {namespace}",
                    action.unwrap_or("use topics")
                ),
            ))
        }
    }
}
