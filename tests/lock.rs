//! The token-checked locks (`idem_runtime::lock`) on the real servers: Redis
//! (`IDEM_REDIS_URL`) and PostgreSQL advisory locks (`IDEM_POSTGRES_URL`).
//!
//! What they must show: a release or renewal under a wrong token changes
//! nothing, and a holder whose lease ran out can neither release nor renew the
//! lock the next holder took. Lock names are random per case, so runs and
//! other engineers' tests on the same servers never meet.

use std::time::{Duration, Instant};

use idem_runtime::lock::postgres::PgLocks;
use idem_runtime::lock::redis::RedisLocks;
use idem_runtime::store::Token;
use idem_tests::proxy::Proxy;
use idem_tests::services;

fn name(case: &str) -> String {
    let t = *Token::random().as_bytes();
    let hex: String = t[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("lock-test:{case}:{hex}")
}

/// Generous: the box is shared, and only "eventually" is asserted.
const DEADLINE: Duration = Duration::from_secs(30);

async fn redis_locks() -> Option<RedisLocks> {
    let url = services::redis_url();
    services::reachable("Redis", "IDEM_REDIS_URL", RedisLocks::connect(&url).await)
}

async fn pg_locks() -> Option<PgLocks> {
    let url = services::postgres_url();
    services::reachable(
        "PostgreSQL",
        "IDEM_POSTGRES_URL",
        PgLocks::connect(&url).await,
    )
}

#[tokio::test]
async fn redis_one_holder_at_a_time() {
    let Some(locks) = redis_locks().await else {
        return;
    };
    let n = name("one");
    let a = locks
        .try_acquire(&n, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free lock");
    assert!(
        locks
            .try_acquire(&n, Duration::from_secs(30))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(locks.holder(&n).await.unwrap(), Some(a.token()));
    assert!(a.renew(Duration::from_secs(30)).await.unwrap());
    assert!(a.release().await.unwrap());
    assert_eq!(locks.holder(&n).await.unwrap(), None);
    let b = locks
        .try_acquire(&n, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("released lock");
    assert!(b.release().await.unwrap());
}

#[tokio::test]
async fn redis_wrong_token_changes_nothing() {
    let Some(locks) = redis_locks().await else {
        return;
    };
    let n = name("wrong");
    let a = locks
        .try_acquire(&n, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free lock");
    let wrong = Token::random();
    assert!(
        !locks.release(&n, wrong).await.unwrap(),
        "a wrong token released the lock"
    );
    assert!(
        !locks
            .renew(&n, wrong, Duration::from_millis(1))
            .await
            .unwrap()
    );
    assert_eq!(
        locks.holder(&n).await.unwrap(),
        Some(a.token()),
        "the holder changed"
    );
    // The wrong renewal did not shorten the lease either.
    let mut conn = redis::Client::open(services::redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(locks.redis_key(&n))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(pttl > 1000, "lease shortened to {pttl} ms by a wrong token");
    assert!(a.release().await.unwrap());
}

#[tokio::test]
async fn redis_expired_holder_cannot_release_the_next_holders_lock() {
    let Some(locks) = redis_locks().await else {
        return;
    };
    let n = name("expired");
    let a = locks
        .try_acquire(&n, Duration::from_millis(100))
        .await
        .unwrap()
        .expect("free lock");
    let b = locks
        .acquire(&n, Duration::from_secs(30), DEADLINE)
        .await
        .unwrap()
        .expect("A's lease never ran out");
    assert!(
        !a.renew(Duration::from_secs(30)).await.unwrap(),
        "an expired holder renewed"
    );
    assert!(!a.release().await.unwrap(), "an expired holder released");
    assert_eq!(
        locks.holder(&n).await.unwrap(),
        Some(b.token()),
        "B lost its lock"
    );
    assert!(b.release().await.unwrap());
}

#[tokio::test]
async fn postgres_one_session_at_a_time() {
    let Some(locks) = pg_locks().await else {
        return;
    };
    let n = name("one");
    let mut a = locks
        .try_acquire(&n, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free lock");
    assert!(
        locks
            .try_acquire(&n, Duration::from_secs(30))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(locks.holder_pid(&n).await.unwrap(), a.pid().await.unwrap());
    assert!(a.renew(Duration::from_secs(30)).await.unwrap());
    assert!(a.release().await.unwrap());
    assert_eq!(locks.holder_pid(&n).await.unwrap(), None);
    let b = locks
        .try_acquire(&n, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("released lock");
    assert!(b.release().await.unwrap());
}

/// On PostgreSQL the token is the session: another session's unlock (what a
/// wrong holder would send) changes nothing.
#[tokio::test]
async fn postgres_another_session_cannot_release() {
    let Some(locks) = pg_locks().await else {
        return;
    };
    let n = name("wrong");
    let mut a = locks
        .try_acquire(&n, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free lock");
    let pool = sqlx::PgPool::connect(&services::postgres_url())
        .await
        .unwrap();
    let unlocked: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
        .bind(PgLocks::key_of(&n))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!unlocked, "another session released the lock");
    assert_eq!(locks.holder_pid(&n).await.unwrap(), a.pid().await.unwrap());
    assert!(
        locks
            .try_acquire(&n, Duration::from_secs(30))
            .await
            .unwrap()
            .is_none()
    );
    assert!(a.release().await.unwrap());
}

/// A holder that stops renewing loses its session to the server's
/// `idle_session_timeout`; the next holder takes the lock, and the old one's
/// renew and release answer `false` and leave the new holder's lock alone.
#[tokio::test]
async fn postgres_expired_holder_cannot_release_the_next_holders_lock() {
    let Some(locks) = pg_locks().await else {
        return;
    };
    let n = name("expired");
    let mut a = locks
        .try_acquire(&n, Duration::from_millis(200))
        .await
        .unwrap()
        .expect("free lock");
    let mut b = locks
        .acquire(&n, Duration::from_secs(30), DEADLINE)
        .await
        .unwrap()
        .expect("A's lease never ran out");
    assert!(
        !a.renew(Duration::from_secs(30)).await.unwrap(),
        "an expired holder renewed"
    );
    assert!(!a.release().await.unwrap(), "an expired holder released");
    let b_pid = b.pid().await.unwrap();
    assert!(b_pid.is_some());
    assert_eq!(
        locks.holder_pid(&n).await.unwrap(),
        b_pid,
        "B lost its lock"
    );
    assert!(b.renew(Duration::from_secs(30)).await.unwrap());
    assert!(b.release().await.unwrap());
}

/// A guard dropped without release closes its session, so the lock is free
/// again (and no locked session was handed back to the pool).
#[tokio::test]
async fn postgres_dropped_guard_frees_the_lock() {
    let Some(locks) = pg_locks().await else {
        return;
    };
    let n = name("dropped");
    let a = locks
        .try_acquire(&n, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free lock");
    drop(a);
    let started = Instant::now();
    let b = locks
        .acquire(&n, Duration::from_secs(30), DEADLINE)
        .await
        .unwrap()
        .unwrap_or_else(|| {
            panic!(
                "still locked {:?} after the guard was dropped",
                started.elapsed()
            )
        });
    assert!(b.release().await.unwrap());
}

/// A caller's future dropped while `pg_try_advisory_lock` is on the wire (its
/// timeout fired, its request was cancelled): the server granted the lock,
/// but no guard exists to free it. The session must not go back to the pool
/// holding it; the lock must come free without anyone's help.
#[tokio::test]
async fn pg_a_try_acquire_dropped_mid_query_never_leaves_the_lock_held() {
    let url = services::postgres_url();
    let Some(direct) = pg_locks().await else {
        return;
    };
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let proxy = Proxy::start(format!("{}:{}", options.get_host(), options.get_port())).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        // No ping on acquire: the held replies below must only hold the lock's.
        .test_before_acquire(false)
        .connect_with(options.port(proxy.port()))
        .await
        .unwrap();
    let locks = PgLocks::new(pool.clone());
    let n = name("dropped");
    // sqlx prepares a statement in a round trip of its own before it runs it:
    // have the pooled session prepare the lock query now, on a lock it is
    // refused (and so keeps the session in the pool), so that with replies
    // held below the query itself reaches the server.
    let taken = name("taken");
    let other = direct
        .try_acquire(&taken, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free lock");
    assert!(
        locks
            .try_acquire(&taken, Duration::from_secs(30))
            .await
            .unwrap()
            .is_none()
    );
    // The pool pings a session on its way back in: let that finish first.
    while pool.num_idle() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    proxy.hold_replies(true);
    let attempt = tokio::spawn({
        let locks = locks.clone();
        let n = n.clone();
        async move { locks.try_acquire(&n, Duration::from_secs(3600)).await }
    });
    let started = Instant::now();
    while direct.holder_pid(&n).await.unwrap().is_none() {
        assert!(started.elapsed() < DEADLINE, "the lock query never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The server granted it; the caller gives up before the answer arrives.
    attempt.abort();
    assert!(attempt.await.unwrap_err().is_cancelled());
    proxy.hold_replies(false);

    let started = Instant::now();
    while direct.holder_pid(&n).await.unwrap().is_some() {
        assert!(
            started.elapsed() < DEADLINE,
            "a session nobody holds a guard for still holds the lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And the pool still works: the lock can be had through it again.
    let lock = locks
        .try_acquire(&n, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the lock is free");
    assert!(lock.release().await.unwrap());
    assert!(other.release().await.unwrap());
}
