//! Cases every SQL store runs, for behaviour only a SQL store has (a record
//! written by hand, the clamp on absurd durations, a server that never
//! answers). Each dialect's test file calls them with its store and the one
//! statement only it can write.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use idem_runtime::store::{Claim, ClaimRequest, Store, Token};
use idem_runtime::{Clock, Key, StoreError, SystemClock};

use crate::conformance::fresh_key;

/// The longest lease or ttl any SQL store writes: about 35,000 years, the
/// Redis store's bound too.
pub const MAX_MILLIS: i64 = 1 << 50;

fn request(key: &Key, token: Token, d: Duration) -> ClaimRequest<'_> {
    ClaimRequest {
        key,
        token,
        fingerprint: None,
        lease: d,
        ttl: d,
    }
}

/// The error is the store's, names it, and carries the database error
/// (`sqlx::Error`) as its source: the same shape on every dialect.
pub fn assert_store_error(store: &impl Store, e: &StoreError, what: &str) {
    assert_eq!(e.backend(), store.backend(), "{what}: {e}");
    assert!(
        e.to_string().starts_with(&format!(
            "idempotency store {} ({}): ",
            store.backend(),
            e.location()
        )),
        "{what}: {e}"
    );
    let source = std::error::Error::source(e).and_then(|s| s.downcast_ref::<sqlx::Error>());
    assert!(
        matches!(source, Some(sqlx::Error::Decode(_))),
        "{what}: a decode error expected, got {source:?}"
    );
}

/// A record the store cannot read as any state it knows (`set_state` writes
/// `state = 7` on the key's row) fails closed: claims and inspection are
/// errors, never a takeover, a replay, or "DONE".
pub async fn unknown_state_fails_closed<F, Fut>(store: &impl Store, set_state: F)
where
    F: FnOnce(Key) -> Fut,
    Fut: Future<Output = ()>,
{
    let key = fresh_key("unknown-state");
    let claimed = store
        .claim(request(&key, Token::random(), Duration::from_secs(60)))
        .await
        .expect("claim");
    assert!(matches!(claimed, Claim::Acquired { .. }), "{claimed:?}");
    set_state(key).await;
    let claim = store
        .claim(request(&key, Token::random(), Duration::from_secs(60)))
        .await;
    assert_store_error(
        store,
        &claim.expect_err("a claim on an unknown state"),
        "claim",
    );
    let inspect = store.inspect(&key).await;
    assert_store_error(
        store,
        &inspect.expect_err("inspecting an unknown state"),
        "inspect",
    );
}

/// A DONE record without an outcome (`clear_outcome` sets `outcome = NULL` on
/// the key's row) is corrupt: replaying it and inspecting it are errors.
pub async fn done_without_outcome_fails_closed<F, Fut>(store: &impl Store, clear_outcome: F)
where
    F: FnOnce(Key) -> Fut,
    Fut: Future<Output = ()>,
{
    let key = fresh_key("no-outcome");
    let token = Token::random();
    store
        .claim(request(&key, token, Duration::from_secs(60)))
        .await
        .expect("claim");
    let completion = idem_runtime::store::Completion {
        outcome: idem_runtime::store::StoredOutcome::Success,
        payload: b"1",
        ttl: Duration::from_secs(60),
    };
    assert!(
        store
            .complete(&key, token, completion)
            .await
            .expect("complete")
    );
    clear_outcome(key).await;
    let claim = store
        .claim(request(&key, Token::random(), Duration::from_secs(60)))
        .await;
    assert_store_error(store, &claim.expect_err("replaying it"), "claim");
    let inspect = store.inspect(&key).await;
    assert_store_error(store, &inspect.expect_err("inspecting it"), "inspect");
}

/// `Duration::MAX` as lease and ttl is written as [`MAX_MILLIS`] from now on
/// every SQL store: never wrapped, refused, or stored as a different
/// "forever" per dialect.
pub async fn absurd_durations_are_clamped_alike(store: &impl Store) {
    let key = fresh_key("clamp");
    let token = Token::random();
    let before = SystemClock.now_millis();
    store
        .claim(request(&key, token, Duration::MAX))
        .await
        .expect("claim");
    assert!(
        store
            .renew(&key, token, Duration::MAX)
            .await
            .expect("renew")
    );
    let info = store.inspect(&key).await.expect("inspect").expect("live");
    let after = SystemClock.now_millis();
    // A minute either way for the server's clock against ours.
    let window = before + MAX_MILLIS - 60_000..=after + MAX_MILLIS + 60_000;
    assert!(window.contains(&info.lease_until_millis), "{info:?}");
    assert!(window.contains(&info.expires_at_millis), "{info:?}");
}

/// A server that accepts connections and never says a word: opening a store
/// on it must fail within a bounded time, however the driver waits.
pub async fn silent_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a local port");
    let addr = listener.local_addr().expect("local address");
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (addr, task)
}

/// Opening against [`silent_server`] with a 1 s acquire timeout: an error
/// naming the backend, well within a generous deadline.
pub async fn opening_on_a_silent_server_is_bounded<F, Fut, S>(backend: &str, open: F)
where
    F: FnOnce(SocketAddr) -> Fut,
    Fut: Future<Output = Result<S, StoreError>>,
{
    let (addr, server) = silent_server().await;
    let opened = tokio::time::timeout(Duration::from_secs(60), open(addr)).await;
    server.abort();
    let Ok(opened) = opened else {
        panic!("opening a store on a silent server hung");
    };
    let Err(e) = opened else {
        panic!("a silent server opened a store");
    };
    assert_eq!(e.backend(), backend, "{e}");
    assert!(e.to_string().contains(&addr.port().to_string()), "{e}");
}

fn leased(key: &Key, token: Token, lease: Duration) -> ClaimRequest<'_> {
    ClaimRequest {
        lease,
        ttl: Duration::from_secs(120),
        ..request(key, token, lease)
    }
}

/// Transaction A claims `key` and keeps its row locked for two of B's leases;
/// store caller B (`waiter`, one connection) waits on it and wins when A rolls
/// back. B's lease starts then, not when its statement began: a third caller
/// is busy, not a takeover. `existing`: the row was there before A (released),
/// so A and then B update it; otherwise A inserted it and B's insert waited.
/// `b_is_waiting` returns once B's connection waits on a lock.
pub async fn a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins<DB, S, W>(
    store: &S,
    pool: &sqlx::Pool<DB>,
    waiter: S,
    b_is_waiting: W,
    key: Key,
    existing: bool,
) where
    DB: sqlx::Database,
    DB::Connection: idem_runtime::store::tx::TxConnection,
    S: Store + Clone,
    W: Future<Output = ()>,
{
    use idem_runtime::store::tx::{AsTxConnection, TxConnection};

    let lease = Duration::from_secs(1);
    if existing {
        let token = Token::random();
        store.claim(leased(&key, token, lease)).await.unwrap();
        assert!(store.release(&key, token).await.unwrap());
    }
    let mut a = pool.begin().await.unwrap();
    let claim = a
        .tx_connection()
        .claim(leased(&key, Token::random(), lease))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");

    let b = tokio::spawn(async move { waiter.claim(leased(&key, Token::random(), lease)).await });
    b_is_waiting.await;
    // Long enough that a lease counted from B's statement start has run out.
    tokio::time::sleep(lease * 2).await;
    assert!(!b.is_finished(), "B did not wait for A");
    a.rollback().await.unwrap();
    let won = b.await.unwrap().unwrap();
    assert!(
        matches!(
            won,
            Claim::Acquired {
                takeover: false,
                ..
            }
        ),
        "{won:?}"
    );

    let third = store
        .claim(leased(&key, Token::random(), lease))
        .await
        .unwrap();
    assert!(
        matches!(third, Claim::Busy { .. }),
        "B's fresh lease was taken over at once: {third:?}"
    );
}

/// The owner's renewal waits on a row lock another transaction holds
/// (`lock_row` takes it); the renewed lease counts from when it got the row.
/// `owner_is_waiting` returns once the owner's connection waits on a lock.
pub async fn a_renewal_that_waited_on_a_lock_counts_from_when_it_got_the_row<DB, S, L, LF, W>(
    store: &S,
    owner: S,
    lock_row: L,
    owner_is_waiting: W,
    key: Key,
) where
    DB: sqlx::Database,
    S: Store + Clone,
    L: FnOnce(Key) -> LF,
    LF: Future<Output = sqlx::Transaction<'static, DB>>,
    W: Future<Output = ()>,
{
    let lease = Duration::from_secs(1);
    let token = Token::random();
    assert!(matches!(
        owner.claim(leased(&key, token, lease)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let holder = lock_row(key).await;
    let renewal = tokio::spawn(async move { owner.renew(&key, token, lease).await });
    owner_is_waiting.await;
    tokio::time::sleep(lease * 2).await;
    holder.commit().await.unwrap();
    assert!(
        renewal.await.unwrap().unwrap(),
        "the owner's renewal failed"
    );
    let newcomer = store
        .claim(leased(&key, Token::random(), lease))
        .await
        .unwrap();
    assert!(
        matches!(newcomer, Claim::Busy { .. }),
        "the renewed lease was already spent: {newcomer:?}"
    );
}

/// Ends in time or fails the test: a lock wait would otherwise last the
/// server's lock timeout (50 s on InnoDB) and be retried.
async fn soon<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} waited on a lock"))
}

/// A key completed on the pool, ready to replay.
async fn done_key(store: &impl Store, name: &str, payload: &[u8]) -> Key {
    let (key, token) = (fresh_key(name), Token::random());
    let long = Duration::from_secs(60);
    assert!(matches!(
        store.claim(request(&key, token, long)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let done = idem_runtime::store::Completion {
        outcome: idem_runtime::store::StoredOutcome::Success,
        payload,
        ttl: long,
    };
    assert!(store.complete(&key, token, done).await.unwrap());
    key
}

/// Two transactions replay two DONE keys in opposite orders: neither waits on
/// the other, neither is a deadlock victim, and both carry on (each still
/// claims a fresh key afterwards: no aborted transaction, no 25P02).
pub async fn replays_in_opposite_orders_inside_transactions_neither_wait_nor_deadlock<DB>(
    store: &impl Store,
    pool: &sqlx::Pool<DB>,
) where
    DB: sqlx::Database,
    DB::Connection: idem_runtime::store::tx::TxConnection,
{
    use idem_runtime::store::tx::{AsTxConnection, TxConnection};

    let long = Duration::from_secs(60);
    let a = done_key(store, "replay-a", b"a").await;
    let b = done_key(store, "replay-b", b"b").await;
    let mut tx1 = pool.begin().await.unwrap();
    let mut tx2 = pool.begin().await.unwrap();
    for (tx, key) in [(&mut tx1, &a), (&mut tx2, &b)] {
        let claim = tx
            .tx_connection()
            .claim(request(key, Token::random(), long))
            .await
            .unwrap();
        assert!(matches!(claim, Claim::Done(_)), "{claim:?}");
    }
    let one = tokio::spawn(async move {
        let claim = tx1
            .tx_connection()
            .claim(request(&b, Token::random(), long))
            .await;
        (claim, tx1)
    });
    let two = tokio::spawn(async move {
        let claim = tx2
            .tx_connection()
            .claim(request(&a, Token::random(), long))
            .await;
        (claim, tx2)
    });
    let (one, two) = soon("a replay", async {
        (one.await.unwrap(), two.await.unwrap())
    })
    .await;
    for ((claim, mut tx), payload) in [(one, b"b"), (two, b"a")] {
        match claim {
            Ok(Claim::Done(stored)) => assert_eq!(stored.payload, payload),
            other => panic!("expected a replay, got {other:?}"),
        }
        let fresh = fresh_key("replay-after");
        let claim = tx
            .tx_connection()
            .claim(request(&fresh, Token::random(), long))
            .await
            .expect("the transaction is still usable");
        assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
        tx.rollback().await.unwrap();
    }
}

/// A duplicate told Busy inside an open transaction leaves the row unlocked:
/// the owner renews and completes at once.
pub async fn a_busy_duplicate_in_an_open_transaction_does_not_block_the_owner<DB>(
    store: &impl Store,
    pool: &sqlx::Pool<DB>,
) where
    DB: sqlx::Database,
    DB::Connection: idem_runtime::store::tx::TxConnection,
{
    use idem_runtime::store::tx::{AsTxConnection, TxConnection};

    let long = Duration::from_secs(30);
    let (key, owner) = (fresh_key("busy-dup"), Token::random());
    assert!(matches!(
        store.claim(request(&key, owner, long)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let mut dup = pool.begin().await.unwrap();
    let claim = dup
        .tx_connection()
        .claim(request(&key, Token::random(), long))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Busy { .. }), "{claim:?}");

    assert!(
        soon("the owner's renewal", store.renew(&key, owner, long))
            .await
            .unwrap()
    );
    let done = idem_runtime::store::Completion {
        outcome: idem_runtime::store::StoredOutcome::Success,
        payload: b"owner",
        ttl: long,
    };
    assert!(
        soon("the owner's completion", store.complete(&key, owner, done))
            .await
            .unwrap()
    );
    dup.commit().await.unwrap();
}

/// A PostgreSQL store on a schema of its own, made on `admin`'s database
/// (the server at `url`): a test's records and tables apart from every
/// other's. The caller drops the schema.
pub async fn pg_store_in_schema(
    admin: &sqlx::PgPool,
    url: &str,
    schema: &str,
) -> idem_runtime::store::sql::PgStore {
    use std::str::FromStr;
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(admin)
        .await
        .unwrap();
    let options = sqlx::postgres::PgConnectOptions::from_str(url)
        .unwrap()
        .options([("search_path", schema)]);
    idem_runtime::store::sql::PgStore::builder()
        .connect_with(options)
        .await
        .expect("open postgres")
}
