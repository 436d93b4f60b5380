use std::str::FromStr;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use sqlx::{MySql, Row as _};

use super::records::is_transient_code;
use super::statements::*;
use super::{MySqlStore, location};
use crate::store::sql::dialect::Dialect;

#[test]
fn deadlocks_and_lock_wait_timeouts_are_retried() {
    assert!(is_transient_code(1213));
    assert!(is_transient_code(1205));
}

#[test]
fn other_errors_are_not_retried() {
    // duplicate key, data too long, NULL into NOT NULL, server gone away
    for n in [1062, 1406, 1048, 2006, 1146] {
        assert!(!is_transient_code(n), "{n}");
    }
    assert!(!MySql::is_retryable(&sqlx::Error::PoolTimedOut));
    assert!(!MySql::is_retryable(&sqlx::Error::Io(
        std::io::Error::other("reset")
    )));
}

#[test]
fn location_never_carries_credentials() {
    let o = MySqlConnectOptions::from_str("mysql://app:s3cret@db.internal:3307/orders").unwrap();
    assert_eq!(location(&o), "db.internal:3307/orders");
    let o = MySqlConnectOptions::new().host("::1").database("d");
    assert_eq!(location(&o), "[::1]:3306/d");
}

/// The purge reads a range of the `expires_at` index, not the table, on a
/// table where nearly every row is live. Needs the test server
/// (`IDEM_MYSQL_URL`); says so and passes without it, unless
/// `IDEM_REQUIRE_SERVICES=1`.
#[tokio::test]
async fn purge_walks_the_expires_at_index() {
    use sqlx::Executor as _;

    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let admin = match MySqlPool::connect(&url).await {
        Ok(pool) => pool,
        Err(e) if std::env::var("IDEM_REQUIRE_SERVICES").is_ok_and(|v| v == "1") => {
            panic!("MariaDB is unreachable: {e}")
        }
        Err(e) => return eprintln!("SKIPPED: MariaDB is unreachable: {e}"),
    };
    let db = format!("idem_plan_{:016x}", rand::random::<u64>());
    admin
        .execute(format!("CREATE DATABASE `{db}`").as_str())
        .await
        .unwrap();
    let options = MySqlConnectOptions::from_str(&url).unwrap().database(&db);
    let store = MySqlStore::builder().connect_with(options).await.unwrap();
    store
        .pool()
        .execute(
            "INSERT INTO idem_records (`key`, state, token, fence, lease_until, expires_at)
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 500)
             SELECT UNHEX(SHA2(i, 256)), 2, UNHEX(MD5(i)), 1, 0,
                    IF(i <= 5, 0, 9000000000000 + i)
             FROM n",
        )
        .await
        .unwrap();
    store
        .pool()
        .execute("ANALYZE TABLE idem_records")
        .await
        .unwrap();
    let plan = sqlx::query(&format!("EXPLAIN {PURGE_SELECT}"))
        .bind(100_i64)
        .fetch_all(store.pool())
        .await
        .unwrap();
    let steps: Vec<(String, Option<String>)> = plan
        .iter()
        .map(|row| {
            let text = |col: &str| {
                row.try_get::<Option<Vec<u8>>, _>(col)
                    .ok()
                    .flatten()
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .or_else(|| row.try_get::<Option<String>, _>(col).ok().flatten())
            };
            (text("type").unwrap_or_default(), text("key"))
        })
        .collect();
    store.pool().close().await;
    admin
        .execute(format!("DROP DATABASE `{db}`").as_str())
        .await
        .unwrap();
    assert_eq!(
        steps,
        vec![(
            "range".to_owned(),
            Some("idem_records_expires_at".to_owned())
        )]
    );
}

#[test]
fn claim_assigns_token_before_the_columns_that_read_it() {
    // The ordering argument in the comment above CLAIM, checked on the text.
    let pos = |col: &str| {
        CLAIM
            .find(&format!("\n    {col:<11} = IF("))
            .unwrap_or_else(|| panic!("{col} assignment"))
    };
    assert!(pos("fence") < pos("taken_over"));
    assert!(pos("taken_over") < pos("token"));
    for col in ["lease_until", "fingerprint", "outcome", "result", "state"] {
        assert!(pos("token") < pos(col), "{col}");
    }
    assert!(pos("state") < pos("expires_at"));
    assert!(!CLAIM.contains("IGNORE"));
    // The one call that sets the insert id, with `upsert`'s LOST.
    assert_eq!(CLAIM.matches("LAST_INSERT_ID(").count(), 1);
    assert!(CLAIM.contains(&format!("fence * 2 + taken_over, {LOST})) > {LOST}, ")));
}
