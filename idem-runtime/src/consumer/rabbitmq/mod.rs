//! RabbitMQ through lapin (feature `rabbitmq`).
//!
//! [`RabbitMqSource::declare`] sets up, for a queue `q`:
//!
//! - `q`, durable, whose dead-letter exchange is `q.dlx`;
//! - `q.retry`, durable, with no consumer: a message published there with a
//!   per-message TTL (`expiration`) is dead-lettered back to `q` when it runs
//!   out. That is the delayed redelivery. `basic.nack` with `requeue = true`
//!   is never used: it hands the message straight back, and in-progress
//!   duplicates then spin (100 messages became 907 deliveries that way);
//! - `q.dlx` (fanout) bound to `q.parked`, where parked messages wait for an
//!   operator, with the reason in the header `x-idem-reason`; [`parked`]
//!   reads them back.
//!
//! Deliveries are acked manually after the outcome is recorded, with a
//! prefetch: at least the runner's
//! [`concurrency`](super::Runner::concurrency), or fewer deliveries are in
//! flight. A redelivery or a parked copy is published `mandatory` with
//! publisher confirms before the original is acked: a crash in between leaves
//! two copies, and the record makes the second a replay; a copy no queue
//! takes is an error, and the original stays unacked. Counted failures travel
//! in the header `x-idem-failures`. A message the broker hands back because a
//! consumer's channel or connection ended before its verdict (`redelivered`)
//! counts as a failure too: the flag does not say how often that happened, so
//! the consumer that receives it republishes it to the tail of `q` with the
//! count raised and acks the returned copy, before any handler runs it.
//!
//! Per-message TTLs expire at the head of `q.retry` only, so a long delay ahead
//! of a short one stretches the short one: delays are lower bounds.
//!
//! ```no_run
//! use idem_runtime::consumer::Runner;
//! use idem_runtime::consumer::rabbitmq::RabbitMqSource;
//!
//! # #[derive(serde::Serialize, serde::Deserialize)] struct OrderPaid { order_id: String }
//! # async fn settle(e: OrderPaid) -> Result<(), std::io::Error> { Ok(()) }
//! # async fn go() -> Result<(), Box<dyn std::error::Error>> {
//! // RabbitMQ (feature `rabbitmq`)
//! let conn = idem_runtime::consumer::rabbitmq::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?;
//! let channel = conn.create_channel().await?;
//! RabbitMqSource::declare(&channel, "orders").await?;
//! let source = RabbitMqSource::builder("orders", "worker-1").prefetch(16).connect(channel).await?;
//! Runner::new().concurrency(16).run(source, settle).await;
//! # Ok(()) }
//! ```
//!
//! # Limits of RabbitMQ
//!
//! What the broker (AMQP 0-9-1, through lapin) answers at its edges, and what
//! idem makes of it: the contract the consumer and `outbox::sink::RabbitMqSink`
//! are held to. A row whose test says `none yet` is not checked against a real
//! broker.
//!
//! | limit or odd answer | what RabbitMQ does | what idem does | test |
//! |---|---|---|---|
//! | short strings (routing key, queue name, `message-id`, header name): at most 255 bytes | the length is one byte; lapin writes it unchecked (`len as u8`), so a longer one corrupts the frame and the broker closes the channel | `outbox::put` refuses a topic, id or header name over 255 bytes; the sink fails a row holding one alone | `tests/outbox/scenarios.rs::outside_a_call_a_message_needs_an_id_and_a_repeated_id_is_one_row`, `tests/outbox/sinks.rs::rabbitmq_a_routing_key_over_255_bytes_fails_alone` |
//! | the names `declare` derives (`q.retry` +6, `q.parked` +7, `q.dlx` +4 bytes) | the same 255-byte rule: a corrupt `queue.declare` is a connection error (`FRAME_ERROR`) | `declare` (and `RabbitMqBuilder::connect`) refuses a queue name over 248 bytes with an error naming it, before anything is sent; the connection goes on | `tests/consumer_rabbitmq.rs::declare_refuses_a_queue_whose_derived_names_pass_255_bytes` (248 and 249 bytes) |
//! | content header (properties and headers) must fit in one frame: `frame_max`, 131 072 bytes by default | a larger header frame is a connection error (`FRAME_ERROR`): every channel on the connection closes. RabbitMQ 3.10 lets the frame pass `frame_max` by up to 8 bytes (its overhead) | held to `frame_max` for the whole frame, encoded as lapin encodes it (`RabbitMqSink::frame_max`, `RabbitMqBuilder::frame_max`; RabbitMQ's default unless set, `RabbitMqSink::connect` reads the negotiated one): the sink fails such a message alone with the sizes; a parked copy's `x-idem-reason` (the handler's error text) is cut to fit, saying how long it was; any other copy that would not fit is an error before it is sent (the original stays unacked) | sink: `tests/outbox/sinks.rs::rabbitmq_a_content_header_over_frame_max_fails_alone` (at `frame_max`, 1 and 9 bytes over); consumer: `tests/consumer_rabbitmq.rs::a_parked_reason_is_cut_to_fit_frame_max` (at, 1 byte over, 140 KB) |
//! | body over `max_message_size` (128 MiB on 3.x, 16 MiB on 4.x) | the channel closes (`PRECONDITION_FAILED`) | the sink fails a payload over `RabbitMqSink::max_message_bytes` (default 128 MiB, 3.x's; set it to the broker's) alone. Copies the consumer publishes are as large as what the broker took | sink: `tests/outbox/sinks.rs::rabbitmq_a_payload_over_max_message_bytes_fails_alone` (the setting lowered to 1 KiB: 1 KiB and 1 byte over); the broker's own answer is not tested: its limit is a global setting of the shared broker, and reaching 128 MiB would push its memory toward the alarm that blocks every publisher |
//! | unroutable message published without `mandatory` | confirmed (`basic.ack`) and dropped | the sink publishes `mandatory` and fails a returned message, matched by `message-id`. The consumer's copies (to `q.retry`, to `q.dlx`, back to `q`) are `mandatory`, one at a time on the channel so a return is the copy's own: with `q.retry` or `q.parked` gone, the copy comes back, the runner gets a `BrokerError` naming the queue, and the original stays unacked (back in `q` when the channel ends) | sink: `tests/outbox/sinks.rs::rabbitmq_carries_the_id_and_an_unroutable_message_is_not_marked_sent`, `tests/outbox/sinks.rs::rabbitmq_returns_in_a_mixed_batch_are_matched_to_their_own_messages`; consumer: `tests/consumer_rabbitmq.rs::a_retry_copy_no_queue_takes_is_an_error_and_the_original_stays`, `tests/consumer_rabbitmq.rs::a_parked_copy_no_queue_takes_is_an_error_and_the_original_stays` (queue present, then deleted) |
//! | a message handed back after its consumer's channel or connection ended | a classic queue sets `redelivered` only, however often; a quorum queue counts `x-delivery-count` | counted as failures, republished to the tail of `q` with `x-idem-failures` raised, before any handler runs | `tests/consumer_rabbitmq.rs::dead_consumer_is_taken_over`, `tests/consumer_rabbitmq.rs::crash_and_panic_are_parked` |
//! | unacked deliveries: `basic.qos` prefetch, a `u16` (0 = unlimited) | hands out no more than the prefetch | `prefetch` is at least 1 (0 counts as 1), never unlimited; below the runner's concurrency it caps what runs, so a concurrency over 65 535 runs at most 65 535 | `tests/consumer_rabbitmq.rs::concurrency_keeps_n_in_flight` (at 8), `tests/consumer_rabbitmq.rs::prefetch_0_is_1_and_a_prefetch_below_concurrency_caps_it` (0; 2 under a concurrency of 4: the same cap as 65 535 under more, which the `u16` makes the only case) |
//! | a delivery unacked past `consumer_timeout` (30 min by default) | closes the channel; every unacked delivery on it comes back `redelivered` | a handler running that long costs the channel: the others in flight are counted a failure each and the runner returns the broker error | none yet: RabbitMQ 3.10 has the timeout only as a global setting (the `consumer-timeout` policy key is refused, "not recognised policy settings"; the `x-consumer-timeout` queue argument and policy key come in 3.12), and tests do not change the shared broker's global settings |
//! | connection lost between a publish and its confirm | the message may or may not be queued | the sink fails the batch and publishes it again (the consumer's record deduplicates by `message-id`); `RabbitMqSink::connect` reopens the connection | `tests/outbox/sinks.rs::the_rabbitmq_sink_reconnects_after_the_broker_closed_its_connection`, `tests/outbox/crash.rs::a_relay_killed_mid_batch_publishes_everything_at_least_once_and_each_applies_once` |

use lapin::options::{BasicGetOptions, BasicNackOptions};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde::Serialize;

use super::{BrokerError, Parked};
use confirm::publish_confirmed;
use headers::{DELIVERIES, QUEUE, REASON, header, text};

mod confirm;
mod delivery;
mod headers;
mod queues;
mod source;

pub use confirm::DEFAULT_FRAME_MAX;
// For the outbox's sink, which holds its messages to the same frame.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) use confirm::header_too_large;
pub use delivery::RabbitMqDelivery;
pub use source::{RabbitMqBuilder, RabbitMqSource};

fn broker(e: lapin::Error) -> BrokerError {
    BrokerError::new("rabbitmq", e)
}

/// Connects on the current tokio runtime (lapin would otherwise start an
/// executor and a reactor of its own).
pub async fn connect(url: &str) -> Result<Connection, BrokerError> {
    let props = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio);
    Connection::connect(url, props).await.map_err(broker)
}

/// Publishes `message` as persistent JSON to `queue` through the default
/// exchange, and waits for the broker's confirm when the channel is in
/// confirm mode.
pub async fn publish<M: Serialize + ?Sized>(
    channel: &Channel,
    queue: &str,
    message: &M,
) -> Result<(), BrokerError> {
    let body = serde_json::to_vec(message).map_err(|e| BrokerError::new("rabbitmq", e))?;
    publish_raw(channel, queue, &body, None).await
}

/// Publishes `payload` as it is to `queue`, with the properties [`publish`]
/// sets (persistent, `content-type: application/json`: the queue's contract,
/// which these bytes may break) and, given an id, the AMQP `message-id`, as
/// the outbox's relay sets it. Bytes that are not the handler's JSON are how
/// a test makes a poison message: the runner parks it as undecodable.
///
/// ```no_run
/// use idem_runtime::consumer::rabbitmq;
///
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let conn = rabbitmq::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?;
/// let channel = conn.create_channel().await?;
/// rabbitmq::publish_raw(&channel, "orders", b"{\"order_id\": 7", Some("m-1")).await?;
/// # Ok(()) }
/// ```
pub async fn publish_raw(
    channel: &Channel,
    queue: &str,
    payload: &[u8],
    message_id: Option<&str>,
) -> Result<(), BrokerError> {
    let mut props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into());
    if let Some(id) = message_id {
        props = props.with_message_id(id.into());
    }
    publish_confirmed(
        channel,
        "",
        queue,
        false,
        &format!("`{queue}`"),
        payload,
        props,
    )
    .await
    .map(drop)
}

/// Up to `count` messages of `parking_queue` (`<queue>.parked`), oldest
/// first, each with why it was parked.
///
/// A queue cannot be read without taking messages, so this peeks: it takes
/// them with `basic.get` unacked and hands each back (`basic.nack` with
/// `requeue`), in place. If the channel closes in between, the broker hands
/// them back itself: they stay parked either way. AMQP confirms no nack, so
/// for a moment after this returns (and while it runs) another channel may
/// count or see fewer. Remove one once handled by consuming it with an ack.
/// A queue that does not exist is a channel error in AMQP: it closes
/// `channel`.
///
/// ```no_run
/// use idem_runtime::consumer::rabbitmq;
///
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let conn = rabbitmq::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?;
/// let channel = conn.create_channel().await?;
/// for p in rabbitmq::parked(&channel, "orders.parked", 100).await? {
///     println!("{:?} after {:?} deliveries: {}", p.message_id, p.deliveries, p.reason);
/// }
/// # Ok(()) }
/// ```
pub async fn parked(
    channel: &Channel,
    parking_queue: &str,
    count: usize,
) -> Result<Vec<Parked>, BrokerError> {
    let mut taken = Vec::new();
    while taken.len() < count {
        let got = channel
            .basic_get(parking_queue, BasicGetOptions { no_ack: false })
            .await
            .map_err(broker)?;
        let Some(got) = got else { break };
        taken.push(got.delivery);
    }
    // Handed back only after all are taken: a message handed back at once
    // would be the next `basic.get`'s again.
    for d in &taken {
        d.nack(BasicNackOptions {
            requeue: true,
            multiple: false,
        })
        .await
        .map_err(broker)?;
    }
    Ok(taken
        .into_iter()
        .map(|d| {
            let props = &d.properties;
            Parked {
                reason: text(props, REASON).unwrap_or_default(),
                message_id: props.message_id().as_ref().map(|id| id.to_string()),
                origin: text(props, QUEUE),
                deliveries: header(props, DELIVERIES),
                parked_at: None,
                position: None,
                payload: d.data,
            }
        })
        .collect())
}
