//! The relay's sink to Kafka (feature `kafka`): the idempotent producer
//! (`enable.idempotence`, `acks=all`), a message's ordering key as its Kafka
//! key (so a key's messages stay in one partition, in commit order), its id
//! in the header `message-id` and its headers as Kafka headers. A message is
//! confirmed when the broker acknowledged it; one the producer refuses (over
//! `message.max.bytes`, an invalid topic) fails alone.

use std::time::Duration;

use futures_util::future::join_all;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::Sink;
use crate::consumer::BrokerError;
use crate::consumer::kafka::{MESSAGE_ID_HEADER, producer};
use crate::outbox::Outgoing;

/// Publishes the outbox's messages to Kafka.
///
/// ```no_run
/// use idem_runtime::outbox::{Relay, sink::KafkaSink};
///
/// # async fn go(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let sink = KafkaSink::connect("127.0.0.1:9092")?;
/// Relay::builder(pool, sink).build().run().await;
/// # Ok(()) }
/// ```
pub struct KafkaSink {
    producer: FutureProducer,
    timeout: Duration,
}

impl KafkaSink {
    /// The idempotent producer on the brokers at `brokers` (`host:port[,…]`).
    pub fn connect(brokers: &str) -> Result<KafkaSink, BrokerError> {
        Ok(KafkaSink::new(producer(brokers)?))
    }

    /// A producer of the caller's (set `enable.idempotence=true` on it: a
    /// send the client retries inside itself is then written once).
    pub fn new(producer: FutureProducer) -> KafkaSink {
        KafkaSink {
            producer,
            timeout: Duration::from_secs(30),
        }
    }

    /// How long a message may wait in the producer's queue for room (default
    /// 30 s); past it, it fails and the relay tries it again later.
    pub fn queue_timeout(mut self, timeout: Duration) -> KafkaSink {
        self.timeout = timeout;
        self
    }
}

#[async_trait::async_trait]
impl Sink for KafkaSink {
    fn name(&self) -> &'static str {
        "kafka"
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let sends = batch.iter().map(|m| {
            let mut headers = OwnedHeaders::new_with_capacity(m.headers.len() + 1).insert(Header {
                key: MESSAGE_ID_HEADER,
                value: Some(m.id.as_str()),
            });
            for (name, value) in &m.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value),
                });
            }
            let mut record = FutureRecord::<str, [u8]>::to(&m.topic)
                .payload(&m.payload)
                .headers(headers);
            if let Some(key) = &m.ordering_key {
                record = record.key(key);
            }
            // All enqueued at once, then their acknowledgements awaited: the
            // producer batches them.
            self.producer.send(record, self.timeout)
        });
        join_all(sends)
            .await
            .into_iter()
            .map(|sent| {
                sent.map(drop)
                    .map_err(|(e, _)| BrokerError::new("kafka", e))
            })
            .collect()
    }
}
