//! The processes `tests/outbox/crash.rs` kills with SIGKILL.
//!
//! ```text
//! outbox_proc produce <postgres schema> <topic> <message id>
//! outbox_proc relay <postgres schema> <redis url>
//! outbox_proc relay-kafka <postgres schema> <kafka brokers>
//! ```
//!
//! `produce` writes one message in a transaction, commits, prints
//! `committed`, and waits to be killed before any relay ran. `relay` relays
//! the schema's outbox into Redis Streams through a slow sink (one message at
//! a time, 20 ms apart, printing `published <id>` for each) with a lease of
//! one second, until it is killed; `relay-kafka` the same into Kafka.

use std::io::Write;
use std::str::FromStr;
use std::time::Duration;

use idem_runtime::consumer::BrokerError;
use idem_runtime::outbox::sink::{KafkaSink, RedisStreamsSink, Sink};
use idem_runtime::outbox::{self, Message, Outgoing, Relay};
use idem_tests::services;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

struct OneByOne<S>(S);

#[async_trait::async_trait]
impl<S: Sink> Sink for OneByOne<S> {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let mut out = Vec::new();
        for m in batch {
            let mut one = self.0.publish(std::slice::from_ref(m)).await;
            println!("published {}", m.id);
            std::io::stdout().flush().unwrap();
            out.append(&mut one);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        out
    }
}

/// Relays through `sink`, one message at a time, until killed.
async fn relay<S: Sink + 'static>(pool: sqlx::PgPool, sink: S) {
    let relay = Relay::builder(pool, OneByOne(sink))
        .batch(100)
        .lease(Duration::from_secs(1))
        .build();
    println!("relaying");
    std::io::stdout().flush().unwrap();
    relay.run().await;
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = PgConnectOptions::from_str(&services::postgres_url())
        .unwrap()
        .options([("search_path", args[1].as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("postgres");
    match args[0].as_str() {
        "produce" => {
            let mut tx = pool.begin().await.unwrap();
            outbox::put(
                &mut tx,
                Message::bytes(args[2].as_str(), b"{\"n\":1}".to_vec()).id(args[3].as_str()),
            )
            .await
            .unwrap();
            tx.commit().await.unwrap();
            println!("committed");
            std::io::stdout().flush().unwrap();
            std::future::pending::<()>().await;
        }
        "relay" => {
            let client = redis::Client::open(args[2].as_str()).unwrap();
            relay(pool, RedisStreamsSink::connect(&client).await.unwrap()).await;
        }
        "relay-kafka" => relay(pool, KafkaSink::connect(&args[2]).unwrap()).await,
        other => panic!("unknown mode {other}"),
    }
}
