//! Migrations: from several processes at once under `GET_LOCK`, and none at
//! all with `skip_migrations`.

use std::str::FromStr;

use idem_runtime::store::sql::MySqlStore;
use idem_runtime::store::{Claim, Store, Token};
use idem_tests::conformance::fresh_key;
use idem_tests::services;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

use crate::{request, store};

/// Four processes opening a fresh database at once: every one succeeds (they
/// take turns under `GET_LOCK`; without it two would race to insert the same
/// ledger row), the migration is recorded once, and the table works.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_are_harmless() {
    let Some(admin) = store().await else { return };
    let database = format!(
        "idem_migrate_{:016x}",
        u64::from_le_bytes(Token::random().as_bytes()[..8].try_into().unwrap())
    );
    sqlx::raw_sql(&format!("CREATE DATABASE `{database}`"))
        .execute(admin.pool())
        .await
        .expect("the test user may create a scratch database");
    let options = MySqlConnectOptions::from_str(&services::mysql_url())
        .unwrap()
        .database(&database);
    let open = || MySqlStore::builder().connect_with(options.clone());
    let (s1, s2, s3, s4) = tokio::join!(open(), open(), open(), open());
    let stores = [s1, s2, s3, s4].map(|s| s.expect("a concurrent migration failed"));

    let (rows, version): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), MAX(version) FROM idem_schema_migrations")
            .fetch_one(stores[0].pool())
            .await
            .unwrap();
    assert_eq!((rows, version), (4, 4), "every migration, once");
    stores[1]
        .migrate()
        .await
        .expect("migrating again is a no-op");

    let key = fresh_key("mysql-migrated");
    assert!(matches!(
        stores[2]
            .claim(request(&key, Token::random()))
            .await
            .unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(matches!(
        stores[3]
            .claim(request(&key, Token::random()))
            .await
            .unwrap(),
        Claim::Busy { .. }
    ));

    for s in &stores {
        s.pool().close().await;
    }
    sqlx::raw_sql(&format!("DROP DATABASE `{database}`"))
        .execute(admin.pool())
        .await
        .unwrap();
}

/// With `skip_migrations` the store runs no DDL: on a database whose table
/// was created by hand (by whoever may), it works, and no ledger appears.
#[tokio::test]
async fn a_store_that_skips_migrations_runs_no_ddl() {
    let Some(admin) = store().await else { return };
    let name = format!(
        "idem_skipmig_{:016x}",
        u64::from_le_bytes(Token::random().as_bytes()[..8].try_into().unwrap())
    );
    sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
        .execute(admin.pool())
        .await
        .expect("the test user may create a scratch database");
    let options = MySqlConnectOptions::from_str(&services::mysql_url())
        .unwrap()
        .database(&name);
    let by_hand = MySqlPoolOptions::new()
        .connect_with(options.clone())
        .await
        .unwrap();
    sqlx::raw_sql(include_str!(
        "../../idem-runtime/migrations/mysql/0001_create_records.sql"
    ))
    .execute(&by_hand)
    .await
    .expect("the schema, applied by hand");
    by_hand.close().await;
    let store = MySqlStore::builder()
        .skip_migrations()
        .connect_with(options)
        .await
        .expect("open without migrating");
    let key = fresh_key("skip-migrations");
    let claimed = store.claim(request(&key, Token::random())).await.unwrap();
    assert!(matches!(claimed, Claim::Acquired { .. }), "{claimed:?}");
    let ledgers: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables
         WHERE table_schema = ? AND table_name = 'idem_schema_migrations'",
    )
    .bind(&name)
    .fetch_one(admin.pool())
    .await
    .unwrap();
    store.pool().close().await;
    sqlx::raw_sql(&format!("DROP DATABASE `{name}`"))
        .execute(admin.pool())
        .await
        .unwrap();
    assert_eq!(
        ledgers, 0,
        "a store told to skip migrations created the ledger"
    );
}
