//! Redis locks: one key per lock, `SET key token NX PX lease` to acquire, and
//! compare-and-set Lua scripts (`renew.lua`, `release.lua`) to renew and
//! release.
//!
//! The key is `<prefix>{<name>}` (default prefix `idem:lock:`): the hash tag
//! places it in one Redis Cluster slot, and every command touches that one key.
//! Redis acknowledges a write before a replica has it, so a failover can lose
//! a lock and let a second holder in: one more reason a lock never replaces
//! the claim.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_runtime::lock::redis::RedisLocks;
//!
//! # async fn run() -> Result<(), idem_runtime::StoreError> {
//! let locks = RedisLocks::connect("redis://127.0.0.1:6379").await?;
//! if let Some(lock) = locks.try_acquire("rebalance", Duration::from_secs(30)).await? {
//!     lock.release().await?; // only this holder's token can release it
//! }
//! # Ok(()) }
//! ```

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{IntoConnectionInfo, Script, Value};

use crate::clock::duration_millis;
use crate::error::StoreError;
use crate::store::Token;

const BACKEND: &str = "redis-lock";

static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("renew.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("release.lua")));

/// Locks in one Redis (a single node through a [`ConnectionManager`], or any
/// other async connection such as a cluster's).
///
/// ```no_run
/// use std::time::Duration;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let locks = idem_runtime::lock::redis::RedisLocks::connect("redis://127.0.0.1:6379").await?;
/// if let Some(lock) = locks.try_acquire("rebalance", Duration::from_secs(30)).await? {
///     // … renew every third of the lease; stop when renew answers false …
///     lock.release().await?; // only this holder's token can release it
/// }
/// # Ok::<(), idem_runtime::StoreError>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct RedisLocks<C = ConnectionManager> {
    conn: C,
    prefix: String,
    location: String,
}

impl<C> std::fmt::Debug for RedisLocks<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLocks")
            .field("prefix", &self.prefix)
            .field("location", &self.location)
            .finish_non_exhaustive()
    }
}

impl RedisLocks<ConnectionManager> {
    /// Connects to a single node (one reconnecting multiplexed connection).
    /// Errors name the host and port, never the password.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let info = url
            .into_connection_info()
            .map_err(|e| StoreError::new(BACKEND, "an unparsable URL", e))?;
        let location = info.addr().to_string();
        let client =
            redis::Client::open(info).map_err(|e| StoreError::new(BACKEND, &location, e))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(2)));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| StoreError::new(BACKEND, &location, e))?;
        Ok(RedisLocks {
            conn,
            prefix: "idem:lock:".to_owned(),
            location,
        })
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisLocks<C> {
    /// Locks on a connection the application already has (a
    /// `ClusterConnection`, a `ConnectionManager` with its own settings).
    /// `location` names the server in errors: never put a password in it.
    pub fn new(conn: C, location: impl Into<String>) -> Self {
        RedisLocks {
            conn,
            prefix: "idem:lock:".to_owned(),
            location: location.into(),
        }
    }

    /// What every lock's key starts with (default `idem:lock:`). A brace in
    /// it would replace the hash tag, so braces are refused.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Result<Self, StoreError> {
        let prefix = prefix.into();
        if prefix.contains(['{', '}']) {
            return Err(StoreError::new(
                BACKEND,
                &*self.location,
                format!("the lock key prefix {prefix:?} contains a brace"),
            ));
        }
        self.prefix = prefix;
        Ok(self)
    }

    /// The Redis key of the lock `name`, for `redis-cli` (`GET`, `PTTL`).
    pub fn redis_key(&self, name: &str) -> String {
        format!("{}{{{}}}", self.prefix, name)
    }

    fn err(&self, e: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> StoreError {
        StoreError::new(BACKEND, &*self.location, e)
    }

    /// Takes the lock if nobody holds it: one `SET key token NX PX lease`.
    /// `None` when another token holds it.
    pub async fn try_acquire(
        &self,
        name: &str,
        lease: Duration,
    ) -> Result<Option<RedisLock<C>>, StoreError> {
        let token = Token::random();
        let set: Value = redis::cmd("SET")
            .arg(self.redis_key(name))
            .arg(&token.as_bytes()[..])
            .arg("NX")
            .arg("PX")
            .arg(lease_millis(lease))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.err(e))?;
        Ok(match set {
            Value::Nil => None,
            _ => Some(RedisLock {
                locks: self.clone(),
                name: name.to_owned(),
                token,
            }),
        })
    }

    /// Tries to take the lock until `wait` has passed, pausing a few
    /// jittered milliseconds between attempts. `None` if it never got it.
    pub async fn acquire(
        &self,
        name: &str,
        lease: Duration,
        wait: Duration,
    ) -> Result<Option<RedisLock<C>>, StoreError> {
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

    /// Extends the lease of `name` to `lease` from now, only if `token` holds
    /// it. Returns whether it did.
    pub async fn renew(
        &self,
        name: &str,
        token: Token,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let done: i64 = RENEW
            .key(self.redis_key(name))
            .arg(&token.as_bytes()[..])
            .arg(lease_millis(lease))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.err(e))?;
        Ok(done == 1)
    }

    /// Deletes the lock `name`, only if `token` holds it. Returns whether it
    /// did; a wrong or expired token changes nothing.
    pub async fn release(&self, name: &str, token: Token) -> Result<bool, StoreError> {
        let done: i64 = RELEASE
            .key(self.redis_key(name))
            .arg(&token.as_bytes()[..])
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.err(e))?;
        Ok(done == 1)
    }

    /// The token holding `name`, if any: for operators and tests.
    pub async fn holder(&self, name: &str) -> Result<Option<Token>, StoreError> {
        let held: Option<Vec<u8>> = redis::cmd("GET")
            .arg(self.redis_key(name))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.err(e))?;
        Ok(held.and_then(|b| {
            <[u8; 16]>::try_from(b.as_slice())
                .ok()
                .map(Token::from_bytes)
        }))
    }
}

/// A held Redis lock. Dropping it without [`release`](Self::release) leaves
/// the lock to run out at the end of its lease.
#[must_use = "a lock not released is held until its lease runs out"]
pub struct RedisLock<C = ConnectionManager> {
    locks: RedisLocks<C>,
    name: String,
    token: Token,
}

impl<C> std::fmt::Debug for RedisLock<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLock")
            .field("name", &self.name)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisLock<C> {
    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The random token this holder owns the lock under.
    pub fn token(&self) -> Token {
        self.token
    }

    /// Extends the lease to `lease` from now. `false`: the lease had run out
    /// and the lock is gone or someone else's; stop the work.
    pub async fn renew(&self, lease: Duration) -> Result<bool, StoreError> {
        self.locks.renew(&self.name, self.token, lease).await
    }

    /// Releases the lock if this holder still owns it. `false`: the lease had
    /// run out, and whoever holds it now keeps it.
    pub async fn release(self) -> Result<bool, StoreError> {
        self.locks.release(&self.name, self.token).await
    }
}

/// At least one millisecond (`PX 0` is an error), at most what Lua's doubles
/// still hold exactly.
fn lease_millis(lease: Duration) -> i64 {
    duration_millis(lease).clamp(1, 1 << 50)
}
