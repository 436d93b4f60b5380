//! Where a relay publishes: one [`Sink`] per broker, each confirming only what
//! the broker took, and each carrying the message id where that broker's
//! consumers (and [`Envelope`](crate::consumer::Envelope)) find it.
//!
//! | sink | topic is | message id travels as | duplicate re-publish |
//! |---|---|---|---|
//! | `RedisStreamsSink` (feature `redis-streams`) | the stream | field `message-id` | a second entry; the consumer's record deduplicates |
//! | `JetStreamSink` (feature `jetstream`) | the subject | `Nats-Msg-Id` header | dropped by the server inside the stream's duplicate window |
//! | `RabbitMqSink` (feature `rabbitmq`) | the routing key (on the default exchange unless set) | AMQP `message-id` | a second message; the consumer's record deduplicates |
//! | [`MemorySink`] | anything | [`Outgoing::id`] | delivered again |
//!
//! What each broker answers at its limits (name, header and size caps, returned
//! and duplicate messages, a connection lost before the confirm), and which test
//! holds the sink to it, is tabled under `# Limits of …` in the consumer module
//! of that broker (`consumer::rabbitmq`, `consumer::jetstream`,
//! `consumer::redis_streams`).
//!
//! A sink publishes what a relay claimed and says what the broker took; the
//! in-process one shows the shape:
//!
//! ```
//! use idem_runtime::outbox::sink::MemorySink;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let (sink, mut published) = MemorySink::channel(16);
//! sink.set_down(true); // every publish fails: the relay backs off, the backlog stays
//! sink.set_down(false);
//! assert!(published.try_recv().is_err()); // nothing published yet
//! # });
//! ```

#[cfg(feature = "jetstream")]
mod jetstream;
#[cfg(feature = "kafka")]
mod kafka;
mod memory;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
#[cfg(feature = "redis-streams")]
mod redis_streams;

#[cfg(feature = "jetstream")]
#[cfg_attr(docsrs, doc(cfg(feature = "jetstream")))]
pub use jetstream::JetStreamSink;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use kafka::KafkaSink;
pub use memory::MemorySink;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub use rabbitmq::RabbitMqSink;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub use redis_streams::RedisStreamsSink;

use super::Outgoing;
use crate::consumer::BrokerError;

/// A broker the relay publishes to.
///
/// ```
/// use idem_runtime::consumer::BrokerError;
/// use idem_runtime::outbox::{Outgoing, sink::Sink};
///
/// /// Prints instead of publishing.
/// struct Stdout;
///
/// #[async_trait::async_trait]
/// impl Sink for Stdout {
///     fn name(&self) -> &'static str { "stdout" }
///     async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
///         batch.iter().map(|m| { println!("{} {}", m.topic, m.id); Ok(()) }).collect()
///     }
/// }
/// ```
#[async_trait::async_trait]
pub trait Sink: Send + Sync {
    /// The broker's name, for errors and logs.
    fn name(&self) -> &'static str;

    /// Publishes a batch (at most one message per ordering key, so any order
    /// among them is fine) and says, per message in the same order, whether
    /// the broker confirmed it. Only a confirmed message is marked sent; a
    /// missing answer counts as a failure.
    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>>;
}
