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

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde::Serialize;

use super::{BrokerError, Delivery, Parked, Source};

const FAILURES: &str = "x-idem-failures";
// What a parked copy carries besides the message's own headers.
const REASON: &str = "x-idem-reason";
const DELIVERIES: &str = "x-idem-deliveries";
const QUEUE: &str = "x-idem-queue";

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

/// Publishes and waits for the broker's confirm; a nack is an error naming
/// `to`. A `mandatory` publish that no queue took comes back: the returned
/// message is in the confirmation.
async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
    to: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<lapin::publisher_confirm::Confirmation, BrokerError> {
    let confirm = channel
        .basic_publish(
            exchange,
            routing_key,
            BasicPublishOptions {
                mandatory,
                ..BasicPublishOptions::default()
            },
            body,
            props,
        )
        .await
        .map_err(broker)?
        .await
        .map_err(broker)?;
    if confirm.is_nack() {
        return Err(BrokerError::new(
            "rabbitmq",
            format!("the broker refused a message for {to}"),
        ));
    }
    Ok(confirm)
}

/// RabbitMQ's default `frame_max`, what the consumer and the sink assume
/// unless told the connection's ([`RabbitMqBuilder::frame_max`],
/// `RabbitMqSink::frame_max`): lapin negotiates it on the connection and
/// does not show it on a channel.
pub const DEFAULT_FRAME_MAX: u32 = 131_072;

/// What a frame carries besides its payload: type, channel, size and the
/// end octet.
const FRAME_OVERHEAD: usize = 8;

/// The bytes of the content header frame that carries `props`: the frame's
/// overhead, class, weight and body size, then the properties as lapin
/// encodes them.
pub(crate) fn header_frame_bytes(props: &BasicProperties) -> usize {
    let encoded = lapin::protocol::basic::gen_properties::<Vec<u8>>(props)(Vec::new().into());
    // Encoding into a `Vec` does not fail; if it ever did, the header counts
    // as too large rather than being sent.
    encoded.map_or(usize::MAX, |ctx| {
        FRAME_OVERHEAD + 12 + usize::try_from(ctx.position).unwrap_or(usize::MAX)
    })
}

/// Why a message with `props` cannot be published on a connection whose
/// `frame_max` is `frame_max`: AMQP sends the content header as one frame,
/// and a larger one is a connection error that takes every channel with it.
/// (RabbitMQ lets a frame pass `frame_max` by up to its 8 bytes of overhead;
/// this holds to the protocol's bound.)
pub(crate) fn header_too_large(props: &BasicProperties, frame_max: u32) -> Option<String> {
    let bytes = header_frame_bytes(props);
    (bytes > frame_max as usize).then(|| {
        format!(
            "its content header (properties and headers) is a {bytes}-byte frame, over the \
             connection's frame_max ({frame_max}): AMQP sends it in one frame"
        )
    })
}

/// `reason` as it fits in `room` bytes: cut at a character boundary, with
/// how long it was.
fn cut(reason: &str, room: usize) -> String {
    if reason.len() <= room {
        return reason.to_owned();
    }
    let note = format!("… (cut to fit the frame: {} bytes in all)", reason.len());
    // With no room for the note, as much of the reason as fits.
    let (mut keep, note) = match room.checked_sub(note.len()) {
        Some(keep) => (keep, note),
        None => (room, String::new()),
    };
    while !reason.is_char_boundary(keep) {
        keep -= 1;
    }
    format!("{}{note}", &reason[..keep])
}

/// The longest AMQP short string, which a queue's and an exchange's name is.
const SHORT_STRING_BYTES: usize = 255;

struct Names {
    queue: String,
    retry: String,
    parked: String,
    dlx: String,
}

impl Names {
    /// The names `declare` derives from `queue`; an error naming it when the
    /// longest (`.parked`) would not be a short string: lapin would write it
    /// with a wrong length, and the broker close the connection on the
    /// corrupt frame.
    fn of(queue: &str) -> Result<Names, BrokerError> {
        let parked = format!("{queue}.parked");
        if parked.len() > SHORT_STRING_BYTES {
            return Err(BrokerError::new(
                "rabbitmq",
                format!(
                    "the queue name `{queue}` is {} bytes: `<queue>.parked` would be {}, over \
                     AMQP's {SHORT_STRING_BYTES} (a queue name may have at most {})",
                    queue.len(),
                    parked.len(),
                    SHORT_STRING_BYTES - ".parked".len()
                ),
            ));
        }
        Ok(Names {
            queue: queue.to_owned(),
            retry: format!("{queue}.retry"),
            parked,
            dlx: format!("{queue}.dlx"),
        })
    }
}

/// What a consumer's copies (a redelivery, a parked copy, a returned message
/// counted) need besides the channel.
struct Copies {
    names: Names,
    frame_max: u32,
    /// Held from a copy's publish to its confirm. Copies are `mandatory`, and
    /// lapin hands a returned message to whichever confirm completes next
    /// (one `multiple` ack completes several): with one copy in flight on the
    /// channel, a return is that copy's. Copies are the exception path, so
    /// the round trips in a row cost little.
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl Copies {
    /// Publishes a copy `mandatory` with a confirm: a copy no queue takes
    /// (`to`, a queue deleted since `declare`) comes back and is an error, so
    /// the caller does not ack the original. A copy whose header would not
    /// fit in a frame is an error before anything is sent.
    async fn publish(
        &self,
        channel: &Channel,
        exchange: &str,
        routing_key: &str,
        to: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), BrokerError> {
        if let Some(why) = header_too_large(&props, self.frame_max) {
            return Err(BrokerError::new(
                "rabbitmq",
                format!("a copy for {to} was not published: {why}"),
            ));
        }
        let _one = self.one_at_a_time.lock().await;
        let confirm =
            publish_confirmed(channel, exchange, routing_key, true, to, body, props).await?;
        if confirm.take_message().is_some() {
            return Err(BrokerError::new(
                "rabbitmq",
                format!("no queue took the copy for {to}: it came back (was the queue deleted?)"),
            ));
        }
        Ok(())
    }
}

/// A consumer on a queue: a [`Source`] for [`super::Runner`].
pub struct RabbitMqSource {
    channel: Channel,
    copies: Arc<Copies>,
    consumer: lapin::Consumer,
}

impl RabbitMqSource {
    /// Declares `queue`, `queue.retry`, the exchange `queue.dlx` and
    /// `queue.parked` (see the module documentation). Idempotent; the queues
    /// are durable. A name over 248 bytes is an error before anything is
    /// sent: `queue.parked` would pass AMQP's 255.
    pub async fn declare(channel: &Channel, queue: &str) -> Result<(), BrokerError> {
        let n = Names::of(queue)?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .exchange_declare(
                &n.dlx,
                ExchangeKind::Fanout,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(broker)?;
        let parked = &n.parked;
        channel
            .queue_declare(parked, durable, FieldTable::default())
            .await
            .map_err(broker)?;
        channel
            .queue_bind(
                parked,
                &n.dlx,
                "",
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker)?;
        let mut main = FieldTable::default();
        main.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(n.dlx.as_str().into()),
        );
        channel
            .queue_declare(&n.queue, durable, main)
            .await
            .map_err(broker)?;
        let mut retry = FieldTable::default();
        retry.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        retry.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(n.queue.as_str().into()),
        );
        channel
            .queue_declare(&n.retry, durable, retry)
            .await
            .map_err(broker)?;
        Ok(())
    }

    /// Settings for a consumer named `tag` on `queue` (declared with
    /// [`RabbitMqSource::declare`]).
    pub fn builder(queue: &str, tag: &str) -> RabbitMqBuilder {
        RabbitMqBuilder {
            queue: queue.to_owned(),
            tag: tag.to_owned(),
            prefetch: 1,
            frame_max: DEFAULT_FRAME_MAX,
        }
    }
}

/// Settings of a [`RabbitMqSource`] consumer.
#[derive(Debug, Clone)]
pub struct RabbitMqBuilder {
    queue: String,
    tag: String,
    prefetch: u16,
    frame_max: u32,
}

impl RabbitMqBuilder {
    /// At most this many unacked messages on the consumer (default 1). Set
    /// it to at least the runner's [`concurrency`](super::Runner::concurrency):
    /// the broker hands out no more than this, so a lower prefetch caps the
    /// deliveries in flight. A little above it keeps the next messages on
    /// their way while the slots are busy; every prefetched message is one
    /// another consumer of the queue cannot take. 0 counts as 1 (AMQP's 0
    /// would be unlimited); the type caps it at 65 535, so a runner's
    /// concurrency above that runs at most 65 535 deliveries at once.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n;
        self
    }

    /// The `frame_max` the channel's connection negotiated,
    /// `Connection::configuration().frame_max()` (default
    /// [`DEFAULT_FRAME_MAX`], RabbitMQ's). A parked copy's reason is cut so
    /// that its content header fits in one frame of this size, and a copy
    /// that still would not fit is an error instead of a frame that closes
    /// the connection.
    pub fn frame_max(mut self, bytes: u32) -> Self {
        self.frame_max = bytes;
        self
    }

    /// Starts consuming with manual acks. Puts the channel in confirm mode
    /// for the copies it publishes, which are its only publishes: the channel
    /// is the consumer's own.
    pub async fn connect(self, channel: Channel) -> Result<RabbitMqSource, BrokerError> {
        let RabbitMqBuilder {
            queue,
            tag,
            prefetch,
            frame_max,
        } = self;
        let (queue, tag) = (queue.as_str(), tag.as_str());
        let names = Names::of(queue)?;
        channel
            .basic_qos(prefetch.max(1), BasicQosOptions::default())
            .await
            .map_err(broker)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker)?;
        let consumer = channel
            .basic_consume(
                queue,
                tag,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker)?;
        Ok(RabbitMqSource {
            channel,
            copies: Arc::new(Copies {
                names,
                frame_max,
                one_at_a_time: tokio::sync::Mutex::new(()),
            }),
            consumer,
        })
    }
}

fn int(v: &AMQPValue) -> Option<u32> {
    let n: i64 = match v {
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    };
    u32::try_from(n).ok()
}

fn header(props: &BasicProperties, name: &str) -> Option<u32> {
    field(props, name).and_then(int)
}

fn text(props: &BasicProperties, name: &str) -> Option<String> {
    match field(props, name)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

fn field<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props
        .headers()
        .as_ref()?
        .inner()
        .get(&ShortString::from(name))
}

#[async_trait::async_trait]
impl Source for RabbitMqSource {
    type Delivery = RabbitMqDelivery;

    async fn next(&mut self) -> Result<RabbitMqDelivery, BrokerError> {
        loop {
            let delivery = match self.consumer.next().await {
                Some(d) => d.map_err(broker)?,
                None => {
                    return Err(BrokerError::new(
                        "rabbitmq",
                        "the consumer was cancelled or its channel closed",
                    ));
                }
            };
            let failures = header(&delivery.properties, FAILURES).unwrap_or(0);
            let delivery = RabbitMqDelivery {
                channel: self.channel.clone(),
                copies: self.copies.clone(),
                attempt: failures + 1,
                delivery,
            };
            if !delivery.delivery.redelivered {
                return Ok(delivery);
            }
            // Handed back by the broker: a consumer holding it ended without
            // a verdict. A classic queue only flags that, and the flag stays
            // the same however often it happens, so a message that kills every
            // consumer would never reach `max_deliveries`: the count goes into
            // the header of a fresh copy instead, at the tail of the queue. (A
            // quorum queue counts the returns of this copy itself.)
            let returned = header(&delivery.delivery.properties, "x-delivery-count")
                .unwrap_or(1)
                .max(1);
            let props = delivery.copy_props(&[(
                FAILURES,
                AMQPValue::LongLongInt((failures + returned).into()),
            )]);
            let names = &self.copies.names;
            self.copies
                .publish(
                    &self.channel,
                    "",
                    &names.queue,
                    &format!("`{}`", names.queue),
                    &delivery.delivery.data,
                    props,
                )
                .await?;
            delivery.ack().await?;
        }
    }
}

/// One message handed to this consumer.
pub struct RabbitMqDelivery {
    channel: Channel,
    copies: Arc<Copies>,
    attempt: u32,
    delivery: lapin::message::Delivery,
}

impl RabbitMqDelivery {
    /// The message's headers with ours set, for a copy.
    fn copy_props(&self, set: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut headers = self
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        for (k, v) in set {
            headers.insert((*k).into(), v.clone());
        }
        self.delivery
            .properties
            .clone()
            .with_delivery_mode(2)
            .with_headers(headers)
    }

    /// Publishes a copy to `q.retry`, due back in `after`, carrying `failures`.
    async fn redeliver(self, after: Duration, failures: u32) -> Result<(), BrokerError> {
        // A zero TTL would expire at once: still a delay of at least 1 ms.
        let ttl = after.as_millis().max(1).to_string();
        let props = self
            .copy_props(&[(FAILURES, AMQPValue::LongLongInt(failures.into()))])
            .with_expiration(ttl.as_str().into());
        let retry = &self.copies.names.retry;
        self.copies
            .publish(
                &self.channel,
                "",
                retry,
                &format!("`{retry}`"),
                &self.delivery.data,
                props,
            )
            .await?;
        self.ack().await
    }
}

#[async_trait::async_trait]
impl Delivery for RabbitMqDelivery {
    fn payload(&self) -> Option<&[u8]> {
        Some(&self.delivery.data)
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The AMQP `message-id` property.
    fn message_id(&self) -> Option<&str> {
        self.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str())
    }

    async fn ack(self) -> Result<(), BrokerError> {
        self.delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(broker)?;
        Ok(())
    }

    async fn retry(self, after: Duration) -> Result<(), BrokerError> {
        let failures = self.attempt;
        self.redeliver(after, failures).await
    }

    async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError> {
        let failures = self.attempt.saturating_sub(1);
        self.redeliver(after, failures).await.map(|()| None)
    }

    /// The reason (often a handler's error text) is cut to what fits the
    /// copy's content header in one frame: the message is parked with the
    /// start of it rather than the connection closed on it.
    async fn park(self, reason: &str) -> Result<(), BrokerError> {
        let names = &self.copies.names;
        let with = |reason: &str| {
            self.copy_props(&[
                (REASON, AMQPValue::LongString(reason.into())),
                (DELIVERIES, AMQPValue::LongLongInt(self.attempt.into())),
                (QUEUE, AMQPValue::LongString(names.queue.as_str().into())),
            ])
        };
        // The reason's bytes add to the header one for one.
        let room = (self.copies.frame_max as usize).saturating_sub(header_frame_bytes(&with("")));
        let props = with(&cut(reason, room));
        self.copies
            .publish(
                &self.channel,
                &names.dlx,
                "",
                &format!("`{}` (bound to `{}`)", names.dlx, names.parked),
                &self.delivery.data,
                props,
            )
            .await?;
        self.ack().await
    }
}
