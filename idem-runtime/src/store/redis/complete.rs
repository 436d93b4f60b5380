//! The completion: `PROCESSING` → `DONE`, only while this owner's claim is
//! what the key holds.
//!
//! Where the server has conditional `SET` (Valkey ≥ 8.1, Redis ≥ 8.4), it is
//! one plain command:
//!
//! ```text
//! SET <key> <DONE record> IFEQ <the PROCESSING record this owner wrote> PX <ttl>
//! ```
//!
//! The server compares the key's whole value with the record the owner
//! holds and writes the DONE record only if they are equal, in one command
//! (a server runs one command at a time, so nothing can change the key
//! between the comparison and the write). The PROCESSING record carries the
//! owner's token and fence, so "equal" means "still this owner's claim": a
//! takeover, a release, an eviction or a renewal by nobody else can have
//! happened in between, since each rewrites the value. The owner knows the
//! exact value because it wrote it: the claim's `SET`, the value
//! `reclaim.lua` answers, and each renewal's new margin (`renew.lua` answers
//! it) are kept per (key, token) while the claim is held ([`Held`]).
//!
//! A nil answer (not written) is the rare path: one `GET` tells a completion
//! that already happened under this token (the same completion re-sent after
//! an I/O error: success) from a record that is no longer ours (fenced: the
//! stale owner writes nothing).
//!
//! Elsewhere (Redis 7.x), or when the held value is unknown (a claim made
//! before a restart of this process, or forgotten under memory pressure),
//! `complete.lua` does the same compare-and-set by token in a script.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::error::StoreError;
use crate::key::{DigestHasher, Key};
use crate::store::{Completion, Token};

use super::record::{self, Record};
use super::{Inner, SCRIPTS, millis};

/// The PROCESSING records this process's owners hold, by (key, token).
///
/// Sharded by the token's first byte so concurrent calls rarely share a
/// lock. A shard that fills up (claims whose owners never completed nor
/// released: dropped futures) is emptied; a completion whose record was
/// forgotten takes the script path, which needs no held value.
pub(super) struct Held {
    shards: [Mutex<Shard>; 16],
}

/// The held records of the tokens whose first byte falls in one shard.
type Shard = HashMap<Holder, Vec<u8>, DigestHasher>;

/// Who holds a record: its key and the claim's token.
#[derive(PartialEq, Eq)]
struct Holder(Key, Token);

impl std::hash::Hash for Holder {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        // The token alone: random, so uniform for `DigestHasher`, and
        // unique to one claim; SipHash over key and token twice a call was
        // work for nothing.
        h.write(self.1.as_bytes());
    }
}

const SHARD_CAP: usize = 4096;

impl Held {
    pub(super) fn new() -> Held {
        Held {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::with_hasher(DigestHasher::new()))),
        }
    }

    fn shard(&self, token: Token) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[usize::from(token.as_bytes()[0] & 15)]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn insert(&self, key: &Key, token: Token, value: Vec<u8>) {
        let mut shard = self.shard(token);
        if shard.len() >= SHARD_CAP {
            shard.clear();
        }
        shard.insert(Holder(*key, token), value);
    }

    pub(super) fn take(&self, key: &Key, token: Token) -> Option<Vec<u8>> {
        self.shard(token).remove(&Holder(*key, token))
    }

    /// A renewal rewrote the record's margin.
    pub(super) fn renewed(&self, key: &Key, token: Token, margin: u64) {
        if let Some(v) = self.shard(token).get_mut(&Holder(*key, token)) {
            record::set_margin(v, margin);
        }
    }
}

impl Inner {
    pub(super) async fn complete_record(
        &self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        let code = b'0' + completion.outcome.code();
        let held = if self.set_ifeq {
            self.held.take(key, token)
        } else {
            None
        };
        let Some(held) = held else {
            let ttl = millis(completion.ttl).to_string();
            return self
                .fenced(
                    &SCRIPTS.complete,
                    key,
                    &[
                        token.as_bytes(),
                        &[code],
                        completion.payload,
                        ttl.as_bytes(),
                    ],
                )
                .await;
        };
        let Some(done) = record::done_from_processing(&held, code, completion.payload) else {
            return Err(self.err("a held PROCESSING record this version cannot read"));
        };
        let name = self.redis_key(key);
        let written: Option<redis::Value> = match redis::cmd("SET")
            .arg(&name)
            .arg(&done)
            .arg("IFEQ")
            .arg(&held)
            .arg("PX")
            .arg(millis(completion.ttl))
            .query_async(&mut self.conn())
            .await
        {
            Ok(v) => v,
            Err(e) => {
                // The protocol may send the completion again: keep what it
                // compares against.
                self.held.insert(key, token, held);
                return Err(self.err_at(&name, e));
            }
        };
        if written.is_some() {
            return Ok(true);
        }
        let now: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&name)
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&name, e))?;
        Ok(matches!(
            now.as_deref().map(record::decode),
            Some(Ok(Record::Done { token: t, .. })) if t == token
        ))
    }
}
