//! The consumer scenarios on NATS JetStream (`IDEM_NATS_URL`), each on a
//! stream and a parking stream of its own that it deletes at the end.

use std::time::Duration;

use async_nats::jetstream::{self, Context, stream};
use idem_runtime::consumer::Parked;
use idem_runtime::consumer::jetstream::{self as idem_jetstream, JetStreamSource};
use idem_tests::consumer::*;
use idem_tests::services;

struct Nats {
    url: String,
    js: Context,
    stream: String,
    subject: String,
}

impl Nats {
    async fn new() -> Option<Nats> {
        let url = services::nats_url();
        let client = services::reachable("NATS", &url, async_nats::connect(url.as_str()).await)?;
        let js = jetstream::new(client);
        let name = format!("IDEM_TEST_{}", suffix().to_uppercase());
        let subject = format!("idem-test.{name}");
        for (stream, subject) in [
            (name.clone(), subject.clone()),
            (format!("{name}_PARKED"), format!("{subject}.parked")),
        ] {
            js.create_stream(stream::Config {
                name: stream,
                subjects: vec![subject],
                ..Default::default()
            })
            .await
            .unwrap();
        }
        Some(Nats {
            url,
            js,
            stream: name,
            subject,
        })
    }
}

#[async_trait::async_trait]
impl Broker for Nats {
    type Src = JetStreamSource;

    async fn publish(&self, order: &OrderPaid) {
        idem_jetstream::publish(&self.js, &self.subject, order)
            .await
            .unwrap();
    }

    async fn publish_raw(&self, body: &[u8], message_id: Option<&str>) {
        idem_jetstream::publish_raw(&self.js, &self.subject, body, message_id)
            .await
            .unwrap();
    }

    async fn consumer(&self, name: &str) -> JetStreamSource {
        self.consumer_for(name, 1).await
    }

    async fn consumer_for(&self, _name: &str, concurrency: usize) -> JetStreamSource {
        // A connection per consumer, as separate processes would have. The
        // ack wait is short so a dead consumer's message comes back quickly.
        let client = async_nats::connect(self.url.as_str()).await.unwrap();
        JetStreamSource::builder(
            &self.stream,
            "settlement",
            &format!("{}.parked", self.subject),
        )
        .ack_wait(Duration::from_secs(2))
        .batch(concurrency.max(10))
        .connect(&jetstream::new(client))
        .await
        .unwrap()
    }

    async fn parked(&self) -> Vec<Parked> {
        idem_jetstream::parked(&self.js, &format!("{}_PARKED", self.stream), 1000)
            .await
            .unwrap()
    }

    fn origin(&self) -> String {
        self.stream.clone()
    }

    async fn drained(&self) -> bool {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let info = stream.consumer_info("settlement").await.unwrap();
        info.num_pending == 0 && info.num_ack_pending == 0
    }

    fn child_args(&self) -> Vec<String> {
        vec![
            "nats".into(),
            self.stream.clone(),
            format!("{}.parked", self.subject),
        ]
    }

    async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.stream).await;
        let _ = self
            .js
            .delete_stream(format!("{}_PARKED", self.stream))
            .await;
    }
}

#[tokio::test]
async fn duplicate_publish_is_processed_once() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::duplicate_publish_is_processed_once(b).await;
}

#[tokio::test]
async fn dead_consumer_is_taken_over() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::dead_consumer_is_taken_over(b).await;
}

#[tokio::test]
async fn replay_a_day_later_is_deduplicated() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::replay_a_day_later_is_deduplicated(b).await;
}

#[tokio::test]
async fn poison_is_parked() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::poison_is_parked(b).await;
}

#[tokio::test]
async fn two_consumers_settle_each_order_once() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::two_consumers_settle_each_order_once(b).await;
}

#[test]
fn in_progress_is_not_a_failure() {
    idem_tests::consumer::in_progress_is_not_a_failure(Nats::new());
}

#[tokio::test]
async fn effect_after_the_call_is_not_lost() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::effect_after_the_call_is_not_lost(b).await;
}

#[tokio::test]
async fn crash_and_panic_are_parked() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::crash_and_panic_are_parked(env!("CARGO_BIN_EXE_consumer_crash"), b).await;
}

#[tokio::test]
async fn concurrency_keeps_n_in_flight() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::concurrency_keeps_n_in_flight(b).await;
}

#[tokio::test]
async fn one_key_twice_in_flight_runs_once() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::one_key_twice_in_flight_runs_once(b).await;
}

#[tokio::test]
async fn poison_is_parked_under_concurrency() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::poison_is_parked_under_concurrency(b).await;
}

#[tokio::test]
async fn undecodable_bytes_are_parked_as_published() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::undecodable_bytes_are_parked_as_published(b).await;
}

#[tokio::test]
async fn failing_handler_is_parked_with_its_error() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::failing_handler_is_parked_with_its_error(b).await;
}
