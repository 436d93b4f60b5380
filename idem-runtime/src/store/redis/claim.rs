//! The claim: one plain command, `SET <key> <PROCESSING record> NX PX <life> GET`.
//!
//! What the server does with it, atomically, as one command: if the key is
//! absent it writes the record with its expiry and answers nil (the caller
//! owns the key, fence 1); if the key exists it writes nothing and answers
//! the value it holds. Redis runs one command at a time, so two claims of
//! the same key can never both see it absent (Redis >= 7.0 accepts `NX`
//! together with `GET`).
//!
//! What the caller does with the answer, without another round trip: a DONE
//! record is replayed; its own PROCESSING record (the same claim re-sent by
//! the cluster client after an I/O error) is its claim. Only a RELEASED
//! record or another owner's PROCESSING record needs the server again:
//! `reclaim.lua`, which judges the lease by the key's expiry and takes over
//! with the next fence. That is the rare path (a retry after a release, a
//! duplicate arriving while the first call runs, a crashed owner).

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Script, Value};

use crate::error::StoreError;
use crate::store::{Claim, ClaimRequest, RecoveryArgs, Store as _};

use super::record::{self, Record};
use super::reply::{bytes, fingerprint, int};
use super::{Inner, millis};

static RECLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("reclaim.lua")));

impl Inner {
    pub(super) async fn claim_record(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let key = self.redis_key(req.key);
        let (lease, ttl) = (millis(req.lease), millis(req.ttl));
        // The record outlives its lease even when a caller asks for a ttl
        // shorter than it: Redis deleting a live claim would let a newcomer
        // run the body beside it.
        let lives = lease.max(ttl);
        // One buffer holds the record; its head is what a reclaim needs.
        let mut record = record::processing_head(req.token, req.fingerprint);
        let head = record.len();
        record::push_processing_tail(&mut record, ttl, lives, lease);
        let mut set = redis::cmd("SET");
        set.arg(&key)
            .arg(&record)
            .arg("NX")
            .arg("PX")
            .arg(lives)
            .arg("GET");
        // While records may remain under their earlier names, that name is
        // read beside the claim, in the same round trip (earlier.rs).
        let (found, earlier) = if self.earlier.may_remain() {
            let mut conn = self.conn();
            let (found, earlier) = tokio::join!(
                set.query_async::<Option<Vec<u8>>>(&mut conn),
                self.read_earlier(req.key)
            );
            match earlier {
                Ok(earlier) => (found, earlier.is_some()),
                Err(e) => {
                    // The earlier name could not be read (a hash of the
                    // oldest layout there, or the connection): the claim
                    // must not stand on the new name, or it would hold the
                    // key for its whole lease with nothing running.
                    if let Ok(None) = found {
                        let _ = self
                            .release(req.key, req.token)
                            .await
                            .inspect_err(|e| tracing::warn!(error = %e, "could not release a claim whose earlier name could not be read; it holds the key until its lease ends"));
                    }
                    return Err(e);
                }
            }
        } else {
            (set.query_async(&mut self.conn()).await, false)
        };
        let found = found.map_err(|e| self.err_at(&key, e))?;
        let (claim, ours) = match found {
            None if !earlier => {
                self.hold_record(req, record);
                return Ok(Claim::Acquired {
                    fence: 1,
                    takeover: false,
                });
            }
            None => (
                Claim::Acquired {
                    fence: 1,
                    takeover: false,
                },
                record.clone(),
            ),
            Some(found) => match record::decode(&found).map_err(|e| self.unreadable(&key, e))? {
                Record::Done { result, .. } => return Ok(Claim::Done(result)),
                Record::Processing { token, fence } if token == req.token => (
                    Claim::Acquired {
                        fence,
                        takeover: false,
                    },
                    found,
                ),
                Record::Processing { .. } | Record::Released => {
                    let claim = self
                        .reclaim_with(&key, None, &record[..head], lease, ttl)
                        .await?;
                    let Claim::Acquired { fence, .. } = claim else {
                        return Ok(claim);
                    };
                    (
                        claim,
                        record::processing_at(&record[..head], fence, ttl, lease),
                    )
                }
            },
        };
        if earlier && self.adopt_over(req.key, &ours).await? {
            // The earlier record now stands where the claim stood: claim
            // again, as over any record found.
            return self
                .reclaim_held(req, &key, None, &record[..head], lease, ttl)
                .await;
        }
        self.hold_record(req, ours);
        Ok(claim)
    }

    /// `reclaim.lua`, keeping the record written if it acquires.
    pub(super) async fn reclaim_held(
        &self,
        req: ClaimRequest<'_>,
        key: &str,
        recovery: Option<(&str, RecoveryArgs<'_>)>,
        head: &[u8],
        lease: u64,
        ttl: u64,
    ) -> Result<Claim, StoreError> {
        let claim = self.reclaim_with(key, recovery, head, lease, ttl).await?;
        if let Claim::Acquired { fence, .. } = claim {
            self.hold_record(req, record::processing_at(head, fence, ttl, lease));
        }
        Ok(claim)
    }

    /// Keeps the PROCESSING record this claim wrote, for a completion by
    /// `SET … IFEQ` (complete.rs).
    pub(super) fn hold_record(&self, req: ClaimRequest<'_>, value: Vec<u8>) {
        if self.set_ifeq {
            self.held.insert(req.key, req.token, value);
        }
    }

    /// `reclaim.lua`; with `recovery`, the hash the arguments go to, and
    /// the arguments (recovery.rs).
    pub(super) async fn reclaim_with(
        &self,
        key: &str,
        recovery: Option<(&str, RecoveryArgs<'_>)>,
        head: &[u8],
        lease: u64,
        ttl: u64,
    ) -> Result<Claim, StoreError> {
        let mut invocation = RECLAIM.key(key);
        invocation.arg(head).arg(lease).arg(ttl);
        if let Some((hash, recovery)) = recovery {
            invocation.key(hash).arg(recovery.scope).arg(recovery.args);
        }
        let reply: Value = invocation
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(key, e))?;
        let Value::Array(items) = reply else {
            return Err(self.err("unexpected reply: reclaim.lua did not answer an array"));
        };
        let mut items = items.into_iter();
        let tag = bytes(items.next()).map_err(|e| self.err(e))?;
        let malformed = |e| self.err(e);
        match &tag[..] {
            b"acquired" => Ok(Claim::Acquired {
                fence: u64::try_from(int(items.next()).map_err(malformed)?)
                    .map_err(|_| self.err("unexpected reply: negative fence"))?,
                takeover: int(items.next()).map_err(malformed)? == 1,
            }),
            b"busy" => Ok(Claim::Busy {
                lease_remaining: Duration::from_millis(
                    u64::try_from(int(items.next()).map_err(malformed)?).unwrap_or(0),
                ),
                fingerprint: fingerprint(items.next()).map_err(malformed)?,
            }),
            b"done" => {
                let v = bytes(items.next()).map_err(malformed)?;
                match record::decode(&v).map_err(|e| self.unreadable(key, e))? {
                    Record::Done { result, .. } => Ok(Claim::Done(result)),
                    _ => Err(self
                        .err("unexpected reply: reclaim.lua answered done without a DONE record")),
                }
            }
            _ => Err(self.err("unexpected reply: reclaim.lua answered an unknown tag")),
        }
    }
}
