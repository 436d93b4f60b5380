//! Publishing to NATS JetStream: every message sent, then every ack awaited.

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::message::PublishMessage;

use super::{Outgoing, Sink};
use crate::consumer::BrokerError;

/// Publishes each message on the subject named by its topic with
/// `Nats-Msg-Id` set to the message id, so the stream drops a re-publish
/// inside its duplicate window (2 minutes unless the stream says otherwise);
/// confirmed when the stream acked it.
///
/// ```no_run
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let nats = async_nats::connect("127.0.0.1:4222").await?;
/// let sink = idem_runtime::outbox::sink::JetStreamSink::new(async_nats::jetstream::new(nats));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct JetStreamSink {
    js: Context,
}

impl JetStreamSink {
    /// On a JetStream context.
    pub fn new(js: Context) -> JetStreamSink {
        JetStreamSink { js }
    }
}

fn broker(e: impl std::error::Error + Send + Sync + 'static) -> BrokerError {
    BrokerError::new("nats", e)
}

#[async_trait::async_trait]
impl Sink for JetStreamSink {
    fn name(&self) -> &'static str {
        "nats"
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let mut pending = Vec::with_capacity(batch.len());
        for m in batch {
            let mut headers = HeaderMap::new();
            for (name, value) in &m.headers {
                headers.insert(name.as_str(), value.as_str());
            }
            let publish = PublishMessage::build()
                .payload(m.payload.clone().into())
                .headers(headers)
                .message_id(m.id.as_str());
            pending.push(self.js.send_publish(m.topic.clone(), publish).await);
        }
        let mut out = Vec::with_capacity(batch.len());
        for sent in pending {
            out.push(match sent {
                Ok(ack) => ack.await.map(|_| ()).map_err(broker),
                Err(e) => Err(broker(e)),
            });
        }
        out
    }
}
