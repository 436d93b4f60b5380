//! In-process deliveries for examples and unit tests of handlers.
//!
//! A handler's outcome on a delivery that needs no broker:
//!
//! ```
//! use idem_runtime::consumer::{Acked, Action, Runner, testing::Memory};
//! use idem_runtime::store::memory::MemoryStore;
//!
//! #[derive(serde::Deserialize)]
//! struct Ping { id: u64 }
//!
//! #[idem_runtime::idempotent(consumer, event = "PING", key = "p.id", scope = "doc.ping")]
//! async fn on_ping(p: Ping) -> Result<(), idem_runtime::Error> { Ok(()) }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! idem_runtime::install(MemoryStore::new());
//! let delivery = Memory::new(br#"{"id": 1}"#).with_message_id("m-1");
//! let log = delivery.log(); // what the runner told the "broker"
//! let action = Runner::new().process(delivery, &on_ping).await.unwrap();
//! assert_eq!(action, Action::Acked(Acked::Processed));
//! assert_eq!(log.lock().unwrap().len(), 1);
//! # });
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{BrokerError, Delivery};

/// A delivery that remembers what was done with it.
///
/// ```
/// use idem_runtime::consumer::testing::Memory;
/// let d = Memory::new(b"{}");
/// let log = d.log();
/// assert!(log.lock().unwrap().is_empty());
/// ```
pub struct Memory {
    body: Vec<u8>,
    attempt: u32,
    message_id: Option<String>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Memory {
    /// A first delivery of `body`.
    pub fn new(body: &[u8]) -> Memory {
        Memory {
            body: body.to_vec(),
            attempt: 1,
            message_id: None,
            log: Arc::default(),
        }
    }

    /// The same, as its `attempt`-th counted delivery.
    pub fn attempt(mut self, attempt: u32) -> Memory {
        self.attempt = attempt;
        self
    }

    /// The same, published under `id` (as the outbox's relay sets it).
    pub fn with_message_id(mut self, id: impl Into<String>) -> Memory {
        self.message_id = Some(id.into());
        self
    }

    /// What was done with it: `ack`, `retry <delay>`, `defer <delay>`,
    /// `park <reason>`.
    pub fn log(&self) -> Arc<Mutex<Vec<String>>> {
        self.log.clone()
    }

    fn push(&self, what: String) {
        self.log.lock().expect("log lock").push(what);
    }
}

#[async_trait::async_trait]
impl Delivery for Memory {
    fn payload(&self) -> Option<&[u8]> {
        Some(&self.body)
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    async fn ack(self) -> Result<(), BrokerError> {
        self.push("ack".into());
        Ok(())
    }

    async fn retry(self, after: Duration) -> Result<(), BrokerError> {
        self.push(format!("retry {after:?}"));
        Ok(())
    }

    async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError> {
        self.push(format!("defer {after:?}"));
        Ok(None)
    }

    async fn park(self, reason: &str) -> Result<(), BrokerError> {
        self.push(format!("park {reason}"));
        Ok(())
    }
}
