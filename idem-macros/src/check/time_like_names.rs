//! Rejects key segments whose names say "time of the request" or "random per
//! request" (`created_at`, `timestamp`, `request_id`, `nonce`, …): such a key is
//! different on every retry and never deduplicates.
//!
//! Names are split into words (`created_at` → created, at; `createdAt` →
//! created, at) and judged word by word, so `candidate_id`, `known_sku`, `seat`
//! and `update_count` — which merely contain `date`, `now`, `at` or `update` —
//! pass.

use super::Role;

/// What a suspicious name looks like, for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Suspicion {
    Time,
    PerRequest,
}

const TIME_WORDS: &[&str] = &[
    "timestamp",
    "ts",
    "now",
    "time",
    "datetime",
    "date",
    "instant",
    "clock",
    "epoch",
    "millis",
    "nanos",
    "micros",
];
const RANDOM_WORDS: &[&str] = &["nonce", "random", "rand", "rng", "salt"];
// `<word>_id` naming something minted per request or per hop, never per intent.
const PER_REQUEST_ID_WORDS: &[&str] = &["request", "req", "trace", "span", "correlation"];

fn words(name: &str) -> Vec<String> {
    let mut out = Vec::new();
    for chunk in name.split('_').filter(|c| !c.is_empty()) {
        let mut word = String::new();
        let mut prev_lower = false;
        for c in chunk.chars() {
            if c.is_uppercase() && prev_lower && !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            prev_lower = c.is_lowercase() || c.is_ascii_digit();
            word.extend(c.to_lowercase());
        }
        if !word.is_empty() {
            out.push(word);
        }
    }
    out
}

pub(crate) fn judge(name: &str) -> Option<Suspicion> {
    let words = words(name);
    let last = words.last()?;
    if words.iter().any(|w| TIME_WORDS.contains(&w.as_str())) {
        return Some(Suspicion::Time);
    }
    // `created_at`, `sentAt`: the `at` suffix is how Rust and SQL name instants.
    if words.len() > 1 && last == "at" {
        return Some(Suspicion::Time);
    }
    if words.iter().any(|w| RANDOM_WORDS.contains(&w.as_str())) {
        return Some(Suspicion::PerRequest);
    }
    let per_request_id = words.windows(2).any(|pair| {
        PER_REQUEST_ID_WORDS.contains(&pair[0].as_str())
            && matches!(pair[1].as_str(), "id" | "uuid")
    });
    if per_request_id || matches!(name, "rid" | "request_uuid") {
        return Some(Suspicion::PerRequest);
    }
    None
}

pub(crate) fn message(role: Role, segment: &str, name: &str, suspicion: Suspicion) -> String {
    let (what, exempt) = match suspicion {
        Suspicion::Time => (
            "looks like a time value",
            format!("if `{name}` really is fixed per intent (a batch's settlement date)"),
        ),
        Suspicion::PerRequest => (
            "looks like a per-request random id",
            format!(
                "if the client generates `{name}` once and resends it unchanged on every retry (an idempotency key)"
            ),
        ),
    };
    // `req.created_at` names the suspicious word; `nonce` alone needs no repeat.
    let which = if segment == name {
        String::new()
    } else {
        format!(" (`{name}`)")
    };
    format!(
        "{option} segment `{segment}` {what}{which}: it changes on every retry, {harm}\n\
         help: use business fields that are the same for every delivery of one intent ({fields})\n\
         help: {exempt}, add `allow = \"{name}\"`",
        option = role.option(),
        harm = role.harm(),
        fields = role.fields(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_time_and_per_request_names() {
        for name in [
            "timestamp",
            "ts",
            "now",
            "created_at",
            "updatedAt",
            "sent_at",
            "event_time",
            "req_ts",
            "settle_date",
            "request_id",
            "requestId",
            "trace_id",
            "nonce",
            "random_suffix",
            "x_request_id",
        ] {
            assert!(judge(name).is_some(), "{name} should be flagged");
        }
    }

    #[test]
    fn passes_names_that_only_contain_those_letters() {
        for name in [
            "candidate_id",
            "known_sku",
            "seat",
            "update_count",
            "user_id",
            "sku",
            "client_order_no",
            "order_id",
            "at",
            "status",
            "data",
            "format",
            "timeline_id",
            "snowflake",
        ] {
            assert_eq!(judge(name), None, "{name} should pass");
        }
    }
}
