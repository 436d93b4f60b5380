//! The consumer: its settings, the group membership that follows
//! rebalances into the partitions' state, the task that reads the consumer
//! for as long as the source lives, and [`Source::next`], which hands out a
//! partition's next message once it is counted (see `count.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Headers;
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientContext, Message as _, TopicPartitionList};
use tokio::sync::Notify;

use super::count::Block;
use super::partitions::{Flow, Out, Partitions, Tp};
use super::{KafkaDelivery, MESSAGE_ID_HEADER, broker, producer};
use crate::consumer::{BrokerError, Source};
use crate::store::{AsStore, StoreRef};

/// What the consumer's threads and its deliveries share.
pub(super) struct Shared {
    pub(super) partitions: Mutex<Partitions>,
    /// A message was read, a partition went free, a message was put back.
    pub(super) wake: Notify,
    /// The reader stopped on a fatal error.
    pub(super) failed: Mutex<Option<KafkaError>>,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Partitions> {
        self.partitions.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Follows the group's assignment: librdkafka calls it on a rebalance.
pub(super) struct Rebalancing {
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

pub(super) type Client = StreamConsumer<Rebalancing>;

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
pub(super) struct Link {
    pub(super) consumer: Client,
    pub(super) shared: Arc<Shared>,
    /// Per partition, the block of offsets last claimed (see `count`).
    pub(super) blocks: Mutex<HashMap<Tp, Block>>,
    pub(super) producer: FutureProducer,
    pub(super) store: StoreRef,
    pub(super) group: String,
    pub(super) parking: String,
    pub(super) keep_counts: Duration,
}

impl Link {
    pub(super) fn flow(&self, tp: &Tp, flow: Flow) {
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
/// [`Runner`](crate::consumer::Runner).
pub struct KafkaSource {
    pub(super) link: Arc<Link>,
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
