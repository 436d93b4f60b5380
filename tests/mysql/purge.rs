//! Purging: bounded batches that skip locked rows and wait for no claim, in a
//! database of the test's own.

use std::str::FromStr;
use std::time::Duration;

use idem_runtime::store::sql::MySqlStore;
use idem_runtime::store::tx::{AsTxConnection, TxConnection};
use idem_runtime::store::{Claim, Completion, Store, Token};
use idem_tests::conformance::fresh_key;
use idem_tests::services;
use sqlx::mysql::MySqlConnectOptions;

use crate::{done_key, request, soon, store, success};

/// A database of one's own, for tests that count or delete table-wide.
struct Database {
    name: String,
    admin: MySqlStore,
    store: MySqlStore,
}

impl Database {
    async fn create(tag: &str) -> Option<Database> {
        let admin = store().await?;
        let name = format!(
            "idem_{tag}_{:016x}",
            u64::from_le_bytes(Token::random().as_bytes()[..8].try_into().unwrap())
        );
        sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
            .execute(admin.pool())
            .await
            .expect("the test user may create a scratch database");
        let options = MySqlConnectOptions::from_str(&services::mysql_url())
            .unwrap()
            .database(&name);
        let store = MySqlStore::builder()
            .connect_with(options)
            .await
            .expect("open the scratch database");
        Some(Database { name, admin, store })
    }

    async fn count(&self) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM `{}`.idem_records",
            self.name
        ))
        .fetch_one(self.admin.pool())
        .await
        .unwrap()
    }

    async fn drop(self) {
        self.store.pool().close().await;
        sqlx::raw_sql(&format!("DROP DATABASE `{}`", self.name))
            .execute(self.admin.pool())
            .await
            .unwrap();
    }
}

/// Purging takes bounded batches of dead records (released ones included), in
/// index order, and waits on nothing: not on a live row an open transaction
/// holds, not on a dead one another transaction has locked (it is skipped and
/// goes in a later batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purging_is_bounded_skips_locked_rows_and_waits_for_no_claim() {
    let Some(db) = Database::create("purge").await else {
        return;
    };
    let store = &db.store;
    for _ in 0..6 {
        let (key, token) = (fresh_key("dead"), Token::random());
        store.claim(request(&key, token)).await.unwrap();
        let short = Completion {
            ttl: Duration::from_millis(1),
            ..success(b"d")
        };
        assert!(store.complete(&key, token, short).await.unwrap());
    }
    let (released, token) = (fresh_key("released"), Token::random());
    store.claim(request(&released, token)).await.unwrap();
    assert!(store.release(&released, token).await.unwrap());
    let live = done_key(store, "live", b"l").await;
    tokio::time::sleep(Duration::from_millis(20)).await;

    // An open transaction claims a new key (its row stays locked), and another
    // holds one dead row.
    let mut claiming = store.pool().begin().await.unwrap();
    let claim = claiming
        .tx_connection()
        .claim(request(&fresh_key("claiming"), Token::random()))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    let mut holder = store.pool().begin().await.unwrap();
    let held: Vec<u8> = sqlx::query_scalar(
        "SELECT `key` FROM idem_records WHERE state = 2 ORDER BY expires_at LIMIT 1 FOR UPDATE",
    )
    .fetch_one(&mut *holder)
    .await
    .unwrap();

    let mut batches = Vec::new();
    loop {
        let n = soon("purging", store.purge_expired(3)).await.unwrap();
        batches.push(n);
        if n < 3 {
            break;
        }
    }
    // 6 dead + 1 released, less the held one, 3 at a time.
    assert_eq!(batches, vec![3, 3, 0]);
    holder.commit().await.unwrap();
    assert_eq!(soon("purging", store.purge_expired(3)).await.unwrap(), 1);
    let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_records WHERE `key` = ?")
        .bind(&held)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(left, 0, "the held row went last");
    claiming.rollback().await.unwrap();
    assert_eq!(db.count().await, 1, "only the live record is left");
    assert!(store.inspect(&live).await.unwrap().is_some());
    db.drop().await;
}
