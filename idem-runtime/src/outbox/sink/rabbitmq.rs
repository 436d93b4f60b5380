//! Publishing to RabbitMQ with publisher confirms: every message sent, then
//! every confirm awaited.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use std::collections::HashSet;
use std::sync::Arc;

use lapin::{BasicProperties, Channel};
use tokio::sync::Mutex;

use super::{Outgoing, Sink};
use crate::consumer::BrokerError;
use crate::consumer::rabbitmq::{DEFAULT_FRAME_MAX, header_too_large};

/// Publishes each message persistent and `mandatory` (a message no queue
/// takes comes back, and counts as a failure) with its id as the AMQP
/// `message-id`, its headers as AMQP headers; confirmed by the broker's
/// publisher confirm.
///
/// A message the broker would not take as it is fails alone, before it is
/// sent, instead of closing the channel or the connection on the batch: a
/// name over 255 bytes, a content header (id and headers) over the
/// connection's `frame_max` ([`RabbitMqSink::frame_max`]), a payload over
/// the broker's `max_message_size` ([`RabbitMqSink::max_message_bytes`]).
///
/// ```no_run
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let sink = idem_runtime::outbox::sink::RabbitMqSink::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RabbitMqSink {
    channel: Arc<Mutex<Channel>>,
    /// Where to connect again after the connection closed (`connect` only).
    url: Option<Arc<str>>,
    exchange: String,
    frame_max: u32,
    max_message_bytes: usize,
}

/// RabbitMQ 3.x's default `max_message_size`, 128 MiB (4.x's is 16 MiB).
const DEFAULT_MAX_MESSAGE_BYTES: usize = 128 << 20;

fn broker(e: lapin::Error) -> BrokerError {
    BrokerError::new("rabbitmq", e)
}

/// The longest AMQP short string (a routing key, a `message-id`, a header's
/// name), the limit `put` holds names to. A longer one breaks the frame, and
/// the broker closes the channel with every message of the batch on it.
const SHORT_STRING_BYTES: usize = crate::outbox::MAX_NAME_BYTES;

/// Why `m` cannot go into an AMQP frame, so it fails alone. `put` refuses
/// these; a row written before it did may still hold one.
fn too_long_a_name(m: &Outgoing) -> Option<BrokerError> {
    let long = [
        ("routing key", m.topic.as_str()),
        ("message-id", m.id.as_str()),
    ]
    .into_iter()
    .chain(m.headers.keys().map(|name| ("header name", name.as_str())))
    .find(|(_, s)| s.len() > SHORT_STRING_BYTES)?;
    Some(BrokerError::new(
        "rabbitmq",
        format!(
            "the {} `{}` is {} bytes, over AMQP's {SHORT_STRING_BYTES}",
            long.0,
            long.1,
            long.1.len()
        ),
    ))
}

async fn confirming(channel: &Channel) -> Result<(), BrokerError> {
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker)
}

/// A confirming channel on a new connection to `url`, and the connection's
/// negotiated `frame_max`.
async fn open(url: &str) -> Result<(Channel, u32), BrokerError> {
    let conn = crate::consumer::rabbitmq::connect(url).await?;
    let channel = conn.create_channel().await.map_err(broker)?;
    confirming(&channel).await?;
    Ok((channel, conn.configuration().frame_max()))
}

impl RabbitMqSink {
    /// On a channel of its own (put in confirm mode here), publishing to the
    /// default exchange: the topic is the queue's name.
    /// A closed channel stays closed: use [`RabbitMqSink::connect`] for a
    /// sink that reconnects.
    /// A connection that negotiated a `frame_max` other than RabbitMQ's
    /// default needs [`RabbitMqSink::frame_max`].
    pub async fn new(channel: Channel) -> Result<RabbitMqSink, BrokerError> {
        confirming(&channel).await?;
        Ok(RabbitMqSink {
            channel: Arc::new(Mutex::new(channel)),
            url: None,
            exchange: String::new(),
            frame_max: DEFAULT_FRAME_MAX,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        })
    }

    /// On a connection of its own to `url`, opened again (on the next
    /// publish) after the broker closed it: a relay outlives a broker
    /// restart, and the publishes meanwhile fail and are retried.
    /// Its `frame_max` is the one the connection negotiated.
    pub async fn connect(url: &str) -> Result<RabbitMqSink, BrokerError> {
        let (channel, frame_max) = open(url).await?;
        Ok(RabbitMqSink {
            channel: Arc::new(Mutex::new(channel)),
            url: Some(url.into()),
            exchange: String::new(),
            frame_max,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        })
    }

    /// Publishes to `exchange` instead, the topic as the routing key.
    pub fn exchange(mut self, exchange: impl Into<String>) -> RabbitMqSink {
        self.exchange = exchange.into();
        self
    }

    /// The `frame_max` of the channel's connection,
    /// `Connection::configuration().frame_max()` (default 131 072,
    /// [RabbitMQ's](crate::consumer::rabbitmq::DEFAULT_FRAME_MAX); `connect`
    /// reads it). AMQP sends a
    /// message's content header (its id and headers) in one frame, and a
    /// larger one is a connection error for every message in flight on it:
    /// such a message fails alone instead.
    pub fn frame_max(mut self, bytes: u32) -> RabbitMqSink {
        self.frame_max = bytes;
        self
    }

    /// The broker's `max_message_size` (default 134 217 728 bytes, RabbitMQ
    /// 3.x's 128 MiB; set 16 MiB for 4.x's default, or what the broker is
    /// configured with). The broker
    /// closes the channel on a larger payload, failing the batch on it: such
    /// a payload fails alone instead.
    pub fn max_message_bytes(mut self, bytes: usize) -> RabbitMqSink {
        self.max_message_bytes = bytes;
        self
    }
}

#[async_trait::async_trait]
impl Sink for RabbitMqSink {
    fn name(&self) -> &'static str {
        "rabbitmq"
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let mut channel = self.channel.lock().await;
        if let Some(url) = self
            .url
            .as_deref()
            .filter(|_| !channel.status().connected())
        {
            match open(url).await {
                // The same broker: the `frame_max` read at `connect` holds.
                Ok((fresh, _)) => *channel = fresh,
                Err(e) => {
                    let why = e.to_string();
                    return batch
                        .iter()
                        .map(|_| Err(BrokerError::new("rabbitmq", why.clone())))
                        .collect();
                }
            }
        }
        let mut pending = Vec::with_capacity(batch.len());
        for m in batch {
            if let Some(e) = too_long_a_name(m) {
                pending.push(Err(e));
                continue;
            }
            if m.payload.len() > self.max_message_bytes {
                pending.push(Err(BrokerError::new(
                    "rabbitmq",
                    format!(
                        "the payload is {} bytes, over the broker's max_message_size ({}, \
                         `RabbitMqSink::max_message_bytes`)",
                        m.payload.len(),
                        self.max_message_bytes
                    ),
                )));
                continue;
            }
            let mut headers = FieldTable::default();
            for (name, value) in &m.headers {
                headers.insert(
                    name.as_str().into(),
                    AMQPValue::LongString(value.as_str().into()),
                );
            }
            let props = BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(ShortString::from(m.id.as_str()))
                .with_headers(headers);
            if let Some(why) = header_too_large(&props, self.frame_max) {
                pending.push(Err(BrokerError::new(
                    "rabbitmq",
                    format!("the message `{}` was not published: {why}", m.id),
                )));
                continue;
            }
            let sent = channel
                .basic_publish(
                    &self.exchange,
                    &m.topic,
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &m.payload,
                    props,
                )
                .await
                .map_err(broker);
            pending.push(sent);
        }
        // Confirms are matched to messages by delivery tag, but lapin hands a
        // returned (unroutable) message to whichever confirm completes next,
        // and one `multiple` ack completes several in any order. So the
        // returns are gathered from every confirm of the batch and matched to
        // their messages by `message-id`, which the relay keeps unique.
        let mut answers = Vec::with_capacity(batch.len());
        let mut returned = HashSet::new();
        let mut unmatched_return = false;
        for (m, sent) in batch.iter().zip(pending) {
            answers.push(match sent {
                Err(e) => Err(e),
                Ok(confirm) => match confirm.await {
                    Err(e) => Err(broker(e)),
                    Ok(c) => {
                        let nack = c.is_nack();
                        if let Some(back) = c.take_message() {
                            match back.properties.message_id() {
                                Some(id) => {
                                    returned.insert(id.as_str().to_owned());
                                }
                                None => unmatched_return = true,
                            }
                        }
                        if nack {
                            Err(BrokerError::new(
                                "rabbitmq",
                                format!("the broker refused the message for `{}`", m.topic),
                            ))
                        } else {
                            Ok(())
                        }
                    }
                },
            });
        }
        batch
            .iter()
            .zip(answers)
            .map(|(m, answer)| {
                answer?;
                if returned.contains(m.id.as_str()) {
                    return Err(BrokerError::new(
                        "rabbitmq",
                        format!(
                            "no queue is bound for `{}` (the message came back)",
                            m.topic
                        ),
                    ));
                }
                // A return without an id cannot be told apart: every message
                // of the batch might be it, so none is marked sent (at least
                // once; the consumers deduplicate by id).
                if unmatched_return {
                    return Err(BrokerError::new(
                        "rabbitmq",
                        "a message of this batch came back without its message-id",
                    ));
                }
                Ok(())
            })
            .collect()
    }
}
