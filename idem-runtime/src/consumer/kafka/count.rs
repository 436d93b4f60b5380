//! Kafka keeps no delivery count: a message is at an offset, and a consumer
//! that crashed while running it leaves only its last commit behind. The
//! count lives in the idem store instead. A count is a claim on a key with a
//! fresh token and a lease that has already run out, so the next claim takes
//! it over and the store's fence, which grows by one with every owner of a
//! key, is the number of claims so far. Written before the handler runs, it
//! counts a delivery that ended with its process as much as one that failed.
//!
//! One write per message would put a store round trip in front of every
//! message, so the offsets of a partition go in blocks of [`BLOCK`]: before
//! an owner hands out the first message of a block, it claims the block's
//! key. A fence of 1 says no one handed out any message of the block before
//! (each would have claimed it first), so its messages' first deliveries
//! under this owner are first deliveries: nothing more to write. A higher
//! fence says an earlier owner (one that crashed, or lost the partition)
//! may have handed some of them out uncounted, at most once each, so from
//! then on each message of the block is counted on its own key, as one more
//! than its fence: a message that kills every owner is parked at
//! `max_deliveries` all the same, and a message the earlier owner never
//! reached counts one delivery more than it had. A message handed out again
//! by the same owner (a retry, a dropped delivery) is counted on its own key
//! too. While a partition is in a block, the next block is claimed in the
//! background, so no delivery waits on the store at a block's edge; a block
//! claimed that way and never reached only makes its next owner count one
//! by one.

use std::time::Duration;

use rdkafka::Message as _;

use super::KafkaSource;
use super::partitions::Out;
use crate::error::StoreError;
use crate::key::Key;
use crate::store::{Claim, ClaimRequest, Store, StoreRef, Token};

/// The scope of the count keys.
pub(super) const SCOPE: &str = "idem.consumer.kafka.deliveries";

/// Offsets per block (see the module's doc).
pub(super) const BLOCK: i64 = 128;

/// The key a message's deliveries are counted under.
fn key(group: &str, topic: &str, partition: i32, offset: i64) -> Key {
    Key::builder(SCOPE)
        .part(group)
        .part(topic)
        .part(&partition)
        .part(&offset)
        .finish()
}

/// The key an owner claims before it hands out the block's first message.
fn block_key(group: &str, topic: &str, partition: i32, block: i64) -> Key {
    Key::builder(SCOPE)
        .part(group)
        .part(topic)
        .part(&partition)
        .part("block")
        .part(&block)
        .finish()
}

/// Which block an offset is in.
fn block_of(offset: i64) -> i64 {
    offset.div_euclid(BLOCK)
}

/// Claims `key` once more and returns how many claims it has had, this one
/// included.
async fn one_more(store: &StoreRef, key: &Key, keep: Duration) -> Result<u32, StoreError> {
    loop {
        let claim = store
            .claim(ClaimRequest {
                key,
                token: Token::random(),
                fingerprint: None,
                // Over before the next delivery can come: that one takes it over.
                lease: Duration::from_millis(1),
                ttl: keep,
            })
            .await?;
        match claim {
            Claim::Acquired { fence, .. } => return Ok(u32::try_from(fence).unwrap_or(u32::MAX)),
            // The last delivery's millisecond is not over yet.
            Claim::Busy { .. } => tokio::time::sleep(Duration::from_millis(2)).await,
            Claim::Done(_) => {
                return Err(StoreError::new(
                    store.backend(),
                    "kafka delivery count",
                    "a count key holds a finished record: another use of the scope `idem.consumer.kafka.deliveries`",
                ));
            }
        }
    }
}

impl KafkaSource {
    /// How many times the message has been delivered, this time included,
    /// written to the store where it must be (see `count`'s doc): once per
    /// block of offsets while a partition keeps its owner, once per message
    /// where an earlier owner may have handed it out.
    pub(super) async fn count(&self, out: &Out) -> Result<u32, crate::error::StoreError> {
        let l = &self.link;
        let m = &out.waiting.message;
        let block = block_of(m.offset());
        let fresh = match self.known_block(out, block) {
            Known::Current(fresh) => fresh,
            Known::Ahead(claim) => match claim.await {
                Ok(Ok(fresh)) => self.enter_block(out, block, fresh),
                // Claimed again now: a second claim only makes the block
                // look handed out before, which counts more, never less.
                Ok(Err(_)) | Err(_) => self.claim_block(out, block).await?,
            },
            Known::Nothing => self.claim_block(out, block).await?,
        };
        if fresh && !out.waiting.handed {
            return Ok(1);
        }
        let key = key(&l.group, m.topic(), m.partition(), m.offset());
        let fence = one_more(&l.store, &key, l.keep_counts).await?;
        // Its first delivery went uncounted (a fresh block's), or may have
        // (an earlier owner's).
        Ok(fence.saturating_add(1))
    }

    /// What this owner already knows of `block` in the delivery's epoch.
    fn known_block(&self, out: &Out, block: i64) -> Known {
        let mut blocks = self.link.blocks.lock().unwrap_or_else(|p| p.into_inner());
        let Some(b) = blocks.get_mut(&out.tp).filter(|b| b.epoch == out.epoch) else {
            return Known::Nothing;
        };
        if b.block == block {
            return Known::Current(b.fresh);
        }
        match b.ahead.take() {
            Some((next, claim)) if next == block => Known::Ahead(claim),
            _ => Known::Nothing,
        }
    }

    async fn claim_block(&self, out: &Out, block: i64) -> Result<bool, crate::error::StoreError> {
        let l = &self.link;
        let key = block_key(&l.group, &out.tp.0, out.tp.1, block);
        let fresh = one_more(&l.store, &key, l.keep_counts).await? == 1;
        Ok(self.enter_block(out, block, fresh))
    }

    /// The partition is in `block` now; the next block is claimed in the
    /// background, so that claim is over by the time the partition gets
    /// there and no `next` waits on the store for it. (Claimed and never
    /// reached, it makes the next owner count that block's messages one by
    /// one: more writes, never fewer counts.)
    fn enter_block(&self, out: &Out, block: i64, fresh: bool) -> bool {
        let l = &self.link;
        let (store, keep) = (l.store.clone(), l.keep_counts);
        let key = block_key(&l.group, &out.tp.0, out.tp.1, block + 1);
        let claim = tokio::spawn(async move { Ok(one_more(&store, &key, keep).await? == 1) });
        l.blocks.lock().unwrap_or_else(|p| p.into_inner()).insert(
            out.tp.clone(),
            Block {
                epoch: out.epoch,
                block,
                fresh,
                ahead: Some((block + 1, claim)),
            },
        );
        fresh
    }
}

/// The block of offsets a partition's owner is in, in which epoch, whether
/// it was the block's first claim, and the next block's claim under way.
pub(super) struct Block {
    epoch: u64,
    block: i64,
    fresh: bool,
    ahead: Option<(i64, BlockClaim)>,
}

/// A block's claim in the background: whether it was the block's first.
type BlockClaim = tokio::task::JoinHandle<Result<bool, crate::error::StoreError>>;

enum Known {
    Current(bool),
    Ahead(BlockClaim),
    Nothing,
}
