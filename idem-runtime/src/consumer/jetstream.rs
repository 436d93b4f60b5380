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
//!   ([`parked`] does); [`JetStreamBuilder::create_parking_stream`] creates
//!   one when it is missing. The copy keeps the message's own headers but those
//!   the server acts on (`Nats-…`, `Nats-Msg-Id` kept); the reason is on one
//!   line (`\`, CR, LF and other control characters as Rust escapes, which
//!   [`parked`] reverses) and cut, ending with `…`, where the whole would put
//!   the copy over the server's `max_payload`.
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
//!     .create_stream(["orders.paid"]) // when missing; an existing one is checked, never changed
//!     .create_parking_stream("ORDERS_PARKED")
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
//! | a parked copy: the message's headers and payload plus `Idem-Reason`, `Idem-Deliveries`, `Idem-Stream` | the same `max_payload` rule | the reason is cut to fit, ending with `…`; when even a copy with no reason would be over, the copy leaves the message's own headers out but its id; when that is over too (a payload a few dozen bytes from the limit), `park` fails naming `max_payload` and sends nothing: the connection stays, the message stays unacked and comes back after `ack_wait` (and `run` returns that error, as for any failed park) | `tests/consumer_jetstream.rs::a_parked_copy_is_cut_to_max_payload` (a copy at the limit, one byte over, an original at the limit) |
//! | header values end at CR or LF | async-nats writes a value as given (`HeaderMap::insert` does not check); a reader fails on a line without `:` (`malformed header line`) | `outbox::put` refuses CR, LF and NUL in values; the consumer writes its values (`Idem-Reason`, a multi-line `Debug` or panic message included, and `Idem-Stream`) on one line, `\`, CR, LF, tab and other control characters as Rust escapes, and [`parked`] reads them back as they were | put: `tests/outbox/scenarios.rs::outside_a_call_a_message_needs_an_id_and_a_repeated_id_is_one_row`; park: `tests/consumer_jetstream.rs::a_multi_line_reason_is_read_back_as_written` |
//! | server-interpreted headers (`Nats-Expected-Stream`, `Nats-Expected-Last-Sequence`, `Nats-Expected-Last-Subject-Sequence`, `Nats-Rollup`…) are stored and delivered with the message; `Nats-` is the server's namespace, and releases add to it (`Nats-TTL` 2.11; `Nats-Incr`, `Nats-Batch-*`, `Nats-Schedule` 2.12) | applied to any publish carrying them (`expected stream does not match`, `rollup not permitted`) | a parked copy drops every `Nats-*` header but `Nats-Msg-Id`, which `parked` reads back and which stores a park sent twice (its ack lost) once; so a second park of one id inside the parking stream's duplicate window (2 min) is acked as a duplicate, and the first copy stands | `tests/consumer_jetstream.rs::a_parked_copy_drops_the_headers_the_server_acts_on` (plain, `Nats-Expected-Stream`, `Nats-Rollup`) |
//! | subject syntax: no whitespace, no empty token, `*` and `>` only in subscriptions | refuses the publish (whitespace breaks the protocol line) | the sink fails such a topic alone, with the reason, before sending: the connection and the rest of the batch go on (sent, a space would split the protocol line and cost the connection, and the whole batch) | `idem-runtime/src/outbox/sink/jetstream.rs::tests::subjects_the_server_refuses_are_named`; `tests/outbox/sinks.rs::jetstream_subjects_the_server_refuses_fail_alone` |
//! | duplicate window (2 min unless the stream says otherwise) | a publish whose `Nats-Msg-Id` it saw inside the window is acked as a duplicate and not stored | a duplicate ack counts as confirmed; past the window the copy is stored and the consumer's record deduplicates | `tests/outbox/sinks.rs::jetstream_drops_a_republish_by_nats_msg_id` |
//! | publishes awaiting their ack: async-nats' `max_ack_inflight` (5 000) | a publish past it waits for a permit that only an awaited ack frees | the sink keeps at most `max_in_flight` (1 000) unawaited | `tests/outbox/sinks.rs::jetstream_a_batch_over_the_clients_in_flight_cap_is_published` |
//! | unacked past `ack_wait` | redelivers, counting the delivery (`-NAK` with a delay counts too); `+WPI` restarts the wait | `InProgress` is `+WPI` in slices, not a redelivery; `max_deliver` unlimited, parked at `max_deliveries` | `tests/consumer_jetstream.rs::dead_consumer_is_taken_over`, `tests/consumer_jetstream.rs::in_progress_is_not_a_failure`, `tests/consumer_jetstream.rs::poison_is_parked` |
//! | streams: one per name, and a subject in one stream only | creating a stream on a subject another captures fails (`subjects overlap with an existing stream`, 10065); creating one whose name is taken with another configuration fails (10058) | only on request (`JetStreamBuilder::create_stream`, `create_parking_stream`, `JetStreamSink::create_stream`): a missing stream is created with the server's defaults; an existing one is used as it is when its subjects capture those asked for (a wider `orders.>` captures `orders.paid`), and otherwise the call fails naming the stream, its subjects and the missing ones, and changes nothing; so does a stream that captures its own parking subject, and another stream already on the subjects is named | `tests/consumer_jetstream.rs::streams_are_created_on_request_and_never_changed`, `tests/outbox/sinks.rs::jetstream_sink_creates_its_stream_on_request` |
//! | unacked per consumer: `max_ack_pending` (1 000 by default) | stops delivering to the durable, all its pullers together, at that many | not set: a durable `connect` creates gets the server's default, an existing one keeps its own; a runner's concurrency above it never fills. `connect` logs a warning when it is below the batch; set it on the durable at or above concurrency × processes | `tests/consumer_jetstream.rs::the_durables_max_ack_pending_caps_concurrency` (4 under `concurrency(8)`: 4 at once; 8: 8) |

use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind, Context};
use futures_util::StreamExt;
use serde::Serialize;

use super::{BrokerError, Delivery, Source};

mod escape;
mod parking;
pub(crate) mod streams;

pub use parking::parked;

use escape::escaped;

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

// What a parked copy carries besides the message's own headers.
const REASON: &str = "Idem-Reason";
const DELIVERIES: &str = "Idem-Deliveries";
const STREAM: &str = "Idem-Stream";
const ESCAPED: &str = "Idem-Escaped";

/// Settings of a [`JetStreamSource`] consumer.
pub struct JetStreamBuilder {
    stream: String,
    durable: String,
    parking: String,
    ack_wait: Duration,
    batch: usize,
    /// The subjects to create the stream on, if asked.
    create_stream: Option<Vec<String>>,
    /// The name of the parking stream to create, if asked.
    parking_stream: Option<String>,
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
    /// in flight, but each pull then fills fewer slots. Either way the
    /// durable's `max_ack_pending` caps the messages in flight, across all
    /// its pullers.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// Has [`connect`](Self::connect) create the stream, capturing
    /// `subjects`, when it does not exist (with the server's defaults: file
    /// storage, limits retention, a 2 minute duplicate window). An existing
    /// stream is used as it is when its subjects capture these; otherwise,
    /// or when the stream captures the parking subject (parked copies would
    /// come back as messages), `connect` fails saying so and changes nothing.
    ///
    /// On a stream wider than asked (`orders.>` for `orders.paid`) the
    /// durable reads only what was asked: a new durable is made with that
    /// subject as its filter (one subject: several need nats-server 2.10),
    /// and a durable that would read beyond it (an existing one without that
    /// filter, or several subjects asked on a wider stream) fails `connect`,
    /// so another event on the stream never reaches the handler.
    ///
    /// ```no_run
    /// use idem_runtime::consumer::jetstream::JetStreamSource;
    ///
    /// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
    /// let js = async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
    /// let source = JetStreamSource::builder("ORDERS", "settlement", "parked.orders")
    ///     .create_stream(["orders.>"])
    ///     .create_parking_stream("ORDERS_PARKED")
    ///     .connect(&js)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn create_stream<S: Into<String>>(mut self, subjects: impl IntoIterator<Item = S>) -> Self {
        self.create_stream = Some(subjects.into_iter().map(Into::into).collect());
        self
    }

    /// Has [`connect`](Self::connect) create the stream `name` capturing the
    /// parking subject when it does not exist, so that a park has somewhere
    /// to go ([`parked`] reads it by this name). An existing stream is used
    /// as it is when it captures the parking subject; otherwise `connect`
    /// fails saying so and changes nothing.
    ///
    /// ```no_run
    /// use idem_runtime::consumer::jetstream::{self, JetStreamSource};
    ///
    /// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
    /// let js = async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
    /// let source = JetStreamSource::builder("ORDERS", "settlement", "parked.orders")
    ///     .create_parking_stream("ORDERS_PARKED")
    ///     .connect(&js)
    ///     .await?;
    /// let parked = jetstream::parked(&js, "ORDERS_PARKED", 10).await?;
    /// # Ok(()) }
    /// ```
    pub fn create_parking_stream(mut self, name: &str) -> Self {
        self.parking_stream = Some(name.to_owned());
        self
    }

    /// Creates the streams asked for ([`create_stream`](Self::create_stream),
    /// [`create_parking_stream`](Self::create_parking_stream)) and the
    /// durable pull consumer if they do not exist, and starts pulling.
    /// Without those options, the streams must exist. An existing durable
    /// keeps its settings; a new one gets the server's `max_ack_pending`
    /// (1 000 by default). Below the batch, that is logged as a warning: no
    /// more messages than it are in flight at once.
    pub async fn connect(self, js: &Context) -> Result<JetStreamSource, BrokerError> {
        if let Some(subjects) = &self.create_stream {
            streams::ensure(js, &self.stream, subjects, Some(&self.parking)).await?;
        }
        if let Some(name) = &self.parking_stream {
            streams::ensure(js, name, std::slice::from_ref(&self.parking), None).await?;
        }
        let stream = js.get_stream(&self.stream).await.map_err(broker)?;
        if let Some(asked) = self.create_stream.as_ref().filter(|a| a.len() > 1) {
            // Several subjects get no filter (nats-server 2.9): a new durable
            // would read the whole stream. Refused before one is made.
            let stream_subjects = &stream.cached_info().config.subjects;
            streams::reads_only(asked, "", stream_subjects, &self.durable, &self.stream)?;
        }
        let consumer: async_nats::jetstream::consumer::Consumer<pull::Config> = stream
            .get_or_create_consumer(
                &self.durable,
                pull::Config {
                    durable_name: Some(self.durable.clone()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    max_deliver: -1,
                    // On a wider stream than asked, only what was asked
                    // (`streams::reads_only` says why, and checks).
                    filter_subject: match self.create_stream.as_deref() {
                        Some([one]) => one.clone(),
                        _ => String::new(),
                    },
                    ..pull::Config::default()
                },
            )
            .await
            .map_err(broker)?;
        if let Some(asked) = &self.create_stream {
            let filter = &consumer.cached_info().config.filter_subject;
            let stream_subjects = &stream.cached_info().config.subjects;
            streams::reads_only(asked, filter, stream_subjects, &self.durable, &self.stream)?;
        }
        // An existing durable keeps its own settings, and the server hands
        // none of its consumers more than `max_ack_pending` unacked messages
        // in all: nothing else would tell why a runner's slots stay empty.
        let max_ack_pending = consumer.cached_info().config.max_ack_pending;
        if usize::try_from(max_ack_pending).is_ok_and(|cap| cap < self.batch) {
            tracing::warn!(
                stream = %self.stream,
                durable = %self.durable,
                max_ack_pending,
                batch = self.batch,
                "the durable's max_ack_pending is below the batch: at most that many \
                 messages are in flight at once, whatever the runner's concurrency"
            );
        }
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
            create_stream: None,
            parking_stream: None,
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
        let headers = parked_headers(
            self.message.headers.as_ref(),
            reason,
            self.attempt,
            &self.shared.stream,
            self.message.payload.len(),
            self.js.client().server_info().max_payload,
        )?;
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

/// The headers of a message's parked copy: its own, less those the server
/// acts on, plus why, how often and from where it was parked, with the
/// reason cut so that the copy fits in `max_payload` (0: not known yet).
///
/// A copy that would not fit even without a reason leaves the message's own
/// headers out (but its id) rather than fail: a park that fails leaves the
/// message unacked, and it would stop its consumer at every delivery.
fn parked_headers(
    original: Option<&HeaderMap>,
    reason: &str,
    deliveries: u32,
    stream: &str,
    payload: usize,
    max_payload: usize,
) -> Result<HeaderMap, BrokerError> {
    let copy = |only_the_id| {
        copy_headers(
            original,
            only_the_id,
            reason,
            deliveries,
            stream,
            payload,
            max_payload,
        )
    };
    match copy(false) {
        Err(_) if original.is_some() => copy(true),
        done => done,
    }
}

fn copy_headers(
    original: Option<&HeaderMap>,
    only_the_id: bool,
    reason: &str,
    deliveries: u32,
    stream: &str,
    payload: usize,
    max_payload: usize,
) -> Result<HeaderMap, BrokerError> {
    let mut headers = HeaderMap::new();
    for (name, values) in original.into_iter().flat_map(HeaderMap::iter) {
        if only_the_id && AsRef::<str>::as_ref(name) != "Nats-Msg-Id" {
            continue;
        }
        // The server acts on headers named `Nats-…` (`Nats-Expected-Stream`,
        // `Nats-Rollup`, `Nats-TTL`, and more in each release), and the
        // parking stream is not the stream they were meant for: refused
        // there, the park would fail at every delivery. All go but the id,
        // which only deduplicates a park sent twice.
        let name_text: &str = name.as_ref();
        if name_text
            .get(..5)
            .is_some_and(|prefix| prefix.eq_ignore_ascii_case("nats-"))
            && name_text != "Nats-Msg-Id"
        {
            continue;
        }
        for value in values {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.insert(DELIVERIES, deliveries.to_string());
    headers.insert(STREAM, escaped(stream, usize::MAX));
    // Says the values are escaped: copies parked before escaping began are
    // read back as they were written.
    headers.insert(ESCAPED, "1");
    headers.insert(REASON, "");
    // What the server counts against `max_payload`: the header block
    // (`NATS/1.0\r\n`, a `name: value\r\n` line per value, a blank line) and
    // the payload.
    let without_reason = "NATS/1.0\r\n".len()
        + headers
            .iter()
            .flat_map(|(name, values)| {
                let name: &str = name.as_ref();
                values
                    .iter()
                    .map(move |v| name.len() + 2 + v.as_str().len() + 2)
            })
            .sum::<usize>()
        + 2
        + payload;
    let room = if max_payload == 0 {
        usize::MAX
    } else if without_reason > max_payload {
        return Err(BrokerError::new(
            "nats",
            format!(
                "the parked copy would be {without_reason} bytes with its headers and no \
                 reason, over the server's max_payload of {max_payload}: not parked, and \
                 left unacked"
            ),
        ));
    } else {
        max_payload - without_reason
    };
    headers.insert(REASON, escaped(reason, room));
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parked_copy_keeps_the_id_and_drops_what_the_server_acts_on() {
        let mut original = HeaderMap::new();
        original.insert(async_nats::header::NATS_MESSAGE_ID, "m-1");
        original.insert("Nats-Expected-Stream", "ORDERS");
        original.insert("nats-rollup", "sub");
        original.insert("Nats-TTL", "1s");
        original.append("Tenant", "a");
        original.append("Tenant", "b");
        let copy = parked_headers(Some(&original), "why", 3, "ORDERS", 10, 0).unwrap();
        let mut names: Vec<&str> = copy.iter().map(|(n, _)| n.as_ref()).collect();
        names.sort();
        assert_eq!(
            names,
            [
                "Idem-Deliveries",
                "Idem-Escaped",
                "Idem-Reason",
                "Idem-Stream",
                "Nats-Msg-Id",
                "Tenant"
            ]
        );
        assert_eq!(copy.get_all("Tenant").count(), 2);
        assert_eq!(copy.get(REASON).map(|v| v.as_str()), Some("why"));
    }
}
