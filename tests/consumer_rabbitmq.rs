//! The consumer scenarios on RabbitMQ (`IDEM_RABBITMQ_URL`), each on queues of
//! its own that it deletes at the end.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use idem_runtime::consumer::rabbitmq::{self, RabbitMqSource};
use idem_runtime::consumer::{Action, Delivery, Parked, Runner, Source};
use idem_runtime::store::memory::MemoryStore;
use idem_tests::consumer::*;
use idem_tests::services;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

struct Rabbit {
    conn: Connection,
    channel: Channel,
    queue: String,
    /// Each consumer's own connection, so `kill` can cut it.
    consumers: Mutex<HashMap<String, Connection>>,
}

impl Rabbit {
    async fn new() -> Option<Rabbit> {
        let url = services::rabbitmq_url();
        let conn = services::reachable("RabbitMQ", &url, rabbitmq::connect(&url).await)?;
        let channel = conn.create_channel().await.unwrap();
        let queue = format!("idem-test-consumer-{}", suffix());
        RabbitMqSource::declare(&channel, &queue).await.unwrap();
        channel.confirm_select(Default::default()).await.unwrap();
        Some(Rabbit {
            conn,
            channel,
            queue,
            consumers: Mutex::default(),
        })
    }

    async fn ready(&self, queue: &str) -> u32 {
        let q = self
            .channel
            .queue_declare(
                queue,
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        q.message_count()
    }
}

#[async_trait::async_trait]
impl Broker for Rabbit {
    type Src = RabbitMqSource;

    async fn publish(&self, order: &OrderPaid) {
        rabbitmq::publish(&self.channel, &self.queue, order)
            .await
            .unwrap();
    }

    async fn publish_raw(&self, body: &[u8], message_id: Option<&str>) {
        rabbitmq::publish_raw(&self.channel, &self.queue, body, message_id)
            .await
            .unwrap();
    }

    async fn consumer(&self, name: &str) -> RabbitMqSource {
        // Prefetch 1: a consumer busy with one message leaves the rest to the
        // other, which the in-progress scenario relies on.
        self.consumer_for(name, 1).await
    }

    async fn consumer_for(&self, name: &str, concurrency: usize) -> RabbitMqSource {
        let conn = rabbitmq::connect(&services::rabbitmq_url()).await.unwrap();
        let channel = conn.create_channel().await.unwrap();
        let source = RabbitMqSource::builder(&self.queue, name)
            .prefetch(u16::try_from(concurrency).unwrap_or(u16::MAX))
            .connect(channel)
            .await
            .unwrap();
        self.consumers.lock().unwrap().insert(name.to_owned(), conn);
        source
    }

    async fn parked(&self) -> Vec<Parked> {
        rabbitmq::parked(&self.channel, &format!("{}.parked", self.queue), 1000)
            .await
            .unwrap()
    }

    fn origin(&self) -> String {
        self.queue.clone()
    }

    fn parking_is_a_stream(&self) -> bool {
        false
    }

    async fn drained(&self) -> bool {
        // Unacked messages are not `ready`; the scenarios check acks through
        // the runners' counters.
        self.ready(&self.queue).await == 0
            && self.ready(&format!("{}.retry", self.queue)).await == 0
    }

    async fn kill(&self, name: &str) {
        let conn = self.consumers.lock().unwrap().remove(name);
        if let Some(conn) = conn {
            let _ = conn.close(320, "killed").await;
        }
    }

    fn child_args(&self) -> Vec<String> {
        vec!["rabbitmq".into(), self.queue.clone()]
    }

    async fn cleanup(&self) {
        for q in ["", ".retry", ".parked"] {
            let _ = self
                .channel
                .queue_delete(&format!("{}{q}", self.queue), QueueDeleteOptions::default())
                .await;
        }
        let _ = self
            .channel
            .exchange_delete(&format!("{}.dlx", self.queue), Default::default())
            .await;
        let conns: Vec<Connection> = self
            .consumers
            .lock()
            .unwrap()
            .drain()
            .map(|(_, c)| c)
            .collect();
        for c in conns {
            let _ = c.close(200, "done").await;
        }
        let _ = self.conn.close(200, "done").await;
    }
}

#[tokio::test]
async fn duplicate_publish_is_processed_once() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::duplicate_publish_is_processed_once(b).await;
}

#[tokio::test]
async fn dead_consumer_is_taken_over() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::dead_consumer_is_taken_over(b).await;
}

#[tokio::test]
async fn replay_a_day_later_is_deduplicated() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::replay_a_day_later_is_deduplicated(b).await;
}

#[tokio::test]
async fn poison_is_parked() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::poison_is_parked(b).await;
}

#[tokio::test]
async fn two_consumers_settle_each_order_once() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::two_consumers_settle_each_order_once(b).await;
}

#[test]
fn in_progress_is_not_a_failure() {
    idem_tests::consumer::in_progress_is_not_a_failure(Rabbit::new());
}

#[tokio::test]
async fn effect_after_the_call_is_not_lost() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::effect_after_the_call_is_not_lost(b).await;
}

#[tokio::test]
async fn crash_and_panic_are_parked() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::crash_and_panic_are_parked(env!("CARGO_BIN_EXE_consumer_crash"), b).await;
}

#[tokio::test]
async fn concurrency_keeps_n_in_flight() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::concurrency_keeps_n_in_flight(b).await;
}

#[tokio::test]
async fn one_key_twice_in_flight_runs_once() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::one_key_twice_in_flight_runs_once(b).await;
}

#[tokio::test]
async fn poison_is_parked_under_concurrency() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::poison_is_parked_under_concurrency(b).await;
}

#[tokio::test]
async fn undecodable_bytes_are_parked_as_published() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::undecodable_bytes_are_parked_as_published(b).await;
}

#[tokio::test]
async fn failing_handler_is_parked_with_its_error() {
    let Some(b) = Rabbit::new().await else { return };
    idem_tests::consumer::failing_handler_is_parked_with_its_error(b).await;
}

// ---- Limits of RabbitMQ (issue 30): the boundary tests of the module's
// `# Limits of RabbitMQ` table, each against the real broker. ----

/// The next delivery, within a deadline far above what the broker needs.
async fn next(source: &mut RabbitMqSource) -> <RabbitMqSource as Source>::Delivery {
    tokio::time::timeout(Duration::from_secs(20), source.next())
        .await
        .expect("a delivery within 20 s")
        .expect("the broker")
}

/// Regression: a redelivery copy was published without `mandatory`, so with
/// `q.retry` gone the broker confirmed and dropped it and the original was
/// acked: `process` said `Retried` and the message was lost. Now the copy
/// comes back, `process` fails naming `q.retry`, and the original stays.
#[tokio::test]
async fn a_retry_copy_no_queue_takes_is_an_error_and_the_original_stays() {
    let Some(b) = Rabbit::new().await else { return };
    let ledger = Ledger::new(MemoryStore::new());
    // A backoff long enough for the copy to wait in `q.retry` to be counted.
    let runner = runner().backoff(Duration::from_secs(60), Duration::from_secs(60));
    let handler = |e: OrderPaid| settle(ledger.clone(), e);
    let retry = format!("{}.retry", b.queue);

    // Under: `q.retry` is there and takes the copy.
    b.publish(&order("poison-retried")).await;
    let mut source = b.consumer_for("c1", 1).await;
    let action = runner.process(next(&mut source).await, &handler).await;
    assert!(matches!(action, Ok(Action::Retried { .. })), "{action:?}");
    assert_eq!((b.ready(&b.queue).await, b.ready(&retry).await), (0, 1));

    // Over: with `q.retry` deleted, no queue takes the copy.
    b.publish(&order("poison-kept")).await;
    its_copy_comes_back_and_it_stays(&b, &mut source, &runner, &handler, &retry).await;
}

/// Deletes the queue `gone`, then processes the next delivery, whose copy
/// goes there: the copy comes back, `process` fails naming `gone`, and the
/// original, unacked, is handed back by the broker when the consumer goes.
async fn its_copy_comes_back_and_it_stays<H, Fut>(
    b: &Rabbit,
    source: &mut RabbitMqSource,
    runner: &Runner,
    handler: &H,
    gone: &str,
) where
    H: Fn(OrderPaid) -> Fut,
    Fut: Future<Output = Result<(), SettleError>>,
{
    b.channel
        .queue_delete(gone, QueueDeleteOptions::default())
        .await
        .unwrap();
    let err = runner
        .process(next(source).await, handler)
        .await
        .expect_err("a copy that came back");
    assert!(
        err.to_string().contains(&format!("`{gone}`")) && err.to_string().contains("came back"),
        "{err}"
    );
    b.kill("c1").await;
    eventually("the original is back in the queue", || async {
        b.ready(&b.queue).await == 1
    })
    .await;
    b.cleanup().await;
}

/// Regression: the parked copy went to `q.dlx` without `mandatory`, so with
/// `q.parked` gone (no queue bound to the exchange) it was dropped and the
/// original acked. Now `process` fails naming both, and the original stays.
#[tokio::test]
async fn a_parked_copy_no_queue_takes_is_an_error_and_the_original_stays() {
    let Some(b) = Rabbit::new().await else { return };
    let runner = runner();
    let handler = |_: OrderPaid| async { Ok::<(), SettleError>(()) };
    let parked = format!("{}.parked", b.queue);

    // Under: `q.parked` is bound and takes the copy.
    b.publish_raw(b"not json", Some("m-parked")).await;
    let mut source = b.consumer_for("c1", 1).await;
    let action = runner.process(next(&mut source).await, &handler).await;
    assert!(matches!(action, Ok(Action::Parked { .. })), "{action:?}");
    assert_eq!(b.ready(&parked).await, 1);

    // Over: with `q.parked` deleted, `q.dlx` routes the copy nowhere.
    b.publish_raw(b"not json either", Some("m-kept")).await;
    its_copy_comes_back_and_it_stays(&b, &mut source, &runner, &handler, &parked).await;
}

/// A handler error whose `Debug` is exactly this long (the order's `amount`).
struct Text(u64);

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&"x".repeat(self.0 as usize))
    }
}

/// Regression: a parked copy carries the handler's error text in
/// `x-idem-reason`; a text past `frame_max` made a content header frame the
/// broker refuses with a connection error, so the park failed and the
/// message came back. The reason is cut to fit now: whole at exactly a
/// `frame_max`-byte header frame, cut one byte over (where RabbitMQ's own
/// 8-byte slack would still have taken it) and far over.
#[tokio::test]
async fn a_parked_reason_is_cut_to_fit_frame_max() {
    let Some(b) = Rabbit::new().await else { return };
    let frame_max = b.conn.configuration().frame_max() as usize;
    let runner = runner().max_deliveries(1);
    let handler = |e: OrderPaid| async move { Err::<(), _>(Text(e.amount)) };
    let prefix = "failed 1 counted deliveries; the last: ";
    // The parked copy's content header frame, counted by hand: frame
    // overhead 8, class, weight and body size 12, property flags 2,
    // `content-type` (1 + 16), `delivery-mode` 1, the header table's length
    // 4 and its entries, each a name (1 + len), a type octet and the value:
    // `x-idem-deliveries` a 64-bit integer, `x-idem-queue` and
    // `x-idem-reason` long strings (4 + len).
    let fixed =
        8 + 12 + 2 + 17 + 1 + 4 + (18 + 1 + 8) + (13 + 1 + 4 + b.queue.len()) + (14 + 1 + 4);
    let room = frame_max - fixed;
    let at = (room - prefix.len()) as u64;
    let mut source = b.consumer_for("c1", 1).await;
    for (name, amount) in [("at", at), ("over", at + 1), ("far-over", 140_000)] {
        b.publish(&OrderPaid {
            order_id: name.into(),
            amount,
        })
        .await;
        let action = runner.process(next(&mut source).await, &handler).await;
        assert!(
            matches!(action, Ok(Action::Parked { .. })),
            "{name}: {action:?}"
        );
    }
    let parked = b.parked().await;
    assert_eq!(parked.len(), 3, "{parked:?}");
    let whole = format!("{prefix}{}", "x".repeat(at as usize));
    assert_eq!(parked[0].reason, whole, "exactly at the frame: whole");
    for (p, amount) in parked[1..].iter().zip([at + 1, 140_000]) {
        let len = prefix.len() + amount as usize;
        assert!(p.reason.len() <= room, "{} > {room}", p.reason.len());
        assert!(
            p.reason.starts_with(&format!("{prefix}xxx"))
                && p.reason
                    .ends_with(&format!("(cut to fit the frame: {len} bytes in all)")),
            "{}",
            &p.reason[p.reason.len() - 80..]
        );
    }
    b.cleanup().await;
}

/// `declare` derives `q.retry`, `q.parked` and `q.dlx`: at 248 bytes
/// `q.parked` is AMQP's 255 and all is declared; at 249 it is an error naming
/// the queue before anything is sent (it was a corrupt frame and a closed
/// connection), and the connection goes on.
#[tokio::test]
async fn declare_refuses_a_queue_whose_derived_names_pass_255_bytes() {
    let url = services::rabbitmq_url();
    let Some(conn) = services::reachable("RabbitMQ", &url, rabbitmq::connect(&url).await) else {
        return;
    };
    let channel = conn.create_channel().await.unwrap();
    let mut at = format!("idem-test-long-{}-", suffix());
    at.push_str(&"q".repeat(248 - at.len()));
    RabbitMqSource::declare(&channel, &at).await.unwrap();
    let parked = format!("{at}.parked");
    assert_eq!(parked.len(), 255);
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    channel
        .queue_declare(&parked, passive, FieldTable::default())
        .await
        .expect("`q.parked` declared at 255 bytes");
    for q in ["", ".retry", ".parked"] {
        channel
            .queue_delete(&format!("{at}{q}"), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    channel
        .exchange_delete(&format!("{at}.dlx"), Default::default())
        .await
        .unwrap();

    let over = format!("{at}q");
    let err = RabbitMqSource::declare(&channel, &over)
        .await
        .expect_err("249 bytes");
    assert!(
        err.to_string().contains(&format!("`{over}` is 249 bytes")),
        "{err}"
    );
    // Nothing was sent: the channel still works, and nothing was declared.
    let found = channel
        .queue_declare(&over, passive, FieldTable::default())
        .await;
    assert!(found.is_err(), "{found:?}");
    let fresh = conn.create_channel().await.unwrap();
    fresh
        .queue_declare(&at, passive, FieldTable::default())
        .await
        .expect_err("deleted above");
    let _ = conn.close(200, "done").await;
}

/// The prefetch is a `u16` where AMQP's 0 is unlimited: `prefetch(0)` hands
/// out one message at a time, and a prefetch below the runner's concurrency
/// caps the deliveries running (as it would a concurrency past 65 535).
#[tokio::test]
async fn prefetch_0_is_1_and_a_prefetch_below_concurrency_caps_it() {
    let Some(b) = Rabbit::new().await else { return };
    for i in 0..2 {
        b.publish(&order(format!("one-{i}"))).await;
    }
    let mut source = b.consumer_for("c1", 0).await;
    let first = next(&mut source).await;
    let second = tokio::time::timeout(Duration::from_millis(500), source.next()).await;
    assert!(second.is_err(), "a second delivery with one unacked");
    first.ack().await.unwrap();
    next(&mut source).await.ack().await.unwrap();
    b.kill("c1").await;

    // Four slots, a prefetch of 2: two bodies run at once, never more.
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner().concurrency(4);
    for i in 0..4 {
        b.publish(&order(format!("hold-{i}"))).await;
    }
    let task = spawn::<Rabbit>(b.consumer_for("c2", 2).await, &runner, &ledger);
    let _two = ledger.started.acquire_many(2).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(ledger.running.load(SeqCst), 2);
    ledger.release.add_permits(4);
    eventually("all four ran", || async { runner.stats().acked == 4 }).await;
    assert_eq!(ledger.most_running.load(SeqCst), 2);
    task.abort();
    b.cleanup().await;
}
