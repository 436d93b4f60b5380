//! What a write costs the caller's transaction, counted from sqlx's
//! per-statement events (`idem_tests::statements`): `put` and `put_all` are
//! one statement each, ordering keys included, on PostgreSQL; MySQL adds one
//! for the messages' ordering keys. Plain `#[tokio::test]`s: the recorder
//! counts what the test's own thread sends. (sqlx runs SQLite's statements on
//! a worker thread of its own, which the recorder does not see; SQLite's
//! write is the same single `INSERT … VALUES …` as the others'.)

use idem_runtime::outbox::{self, Message, OutboxDatabase};
use idem_tests::statements::Statements;
use sqlx::Pool;

use super::{mysql, postgres, tag};

async fn count<DB: OutboxDatabase>(pool: &Pool<DB>, keyed_extra: usize) {
    let topic = format!("counted.{}", tag());
    let mut tx = pool.begin().await.unwrap();
    let seen = Statements::record();
    seen.take();
    let m = |id: &str| Message::bytes(topic.as_str(), b"{}".to_vec()).id(id);
    outbox::put(&mut tx, m("one")).await.unwrap();
    let sent = seen.take();
    assert_eq!(sent.len(), 1, "put: {sent:#?}");
    outbox::put_all(&mut tx, [m("a"), m("b"), m("c")])
        .await
        .unwrap();
    let sent = seen.take();
    assert_eq!(sent.len(), 1, "put_all of three: {sent:#?}");
    outbox::put_all(
        &mut tx,
        [
            m("k1").ordering_key("order-1"),
            m("k2").ordering_key("order-2"),
            m("k3"),
        ],
    )
    .await
    .unwrap();
    let sent = seen.take();
    assert_eq!(
        sent.len(),
        1 + keyed_extra,
        "put_all with ordering keys: {sent:#?}"
    );
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn postgres_put_and_put_all_are_one_statement_each() {
    let Some(db) = postgres().await else { return };
    count(&db.pool, 0).await;
    db.drop().await;
}

#[tokio::test]
async fn mysql_put_and_put_all_are_one_statement_each_and_one_more_for_ordering_keys() {
    let Some(db) = mysql().await else { return };
    count(&db.pool, 1).await;
    db.drop().await;
}
