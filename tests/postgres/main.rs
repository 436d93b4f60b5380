//! The PostgreSQL store: the conformance suite on a real server, failing
//! closed, a connection lost mid-call, migrations from several processes,
//! sweeping, and claims inside the caller's transaction.
//!
//! Needs the server `services::postgres_url()` names; without it every test
//! says SKIPPED (or fails, with `IDEM_REQUIRE_SERVICES=1`). Keys are random
//! per test, and tests that count or delete rows table-wide run in a schema
//! of their own, so runs and tests never see each other's records.
//!
//! One module per topic; the stores, requests and the private schema several
//! topics use are here.

mod fail_closed;
mod locks;
mod migrations;
mod purge;
mod records;
mod transaction;

use std::str::FromStr;
use std::time::{Duration, Instant};

use idem_runtime::Key;
use idem_runtime::store::StoreRef;
use idem_runtime::store::sql::PgStore;
use idem_runtime::store::{ClaimRequest, Completion, StoredOutcome, Token};
use idem_tests::conformance::Subject;
use idem_tests::services;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Long enough that a loaded two-core machine never misses a lease boundary
/// by a whole unit, short enough that the slowest case takes about 3 s.
const UNIT: Duration = Duration::from_millis(400);

async fn store() -> Option<PgStore> {
    let url = services::postgres_url();
    services::reachable("PostgreSQL", &url, PgStore::connect(&url).await)
}

async fn subject() -> Option<Subject> {
    store()
        .await
        .map(|store| Subject::real(StoreRef::new(store), UNIT))
}

idem_tests::conformance_suite!(postgres_store, subject());

fn request(key: &Key, token: Token, lease: Duration) -> ClaimRequest<'_> {
    ClaimRequest {
        key,
        token,
        fingerprint: None,
        lease,
        ttl: Duration::from_secs(120),
    }
}

fn success(payload: &[u8], ttl: Duration) -> Completion<'_> {
    Completion {
        outcome: StoredOutcome::Success,
        payload,
        ttl,
    }
}

fn random_u32() -> u32 {
    u32::from_le_bytes(Token::random().as_bytes()[..4].try_into().unwrap())
}

/// Polls `check` until it holds, failing after 10 s.
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A schema of one's own, for tests that look at the whole table.
struct Schema {
    name: String,
    options: PgConnectOptions,
    admin: PgPool,
}

impl Schema {
    async fn create(tag: &str) -> Option<Schema> {
        let url = services::postgres_url();
        let admin = services::reachable(
            "PostgreSQL",
            &url,
            PgPoolOptions::new().max_connections(2).connect(&url).await,
        )?;
        let name = format!("idem_test_{tag}_{:08x}", random_u32());
        sqlx::query(&format!("CREATE SCHEMA {name}"))
            .execute(&admin)
            .await
            .expect("create schema");
        let options = PgConnectOptions::from_str(&url)
            .expect("postgres url")
            .options([("search_path", name.as_str())]);
        Some(Schema {
            name,
            options,
            admin,
        })
    }

    async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {}.{table}", self.name))
            .fetch_one(&self.admin)
            .await
            .expect("count")
    }

    async fn drop(self) {
        sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.name))
            .execute(&self.admin)
            .await
            .expect("drop schema");
    }
}
