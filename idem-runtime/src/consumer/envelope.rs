//! A message together with the id it was published under, so a handler can
//! be keyed on the id alone (what the outbox's relay sets on every message).

use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::Delivery;
use crate::error::CodecError;
use crate::key::{KeyEncoder, KeyPart};

/// The stable id of a published message: the outbox's id, carried by each
/// broker in its own place (a stream field, `Nats-Msg-Id`, AMQP `message-id`).
///
/// ```
/// let id = idem_runtime::consumer::MessageId::new("7f3a");
/// assert_eq!(id.as_str(), "7f3a");
/// assert_eq!(id.to_string(), "7f3a");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MessageId(String);

impl MessageId {
    /// Wraps an id.
    pub fn new(id: impl Into<String>) -> MessageId {
        MessageId(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl KeyPart for MessageId {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        enc.write_str(&self.0);
    }
}

/// A decoded message and the id it was published under: take it as the
/// handler's parameter and key the handler on `id`, with no business field.
/// A delivery that carries no id is parked.
///
/// ```
/// use idem_runtime::consumer::Envelope;
/// use idem_runtime::idempotent;
///
/// #[idempotent(consumer, key = "m.id", scope = "shipping.on_order_created", event = "ORDER_CREATED")]
/// async fn ship(m: Envelope<OrderCreated>) -> Result<(), ShipError> {
///     book_courier(m.body.order_id).await
/// }
///
/// #[derive(serde::Deserialize)]
/// struct OrderCreated { order_id: String }
/// # #[derive(Debug)]
/// # struct ShipError(idem_runtime::Error);
/// # impl From<idem_runtime::Error> for ShipError { fn from(e: idem_runtime::Error) -> Self { ShipError(e) } }
/// # async fn book_courier(_order_id: String) -> Result<(), ShipError> { Ok(()) }
///
/// // A second delivery of the same message id is a duplicate:
/// use idem_runtime::consumer::{Acked, Action, Runner, testing::Memory};
/// use idem_runtime::store::memory::MemoryStore;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// idem_runtime::install(MemoryStore::new());
/// let runner = Runner::new();
/// let msg = || Memory::new(br#"{"order_id":"o-1"}"#).with_message_id("m-1");
/// assert_eq!(runner.process(msg(), &ship).await.unwrap(), Action::Acked(Acked::Processed));
/// assert_eq!(runner.process(msg(), &ship).await.unwrap(), Action::Acked(Acked::Deduplicated));
/// # });
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope<M> {
    /// The id the message was published under.
    pub id: MessageId,
    /// The message.
    pub body: M,
}

/// What a consumer's handler takes: any JSON-decodable message, or an
/// [`Envelope`] of one.
pub trait FromDelivery: Sized {
    /// Decodes the delivery, or says why it cannot be (the message is then
    /// parked with that reason).
    fn from_delivery<D: Delivery>(delivery: &D) -> Result<Self, String>;
}

fn decode<M: DeserializeOwned, D: Delivery>(delivery: &D) -> Result<M, String> {
    match delivery.payload() {
        None => Err("undecodable: the message has no payload".to_owned()),
        // The reason keeps serde's category and position, not the value:
        // message bodies hold customers' data and reasons end up in logs and
        // parking streams.
        Some(body) => serde_json::from_slice(body)
            .map_err(|e| format!("undecodable: {}", CodecError::from(e))),
    }
}

impl<M: DeserializeOwned> FromDelivery for M {
    fn from_delivery<D: Delivery>(delivery: &D) -> Result<M, String> {
        decode(delivery)
    }
}

impl<M: DeserializeOwned> FromDelivery for Envelope<M> {
    fn from_delivery<D: Delivery>(delivery: &D) -> Result<Self, String> {
        let Some(id) = delivery.message_id() else {
            return Err(
                "the message carries no message id (the handler takes an Envelope, keyed on the id \
                 the outbox relay sets)"
                    .to_owned(),
            );
        };
        let id = MessageId::new(id);
        Ok(Envelope {
            id,
            body: decode(delivery)?,
        })
    }
}
