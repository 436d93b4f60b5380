//! The MySQL/MariaDB store on a real server: the whole conformance suite,
//! claims inside the caller's transaction, migrations from several processes
//! at once, a crashed owner taken over, and failing closed.
//!
//! The server is `IDEM_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).
//! When it is unreachable each test says so and returns, or fails under
//! `IDEM_REQUIRE_SERVICES=1`.
//!
//! One module per topic; the stores, requests and calls several topics use
//! are here.

mod claim;
mod fail_closed;
mod locks;
mod migrations;
mod purge;
mod records;
mod statements;
mod transaction;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idem_runtime::store::StoreRef;
use idem_runtime::store::sql::MySqlStore;
use idem_runtime::store::{Claim, ClaimRequest, Completion, Store, StoredOutcome, Token};
use idem_runtime::{Error, Key, idempotent};
use idem_tests::conformance::{Subject, fresh_key};
use idem_tests::services;
use sqlx::mysql::MySqlPoolOptions;

/// A store on the test server, migrated, or `None` (said loudly) when the
/// server is unreachable.
async fn store() -> Option<MySqlStore> {
    let url = services::mysql_url();
    services::reachable("MariaDB", &url, MySqlStore::connect(&url).await)
}

/// Server time, so the cases wait in real time: 250 ms per unit keeps the
/// leases (3 units) well clear of the server's millisecond clock and the
/// round trips.
async fn subject() -> Option<Subject> {
    let store = store().await?;
    Some(Subject::real(
        StoreRef::new(store),
        Duration::from_millis(250),
    ))
}

idem_tests::conformance_suite!(mysql_store, subject());

fn request(key: &Key, token: Token) -> ClaimRequest<'_> {
    ClaimRequest {
        key,
        token,
        fingerprint: None,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    }
}

fn success(payload: &[u8]) -> Completion<'_> {
    Completion {
        outcome: StoredOutcome::Success,
        payload,
        ttl: Duration::from_secs(3600),
    }
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[idempotent(key = "order_id", ttl = "1h", store = store)]
async fn charge(store: &MySqlStore, order_id: u64, runs: &AtomicUsize) -> Result<u64, AppError> {
    runs.fetch_add(1, SeqCst);
    Ok(order_id)
}

/// A store with one connection, and that connection's id: whatever the store
/// runs, `wait_on_a_lock` can watch.
async fn store_with_one_connection() -> Option<(MySqlStore, u64)> {
    store().await?;
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&services::mysql_url())
        .await
        .unwrap();
    // After opening: migrating closes the connection it used.
    let store = MySqlStore::builder().pool(pool).await.unwrap();
    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    Some((store, id))
}

/// A key completed on the pool, ready to replay.
async fn done_key(store: &MySqlStore, name: &str, payload: &[u8]) -> Key {
    let (key, token) = (fresh_key(name), Token::random());
    assert!(matches!(
        store.claim(request(&key, token)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(store.complete(&key, token, success(payload)).await.unwrap());
    key
}

/// Ends in time or fails the test: a lock wait would otherwise last
/// `innodb_lock_wait_timeout` (50 s) and be retried.
async fn soon<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} waited on a lock"))
}
