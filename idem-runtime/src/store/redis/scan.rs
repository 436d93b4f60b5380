//! What walks the keyspace: `SCAN` on the one node or on every cluster
//! master, and the two operations built on it, purging released records and
//! counting records by state.

use futures_util::future::join_all;
use redis::Value;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};

use crate::error::StoreError;
use crate::store::RecordStats;

use super::connection::Connection;
use super::record::Record;
use super::reply::{Malformed, RecordError, bytes, int, read_inspected};
use super::{Inner, SCRIPTS};

/// Keys a SCAN step asks for; each step is one round trip per node.
const SCAN_COUNT: usize = 512;

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

/// Escapes the glob characters of a SCAN `MATCH` pattern.
pub(super) fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl Inner {
    pub(super) async fn purge_released(&self, limit: usize) -> Result<u64, StoreError> {
        // `{*}` takes the earlier layout's 64-hex names as well as this one's,
        // so records an earlier version left are purged and counted too.
        let pattern = format!("{}{{*}}", glob_escape(&self.key_prefix));
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

    pub(super) async fn count_records(&self) -> Result<RecordStats, StoreError> {
        let pattern = format!("{}{{*}}", glob_escape(&self.key_prefix));
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

    /// The server's clock in milliseconds (`TIME`), as the scripts read it.
    async fn server_millis(&self) -> Result<i64, StoreError> {
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.err(e))?;
        Ok(secs * 1000 + micros / 1000)
    }

    /// Where SCAN must run: the one node, or one slot per cluster master.
    pub(super) async fn scan_targets(&self) -> Result<Vec<Option<u16>>, StoreError> {
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

    pub(super) async fn scan_step(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_escape_keeps_plain_prefixes() {
        assert_eq!(glob_escape("idem:"), "idem:");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
