//! What every bench in this package reads the same way: its knobs from the
//! environment, the machine's load, a median. Included by each bench with
//! `#[path]` (bench targets share no library).

#![allow(dead_code)] // each bench uses what it needs

use std::str::FromStr;

/// The knob `name`, parsed, or `default` when unset or unparsable.
pub fn env<T: FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The text knob `name` (a URL), or `default`.
pub fn url(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The comma-separated knob `name`, or `default`'s items.
pub fn list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// `/proc/loadavg`, printed at a run's start and end: ratios from a loaded
/// machine read differently.
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The middle value (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
