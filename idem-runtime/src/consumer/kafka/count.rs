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

use crate::error::StoreError;
use crate::key::Key;
use crate::store::{Claim, ClaimRequest, Store, StoreRef, Token};

/// The scope of the count keys.
pub(super) const SCOPE: &str = "idem.consumer.kafka.deliveries";

/// Offsets per block (see the module's doc).
pub(super) const BLOCK: i64 = 128;

/// The key a message's deliveries are counted under.
pub(super) fn key(group: &str, topic: &str, partition: i32, offset: i64) -> Key {
    Key::builder(SCOPE)
        .part(group)
        .part(topic)
        .part(&partition)
        .part(&offset)
        .finish()
}

/// The key an owner claims before it hands out the block's first message.
pub(super) fn block_key(group: &str, topic: &str, partition: i32, block: i64) -> Key {
    Key::builder(SCOPE)
        .part(group)
        .part(topic)
        .part(&partition)
        .part("block")
        .part(&block)
        .finish()
}

/// Which block an offset is in.
pub(super) fn block_of(offset: i64) -> i64 {
    offset.div_euclid(BLOCK)
}

/// Claims `key` once more and returns how many claims it has had, this one
/// included.
pub(super) async fn one_more(
    store: &StoreRef,
    key: &Key,
    keep: Duration,
) -> Result<u32, StoreError> {
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
