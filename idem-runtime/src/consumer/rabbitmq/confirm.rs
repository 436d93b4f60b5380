//! Publishing with publisher confirms: a publish waits for the broker's
//! confirm (a nack is an error), the content header is held to the
//! connection's `frame_max` (a larger one closes the connection), and the
//! consumer's copies (a redelivery, a parked copy, a returned message
//! counted) go `mandatory`, one at a time, so a copy no queue took comes back
//! as an error and the original stays unacked.

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel};

use super::broker;
use super::queues::Names;
use crate::consumer::BrokerError;

/// Publishes and waits for the broker's confirm; a nack is an error naming
/// `to`. A `mandatory` publish that no queue took comes back: the returned
/// message is in the confirmation.
pub(super) async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
    to: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<lapin::publisher_confirm::Confirmation, BrokerError> {
    let confirm = channel
        .basic_publish(
            exchange,
            routing_key,
            BasicPublishOptions {
                mandatory,
                ..BasicPublishOptions::default()
            },
            body,
            props,
        )
        .await
        .map_err(broker)?
        .await
        .map_err(broker)?;
    if confirm.is_nack() {
        return Err(BrokerError::new(
            "rabbitmq",
            format!("the broker refused a message for {to}"),
        ));
    }
    Ok(confirm)
}

/// RabbitMQ's default `frame_max`, what the consumer and the sink assume
/// unless told the connection's
/// ([`RabbitMqBuilder::frame_max`](super::RabbitMqBuilder::frame_max),
/// `RabbitMqSink::frame_max`): lapin negotiates it on the connection and
/// does not show it on a channel.
pub const DEFAULT_FRAME_MAX: u32 = 131_072;

/// What a frame carries besides its payload: type, channel, size and the
/// end octet.
const FRAME_OVERHEAD: usize = 8;

/// The bytes of the content header frame that carries `props`: the frame's
/// overhead, class, weight and body size, then the properties as lapin
/// encodes them.
pub(crate) fn header_frame_bytes(props: &BasicProperties) -> usize {
    let encoded = lapin::protocol::basic::gen_properties::<Vec<u8>>(props)(Vec::new().into());
    // Encoding into a `Vec` does not fail; if it ever did, the header counts
    // as too large rather than being sent.
    encoded.map_or(usize::MAX, |ctx| {
        FRAME_OVERHEAD + 12 + usize::try_from(ctx.position).unwrap_or(usize::MAX)
    })
}

/// Why a message with `props` cannot be published on a connection whose
/// `frame_max` is `frame_max`: AMQP sends the content header as one frame,
/// and a larger one is a connection error that takes every channel with it.
/// (RabbitMQ lets a frame pass `frame_max` by up to its 8 bytes of overhead;
/// this holds to the protocol's bound.)
pub(crate) fn header_too_large(props: &BasicProperties, frame_max: u32) -> Option<String> {
    let bytes = header_frame_bytes(props);
    (bytes > frame_max as usize).then(|| {
        format!(
            "its content header (properties and headers) is a {bytes}-byte frame, over the \
             connection's frame_max ({frame_max}): AMQP sends it in one frame"
        )
    })
}

/// `reason` as it fits in `room` bytes: cut at a character boundary, with
/// how long it was.
pub(super) fn cut(reason: &str, room: usize) -> String {
    if reason.len() <= room {
        return reason.to_owned();
    }
    let note = format!("… (cut to fit the frame: {} bytes in all)", reason.len());
    // With no room for the note, as much of the reason as fits.
    let (mut keep, note) = match room.checked_sub(note.len()) {
        Some(keep) => (keep, note),
        None => (room, String::new()),
    };
    while !reason.is_char_boundary(keep) {
        keep -= 1;
    }
    format!("{}{note}", &reason[..keep])
}

/// What a consumer's copies (a redelivery, a parked copy, a returned message
/// counted) need besides the channel.
pub(super) struct Copies {
    pub(super) names: Names,
    pub(super) frame_max: u32,
    /// Held from a copy's publish to its confirm. Copies are `mandatory`, and
    /// lapin hands a returned message to whichever confirm completes next
    /// (one `multiple` ack completes several): with one copy in flight on the
    /// channel, a return is that copy's. Copies are the exception path, so
    /// the round trips in a row cost little.
    pub(super) one_at_a_time: tokio::sync::Mutex<()>,
}

impl Copies {
    /// Publishes a copy `mandatory` with a confirm: a copy no queue takes
    /// (`to`, a queue deleted since `declare`) comes back and is an error, so
    /// the caller does not ack the original. A copy whose header would not
    /// fit in a frame is an error before anything is sent.
    pub(super) async fn publish(
        &self,
        channel: &Channel,
        exchange: &str,
        routing_key: &str,
        to: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), BrokerError> {
        if let Some(why) = header_too_large(&props, self.frame_max) {
            return Err(BrokerError::new(
                "rabbitmq",
                format!("a copy for {to} was not published: {why}"),
            ));
        }
        let _one = self.one_at_a_time.lock().await;
        let confirm =
            publish_confirmed(channel, exchange, routing_key, true, to, body, props).await?;
        if confirm.take_message().is_some() {
            return Err(BrokerError::new(
                "rabbitmq",
                format!("no queue took the copy for {to}: it came back (was the queue deleted?)"),
            ));
        }
        Ok(())
    }
}
