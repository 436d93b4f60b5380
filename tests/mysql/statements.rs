//! Statements per call, by the server's own counters, and the insert id that
//! tells a claim what it got.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use idem_runtime::idempotent;
use idem_runtime::store::sql::MySqlStore;
use idem_runtime::store::tx::{AsTxConnection, TxConnection};
use idem_runtime::store::{Claim, Token};
use idem_tests::conformance::fresh_key;

use crate::{AppError, charge, request, store, store_with_one_connection};

/// What one connection has sent the server so far, by the server's own
/// counters for that connection's session.
///
/// `Questions` counts every statement a client sends, a text query (BEGIN,
/// COMMIT) or a prepared statement's execution, and neither prepares, pings
/// nor statements run inside stored programs. The server's count rather than
/// the client's (sqlx's `sqlx::query` events): it sees what the driver sends
/// on its own too, and needs no log level or subscriber shared with the tests
/// running beside this one. `Com_stmt_prepare` shows the prepares: none after
/// a warm-up call (sqlx keeps each connection's prepared statements), so the
/// statements are then also the round trips. MariaDB ships with
/// performance_schema off, so no other connection can read these counters for
/// this one's thread: the connection reads its own, as text queries (no
/// prepare), and each reading counts itself once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sent {
    statements: i64,
    prepares: i64,
}

async fn sent_so_far(conn: &mut sqlx::MySqlConnection) -> Sent {
    use sqlx::{Executor as _, Row as _};

    let rows = conn
        .fetch_all("SHOW SESSION STATUS WHERE Variable_name IN ('Questions', 'Com_stmt_prepare')")
        .await
        .unwrap();
    let value = |name: &str| -> i64 {
        rows.iter()
            .find(|r| r.get::<String, _>(0).eq_ignore_ascii_case(name))
            .unwrap_or_else(|| panic!("no {name} in SHOW SESSION STATUS"))
            .get::<String, _>(1)
            .parse()
            .unwrap()
    };
    Sent {
        statements: value("Questions"),
        prepares: value("Com_stmt_prepare"),
    }
}

/// What the connection sent between two readings, the second reading not
/// counted.
async fn sent_since(conn: &mut sqlx::MySqlConnection, before: Sent) -> Sent {
    let now = sent_so_far(conn).await;
    Sent {
        statements: now.statements - before.statements - 1,
        prepares: now.prepares - before.prepares,
    }
}

static PLACED: AtomicUsize = AtomicUsize::new(0);

/// One business statement on the caller's transaction, under the claim.
#[idempotent(key = "order_no", tx = tx, scope = "mysql-tests.statements")]
async fn place_order(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    order_no: u64,
) -> Result<u64, AppError> {
    PLACED.fetch_add(1, SeqCst);
    let placed: u64 = sqlx::query_scalar("SELECT CAST(? AS UNSIGNED)")
        .bind(order_no)
        .fetch_one(&mut **tx)
        .await?;
    Ok(placed)
}

/// `place_order` in a transaction of its own on `conn`, committed.
async fn place_order_and_commit(conn: &mut sqlx::MySqlConnection, order_no: u64) -> u64 {
    let mut tx = sqlx::Connection::begin(conn).await.unwrap();
    let placed = place_order(&mut tx, order_no).await.unwrap();
    tx.commit().await.unwrap();
    placed
}

fn random_u64() -> u64 {
    u64::from_le_bytes(Token::random().as_bytes()[..8].try_into().unwrap())
}

/// The reference flow inside the business transaction is BEGIN, its dedup
/// insert, the business statement, COMMIT. `#[idempotent(tx = tx)]` adds two
/// statements to that on a first call (a plain read that finds nothing, the
/// claim, and the completion, in place of the dedup insert), and a replay is
/// BEGIN, one read, COMMIT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_call_inside_a_transaction_sends_three_statements_of_its_own_and_a_replay_one() {
    let Some(store) = store().await else { return };
    let mut conn = store.pool().acquire().await.unwrap();
    // A first call and a replay, so every statement of both is prepared.
    let warm_up = random_u64();
    place_order_and_commit(&mut conn, warm_up).await;
    place_order_and_commit(&mut conn, warm_up).await;

    let order_no = random_u64();
    let before = sent_so_far(&mut conn).await;
    assert_eq!(place_order_and_commit(&mut conn, order_no).await, order_no);
    let runs = PLACED.load(SeqCst);
    assert_eq!(
        sent_since(&mut conn, before).await,
        Sent {
            statements: 6,
            prepares: 0
        },
        "a first call: BEGIN, read, claim, the business statement, completion, COMMIT"
    );
    let before = sent_so_far(&mut conn).await;
    assert_eq!(place_order_and_commit(&mut conn, order_no).await, order_no);
    assert_eq!(
        sent_since(&mut conn, before).await,
        Sent {
            statements: 3,
            prepares: 0
        },
        "a replay: BEGIN, read, COMMIT"
    );
    assert_eq!(PLACED.load(SeqCst), runs, "the replay ran the body");
}

/// A `()` result: the claim writes the record DONE at once.
#[idempotent(key = "order_no", tx = tx, scope = "mysql-tests.statements.unit")]
async fn settle(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    order_no: u64,
) -> Result<(), AppError> {
    sqlx::query("SELECT CAST(? AS UNSIGNED)")
        .bind(order_no)
        .fetch_one(&mut **tx)
        .await?;
    Ok(())
}

async fn settle_and_commit(conn: &mut sqlx::MySqlConnection, order_no: u64) {
    let mut tx = sqlx::Connection::begin(conn).await.unwrap();
    settle(&mut tx, order_no).await.unwrap();
    tx.commit().await.unwrap();
}

/// With a `()` result the claim writes the record DONE, so a first call is
/// one statement shorter: BEGIN, read, claim, the business statement, COMMIT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_result_inside_a_transaction_needs_no_completion() {
    let Some(store) = store().await else { return };
    let mut conn = store.pool().acquire().await.unwrap();
    let warm_up = random_u64();
    settle_and_commit(&mut conn, warm_up).await;
    settle_and_commit(&mut conn, warm_up).await;

    let order_no = random_u64();
    let before = sent_so_far(&mut conn).await;
    settle_and_commit(&mut conn, order_no).await;
    assert_eq!(
        sent_since(&mut conn, before).await,
        Sent {
            statements: 5,
            prepares: 0
        },
        "a first call: BEGIN, read, claim (DONE), the business statement, COMMIT"
    );
    let before = sent_so_far(&mut conn).await;
    settle_and_commit(&mut conn, order_no).await;
    assert_eq!(
        sent_since(&mut conn, before).await,
        Sent {
            statements: 3,
            prepares: 0
        },
        "a replay: BEGIN, read, COMMIT (no business statement: the body did not run)"
    );
    let key = idem_runtime::Key::builder("mysql-tests.statements.unit")
        .part(&order_no)
        .finish();
    let record = idem_runtime::store::Store::inspect(&store, &key)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.state, idem_runtime::store::RecordState::Done);
}

/// On the pool (`MySqlStore`, each statement its own transaction) a first
/// call is the read, the claim and the completion; a replay is the read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_call_on_the_store_sends_three_statements_and_a_replay_one() {
    let Some((store, connection)) = store_with_one_connection().await else {
        return;
    };
    // The pool's one connection, the store's between two readings.
    let reading = async |store: &MySqlStore, since: Option<Sent>| {
        let mut conn = store.pool().acquire().await.unwrap();
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(id, connection, "the pool replaced its connection");
        match since {
            // The reading's own SELECT counts as well.
            Some(before) => {
                let d = sent_since(&mut conn, before).await;
                Sent {
                    statements: d.statements - 1,
                    ..d
                }
            }
            None => sent_so_far(&mut conn).await,
        }
    };
    let runs = AtomicUsize::new(0);
    let warm_up = random_u64();
    charge(&store, warm_up, &runs).await.unwrap();
    charge(&store, warm_up, &runs).await.unwrap();
    reading(&store, None).await;

    let order_id = random_u64();
    let before = reading(&store, None).await;
    assert_eq!(charge(&store, order_id, &runs).await.unwrap(), order_id);
    assert_eq!(
        reading(&store, Some(before)).await,
        Sent {
            statements: 3,
            prepares: 0
        },
        "a first call: read, claim, completion"
    );
    let before = reading(&store, None).await;
    assert_eq!(charge(&store, order_id, &runs).await.unwrap(), order_id);
    assert_eq!(
        reading(&store, Some(before)).await,
        Sent {
            statements: 1,
            prepares: 0
        },
        "a replay: the read"
    );
    assert_eq!(runs.load(SeqCst), 2, "each body ran once");
}

/// The claim tells a row it inserted from one it found by the statement's
/// insert id: 0 unless its ON DUPLICATE KEY branch set one with
/// `LAST_INSERT_ID(…)`. That id is the statement's own. A value an earlier
/// statement on the connection left in `LAST_INSERT_ID()` does not reach the
/// next statement's OK packet, whatever it is: here the markers for "lost",
/// "won with fence 1" and "won with fence 7 by takeover".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_last_insert_id_on_the_connection_never_reaches_a_claim() {
    use sqlx::Executor as _;

    let Some(store) = store().await else { return };
    let mut conn = store.pool().acquire().await.unwrap();

    // The server's behaviour itself, on a table without AUTO_INCREMENT.
    conn.execute("CREATE TEMPORARY TABLE idem_insert_id (k INT PRIMARY KEY, v INT NOT NULL)")
        .await
        .unwrap();
    sqlx::query("SELECT LAST_INSERT_ID(15)")
        .execute(&mut *conn)
        .await
        .unwrap();
    // Insert ids of: a fresh row, the same key again (the marker), a fresh row.
    let mut ids = Vec::new();
    for k in [1, 1, 2] {
        let done = sqlx::query(
            "INSERT INTO idem_insert_id (k, v) VALUES (?, 0)
             ON DUPLICATE KEY UPDATE v = IF(LAST_INSERT_ID(7), v, v)",
        )
        .bind(k)
        .execute(&mut *conn)
        .await
        .unwrap();
        ids.push(done.last_insert_id());
    }
    assert_eq!(ids, [0, 7, 0]);
    conn.execute("DROP TEMPORARY TABLE idem_insert_id")
        .await
        .unwrap();

    // And the claim, inside a transaction as on the pool.
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let warm_up = fresh_key("mysql-stale-insert-id");
    tx.tx_connection()
        .claim(request(&warm_up, Token::random()))
        .await
        .unwrap();
    for stale in [1_u64, 2, 15] {
        sqlx::query("SELECT LAST_INSERT_ID(?)")
            .bind(stale)
            .execute(&mut *tx)
            .await
            .unwrap();
        let key = fresh_key("mysql-stale-insert-id");
        let before = sent_so_far(&mut tx).await;
        let claim = tx
            .tx_connection()
            .claim(request(&key, Token::random()))
            .await
            .unwrap();
        assert!(
            matches!(
                claim,
                Claim::Acquired {
                    fence: 1,
                    takeover: false
                }
            ),
            "after LAST_INSERT_ID({stale}): {claim:?}"
        );
        assert_eq!(
            sent_since(&mut tx, before).await.statements,
            2,
            "after LAST_INSERT_ID({stale}): the read and the claim, nothing more"
        );
    }
    tx.rollback().await.unwrap();
}
