//! Kafka consumer groups through rdkafka (feature `kafka`; librdkafka is
//! built from source with the crate, no system library). The adapter speaks
//! the Kafka protocol; the tests run it against Tansu, an Apache-2.0 broker
//! of that protocol (see the limits below for where Tansu and Kafka differ).
//!
//! - **Order per partition.** A partition hands out its next message only
//!   once the one before it was acked or parked, so an order's "created" runs
//!   before its "cancelled"; partitions run side by side under
//!   [`Runner::concurrency`](super::Runner::concurrency). A message to retry
//!   goes back to the front of its partition and waits out its backoff there:
//!   nothing after it runs, or is committed, before it.
//! - **Offsets** are committed only after the runner's outcome for the
//!   message is recorded (processed, replayed, parked), never by librdkafka on
//!   its own (`enable.auto.commit=false`), one past the message: a
//!   partition's commits follow its messages one by one.
//! - **Rebalance.** A revoked partition's messages read and not handed out
//!   are dropped; one in flight runs to its end but commits nothing (the
//!   partition is another consumer's, which starts from the last commit, and
//!   idem answers that redelivery: a replay, or `InProgress` while the first
//!   still runs). A partition assigned again starts afresh.
//! - **Counting deliveries.** Kafka keeps no count, so the count lives in the
//!   idem store (the one given to [`KafkaBuilder::store`], else the installed
//!   one), written before a delivery is handed out: a delivery that ended
//!   with its process counts, and a message that kills its consumer every
//!   time is parked at `max_deliveries`. While a partition keeps its owner
//!   that is one store write per 128 offsets (a claim on the block's key
//!   saying no one handed any of them out before); where an earlier owner
//!   may have handed a message out (it crashed or lost the partition in that
//!   block), and for a message handed out again, one write per delivery under
//!   the message's group, topic, partition and offset, and the count is one
//!   more than the writes, for the uncounted first delivery it may have had:
//!   after a partition changes owner, up to 127 messages the earlier owner
//!   never reached count a delivery more than they had. The count keys live
//!   [`keep_counts`](KafkaBuilder::keep_counts) (7 days).
//! - **`InProgress`** keeps the message in flight and runs it again after the
//!   delay, uncounted; a **retry** is counted.
//! - **Parking** produces a copy to the parking topic (`<topic>.parked`
//!   unless set) with the message's key and headers and `idem-reason`,
//!   `idem-deliveries`, `idem-origin` (its topic) and `idem-position`
//!   (`partition/offset` there), waits for
//!   the broker's acknowledgement, then commits past the message. [`parked`]
//!   reads them back.
//! - **Message ids** come from the header `message-id` (the outbox's
//!   `KafkaSink` sets it), so an [`Envelope`](super::Envelope) handler works
//!   as on the other brokers.
//!
//! ```no_run
//! use idem_runtime::consumer::Runner;
//! use idem_runtime::consumer::kafka::KafkaSource;
//!
//! # #[derive(serde::Serialize, serde::Deserialize)] struct OrderPaid { order_id: String }
//! # async fn settle(e: OrderPaid) -> Result<(), std::io::Error> { Ok(()) }
//! # async fn go(store: idem_runtime::store::memory::MemoryStore) -> Result<(), Box<dyn std::error::Error>> {
//! // Kafka (feature `kafka`)
//! let source = KafkaSource::builder("127.0.0.1:9092", "orders", "settlement")
//!     .store(store)
//!     .connect()
//!     .await?;
//! Runner::new().concurrency(8).run(source, settle).await; // returns when the broker fails
//! # Ok(()) }
//! ```

//!
//! # Limits of Kafka
//!
//! What a Kafka-protocol broker (and librdkafka in front of it) answers at
//! its edges, and what idem makes of it. The tests run Tansu 0.6 with its
//! memory engine; where Tansu differs from Apache Kafka the row says so, and
//! what is tested is what Kafka users rely on. A row whose test says
//! `none yet` is not checked against a real broker.
//!
//! | limit or odd answer | what the broker does | what idem does | test |
//! |---|---|---|---|
//! | no delivery count: a message is an offset, and a member that died leaves only its group's last commit | redelivers from the last commit to whoever owns the partition next | counts deliveries in the idem store before handing a message out (claims whose fences count them: one per block of 128 offsets while a partition keeps its owner, one per delivery where an earlier owner may have handed it out), so a message that kills its consumer every time is parked at `max_deliveries` | `tests/consumer_kafka.rs::crash_and_panic_are_parked` (a new process per kill), `tests/consumer_kafka.rs::a_dropped_delivery_commits_nothing_and_comes_back_first` (a second delivery by the same owner); the fence rule: `tests/src/conformance.rs::each_new_owner_raises_the_fence_by_one` on every store |
//! | a member killed mid-batch | its commits so far stay; what it read past them is redelivered to the next owner | commits one past a message only after its outcome is recorded, so no commit is ahead of what was applied | `tests/consumer_kafka.rs::a_process_killed_mid_batch_commits_nothing_ahead_and_the_next_applies_each_once` (300 messages, 3 partitions, each a PostgreSQL transaction; the commits read right after the SIGKILL) |
//! | a topic deleted while clients know it | Kafka forgets it; against Tansu, librdkafka 2.x crashed (SIGSEGV in its metadata cache) in a process whose other clients had known a deleted topic | never deletes a topic; the bench leaves its topics in place | none (seen in the consumers bench, not reproduced alone) |
//! | a commit's metadata | Kafka keeps it with the offset; Tansu's memory engine answers it empty | not used: the count lives in the store | none (the reason the count is not kept in commits) |
//! | a partition revoked while its message runs | the group coordinator takes a commit from any current member, owner or not | a delivery commits only while its partition is owned in the epoch it was handed out in; a revoked partition's read messages are dropped | `idem-runtime/src/consumer/kafka/partitions.rs::tests::a_revoked_partition_commits_nothing_and_drops_what_it_held`; `tests/consumer_kafka.rs::two_consumers_settle_each_order_once` (a member joining mid-run) |
//! | a member killed (SIGKILL) | keeps its partitions until `session.timeout.ms` (45 s by default) passes without a heartbeat; a join takes seconds more (Tansu holds a first join for about the session timeout) | nothing to do; the tests set 6 s | `tests/consumer_kafka.rs::crash_and_panic_are_parked`, `tests/consumer_kafka.rs::dead_consumer_is_taken_over` |
//! | order within a partition | kept by the broker; a key's messages go to one partition | one message in flight per partition; a retry waits at the front | `tests/consumer_kafka.rs::order_is_kept_per_partition_under_concurrency` (300 messages, 30 keys, 3 partitions, `concurrency(8)`) |
//! | high-water marks and lag | Kafka reports them; Tansu's memory engine reports wrong ones | nothing in idem reads them; the tests compare commits with the producer's own acknowledgements | — |
//! | `AllBrokersDown`, `BrokerTransportFailure` | the client reconnects by itself | a consumer error that is not fatal is logged and waited out; only a fatal one ends `run` | none yet |
//! | a message over `message.max.bytes` (1 000 000 bytes by default, client and broker) | the producer refuses it before sending (`MsgSizeTooLarge`) | the sink fails that message alone; the relay retries and parks it at `max_attempts` | `tests/outbox/sinks.rs::kafka_a_message_over_message_max_bytes_fails_alone` (900 000 bytes published, 1 000 001 failed alone) |

mod count;
mod delivery;
mod parking;
mod partitions;
mod source;

pub use delivery::KafkaDelivery;
pub use parking::parked;
pub use source::{KafkaBuilder, KafkaSource};

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;

use super::BrokerError;
use source::Link;

/// The header holding the message id, when the publisher set one (the
/// outbox's relay always does); see [`Delivery::message_id`](super::Delivery::message_id).
pub const MESSAGE_ID_HEADER: &str = "message-id";

// The headers a parked copy carries besides the message's own.
const REASON_HEADER: &str = "idem-reason";
const DELIVERIES_HEADER: &str = "idem-deliveries";
const ORIGIN_HEADER: &str = "idem-origin";
const POSITION_HEADER: &str = "idem-position";

fn broker(e: impl std::error::Error + Send + Sync + 'static) -> BrokerError {
    BrokerError::new("kafka", e)
}

/// A producer for `publish`, `publish_raw` and the outbox's sink: the
/// idempotent producer (`enable.idempotence`, so a retried send inside the
/// client is written once), acknowledged by every in-sync replica, a send
/// given up after 30 s (`message.timeout.ms`; librdkafka's own default, 5
/// minutes, would hold a relay's batch that long when no broker answers).
///
/// ```no_run
/// let producer = idem_runtime::consumer::kafka::producer("127.0.0.1:9092")?;
/// # Ok::<(), idem_runtime::consumer::BrokerError>(())
/// ```
pub fn producer(brokers: &str) -> Result<FutureProducer, BrokerError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", "30000")
        .create()
        .map_err(broker)
}

/// Sends `message` as JSON to `topic` under `key` (a key's messages go to one
/// partition, in order) and returns its partition and offset.
pub async fn publish<M: Serialize + ?Sized>(
    producer: &FutureProducer,
    topic: &str,
    key: Option<&str>,
    message: &M,
) -> Result<(i32, i64), BrokerError> {
    let body = serde_json::to_vec(message).map_err(broker)?;
    publish_raw(producer, topic, key, &body, None).await
}

/// Sends `payload` as it is (a test's poison message is bytes that do not
/// decode), with the id in the header [`MESSAGE_ID_HEADER`] when given.
///
/// ```no_run
/// use idem_runtime::consumer::kafka;
///
/// # async fn go() -> Result<(), idem_runtime::consumer::BrokerError> {
/// let producer = kafka::producer("127.0.0.1:9092")?;
/// kafka::publish_raw(&producer, "orders", Some("order-7"), b"{\"order_id\": 7", Some("m-1")).await?;
/// # Ok(()) }
/// ```
pub async fn publish_raw(
    producer: &FutureProducer,
    topic: &str,
    key: Option<&str>,
    payload: &[u8],
    message_id: Option<&str>,
) -> Result<(i32, i64), BrokerError> {
    let mut record = FutureRecord::<str, [u8]>::to(topic).payload(payload);
    if let Some(key) = key {
        record = record.key(key);
    }
    if let Some(id) = message_id {
        record = record.headers(OwnedHeaders::new().insert(Header {
            key: MESSAGE_ID_HEADER,
            value: Some(id),
        }));
    }
    let delivery = producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| broker(e))?;
    Ok((delivery.partition, delivery.offset))
}
