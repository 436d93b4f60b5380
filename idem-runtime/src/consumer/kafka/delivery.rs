//! One message handed out by a [`KafkaSource`](super::KafkaSource): its
//! verdicts (ack, retry, defer, park), each carried out on its partition,
//! and what dropping it undecided does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::{Message as _, Offset, TopicPartitionList};

use super::partitions::Out;
use super::{DELIVERIES_HEADER, Link, ORIGIN_HEADER, POSITION_HEADER, REASON_HEADER, broker};
use crate::consumer::{BrokerError, Delivery};

/// One message handed to this consumer.
pub struct KafkaDelivery {
    pub(super) link: Arc<Link>,
    /// `None` once acked, parked or put back.
    pub(super) out: Option<Out>,
    pub(super) attempt: u32,
    pub(super) message_id: Option<String>,
}

impl KafkaDelivery {
    /// The message's topic, partition and offset.
    pub fn position(&self) -> Option<(&str, i32, i64)> {
        self.out.as_ref().map(|o| {
            let m = &o.waiting.message;
            (m.topic(), m.partition(), m.offset())
        })
    }

    /// The partition goes on; commits past the message while it is still
    /// this consumer's.
    fn commit_past(&mut self) -> Result<(), BrokerError> {
        let Some(out) = self.out.take() else {
            return Ok(());
        };
        let m = &out.waiting.message;
        let l = &self.link;
        let committed = {
            // Held across the commit's enqueueing: a rebalance waits for it,
            // so a partition is never committed after its revoke.
            let mut partitions = l.shared.lock();
            if partitions.done(&out.tp, out.epoch) {
                let mut list = TopicPartitionList::new();
                list.add_partition_offset(m.topic(), m.partition(), Offset::Offset(m.offset() + 1))
                    .map_err(broker)?;
                l.consumer.commit(&list, CommitMode::Async).map_err(broker)
            } else {
                Ok(())
            }
        };
        l.shared.wake.notify_one();
        committed
    }
}

impl Drop for KafkaDelivery {
    /// Dropped without a verdict (its runner's future was dropped): the
    /// message goes back to the front of its partition, to be handed out
    /// again, counted, as after a crash.
    fn drop(&mut self) {
        if let Some(out) = self.out.take() {
            self.link.shared.lock().put_back(out, Instant::now());
            self.link.shared.wake.notify_one();
        }
    }
}

#[async_trait::async_trait]
impl Delivery for KafkaDelivery {
    fn payload(&self) -> Option<&[u8]> {
        self.out.as_ref().and_then(|o| o.waiting.message.payload())
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    async fn ack(mut self) -> Result<(), BrokerError> {
        self.commit_past()
    }

    async fn retry(mut self, after: Duration) -> Result<(), BrokerError> {
        if let Some(out) = self.out.take() {
            self.link
                .shared
                .lock()
                .put_back(out, Instant::now() + after);
            self.link.shared.wake.notify_one();
        }
        Ok(())
    }

    async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError> {
        // Kafka cannot hold a message back uncounted: keep it, wait, run it
        // again (its partition waits too, as its order asks).
        tokio::time::sleep(after).await;
        Ok(Some(self))
    }

    async fn park(mut self, reason: &str) -> Result<(), BrokerError> {
        let Some(out) = self.out.as_ref() else {
            return Ok(());
        };
        let m = &out.waiting.message;
        let deliveries = self.attempt.to_string();
        let position = format!("{}/{}", m.partition(), m.offset());
        let mut headers = OwnedHeaders::new();
        if let Some(own) = m.headers() {
            for h in own.iter() {
                if ![
                    REASON_HEADER,
                    DELIVERIES_HEADER,
                    ORIGIN_HEADER,
                    POSITION_HEADER,
                ]
                .contains(&h.key)
                {
                    headers = headers.insert(h);
                }
            }
        }
        let headers = headers
            .insert(Header {
                key: REASON_HEADER,
                value: Some(reason),
            })
            .insert(Header {
                key: DELIVERIES_HEADER,
                value: Some(&deliveries),
            })
            .insert(Header {
                key: ORIGIN_HEADER,
                value: Some(m.topic()),
            })
            .insert(Header {
                key: POSITION_HEADER,
                value: Some(&position),
            });
        let mut record = FutureRecord::<[u8], [u8]>::to(&self.link.parking)
            .payload(m.payload().unwrap_or_default())
            .headers(headers);
        if let Some(key) = m.key() {
            record = record.key(key);
        }
        self.link
            .producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| broker(e))?;
        self.commit_past()
    }
}
