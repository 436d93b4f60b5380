//! What every bench in this package reads the same way: its knobs from the
//! environment, the machine's load, a median. Included by each bench with
//! `#[path]` (bench targets share no library).

#![allow(dead_code)] // each bench uses what it needs

use std::str::FromStr;
use std::time::Duration;

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

/// User + system CPU of this whole process.
pub fn process_cpu() -> Duration {
    // SAFETY: an all-zero rusage is a valid value to be overwritten.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is valid and writable.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "getrusage");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// User + system CPU used so far by every process whose name is `name`
/// (a database server's backends and helpers), from /proc. Linux counts it
/// in USER_HZ ticks, 100 a second on every mainstream build: over a cell of
/// seconds the 10 ms grain stays under 1 %. A process that exits between
/// two readings takes its CPU with it, so read around work whose
/// connections stay open.
pub fn cpu_of_processes(name: &str) -> Duration {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Duration::ZERO;
    };
    let ticks: u64 = dir
        .flatten()
        .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
        .filter_map(|stat| {
            let comm = &stat[stat.find('(')? + 1..stat.rfind(')')?];
            if comm != name {
                return None;
            }
            let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .sum();
    Duration::from_millis(ticks * 10)
}
