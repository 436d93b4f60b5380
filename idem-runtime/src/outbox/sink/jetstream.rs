//! Publishing to NATS JetStream: every message sent, then every ack awaited.

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::message::PublishMessage;
use std::collections::VecDeque;

use super::{Outgoing, Sink};
use crate::consumer::BrokerError;
use crate::consumer::jetstream::streams;

/// Publishes each message on the subject named by its topic with
/// `Nats-Msg-Id` set to the message id, so the stream drops a re-publish
/// inside its duplicate window (2 minutes unless the stream says otherwise);
/// confirmed when the stream acked it. A stream must capture each topic's
/// subject: [`create_stream`](JetStreamSink::create_stream) creates it when
/// it does not exist.
///
/// ```no_run
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let nats = async_nats::connect("127.0.0.1:4222").await?;
/// let sink = idem_runtime::outbox::sink::JetStreamSink::new(async_nats::jetstream::new(nats))
///     .create_stream("ORDERS", ["orders.>"])
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct JetStreamSink {
    js: Context,
    max_in_flight: usize,
}

/// Publishes awaiting their ack at once, unless set: well under async-nats'
/// own cap (`max_ack_inflight`, 5 000 by default), whose permits only an
/// awaited ack gives back.
const DEFAULT_MAX_IN_FLIGHT: usize = 1_000;

impl JetStreamSink {
    /// On a JetStream context.
    pub fn new(js: Context) -> JetStreamSink {
        JetStreamSink {
            js,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }

    /// At most `n` publishes awaiting their ack at once (1 000 unless set;
    /// at least 1). Keep it at or under the context's `max_ack_inflight`:
    /// above it a publish waits for a permit that only an awaited ack frees.
    ///
    /// ```no_run
    /// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
    /// let nats = async_nats::connect("127.0.0.1:4222").await?;
    /// let sink = idem_runtime::outbox::sink::JetStreamSink::new(async_nats::jetstream::new(nats))
    ///     .max_in_flight(256);
    /// # Ok(()) }
    /// ```
    pub fn max_in_flight(mut self, n: usize) -> JetStreamSink {
        self.max_in_flight = n.max(1);
        self
    }

    /// Creates the stream `name`, capturing `subjects`, now if it does not
    /// exist (with the server's defaults: file storage, limits retention, a
    /// 2 minute duplicate window). An existing stream is used as it is when
    /// its subjects capture these; otherwise this fails saying so and
    /// changes nothing, as it does when another stream already captures
    /// them (a subject belongs to one stream).
    ///
    /// ```no_run
    /// use idem_runtime::outbox::sink::JetStreamSink;
    ///
    /// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
    /// let nats = async_nats::connect("127.0.0.1:4222").await?;
    /// let sink = JetStreamSink::new(async_nats::jetstream::new(nats))
    ///     .create_stream("ORDERS", ["orders.created", "orders.paid"])
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn create_stream<S: Into<String>>(
        self,
        name: &str,
        subjects: impl IntoIterator<Item = S>,
    ) -> Result<JetStreamSink, BrokerError> {
        let subjects: Vec<String> = subjects.into_iter().map(Into::into).collect();
        streams::ensure(&self.js, name, &subjects, None).await?;
        Ok(self)
    }
}

fn broker(e: impl std::error::Error + Send + Sync + 'static) -> BrokerError {
    BrokerError::new("nats", e)
}

/// Why the server would refuse `m` (or close the connection over it), so it
/// fails alone instead of taking its batch with it.
fn refused(m: &Outgoing, max_payload: usize) -> Option<BrokerError> {
    if let Some(problem) = subject_problem(&m.topic) {
        return Some(BrokerError::new(
            "nats",
            format!("`{}` is not a subject to publish on: {problem}", m.topic),
        ));
    }
    // What the server counts against `max_payload`: the header block
    // (`NATS/1.0\r\n`, a `name: value\r\n` line per header, `Nats-Msg-Id`
    // among them, a blank line) and the payload.
    let headers: usize = m
        .headers
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .chain([("Nats-Msg-Id", m.id.as_str())])
        .map(|(name, value)| name.len() + 2 + value.len() + 2)
        .sum();
    let size = "NATS/1.0\r\n".len() + headers + 2 + m.payload.len();
    // 0 before the client met a server: nothing to compare with.
    (max_payload > 0 && size > max_payload).then(|| {
        BrokerError::new(
            "nats",
            format!(
                "the message is {size} bytes with its headers, over the server's \
                 max_payload of {max_payload}"
            ),
        )
    })
}

/// What makes `subject` one the server refuses to publish on.
fn subject_problem(subject: &str) -> Option<&'static str> {
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("it holds whitespace")
    } else if subject.split('.').any(str::is_empty) {
        Some("it has an empty token")
    } else if subject.split('.').any(|t| t == "*" || t == ">") {
        Some("it holds a wildcard")
    } else {
        None
    }
}

#[async_trait::async_trait]
impl Sink for JetStreamSink {
    fn name(&self) -> &'static str {
        "nats"
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let max_payload = self.js.client().server_info().max_payload;
        let mut out: Vec<Option<Result<(), BrokerError>>> = Vec::with_capacity(batch.len());
        // A window of publishes awaiting their ack, the oldest first: each
        // send past the window waits for the oldest ack.
        let mut in_flight = VecDeque::with_capacity(self.max_in_flight.min(batch.len()));
        for (i, m) in batch.iter().enumerate() {
            if let Some(e) = refused(m, max_payload) {
                out.push(Some(Err(e)));
                continue;
            }
            if in_flight.len() >= self.max_in_flight {
                let (at, ack): (usize, PublishAckFuture) =
                    in_flight.pop_front().expect("a full window");
                out[at] = Some(ack.await.map(|_| ()).map_err(broker));
            }
            let mut headers = HeaderMap::new();
            for (name, value) in &m.headers {
                headers.insert(name.as_str(), value.as_str());
            }
            let publish = PublishMessage::build()
                .payload(m.payload.clone().into())
                .headers(headers)
                .message_id(m.id.as_str());
            match self.js.send_publish(m.topic.clone(), publish).await {
                Ok(ack) => {
                    out.push(None);
                    in_flight.push_back((i, ack));
                }
                Err(e) => out.push(Some(Err(broker(e)))),
            }
        }
        for (at, ack) in in_flight {
            out[at] = Some(ack.await.map(|_| ()).map_err(broker));
        }
        out.into_iter()
            .map(|answer| answer.expect("every publish answered"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::subject_problem;

    #[test]
    fn subjects_the_server_refuses_are_named() {
        assert_eq!(subject_problem("orders.created"), None);
        assert!(subject_problem("orders created").is_some());
        assert!(subject_problem("orders..created").is_some());
        assert!(subject_problem(".orders").is_some());
        assert!(subject_problem("orders.*").is_some());
        assert!(subject_problem("orders.>").is_some());
        assert_eq!(subject_problem("orders.x*"), None);
    }
}
