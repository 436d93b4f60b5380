//! Records in Redis, on a single node or a Redis Cluster.
//!
//! Each record is one string value at `<prefix>{<32 hex>}`, the first 16
//! bytes of the key's digest in hex: its
//! kind (PROCESSING, DONE or RELEASED), the owner token (kept once done: a
//! re-sent completion recognises itself by it), the fingerprint, the fence,
//! and once done the outcome and result (the layout is in `record.rs`). The
//! key's own expiry is the record's life, and the lease end is kept as a
//! margin before it, so no operation needs to read a clock.
//!
//! One file per operation, next to this one: `claim.rs` (one plain
//! `SET … NX PX … GET`, and `reclaim.lua` on its rare path), `complete.rs`
//! (one plain `SET … IFEQ` where the server has it) and `complete.lua`,
//! `release.lua`, `renew.lua`, `inspect.lua`, `purge.lua` and `evict.lua`. Scripts run
//! with `EVALSHA` and are loaded again by themselves when the server answers
//! `NOSCRIPT` (after a restart, a failover or `SCRIPT FLUSH`). Around them:
//! `builder.rs` (options and connecting), `connection.rs` (one node or a
//! cluster behind one type), `reply.rs` (decoding the scripts' replies),
//! `scan.rs` (walking the keyspace for `purge_expired` and `stats`) and
//! `earlier.rs` with `adopt.lua` (records under the earlier layout's names).
//!
//! # The names changed
//!
//! Versions before this one named a record `<prefix>{<64 hex>}`, the whole
//! digest. The name is now half as long: on Valkey 8.1 a first call's DONE
//! record (a 40-byte result) takes 144 bytes (`MEMORY USAGE`) where it took
//! 176, on Redis 7.0 168 where it took 200, as a name of up to 43 bytes keeps
//! the key in a smaller allocation. Records under the earlier names are not
//! missed: while any may remain, each claim also reads its key's earlier name
//! in the same round trip and moves a record it finds over its own claim
//! before anything runs (a DONE one is replayed, a live claim makes it
//! Busy, a released or abandoned one is taken over with its next fence), and
//! inspect, evict, `stats`, `purge_expired` and the recovery worker find them
//! too. A marker key, `<prefix>{layout}:short-names`, written once a walk of
//! the keyspace finds none, ends this: a store that finds it at connect (one
//! `GET`) never reads an earlier name ([`RedisStore::reads_earlier_names`]).
//! **Stop every process of the earlier version before this one starts**: they
//! never look at the new names, so during a rolling deploy across the change
//! each version could run a key once.
//!
//! Why these choices:
//! - one value per record, written whole by one command or one script:
//!   status, owner and result can never disagree, whatever crashes between
//!   two commands (the reference flow kept status and result in two keys
//!   written one after the other);
//! - the claim is a plain command, the cheapest thing Redis runs: a first
//!   call costs one `SET` and one `EVALSHA` (the compare-and-set completion;
//!   on servers with `SET … IFEQ`, a second plain `SET`: complete.rs), a
//!   replay one `SET`;
//! - a lease separate from the ttl: a crashed owner blocks its key for the
//!   lease, not for the whole ttl, and its record stays until the ttl, so a
//!   takeover counts on from its fence;
//! - the hash tag `{…}` around the key's hex: a Redis Cluster places the key by
//!   the tag alone, and since every command touches exactly one key (or a
//!   record and its recovery arguments, `<name>:recovery`, under the same
//!   tag) none is ever CROSSSLOT; the same code runs on one node and on a
//!   cluster. 32 hex digits, not 32 raw bytes: a raw `}` would end the tag
//!   early, and the names stay readable in `redis-cli`;
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
//!
//! # Limits of Redis and Valkey
//!
//! What the server answers at its edges, and what the store makes of it. A row
//! whose test says `none yet` is not checked against a real server.
//!
//! | limit or odd answer | what Redis/Valkey does | what idem does | test |
//! |---|---|---|---|
//! | one value over `proto-max-bulk-len` (512 MiB by default) | `-ERR Protocol error: invalid bulk length` and the connection closes, failing every command queued on it | a record is the result plus a head of at most 74 bytes; `max_result_bytes` (1 MiB by default) is capped at connect to the server's `proto-max-bulk-len` less that head (512 MiB is assumed with `connect_lazy` or where `CONFIG GET` is refused), so a larger result is not stored: the caller gets it, duplicates get `ResultTooLarge` | at the 1 MiB default cap: `tests/redis/main.rs::redis_single::outcomes_and_payloads_round_trip` (`tests/src/conformance.rs`); at the server's limit (lowered to 1 MiB): `tests/redis/limits.rs::max_result_bytes_is_capped_to_what_proto_max_bulk_len_takes` |
//! | `SET … IFEQ` (Valkey 8.1 and later only) | Redis answers a syntax error | the completion is one plain `SET … IFEQ` where the server has it, `complete.lua` elsewhere | `tests/redis/completion.rs::the_completion_is_one_plain_set_ifeq_exactly_where_the_server_has_it` |
//! | scripts forgotten (restart, failover, `SCRIPT FLUSH`) | `EVALSHA` answers `NOSCRIPT` | loads the script again and runs it | `tests/redis/scripts.rs::single_node_reloads_scripts_after_script_flush`, `tests/redis/scripts.rs::cluster_reloads_scripts_after_script_flush` |
//! | a reply lost with the connection | the command may have run | a claim sent again under its token recognises itself; a completion sent again is the same completion; a claim whose completion never arrives is taken over after the lease | `tests/redis/claim.rs::single_node_recognises_a_resent_claim`, `tests/redis/records.rs::single_node_resent_complete_is_the_same_completion`, `tests/redis/fail_closed.rs::connection_lost_between_claim_and_complete_is_taken_over_after_the_lease` |
//! | `maxmemory` | `noeviction`: writes answer `-OOM`; `allkeys-*` and `volatile-*` (every record has a ttl) evict silently | a claim refused with `-OOM` fails closed (`Error::Store` naming the refusal, the body not run); so does a duplicate of a completed call, as the claim is a write, instead of replaying. An evicted record lets a duplicate run again: use `noeviction` | `noeviction`: `tests/redis/limits.rs::maxmemory_with_noeviction_fails_closed`; eviction: `tests/redis/limits.rs::maxmemory_with_an_evicting_policy_lets_a_duplicate_run_again` (`allkeys-lru`) |
//! | failover with asynchronous replication | the last acknowledged writes can be lost | claims lost that way let a duplicate run: keep a unique constraint behind Redis | none yet (not tested: needs a replica promoted while the claim is still unreplicated, i.e. two servers with their link held and a failover; the loss is Redis's documented behaviour, which idem cannot detect) |
//! | Cluster slots | a command over keys of two slots is `CROSSSLOT`; `MOVED`/`ASK` redirect | every command touches one key, placed by its `{…}` hash tag (a record's recovery arguments share it; its earlier name is read by commands of its own) | `tests/redis/claim.rs::cluster_keys_are_hash_tagged_and_spread`, `tests/redis/layout.rs::cluster_every_key_of_a_record_is_in_one_slot`, `tests/redis/layout.rs::cluster_honours_records_under_their_earlier_names` |
//! | a value at a record's key this version cannot read | answers whatever is there | fails closed with a `StoreError` and leaves it alone | `tests/redis/records.rs::single_node_unknown_state_fails_closed`, `tests/redis/records.rs::single_node_earlier_layout_is_a_clear_error` |
//! | server down or slow | connection refused, or no answer | fails closed within `response_timeout` (2 s) and reconnects by itself | `tests/redis/fail_closed.rs::redis_stopped_mid_test_fails_closed`, `tests/redis/fail_closed.rs::closed_port_fails_closed_without_showing_the_password` |
//!
//! ```no_run
//! use idem_runtime::store::redis::RedisStore;
//!
//! # async fn run() -> Result<(), idem_runtime::StoreError> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! // Valkey ≥ 8.1 and Redis ≥ 8.4 complete with one `SET … IFEQ`:
//! let one_command = store.completes_with_set_ifeq();
//! idem_runtime::install(store);
//! # let _ = one_command; Ok(()) }
//! ```

mod builder;
mod claim;
mod complete;
mod connection;
mod earlier;
mod record;
mod recovery;
mod reply;
mod scan;

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::{Script, Value};

use crate::clock::duration_millis;
use crate::error::StoreError;
use crate::key::Key;
use crate::store::{
    Abandoned, Claim, ClaimRequest, Completion, RecordInfo, RecordStats, RecoveryArgs,
    RecoveryInfo, RecoveryTurn, Store, Token, Turn,
};
use connection::Connection;
use record::Unreadable;
use reply::{RecordError, decode_record};

pub use builder::RedisStoreBuilder;

/// Hex digits of the key's digest in a record's name: its first 16 bytes.
const NAME_HEX: usize = 32;

/// The scripts, hashed once per process (`complete.lua` runs only where the
/// server has no `SET … IFEQ`: complete.rs).
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
/// What each operation sends:
///
/// - **claim**: one `SET … NX PX … GET` (one round trip); a second,
///   `reclaim.lua`, only after a release or beside another live owner. While
///   records may remain under the earlier layout's names
///   ([`reads_earlier_names`](RedisStore::reads_earlier_names)), a `GET` and
///   a `PTTL` of that name go beside it, in the same round trip;
/// - **complete**: one `SET … IFEQ … PX` where the server has it (Valkey ≥
///   8.1, Redis ≥ 8.4, learnt at connect), `complete.lua` elsewhere;
/// - **inspect**: one `EVALSHA inspect.lua` (the value and its expiry
///   together); **evict**: one `EVALSHA evict.lua`, which ends a live
///   record without deleting it, so its fence keeps growing;
/// - **purge_expired** and **stats**: walk the store's key prefix with `SCAN`
///   (on every master of a cluster), pipelined per page: run them from a
///   sweeper or by hand, never on a request path;
/// - **claim_recoverable**: indexes the key in its scope (one pipelined `SADD`
///   and `ZADD` on the `{recovery}` slot), then claims with `reclaim.lua`,
///   which writes the arguments beside the record: two round trips;
///   **abandoned** reads the scope's due index (`ZRANGEBYSCORE`) and one
///   `EVALSHA peek.lua` per entry; **recovery_scopes** names every scope ever
///   indexed on the prefix (a set that only grows).
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
    /// The server takes `SET … IFEQ` (complete.rs), and the store uses it.
    set_ifeq: bool,
    /// The PROCESSING records held, for `IFEQ` (empty without it).
    held: complete::Held,
    /// Whether records may remain under the earlier layout's names (earlier.rs).
    earlier: earlier::EarlierNames,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("backend", &self.inner.backend)
            .field("location", &self.inner.location)
            .field("key_prefix", &self.inner.key_prefix)
            .field("max_result_bytes", &self.inner.max_result_bytes)
            .field("set_ifeq", &self.inner.set_ifeq)
            .finish()
    }
}
impl RedisStore {
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
        self.inner.redis_key(key)
    }

    /// Whether completions are one `SET … IFEQ` (Valkey ≥ 8.1, Redis ≥ 8.4,
    /// learnt at connect) rather than `complete.lua`.
    ///
    /// ```no_run
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let store = idem_runtime::store::redis::RedisStore::connect("redis://127.0.0.1:6379").await?;
    /// println!("plain-command completion: {}", store.completes_with_set_ifeq());
    /// # Ok::<(), idem_runtime::StoreError>(())
    /// # }).unwrap();
    /// ```
    pub fn completes_with_set_ifeq(&self) -> bool {
        self.inner.set_ifeq
    }
}

/// A command met a key that is not a string (`WRONGTYPE`). A pipeline's
/// failure carries the server's error in its text, not in its code.
fn is_wrongtype(e: &redis::RedisError) -> bool {
    e.code() == Some("WRONGTYPE") || e.to_string().contains("WRONGTYPE")
}

impl Inner {
    fn redis_key(&self, key: &Key) -> String {
        // Only the part in braces decides the cluster slot: one record, one slot.
        // Half the digest: a name of up to 43 bytes is what keeps a small
        // record in Valkey's smaller allocation (see the module's doc), and
        // 128 bits still take 2^64 records for a chance collision and 2^128
        // tries to aim one. Hex, not raw bytes: a raw `}` would end the hash
        // tag early, and the name stays readable in `redis-cli`.
        // Built in one buffer: every operation names its record by this.
        // (Not `vec![0; n]`: zeroed memory comes from `calloc`, slower
        // than the bytes written over it.)
        let prefix = &self.key_prefix;
        let mut digest_hex = [0u8; NAME_HEX];
        hex::encode_to_slice(&key.as_bytes()[..NAME_HEX / 2], &mut digest_hex)
            .expect("the hex holds the bytes");
        let mut name = String::with_capacity(prefix.len() + NAME_HEX + 2);
        name.push_str(prefix);
        name.push('{');
        name.push_str(std::str::from_utf8(&digest_hex).expect("hex is ASCII"));
        name.push('}');
        name
    }

    fn conn(&self) -> Connection {
        self.conn.clone()
    }

    fn err(&self, e: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> StoreError {
        StoreError::new(self.backend, &*self.location, e)
    }

    /// A command on one record failed. A record that is not a string is
    /// named as such: it is not one of ours, or was written by the earlier
    /// layout (a hash), and it was left as it is.
    fn err_at(&self, key: &str, e: redis::RedisError) -> StoreError {
        if is_wrongtype(&e) {
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
}

/// Durations travel as decimal milliseconds, capped where the scripts' Lua
/// numbers (doubles) still hold every millisecond exactly: about 35,000
/// years, longer than any lease or ttl means. At least 1: `PX 0` is an error.
fn millis(d: Duration) -> u64 {
    const MAX_EXACT: i64 = 1 << 50;
    duration_millis(d).clamp(1, MAX_EXACT) as u64
}

impl Store for Inner {
    fn backend(&self) -> &'static str {
        self.backend
    }

    fn max_result_bytes(&self) -> usize {
        self.max_result_bytes
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
        self.complete_record(key, token, completion).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
        if self.set_ifeq {
            self.held.take(key, token);
        }
        self.fenced(&SCRIPTS.release, key, &[token.as_bytes()])
            .await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let name = self.redis_key(key);
        let margin: i64 = SCRIPTS
            .renew
            .key(&name)
            .arg(token.as_bytes())
            .arg(millis(lease).to_string())
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&name, e))?;
        if margin <= 0 {
            return Ok(false);
        }
        if self.set_ifeq {
            self.held.renewed(key, token, (margin - 1) as u64);
        }
        Ok(true)
    }

    /// One `EVALSHA inspect.lua`: the value and its expiry, read together.
    async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
        self.adopt_earlier(key).await?;
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

    /// One `evict.lua`: a DONE record is released and a PROCESSING one left
    /// under a token nobody holds with its lease ended, both keeping their
    /// fence (a `DEL` would start the next claim at fence 1 beside an owner
    /// that may still hold 1).
    async fn evict(&self, key: &Key) -> Result<bool, StoreError> {
        // An earlier name holding what no version reads (a hash of the oldest
        // layout) goes too: evicting is the operator's way out of it.
        let earlier = match self.adopt_earlier(key).await {
            Err(_) if self.earlier_is_not_a_record(key).await => Some(self.earlier_name(key)),
            other => other?,
        };
        let evicted = self
            .fenced(&SCRIPTS.evict, key, &[Token::random().as_bytes()])
            .await?;
        if let Some(name) = earlier {
            // The new name was taken (a claim that had not yet moved this
            // one over itself): once evicted, nothing may bring it back.
            self.evict_earlier(&name).await?;
        }
        Ok(evicted)
    }

    /// Deletes up to `limit` released records under this store's prefix.
    ///
    /// Expired records are never counted: Redis deletes them itself when
    /// their ttl ends, so there are none left to purge. Released records stay
    /// until their ttl (they carry the fence); purging deletes them sooner.
    /// Walks the keyspace with `SCAN` (on every master of a cluster), so run
    /// it from a sweeper, not on a request path.
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.purge_released(limit).await
    }

    /// Walks this store's key prefix with `SCAN` (on every master of a
    /// cluster) and reads each record's value and expiry with one `EVALSHA
    /// inspect.lua`, pipelined per page: about one round trip per 512 keys and a read of
    /// every record, so run it by hand, not on a request path. Records Redis
    /// already expired are gone and not counted; released ones count as dead.
    async fn stats(&self) -> Result<RecordStats, StoreError> {
        self.count_records().await
    }

    /// Indexes the key in its scope (one pipelined `SADD` and `ZADD` on the
    /// `{recovery}` slot), then claims with `reclaim.lua`, which writes the
    /// arguments beside the record in the same step (recovery.rs): two round
    /// trips where a plain claim takes one.
    async fn claim_recoverable(
        &self,
        req: ClaimRequest<'_>,
        recovery: RecoveryArgs<'_>,
    ) -> Result<Claim, StoreError> {
        self.claim_recoverable_record(req, recovery).await
    }

    /// Every scope ever indexed on this prefix (a set that only grows).
    async fn recovery_scopes(&self) -> Result<Vec<String>, StoreError> {
        self.recovery_scope_names().await
    }

    /// Reads the scope's due index entries (`ZRANGEBYSCORE`), one `EVALSHA
    /// peek.lua` per entry, and tidies the index on the way (recovery.rs).
    async fn abandoned(&self, scope: &str, limit: usize) -> Result<Vec<Abandoned>, StoreError> {
        self.abandoned_records(scope, limit).await
    }

    async fn take_recovery(&self, key: &Key, turn: RecoveryTurn<'_>) -> Result<Turn, StoreError> {
        self.take_turn(key, turn).await
    }

    async fn recovery_info(&self, key: &Key) -> Result<Option<RecoveryInfo>, StoreError> {
        self.recovery_state(key).await
    }

    async fn retry_recovery(&self, key: &Key) -> Result<bool, StoreError> {
        self.retry_record(key).await
    }
}

forward_store!(RedisStore => inner);
