//! Wall-clock time for leases and expiry, injectable so tests can jump a day.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in milliseconds since the Unix epoch.
///
/// Records outlive processes, so leases and expiry are absolute wall-clock
/// instants, not `Instant`s.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_millis(&self) -> i64;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_millis(&self) -> i64 {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
    }
}

/// A clock that moves only when told to: tests cover a 24-hour replay or a
/// lease expiry without sleeping.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::{Clock, ManualClock};
///
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_secs(86_400));
/// assert_eq!(clock.now_millis(), 1_000 + 86_400_000);
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<AtomicI64>,
}

impl ManualClock {
    /// A clock standing at `start_millis`.
    pub fn new(start_millis: i64) -> Self {
        ManualClock {
            now: Arc::new(AtomicI64::new(start_millis)),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.now.fetch_add(duration_millis(by), Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    /// Starts at the current system time, so records look plausible.
    fn default() -> Self {
        ManualClock::new(SystemClock.now_millis())
    }
}

impl Clock for ManualClock {
    fn now_millis(&self) -> i64 {
        self.now.load(Ordering::SeqCst)
    }
}

/// A duration in whole milliseconds, saturating instead of wrapping.
pub(crate) fn duration_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
