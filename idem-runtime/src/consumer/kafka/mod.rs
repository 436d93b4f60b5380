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
mod partitions;

pub use delivery::KafkaDelivery;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, UNIX_EPOCH};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientContext, Message as _, Offset, TopicPartitionList};
use serde::Serialize;
use tokio::sync::Notify;

use super::{BrokerError, Parked, Source};
use crate::store::{AsStore, StoreRef};
use partitions::{Flow, Out, Partitions, Tp};

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

/// What the consumer's threads and its deliveries share.
struct Shared {
    partitions: Mutex<Partitions>,
    /// A message was read, a partition went free, a message was put back.
    wake: Notify,
    /// The reader stopped on a fatal error.
    failed: Mutex<Option<KafkaError>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Partitions> {
        self.partitions.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Follows the group's assignment: librdkafka calls it on a rebalance.
struct Rebalancing {
    shared: Arc<Shared>,
}

impl ClientContext for Rebalancing {}

impl ConsumerContext for Rebalancing {
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let mut partitions = self.shared.lock();
        match rebalance {
            Rebalance::Revoke(list) => {
                for e in list.elements() {
                    partitions.revoke(&(Arc::from(e.topic()), e.partition()));
                }
            }
            Rebalance::Assign(list) => {
                for e in list.elements() {
                    partitions.assign((Arc::from(e.topic()), e.partition()));
                }
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "kafka rebalance failed"),
        }
        drop(partitions);
        self.shared.wake.notify_one();
    }
}

type Client = StreamConsumer<Rebalancing>;

/// Settings of a [`KafkaSource`].
pub struct KafkaBuilder {
    config: ClientConfig,
    topic: String,
    group: String,
    parking: String,
    store: Option<StoreRef>,
    keep_counts: Duration,
}

impl KafkaBuilder {
    /// Any librdkafka setting (`session.timeout.ms`, `security.protocol`,
    /// …). `group.id`, `enable.auto.commit` and `enable.auto.offset.store`
    /// are the adapter's own.
    pub fn set(mut self, key: &str, value: impl Into<String>) -> Self {
        self.config.set(key, value);
        self
    }

    /// Where parked copies go (default `<topic>.parked`).
    pub fn parking_topic(mut self, topic: impl Into<String>) -> Self {
        self.parking = topic.into();
        self
    }

    /// The store delivery counts are kept in (default: the installed one).
    pub fn store(mut self, store: impl AsStore) -> Self {
        self.store = Some(store.store_ref());
        self
    }

    /// How long a message's delivery count is kept (default 7 days): longer
    /// than a message can stay unprocessed in its partition.
    pub fn keep_counts(mut self, keep: Duration) -> Self {
        self.keep_counts = keep;
        self
    }

    /// Joins the group, starts a task that reads the consumer for as long
    /// as the source lives (on the current tokio runtime), and opens the
    /// producer parked copies go through.
    pub async fn connect(mut self) -> Result<KafkaSource, BrokerError> {
        let store = self
            .store
            .take()
            .or_else(crate::install::default_store)
            .ok_or_else(|| {
                broker(std::io::Error::other(
                    "the Kafka consumer counts deliveries in an idem store: give one with \
                     `.store(…)` or install one with `idem_runtime::install`",
                ))
            })?;
        let brokers = self
            .config
            .get("bootstrap.servers")
            .unwrap_or_default()
            .to_owned();
        let shared = Arc::new(Shared {
            partitions: Mutex::default(),
            wake: Notify::new(),
            failed: Mutex::default(),
        });
        let consumer: Client = self
            .config
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .create_with_context(Rebalancing {
                shared: shared.clone(),
            })
            .map_err(broker)?;
        consumer.subscribe(&[&self.topic]).map_err(broker)?;
        let producer = producer(&brokers)?;
        let link = Arc::new(Link {
            consumer,
            shared,
            blocks: Mutex::default(),
            producer,
            store,
            group: self.group,
            parking: self.parking,
            keep_counts: self.keep_counts,
        });
        let reader = tokio::spawn(read(link.clone()));
        Ok(KafkaSource { link, reader })
    }
}

/// What a source and its deliveries hold.
struct Link {
    consumer: Client,
    shared: Arc<Shared>,
    /// Per partition, the block of offsets last claimed (see `count`).
    blocks: Mutex<HashMap<Tp, Block>>,
    producer: FutureProducer,
    store: StoreRef,
    group: String,
    parking: String,
    keep_counts: Duration,
}

impl Link {
    fn flow(&self, tp: &Tp, flow: Flow) {
        if !flow.pause && !flow.resume {
            return;
        }
        let mut list = TopicPartitionList::new();
        list.add_partition(&tp.0, tp.1);
        let done = if flow.pause {
            self.consumer.pause(&list)
        } else {
            self.consumer.resume(&list)
        };
        if let Err(e) = done {
            tracing::warn!(topic = %tp.0, partition = tp.1, error = %e, "kafka pause or resume failed");
        }
    }
}

/// One member of a Kafka consumer group: a [`Source`] for
/// [`super::Runner`].
pub struct KafkaSource {
    link: Arc<Link>,
    /// The task reading the consumer (see [`read`]).
    reader: tokio::task::JoinHandle<()>,
}

impl KafkaSource {
    /// A member of `group` reading `topic` from the brokers at `brokers`
    /// (`host:port[,host:port…]`). A group new to the topic starts at its
    /// beginning (`auto.offset.reset=earliest`; change it with `set`).
    pub fn builder(brokers: &str, topic: &str, group: &str) -> KafkaBuilder {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", brokers)
            .set("auto.offset.reset", "earliest");
        KafkaBuilder {
            config,
            topic: topic.to_owned(),
            group: group.to_owned(),
            parking: format!("{topic}.parked"),
            store: None,
            keep_counts: Duration::from_secs(7 * 24 * 3600),
        }
    }

    async fn hand_out(&self, mut out: Out) -> Result<KafkaDelivery, Out> {
        match self.count(&out).await {
            Ok(attempt) => {
                let m = &out.waiting.message;
                let message_id = m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == MESSAGE_ID_HEADER)
                        .and_then(|h| h.value)
                        .and_then(|v| std::str::from_utf8(v).ok())
                        .map(str::to_owned)
                });
                out.waiting.handed = true;
                Ok(KafkaDelivery {
                    link: self.link.clone(),
                    out: Some(out),
                    attempt,
                    message_id,
                })
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not count a Kafka delivery; trying again in 1 s");
                Err(out)
            }
        }
    }

    /// How many times the message has been delivered, this time included,
    /// written to the store where it must be (see `count`'s doc): once per
    /// block of offsets while a partition keeps its owner, once per message
    /// where an earlier owner may have handed it out.
    async fn count(&self, out: &Out) -> Result<u32, crate::error::StoreError> {
        let l = &self.link;
        let m = &out.waiting.message;
        let block = count::block_of(m.offset());
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
        let key = count::key(&l.group, m.topic(), m.partition(), m.offset());
        let fence = count::one_more(&l.store, &key, l.keep_counts).await?;
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
        let key = count::block_key(&l.group, &out.tp.0, out.tp.1, block);
        let fresh = count::one_more(&l.store, &key, l.keep_counts).await? == 1;
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
        let key = count::block_key(&l.group, &out.tp.0, out.tp.1, block + 1);
        let claim =
            tokio::spawn(async move { Ok(count::one_more(&store, &key, keep).await? == 1) });
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
struct Block {
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

/// A consumer error worth waiting out: the client reconnects by itself.
fn transient(e: &KafkaError) -> bool {
    !matches!(e.rdkafka_error_code(), Some(RDKafkaErrorCode::Fatal))
}

/// Reads the consumer for as long as the source lives, whether or not the
/// runner wants a delivery: librdkafka serves the group (a rebalance, its
/// revoke and assign) only while it is read, and a member busy with long
/// handlers must still let go of partitions when a member joins.
async fn read(link: Arc<Link>) {
    loop {
        match link.consumer.recv().await {
            Ok(m) => {
                let (tp, flow, ready) = link.shared.lock().push(m.detach());
                link.flow(&tp, flow);
                if ready {
                    link.shared.wake.notify_one();
                }
            }
            Err(e) if transient(&e) => {
                tracing::warn!(error = %e, "kafka consumer error; going on");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => {
                *link.shared.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                link.shared.wake.notify_one();
                return;
            }
        }
    }
}

#[async_trait::async_trait]
impl Source for KafkaSource {
    type Delivery = KafkaDelivery;

    async fn next(&mut self) -> Result<KafkaDelivery, BrokerError> {
        loop {
            let ready = self.link.shared.lock().take_ready(Instant::now());
            if let Some((out, flow)) = ready {
                self.link.flow(&out.tp, flow);
                match self.hand_out(out).await {
                    Ok(delivery) => return Ok(delivery),
                    Err(out) => {
                        let later = Instant::now() + Duration::from_secs(1);
                        self.link.shared.lock().put_back(out, later);
                        continue;
                    }
                }
            }
            if let Some(e) = self
                .link
                .shared
                .failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
            {
                return Err(broker(e));
            }
            let due = self.link.shared.lock().next_due();
            let wait_due = async {
                match due {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.link.shared.wake.notified() => {}
                () = wait_due => {}
            }
        }
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        self.reader.abort();
    }
}
