//! NATS JetStream through async-nats (feature `jetstream`).
//!
//! - A durable pull consumer with explicit acks; several processes pulling
//!   from the same durable share its messages.
//! - Ack is `+ACK` waiting for the server's confirmation (`double_ack`), sent
//!   after the outcome is recorded.
//! - A counted failure is `-NAK` with the backoff as its delay.
//! - `InProgress`: JetStream counts every redelivery, a delayed `-NAK` too, so
//!   the runner keeps the message instead: it sends `+WPI` (work in progress,
//!   which restarts the ack wait) and runs it again after the delay.
//! - A parked message is published to the parking subject with headers
//!   `Idem-Reason`, `Idem-Deliveries` and `Idem-Stream`, and then `+TERM`ed.
//!   Capture that subject in a stream of its own so an operator can read it
//!   ([`parked`] does).
//! - A consumer that dies leaves its messages unacked: the server redelivers
//!   them after `ack_wait`, counting the delivery, pulled messages it had not
//!   started yet included. Keep `ack_wait` above the longest handler run.
//!   Older servers (2.9; fixed in the 2.10 series, nats-server#5305 and
//!   #5338) can, when a redelivery falls due just as a consumer disconnects,
//!   hand a message out again with its count gone back by one, so it can run
//!   once more than `max_deliveries`.
//!
//! Under [`Runner::concurrency`](super::Runner::concurrency) `n`, up to `n`
//! messages are in flight, each acked on its own; an `InProgress` one that
//! is kept holds its slot while it waits.
//!
//! The server's `max_deliver` is left unlimited: the runner parks at
//! `max_deliveries`, with the reason, where a server-side limit would drop the
//! message silently.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_runtime::consumer::Runner;
//! use idem_runtime::consumer::jetstream::JetStreamSource;
//!
//! # #[derive(serde::Serialize, serde::Deserialize)] struct OrderPaid { order_id: String }
//! # async fn settle(e: OrderPaid) -> Result<(), std::io::Error> { Ok(()) }
//! # async fn go() -> Result<(), Box<dyn std::error::Error>> {
//! // NATS JetStream (feature `jetstream`)
//! let js = async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
//! let source = JetStreamSource::builder("ORDERS", "settlement", "orders.parked")
//!     .ack_wait(Duration::from_secs(30))
//!     .connect(&js)
//!     .await?;
//! Runner::new().run(source, settle).await;
//! # Ok(()) }
//! ```
//!
//! # Limits of NATS JetStream
//!
//! What nats-server (and async-nats in front of it) answers at its edges, and
//! what idem makes of it: the contract the consumer and
//! `outbox::sink::JetStreamSink` are held to. A row whose test says `none yet`
//! is not checked against a real server.
//!
//! | limit or odd answer | what NATS does | what idem does | test |
//! |---|---|---|---|
//! | `max_payload` (1 MiB by default) counts the header block and the payload | `-ERR 'Maximum Payload Violation'` and the connection closes; async-nats checks the size only on a plain `publish`, not on a JetStream publish with headers | the sink counts the header block (`NATS/1.0`, a line per header, `Nats-Msg-Id`) with the payload and fails an over-limit message alone | `tests/outbox/sinks.rs::jetstream_a_payload_over_max_payload_fails_alone` (at the limit and one byte over) |
//! | a parked copy: the message's headers and payload plus `Idem-Reason`, `Idem-Deliveries`, `Idem-Stream` | the same `max_payload` rule | not checked: a message within a few hundred bytes of the limit cannot be parked; the connection closes, the message comes back after `ack_wait`, and `max_deliver` is unlimited | none yet |
//! | header values end at CR or LF | async-nats writes a value as given (`HeaderMap::insert` does not check); a reader fails on a line without `:` (`malformed header line`) | `outbox::put` refuses CR, LF and NUL in values; a parked copy's `Idem-Reason` is the handler's error text unchecked (a multi-line `Debug`, a panic message) | put: `tests/outbox/scenarios.rs::outside_a_call_a_message_needs_an_id_and_a_repeated_id_is_one_row`; park: none yet |
//! | server-interpreted headers (`Nats-Expected-Stream`, `Nats-Expected-Last-Sequence`, `Nats-Expected-Last-Subject-Sequence`, `Nats-Rollup`…) are stored and delivered with the message | applied to any publish carrying them | a parked copy carries the message's headers: one published with an expectation is checked again against the parking stream, and its park can fail every time | none yet |
//! | subject syntax: no whitespace, no empty token, `*` and `>` only in subscriptions | refuses the publish (whitespace breaks the protocol line) | the sink fails such a topic alone, before sending | unit only: `idem-runtime/src/outbox/sink/jetstream.rs::tests::subjects_the_server_refuses_are_named`; against a server: none yet |
//! | duplicate window (2 min unless the stream says otherwise) | a publish whose `Nats-Msg-Id` it saw inside the window is acked as a duplicate and not stored | a duplicate ack counts as confirmed; past the window the copy is stored and the consumer's record deduplicates | `tests/outbox/sinks.rs::jetstream_drops_a_republish_by_nats_msg_id` |
//! | publishes awaiting their ack: async-nats' `max_ack_inflight` (5 000) | a publish past it waits for a permit that only an awaited ack frees | the sink keeps at most `max_in_flight` (1 000) unawaited | `tests/outbox/sinks.rs::jetstream_a_batch_over_the_clients_in_flight_cap_is_published` |
//! | unacked past `ack_wait` | redelivers, counting the delivery (`-NAK` with a delay counts too); `+WPI` restarts the wait | `InProgress` is `+WPI` in slices, not a redelivery; `max_deliver` unlimited, parked at `max_deliveries` | `tests/consumer_jetstream.rs::dead_consumer_is_taken_over`, `tests/consumer_jetstream.rs::in_progress_is_not_a_failure`, `tests/consumer_jetstream.rs::poison_is_parked` |
//! | unacked per consumer: `max_ack_pending` (1 000 by default) | stops delivering to the durable at that many | not set (the server default applies): a runner concurrency above it never fills | none yet |

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::RawMessageErrorKind;
use async_nats::jetstream::{self, AckKind, Context};
use futures_util::StreamExt;
use serde::Serialize;

use super::{BrokerError, Delivery, Parked, Source};

fn broker(e: impl std::error::Error + Send + Sync + 'static) -> BrokerError {
    BrokerError::new("nats", e)
}

/// Publishes `message` as JSON to `subject` and waits for the stream's ack.
pub async fn publish<M: Serialize + ?Sized>(
    js: &Context,
    subject: &str,
    message: &M,
) -> Result<(), BrokerError> {
    let body = serde_json::to_vec(message).map_err(broker)?;
    publish_raw(js, subject, &body, None).await
}

/// Publishes `payload` as it is to `subject`, as [`publish`] publishes JSON
/// (and, given an id, with `Nats-Msg-Id`, as the outbox's relay does: the
/// stream then drops another publish of that id inside its duplicate
/// window), and waits for the stream's ack. Bytes that are not the handler's
/// JSON are how a test makes a poison message: the runner parks it as
/// undecodable.
///
/// ```no_run
/// use idem_runtime::consumer::jetstream;
///
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let js = async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
/// jetstream::publish_raw(&js, "orders.paid", b"{\"order_id\": 7", Some("m-1")).await?;
/// # Ok(()) }
/// ```
pub async fn publish_raw(
    js: &Context,
    subject: &str,
    payload: &[u8],
    message_id: Option<&str>,
) -> Result<(), BrokerError> {
    let mut message = PublishMessage::build().payload(payload.to_vec().into());
    if let Some(id) = message_id {
        message = message.message_id(id);
    }
    js.send_publish(subject.to_owned(), message)
        .await
        .map_err(broker)?
        .await
        .map_err(broker)?;
    Ok(())
}

/// Up to `count` messages of `parking_stream` (the stream capturing the
/// parking subject), oldest first, each with why it was parked.
///
/// Reading leaves them parked: each is fetched by sequence (`STREAM.MSG.GET`),
/// with no consumer, so this works on any retention, a work queue's too.
/// Remove one once handled with `Stream::delete_message(position)`.
///
/// ```no_run
/// use idem_runtime::consumer::jetstream;
///
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let js = async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
/// for p in jetstream::parked(&js, "ORDERS_PARKED", 100).await? {
///     println!("{:?} after {:?} deliveries: {}", p.message_id, p.deliveries, p.reason);
/// }
/// # Ok(()) }
/// ```
pub async fn parked(
    js: &Context,
    parking_stream: &str,
    count: usize,
) -> Result<Vec<Parked>, BrokerError> {
    let stream = js
        .get_stream_no_info(parking_stream)
        .await
        .map_err(broker)?;
    let mut out = Vec::new();
    let mut next = 1;
    while out.len() < count {
        // The first message at or after `next`, over deleted ones.
        let m = match stream.get_first_raw_message_by_subject(">", next).await {
            Ok(m) => m,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => break,
            Err(e) => return Err(broker(e)),
        };
        next = m.sequence + 1;
        let header = |name: &str| m.headers.get(name).map(|v| v.as_str().to_owned());
        out.push(Parked {
            reason: header(REASON).unwrap_or_default(),
            // By the constant: a name given as text never matches a standard
            // header that the server's reply was parsed into.
            message_id: m
                .headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str().to_owned()),
            origin: header(STREAM),
            deliveries: header(DELIVERIES).and_then(|n| n.parse().ok()),
            parked_at: Some(m.time.into()),
            position: Some(m.sequence.to_string()),
            payload: m.payload.to_vec(),
        });
    }
    Ok(out)
}

// What a parked copy carries besides the message's own headers.
const REASON: &str = "Idem-Reason";
const DELIVERIES: &str = "Idem-Deliveries";
const STREAM: &str = "Idem-Stream";

/// Settings of a [`JetStreamSource`] consumer.
pub struct JetStreamBuilder {
    stream: String,
    durable: String,
    parking: String,
    ack_wait: Duration,
    batch: usize,
}

impl JetStreamBuilder {
    /// How long the server waits for an ack before it redelivers (default
    /// 30 s): above the longest handler run.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// Messages pulled at once (default 10). Pulled messages wait in this
    /// process, and their ack wait runs meanwhile. About the runner's
    /// [`concurrency`](super::Runner::concurrency) when that is higher: the
    /// pull goes on as messages are handed out, so more than `batch` can be
    /// in flight, but each pull then fills fewer slots.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// Creates the durable pull consumer if it does not exist, and starts
    /// pulling.
    pub async fn connect(self, js: &Context) -> Result<JetStreamSource, BrokerError> {
        let stream = js.get_stream(&self.stream).await.map_err(broker)?;
        let consumer: async_nats::jetstream::consumer::Consumer<pull::Config> = stream
            .get_or_create_consumer(
                &self.durable,
                pull::Config {
                    durable_name: Some(self.durable.clone()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    max_deliver: -1,
                    ..pull::Config::default()
                },
            )
            .await
            .map_err(broker)?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.batch)
            .messages()
            .await
            .map_err(broker)?;
        Ok(JetStreamSource {
            js: js.clone(),
            shared: Arc::new(Shared {
                stream: self.stream,
                parking: self.parking,
                ack_wait: self.ack_wait,
            }),
            messages,
        })
    }
}

struct Shared {
    stream: String,
    parking: String,
    ack_wait: Duration,
}

/// One puller of a durable JetStream consumer: a [`Source`] for
/// [`super::Runner`].
pub struct JetStreamSource {
    js: Context,
    shared: Arc<Shared>,
    messages: pull::Stream,
}

impl JetStreamSource {
    /// Pulls from the durable consumer `durable` of `stream`, parking to
    /// `parking_subject`.
    pub fn builder(stream: &str, durable: &str, parking_subject: &str) -> JetStreamBuilder {
        JetStreamBuilder {
            stream: stream.to_owned(),
            durable: durable.to_owned(),
            parking: parking_subject.to_owned(),
            ack_wait: Duration::from_secs(30),
            batch: 10,
        }
    }
}

#[async_trait::async_trait]
impl Source for JetStreamSource {
    type Delivery = JetStreamDelivery;

    async fn next(&mut self) -> Result<JetStreamDelivery, BrokerError> {
        let message = match self.messages.next().await {
            Some(m) => m.map_err(broker)?,
            None => return Err(BrokerError::new("nats", "the pull subscription ended")),
        };
        let attempt = message
            .info()
            .map_err(|e| BrokerError::new("nats", e))?
            .delivered
            .clamp(1, i64::from(u32::MAX)) as u32;
        Ok(JetStreamDelivery {
            js: self.js.clone(),
            shared: self.shared.clone(),
            message,
            attempt,
        })
    }
}

/// One message handed to this puller.
pub struct JetStreamDelivery {
    js: Context,
    shared: Arc<Shared>,
    message: jetstream::Message,
    attempt: u32,
}

impl JetStreamDelivery {
    async fn send(&self, kind: AckKind) -> Result<(), BrokerError> {
        self.message
            .ack_with(kind)
            .await
            .map_err(|e| BrokerError::new("nats", e))
    }
}

#[async_trait::async_trait]
impl Delivery for JetStreamDelivery {
    fn payload(&self) -> Option<&[u8]> {
        Some(&self.message.payload)
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    /// `Nats-Msg-Id`: the id the server's duplicate window also drops
    /// re-publishes by.
    fn message_id(&self) -> Option<&str> {
        self.message
            .headers
            .as_ref()?
            .get(async_nats::header::NATS_MESSAGE_ID)
            .map(|v| v.as_str())
    }

    async fn ack(self) -> Result<(), BrokerError> {
        self.message
            .double_ack()
            .await
            .map_err(|e| BrokerError::new("nats", e))
    }

    async fn retry(self, after: Duration) -> Result<(), BrokerError> {
        self.send(AckKind::Nak(Some(after))).await
    }

    async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError> {
        // Restart the ack wait while waiting, in slices shorter than it.
        let slice = (self.shared.ack_wait / 2).max(Duration::from_millis(10));
        let mut left = after;
        while !left.is_zero() {
            self.send(AckKind::Progress).await?;
            let nap = left.min(slice);
            tokio::time::sleep(nap).await;
            left -= nap;
        }
        self.send(AckKind::Progress).await?;
        Ok(Some(self))
    }

    async fn park(self, reason: &str) -> Result<(), BrokerError> {
        let mut headers = self.message.headers.clone().unwrap_or_default();
        headers.insert(REASON, reason);
        headers.insert(DELIVERIES, self.attempt.to_string().as_str());
        headers.insert(STREAM, self.shared.stream.as_str());
        self.js
            .publish_with_headers(
                self.shared.parking.clone(),
                headers,
                self.message.payload.clone(),
            )
            .await
            .map_err(broker)?
            .await
            .map_err(broker)?;
        self.send(AckKind::Term).await
    }
}
