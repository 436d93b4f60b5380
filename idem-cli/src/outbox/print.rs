//! How `idem outbox stats` and `list` print: a table, or one JSON object.

use idem_runtime::outbox::{Backlog, ListedMessage};
use serde_json::{Map, Value, json};

use super::State;
use crate::{Cli, now_millis, span};

pub fn print_stats(cli: &Cli, backlog: &[Backlog]) {
    let pending: u64 = backlog.iter().map(|b| b.pending).sum();
    let parked: u64 = backlog.iter().map(|b| b.parked).sum();
    let sent: u64 = backlog.iter().map(|b| b.sent).sum();
    let oldest = backlog
        .iter()
        .map(|b| b.oldest_pending_ms)
        .max()
        .unwrap_or(0);
    if cli.json {
        let topics: Map<String, Value> = backlog
            .iter()
            .map(|b| {
                (
                    b.topic.clone(),
                    json!({
                        "pending": b.pending,
                        "parked": b.parked,
                        "sent": b.sent,
                        "oldest_pending_ms": b.oldest_pending_ms,
                    }),
                )
            })
            .collect();
        println!(
            "{}",
            json!({
                "pending": pending,
                "parked": parked,
                "sent": sent,
                "oldest_pending_ms": oldest,
                "topics": topics,
            })
        );
        return;
    }
    if backlog.is_empty() {
        println!("the outbox is empty");
        return;
    }
    let age = |b: &Backlog| {
        if b.pending == 0 {
            "-".to_owned()
        } else {
            span(b.oldest_pending_ms / 1000)
        }
    };
    let mut rows: Vec<Vec<String>> = backlog
        .iter()
        .map(|b| {
            vec![
                b.topic.clone(),
                b.pending.to_string(),
                b.parked.to_string(),
                b.sent.to_string(),
                age(b),
            ]
        })
        .collect();
    if backlog.len() > 1 {
        rows.push(vec![
            "(all)".into(),
            pending.to_string(),
            parked.to_string(),
            sent.to_string(),
            if pending == 0 {
                "-".into()
            } else {
                span(oldest / 1000)
            },
        ]);
    }
    columns(
        &["topic", "pending", "parked", "sent", "oldest pending"],
        &[false, true, true, true, false],
        &rows,
    );
    if parked > 0 {
        println!(
            "\nparked messages wait for an operator: `idem outbox list` shows them, `idem outbox retry ID` sends one again"
        );
    }
}

pub fn print_list(cli: &Cli, state: State, limit: usize, listed: &[ListedMessage]) {
    if cli.json {
        let messages: Vec<Value> = listed
            .iter()
            .map(|m| {
                json!({
                    "seq": m.seq,
                    "id": m.id,
                    "topic": m.topic,
                    "ordering_key": m.ordering_key,
                    "attempts": m.attempts,
                    "created_at_ms": m.created_at,
                    "last_error": m.last_error,
                    "payload_bytes": m.payload_bytes,
                })
            })
            .collect();
        println!("{}", json!({"state": state.name(), "messages": messages}));
        return;
    }
    if listed.is_empty() {
        println!("no {} messages", state.name());
        return;
    }
    let now = now_millis();
    let rows: Vec<Vec<String>> = listed
        .iter()
        .map(|m| {
            vec![
                m.seq.to_string(),
                m.id.clone(),
                m.topic.clone(),
                m.ordering_key.clone().unwrap_or_else(|| "-".into()),
                m.attempts.to_string(),
                format!(
                    "{} ({} ago)",
                    iso_utc(m.created_at),
                    span((now - m.created_at).max(0) as u64 / 1000)
                ),
                m.payload_bytes.to_string(),
                m.last_error.as_deref().map_or_else(|| "-".into(), one_line),
            ]
        })
        .collect();
    columns(
        &[
            "seq",
            "id",
            "topic",
            "ordering key",
            "attempts",
            "created (UTC)",
            "bytes",
            "last error",
        ],
        &[true, false, false, false, true, false, true, false],
        &rows,
    );
    if listed.len() == limit {
        eprintln!("idem: the first {limit} shown; --limit shows more");
    }
}

/// A last error fit for one table cell (`--json` has it whole).
fn one_line(s: &str) -> String {
    let flat: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > 100 {
        flat.chars().take(100).collect::<String>() + "…"
    } else {
        flat
    }
}

/// `2024-05-01 12:03:04` (UTC) from milliseconds since the epoch.
pub(super) fn iso_utc(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// A table with a header row; `right` aligns the numeric columns.
fn columns(header: &[&str], right: &[bool], rows: &[Vec<String>]) {
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| {
        let last = cells.len() - 1;
        let text: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| match (right[i], i == last) {
                (true, _) => format!("{c:>w$}", w = widths[i]),
                (false, true) => c.to_string(),
                (false, false) => format!("{c:<w$}", w = widths[i]),
            })
            .collect();
        println!("{}", text.join("  "));
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}
