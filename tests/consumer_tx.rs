//! `Runner::run_in_tx` / `process_in_tx`: the runner begins a transaction per
//! delivery, the handler's `tx = tx` call records on it, and the runner
//! commits on `Ok` (then acks) or rolls back on `Err`, a panic or a failed
//! commit (then redelivers). Deliveries are in-process (`testing::Memory`);
//! the broker adapters are covered by the consumer suites.
//!
//! SQLite runs here with no server; PostgreSQL (a commit that fails on a
//! deferred constraint) against the local server, failed under
//! IDEM_REQUIRE_SERVICES=1 when unreachable.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_runtime::Key;
use idem_runtime::consumer::testing::Memory;
use idem_runtime::consumer::{Acked, Action, BrokerError, Runner, Source};
use idem_runtime::idempotent;
use idem_runtime::store::sql::SqliteStore;
use idem_runtime::store::{RecordState, Store};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};

#[derive(Debug, thiserror::Error)]
enum SettleError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("the bank refused")]
    Refused,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: String,
    amount_cents: i64,
    /// Makes the handler fail after its write: `"err"` or `"panic"`.
    #[serde(default)]
    fail: Option<String>,
}

const SCOPE: &str = "tests.consumer_tx.settle";

/// Writes the settlement on the runner's transaction; the record rides along.
#[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "tests.consumer_tx.settle", tx = tx)]
async fn settle(tx: &mut Transaction<'_, Sqlite>, e: OrderPaid) -> Result<(), SettleError> {
    sqlx::query("INSERT INTO settlements (order_id, amount_cents) VALUES (?1, ?2)")
        .bind(&e.order_id)
        .bind(e.amount_cents)
        .execute(&mut **tx)
        .await?;
    if e.fail.as_deref() == Some("sqlite-rollback") {
        // A statement whose conflict clause is ROLLBACK: SQLite ends the
        // whole transaction itself, and the handler swallows the error.
        let failed = sqlx::query("INSERT INTO guard (k) VALUES ('taken')")
            .execute(&mut **tx)
            .await;
        assert!(failed.is_err());
    }
    match e.fail.as_deref() {
        Some("err") => Err(SettleError::Refused),
        Some("panic") => panic!("the handler blew up after its write"),
        _ => Ok(()),
    }
}

async fn sqlite() -> SqliteStore {
    let store = SqliteStore::in_memory().await.expect("in-memory sqlite");
    // No unique key: a second run of the body would be a second row.
    sqlx::query("CREATE TABLE settlements (order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    store
}

async fn rows(store: &SqliteStore, order_id: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM settlements WHERE order_id = ?1")
        .bind(order_id)
        .fetch_one(store.pool())
        .await
        .unwrap()
}

fn payload(order_id: &str, fail: Option<&str>) -> Vec<u8> {
    serde_json::to_vec(&OrderPaid {
        order_id: order_id.to_owned(),
        amount_cents: 1250,
        fail: fail.map(str::to_owned),
    })
    .unwrap()
}

fn key(order_id: &str) -> Key {
    Key::builder(SCOPE).part("SETTLE").part(order_id).finish()
}

fn runner() -> Runner {
    Runner::new()
        .max_deliveries(3)
        .backoff(Duration::from_millis(10), Duration::from_millis(10))
}

fn handler<'t>(
    tx: &'t mut Transaction<'static, Sqlite>,
    e: OrderPaid,
) -> futures_util::future::BoxFuture<'t, Result<(), SettleError>> {
    Box::pin(settle(tx, e))
}

/// A delivery whose transaction does not last (`fail` tells the handler how
/// to end it) is retried, not acked, and the last one parks saying `why`.
async fn not_acked_and_parked<DB, H>(
    pool: &sqlx::Pool<DB>,
    handler: &H,
    order_id: &str,
    fail: &str,
    why: &str,
) where
    DB: sqlx::Database,
    DB::Connection: idem_runtime::store::tx::TxConnection,
    H: for<'t> Fn(
        &'t mut Transaction<'static, DB>,
        OrderPaid,
    ) -> futures_util::future::BoxFuture<'t, Result<(), SettleError>>,
{
    let runner = runner();
    let delivery = Memory::new(&payload(order_id, Some(fail)));
    let log = delivery.log();
    let action = runner.process_in_tx(delivery, pool, handler).await.unwrap();
    assert!(
        matches!(action, Action::Retried { attempt: 1, .. }),
        "{action:?}"
    );
    assert!(log.lock().unwrap()[0].starts_with("retry"), "{log:?}");
    let last = Memory::new(&payload(order_id, Some(fail))).attempt(3);
    let action = runner.process_in_tx(last, pool, handler).await.unwrap();
    let Action::Parked { reason } = action else {
        panic!("parked at max_deliveries: {action:?}")
    };
    assert!(reason.contains(why), "{reason}");
}

#[tokio::test]
async fn ok_commits_the_write_and_the_record_then_acks_and_a_duplicate_replays() {
    let store = sqlite().await;
    let runner = runner();
    let delivery = Memory::new(&payload("o-ok", None));
    let log = delivery.log();
    let action = runner
        .process_in_tx(delivery, store.pool(), &handler)
        .await
        .unwrap();
    assert_eq!(action, Action::Acked(Acked::Processed));
    assert_eq!(*log.lock().unwrap(), ["ack"]);
    // Committed: the row and the record are visible on another connection.
    assert_eq!(rows(&store, "o-ok").await, 1);
    let record = store
        .inspect(&key("o-ok"))
        .await
        .unwrap()
        .expect("a record");
    assert_eq!(record.state, RecordState::Done);

    let again = runner
        .process_in_tx(Memory::new(&payload("o-ok", None)), store.pool(), &handler)
        .await
        .unwrap();
    assert_eq!(again, Action::Acked(Acked::Deduplicated));
    assert_eq!(rows(&store, "o-ok").await, 1);
    let stats = runner.stats();
    assert_eq!((stats.processed, stats.deduplicated), (1, 1));
}

/// A transaction SQLite ended by itself under the handler (a conflict
/// clause of ROLLBACK; SQLite does the same on some I/O, full-disk and busy
/// errors), the handler swallowing the error: not acked, nothing of it
/// lasted, and the redelivery settles the order once.
#[tokio::test]
async fn a_transaction_sqlite_rolled_back_itself_is_not_acked() {
    let store = sqlite().await;
    sqlx::query("CREATE TABLE guard (k TEXT UNIQUE ON CONFLICT ROLLBACK)")
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query("INSERT INTO guard (k) VALUES ('taken')")
        .execute(store.pool())
        .await
        .unwrap();
    let runner = runner();
    let action = runner
        .process_in_tx(
            Memory::new(&payload("o-self", Some("sqlite-rollback"))),
            store.pool(),
            &handler,
        )
        .await
        .unwrap();
    assert!(
        matches!(action, Action::Retried { attempt: 1, .. }),
        "{action:?}"
    );
    assert_eq!(rows(&store, "o-self").await, 0);
    assert!(store.inspect(&key("o-self")).await.unwrap().is_none());
    let action = runner
        .process_in_tx(
            Memory::new(&payload("o-self", None)).attempt(2),
            store.pool(),
            &handler,
        )
        .await
        .unwrap();
    assert_eq!(action, Action::Acked(Acked::Processed));
    assert_eq!(rows(&store, "o-self").await, 1);
}

#[tokio::test]
async fn err_rolls_back_the_write_and_the_claim_and_redelivers() {
    let store = sqlite().await;
    let runner = runner();
    let delivery = Memory::new(&payload("o-err", Some("err")));
    let log = delivery.log();
    let action = runner
        .process_in_tx(delivery, store.pool(), &handler)
        .await
        .unwrap();
    assert!(
        matches!(action, Action::Retried { attempt: 1, .. }),
        "{action:?}"
    );
    assert!(log.lock().unwrap()[0].starts_with("retry"), "{log:?}");
    // Rolled back: no row, and no claim holding the key.
    assert_eq!(rows(&store, "o-err").await, 0);
    assert!(store.inspect(&key("o-err")).await.unwrap().is_none());

    // The redelivery (now succeeding) runs the body at once (its row is the
    // proof): nothing waits for a lease.
    let action = runner
        .process_in_tx(
            Memory::new(&payload("o-err", None)).attempt(2),
            store.pool(),
            &handler,
        )
        .await
        .unwrap();
    assert_eq!(action, Action::Acked(Acked::Processed));
    assert_eq!(rows(&store, "o-err").await, 1);
}

#[tokio::test]
async fn the_last_failed_delivery_is_parked_with_the_handlers_error() {
    let store = sqlite().await;
    let runner = runner();
    let action = runner
        .process_in_tx(
            Memory::new(&payload("o-park", Some("err"))).attempt(3),
            store.pool(),
            &handler,
        )
        .await
        .unwrap();
    let Action::Parked { reason } = action else {
        panic!("{action:?}")
    };
    assert!(reason.contains("Refused"), "{reason}");
    assert!(reason.contains("rolled back"), "{reason}");
    assert_eq!(rows(&store, "o-park").await, 0);
}

#[tokio::test]
async fn a_panic_rolls_back_and_frees_the_key_at_once() {
    let store = sqlite().await;
    let runner = runner();
    let action = runner
        .process_in_tx(
            Memory::new(&payload("o-panic", Some("panic"))),
            store.pool(),
            &handler,
        )
        .await
        .unwrap();
    assert!(matches!(action, Action::Retried { .. }), "{action:?}");
    assert_eq!(rows(&store, "o-panic").await, 0);
    // The transaction died with the unwinding: no PROCESSING claim is left
    // to wait out (without `tx` it would hold the key for its lease).
    assert!(store.inspect(&key("o-panic")).await.unwrap().is_none());
}

#[tokio::test]
async fn a_transaction_that_cannot_begin_runs_nothing_and_redelivers() {
    let store = sqlite().await;
    let runner = runner();
    let pool = store.pool().clone();
    pool.close().await;
    // A flag of this test's own (tests run in parallel).
    let called = AtomicBool::new(false);
    let action = runner
        .process_in_tx(Memory::new(&payload("o-closed", None)), &pool, &|tx, e| {
            called.store(true, Ordering::SeqCst);
            handler(tx, e)
        })
        .await
        .unwrap();
    assert!(matches!(action, Action::Retried { .. }), "{action:?}");
    assert!(
        !called.load(Ordering::SeqCst),
        "the handler ran without a transaction"
    );
}

/// Deliveries from a channel: enough of a broker to drive `run_in_tx`.
struct Channel(tokio::sync::mpsc::UnboundedReceiver<Memory>);

#[async_trait::async_trait]
impl Source for Channel {
    type Delivery = Memory;
    async fn next(&mut self) -> Result<Memory, BrokerError> {
        self.0.recv().await.ok_or_else(|| {
            BrokerError::new(
                "channel",
                std::io::Error::new(std::io::ErrorKind::BrokenPipe, "closed"),
            )
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_in_tx_on_a_spawned_task_settles_each_order_once() {
    let store = sqlite().await;
    let pool = store.pool().clone();
    let (send, recv) = tokio::sync::mpsc::unbounded_channel();
    let runner = runner().concurrency(4);
    let stats = runner.clone();
    // Spawned: the runner's future with a closure handler is `Send`.
    let task = tokio::spawn(async move {
        runner
            .run_in_tx(Channel(recv), &pool, |tx, e| Box::pin(settle(tx, e)))
            .await
    });
    let mut logs = Vec::new();
    for i in 0..20 {
        // Every order twice.
        for _ in 0..2 {
            let d = Memory::new(&payload(&format!("o-run-{i}"), None));
            logs.push(d.log());
            send.send(d).unwrap();
        }
    }
    drop(send);
    let err = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the runner ends when the channel closes")
        .unwrap();
    assert!(err.to_string().contains("closed"), "{err}");
    for i in 0..20 {
        assert_eq!(rows(&store, &format!("o-run-{i}")).await, 1);
    }
    assert!(logs.iter().all(|l| *l.lock().unwrap() == ["ack"]));
    let s = stats.stats();
    assert_eq!((s.processed, s.deduplicated, s.acked), (20, 20, 40));
}

mod postgres {
    //! A commit that fails: the handler's call recorded `Ok`, but nothing of
    //! it lasted, so the runner must not ack.

    use super::*;
    use idem_runtime::store::sql::PgStore;
    use idem_tests::services;
    use sqlx::Postgres;

    #[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "tests.consumer_tx.pg", tx = tx)]
    async fn settle_pg(
        tx: &mut Transaction<'_, Postgres>,
        e: OrderPaid,
    ) -> Result<(), SettleError> {
        // The deferred unique key is checked at COMMIT: a second row for the
        // order (written here on purpose when `fail` says so) fails the commit.
        let copies = if e.fail.as_deref() == Some("commit") {
            2
        } else {
            1
        };
        for _ in 0..copies {
            sqlx::query("INSERT INTO consumer_tx_settlements (order_id) VALUES ($1)")
                .bind(&e.order_id)
                .execute(&mut **tx)
                .await?;
        }
        if let Some(ms) = e.fail.as_deref().and_then(|f| f.strip_prefix("idle-")) {
            // The server ends a session idle in its transaction for longer
            // than this: the handler's wait below is that idleness.
            sqlx::query("SET LOCAL idle_in_transaction_session_timeout = '2s'")
                .execute(&mut **tx)
                .await?;
            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
        }
        if e.fail.as_deref() == Some("swallow") {
            // A failed statement whose error the handler ignores: PostgreSQL
            // has aborted the transaction, and its COMMIT answers ROLLBACK
            // with no error.
            let failed = sqlx::query("SELECT 1 / 0").execute(&mut **tx).await;
            assert!(failed.is_err());
        }
        Ok(())
    }

    async fn pg() -> Option<PgStore> {
        let url = services::postgres_url();
        let store = services::reachable("PostgreSQL", &url, PgStore::connect(&url).await)?;
        static TABLE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        TABLE
            .get_or_init(|| async {
                sqlx::query(
                    "CREATE TABLE IF NOT EXISTS consumer_tx_settlements (order_id TEXT NOT NULL, \
                     CONSTRAINT consumer_tx_one_per_order UNIQUE (order_id) DEFERRABLE INITIALLY DEFERRED)",
                )
                .execute(store.pool())
                .await
                .unwrap();
            })
            .await;
        Some(store)
    }

    fn order_id(case: &str) -> String {
        format!(
            "{case}-{}-{:?}",
            std::process::id(),
            idem_runtime::store::Token::random().as_bytes()
        )
    }

    fn handler<'t>(
        tx: &'t mut Transaction<'static, Postgres>,
        e: OrderPaid,
    ) -> futures_util::future::BoxFuture<'t, Result<(), SettleError>> {
        Box::pin(settle_pg(tx, e))
    }

    /// Regression (issue 30, item 5): sqlx's `commit()` returns `Ok` for an
    /// aborted transaction, which PostgreSQL rolls back; the runner must not
    /// ack it.
    #[tokio::test]
    async fn an_aborted_transaction_is_not_acked_and_redelivers() {
        let Some(store) = pg().await else { return };
        let runner = runner();
        let id = order_id("aborted");
        not_acked_and_parked(store.pool(), &handler, &id, "swallow", "aborted").await;
        let k = Key::builder("tests.consumer_tx.pg")
            .part("SETTLE")
            .part(&id)
            .finish();
        assert!(store.inspect(&k).await.unwrap().is_none());

        let action = runner
            .process_in_tx(
                Memory::new(&payload(&id, None)).attempt(2),
                store.pool(),
                &handler,
            )
            .await
            .unwrap();
        assert_eq!(action, Action::Acked(Acked::Processed));
        let n: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM consumer_tx_settlements WHERE order_id = $1")
                .bind(&id)
                .fetch_one(store.pool())
                .await
                .unwrap();
        assert_eq!(n, 1, "the redelivery wrote the settlement, once");
    }

    async fn settlements(store: &PgStore, id: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM consumer_tx_settlements WHERE order_id = $1")
            .bind(id)
            .fetch_one(store.pool())
            .await
            .unwrap()
    }

    /// Delivery `attempt` of order `id` (with `fail`), in a transaction on
    /// `pool`.
    async fn deliver(
        runner: &Runner,
        pool: &sqlx::PgPool,
        id: &str,
        fail: Option<&str>,
        attempt: u32,
    ) -> Action {
        runner
            .process_in_tx(
                Memory::new(&payload(id, fail)).attempt(attempt),
                pool,
                &handler,
            )
            .await
            .unwrap()
    }

    /// The server ends the session under the handler
    /// (`idle_in_transaction_session_timeout`, 2 s): one idle for 50 ms
    /// commits and is acked; one idle for 3 s is not acked, has written
    /// nothing, and its redelivery writes the settlement once.
    #[tokio::test]
    async fn a_session_the_server_ends_mid_transaction_is_not_acked() {
        let Some(store) = pg().await else { return };
        let runner = runner();
        let under = order_id("idle-under");
        let action = deliver(&runner, store.pool(), &under, Some("idle-50"), 1).await;
        assert_eq!(action, Action::Acked(Acked::Processed));
        assert_eq!(settlements(&store, &under).await, 1);

        let over = order_id("idle-over");
        let action = deliver(&runner, store.pool(), &over, Some("idle-3000"), 1).await;
        assert!(
            matches!(action, Action::Retried { attempt: 1, .. }),
            "{action:?}"
        );
        assert_eq!(settlements(&store, &over).await, 0);
        let action = deliver(&runner, store.pool(), &over, None, 2).await;
        assert_eq!(action, Action::Acked(Acked::Processed));
        assert_eq!(settlements(&store, &over).await, 1);
    }

    /// The COMMIT reaches the server and commits, and its answer is lost
    /// with the connection: the runner cannot tell, so it does not ack; the
    /// redelivery finds the record the commit wrote and replays it. The
    /// settlement is written once.
    #[tokio::test]
    async fn a_commit_whose_answer_is_lost_is_not_acked_and_its_redelivery_replays() {
        let Some(store) = pg().await else { return };
        let url = services::postgres_url();
        let options =
            <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url).unwrap();
        let proxy = idem_tests::proxy::Proxy::start(format!(
            "{}:{}",
            options.get_host(),
            options.get_port()
        ))
        .await;
        let through_proxy = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.host("127.0.0.1").port(proxy.port()))
            .await
            .unwrap();
        let runner = runner();
        let id = order_id("commit-lost");
        proxy.cut_after_request_with(b"COMMIT");
        let action = deliver(&runner, &through_proxy, &id, None, 1).await;
        assert!(
            matches!(action, Action::Retried { attempt: 1, .. }),
            "{action:?}"
        );
        // The server may still be finishing the COMMIT it was sent.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while settlements(&store, &id).await == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the COMMIT never committed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(settlements(&store, &id).await, 1);
        let action = deliver(&runner, store.pool(), &id, None, 2).await;
        assert_eq!(action, Action::Acked(Acked::Deduplicated));
        assert_eq!(settlements(&store, &id).await, 1);
    }

    #[tokio::test]
    async fn a_commit_that_fails_is_not_acked_and_leaves_no_record() {
        let Some(store) = pg().await else { return };
        let runner = runner();
        let id = order_id("commit");
        let delivery = Memory::new(&payload(&id, Some("commit")));
        let log = delivery.log();
        let action = runner
            .process_in_tx(delivery, store.pool(), &handler)
            .await
            .unwrap();
        assert!(
            matches!(action, Action::Retried { attempt: 1, .. }),
            "{action:?}"
        );
        assert!(log.lock().unwrap()[0].starts_with("retry"), "{log:?}");
        let k = Key::builder("tests.consumer_tx.pg")
            .part("SETTLE")
            .part(&id)
            .finish();
        assert!(store.inspect(&k).await.unwrap().is_none());
        let n: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM consumer_tx_settlements WHERE order_id = $1")
                .bind(&id)
                .fetch_one(store.pool())
                .await
                .unwrap();
        assert_eq!(n, 0);

        // The redelivery that commits is processed, once.
        let action = runner
            .process_in_tx(
                Memory::new(&payload(&id, None)).attempt(2),
                store.pool(),
                &handler,
            )
            .await
            .unwrap();
        assert_eq!(action, Action::Acked(Acked::Processed));
        let record = store.inspect(&k).await.unwrap().expect("a record");
        assert_eq!(record.state, RecordState::Done);
    }
}

/// The runner's metrics carry the handler's `scope` and `event`, with no
/// strings given to the runner; a delivery that never reaches the call
/// carries the last call's labels, or `unknown` before any.
#[test]
fn the_runners_metrics_are_labelled_by_the_handlers_attribute() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let parked = |snapshot: &[(metrics_util::CompositeKey, DebugValue)], scope: &str| -> u64 {
        snapshot
            .iter()
            .filter(|(k, _)| {
                let key = k.key();
                key.name() == "idem_consumer_parked_total"
                    && key
                        .labels()
                        .any(|l| l.key() == "scope" && l.value() == scope)
            })
            .map(|(_, v)| match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    };
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let store = sqlite().await;
                let runner = runner();
                // A poison message first: no call has told the runner whose it is.
                runner
                    .process_in_tx(Memory::new(b"not json"), store.pool(), &handler)
                    .await
                    .unwrap();
                let snapshot: Vec<_> = snapshotter
                    .snapshot()
                    .into_vec()
                    .into_iter()
                    .map(|(k, _, _, v)| (k, v))
                    .collect();
                assert_eq!(parked(&snapshot, "unknown"), 1);

                runner
                    .process_in_tx(
                        Memory::new(&payload("o-labels", None)),
                        store.pool(),
                        &handler,
                    )
                    .await
                    .unwrap();
                runner
                    .process_in_tx(Memory::new(b"not json"), store.pool(), &handler)
                    .await
                    .unwrap();
                let snapshot: Vec<_> = snapshotter
                    .snapshot()
                    .into_vec()
                    .into_iter()
                    .map(|(k, _, _, v)| (k, v))
                    .collect();
                let labelled = |name: &str| {
                    snapshot.iter().any(|(k, _)| {
                        let key = k.key();
                        key.name() == name
                            && key
                                .labels()
                                .any(|l| l.key() == "scope" && l.value() == SCOPE)
                            && key
                                .labels()
                                .any(|l| l.key() == "event" && l.value() == "SETTLE")
                    })
                };
                assert!(labelled("idem_consumer_processed_total"), "{snapshot:?}");
                assert_eq!(parked(&snapshot, SCOPE), 1, "{snapshot:?}");
            });
    });
}

mod mysql {
    //! MariaDB ends a transaction that lost a deadlock and runs the
    //! statements after it in autocommit; its COMMIT then answers OK.

    use super::*;
    use idem_runtime::store::sql::MySqlStore;
    use idem_tests::services;
    use sqlx::MySql;

    #[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "tests.consumer_tx.mysql", tx = tx)]
    async fn settle_my(tx: &mut Transaction<'_, MySql>, e: OrderPaid) -> Result<(), SettleError> {
        if e.fail.as_deref() == Some("ended") {
            // What the server does on a lost deadlock: the transaction (the
            // claim's record with it) is rolled back under sqlx, which still
            // counts it open.
            sqlx::Executor::execute(&mut **tx, "ROLLBACK").await?;
        }
        Ok(())
    }

    fn handler<'t>(
        tx: &'t mut Transaction<'static, MySql>,
        e: OrderPaid,
    ) -> futures_util::future::BoxFuture<'t, Result<(), SettleError>> {
        Box::pin(settle_my(tx, e))
    }

    /// Regression (issue 30, item 5, on MariaDB): a transaction the server
    /// ended under the handler is not acked.
    #[tokio::test]
    async fn a_transaction_the_server_ended_is_not_acked() {
        let url = services::mysql_url();
        let Some(store) = services::reachable("MariaDB", &url, MySqlStore::connect(&url).await)
        else {
            return;
        };
        let runner = runner();
        let id = format!(
            "ended-{}-{:?}",
            std::process::id(),
            std::time::Instant::now()
        );
        not_acked_and_parked(
            store.pool(),
            &handler,
            &id,
            "ended",
            "already rolled the transaction back",
        )
        .await;
        let action = runner
            .process_in_tx(
                Memory::new(&payload(&id, None)).attempt(2),
                store.pool(),
                &handler,
            )
            .await
            .unwrap();
        assert_eq!(action, Action::Acked(Acked::Processed));
        let k = Key::builder("tests.consumer_tx.mysql")
            .part("SETTLE")
            .part(&id)
            .finish();
        let record = store.inspect(&k).await.unwrap().expect("a record");
        assert_eq!(record.state, RecordState::Done);
    }
}
