//! The headers idem sets on a copy (`x-idem-failures` on a redelivery; the
//! reason, the delivery count and the origin queue on a parked copy) and
//! reading them back from a message's properties.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, ShortString};

/// The failures counted so far, on a redelivery and on a returned message's
/// copy.
pub(super) const FAILURES: &str = "x-idem-failures";
// What a parked copy carries besides the message's own headers.
pub(super) const REASON: &str = "x-idem-reason";
pub(super) const DELIVERIES: &str = "x-idem-deliveries";
pub(super) const QUEUE: &str = "x-idem-queue";

fn int(v: &AMQPValue) -> Option<u32> {
    let n: i64 = match v {
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    };
    u32::try_from(n).ok()
}

pub(super) fn header(props: &BasicProperties, name: &str) -> Option<u32> {
    field(props, name).and_then(int)
}

pub(super) fn text(props: &BasicProperties, name: &str) -> Option<String> {
    match field(props, name)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

fn field<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props
        .headers()
        .as_ref()?
        .inner()
        .get(&ShortString::from(name))
}
