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

/// Publishes each message persistent and `mandatory` (a message no queue
/// takes comes back, and counts as a failure) with its id as the AMQP
/// `message-id`, its headers as AMQP headers; confirmed by the broker's
/// publisher confirm.
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
}

fn broker(e: lapin::Error) -> BrokerError {
    BrokerError::new("rabbitmq", e)
}

/// The longest AMQP short string (a routing key, a `message-id`, a header's
/// name), the limit `put` holds names to. A longer one breaks the frame, and
/// the broker closes the channel with every message of the batch on it.
const SHORT_STRING_BYTES: usize = crate::outbox::MAX_NAME_BYTES;

/// Why `m` cannot go into an AMQP frame, so it fails alone. `put` refuses
/// these; a row written before it did may still hold one.
fn refused(m: &Outgoing) -> Option<BrokerError> {
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

async fn open(url: &str) -> Result<Channel, BrokerError> {
    let conn = crate::consumer::rabbitmq::connect(url).await?;
    let channel = conn.create_channel().await.map_err(broker)?;
    confirming(&channel).await?;
    Ok(channel)
}

impl RabbitMqSink {
    /// On a channel of its own (put in confirm mode here), publishing to the
    /// default exchange: the topic is the queue's name.
    /// A closed channel stays closed: use [`RabbitMqSink::connect`] for a
    /// sink that reconnects.
    pub async fn new(channel: Channel) -> Result<RabbitMqSink, BrokerError> {
        confirming(&channel).await?;
        Ok(RabbitMqSink {
            channel: Arc::new(Mutex::new(channel)),
            url: None,
            exchange: String::new(),
        })
    }

    /// On a connection of its own to `url`, opened again (on the next
    /// publish) after the broker closed it: a relay outlives a broker
    /// restart, and the publishes meanwhile fail and are retried.
    pub async fn connect(url: &str) -> Result<RabbitMqSink, BrokerError> {
        let channel = open(url).await?;
        Ok(RabbitMqSink {
            channel: Arc::new(Mutex::new(channel)),
            url: Some(url.into()),
            exchange: String::new(),
        })
    }

    /// Publishes to `exchange` instead, the topic as the routing key.
    pub fn exchange(mut self, exchange: impl Into<String>) -> RabbitMqSink {
        self.exchange = exchange.into();
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
                Ok(fresh) => *channel = fresh,
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
            if let Some(e) = refused(m) {
                pending.push(Err(e));
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
