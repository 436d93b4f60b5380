//! The consumer scenarios on RabbitMQ (`IDEM_RABBITMQ_URL`), each on queues of
//! its own that it deletes at the end.

use std::collections::HashMap;
use std::sync::Mutex;

use idem_runtime::consumer::Parked;
use idem_runtime::consumer::rabbitmq::{self, RabbitMqSource};
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
            .prefetch(concurrency as u16)
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
