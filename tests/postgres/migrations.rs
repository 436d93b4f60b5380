//! Migrations: from several stores at once, none at all with
//! `skip_migrations`, and futures that can be spawned.

use std::time::Duration;

use idem_runtime::store::sql::PgStore;
use idem_runtime::store::{Claim, Store, Token};
use idem_tests::conformance::fresh_key;
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use crate::{Schema, request};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrating_twice_and_from_several_stores_at_once_is_harmless() {
    let Some(schema) = Schema::create("migrate").await else {
        return;
    };
    // Four processes starting at once on an empty schema.
    let opening: Vec<_> = (0..4)
        .map(|_| {
            let options = schema.options.clone();
            tokio::spawn(async move {
                PgStore::builder()
                    .max_connections(2)
                    .connect_with(options)
                    .await
            })
        })
        .collect();
    let mut stores = Vec::new();
    for t in opening {
        stores.push(t.await.unwrap().expect("every store opens"));
    }
    stores[0].migrate().await.expect("migrating again");
    stores[3].migrate().await.expect("and again");

    let ledger: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT version, description FROM {}.idem_schema_migrations ORDER BY version",
        schema.name
    ))
    .fetch_all(&schema.admin)
    .await
    .unwrap();
    assert_eq!(
        ledger,
        vec![
            (1, "create idem_records".to_owned()),
            (2, "create idem_outbox".to_owned()),
            (3, "create idem_recovery".to_owned()),
            (4, "leave room for completions in idem_records".to_owned()),
            (5, "outbox writers wake relays without a trigger".to_owned())
        ]
    );
    let indexed: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND indexname = 'idem_records_expires_at')",
    )
    .bind(&schema.name)
    .fetch_one(&schema.admin)
    .await
    .unwrap();
    assert!(indexed);
    // Room on each page for the completion to rewrite a record in place.
    let options: Option<Vec<String>> = sqlx::query_scalar(
        "SELECT c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND c.relname = 'idem_records'",
    )
    .bind(&schema.name)
    .fetch_one(&schema.admin)
    .await
    .unwrap();
    assert_eq!(options, Some(vec!["fillfactor=80".to_owned()]));

    let key = fresh_key("migrated");
    let claim = stores[1]
        .claim(request(&key, Token::random(), Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }));
    assert_eq!(schema.count("idem_records").await, 1);
    for s in &stores {
        s.pool().close().await;
    }
    schema.drop().await;
}

/// With `skip_migrations` the store runs no DDL: on a schema whose table was
/// created by hand (by whoever may), it works, and no ledger appears.
#[tokio::test]
async fn a_store_that_skips_migrations_runs_no_ddl() {
    let Some(schema) = Schema::create("skipmig").await else {
        return;
    };
    let by_hand = PgPool::connect_with(schema.options.clone()).await.unwrap();
    sqlx::raw_sql(include_str!(
        "../../idem-runtime/migrations/postgres/0001_create_records.sql"
    ))
    .execute(&by_hand)
    .await
    .expect("the schema, applied by hand");
    by_hand.close().await;
    let store = PgStore::builder()
        .skip_migrations()
        .connect_with(schema.options.clone())
        .await
        .expect("open without migrating");
    let key = fresh_key("skip-migrations");
    let claimed = store
        .claim(request(&key, Token::random(), Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(matches!(claimed, Claim::Acquired { .. }), "{claimed:?}");
    let ledger: bool = sqlx::query_scalar(&format!(
        "SELECT to_regclass('{}.idem_schema_migrations') IS NOT NULL",
        schema.name
    ))
    .fetch_one(&schema.admin)
    .await
    .unwrap();
    assert!(
        !ledger,
        "a store told to skip migrations created the ledger"
    );
    store.pool().close().await;
    schema.drop().await;
}

/// Opening and migrating can be spawned: their futures are `Send` for any
/// lifetime, which sqlx's lifetime-generic executors make easy to lose.
#[allow(dead_code)]
fn opening_and_migrating_can_be_spawned(url: String, options: PgConnectOptions, pool: PgPool) {
    fn send<T: Send>(_: T) {}
    let store = async move {
        let a = PgStore::connect(&url).await?;
        let b = PgStore::builder().connect_with(options).await?;
        let c = PgStore::builder().pool(pool).await?;
        a.migrate().await?;
        Ok::<_, idem_runtime::StoreError>((a, b, c))
    };
    send(store);
}

/// The README's way to keep idem's tables in a schema of their own: the
/// store connects with that schema as its `search_path` (written in the URL)
/// and creates its tables there, and the application's connections reach
/// them through their own `search_path`, so a claim on the application's
/// transaction (`tx = tx`) lands in the same table.
#[tokio::test]
async fn a_search_path_in_the_url_keeps_the_tables_in_their_own_schema() {
    let Some(idem) = Schema::create("url_idem").await else {
        return;
    };
    let app = Schema::create("url_app").await.expect("a second schema");
    let base = idem_tests::services::postgres_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}options=-c%20search_path%3D{}", idem.name);
    let store = PgStore::connect(&url).await.expect("store");
    let found: Option<String> = sqlx::query_scalar(&format!(
        "SELECT to_regclass('{}.idem_records')::text",
        idem.name
    ))
    .fetch_one(&idem.admin)
    .await
    .unwrap();
    assert!(found.is_some(), "idem_records is not in {}", idem.name);

    // The application's pool: its own schema first, idem's after it.
    let app_url = format!(
        "{base}{sep}options=-c%20search_path%3D{},{}",
        app.name, idem.name
    );
    let pool = PgPool::connect(&app_url).await.expect("app pool");
    let key = fresh_key("url_path");
    let mut tx = pool.begin().await.unwrap();
    let claim = idem_runtime::store::tx::TxConnection::claim(
        &mut *tx,
        request(&key, Token::random(), Duration::from_secs(30)),
    )
    .await
    .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    tx.commit().await.unwrap();
    assert_eq!(idem.count("idem_records").await, 1);
    assert!(store.inspect(&key).await.unwrap().is_some());
    pool.close().await;
    drop(store);
    app.drop().await;
    idem.drop().await;
}
