//! The features as the session sees them: [`crate::session::seam::Features`] implemented
//! over each pool's [`super::Features`].

use std::sync::Arc;

use std::time::Duration;

use shoal_wire::sql::ClientEncoding;

use super::PoolFeatures;
use crate::limits::{PoolLimits, Running};
use crate::pool::Pool;
use crate::prepared::ClientStatements;
use crate::query_rules::QueryRules;
use crate::session::seam::{self, Refusal};

/// The features the data plane runs with (named at the crate root as [`crate::Plugged`]).
pub struct Plugged;

impl seam::Features for Plugged {
    type Limits = Option<Arc<PoolLimits>>;
    type Running = Option<Running>;

    #[inline]
    fn limits(pool: &Pool) -> Self::Limits {
        pool.limits()
    }

    async fn admit_unit(limits: &Self::Limits) -> Result<(), Refusal> {
        match limits.as_ref().filter(|l| l.has_rate()) {
            Some(l) => l.admit_query().await,
            None => Ok(()),
        }
    }

    async fn admit_transaction(limits: &Self::Limits) -> Result<Self::Running, Refusal> {
        match limits.as_ref().filter(|l| l.has_concurrency()) {
            Some(l) => l.admit_transaction().await.map(Some),
            None => Ok(None),
        }
    }

    #[inline]
    fn transaction_ran(pool: &Pool, queries: u64) {
        if let Some(l) = pool.limits() {
            l.charge(queries);
        }
    }

    type Rules = Arc<QueryRules>;

    #[inline]
    fn rules(pool: &Pool) -> Option<Self::Rules> {
        pool.rules()
    }

    async fn rules_ready(rules: &Self::Rules, limit: Duration) {
        rules.catalogue_read(limit).await
    }

    #[inline]
    fn refusal(
        rules: &Self::Rules,
        msg: &[u8],
        statements: Option<&ClientStatements>,
        pool: &str,
        encoding: ClientEncoding,
    ) -> Option<(&'static str, String)> {
        rules.refusal(msg, statements, pool, encoding)
    }
}
