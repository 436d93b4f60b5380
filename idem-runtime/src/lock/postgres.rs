//! PostgreSQL locks: session advisory locks, each on a connection its guard
//! owns.
//!
//! What lease, renew and token mean here, honestly:
//!
//! - **The holder is a session.** `pg_try_advisory_lock` ties the lock to the
//!   connection that took it; only that session can release it, so no other
//!   process, whatever token it shows, can unlock it. The guard's [`Token`] is
//!   a random name for that session, for logs and for parity with Redis.
//! - **The lease is the server's `idle_session_timeout`** (PostgreSQL 14 or
//!   later), set on the guard's connection: a holder that sends nothing for
//!   the lease (a hung process, a partition) has its session closed by the
//!   server, and the lock goes with it. A crashed process loses it as soon as
//!   the server notices the closed socket.
//! - **Renew** runs a statement on that connection (which restarts the idle
//!   clock), sets the new lease, and checks the session still holds the lock.
//!   `false` means the session or the lock is gone: stop the work.
//! - **Release** unlocks on that session and closes it. A holder whose session
//!   was closed under it gets `false`, and the next holder keeps the lock.
//!
//! The guard's connection is taken from the pool and then detached from it, so
//! a guard dropped without release closes its connection (freeing the lock)
//! instead of handing a locked session back to the pool. A `try_acquire`
//! dropped mid-way (a timeout around it, a cancelled request) closes its
//! connection too, unless the lock was refused. Each held lock costs one
//! connection.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_runtime::lock::postgres::PgLocks;
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
//! let locks = PgLocks::new(pool); // the application's pool; each held lock takes a connection off it
//! if let Some(mut lock) = locks.try_acquire("rebalance", Duration::from_secs(30)).await? {
//!     while lock.renew(Duration::from_secs(30)).await? {
//!         // … a slice of the work, then renew again …
//!         break;
//!     }
//!     lock.release().await?; // false: the lease ran out and the session was closed
//! }
//! # Ok(()) }
//! ```

use std::str::FromStr;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{Connection as _, Row as _};

use crate::clock::duration_millis;
use crate::error::StoreError;
use crate::store::Token;

const BACKEND: &str = "postgres-lock";

/// Advisory locks on one PostgreSQL database.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::lock::postgres::PgLocks;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
/// let locks = PgLocks::new(pool);
/// if let Some(mut lock) = locks.try_acquire("rebalance", Duration::from_secs(30)).await? {
///     // … the work, renewing every 10 s with `lock.renew(…)` …
///     lock.release().await?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct PgLocks {
    pool: PgPool,
    location: String,
}

impl PgLocks {
    /// Locks on the application's pool. Each held lock detaches one
    /// connection from it.
    pub fn new(pool: PgPool) -> Self {
        let options = pool.connect_options();
        let location = format!(
            "{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or("")
        );
        PgLocks { pool, location }
    }

    /// Connects a small pool to the database a `postgres://` URL names.
    /// Errors name the host, port and database, never the password.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::new(BACKEND, "<unparsable postgres URL>", e))?;
        let location = format!(
            "{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or("")
        );
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await
            .map_err(|e| StoreError::new(BACKEND, &location, e))?;
        Ok(PgLocks { pool, location })
    }

    /// The advisory lock key of `name`: the first 8 bytes of
    /// SHA-256("idem.lock\0" + name). Find its holder with
    /// `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = <key & 0xffffffff>`.
    pub fn key_of(name: &str) -> i64 {
        let digest = Sha256::new()
            .chain_update(b"idem.lock\0")
            .chain_update(name.as_bytes())
            .finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        i64::from_be_bytes(first)
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        StoreError::new(BACKEND, &*self.location, e)
    }

    /// Takes the lock if no session holds it, with the server closing the
    /// holder's session after `lease` without a renewal. `None` when another
    /// session holds it.
    pub async fn try_acquire(
        &self,
        name: &str,
        lease: Duration,
    ) -> Result<Option<PgLock>, StoreError> {
        let key = Self::key_of(name);
        // From the lock query on, dropping this future (a timeout, a cancelled
        // request) must close the session rather than hand it back to the pool
        // still holding a lock nobody has a guard for.
        let mut conn = CloseUnlessKept(Some(self.pool.acquire().await.map_err(|e| self.err(e))?));
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(key)
            .fetch_one(&mut **conn.get())
            .await
            .map_err(|e| self.err(e))?;
        if !got {
            // Holds nothing: back to the pool.
            drop(conn.keep());
            return Ok(None);
        }
        // From here the session holds a lock: it must never go back to the pool.
        let mut conn = conn.keep().detach();
        if let Err(e) = set_lease(&mut conn, lease).await {
            let _ = conn.close().await;
            return Err(self.err(e));
        }
        Ok(Some(PgLock {
            conn: Some(conn),
            key,
            name: name.to_owned(),
            token: Token::random(),
            location: self.location.clone(),
        }))
    }

    /// Tries to take the lock until `wait` has passed, pausing a few
    /// jittered milliseconds between attempts. `None` if it never got it.
    pub async fn acquire(
        &self,
        name: &str,
        lease: Duration,
        wait: Duration,
    ) -> Result<Option<PgLock>, StoreError> {
        let deadline = Instant::now() + wait;
        let mut attempt = 0;
        loop {
            if let Some(lock) = self.try_acquire(name, lease).await? {
                return Ok(Some(lock));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(super::pause(attempt)).await;
            attempt += 1;
        }
    }

    /// The server process id of the session holding `name`, if any: for
    /// operators and tests.
    pub async fn holder_pid(&self, name: &str) -> Result<Option<i32>, StoreError> {
        let key = Self::key_of(name);
        sqlx::query_scalar(
            "SELECT pid FROM pg_locks
             WHERE locktype = 'advisory' AND granted AND objsubid = 1
               AND classid = (($1 >> 32) & 4294967295)::oid
               AND objid = ($1 & 4294967295)::oid
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| self.err(e))
    }
}

/// A held advisory lock and the session that holds it. Dropping it without
/// [`release`](Self::release) closes the session, which frees the lock.
#[must_use = "a lock not released is held until its session closes"]
#[derive(Debug)]
pub struct PgLock {
    conn: Option<PgConnection>,
    key: i64,
    name: String,
    token: Token,
    location: String,
}

impl PgLock {
    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The random name of this holder's session.
    pub fn token(&self) -> Token {
        self.token
    }

    /// The session's server process id (`pg_locks.pid`), or `None` once the
    /// session is gone.
    pub async fn pid(&mut self) -> Result<Option<i32>, StoreError> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(None);
        };
        match sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
        {
            Ok(pid) => Ok(Some(pid)),
            Err(e) if session_gone(&e) => Ok(None),
            Err(e) => Err(StoreError::new(BACKEND, &*self.location, e)),
        }
    }

    /// Sets the lease to `lease` from now and checks the session still holds
    /// the lock. `false`: the session was closed (its lease ran out) or the
    /// lock is gone; stop the work.
    pub async fn renew(&mut self, lease: Duration) -> Result<bool, StoreError> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(false);
        };
        let held = async {
            set_lease(conn, lease).await?;
            let row = sqlx::query(
                "SELECT EXISTS (SELECT 1 FROM pg_locks
                 WHERE locktype = 'advisory' AND granted AND objsubid = 1
                   AND pid = pg_backend_pid()
                   AND classid = (($1 >> 32) & 4294967295)::oid
                   AND objid = ($1 & 4294967295)::oid)",
            )
            .bind(self.key)
            .fetch_one(&mut *conn)
            .await?;
            row.try_get::<bool, _>(0)
        };
        match held.await {
            Ok(held) => Ok(held),
            Err(e) if session_gone(&e) => {
                self.conn = None;
                Ok(false)
            }
            Err(e) => Err(StoreError::new(BACKEND, &*self.location, e)),
        }
    }

    /// Unlocks on this holder's session and closes it. `false`: the session
    /// had been closed (its lease ran out), and whoever holds the lock now
    /// keeps it; no other session's lock can be released from here.
    pub async fn release(mut self) -> Result<bool, StoreError> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(false);
        };
        let unlocked = sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1)")
            .bind(self.key)
            .fetch_one(&mut conn)
            .await;
        let _ = conn.close().await;
        match unlocked {
            Ok(unlocked) => Ok(unlocked),
            Err(e) if session_gone(&e) => Ok(false),
            Err(e) => Err(StoreError::new(BACKEND, &*self.location, e)),
        }
    }
}

/// A pooled connection that is closed, not returned to the pool, if dropped
/// before [`keep`](Self::keep): a future dropped at an `.await` leaves the
/// session in a state only the server knows (here: maybe holding a lock).
struct CloseUnlessKept(Option<sqlx::pool::PoolConnection<sqlx::Postgres>>);

impl CloseUnlessKept {
    fn get(&mut self) -> &mut sqlx::pool::PoolConnection<sqlx::Postgres> {
        self.0.as_mut().expect("kept only once")
    }

    fn keep(mut self) -> sqlx::pool::PoolConnection<sqlx::Postgres> {
        self.0.take().expect("kept only once")
    }
}

impl Drop for CloseUnlessKept {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

/// Whether the error means the session no longer exists (closed by the
/// server, terminated, the socket lost): the lock went with it.
fn session_gone(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
        // 57P01 admin shutdown (pg_terminate_backend), 57P05 idle session
        // timeout, 08xxx connection exceptions.
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c == "57P01" || c == "57P05" || c.starts_with("08")),
        _ => false,
    }
}

/// `SET` takes no parameters; the value is an integer we format ourselves.
async fn set_lease(conn: &mut PgConnection, lease: Duration) -> Result<(), sqlx::Error> {
    // At least 1 ms (0 would disable the timeout), at most what the setting holds.
    let ms = duration_millis(lease).clamp(1, i64::from(i32::MAX));
    sqlx::query(&format!("SET idle_session_timeout = {ms}"))
        .execute(conn)
        .await
        .map(|_| ())
}
