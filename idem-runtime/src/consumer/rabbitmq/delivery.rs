//! One message handed out by a [`RabbitMqSource`](super::RabbitMqSource):
//! its verdicts. An ack acks; a retry or a deferral publishes a copy to
//! `q.retry` with a per-message TTL, and a park one to `q.dlx` with the
//! reason cut to fit a frame, each confirmed before the original is acked.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::BasicAckOptions;
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Channel};

use super::broker;
use super::confirm::{Copies, cut, header_frame_bytes};
use super::headers::{DELIVERIES, FAILURES, QUEUE, REASON};
use crate::consumer::{BrokerError, Delivery};

/// One message handed to this consumer.
pub struct RabbitMqDelivery {
    pub(super) channel: Channel,
    pub(super) copies: Arc<Copies>,
    pub(super) attempt: u32,
    pub(super) delivery: lapin::message::Delivery,
}

impl RabbitMqDelivery {
    /// The message's headers with ours set, for a copy.
    pub(super) fn copy_props(&self, set: &[(&str, AMQPValue)]) -> BasicProperties {
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
