//! The consumer: its settings (prefetch, `frame_max`), and [`Source::next`], which
//! counts a message the broker handed back (`redelivered`) as a failure and
//! republishes it to the tail of the queue before any handler runs it.

use std::sync::Arc;

use futures_util::StreamExt;
use lapin::Channel;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};

use super::confirm::{Copies, DEFAULT_FRAME_MAX};
use super::headers::{FAILURES, header};
use super::queues::{self, Names};
use super::{RabbitMqDelivery, broker};
use crate::consumer::{BrokerError, Delivery, Source};

/// A consumer on a queue: a [`Source`] for [`Runner`](crate::consumer::Runner).
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
        queues::declare(channel, queue).await
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
    /// it to at least the runner's [`concurrency`](crate::consumer::Runner::concurrency):
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
