//! Kafka keeps no delivery count: a message is at an offset, and a consumer
//! that crashed while running it leaves only its last commit behind. The
//! count lives in the idem store instead, under the message's group, topic,
//! partition and offset: each delivery claims that key with a fresh token and
//! a lease that has already run out, so the next delivery takes it over and
//! the store's fence, which grows by one with every owner of a key, is the
//! number of deliveries so far. Written before the handler runs, it counts a
//! delivery that ended with its process as much as one that failed.

use std::time::Duration;

use crate::error::StoreError;
use crate::key::Key;
use crate::store::{Claim, ClaimRequest, Store, StoreRef, Token};

/// The scope of the count keys.
pub(super) const SCOPE: &str = "idem.consumer.kafka.deliveries";

/// The key a message's deliveries are counted under.
pub(super) fn key(group: &str, topic: &str, partition: i32, offset: i64) -> Key {
    Key::builder(SCOPE)
        .part(group)
        .part(topic)
        .part(&partition)
        .part(&offset)
        .finish()
}

/// Counts one more delivery of the message and returns how many there have
/// been, this one included.
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
