//! The consumer scenarios on Redis Streams (a consumer group on the server at
//! `IDEM_REDIS_URL`), each on a stream of its own that it deletes at the end.

use std::time::Duration;

use idem_runtime::consumer::redis_streams::{self, RedisStreamsSource};
use idem_runtime::consumer::{Delivery, Parked, Source};
use idem_tests::consumer::*;
use idem_tests::services;
use redis::aio::MultiplexedConnection;

struct Streams {
    client: redis::Client,
    conn: MultiplexedConnection,
    stream: String,
    group: String,
}

impl Streams {
    async fn new() -> Option<Streams> {
        let url = services::redis_url();
        let client = redis::Client::open(url.as_str()).expect("a Redis URL");
        let conn = services::reachable(
            "Redis",
            &url,
            client.get_multiplexed_async_connection().await,
        )?;
        let stream = format!("idem-test-consumer-{}", suffix());
        Some(Streams {
            client,
            conn,
            group: format!("{stream}-group"),
            stream,
        })
    }

    fn parking(&self) -> String {
        format!("{}:parked", self.stream)
    }
}

#[async_trait::async_trait]
impl Broker for Streams {
    type Src = RedisStreamsSource;

    async fn publish(&self, order: &OrderPaid) {
        redis_streams::publish(&mut self.conn.clone(), &self.stream, order)
            .await
            .unwrap();
    }

    async fn publish_raw(&self, body: &[u8], message_id: Option<&str>) {
        redis_streams::publish_raw(&mut self.conn.clone(), &self.stream, body, message_id)
            .await
            .unwrap();
    }

    async fn consumer(&self, name: &str) -> RedisStreamsSource {
        self.consumer_for(name, 1).await
    }

    async fn consumer_for(&self, name: &str, concurrency: usize) -> RedisStreamsSource {
        // Short idle and block times keep the suite quick; they bound the
        // delays, which is fine here.
        RedisStreamsSource::builder(&self.stream, &self.group, name)
            .claim_idle(Duration::from_millis(1500))
            .block(Duration::from_millis(200))
            .batch(concurrency.max(10))
            .connect(&self.client)
            .await
            .unwrap()
    }

    async fn parked(&self) -> Vec<Parked> {
        redis_streams::parked(&mut self.conn.clone(), &self.parking(), 1000)
            .await
            .unwrap()
    }

    fn origin(&self) -> String {
        self.stream.clone()
    }

    async fn drained(&self) -> bool {
        let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(&self.group)
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
        let groups: redis::streams::StreamInfoGroupsReply = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.stream)
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
        let lag = groups
            .groups
            .iter()
            .find(|g| g.name == self.group)
            .and_then(|g| g.lag);
        pending.count() == 0 && lag == Some(0)
    }

    fn child_args(&self) -> Vec<String> {
        vec!["redis".into(), self.stream.clone(), self.group.clone()]
    }

    async fn cleanup(&self) {
        let _: () = redis::cmd("DEL")
            .arg(&self.stream)
            .arg(self.parking())
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn duplicate_publish_is_processed_once() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::duplicate_publish_is_processed_once(b).await;
}

#[tokio::test]
async fn dead_consumer_is_taken_over() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::dead_consumer_is_taken_over(b).await;
}

#[tokio::test]
async fn replay_a_day_later_is_deduplicated() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::replay_a_day_later_is_deduplicated(b).await;
}

#[tokio::test]
async fn poison_is_parked() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::poison_is_parked(b).await;
}

#[tokio::test]
async fn two_consumers_settle_each_order_once() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::two_consumers_settle_each_order_once(b).await;
}

#[test]
fn in_progress_is_not_a_failure() {
    idem_tests::consumer::in_progress_is_not_a_failure(async { Streams::new().await });
}

#[tokio::test]
async fn effect_after_the_call_is_not_lost() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::effect_after_the_call_is_not_lost(b).await;
}

#[tokio::test]
async fn crash_and_panic_are_parked() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::crash_and_panic_are_parked(env!("CARGO_BIN_EXE_consumer_crash"), b).await;
}

#[tokio::test]
async fn concurrency_keeps_n_in_flight() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::concurrency_keeps_n_in_flight(b).await;
}

#[tokio::test]
async fn one_key_twice_in_flight_runs_once() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::one_key_twice_in_flight_runs_once(b).await;
}

#[tokio::test]
async fn poison_is_parked_under_concurrency() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::poison_is_parked_under_concurrency(b).await;
}

#[tokio::test]
async fn undecodable_bytes_are_parked_as_published() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::undecodable_bytes_are_parked_as_published(b).await;
}

#[tokio::test]
async fn failing_handler_is_parked_with_its_error() {
    let Some(b) = Streams::new().await else {
        return;
    };
    idem_tests::consumer::failing_handler_is_parked_with_its_error(b).await;
}

/// A slow but healthy consumer: each run takes 700 ms, under `claim_idle`
/// (1 s), and the default batch (10) leaves entries waiting in its buffer
/// for several seconds. None may go idle for `claim_idle` (another member
/// polling `XAUTOCLAIM` finds nothing to take) or have a delivery counted
/// that never ran: with `max_deliveries(1)`, one counted twice would be
/// parked unrun (was: the buffered entries passed `claim_idle`, were dropped,
/// came back through `XAUTOCLAIM` as second deliveries and were parked as
/// crashed).
#[tokio::test]
async fn a_slow_healthy_consumer_has_nothing_taken_over_or_counted_twice() {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    let Some(b) = Streams::new().await else {
        return;
    };
    let orders: Vec<String> = (0..6).map(|i| format!("slow-{i}")).collect();
    for id in &orders {
        b.publish(&order(id.as_str())).await;
    }
    let source = RedisStreamsSource::builder(&b.stream, &b.group, "slow")
        .claim_idle(Duration::from_secs(1))
        .block(Duration::from_millis(200))
        .connect(&b.client)
        .await
        .unwrap();
    // Another member of the group takes over whatever has been idle for
    // `claim_idle`, as a second consumer would: it must find nothing.
    let stolen = Arc::new(Mutex::new(Vec::<String>::new()));
    let thief = tokio::spawn({
        let (mut conn, stream, group, stolen) = (
            b.conn.clone(),
            b.stream.clone(),
            b.group.clone(),
            stolen.clone(),
        );
        async move {
            loop {
                let reply: redis::Value = redis::cmd("XAUTOCLAIM")
                    .arg(&stream)
                    .arg(&group)
                    .arg("thief")
                    .arg(1000)
                    .arg("0-0")
                    .arg("COUNT")
                    .arg(100)
                    .arg("JUSTID")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                // [next cursor, [claimed id…], deleted ids]
                if let redis::Value::Array(parts) = reply
                    && let Some(redis::Value::Array(ids)) = parts.get(1)
                {
                    for id in ids {
                        if let redis::Value::BulkString(id) = id {
                            stolen
                                .lock()
                                .unwrap()
                                .push(String::from_utf8_lossy(id).into());
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let runner = runner().max_deliveries(1);
    let task = spawn_with::<Streams, _, _, _>(source, &runner, {
        let runs = runs.clone();
        move |e: OrderPaid| {
            let runs = runs.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(700)).await;
                *runs.lock().unwrap().entry(e.order_id).or_default() += 1;
                Ok::<_, SettleError>(())
            }
        }
    });
    eventually("every entry is acked or parked", || async {
        let s = runner.stats();
        s.acked + s.parked >= orders.len() as u64
    })
    .await;
    task.abort();
    thief.abort();

    assert_eq!(
        *stolen.lock().unwrap(),
        Vec::<String>::new(),
        "entries went idle for claim_idle and another consumer took them"
    );
    assert_eq!(b.parked().await, vec![], "parked without being run");
    let runs = runs.lock().unwrap().clone();
    for id in &orders {
        assert_eq!(runs.get(id), Some(&1), "{id}: {runs:?}");
    }
    let stats = runner.stats();
    assert_eq!((stats.delivered, stats.processed), (6, 6), "{stats:?}");
    assert!(b.drained().await);
    b.cleanup().await;
}

/// A park whose copy cannot be written (the parking key holds a string, not
/// a stream: `WRONGTYPE`) must not ack the entry: `process` fails and the
/// entry stays pending. Once the key is a stream again, the entry comes back
/// through `XAUTOCLAIM` and is parked as usual (was: `MULTI` ran the `XACK`
/// after the failed `XADD`, so the entry was neither pending nor parked).
#[tokio::test]
async fn a_park_that_cannot_write_its_copy_leaves_the_entry_pending() {
    let Some(b) = Streams::new().await else {
        return;
    };
    let mut conn = b.conn.clone();
    b.publish_raw(b"{\"order_id\": 7", Some("m-wrongtype"))
        .await;
    let _: () = redis::cmd("SET")
        .arg(b.parking())
        .arg("not a stream")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut source = b.consumer("c1").await;
    let runner = runner();
    let handler = |_: OrderPaid| async { Ok::<_, SettleError>(()) };

    let refused = runner.process(source.next().await.unwrap(), &handler).await;
    let e = refused.expect_err("a park whose copy was refused");
    assert!(e.to_string().contains("WRONGTYPE"), "{e}");
    let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
        .arg(&b.stream)
        .arg(&b.group)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(pending.count(), 1, "the entry is still pending");

    let _: () = redis::cmd("DEL")
        .arg(b.parking())
        .query_async(&mut conn)
        .await
        .unwrap();
    let again = tokio::time::timeout(Duration::from_secs(10), source.next())
        .await
        .expect("taken over after claim_idle")
        .unwrap();
    assert_eq!(again.attempt(), 2);
    runner.process(again, &handler).await.unwrap();
    let parked = b.parked().await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].message_id.as_deref(), Some("m-wrongtype"));
    assert_eq!(parked[0].deliveries, Some(2));
    assert!(b.drained().await);
    b.cleanup().await;
}

/// An entry deleted from the stream (`XDEL`, `XTRIM`, the sink's `max_len`)
/// while pending on a consumer that died: `XAUTOCLAIM` (Redis 7) drops it
/// from the pending list and names it as deleted; the next consumer hands
/// nothing out for it, and its neighbour still comes through. The message is
/// gone without a delivery: what the table's trimming row warns of.
#[tokio::test]
async fn an_entry_deleted_while_pending_is_dropped_not_handed_out() {
    let Some(b) = Streams::new().await else {
        return;
    };
    let mut conn = b.conn.clone();
    b.publish(&order("deleted")).await;
    b.publish(&order("kept")).await;
    let mut dead = b.consumer("dead").await;
    let first = dead.next().await.unwrap();
    let second = dead.next().await.unwrap();
    let deleted = first.id().to_owned();
    // The consumer dies with both pending; one of them is deleted.
    drop((first, second, dead));
    let _: i64 = redis::cmd("XDEL")
        .arg(&b.stream)
        .arg(&deleted)
        .query_async(&mut conn)
        .await
        .unwrap();

    let mut next = b.consumer("next").await;
    let taken = tokio::time::timeout(Duration::from_secs(10), next.next())
        .await
        .expect("the neighbour taken over after claim_idle")
        .unwrap();
    assert_ne!(taken.id(), deleted);
    let body: OrderPaid = serde_json::from_slice(taken.payload().unwrap()).unwrap();
    assert_eq!(body.order_id, "kept");
    taken.ack().await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), next.next())
            .await
            .is_err(),
        "nothing handed out for the deleted entry"
    );
    assert!(b.drained().await, "the deleted entry left the pending list");
    b.cleanup().await;
}
