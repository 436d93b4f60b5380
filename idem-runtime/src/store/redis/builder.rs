//! Making a store: its options, connecting to one node or to a cluster, and
//! the checks that fail before any command is sent.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::{ConnectionInfo, IntoConnectionInfo};

use crate::error::StoreError;
use crate::redis_limits::{self, DEFAULT_PROTO_MAX_BULK_LEN};
use crate::store::DEFAULT_MAX_RESULT_BYTES;

use super::connection::Connection;
use super::earlier;
use super::record::DONE_HEAD_MAX;
use super::{Inner, RedisStore};

const SINGLE: &str = "redis";
const CLUSTER: &str = "redis-cluster";

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
    script_completion: bool,
}

impl RedisStoreBuilder {
    /// What every record's key starts with (default `idem:`); a record's key
    /// is the prefix followed by `{<32 hex>}`, the first half of the key's
    /// digest (earlier versions used all 64: see [`RedisStore`]). Give each
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
    /// Capped at what the server takes in one argument, its
    /// `proto-max-bulk-len` (read at connect; 512 MiB by default, and where
    /// the server does not say or with [`connect_lazy`](Self::connect_lazy)),
    /// less a record's head of 74 bytes: over it, Redis would close the
    /// connection under the completion and every call sharing it.
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

    /// Completes with `complete.lua` even where the server takes `SET … IFEQ`
    /// (by default a plain command there: see
    /// [`RedisStore::completes_with_set_ifeq`]). For comparisons, or a proxy
    /// in front of the server that passes `SET` but mangles `IFEQ`.
    ///
    /// ```
    /// let builder = idem_runtime::store::redis::RedisStore::builder().script_completion();
    /// # let _ = builder;
    /// ```
    pub fn script_completion(mut self) -> Self {
        self.script_completion = true;
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
        self.finish(Connection::Single(manager), SINGLE, location)
            .await
    }

    /// Like [`connect`](Self::connect), but connects on first use: a service
    /// can start while Redis is still down, and its calls fail with
    /// `Error::Store` (without running their bodies) until Redis is up. Only
    /// a malformed URL fails here. Call it inside a Tokio runtime. With no
    /// server to ask at start, completions use `complete.lua` on every server.
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
        // Nothing to ask yet: completions take the script, which every
        // server runs, and results are capped by the default limit.
        // Records under the earlier layout's names are looked for once the
        // server answers (earlier.rs); claims read those names until then.
        Ok(self.build(
            Connection::Single(manager),
            SINGLE,
            location,
            false,
            DEFAULT_PROTO_MAX_BULK_LEN,
            false,
        ))
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
        self.finish(Connection::Cluster(conn), CLUSTER, location)
            .await
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

    async fn finish(
        self,
        conn: Connection,
        backend: &'static str,
        location: String,
    ) -> Result<RedisStore, StoreError> {
        let set_ifeq = !self.script_completion
            && takes_set_ifeq(conn.clone(), &self.key_prefix)
                .await
                .map_err(|e| StoreError::new(backend, &location, e))?;
        let max_bulk_len = redis_limits::proto_max_bulk_len(&mut conn.clone())
            .await
            .map_err(|e| StoreError::new(backend, &location, e))?;
        let none_earlier = earlier::marker_set(&mut conn.clone(), &self.key_prefix)
            .await
            .map_err(|e| StoreError::new(backend, &location, e))?;
        Ok(self.build(
            conn,
            backend,
            location,
            set_ifeq,
            max_bulk_len,
            none_earlier,
        ))
    }

    fn build(
        self,
        conn: Connection,
        backend: &'static str,
        location: String,
        set_ifeq: bool,
        max_bulk_len: usize,
        none_earlier: bool,
    ) -> RedisStore {
        // A result travels as one argument: the DONE record (`SET … IFEQ`) or
        // the payload beside it (`complete.lua`).
        let max_result_bytes = self
            .max_result_bytes
            .min(max_bulk_len.saturating_sub(DONE_HEAD_MAX));
        if max_result_bytes < self.max_result_bytes {
            tracing::warn!(
                asked = self.max_result_bytes,
                kept = max_result_bytes,
                proto_max_bulk_len = max_bulk_len,
                location = %location,
                "max_result_bytes lowered to what the server takes in one argument"
            );
        }
        let inner = Arc::new(Inner {
            conn,
            backend,
            location,
            key_prefix: self.key_prefix,
            max_result_bytes,
            set_ifeq,
            held: super::complete::Held::new(),
            earlier: earlier::EarlierNames::new(none_earlier),
        });
        if !none_earlier {
            earlier::start_survey(&inner);
        }
        RedisStore { inner }
    }
}

/// Whether the server accepts `SET … IFEQ`: a conditional set of a key that
/// does not exist writes nothing and answers nil where it does, and a syntax
/// error where it does not. (A cluster is asked through the node owning the
/// probe key; its nodes are assumed to run one version.)
async fn takes_set_ifeq(mut conn: Connection, prefix: &str) -> Result<bool, redis::RedisError> {
    let probe: Result<Option<Vec<u8>>, redis::RedisError> = redis::cmd("SET")
        .arg(format!("{prefix}{{ifeq-probe}}"))
        .arg("")
        .arg("IFEQ")
        .arg("a value nobody writes")
        .query_async(&mut conn)
        .await;
    match probe {
        Ok(_) => Ok(true),
        Err(e)
            if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError)
                || e.code().is_some() =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
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
            script_completion: false,
        }
    }
}
