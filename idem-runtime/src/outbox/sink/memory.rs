//! An in-process sink: a channel the application reads, for a service that
//! has no broker yet, examples and tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::mpsc;

use super::{Outgoing, Sink};
use crate::consumer::BrokerError;

/// Publishes into a bounded channel (a full channel makes the relay wait).
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use idem_runtime::outbox::sink::{MemorySink, Sink};
/// let (sink, mut rx) = MemorySink::channel(16);
/// let out = idem_runtime::outbox::Outgoing {
///     id: idem_runtime::consumer::MessageId::new("m-1"),
///     topic: "t".into(), ordering_key: None, headers: Default::default(),
///     payload: b"{}".to_vec(), attempt: 1,
/// };
/// assert!(sink.publish(&[out]).await[0].is_ok());
/// assert_eq!(rx.recv().await.unwrap().id.as_str(), "m-1");
/// # });
/// ```
#[derive(Clone)]
pub struct MemorySink {
    tx: mpsc::Sender<Outgoing>,
    down: Arc<AtomicBool>,
}

impl MemorySink {
    /// A sink and the receiving end of its channel.
    pub fn channel(capacity: usize) -> (MemorySink, mpsc::Receiver<Outgoing>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (
            MemorySink {
                tx,
                down: Arc::default(),
            },
            rx,
        )
    }

    /// While `down`, every publish fails (a broker outage, for tests and
    /// drills).
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl Sink for MemorySink {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let mut out = Vec::with_capacity(batch.len());
        for m in batch {
            out.push(if self.down.load(Ordering::SeqCst) {
                Err(BrokerError::new("memory", "the sink is down"))
            } else {
                self.tx
                    .send(m.clone())
                    .await
                    .map_err(|_| BrokerError::new("memory", "the receiver was dropped"))
            });
        }
        out
    }
}
