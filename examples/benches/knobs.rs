//! What every bench in this package reads the same way: its knobs from the
//! environment, the machine's load, a median. Included by each bench with
//! `#[path]` (bench targets share no library).

#![allow(dead_code)] // each bench uses what it needs

use std::collections::HashMap;
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

/// The name and the user + system CPU clock ticks so far of process `pid`
/// (`"self"` for this one), from `/proc/<pid>/stat`.
fn stat_of(pid: &str) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name sits between the first '(' and the last ')': it may hold
    // either.
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some((stat[open + 1..close].to_owned(), ticks))
}

/// Clock ticks as time, at the kernel's rate (`sysconf(_SC_CLK_TCK)`): a
/// measurement runs for seconds, so the 10 ms grain of the usual 100 a
/// second stays under 1 %.
fn ticks(n: u64) -> Option<Duration> {
    // SAFETY: sysconf only reads a configuration value.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let per_second = u64::try_from(per_second).ok().filter(|&t| t > 0)?;
    Some(Duration::from_nanos(n * 1_000_000_000 / per_second))
}

/// User + system CPU process `pid` (`"self"` for this one) has used so far.
pub fn cpu_of(pid: &str) -> Option<Duration> {
    ticks(stat_of(pid)?.1)
}

/// User + system CPU so far of each process whose name is `name` (a
/// database server's backends and helpers), in clock ticks by pid; `None`
/// where there is no /proc.
pub fn cpu_by_process(name: &str) -> Option<HashMap<u32, u64>> {
    let by_pid = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.to_owned();
            let (comm, ticks) = stat_of(&pid)?;
            (comm == name).then_some((pid.parse().ok()?, ticks))
        })
        .collect();
    Some(by_pid)
}

/// The CPU the processes named `name` used since `before` (from
/// [`cpu_by_process`]), each by its own advance: one started meanwhile
/// counts from zero; one that exited meanwhile is missing, with only its
/// share inside the window, so read around work whose connections stay open.
pub fn cpu_since(name: &str, before: &HashMap<u32, u64>) -> Option<Duration> {
    let advance: u64 = cpu_by_process(name)?
        .into_iter()
        .map(|(pid, now)| now.saturating_sub(before.get(&pid).copied().unwrap_or(0)))
        .sum();
    ticks(advance)
}

/// The lowest and highest of per-round ratios: a cell's spread.
pub fn spread(ratios: &[f64]) -> (f64, f64) {
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}
