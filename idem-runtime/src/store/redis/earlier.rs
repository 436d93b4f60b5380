//! Records under the earlier layout's names, `<prefix>{<64 hex of the key>}`,
//! written before the names shortened to 32 hex: found, and moved to their
//! new names, for as long as any may remain.
//!
//! A DONE record lives its ttl (7 days by default), so after an upgrade a
//! retry may meet its call's record under the earlier name only. Missing it
//! would run the body a second time; missing a live PROCESSING one would run
//! it beside its owner. So while such records may remain:
//!
//! - a claim reads the earlier name beside its own first command, in the same
//!   round trip (the two names are in different cluster slots, so they go
//!   side by side, never as one multi-key command). If it saw a record there
//!   and it then holds the key, it reads the earlier name again, now that its
//!   claim stands, and if the record is still there moves it over its own
//!   claim (`adopt.lua`, only if the key still holds exactly that claim) and
//!   deletes it, then claims once more with `reclaim.lua`, which judges the
//!   moved record as any: a DONE one is replayed, a live claim is Busy, a
//!   released or abandoned one is taken over with its next fence;
//! - inspect, evict and the recovery worker's operations first move an
//!   earlier record whose new name is absent.
//!
//! Why it holds: earlier-named records are never created again (the earlier
//! version's processes are stopped before this one starts: the CHANGELOG says
//! so), so a read that finds none is final. A key under the new name exists
//! only after a claim that read the earlier name, and its holder does not
//! run the body before the adoption above: a record left unadopted under the
//! new name (its claimer stopped between the two steps) is still checked by
//! whoever acquires the key next.
//!
//! And when none can remain: at connect the store reads one marker key,
//! `<prefix>{layout}:short-names`, which says so; without it, a task walks
//! the keyspace (SCAN with a `MATCH` of the earlier shape, on every master of
//! a cluster) and reads each earlier record's expiry. Finding none, it writes
//! the marker; finding some, the store reads earlier names until the last of
//! them expires, and a store connecting after that finds none and writes the
//! marker. A fresh deployment pays one `GET` at connect and nothing per call.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use futures_util::future::join_all;
use redis::{Script, Value};

use super::connection::Connection;
use super::reply::int;
use super::scan::glob_escape;
use super::{Inner, RedisStore};
use crate::clock::{Clock, SystemClock};
use crate::error::StoreError;
use crate::key::Key;

static ADOPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("adopt.lua")));

/// Until when earlier-named records may remain, as this process's clock in
/// milliseconds: 0 once none can, `UNKNOWN` until the keyspace was looked at.
pub(super) struct EarlierNames {
    until_ms: AtomicI64,
}

const UNKNOWN: i64 = i64::MAX;

impl EarlierNames {
    pub(super) fn new(none_left: bool) -> EarlierNames {
        EarlierNames {
            until_ms: AtomicI64::new(if none_left { 0 } else { UNKNOWN }),
        }
    }

    /// Whether a record may still be under its earlier name: a claim then
    /// reads that name too.
    pub(super) fn may_remain(&self) -> bool {
        match self.until_ms.load(Relaxed) {
            0 => false,
            UNKNOWN => true,
            until if SystemClock.now_millis() < until => true,
            until => {
                // Passed: no clock read per claim from here on.
                let _ = self.until_ms.compare_exchange(until, 0, Relaxed, Relaxed);
                false
            }
        }
    }
}

/// A field of a recovery hash and its value.
type Field = (Vec<u8>, Vec<u8>);

/// A record found under its earlier name.
pub(super) struct EarlierRecord {
    name: String,
    value: Vec<u8>,
    /// Its `PTTL` (-1: no expiry).
    pttl: i64,
}

/// The marker key that says no earlier-named record can remain. Not of the
/// shape `{…}` that `scan.rs` takes for a record.
fn marker(prefix: &str) -> String {
    format!("{prefix}{{layout}}:short-names")
}

/// Whether the marker is there (one `GET`, at connect).
pub(super) async fn marker_set(conn: &mut Connection, prefix: &str) -> redis::RedisResult<bool> {
    let v: Option<Vec<u8>> = redis::cmd("GET")
        .arg(marker(prefix))
        .query_async(conn)
        .await?;
    Ok(v.is_some())
}

/// Looks for earlier-named records in the background until it knows (a
/// failure is tried again, less and less often, while the store lives).
pub(super) fn start_survey(store: &Arc<Inner>) {
    let weak: Weak<Inner> = Arc::downgrade(store);
    tokio::spawn(async move {
        let mut wait = Duration::from_millis(500);
        loop {
            let Some(inner) = weak.upgrade() else {
                return;
            };
            match inner.survey().await {
                Ok(()) => return,
                Err(e) => tracing::warn!(
                    error = %e,
                    "could not look for records under the earlier Redis key names; \
                     claims read those names too until it can"
                ),
            }
            drop(inner);
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(60));
        }
    });
}

impl Inner {
    /// A record's name in the earlier layout.
    pub(super) fn earlier_name(&self, key: &Key) -> String {
        format!("{}{{{}}}", self.key_prefix, key.to_hex())
    }

    /// Reads the earlier name: its value and `PTTL`, pipelined (one slot).
    pub(super) async fn read_earlier(
        &self,
        key: &Key,
    ) -> Result<Option<EarlierRecord>, StoreError> {
        let name = self.earlier_name(key);
        let (value, pttl): (Option<Vec<u8>>, i64) = redis::pipe()
            .get(&name)
            .pttl(&name)
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&name, e))?;
        // -2: gone; 0: expiring this millisecond, as good as gone (moved
        // with it, it would be written with no expiry at all).
        Ok(value
            .filter(|_| pttl == -1 || pttl > 0)
            .map(|value| EarlierRecord { name, value, pttl }))
    }

    /// Moves `earlier` to the key's new name (with its recovery hash) if
    /// that holds `expected` (empty: nothing), then deletes the earlier keys.
    /// Whether it moved it.
    async fn adopt(
        &self,
        key: &Key,
        expected: &[u8],
        earlier: &EarlierRecord,
    ) -> Result<bool, StoreError> {
        let name = self.redis_key(key);
        let earlier_hash = format!("{}:recovery", earlier.name);
        let mut invocation = ADOPT.key(&name);
        invocation
            .key(self.recovery_hash(key))
            .arg(expected)
            .arg(&earlier.value)
            .arg(earlier.pttl);
        if earlier.value.starts_with(b"P1") {
            // Only a claim has arguments that count.
            let (fields, pttl): (Vec<Field>, i64) = redis::pipe()
                .hgetall(&earlier_hash)
                .pttl(&earlier_hash)
                .query_async(&mut self.conn())
                .await
                .map_err(|e| self.err_at(&earlier_hash, e))?;
            invocation.arg(pttl);
            for (field, value) in fields {
                invocation.arg(field).arg(value);
            }
        } else {
            invocation.arg(-2);
        }
        let reply: Value = invocation
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&name, e))?;
        let Value::Array(items) = reply else {
            return Err(self.err("unexpected reply: adopt.lua did not answer an array"));
        };
        let moved = int(items.into_iter().next()).map_err(|e| self.err(e))? == 1;
        if moved {
            self.forget_earlier(&earlier.name).await?;
        }
        Ok(moved)
    }

    /// Deletes an earlier record and its recovery hash (one slot).
    async fn forget_earlier(&self, name: &str) -> Result<(), StoreError> {
        let _: i64 = redis::cmd("DEL")
            .arg(name)
            .arg(format!("{name}:recovery"))
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(name, e))?;
        Ok(())
    }

    /// After a claim that saw an earlier record acquired the key holding
    /// `ours`: reads the earlier name again and moves what is still there
    /// over the claim. Whether it moved one (the caller then claims again).
    /// A claim that changed under it fails closed: something else acts on
    /// the key, and the earlier record must not be passed over.
    pub(super) async fn adopt_over(&self, key: &Key, ours: &[u8]) -> Result<bool, StoreError> {
        let Some(earlier) = self.read_earlier(key).await? else {
            return Ok(false);
        };
        if self.adopt(key, ours, &earlier).await? {
            return Ok(true);
        }
        Err(self.err(format!(
            "record {} changed while the record under its earlier name {} was being moved to it; \
             nothing was run, try again",
            self.redis_key(key),
            earlier.name
        )))
    }

    /// Before an operation on an existing record (inspect, evict, the
    /// recovery worker's): moves an earlier record whose new name is absent.
    /// The earlier record's name if it stays (the new name was taken).
    pub(super) async fn adopt_earlier(&self, key: &Key) -> Result<Option<String>, StoreError> {
        if !self.earlier.may_remain() {
            return Ok(None);
        }
        let Some(earlier) = self.read_earlier(key).await? else {
            return Ok(None);
        };
        if self.adopt(key, b"", &earlier).await? {
            return Ok(None);
        }
        Ok(Some(earlier.name))
    }

    /// Whether the key's earlier name holds something other than a string
    /// (a hash of the oldest layout), which no operation can move.
    pub(super) async fn earlier_is_not_a_record(&self, key: &Key) -> bool {
        let kind: Result<String, _> = redis::cmd("TYPE")
            .arg(self.earlier_name(key))
            .query_async(&mut self.conn())
            .await;
        matches!(kind.as_deref(), Ok(k) if k != "string" && k != "none")
    }

    /// Evict's part for an earlier record the new name did not take: it goes.
    pub(super) async fn evict_earlier(&self, name: &str) -> Result<(), StoreError> {
        self.forget_earlier(name).await
    }

    /// Walks the keyspace for earlier-named records (see the module's doc).
    async fn survey(&self) -> Result<(), StoreError> {
        let mut conn = self.conn();
        if marker_set(&mut conn, &self.key_prefix)
            .await
            .map_err(|e| self.err(e))?
        {
            self.earlier.until_ms.store(0, Relaxed);
            return Ok(());
        }
        let pattern = format!(
            "{}{{{}}}",
            glob_escape(&self.key_prefix),
            "[0-9a-f]".repeat(64)
        );
        let started = SystemClock.now_millis();
        // When the last record found expires: each PTTL counted from when its
        // reply came back. (Counted from the walk's start, the reads would end
        // early by as long as the walk took, minutes on a large keyspace.)
        let mut last_expiry: i64 = 0;
        for target in self.scan_targets().await? {
            let mut cursor = 0;
            loop {
                let (next, keys) = self.scan_step(target, cursor, &pattern).await?;
                let pttls = join_all(keys.iter().map(|k| {
                    let mut conn = self.conn();
                    async move {
                        redis::cmd("PTTL")
                            .arg(k.as_slice())
                            .query_async::<i64>(&mut conn)
                            .await
                    }
                }))
                .await;
                let read_at = SystemClock.now_millis();
                for pttl in pttls {
                    last_expiry = match pttl.map_err(|e| self.err(e))? {
                        -1 => UNKNOWN,
                        p if p >= 0 => last_expiry.max(read_at.saturating_add(p)),
                        _ => last_expiry,
                    };
                    if last_expiry == UNKNOWN {
                        // One without an expiry: read earlier names for as
                        // long as this store lives.
                        self.earlier.until_ms.store(UNKNOWN, Relaxed);
                        return Ok(());
                    }
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        if last_expiry > 0 {
            self.earlier.until_ms.store(last_expiry.max(1), Relaxed);
            return Ok(());
        }
        let _: () = redis::cmd("SET")
            .arg(marker(&self.key_prefix))
            .arg(started)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        self.earlier.until_ms.store(0, Relaxed);
        Ok(())
    }
}

impl RedisStore {
    /// Whether this store still looks for records under the key names of
    /// idem's earlier Redis layout (`<prefix>{<64 hex>}`): true from connect
    /// until a walk of the keyspace finds none or the last one found expires;
    /// false at once where the marker key says none can remain. While true,
    /// each claim also reads its key's earlier name, in the same round trip.
    ///
    /// ```no_run
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let store = idem_runtime::store::redis::RedisStore::connect("redis://127.0.0.1:6379").await?;
    /// println!("reading earlier names: {}", store.reads_earlier_names());
    /// # Ok::<(), idem_runtime::StoreError>(())
    /// # }).unwrap();
    /// ```
    pub fn reads_earlier_names(&self) -> bool {
        self.inner.earlier.may_remain()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_is_not_taken_for_a_record() {
        let m = marker("idem:");
        assert!(!m.ends_with('}'), "{m}");
    }
}
