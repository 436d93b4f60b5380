//! Reading a parking topic back: its messages, with why each was parked,
//! read by a consumer of no group that commits nothing.

use std::time::{Duration, UNIX_EPOCH};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::{Message as _, Offset, TopicPartitionList};

use super::{DELIVERIES_HEADER, MESSAGE_ID_HEADER, ORIGIN_HEADER, REASON_HEADER, broker};
use crate::consumer::{BrokerError, Parked};

/// Up to `count` messages of `parking_topic`, oldest first per partition,
/// each with why it was parked. Reads with a consumer of no group (nothing
/// is committed, the parked copies stay), until `count` are read or none
/// came for `quiet`.
///
/// ```no_run
/// # async fn go() -> Result<(), idem_runtime::consumer::BrokerError> {
/// use std::time::Duration;
/// let parked = idem_runtime::consumer::kafka::parked("127.0.0.1:9092", "orders.parked", 100, Duration::from_secs(2)).await?;
/// for p in parked {
///     println!("{:?}: {}", p.message_id, p.reason);
/// }
/// # Ok(()) }
/// ```
pub async fn parked(
    brokers: &str,
    parking_topic: &str,
    count: usize,
    quiet: Duration,
) -> Result<Vec<Parked>, BrokerError> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "idem-parked-reader")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()
        .map_err(broker)?;
    let metadata = consumer
        .fetch_metadata(Some(parking_topic), Duration::from_secs(10))
        .map_err(broker)?;
    let mut assignment = TopicPartitionList::new();
    for topic in metadata.topics() {
        for p in topic.partitions() {
            assignment
                .add_partition_offset(parking_topic, p.id(), Offset::Beginning)
                .map_err(broker)?;
        }
    }
    // Assigned by hand: no group to join, no commit.
    consumer.assign(&assignment).map_err(broker)?;
    let mut found = Vec::new();
    while found.len() < count {
        let message = match tokio::time::timeout(quiet, consumer.recv()).await {
            Err(_) => break,
            Ok(m) => m.map_err(broker)?,
        };
        found.push(parked_copy(&message.detach()));
    }
    Ok(found)
}

fn parked_copy(m: &OwnedMessage) -> Parked {
    let header = |name: &str| {
        m.headers().and_then(|h| {
            h.iter()
                .find(|h| h.key == name)
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        })
    };
    let mut p = Parked::new(
        m.payload().unwrap_or_default(),
        header(REASON_HEADER).unwrap_or_default(),
    );
    p.message_id = header(MESSAGE_ID_HEADER);
    p.origin = header(ORIGIN_HEADER);
    p.deliveries = header(DELIVERIES_HEADER).and_then(|d| d.parse().ok());
    p.parked_at = m
        .timestamp()
        .to_millis()
        .and_then(|ms| u64::try_from(ms).ok())
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
    p.position = Some(format!("{}/{}", m.partition(), m.offset()));
    p
}
