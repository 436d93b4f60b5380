//! Streams created on request: `JetStreamBuilder::create_stream`,
//! `create_parking_stream` and `JetStreamSink::create_stream`.
//!
//! A stream that exists is used as it is when it captures the subjects asked
//! for (its limits, storage and replicas are the operator's), and is an
//! error otherwise: idem never changes a stream, since another application's
//! messages may depend on what it captures.

use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
use async_nats::jetstream::{Context, ErrorCode, stream};

use super::BrokerError;

fn error(text: String) -> BrokerError {
    BrokerError::new("nats", text)
}

/// Makes sure the stream `name` exists and captures each of `subjects`,
/// creating it with the server's defaults when it is missing. When `avoid`
/// is given, the stream must not capture it (the parking subject: a parked
/// copy captured by the stream it came from would come back as a message).
pub(crate) async fn ensure(
    js: &Context,
    name: &str,
    subjects: &[String],
    avoid: Option<&str>,
) -> Result<(), BrokerError> {
    if subjects.is_empty() {
        return Err(error(format!(
            "the stream `{name}` is to be created on no subject: name at least one"
        )));
    }
    if let Some(avoid) = avoid {
        captures_not(name, subjects, avoid)?;
    }
    // Twice at most: a stream another process created between the look-up
    // and the create is checked as any existing one.
    for _ in 0..2 {
        match js.get_stream(name).await {
            Ok(existing) => {
                let have = &existing.cached_info().config.subjects;
                return compatible(name, have, subjects, avoid);
            }
            Err(e) if !not_found(&e.kind()) => {
                return Err(error(format!("looking up the stream `{name}`: {e}")));
            }
            Err(_) => {}
        }
        let created = js
            .create_stream(stream::Config {
                name: name.to_owned(),
                subjects: subjects.to_vec(),
                ..Default::default()
            })
            .await;
        let e = match created {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        match e.kind() {
            CreateStreamErrorKind::JetStream(j)
                if j.error_code() == ErrorCode::STREAM_NAME_EXIST =>
            {
                continue;
            }
            CreateStreamErrorKind::JetStream(j)
                if j.error_code() == ErrorCode::STREAM_SUBJECT_OVERLAP =>
            {
                return Err(overlap(js, name, subjects).await);
            }
            _ => return Err(error(format!("creating the stream `{name}`: {e}"))),
        }
    }
    Err(error(format!(
        "the stream `{name}` was reported both missing and existing: another process \
         is creating and deleting it"
    )))
}

fn not_found(kind: &GetStreamErrorKind) -> bool {
    matches!(kind, GetStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// An existing stream is used as it is when its subjects capture the ones
/// asked for, and not the one to avoid.
fn compatible(
    name: &str,
    have: &[String],
    want: &[String],
    avoid: Option<&str>,
) -> Result<(), BrokerError> {
    let missing: Vec<&str> = want
        .iter()
        .filter(|w| !have.iter().any(|h| covers(h, w)))
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        return Err(error(format!(
            "the stream `{name}` exists on the subjects {have:?}, which do not capture \
             {missing:?}: idem does not change an existing stream; add the subjects to it \
             (`nats stream edit {name} --subjects …`) or name another stream"
        )));
    }
    match avoid {
        Some(avoid) => captures_not(name, have, avoid),
        None => Ok(()),
    }
}

fn captures_not(name: &str, subjects: &[String], avoid: &str) -> Result<(), BrokerError> {
    match subjects.iter().find(|s| covers(s, avoid)) {
        Some(s) => Err(error(format!(
            "the stream `{name}` captures the parking subject `{avoid}` (by `{s}`): parked \
             copies would come back to the consumer as messages; park on a subject it \
             does not capture"
        ))),
        None => Ok(()),
    }
}

/// The server refused the new stream because another one captures some of
/// its subjects: say which.
async fn overlap(js: &Context, name: &str, subjects: &[String]) -> BrokerError {
    for s in subjects {
        if let Ok(other) = js.stream_by_subject(s.as_str()).await {
            return error(format!(
                "the stream `{name}` cannot be created on {subjects:?}: the stream `{other}` \
                 already captures `{s}`, and a subject belongs to one stream"
            ));
        }
    }
    error(format!(
        "the stream `{name}` cannot be created on {subjects:?}: another stream captures \
         some of them, and a subject belongs to one stream"
    ))
}

/// Whether every subject `subject` matches (it may hold wildcards) is one
/// `pattern` matches: `orders.>` covers `orders.paid` and `orders.*.eu`;
/// `orders.*` does not cover `orders.>`.
pub(crate) fn covers(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some(_), Some(">")) => return false,
            (Some("*"), Some(_)) => {}
            (Some(pt), Some(st)) if pt == st => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Refuses a durable that reads beyond the subjects asked for. A wider
/// stream than asked (`orders.>` for `orders.paid`) is used as it is, but a
/// durable reading all of it would hand the handler other events (a refund
/// decoding as a payment). A new durable gets the one subject asked for as
/// its filter (several need nats-server 2.10, async-nats' `server_2_10`); an
/// existing one keeps its own filter, and without a filter it reads the
/// whole stream.
pub(crate) fn reads_only(
    asked: &[String],
    filter: &str,
    stream_subjects: &[String],
    durable: &str,
    stream: &str,
) -> Result<(), BrokerError> {
    let read = if filter.is_empty() {
        stream_subjects.to_vec()
    } else {
        vec![filter.to_owned()]
    };
    match read.iter().find(|s| !asked.iter().any(|a| covers(a, s))) {
        None => Ok(()),
        Some(extra) => Err(BrokerError::new(
            "nats",
            format!(
                "the durable `{durable}` on stream `{stream}` reads `{extra}`, beyond the subjects asked for ({}): give it a filter (`nats consumer edit`) or ask for those subjects",
                asked.join(", ")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::covers;

    #[test]
    fn a_pattern_covers_what_each_of_its_tokens_matches() {
        for (pattern, subject) in [
            ("orders.paid", "orders.paid"),
            ("orders.*", "orders.paid"),
            ("orders.*", "orders.*"),
            ("orders.>", "orders.paid"),
            ("orders.>", "orders.*.eu"),
            ("orders.>", "orders.>"),
            (">", "a.b.c"),
            ("*.paid", "orders.paid"),
        ] {
            assert!(covers(pattern, subject), "{pattern} {subject}");
        }
        for (pattern, subject) in [
            ("orders.paid", "orders.parked"),
            ("orders.paid", "orders.*"),
            ("orders.*", "orders.>"),
            ("orders.*", "orders.paid.eu"),
            ("orders.>", "orders"),
            ("orders.paid.eu", "orders.paid"),
            ("orders", "orders.paid"),
        ] {
            assert!(!covers(pattern, subject), "{pattern} {subject}");
        }
    }
}
