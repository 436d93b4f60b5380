//! Rejects key segments whose names say "time of the request", "random per
//! request" or "counts the retries" (`created_at`, `timestamp`, `request_id`,
//! `nonce`, `retry_count`, `delivery_attempt`, …): such a key is different on
//! every retry or redelivery and never deduplicates.
//!
//! Names are split into words (`created_at` → created, at; `createdAt` →
//! created, at) and judged word by word, so `candidate_id`, `known_sku`, `seat`
//! and `update_count` — which merely contain `date`, `now`, `at` or `update` —
//! pass, and so do `delivery_address`, `attempted_sku` and `retry_policy_id`.

use super::Role;

/// What a suspicious name looks like, for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Suspicion {
    Time,
    PerRequest,
    /// A retry or delivery counter, or a redelivery flag.
    PerAttempt,
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
const PER_REQUEST_ID_WORDS: &[&str] =
    &["request", "req", "trace", "span", "correlation", "attempt"];

// Words that only a count of retries or deliveries, or a flag set on a
// redelivery, is named with: `retries`, `num_attempts`, `redelivered`.
const PER_ATTEMPT_WORDS: &[&str] = &[
    "retries",
    "retried",
    "attempts",
    "tries",
    "redelivered",
    "redelivery",
    "redeliveries",
    "deliveries",
    "requeued",
];
// A last word that names the attempt itself: `attempt`, `is_retry`,
// `delivery_attempt`. Elsewhere it qualifies (`retry_policy_id`).
const PER_ATTEMPT_LAST_WORDS: &[&str] = &["retry", "attempt"];
// `<event>` with a counting word anywhere in the name: `retry_count`,
// `attempt_no`, `num_delivered`. `delivery` counts only with an unambiguous
// word: `delivery_no` is a delivery note's number, a business id.
const COUNTED_EVENTS: &[(&str, &[&str])] = &[
    ("retry", COUNT_WORDS),
    ("attempt", COUNT_WORDS),
    ("try", COUNT_WORDS),
    ("delivery", &["count", "counter", "cnt", "times"]),
    ("delivered", &["count", "counter", "cnt", "times", "num"]),
    ("receive", &["count", "counter", "cnt", "times"]),
];
const COUNT_WORDS: &[&str] = &[
    "count", "counter", "cnt", "num", "number", "no", "nr", "n", "idx", "index", "seq", "times",
];
// A limit or a policy is configuration, the same on every retry: `max_retries`,
// `retry_policy_id`, `retry_backoff`.
const CONFIG_WORDS: &[&str] = &[
    "max", "min", "limit", "policy", "budget", "backoff", "delay", "interval", "timeout",
    "strategy", "config", "allowed",
];

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

/// Whether the name of the value that goes into the key (the last name of a
/// segment) says it counts retries or deliveries. Only the last name: a
/// parameter `attempt: LoginAttempt` reached through `attempt.user_id` is not
/// itself keyed.
pub(crate) fn judge_leaf(name: &str) -> Option<Suspicion> {
    let words = words(name);
    let last = words.last()?;
    let has = |set: &[&str]| words.iter().any(|w| set.contains(&w.as_str()));
    if has(CONFIG_WORDS) {
        return None;
    }
    let counted = COUNTED_EVENTS
        .iter()
        .any(|(event, counts)| words.iter().any(|w| w == event) && has(counts));
    if has(PER_ATTEMPT_WORDS) || PER_ATTEMPT_LAST_WORDS.contains(&last.as_str()) || counted {
        return Some(Suspicion::PerAttempt);
    }
    None
}

/// What a suspicious name looks like, when it may be exempted, and what the
/// value does on a retry: the wording every message about a name shares.
fn describe(name: &str, suspicion: Suspicion) -> (&'static str, String, &'static str) {
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
        Suspicion::PerAttempt => (
            "looks like it counts or flags retries or deliveries",
            format!(
                "if `{name}` really is fixed per intent (set once by the client, never raised by a retry or a redelivery)"
            ),
        ),
    };
    let changes = match suspicion {
        Suspicion::PerAttempt => "it changes with every retry or redelivery",
        Suspicion::Time | Suspicion::PerRequest => "it changes on every retry",
    };
    (what, exempt, changes)
}

/// The judgement on a name that is itself the keyed value (a field of a
/// `#[derive(KeyPart)]` type, the last name of a segment).
pub(crate) fn judge_value_name(name: &str) -> Option<Suspicion> {
    judge(name).or_else(|| judge_leaf(name))
}

pub(crate) fn message(role: Role, segment: &str, name: &str, suspicion: Suspicion) -> String {
    let (what, exempt, changes) = describe(name, suspicion);
    // `req.created_at` names the suspicious word; `nonce` alone needs no repeat.
    let which = if segment == name {
        String::new()
    } else {
        format!(" (`{name}`)")
    };
    format!(
        "{option} segment `{segment}` {what}{which}: {changes}, {harm}\n\
         help: use business fields that are the same for every delivery of one intent ({fields})\n\
         help: {exempt}, add `allow = \"{name}\"`",
        option = role.option(),
        harm = role.harm(),
        fields = role.fields(),
    )
}

/// The same judgement on a field of a `#[derive(KeyPart)]` type: every field
/// goes into the key of any call keyed on the type.
pub(crate) fn field_message(ty: &str, field: &str, suspicion: Suspicion) -> String {
    let (what, exempt, changes) = describe(field, suspicion);
    format!(
        "field `{field}` of `{ty}` {what}: `#[derive(KeyPart)]` puts every field into the key, and {changes}, {harm}\n\
         help: derive `KeyPart` on a type holding only business fields that are the same for every delivery of one intent ({fields}), or implement `KeyPart` by hand over those fields\n\
         help: {exempt}, mark the field `#[key_part(allow)]`",
        harm = Role::Key.harm(),
        fields = Role::Key.fields(),
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

    #[test]
    fn flags_retry_and_delivery_counters() {
        for name in [
            "retry",
            "retries",
            "retry_count",
            "retryCount",
            "num_retries",
            "numRetries",
            "n_retries",
            "retries_left",
            "is_retry",
            "attempt",
            "attempts",
            "attempt_no",
            "attempt_number",
            "attemptNo",
            "delivery_attempt",
            "deliveryAttempt",
            "delivery_count",
            "deliveries",
            "redelivered",
            "is_redelivery",
            "redelivery_count",
            "try_count",
            "tries",
            "num_delivered",
            "times_delivered",
            "approximate_receive_count",
        ] {
            assert_eq!(
                judge_leaf(name),
                Some(Suspicion::PerAttempt),
                "{name} should be flagged"
            );
        }
        assert_eq!(judge("attempt_id"), Some(Suspicion::PerRequest));
    }

    #[test]
    fn passes_names_that_mention_retries_without_counting_them() {
        for name in [
            "update_count",
            "candidate_id",
            "known_sku",
            "seat",
            "delivery",
            "delivery_address",
            "delivery_no",
            "delivery_number",
            "delivery_id",
            "attempted_sku",
            "retry_policy_id",
            "max_retries",
            "max_attempts",
            "retry_backoff",
            "entry_count",
            "country",
            "item_count",
            "order_no",
        ] {
            assert_eq!(judge_leaf(name), None, "{name} should pass");
            assert_eq!(judge(name), None, "{name} should pass");
        }
    }
}
