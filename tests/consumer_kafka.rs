//! The consumer scenarios on Kafka (a consumer group on the Kafka-protocol
//! broker at `IDEM_KAFKA_BROKERS`, Tansu in `scripts/test`), each on a topic
//! and a group of its own, and what only Kafka has: order per partition.
//!
//! Tansu's memory engine reports wrong high-water marks, so nothing here
//! rests on them: what was published is known from the producer's own
//! acknowledgements, and `drained` compares the group's commits with that.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::consumer::Parked;
use idem_runtime::consumer::kafka::{self, KafkaSource};
use idem_runtime::store::memory::MemoryStore;
use idem_tests::consumer::*;
use idem_tests::services;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

const PARTITIONS: i32 = 3;

struct Kafka {
    brokers: String,
    producer: FutureProducer,
    topic: String,
    group: String,
    /// Where deliveries are counted: one per test, shared by its consumers.
    counts: MemoryStore,
    /// The highest offset published per partition.
    published: Mutex<HashMap<i32, i64>>,
    next_partition: Mutex<i32>,
}

async fn create_topic(brokers: &str, topic: &str, partitions: i32) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| e.to_string())?;
    let made = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .map_err(|e| e.to_string())?;
    for r in made {
        r.map_err(|(t, e)| format!("{t}: {e}"))?;
    }
    Ok(())
}

impl Kafka {
    async fn new() -> Option<Kafka> {
        let brokers = services::kafka_brokers();
        let topic = format!("idem-test-consumer-{}", suffix());
        let created = async {
            create_topic(&brokers, &topic, PARTITIONS).await?;
            create_topic(&brokers, &format!("{topic}.parked"), 1).await
        };
        services::reachable("Kafka", &brokers, created.await)?;
        Some(Kafka {
            producer: kafka::producer(&brokers).unwrap(),
            group: format!("{topic}-group"),
            brokers,
            topic,
            counts: MemoryStore::new(),
            published: Mutex::default(),
            next_partition: Mutex::default(),
        })
    }

    /// Sends `order` to `partition`, keyed by its id; its offset.
    async fn publish_on(&self, partition: i32, order: &OrderPaid) -> i64 {
        let body = serde_json::to_vec(order).unwrap();
        let sent = self
            .producer
            .send(
                FutureRecord::<str, [u8]>::to(&self.topic)
                    .partition(partition)
                    .key(&order.order_id)
                    .payload(&body),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        self.note((sent.partition, sent.offset));
        sent.offset
    }

    fn note(&self, (partition, offset): (i32, i64)) {
        let mut published = self.published.lock().unwrap();
        let top = published.entry(partition).or_insert(offset);
        *top = (*top).max(offset);
    }
}

#[async_trait::async_trait]
impl Broker for Kafka {
    type Src = KafkaSource;

    /// Round the partitions, not by key: the shared scenarios send one order
    /// twice to have both copies in flight at once, which one partition (in
    /// order, one at a time) never does. `kafka::publish` by key is what
    /// `order_is_kept_per_partition_under_concurrency` uses.
    async fn publish(&self, order: &OrderPaid) {
        let partition = {
            let mut next = self.next_partition.lock().unwrap();
            *next = (*next + 1) % PARTITIONS;
            *next
        };
        self.publish_on(partition, order).await;
    }

    async fn publish_raw(&self, body: &[u8], message_id: Option<&str>) {
        let at = kafka::publish_raw(&self.producer, &self.topic, None, body, message_id)
            .await
            .unwrap();
        self.note(at);
    }

    async fn consumer(&self, name: &str) -> KafkaSource {
        KafkaSource::builder(&self.brokers, &self.topic, &self.group)
            .store(self.counts.clone())
            .set("client.id", name)
            // A member that stops heartbeating loses its partitions soon.
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .connect()
            .await
            .unwrap()
    }

    async fn parked(&self) -> Vec<Parked> {
        kafka::parked(
            &self.brokers,
            &format!("{}.parked", self.topic),
            1000,
            Duration::from_secs(2),
        )
        .await
        .unwrap()
    }

    fn origin(&self) -> String {
        self.topic.clone()
    }

    async fn drained(&self) -> bool {
        let published = self.published.lock().unwrap().clone();
        let reader: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .create()
            .unwrap();
        let mut list = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            list.add_partition(&self.topic, p);
        }
        let Ok(committed) = reader.committed_offsets(list, Duration::from_secs(5)) else {
            return false;
        };
        published.iter().all(|(p, top)| {
            committed
                .find_partition(&self.topic, *p)
                .is_some_and(|e| matches!(e.offset(), Offset::Offset(o) if o > *top))
        })
    }

    async fn cleanup(&self) {}

    fn child_args(&self) -> Vec<String> {
        vec!["kafka".into(), self.topic.clone(), self.group.clone()]
    }
}

#[tokio::test]
async fn duplicate_publish_is_processed_once() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::duplicate_publish_is_processed_once(b).await;
}

#[tokio::test]
async fn poison_is_parked() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::poison_is_parked(b).await;
}

#[tokio::test]
async fn effect_after_the_call_is_not_lost() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::effect_after_the_call_is_not_lost(b).await;
}

#[tokio::test]
async fn undecodable_bytes_are_parked_as_published() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::undecodable_bytes_are_parked_as_published(b).await;
}

#[tokio::test]
async fn failing_handler_is_parked_with_its_error() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::failing_handler_is_parked_with_its_error(b).await;
}

#[tokio::test]
async fn dead_consumer_is_taken_over() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::dead_consumer_is_taken_over(b).await;
}

#[tokio::test]
async fn replay_a_day_later_is_deduplicated() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::replay_a_day_later_is_deduplicated(b).await;
}

/// Two members of one group: the second joins while the first consumes (a
/// rebalance moves partitions between them); each order settles once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_consumers_settle_each_order_once() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::two_consumers_settle_each_order_once(b).await;
}

#[test]
fn in_progress_is_not_a_failure() {
    idem_tests::consumer::in_progress_is_not_a_failure(async { Kafka::new().await });
}

#[tokio::test]
async fn crash_and_panic_are_parked() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::crash_and_panic_are_parked(env!("CARGO_BIN_EXE_consumer_crash"), b).await;
}

#[tokio::test]
async fn one_key_twice_in_flight_runs_once() {
    let Some(b) = Kafka::new().await else { return };
    idem_tests::consumer::one_key_twice_in_flight_runs_once(b).await;
}

/// Kafka's promise: within a partition, messages are handled in offset
/// order, one at a time, under `concurrency(8)`; partitions overlap. 300
/// messages over 30 keys spread on 3 partitions: each key's messages are
/// handled in the order they were published, and more than one partition
/// was in flight at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn order_is_kept_per_partition_under_concurrency() {
    let Some(b) = Kafka::new().await else { return };
    let mut sent: HashMap<String, Vec<u64>> = HashMap::new();
    for i in 0..300u64 {
        let key = format!("key-{}", i % 30);
        let order = OrderPaid {
            order_id: format!("{key}#{i}"),
            amount: i,
        };
        let at = kafka::publish(&b.producer, &b.topic, Some(&key), &order)
            .await
            .unwrap();
        b.note(at);
        sent.entry(key).or_default().push(i);
    }
    let seen: Arc<Mutex<HashMap<String, Vec<u64>>>> = Arc::default();
    let running = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let most = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let runner = runner().concurrency(8);
    let task = spawn_with::<Kafka, _, _, _>(b.consumer("ordered").await, &runner, {
        let (seen, running, most) = (seen.clone(), running.clone(), most.clone());
        move |e: OrderPaid| {
            let (seen, running, most) = (seen.clone(), running.clone(), most.clone());
            async move {
                use std::sync::atomic::Ordering::SeqCst;
                let now = running.fetch_add(1, SeqCst) + 1;
                most.fetch_max(now, SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                let key = e.order_id.split('#').next().unwrap().to_owned();
                seen.lock().unwrap().entry(key).or_default().push(e.amount);
                running.fetch_sub(1, SeqCst);
                Ok::<_, SettleError>(())
            }
        }
    });
    eventually("all 300 are handled and committed", || async {
        runner.stats().acked >= 300 && b.drained().await
    })
    .await;
    task.abort();
    assert_eq!(
        *seen.lock().unwrap(),
        sent,
        "each key in publish order, once"
    );
    let most = most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (2..=PARTITIONS as u32).contains(&most),
        "partitions overlap, one message each at a time: {most} at once"
    );
}

/// A `consumer_crash kafka-tx` process of this test, its output kept for
/// failure messages.
struct Child {
    process: std::process::Child,
    said: Arc<Mutex<Vec<String>>>,
}

impl Child {
    fn start(name: &str, b: &Kafka, table: &str) -> Child {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};
        let mut process = Command::new(env!("CARGO_BIN_EXE_consumer_crash"))
            .args([name, "idem-test-kafka-tx:", "kafka-tx"])
            .args([&b.topic, &b.group, table])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start consumer_crash");
        let said: Arc<Mutex<Vec<String>>> = Arc::default();
        let stdout = process.stdout.take().expect("stdout");
        let lines = said.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        Child { process, said }
    }

    /// SIGKILL: no commit, no leaving the group, no goodbye.
    fn kill(&mut self) {
        self.process.kill().expect("SIGKILL");
        self.process.wait().expect("reap");
    }

    fn tail(&self) -> String {
        let said = self.said.lock().unwrap();
        said[said.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// What Kafka users rely on after a crash: a process SIGKILLed mid-batch
/// (three partitions in flight, each message a PostgreSQL transaction) has
/// committed no offset past a message it did not apply, and a new process
/// in the same group, starting from those commits, applies every message
/// exactly once. 300 messages, 30 keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_mid_batch_commits_nothing_ahead_and_the_next_applies_each_once() {
    let Some(b) = Kafka::new().await else { return };
    let url = services::postgres_url();
    let Some(pool) = services::reachable("PostgreSQL", &url, sqlx::PgPool::connect(&url).await)
    else {
        return;
    };
    let table = format!("idem_test_kafka_applied_{}", suffix());
    // No unique key: a message applied twice is two rows.
    sqlx::query(&format!("CREATE TABLE {table} (order_id TEXT NOT NULL)"))
        .execute(&pool)
        .await
        .unwrap();
    let mut at: HashMap<(i32, i64), String> = HashMap::new();
    // Ids of this run alone: idem's records outlive the table.
    let run = suffix();
    for i in 0..300u64 {
        let key = format!("key-{}", i % 30);
        let order = OrderPaid {
            order_id: format!("{run}-{key}#{i}"),
            amount: i,
        };
        let position = kafka::publish(&b.producer, &b.topic, Some(&key), &order)
            .await
            .unwrap();
        b.note(position);
        at.insert(position, order.order_id);
    }
    let applied = async || -> Vec<String> {
        sqlx::query_scalar(&format!("SELECT order_id FROM {table}"))
            .fetch_all(&pool)
            .await
            .unwrap()
    };

    let mut first = Child::start("consumer-1", &b, &table);
    eventually("a third of the messages are applied", || async {
        applied().await.len() >= 100
    })
    .await;
    first.kill();

    // The dead process commits nothing more: read its commits and what it
    // applied, in that order, so a row read is never newer than the commit.
    let committed = committed_offsets(&b);
    let rows: std::collections::HashSet<String> = applied().await.into_iter().collect();
    assert!(
        committed.values().any(|&o| o > 0),
        "the first process committed something before its kill: {committed:?}\n{}",
        first.tail()
    );
    let ahead: Vec<_> = at
        .iter()
        .filter(|((p, o), id)| committed.get(p).is_some_and(|c| o < c) && !rows.contains(*id))
        .collect();
    assert!(
        ahead.is_empty(),
        "committed past messages never applied: {ahead:?} (committed {committed:?})"
    );

    let second = Child::start("consumer-2", &b, &table);
    eventually("every message is applied and committed", || async {
        applied().await.len() >= 300 && b.drained().await
    })
    .await;
    drop(second);
    let mut times: HashMap<String, u32> = HashMap::new();
    for id in applied().await {
        *times.entry(id).or_default() += 1;
    }
    sqlx::query(&format!("DROP TABLE {table}"))
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(times.len(), 300, "every message applied");
    let twice: Vec<_> = times.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "applied more than once: {twice:?}");
}

/// The group's committed offset per partition, those it has.
fn committed_offsets(b: &Kafka) -> HashMap<i32, i64> {
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &b.brokers)
        .set("group.id", &b.group)
        .create()
        .unwrap();
    let mut list = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        list.add_partition(&b.topic, p);
    }
    let committed = reader
        .committed_offsets(list, Duration::from_secs(5))
        .unwrap();
    committed
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some((e.partition(), o)),
            _ => None,
        })
        .collect()
}

/// A delivery dropped undecided (its task cancelled, a handler that
/// panicked past the runner) commits nothing and is handed out again before
/// anything after it in its partition, counted as a second delivery.
#[tokio::test]
async fn a_dropped_delivery_commits_nothing_and_comes_back_first() {
    use idem_runtime::consumer::Delivery;
    let Some(b) = Kafka::new().await else { return };
    let mut offsets = Vec::new();
    for id in ["dropped-1", "dropped-2"] {
        offsets.push(b.publish_on(0, &order(id)).await);
    }
    let mut source = b.consumer("dropping").await;
    let first = next_within_a_minute(&mut source).await;
    assert_eq!(first.position(), Some((b.topic.as_str(), 0, offsets[0])));
    assert_eq!(first.attempt(), 1);
    drop(first);

    let again = next_within_a_minute(&mut source).await;
    assert_eq!(
        (again.position(), again.attempt()),
        (Some((b.topic.as_str(), 0, offsets[0])), 2),
        "the dropped message again, before the one after it"
    );
    assert_eq!(
        committed_offsets(&b).get(&0),
        None,
        "nothing committed for a dropped delivery"
    );
    again.ack().await.unwrap();
    let after = next_within_a_minute(&mut source).await;
    assert_eq!(after.position(), Some((b.topic.as_str(), 0, offsets[1])));
    eventually("the ack is committed", || async {
        committed_offsets(&b).get(&0) == Some(&(offsets[0] + 1))
    })
    .await;
}

/// Delivery counts past the first block of offsets (counts are claimed per
/// 128 offsets while a partition keeps its owner, the next block ahead of
/// time): a message at offset 130 whose owner dies before deciding it, three
/// owners in a row, is counted 1, 2, 3; the 130 before it, acked by the
/// first owner, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_past_the_first_block_that_outlives_its_owners_is_counted_each_time() {
    use idem_runtime::consumer::Delivery;
    let Some(b) = Kafka::new().await else { return };
    for i in 0..131 {
        b.publish_on(0, &order(format!("block-{i}"))).await;
    }
    let next = next_within_a_minute;
    let mut first = b.consumer("first-owner").await;
    for offset in 0..130 {
        let d = next(&mut first).await;
        assert_eq!(
            (d.position(), d.attempt()),
            (Some((b.topic.as_str(), 0, offset)), 1)
        );
        d.ack().await.unwrap();
    }
    eventually("the first owner's acks are committed", || async {
        committed_offsets(&b).get(&0) == Some(&130)
    })
    .await;
    let mut owner = first;
    for attempt in 1..=3 {
        let d = next(&mut owner).await;
        assert_eq!(
            (d.position(), d.attempt()),
            (Some((b.topic.as_str(), 0, 130)), attempt),
            "delivery {attempt} of the message at offset 130"
        );
        if attempt == 3 {
            break;
        }
        // The owner dies holding it: no verdict, no commit, it leaves the
        // group; the next owner starts from the last commit.
        drop(owner);
        drop(d);
        owner = b.consumer(&format!("owner-{}", attempt + 1)).await;
    }
}

/// The source's next delivery, bounded: a message lost would otherwise
/// leave the test waiting forever.
async fn next_within_a_minute(
    source: &mut KafkaSource,
) -> idem_runtime::consumer::kafka::KafkaDelivery {
    use idem_runtime::consumer::Source;
    tokio::time::timeout(Duration::from_secs(60), source.next())
        .await
        .expect("a delivery within 60 s")
        .unwrap()
}
