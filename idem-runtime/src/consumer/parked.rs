//! A parked message as an operator reads it back: one type for every broker,
//! each adapter supplying only how to read its parking place.

use std::time::SystemTime;

/// A message the runner parked, with why, read back from where the adapter
/// parked it (`redis_streams::parked`, `rabbitmq::parked`,
/// `jetstream::parked`).
///
/// | field | Redis Streams | RabbitMQ | JetStream |
/// |---|---|---|---|
/// | `payload` | field `payload` | the body | the payload |
/// | `reason` | field `reason` | header `x-idem-reason` | header `Idem-Reason` |
/// | `message_id` | field `message-id` | property `message-id` | header `Nats-Msg-Id` |
/// | `origin` | field `stream` | header `x-idem-queue` | header `Idem-Stream` |
/// | `deliveries` | field `deliveries` | header `x-idem-deliveries` | header `Idem-Deliveries` |
/// | `parked_at` | the parking entry's id | — | the parking stream's timestamp |
/// | `position` | the parking entry's id | — | the parking stream's sequence |
///
/// A message put in the parking place by anything but a runner reads back
/// with an empty `reason` and whatever else it carries.
///
/// ```
/// use idem_runtime::consumer::Parked;
///
/// fn triage(p: &Parked) -> &'static str {
///     if p.reason.starts_with("undecodable") {
///         "fix the producer"
///     } else {
///         "fix the handler, then publish the payload again"
///     }
/// }
///
/// let p = Parked::new(b"{\"order_id\": 7".to_vec(), "undecodable: EOF while parsing an object");
/// assert_eq!(triage(&p), "fix the producer");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Parked {
    /// The body as it was delivered, byte for byte.
    pub payload: Vec<u8>,
    /// Why the runner parked it (see the table in [`consumer`](crate::consumer)).
    pub reason: String,
    /// The id it was published under, when it carried one (the outbox's
    /// relay always sets it).
    pub message_id: Option<String>,
    /// The stream or queue it was parked from.
    pub origin: Option<String>,
    /// Its counted deliveries when it was parked.
    pub deliveries: Option<u32>,
    /// When it was parked, by the broker's clock, where the broker keeps it.
    pub parked_at: Option<SystemTime>,
    /// Where the parked copy sits, for removing it once handled: the parking
    /// entry's id on Redis (`XDEL`), the parking stream's sequence on
    /// JetStream (`Stream::delete_message`); `None` on RabbitMQ, whose queues
    /// have no addresses.
    pub position: Option<String>,
}

impl Parked {
    /// A parked message with nothing known beyond its body and reason: for a
    /// broker adapter of one's own, and for tests.
    ///
    /// ```
    /// let mut p = idem_runtime::consumer::Parked::new(&b"{}"[..], "the handler's idempotent call refused it");
    /// p.message_id = Some("m-1".into());
    /// assert_eq!(p.deliveries, None);
    /// ```
    pub fn new(payload: impl Into<Vec<u8>>, reason: impl Into<String>) -> Parked {
        Parked {
            payload: payload.into(),
            reason: reason.into(),
            message_id: None,
            origin: None,
            deliveries: None,
            parked_at: None,
            position: None,
        }
    }
}
