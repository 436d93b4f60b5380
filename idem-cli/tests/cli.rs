//! The `idem` binary, run as an operator runs it: against SQLite files, a
//! PostgreSQL private schema, a MySQL private database and Redis under a
//! private key prefix, with records written through the `Store` API (and
//! outbox messages through `outbox::put_all` and a `Relay`). Server
//! cases skip loudly when a server is unreachable (fail with
//! `IDEM_REQUIRE_SERVICES=1`).

use std::process::{Command, Output};
use std::str::FromStr;
use std::time::Duration;

use idem_runtime::outbox::sink::MemorySink;
use idem_runtime::outbox::{self, Message, OutboxDatabase, Relay};
use idem_runtime::store::StoreRef;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sql::{MySqlStore, PgStore, SqliteStore};
use idem_runtime::store::{
    Claim, ClaimRequest, Completion, RecoveryArgs, RecoveryTurn, Store, StoredOutcome, Token, Turn,
};
use idem_runtime::{Key, KeySecret};
use serde_json::Value;

fn idem(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args)
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_KEY_SECRET");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("run idem")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(o)))
}

fn random_hex() -> String {
    Token::random().as_bytes()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn required() -> bool {
    std::env::var("IDEM_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

fn skip<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) if required() => panic!("{what} unreachable and IDEM_REQUIRE_SERVICES=1: {e}"),
        Err(e) => {
            eprintln!("SKIPPED: {what} unreachable: {e}");
            None
        }
    }
}

const ORDER: u64 = 734211;

fn order_key() -> Key {
    Key::builder("orders.create")
        .part(&ORDER)
        .part("A-1")
        .finish()
}

fn req(key: &Key, token: Token, lease: Duration) -> ClaimRequest<'_> {
    ClaimRequest {
        key,
        token,
        fingerprint: None,
        lease,
        ttl: Duration::from_secs(3600),
    }
}

/// One DONE record (the order key), one PROCESSING, one released: the same
/// fixture on every store.
async fn fixture(store: &StoreRef) {
    let key = order_key();
    let t = Token::random();
    assert!(matches!(
        store
            .claim(req(&key, t, Duration::from_secs(60)))
            .await
            .unwrap(),
        Claim::Acquired { .. }
    ));
    let done = Completion {
        outcome: StoredOutcome::Success,
        payload: br#"{"id":17,"coupon":"CPN-17"}"#,
        ttl: Duration::from_secs(3600),
    };
    assert!(store.complete(&key, t, done).await.unwrap());
    let running = Key::builder("orders.create").part(&1u64).part("B").finish();
    store
        .claim(req(&running, Token::random(), Duration::from_secs(600)))
        .await
        .unwrap();
    let released = Key::builder("orders.create").part(&2u64).part("C").finish();
    let t = Token::random();
    store
        .claim(req(&released, t, Duration::from_secs(600)))
        .await
        .unwrap();
    assert!(store.release(&released, t).await.unwrap());
}

const PARTS: [&str; 6] = [
    "--scope",
    "orders.create",
    "--part",
    "u64:734211",
    "--part",
    "str:A-1",
];

/// Every command on one store: what the README promises operators.
fn operate(store_url: &str, extra: &[&str]) {
    let with = |args: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = vec!["--store".into(), store_url.into()];
        v.extend(extra.iter().map(|s| s.to_string()));
        v.extend(args.iter().map(|s| s.to_string()));
        v
    };
    let run = |args: &[&str]| {
        let v = with(args);
        idem(&v.iter().map(String::as_str).collect::<Vec<_>>(), &[])
    };

    // inspect, for people
    let o = run(&[&["inspect"][..], &PARTS].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    assert!(table.contains(&order_key().to_hex()), "{table}");
    assert!(
        table.contains("done") && table.contains("CPN-17"),
        "{table}"
    );

    // inspect, for scripts, by parts and by hash
    let o = run(&[&["--json", "inspect"][..], &PARTS].concat());
    let v = json(&o);
    assert_eq!(v["state"], "done");
    assert_eq!(v["outcome"], "success");
    assert_eq!(v["result"]["coupon"], "CPN-17");
    assert_eq!(v["key"], order_key().to_hex());
    let o = run(&["--json", "inspect", "--hash", &order_key().to_hex()]);
    assert_eq!(json(&o)["state"], "done");

    // stats
    let o = run(&["--json", "stats"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = json(&o);
    assert_eq!(
        (&s["processing"], &s["done"], &s["dead"], &s["stalled"]),
        (
            &Value::from(1),
            &Value::from(1),
            &Value::from(1),
            &Value::from(0)
        ),
        "{s}"
    );
    assert!(run(&["stats"]).status.success());

    // a key typed as the wrong type is another key: reported, exit 3
    let o = run(&[
        "inspect",
        "--scope",
        "orders.create",
        "--part",
        "str:734211",
        "--part",
        "str:A-1",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("no record for scope \"orders.create\""),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("type"), "{}", stderr(&o));
    // an unknown scope: the same answer
    let o = run(&[
        "inspect",
        "--scope",
        "orders.craete",
        "--part",
        "u64:734211",
        "--part",
        "str:A-1",
    ]);
    assert_eq!(o.status.code(), Some(3));

    // purge the released record
    let o = run(&["--json", "purge"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(json(&o)["purged"], 1);
    assert_eq!(json(&run(&["--json", "stats"]))["dead"], 0);

    // A live PROCESSING record is not evicted without --force: a body may be
    // running under it.
    let running = [
        "--scope",
        "orders.create",
        "--part",
        "u64:1",
        "--part",
        "str:B",
    ];
    let o = run(&[&["evict"][..], &running].concat());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("live lease"), "{}", stderr(&o));
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    let before = json(&run(&[&["--json", "inspect"][..], &running].concat()));
    assert_eq!(before["state"], "processing", "{before}");
    // Forced: the record stays, ownerless and stalled, with its fence, so the
    // next claim takes it over with a higher one (the conformance suite's
    // `evict_of_a_live_claim_keeps_fences_growing` checks that per store).
    let o = run(&[&["evict", "--force"][..], &running].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let after = json(&run(&[&["--json", "inspect"][..], &running].concat()));
    assert_eq!(after["fence"], before["fence"], "{after}");
    let s = json(&run(&["--json", "stats"]));
    assert_eq!(
        (&s["processing"], &s["stalled"]),
        (&Value::from(0), &Value::from(1)),
        "{s}"
    );

    // evict, then it is gone
    let o = run(&[&["evict"][..], &PARTS].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&[&["inspect"][..], &PARTS].concat());
    assert_eq!(o.status.code(), Some(3));
    let o = run(&[&["evict"][..], &PARTS].concat());
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(json(&run(&["--json", "stats"]))["done"], 0);
}

#[test]
fn key_hash_is_the_attributes() {
    let o = idem(&[&["key"][..], &PARTS].concat(), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), order_key().to_hex());

    let o = idem(
        &[
            "key",
            "--scope",
            "s",
            "--part",
            "i32:-5",
            "--part",
            "bool:true",
            "--part",
            "some:str:x",
            "--part",
            "none",
        ],
        &[],
    );
    let expected = Key::builder("s")
        .part(&-5i32)
        .part(&true)
        .part(&Some("x"))
        .part(&None::<u8>)
        .finish();
    assert_eq!(stdout(&o).trim(), expected.to_hex());

    // Under a key secret, read from IDEM_KEY_SECRET as the service reads it.
    let secret_hex = "42".repeat(32);
    let o = idem(
        &[&["key"][..], &PARTS].concat(),
        &[("IDEM_KEY_SECRET", &secret_hex)],
    );
    let secret = KeySecret::from_hex(&secret_hex).unwrap();
    let keyed = Key::keyed_builder("orders.create", &secret)
        .part(&ORDER)
        .part("A-1")
        .finish();
    assert_eq!(stdout(&o).trim(), keyed.to_hex());
    assert_ne!(keyed, order_key());
}

#[test]
fn bad_arguments_are_explained() {
    let o = idem(&["key", "--scope", "s", "--part", "734211"], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("TYPE:VALUE"), "{}", stderr(&o));
    let o = idem(&["key", "--hash", "abc"], &[]);
    assert_eq!(o.status.code(), Some(1));
    let o = idem(
        &[&["key"][..], &PARTS].concat(),
        &[("IDEM_KEY_SECRET", "not hex")],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let o = idem(&["stats"], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--store"), "{}", stderr(&o));
    let o = idem(&["inspect"], &[]);
    assert_eq!(o.status.code(), Some(2), "usage errors are clap's");
}

#[test]
fn bad_store_urls_fail_clearly() {
    let cases = [
        ("ftp://h/x", "unknown store URL scheme"),
        ("/no/such/idem.db", "no SQLite database"),
        (
            "postgres://u:s3cret@127.0.0.1:1/x",
            "postgres (127.0.0.1:1/x)",
        ),
        ("mysql://u:s3cret@127.0.0.1:1/x", "mysql (127.0.0.1:1/x)"),
        ("redis://:s3cret@127.0.0.1:1", "redis (127.0.0.1:1)"),
        ("postgres://[bad", "postgres"),
        // Mistyped URLs are never taken for a SQLite path and quoted whole.
        ("postgres:/ops:s3cret@db/x", "malformed store URL"),
        ("mysql:ops:s3cret@db/x", "malformed store URL"),
        ("redis:/:s3cret@127.0.0.1", "malformed store URL"),
        ("/data/ops:s3cret@db.sqlite", "no SQLite database"),
    ];
    for (url, says) in cases {
        let o = idem(&["--store", url, "stats"], &[]);
        assert_eq!(o.status.code(), Some(1), "{url}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{url}: {}", stderr(&o));
        assert!(
            !stderr(&o).contains("s3cret"),
            "{url} leaked: {}",
            stderr(&o)
        );
    }
    // IDEM_STORE is read too.
    let o = idem(&["stats"], &[("IDEM_STORE", "ftp://h/x")]);
    assert!(stderr(&o).contains("unknown store URL scheme"));
}

/// A recoverable claim whose lease ran out, parked by a worker: `inspect`
/// shows it parked and why, `recover` clears it (exit 3 on a key with no
/// recoverable call).
async fn parked_claim(store: &StoreRef) -> Key {
    let key = Key::builder("orders.recover")
        .part(&ORDER)
        .part(&random_hex())
        .finish();
    let args = RecoveryArgs {
        scope: "orders.recover",
        args: b"sealed arguments",
    };
    let claimed = store
        .claim_recoverable(req(&key, Token::random(), Duration::from_millis(200)), args)
        .await
        .unwrap();
    let Claim::Acquired { fence, .. } = claimed else {
        panic!("{claimed:?}");
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    let turn = RecoveryTurn {
        fence,
        retry_in: Duration::ZERO,
        max_attempts: 5,
        note: "gave up after 5 recoveries",
        park_now: true,
    };
    assert_eq!(
        store.take_recovery(&key, turn).await.unwrap(),
        Turn::Parked { attempts: 0 }
    );
    key
}

fn recover_a_parked_claim(url: &str, extra: &[&str], key: &Key) {
    let hex = key.to_hex();
    let with = |cmd: &[&str]| {
        let mut args = vec!["--store", url];
        args.extend_from_slice(extra);
        args.extend_from_slice(cmd);
        idem(&args, &[])
    };
    let o = with(&["inspect", "--hash", &hex]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("parked") && out.contains("gave up after 5 recoveries"),
        "{out}"
    );
    assert!(out.contains("for scope orders.recover"), "{out}");
    let o = with(&["--json", "inspect", "--hash", &hex]);
    assert_eq!(json(&o)["recovery"]["parked"], true, "{}", stdout(&o));

    let o = with(&["recover", "--hash", &hex]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("worker takes it up"), "{}", stdout(&o));
    let o = with(&["--json", "inspect", "--hash", &hex]);
    let got = json(&o);
    assert_eq!(got["recovery"]["parked"], false, "{got}");
    assert_eq!(got["recovery"]["attempts"], 0, "{got}");

    let other = Key::builder("orders.recover").part(&1u64).finish().to_hex();
    let o = with(&["recover", "--hash", &other]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("no recoverable call"), "{}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_recover_clears_a_parked_claim() {
    let dir = std::env::temp_dir().join(format!("idem-cli-{}", random_hex()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("idem.db");
    let store = StoreRef::new(SqliteStore::open(&path).await.unwrap());
    let key = parked_claim(&store).await;
    let url = path.to_str().unwrap().to_owned();
    tokio::task::spawn_blocking(move || recover_a_parked_claim(&url, &[], &key))
        .await
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_recover_clears_a_parked_claim() {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let prefix = format!("idem-cli-recover:{}:", random_hex());
    let Some(store) = skip(
        "Redis",
        RedisStore::builder()
            .key_prefix(&prefix)
            .connect(&url)
            .await,
    ) else {
        return;
    };
    let key = parked_claim(&StoreRef::new(store)).await;
    tokio::task::spawn_blocking(move || {
        recover_a_parked_claim(&url, &["--redis-prefix", &prefix], &key)
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_file() {
    let dir = std::env::temp_dir().join(format!("idem-cli-{}", random_hex()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("idem.db");
    let store = StoreRef::new(SqliteStore::open(&path).await.unwrap());
    fixture(&store).await;
    let url = path.to_str().unwrap().to_owned();
    tokio::task::spawn_blocking(move || operate(&url, &[]))
        .await
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

/// The DBA path: `idem schema` applied by hand, then a store that runs no
/// DDL works on it, and a store with migrations on finds nothing to do.
#[tokio::test(flavor = "multi_thread")]
async fn sqlite_schema_applied_by_hand() {
    let o = idem(&["schema", "--dialect", "sqlite"], &[]);
    assert!(o.status.success());
    let sql = stdout(&o);
    let dir = std::env::temp_dir().join(format!("idem-cli-{}", random_hex()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dba.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::raw_sql(&sql).execute(&pool).await.unwrap();
    sqlx::raw_sql(&sql)
        .execute(&pool)
        .await
        .expect("twice is harmless");
    let store = SqliteStore::builder()
        .skip_migrations()
        .open(&path)
        .await
        .unwrap();
    let key = order_key();
    assert!(matches!(
        store
            .claim(req(&key, Token::random(), Duration::from_secs(5)))
            .await
            .unwrap(),
        Claim::Acquired { .. }
    ));
    SqliteStore::open(&path)
        .await
        .expect("migrations find it applied");
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM idem_schema_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    // The records table, the outbox's and recovery's: `schema` prints every
    // migration, and the store re-applied none of them.
    assert_eq!(n, 3);
    assert!(sql.contains("idem_outbox"), "{sql}");
    assert!(sql.contains("idem_recovery"), "{sql}");
    // `schema` follows --store's dialect; Redis has none.
    let o = idem(&["--store", "postgres://h/x", "schema"], &[]);
    assert!(stdout(&o).contains("BYTEA"));
    let o = idem(&["--store", "redis://h", "schema"], &[]);
    assert_eq!(o.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).ok();
}

fn pg_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A schema of the test's own on PostgreSQL: the admin pool, its name, and
/// a URL whose `search_path` is it.
async fn pg_private_schema(tag: &str) -> Option<(sqlx::PgPool, String, String)> {
    let admin = skip("PostgreSQL", sqlx::PgPool::connect(&pg_url()).await)?;
    let schema = format!("idem_cli_{tag}{}", random_hex());
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await
        .unwrap();
    Some((admin, schema.clone(), pg_url_in(&schema)))
}

/// The PostgreSQL URL with `search_path` set to `schema`.
fn pg_url_in(schema: &str) -> String {
    let sep = if pg_url().contains('?') { '&' } else { '?' };
    format!("{}{sep}options[search_path]={schema}", pg_url())
}

async fn drop_schema(admin: &sqlx::PgPool, schema: &str) {
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(admin)
        .await
        .unwrap();
}

/// A database of the test's own on MySQL: the admin pool, its name, its
/// connect options and its URL.
async fn mysql_private_database_of(
    tag: &str,
) -> Option<(
    sqlx::MySqlPool,
    String,
    sqlx::mysql::MySqlConnectOptions,
    String,
)> {
    let base = mysql_base();
    let admin = skip("MySQL", sqlx::MySqlPool::connect(&base).await)?;
    let db = format!("idem_cli_{tag}{}", random_hex());
    sqlx::raw_sql(&format!("CREATE DATABASE `{db}`"))
        .execute(&admin)
        .await
        .unwrap();
    let options = sqlx::mysql::MySqlConnectOptions::from_str(&base)
        .unwrap()
        .database(&db);
    let (prefix, _) = base.rsplit_once('/').unwrap();
    let url = format!("{prefix}/{db}");
    Some((admin, db, options, url))
}

async fn drop_database(admin: &sqlx::MySqlPool, db: &str) {
    sqlx::raw_sql(&format!("DROP DATABASE `{db}`"))
        .execute(admin)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_private_schema() {
    let Some((admin, schema, url)) = pg_private_schema("").await else {
        return;
    };
    let store = StoreRef::new(PgStore::connect(&url).await.unwrap());
    fixture(&store).await;
    tokio::task::spawn_blocking(move || operate(&url, &[]))
        .await
        .unwrap();
    // The table missing (another schema): a hint, not just the SQL error.
    let empty = format!("idem_cli_empty_{}", random_hex());
    sqlx::query(&format!("CREATE SCHEMA {empty}"))
        .execute(&admin)
        .await
        .unwrap();
    let o = idem(&["--store", &pg_url_in(&empty), "stats"], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("idem schema"), "{}", stderr(&o));
    for s in [schema, empty] {
        drop_schema(&admin, &s).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn mysql_private_database() {
    let Some((admin, db, options, url)) = mysql_private_database_of("").await else {
        return;
    };
    let store = StoreRef::new(MySqlStore::builder().connect_with(options).await.unwrap());
    fixture(&store).await;
    tokio::task::spawn_blocking(move || operate(&url, &[]))
        .await
        .unwrap();
    drop_database(&admin, &db).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_private_prefix() {
    let url = redis_url();
    let prefix = format!("idem-cli:{}:", random_hex());
    let Some(store) = skip(
        "Redis",
        RedisStore::builder()
            .key_prefix(prefix.clone())
            .connect(&url)
            .await,
    ) else {
        return;
    };
    let store = StoreRef::new(store);
    fixture(&store).await;
    let u = url.clone();
    let p = prefix.clone();
    tokio::task::spawn_blocking(move || operate(&u, &["--redis-prefix", &p]))
        .await
        .unwrap();
    // Another prefix sees none of them.
    let o = idem(
        &[
            "--store",
            &url,
            "--redis-prefix",
            "idem-cli:none:",
            "--json",
            "stats",
        ],
        &[],
    );
    assert_eq!(json(&o)["processing"], 0);
    // Clean up the PROCESSING record.
    let running = Key::builder("orders.create").part(&1u64).part("B").finish();
    store.evict(&running).await.unwrap();
}

// ---- idem outbox ----

fn mysql_base() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A SQLite file migrated by its store, so the outbox table exists.
async fn migrated_sqlite() -> (std::path::PathBuf, String, sqlx::SqlitePool) {
    let dir = std::env::temp_dir().join(format!("idem-cli-outbox-{}", random_hex()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("idem.db");
    let store = SqliteStore::open(&path).await.unwrap();
    let url = path.to_str().unwrap().to_owned();
    (dir, url, store.pool().clone())
}

async fn write<DB: OutboxDatabase>(pool: &sqlx::Pool<DB>, messages: Vec<Message>) {
    let mut tx = pool.begin().await.unwrap();
    outbox::put_all(&mut tx, messages).await.unwrap();
    tx.commit().await.unwrap();
}

/// The same outbox on every SQL store: on `orders.created` two messages sent,
/// one parked (its broker was down, one attempt allowed) and one pending with
/// an ordering key; on `stock.reserved` one pending.
async fn outbox_fixture<DB: OutboxDatabase>(pool: &sqlx::Pool<DB>) {
    let json = |id: &str, topic: &str| Message::bytes(topic, br#"{"n":1}"#.to_vec()).id(id);
    write(
        pool,
        vec![
            json("m-sent-1", "orders.created"),
            json("m-sent-2", "orders.created"),
        ],
    )
    .await;
    let (up, mut rx) = MemorySink::channel(16);
    let round = Relay::builder(pool.clone(), up)
        .build()
        .run_once()
        .await
        .unwrap();
    assert_eq!(round.published, 2, "{round:?}");
    assert_eq!(rx.recv().await.unwrap().id.as_str(), "m-sent-1");

    write(pool, vec![json("m-park", "orders.created")]).await;
    let (down, _rx) = MemorySink::channel(16);
    down.set_down(true);
    let round = Relay::builder(pool.clone(), down)
        .max_attempts(1)
        .build()
        .run_once()
        .await
        .unwrap();
    assert_eq!(round.parked, 1, "{round:?}");

    write(
        pool,
        vec![
            json("m-pend-1", "stock.reserved"),
            json("m-pend-2", "orders.created").ordering_key("order-7"),
        ],
    )
    .await;
}

/// Every outbox command on one database.
fn operate_outbox(store_url: &str) {
    let run = |args: &[&str]| {
        let mut v = vec!["--store", store_url];
        v.extend_from_slice(args);
        idem(&v, &[])
    };
    let counts = |s: &Value| (s["pending"].clone(), s["parked"].clone(), s["sent"].clone());
    let n = |pending: u64, parked: u64, sent: u64| {
        (Value::from(pending), Value::from(parked), Value::from(sent))
    };

    let o = run(&["--json", "outbox", "stats"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = json(&o);
    assert_eq!(counts(&s), n(2, 1, 2), "{s}");
    assert_eq!(counts(&s["topics"]["orders.created"]), n(1, 1, 2), "{s}");
    assert_eq!(counts(&s["topics"]["stock.reserved"]), n(1, 0, 0), "{s}");
    assert!(s["oldest_pending_ms"].is_u64(), "{s}");
    let o = run(&["outbox", "stats"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("orders.created"), "{}", stdout(&o));

    // Parked by default, with why.
    let o = run(&["outbox", "list"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    assert!(
        table.contains("m-park") && table.contains("the sink is down"),
        "{table}"
    );
    assert!(!table.contains("m-pend-1"), "{table}");
    let o = run(&["--json", "outbox", "list", "--state", "parked"]);
    let v = json(&o);
    assert_eq!(v["state"], "parked");
    let parked = v["messages"].as_array().unwrap();
    assert_eq!(parked.len(), 1, "{v}");
    assert_eq!(parked[0]["id"], "m-park");
    assert_eq!(parked[0]["topic"], "orders.created");
    assert_eq!(parked[0]["attempts"], 1);
    assert_eq!(parked[0]["payload_bytes"], 7);
    assert!(
        parked[0]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("the sink is down")),
        "{v}"
    );
    let v = json(&run(&["--json", "outbox", "list", "--state", "pending"]));
    let ids: Vec<&str> = v["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m-pend-1", "m-pend-2"], "{v}");
    assert_eq!(v["messages"][1]["ordering_key"], "order-7", "{v}");
    let v = json(&run(&[
        "--json", "outbox", "list", "--state", "sent", "--limit", "1",
    ]));
    assert_eq!(v["messages"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(
        run(&["outbox", "list", "--state", "gone"]).status.code(),
        Some(2)
    );

    // retry: parked becomes pending; unknown or sent ids are "no record".
    let o = run(&["outbox", "retry", "m-park"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        counts(&json(&run(&["--json", "outbox", "stats"]))),
        n(3, 0, 2)
    );
    let o = run(&["outbox", "retry", "m-nope"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("no unsent message"), "{}", stderr(&o));
    let o = run(&["--json", "outbox", "retry", "m-sent-1"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert_eq!(json(&o)["retried"], false);

    // purge: only sent messages, only those old enough.
    let o = run(&["--json", "outbox", "purge"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(json(&o)["purged"], 0);
    let o = run(&[
        "--json",
        "outbox",
        "purge",
        "--older-than",
        "0s",
        "--limit",
        "1",
    ]);
    assert_eq!(json(&o)["purged"], 1, "{}", stderr(&o));
    let o = run(&["outbox", "purge", "--older-than", "0s"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("purged 1 "), "{}", stdout(&o));
    assert_eq!(
        counts(&json(&run(&["--json", "outbox", "stats"]))),
        n(3, 0, 0)
    );
    let o = run(&["outbox", "purge", "--older-than", "3 weeks"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_sqlite_file() {
    let (dir, url, pool) = migrated_sqlite().await;
    outbox_fixture(&pool).await;
    tokio::task::spawn_blocking(move || operate_outbox(&url))
        .await
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_postgres_private_schema() {
    let Some((admin, schema, url)) = pg_private_schema("outbox_").await else {
        return;
    };
    let store = PgStore::connect(&url).await.unwrap();
    outbox_fixture(store.pool()).await;
    store.pool().close().await;
    tokio::task::spawn_blocking(move || operate_outbox(&url))
        .await
        .unwrap();
    drop_schema(&admin, &schema).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_mysql_private_database() {
    let Some((admin, db, options, url)) = mysql_private_database_of("outbox_").await else {
        return;
    };
    let store = MySqlStore::builder().connect_with(options).await.unwrap();
    outbox_fixture(store.pool()).await;
    store.pool().close().await;
    tokio::task::spawn_blocking(move || operate_outbox(&url))
        .await
        .unwrap();
    drop_database(&admin, &db).await;
}

/// `idem outbox relay` as a service runs it: a child process, stopped by
/// SIGTERM once the stream has the messages.
#[tokio::test(flavor = "multi_thread")]
async fn outbox_relay_to_redis_streams() {
    let Some(client) = skip("Redis", redis::Client::open(redis_url())) else {
        return;
    };
    let Some(mut conn) = skip("Redis", client.get_multiplexed_async_connection().await) else {
        return;
    };
    let (dir, url, pool) = migrated_sqlite().await;
    let topic = format!("idem-cli-outbox:{}", random_hex());
    write(
        &pool,
        (1..=3)
            .map(|i| Message::bytes(&topic, format!("{{\"n\":{i}}}")).id(format!("r-{i}")))
            .collect(),
    )
    .await;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "--store",
            &url,
            "--json",
            "outbox",
            "relay",
            "--to",
            &redis_url(),
        ])
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_RELAY_TO")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start idem outbox relay");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut len = 0u64;
    while std::time::Instant::now() < deadline {
        len = redis::cmd("XLEN")
            .arg(&topic)
            .query_async(&mut conn)
            .await
            .unwrap();
        if len >= 3 || child.try_wait().unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = child.id().to_string();
    let stopped = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .is_ok_and(|s| s.success());
    // Bounded: a relay that ignored SIGTERM is killed, and the test fails.
    let mut exited = None;
    for _ in 0..200 {
        exited = child.try_wait().unwrap();
        if exited.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if exited.is_none() {
        child.kill().ok();
    }
    let out = child.wait_with_output().unwrap();
    let _: () = redis::cmd("DEL")
        .arg(&topic)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(len, 3, "stream length; relay said: {}", stderr(&out));
    assert!(
        stopped && exited.is_some_and(|s| s.success()),
        "{exited:?}: {}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("relaying the outbox to redis ("),
        "{}",
        stderr(&out)
    );
    // Stopped cleanly: its counts, on stdout.
    let stats = json(&out);
    assert_eq!(stats["published"], 3, "{stats}");
    let o = idem(&["--store", &url, "--json", "outbox", "stats"], &[]);
    let s = json(&o);
    assert_eq!(
        (&s["pending"], &s["sent"]),
        (&Value::from(0), &Value::from(3)),
        "{s}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_refusals_are_explained() {
    // Only the SQL stores have an outbox.
    let o = idem(
        &["--store", "redis://127.0.0.1:6379", "outbox", "stats"],
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the outbox lives in a SQL database"),
        "{}",
        stderr(&o)
    );
    let o = idem(&["outbox", "stats"], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--store"), "{}", stderr(&o));

    let (dir, url, _pool) = migrated_sqlite().await;
    let cases = [
        ("foo://x", "unknown --to URL scheme \"foo\""),
        ("redis:/:s3cret@127.0.0.1", "malformed --to URL"),
        ("s3cret", "--to must be a broker URL"),
        ("rediss://:s3cret@127.0.0.1", "TLS"),
        // Nothing listens on port 1.
        (
            "redis://:s3cret@127.0.0.1:1",
            "cannot relay to redis (127.0.0.1:1)",
        ),
        (
            "amqp://u:s3cret@127.0.0.1:1/%2f",
            "cannot relay to amqp (127.0.0.1:1)",
        ),
    ];
    for (to, says) in cases {
        let o = idem(&["--store", &url, "outbox", "relay", "--to", to], &[]);
        assert_eq!(o.status.code(), Some(1), "{to}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{to}: {}", stderr(&o));
        assert!(
            !stderr(&o).contains("s3cret"),
            "{to} leaked: {}",
            stderr(&o)
        );
    }
    let o = idem(&["--store", &url, "outbox", "relay"], &[]);
    assert_eq!(o.status.code(), Some(2), "--to is required");

    // A database without the outbox table: a hint, not just the SQL error.
    let bare = dir.join("bare.db");
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}?mode=rwc", bare.display()))
        .await
        .unwrap();
    sqlx::query("CREATE TABLE t (x INTEGER)")
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    for args in [
        &["outbox", "stats"][..],
        &["outbox", "relay", "--to", "redis://127.0.0.1:1"],
    ] {
        let mut v = vec!["--store", bare.to_str().unwrap()];
        v.extend_from_slice(args);
        let o = idem(&v, &[]);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("no outbox table"), "{}", stderr(&o));
        assert!(stderr(&o).contains("idem schema"), "{}", stderr(&o));
    }
    std::fs::remove_dir_all(&dir).ok();
}
