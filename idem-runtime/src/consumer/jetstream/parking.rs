//! Reading parked messages back: [`parked`](super::parked).

use async_nats::jetstream::Context;
use async_nats::jetstream::stream::RawMessageErrorKind;

use super::escape::unescaped;
use super::{DELIVERIES, ESCAPED, REASON, STREAM, broker};
use crate::consumer::{BrokerError, Parked};

/// Up to `count` messages of `parking_stream` (the stream capturing the
/// parking subject), oldest first, each with why it was parked.
///
/// Reading leaves them parked: each is fetched by sequence (`STREAM.MSG.GET`),
/// with no consumer, so this works on any retention, a work queue's too.
/// Remove one once handled with `Stream::delete_message(position)`.
///
/// ```no_run
/// use idem_runtime::consumer::jetstream;
///
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let js = async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
/// for p in jetstream::parked(&js, "ORDERS_PARKED", 100).await? {
///     println!("{:?} after {:?} deliveries: {}", p.message_id, p.deliveries, p.reason);
/// }
/// # Ok(()) }
/// ```
pub async fn parked(
    js: &Context,
    parking_stream: &str,
    count: usize,
) -> Result<Vec<Parked>, BrokerError> {
    let stream = js
        .get_stream_no_info(parking_stream)
        .await
        .map_err(broker)?;
    let mut out = Vec::new();
    let mut next = 1;
    while out.len() < count {
        // The first message at or after `next`, over deleted ones.
        let m = match stream.get_first_raw_message_by_subject(">", next).await {
            Ok(m) => m,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => break,
            Err(e) => return Err(broker(e)),
        };
        next = m.sequence + 1;
        let escaped = m.headers.get(ESCAPED).is_some();
        let header = |name: &str| {
            m.headers.get(name).map(|v| {
                if escaped {
                    unescaped(v.as_str())
                } else {
                    v.as_str().to_owned()
                }
            })
        };
        out.push(Parked {
            reason: header(REASON).unwrap_or_default(),
            // By the constant: a name given as text never matches a standard
            // header that the server's reply was parsed into.
            message_id: m
                .headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str().to_owned()),
            origin: header(STREAM),
            deliveries: header(DELIVERIES).and_then(|n| n.parse().ok()),
            parked_at: Some(m.time.into()),
            position: Some(m.sequence.to_string()),
            payload: m.payload.to_vec(),
        });
    }
    Ok(out)
}
