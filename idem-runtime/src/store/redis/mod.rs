//! Records in Redis, on a single node or a Redis Cluster.
//!
//! Each record is one string value at `<prefix>{<64 hex of the key>}`: its
//! kind (PROCESSING, DONE or RELEASED), the owner token (kept once done: a
//! re-sent completion recognises itself by it), the fingerprint, the fence,
//! and once done the outcome and result (the layout is in `record.rs`). The
//! key's own expiry is the record's life, and the lease end is kept as a
//! margin before it, so no operation needs to read a clock.
//!
//! One file per operation, next to this one: `claim.rs` (one plain
//! `SET … NX PX … GET`, and `reclaim.lua` on its rare path), `complete.lua`,
//! `release.lua`, `renew.lua`, `inspect.lua`, `purge.lua` and `evict.lua`. Scripts run
//! with `EVALSHA` and are loaded again by themselves when the server answers
//! `NOSCRIPT` (after a restart, a failover or `SCRIPT FLUSH`).
//!
//! Why these choices:
//! - one value per record, written whole by one command or one script:
//!   status, owner and result can never disagree, whatever crashes between
//!   two commands (the reference flow kept status and result in two keys
//!   written one after the other);
//! - the claim is a plain command, the cheapest thing Redis runs: a first
//!   call costs one `SET` and one `EVALSHA` (the compare-and-set completion),
//!   a replay one `SET`;
//! - a lease separate from the ttl: a crashed owner blocks its key for the
//!   lease, not for the whole ttl, and its record stays until the ttl, so a
//!   takeover counts on from its fence;
//! - the hash tag `{…}` around the key's hex: a Redis Cluster places the key by
//!   the tag alone, and since every command touches exactly one key none is
//!   ever CROSSSLOT; the same code runs on one node and on a cluster;
//! - each renewal pushes the key's expiry to the ttl from now, so Redis never
//!   deletes the record of a body that is still heartbeating, however long it
//!   runs.
//!
//! A value at a record's key that this version cannot read (another kind, a
//! truncated value, another application's, or a hash written by the earlier
//! hash layout) is never taken for an absent record: claiming or inspecting
//! it fails with a `StoreError` that says so, and it is left alone.
//!
//! What Redis guarantees, and what it does not: a single Redis node (or the
//! master of a slot) acknowledges writes before replicating them, and a
//! failover can lose the last ones, a claim among them. Redis lowers
//! duplicates; alone it does not prove uniqueness. Keep a unique constraint on
//! the business table behind it.

mod claim;
mod record;

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::join_all;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisFuture, Script, Value};

use crate::clock::duration_millis;
use crate::error::StoreError;
use crate::key::{Fingerprint, Key};
use crate::store::{
    AsStore, Claim, ClaimRequest, Completion, DEFAULT_MAX_RESULT_BYTES, RecordInfo, RecordState,
    RecordStats, Store, StoreRef, Token,
};
use record::{Record, Unreadable};

const SINGLE: &str = "redis";
const CLUSTER: &str = "redis-cluster";
/// Keys a SCAN step asks for; each step is one round trip per node.
const SCAN_COUNT: usize = 512;

/// The scripts, hashed once per process.
struct Scripts {
    complete: Script,
    release: Script,
    renew: Script,
    inspect: Script,
    purge: Script,
    evict: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    complete: Script::new(include_str!("complete.lua")),
    release: Script::new(include_str!("release.lua")),
    renew: Script::new(include_str!("renew.lua")),
    inspect: Script::new(include_str!("inspect.lua")),
    purge: Script::new(include_str!("purge.lua")),
    evict: Script::new(include_str!("evict.lua")),
});

/// One shared connection, whichever kind: both are cheap handles to one
/// multiplexed connection (per node), cloned per call, never opened per call.
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(cmd, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

/// Records in Redis: a single node through one reconnecting multiplexed
/// connection, or a Redis Cluster.
///
/// Fast, and shared by every replica of a service; but Redis acknowledges a
/// write before it reaches a replica, so a failover can forget a claim. Use it
/// to keep duplicates away from the database, and keep a unique constraint
/// there as the proof.
///
/// Expired records are deleted by Redis itself at the end of their ttl, so
/// [`Store::purge_expired`] has only released records to delete.
///
/// ```no_run
/// use idem_runtime::store::redis::RedisStore;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// idem_runtime::install(store);
/// # Ok::<(), idem_runtime::StoreError>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Connection,
    backend: &'static str,
    // host:port (comma-separated for a cluster), never the URL: a URL can hold
    // a password, and this string ends up in every error message.
    location: String,
    key_prefix: String,
    max_result_bytes: usize,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("backend", &self.inner.backend)
            .field("location", &self.inner.location)
            .field("key_prefix", &self.inner.key_prefix)
            .field("max_result_bytes", &self.inner.max_result_bytes)
            .finish()
    }
}

/// Configures a [`RedisStore`].
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::store::redis::RedisStore;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = RedisStore::builder()
///     .key_prefix("orders:idem:")
///     .max_result_bytes(64 * 1024)
///     .response_timeout(Duration::from_secs(1))
///     .connect("redis://127.0.0.1:6379")
///     .await?;
/// # Ok::<(), idem_runtime::StoreError>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    key_prefix: String,
    max_result_bytes: usize,
    connection_timeout: Duration,
    response_timeout: Duration,
    reconnect_retries: usize,
}

impl RedisStoreBuilder {
    /// What every record's key starts with (default `idem:`); a record's key
    /// is the prefix followed by `{<64 hex of the key>}`. Give each
    /// application sharing a database its own. It may not contain `{` or `}`,
    /// which would change the hash tag a cluster places keys by.
    ///
    /// ```
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// let builder = RedisStore::builder().key_prefix("billing:idem:");
    /// # let _ = builder;
    /// ```
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// The largest result kept (default 1 MiB). Larger results are not
    /// stored; duplicates get `Error::ResultTooLarge`.
    ///
    /// ```
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// let builder = RedisStore::builder().max_result_bytes(256 * 1024);
    /// # let _ = builder;
    /// ```
    pub fn max_result_bytes(mut self, limit: usize) -> Self {
        self.max_result_bytes = limit;
        self
    }

    /// How long one connection attempt may take (default 1 s).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// let builder = RedisStore::builder().connection_timeout(Duration::from_millis(500));
    /// # let _ = builder;
    /// ```
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// How long a command may wait for its answer (default 2 s; on a cluster,
    /// including redirections and retries). A call whose claim times out
    /// fails with `Error::Store` and does not run its body.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// let builder = RedisStore::builder().response_timeout(Duration::from_secs(1));
    /// # let _ = builder;
    /// ```
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How many times a single-node store retries connecting, with a growing
    /// delay, before a call fails (default 3: calls fail within about a
    /// second while the server is down, and the store reconnects by itself
    /// once it is back).
    ///
    /// ```
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// let builder = RedisStore::builder().reconnect_retries(1);
    /// # let _ = builder;
    /// ```
    pub fn reconnect_retries(mut self, retries: usize) -> Self {
        self.reconnect_retries = retries;
        self
    }

    /// Connects to a single node (`redis://[:password@]host[:port][/db]`,
    /// `rediss://…` where TLS is built in, `unix://…`). Fails if the server
    /// cannot be reached; afterwards the store reconnects by itself.
    ///
    /// ```no_run
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let store = RedisStore::builder().connect("redis://127.0.0.1:6379/0").await?;
    /// # Ok::<(), idem_runtime::StoreError>(())
    /// # }).unwrap();
    /// ```
    pub async fn connect(self, url: &str) -> Result<RedisStore, StoreError> {
        let (info, location) = parse(SINGLE, url)?;
        self.check_prefix(SINGLE, &location)?;
        let client =
            redis::Client::open(info).map_err(|e| StoreError::new(SINGLE, &location, e))?;
        let manager = ConnectionManager::new_with_config(client, self.manager_config())
            .await
            .map_err(|e| StoreError::new(SINGLE, &location, e))?;
        Ok(self.finish(Connection::Single(manager), SINGLE, location))
    }

    /// Like [`connect`](Self::connect), but connects on first use: a service
    /// can start while Redis is still down, and its calls fail with
    /// `Error::Store` (without running their bodies) until Redis is up. Only
    /// a malformed URL fails here. Call it inside a Tokio runtime.
    ///
    /// ```no_run
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let store = RedisStore::builder().connect_lazy("redis://127.0.0.1:6379")?;
    /// # Ok::<(), idem_runtime::StoreError>(())
    /// # }).unwrap();
    /// ```
    pub fn connect_lazy(self, url: &str) -> Result<RedisStore, StoreError> {
        let (info, location) = parse(SINGLE, url)?;
        self.check_prefix(SINGLE, &location)?;
        let client =
            redis::Client::open(info).map_err(|e| StoreError::new(SINGLE, &location, e))?;
        let manager = ConnectionManager::new_lazy_with_config(client, self.manager_config())
            .map_err(|e| StoreError::new(SINGLE, &location, e))?;
        Ok(self.finish(Connection::Single(manager), SINGLE, location))
    }

    /// Connects to a Redis Cluster through any of its nodes (all URLs share
    /// the cluster's password). The client follows the cluster's slot map and
    /// its redirections; because every record is one hash-tagged key, each
    /// operation lands on exactly one slot.
    ///
    /// ```no_run
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let store = RedisStore::builder()
    ///     .connect_cluster(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"])
    ///     .await?;
    /// # Ok::<(), idem_runtime::StoreError>(())
    /// # }).unwrap();
    /// ```
    pub async fn connect_cluster<I, S>(self, urls: I) -> Result<RedisStore, StoreError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut infos = Vec::new();
        for url in urls {
            infos.push(parse(CLUSTER, url.as_ref())?.0);
        }
        let location = infos
            .iter()
            .map(|i| i.addr().to_string())
            .collect::<Vec<_>>()
            .join(",");
        if infos.is_empty() {
            return Err(StoreError::new(
                CLUSTER,
                "no nodes",
                "connect_cluster needs at least one node URL",
            ));
        }
        self.check_prefix(CLUSTER, &location)?;
        let client = ClusterClientBuilder::new(infos)
            .connection_timeout(self.connection_timeout)
            .response_timeout(self.response_timeout)
            .build()
            .map_err(|e| StoreError::new(CLUSTER, &location, e))?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| StoreError::new(CLUSTER, &location, e))?;
        Ok(self.finish(Connection::Cluster(conn), CLUSTER, location))
    }

    fn manager_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connection_timeout))
            .set_response_timeout(Some(self.response_timeout))
            .set_number_of_retries(self.reconnect_retries)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500))
    }

    fn check_prefix(&self, backend: &'static str, location: &str) -> Result<(), StoreError> {
        if self.key_prefix.contains(['{', '}']) {
            return Err(StoreError::new(
                backend,
                location,
                format!(
                    "the key prefix {:?} contains a brace: it would replace the hash tag that places each record in its own cluster slot",
                    self.key_prefix
                ),
            ));
        }
        Ok(())
    }

    fn finish(self, conn: Connection, backend: &'static str, location: String) -> RedisStore {
        RedisStore {
            inner: Arc::new(Inner {
                conn,
                backend,
                location,
                key_prefix: self.key_prefix,
                max_result_bytes: self.max_result_bytes,
            }),
        }
    }
}

/// Parses a URL and names its address (host:port or a socket path), the only
/// part of it errors ever show.
fn parse(backend: &'static str, url: &str) -> Result<(ConnectionInfo, String), StoreError> {
    // redis-rs's parse errors describe the problem, not the URL.
    let info = url
        .into_connection_info()
        .map_err(|e| StoreError::new(backend, "an unparsable URL", e))?;
    let location = info.addr().to_string();
    Ok((info, location))
}

impl RedisStore {
    /// Connects to a single node with the defaults (see [`RedisStoreBuilder`]).
    ///
    /// ```no_run
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let store = RedisStore::connect("redis://:secret@127.0.0.1:6379").await?;
    /// # Ok::<(), idem_runtime::StoreError>(())
    /// # }).unwrap();
    /// ```
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        RedisStore::builder().connect(url).await
    }

    /// Connects to a Redis Cluster with the defaults (see
    /// [`RedisStoreBuilder::connect_cluster`]).
    ///
    /// ```no_run
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let store = RedisStore::connect_cluster([
    ///     "redis://127.0.0.1:7101",
    ///     "redis://127.0.0.1:7102",
    ///     "redis://127.0.0.1:7103",
    /// ])
    /// .await?;
    /// # Ok::<(), idem_runtime::StoreError>(())
    /// # }).unwrap();
    /// ```
    pub async fn connect_cluster<I, S>(urls: I) -> Result<RedisStore, StoreError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        RedisStore::builder().connect_cluster(urls).await
    }

    /// Configures a store.
    ///
    /// ```
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// let builder = RedisStore::builder().key_prefix("idem:");
    /// # let _ = builder;
    /// ```
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            key_prefix: "idem:".to_owned(),
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            connection_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(2),
            reconnect_retries: 3,
        }
    }

    /// The Redis key of a record, for `redis-cli` (`GET`, `PTTL`; the layout is in `record.rs`).
    ///
    /// ```no_run
    /// use idem_runtime::Key;
    /// use idem_runtime::store::redis::RedisStore;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
    /// let key = Key::builder("orders::create").part("c-1").finish();
    /// assert!(store.redis_key(&key).starts_with("idem:{"));
    /// # Ok::<(), idem_runtime::StoreError>(())
    /// # }).unwrap();
    /// ```
    pub fn redis_key(&self, key: &Key) -> String {
        // Only the part in braces decides the cluster slot: one record, one slot.
        // Built in one buffer: every operation names its record by this.
        let prefix = &self.inner.key_prefix;
        let mut name = vec![0u8; prefix.len() + 66];
        name[..prefix.len()].copy_from_slice(prefix.as_bytes());
        name[prefix.len()] = b'{';
        hex::encode_to_slice(
            key.as_bytes(),
            &mut name[prefix.len() + 1..prefix.len() + 65],
        )
        .expect("64 bytes hold 32 in hex");
        name[prefix.len() + 65] = b'}';
        String::from_utf8(name).expect("the prefix is a str and hex is ASCII")
    }

    fn conn(&self) -> Connection {
        self.inner.conn.clone()
    }

    fn err(&self, e: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> StoreError {
        StoreError::new(self.inner.backend, &*self.inner.location, e)
    }

    /// A command on one record failed. A record that is not a string is
    /// named as such: it is not one of ours, or was written by the earlier
    /// layout (a hash), and it was left as it is.
    fn err_at(&self, key: &str, e: redis::RedisError) -> StoreError {
        if e.code() == Some("WRONGTYPE") {
            return self.err(format!(
                "record {key} is not a string value: a hash of idem's earlier Redis layout, or \
                 another application's key under this prefix; left as it is (let it expire, or \
                 evict it)"
            ));
        }
        if e.code() == Some("IDEM_UNREADABLE") {
            return self.err(format!(
                "record {key} holds a value this version cannot read; left as it is"
            ));
        }
        self.err(e)
    }

    fn unreadable(&self, key: &str, e: Unreadable) -> StoreError {
        self.err(format!(
            "record {key} holds {e}, which this version cannot read; left as it is"
        ))
    }

    /// Runs one of the fenced scripts that answer 1 (done) or 0 (not the owner).
    async fn fenced(&self, script: &Script, key: &Key, args: &[&[u8]]) -> Result<bool, StoreError> {
        let name = self.redis_key(key);
        let mut invocation = script.key(&name);
        for a in args {
            invocation.arg(*a);
        }
        let done: i64 = invocation
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&name, e))?;
        Ok(done == 1)
    }

    /// Where SCAN must run: the one node, or one slot per cluster master.
    async fn scan_targets(&self) -> Result<Vec<Option<u16>>, StoreError> {
        let Connection::Cluster(mut conn) = self.conn() else {
            return Ok(vec![None]);
        };
        let slots = conn
            .route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )
            .await
            .map_err(|e| self.err(e))?;
        masters_first_slots(slots).map_err(|e| self.err(e))
    }

    async fn scan_step(
        &self,
        target: Option<u16>,
        cursor: u64,
        pattern: &str,
    ) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let reply = match (self.conn(), target) {
            (Connection::Cluster(mut conn), Some(slot)) => {
                // A slot the master owns routes the SCAN to that master and
                // keeps it there for every step of the cursor.
                let route = Route::new(slot, SlotAddr::Master);
                conn.route_command(
                    cmd,
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                )
                .await
            }
            (mut conn, _) => cmd.query_async::<Value>(&mut conn).await,
        }
        .map_err(|e| self.err(e))?;
        redis::from_redis_value::<(u64, Vec<Vec<u8>>)>(reply).map_err(|e| self.err(e.to_string()))
    }
}

/// The first slot of each master in a `CLUSTER SLOTS` reply.
fn masters_first_slots(reply: Value) -> Result<Vec<Option<u16>>, Malformed> {
    let Value::Array(ranges) = reply else {
        return Err(Malformed("CLUSTER SLOTS did not answer an array"));
    };
    let mut seen: Vec<(Vec<u8>, i64)> = Vec::new();
    let mut slots = Vec::new();
    for range in ranges {
        let Value::Array(parts) = range else {
            return Err(Malformed("a CLUSTER SLOTS range is not an array"));
        };
        let mut parts = parts.into_iter();
        let start = int(parts.next())?;
        let _end = parts.next();
        let Some(Value::Array(master)) = parts.next() else {
            return Err(Malformed("a CLUSTER SLOTS range has no master"));
        };
        let mut master = master.into_iter();
        let addr = (bytes(master.next())?, int(master.next())?);
        if !seen.contains(&addr) {
            seen.push(addr);
            let slot = u16::try_from(start).map_err(|_| Malformed("slot out of range"))?;
            slots.push(Some(slot));
        }
    }
    Ok(slots)
}

/// A reply that does not have the shape the scripts return.
#[derive(Debug)]
struct Malformed(&'static str);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unexpected reply: {}", self.0)
    }
}

impl std::error::Error for Malformed {}

fn bytes(v: Option<Value>) -> Result<Vec<u8>, Malformed> {
    match v {
        Some(Value::BulkString(b)) => Ok(b),
        Some(Value::SimpleString(s)) => Ok(s.into_bytes()),
        _ => Err(Malformed("expected a string")),
    }
}

fn int(v: Option<Value>) -> Result<i64, Malformed> {
    match v {
        Some(Value::Int(i)) => Ok(i),
        Some(Value::BulkString(b)) => std::str::from_utf8(&b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(Malformed("expected an integer")),
        _ => Err(Malformed("expected an integer")),
    }
}

/// A field or reply slot that may be absent: Lua's `false` is nil in RESP2
/// and a boolean in RESP3.
fn optional(v: Option<Value>) -> Option<Value> {
    match v {
        None | Some(Value::Nil) | Some(Value::Boolean(false)) => None,
        other => other,
    }
}

/// A stored fingerprint; empty (what claim.lua writes for none) or absent is none.
fn fingerprint(v: Option<Value>) -> Result<Option<Fingerprint>, Malformed> {
    let Some(b) = optional(v).map(|v| bytes(Some(v))).transpose()? else {
        return Ok(None);
    };
    if b.is_empty() {
        return Ok(None);
    }
    <[u8; 32]>::try_from(b.as_slice())
        .map(|a| Some(Fingerprint::from_bytes(a)))
        .map_err(|_| Malformed("a fingerprint is not 32 bytes"))
}

/// A record as inspect.lua reads it: the value, its expiry, and (while
/// PROCESSING) the lease end, which is the expiry minus the value's margin.
struct Inspected {
    record: Record,
    expires_at_millis: i64,
    lease_until_millis: i64,
}

/// Decodes inspect.lua's reply; `None` for a key that is gone (absent, or
/// expired and deleted by Redis).
fn read_inspected(reply: Value) -> Result<Option<Inspected>, RecordError> {
    let Value::Array(items) = reply else {
        return Err(RecordError::Malformed(Malformed(
            "inspect.lua did not answer an array",
        )));
    };
    let mut items = items.into_iter();
    let Some(value) = optional(items.next()) else {
        return Ok(None);
    };
    let value = bytes(Some(value))?;
    let expires_at_millis = int(items.next())?;
    let record = record::decode(&value)?;
    let lease_until_millis = match record {
        Record::Processing { .. } => {
            let (_, _, margin) = record::processing_tail(&value)?;
            expires_at_millis - i64::try_from(margin).unwrap_or(i64::MAX)
        }
        Record::Done { .. } | Record::Released => 0,
    };
    Ok(Some(Inspected {
        record,
        expires_at_millis,
        lease_until_millis,
    }))
}

/// A live record for `Store::inspect` (a released one is not live).
fn decode_record(reply: Value) -> Result<Option<RecordInfo>, RecordError> {
    let Some(found) = read_inspected(reply)? else {
        return Ok(None);
    };
    let (state, fence, result) = match found.record {
        Record::Released => return Ok(None),
        Record::Processing { fence, .. } => (RecordState::Processing, fence, None),
        Record::Done { fence, result, .. } => (RecordState::Done, fence, Some(result)),
    };
    Ok(Some(RecordInfo {
        state,
        fence,
        lease_until_millis: found.lease_until_millis,
        expires_at_millis: found.expires_at_millis,
        result,
    }))
}

/// What `stats` counts a record as.
enum Kind {
    Processing,
    Stalled,
    Done,
    Released,
}

/// Sorts one `inspect.lua` reply for `stats`; `None` for a key that is gone.
fn classify(reply: Value, now_millis: i64) -> Result<Option<Kind>, RecordError> {
    Ok(read_inspected(reply)?.map(|found| match found.record {
        Record::Released => Kind::Released,
        Record::Done { .. } => Kind::Done,
        Record::Processing { .. } if found.lease_until_millis > now_millis => Kind::Processing,
        Record::Processing { .. } => Kind::Stalled,
    }))
}

#[derive(Debug)]
enum RecordError {
    Malformed(Malformed),
    Unreadable(Unreadable),
}

impl From<Malformed> for RecordError {
    fn from(e: Malformed) -> Self {
        RecordError::Malformed(e)
    }
}

impl From<Unreadable> for RecordError {
    fn from(e: Unreadable) -> Self {
        RecordError::Unreadable(e)
    }
}

/// Escapes the glob characters of a SCAN `MATCH` pattern.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Durations travel as decimal milliseconds, capped where the scripts' Lua
/// numbers (doubles) still hold every millisecond exactly: about 35,000
/// years, longer than any lease or ttl means. At least 1: `PX 0` is an error.
fn millis(d: Duration) -> u64 {
    const MAX_EXACT: i64 = 1 << 50;
    duration_millis(d).clamp(1, MAX_EXACT) as u64
}

#[async_trait]
impl Store for RedisStore {
    fn backend(&self) -> &'static str {
        self.inner.backend
    }

    fn max_result_bytes(&self) -> usize {
        self.inner.max_result_bytes
    }

    /// One `SET … NX PX … GET` (claim.rs): one round trip, and a second
    /// (`reclaim.lua`) only after a release or beside another live owner.
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.claim_record(req).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        let code = [b'0' + completion.outcome.code()];
        let ttl = millis(completion.ttl).to_string();
        self.fenced(
            &SCRIPTS.complete,
            key,
            &[&token.0, &code, completion.payload, ttl.as_bytes()],
        )
        .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
        self.fenced(&SCRIPTS.release, key, &[&token.0]).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let lease = millis(lease).to_string();
        self.fenced(&SCRIPTS.renew, key, &[&token.0, lease.as_bytes()])
            .await
    }

    /// One `EVALSHA inspect.lua`: the value and its expiry, read together.
    async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
        let name = self.redis_key(key);
        let reply: Value = SCRIPTS
            .inspect
            .key(&name)
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&name, e))?;
        decode_record(reply).map_err(|e| match e {
            RecordError::Malformed(e) => self.err(e),
            RecordError::Unreadable(e) => self.unreadable(&name, e),
        })
    }

    /// One `DEL`, whatever the record's state.
    async fn evict(&self, key: &Key) -> Result<bool, StoreError> {
        self.fenced(&SCRIPTS.evict, key, &[&Token::random().0])
            .await
    }

    /// Deletes up to `limit` released records under this store's prefix.
    ///
    /// Expired records are never counted: Redis deletes them itself when
    /// their ttl ends, so there are none left to purge. Released records stay
    /// until their ttl (they carry the fence); purging deletes them sooner.
    /// Walks the keyspace with `SCAN` (on every master of a cluster), so run
    /// it from a sweeper, not on a request path.
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let pattern = format!("{}{{*}}", glob_escape(&self.inner.key_prefix));
        let mut purged = 0usize;
        for target in self.scan_targets().await? {
            let mut cursor = 0;
            loop {
                if purged >= limit {
                    return Ok(purged as u64);
                }
                let (next, keys) = self.scan_step(target, cursor, &pattern).await?;
                let mut rest = &keys[..];
                while !rest.is_empty() {
                    // Never more checks than deletions still allowed, so the
                    // limit holds; every key of the page is still looked at.
                    let (batch, tail) = rest.split_at(rest.len().min(limit - purged));
                    rest = tail;
                    // Concurrent calls share the one multiplexed connection:
                    // the whole batch goes out as a pipeline.
                    let deleted = join_all(batch.iter().map(|k| {
                        let mut conn = self.conn();
                        async move {
                            SCRIPTS
                                .purge
                                .key(k.as_slice())
                                .invoke_async::<i64>(&mut conn)
                                .await
                        }
                    }))
                    .await;
                    for d in deleted {
                        purged += usize::from(d.map_err(|e| self.err(e))? == 1);
                    }
                    if purged >= limit {
                        return Ok(purged as u64);
                    }
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok(purged as u64)
    }

    /// Walks this store's key prefix with `SCAN` (on every master of a
    /// cluster) and reads each record's state and lease with one `HMGET`,
    /// pipelined per page: about one round trip per 512 keys and a read of
    /// every record, so run it by hand, not on a request path. Records Redis
    /// already expired are gone and not counted; released ones count as dead.
    async fn stats(&self) -> Result<RecordStats, StoreError> {
        let pattern = format!("{}{{*}}", glob_escape(&self.inner.key_prefix));
        let now = self.server_millis().await?;
        let mut stats = RecordStats::default();
        for target in self.scan_targets().await? {
            let mut cursor = 0;
            loop {
                let (next, keys) = self.scan_step(target, cursor, &pattern).await?;
                // One read per key of the value and its expiry together (the
                // lease end is the expiry minus the value's margin).
                let replies = join_all(keys.iter().map(|k| {
                    let mut conn = self.conn();
                    async move {
                        SCRIPTS
                            .inspect
                            .key(k.as_slice())
                            .invoke_async::<Value>(&mut conn)
                            .await
                    }
                }))
                .await;
                for reply in replies {
                    let reply = match reply {
                        Ok(reply) => reply,
                        // A value that is no string: a hash of the earlier layout.
                        Err(e) if e.code() == Some("WRONGTYPE") => {
                            stats.unknown += 1;
                            continue;
                        }
                        Err(e) => return Err(self.err(e)),
                    };
                    match classify(reply, now) {
                        // Deleted (expired, evicted) between SCAN and the read.
                        Ok(None) => {}
                        Ok(Some(Kind::Processing)) => stats.processing += 1,
                        Ok(Some(Kind::Stalled)) => stats.stalled += 1,
                        Ok(Some(Kind::Done)) => stats.done += 1,
                        Ok(Some(Kind::Released)) => stats.dead += 1,
                        Err(_) => stats.unknown += 1,
                    }
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok(stats)
    }
}

impl RedisStore {
    /// The server's clock in milliseconds (`TIME`), as the scripts read it.
    async fn server_millis(&self) -> Result<i64, StoreError> {
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.err(e))?;
        Ok(secs * 1000 + micros / 1000)
    }
}

impl AsStore for RedisStore {
    fn as_store(&self) -> StoreRef {
        StoreRef::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_escape_keeps_plain_prefixes() {
        assert_eq!(glob_escape("idem:"), "idem:");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
