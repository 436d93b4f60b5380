//! The relay: claims committed messages in batches, publishes them through a
//! sink, marks what the broker confirmed, backs off and parks the rest.
//!
//! A claim is a lease (`next_attempt_at` moved past the lease, the batch's
//! random token written), taken in a short transaction of its own, so no
//! database transaction stays open while the broker answers. A relay that
//! dies after claiming leaves its batch to the next relay once the lease runs
//! out: those messages are published again (at least once), and every claim
//! counts an attempt, so a message that takes its relay down every time is
//! parked after `max_attempts` like one the broker keeps refusing.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::RngCore;

use super::admin;
use super::dialect::{Claimed, Dialect, OutboxDatabase};
use super::sink::Sink;
use super::{MessageId, Outgoing};
use crate::error::StoreError;

/// Counts since the relay was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Messages claimed (each claim of a message once).
    pub claimed: u64,
    /// Messages the broker confirmed and the relay marked sent.
    pub published: u64,
    /// Publishes that failed (each is retried after a backoff).
    pub failed: u64,
    /// Messages parked after `max_attempts`.
    pub parked: u64,
}

#[derive(Default)]
struct Counters {
    claimed: AtomicU64,
    published: AtomicU64,
    failed: AtomicU64,
    parked: AtomicU64,
}

/// What one round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Round {
    /// Messages claimed.
    pub claimed: usize,
    /// Confirmed by the broker and marked sent.
    pub published: usize,
    /// Failed, due again after a backoff.
    pub failed: usize,
    /// Parked.
    pub parked: usize,
}

struct Settings {
    batch: i64,
    lease: Duration,
    max_attempts: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    poll: Duration,
    stats_every: Duration,
    retention: Duration,
    purge_every: Duration,
}

/// Settings of a [`Relay`].
pub struct RelayBuilder<DB: OutboxDatabase> {
    pool: sqlx::Pool<DB>,
    sink: Arc<dyn Sink>,
    s: Settings,
}

impl<DB: OutboxDatabase> RelayBuilder<DB> {
    /// Messages claimed per round (default 500).
    pub fn batch(mut self, n: usize) -> Self {
        self.s.batch = n.clamp(1, 10_000) as i64;
        self
    }

    /// How long a claim keeps other relays off a batch (default 30 s): longer
    /// than the broker ever takes to confirm a batch. A relay that dies
    /// leaves its batch to others after this.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.s.lease = lease.max(Duration::from_millis(100));
        self
    }

    /// Claims of one message before it is parked (default 10).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.s.max_attempts = n.max(1);
        self
    }

    /// The backoff after the first failure, doubled after each one up to
    /// `max` (defaults 1 s and 5 min).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.s.first_backoff = first;
        self.s.max_backoff = max.max(first);
        self
    }

    /// How often an idle relay looks for due messages (default 100 ms; 1 s
    /// on PostgreSQL, where a commit wakes it at once).
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.s.poll = every;
        self
    }

    /// How often the backlog gauges are refreshed (default 5 s).
    pub fn stats_interval(mut self, every: Duration) -> Self {
        self.s.stats_every = every;
        self
    }

    /// Sent messages are deleted this long after they were sent (default
    /// 24 h), looked for every `every` (default 1 min).
    pub fn retention(mut self, keep: Duration, every: Duration) -> Self {
        self.s.retention = keep;
        self.s.purge_every = every;
        self
    }

    /// The relay.
    pub fn build(self) -> Relay<DB> {
        Relay {
            pool: self.pool,
            sink: self.sink,
            s: self.s,
            counters: Arc::default(),
        }
    }
}

/// Publishes committed outbox messages (see the [module documentation](super)).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::outbox::{Relay, sink::RedisStreamsSink};
/// # async fn go(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let redis = redis::Client::open("redis://127.0.0.1:6379")?;
/// let sink = RedisStreamsSink::connect(&redis).await?;
/// let relay = Relay::builder(pool, sink).batch(500).max_attempts(10).build();
/// tokio::spawn(async move { relay.run().await });
/// # Ok(()) }
/// ```
pub struct Relay<DB: OutboxDatabase> {
    pool: sqlx::Pool<DB>,
    sink: Arc<dyn Sink>,
    s: Settings,
    counters: Arc<Counters>,
}

fn store_error<DB: Dialect>(e: sqlx::Error) -> StoreError {
    StoreError::new(DB::BACKEND, "outbox", e)
}

impl<DB: OutboxDatabase> Relay<DB> {
    /// A relay from the outbox's database to `sink`. The tables come from the
    /// store's migrations (open the SQL store once, or apply `idem schema`).
    pub fn builder(pool: sqlx::Pool<DB>, sink: impl Sink + 'static) -> RelayBuilder<DB> {
        let listens = DB::BACKEND == "postgres";
        RelayBuilder {
            pool,
            sink: Arc::new(sink),
            s: Settings {
                batch: 500,
                lease: Duration::from_secs(30),
                max_attempts: 10,
                first_backoff: Duration::from_secs(1),
                max_backoff: Duration::from_secs(300),
                poll: if listens {
                    Duration::from_secs(1)
                } else {
                    Duration::from_millis(100)
                },
                stats_every: Duration::from_secs(5),
                retention: Duration::from_secs(24 * 3600),
                purge_every: Duration::from_secs(60),
            },
        }
    }

    /// Counts since the relay was built.
    pub fn stats(&self) -> RelayStats {
        let c = &self.counters;
        RelayStats {
            claimed: c.claimed.load(Ordering::Relaxed),
            published: c.published.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            parked: c.parked.load(Ordering::Relaxed),
        }
    }

    fn backoff_for(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.s
            .first_backoff
            .saturating_mul(1u32 << doublings)
            .min(self.s.max_backoff)
    }

    /// Claims one batch, publishes it and marks what the broker confirmed.
    /// `Err` only when the database failed; a broker's failures are counted
    /// and retried later.
    pub async fn run_once(&self) -> Result<Round, StoreError> {
        let mut token = [0u8; 16];
        rand::rng().fill_bytes(&mut token);
        let lease_ms = self.s.lease.as_millis() as i64;
        let mut claimed = DB::claim(&self.pool, &token, self.s.batch, lease_ms)
            .await
            .map_err(store_error::<DB>)?;
        claimed.sort_by_key(|c| c.seq);
        let mut round = Round {
            claimed: claimed.len(),
            ..Round::default()
        };
        self.counters
            .claimed
            .fetch_add(claimed.len() as u64, Ordering::Relaxed);
        if claimed.is_empty() {
            return Ok(round);
        }
        let (worn_out, mut to_send): (Vec<Claimed>, Vec<Claimed>) = claimed
            .into_iter()
            .partition(|c| c.attempts > i64::from(self.s.max_attempts));
        // Failures are marked in groups that share a reason, a backoff and a
        // verdict: one statement for a batch the broker refused whole.
        let mut failures: BTreeMap<(String, Duration, bool), Vec<&Claimed>> = BTreeMap::new();
        for c in &worn_out {
            let reason = format!(
                "claimed {} times without a broker confirmation: the relays holding it died or hung \
                 (max_attempts {})",
                c.attempts - 1,
                self.s.max_attempts
            );
            failures
                .entry((reason, self.backoff_for(c.attempts.max(1) as u32), true))
                .or_default()
                .push(c);
        }
        // The payloads move to the sink: the claimed rows keep what marking needs.
        let outgoing: Vec<Outgoing> = to_send.iter_mut().map(outgoing).collect();
        let budget = self.s.lease.mul_f64(0.8);
        let results = if outgoing.is_empty() {
            Vec::new()
        } else {
            // Past the lease another relay may publish the batch too; giving
            // up before it keeps that rare (and a late confirmation is then a
            // retry). No answer in time counts as a failure for every message.
            tokio::time::timeout(budget, self.sink.publish(&outgoing))
                .await
                .unwrap_or_default()
        };
        // Sent rows by topic: each topic is marked by its own statement, so
        // its count is the rows this relay marked, even when another relay
        // took some of them back in the meantime.
        let mut sent: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for (i, c) in to_send.iter().enumerate() {
            match results.get(i) {
                Some(Ok(())) => sent.entry(c.topic.as_str()).or_default().push(c.seq),
                failure => {
                    let reason = match failure {
                        Some(Err(e)) => e.to_string(),
                        _ => format!("{}: no confirmation within {budget:?}", self.sink.name()),
                    };
                    let attempt = c.attempts.max(1) as u32;
                    let park = attempt >= self.s.max_attempts;
                    tracing::warn!(id = %c.id, topic = %c.topic, attempt, park, %reason, "outbox: publish failed");
                    failures
                        .entry((reason, self.backoff_for(attempt), park))
                        .or_default()
                        .push(c);
                }
            }
        }
        for ((reason, retry_in, park), group) in &failures {
            self.fail(&token, group, reason, *retry_in, *park).await?;
            if *park {
                round.parked += group.len();
            } else {
                round.failed += group.len();
            }
        }
        for (topic, seqs) in sent {
            // Fewer rows than confirmed: this relay's lease ran out while the
            // broker answered and another relay has those messages now (they
            // are published again, and counted there).
            let marked = DB::mark_sent(&self.pool, &token, &seqs)
                .await
                .map_err(store_error::<DB>)?;
            round.published += marked as usize;
            self.counters.published.fetch_add(marked, Ordering::Relaxed);
            metrics::counter!("idem_outbox_published_total", "topic" => topic.to_owned())
                .increment(marked);
        }
        Ok(round)
    }

    async fn fail(
        &self,
        token: &[u8],
        group: &[&Claimed],
        reason: &str,
        retry_in: Duration,
        park: bool,
    ) -> Result<(), StoreError> {
        let seqs: Vec<i64> = group.iter().map(|c| c.seq).collect();
        DB::mark_failed(
            &self.pool,
            token,
            &seqs,
            reason,
            retry_in.as_millis() as i64,
            park,
        )
        .await
        .map_err(store_error::<DB>)?;
        let counter = if park {
            &self.counters.parked
        } else {
            &self.counters.failed
        };
        counter.fetch_add(group.len() as u64, Ordering::Relaxed);
        let name = if park {
            "idem_outbox_parked_total"
        } else {
            "idem_outbox_failed_total"
        };
        for c in group {
            if park {
                tracing::error!(id = %c.id, topic = %c.topic, %reason, "outbox: message parked");
            }
            metrics::counter!(name, "topic" => c.topic.clone()).increment(1);
        }
        Ok(())
    }

    /// Relays until the process ends: rounds back to back while there is
    /// work, then waits for a commit (PostgreSQL's LISTEN) or the poll
    /// interval. Database errors are logged and retried after a pause; they
    /// never end the loop.
    pub async fn run(&self) {
        self.run_until(std::future::pending::<()>()).await
    }

    /// [`Relay::run`] until `shutdown` completes (a round in progress is
    /// finished first, so nothing is left claimed).
    pub async fn run_until<F: Future>(&self, shutdown: F) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut wakeup = DB::listen(&self.pool).await;
        let mut gauges = Gauges::default();
        let mut next_stats = Instant::now();
        let mut next_purge = Instant::now() + self.s.purge_every;
        let mut pause = Duration::from_millis(100);
        loop {
            let worked = match self.run_once().await {
                Ok(round) => {
                    pause = Duration::from_millis(100);
                    round.claimed > 0
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?pause, "outbox relay: the database failed");
                    let slept = tokio::select! {
                        _ = tokio::time::sleep(pause) => true,
                        _ = &mut shutdown => false,
                    };
                    pause = (pause * 2).min(Duration::from_secs(5));
                    if !slept {
                        return;
                    }
                    continue;
                }
            };
            let now = Instant::now();
            if now >= next_stats {
                next_stats = now + self.s.stats_every;
                if let Err(e) = gauges.refresh(&self.pool).await {
                    tracing::debug!(error = %e, "outbox relay: backlog not read");
                }
            }
            if now >= next_purge {
                next_purge = now + self.s.purge_every;
                match admin::purge(&self.pool, self.s.retention, 10_000).await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(purged = n, "outbox relay: purged sent messages"),
                    Err(e) => tracing::warn!(error = %e, "outbox relay: purge failed"),
                }
            }
            if worked {
                // More may be due at once (the next of an ordering key).
                if futures_util::FutureExt::now_or_never(&mut shutdown).is_some() {
                    return;
                }
                continue;
            }
            if let Some(w) = wakeup.as_mut() {
                w.arm(self.s.poll).await;
                // One more look: a commit between the last round and `arm`
                // did not notify.
                if matches!(self.run_once().await, Ok(r) if r.claimed > 0) {
                    continue;
                }
            }
            let idle = async {
                match wakeup.as_mut() {
                    Some(w) => {
                        tokio::select! {
                            _ = w.wait() => {}
                            _ = tokio::time::sleep(self.s.poll) => {}
                        }
                    }
                    None => tokio::time::sleep(self.s.poll).await,
                }
            };
            tokio::select! {
                _ = idle => {}
                _ = &mut shutdown => return,
            }
        }
    }
}

fn outgoing(c: &mut Claimed) -> Outgoing {
    let headers = c
        .headers
        .as_deref()
        .and_then(|h| serde_json::from_str(h).ok())
        .unwrap_or_default();
    Outgoing {
        id: MessageId::new(c.id.clone()),
        topic: c.topic.clone(),
        ordering_key: c.ordering_key.clone(),
        headers,
        payload: std::mem::take(&mut c.payload),
        attempt: c.attempts.max(1) as u32,
    }
}

/// The backlog gauges, zeroed for topics that emptied.
#[derive(Default)]
struct Gauges {
    topics: BTreeSet<String>,
}

impl Gauges {
    async fn refresh<DB: OutboxDatabase>(
        &mut self,
        pool: &sqlx::Pool<DB>,
    ) -> Result<(), StoreError> {
        let backlog = admin::backlog(pool, false).await?;
        let mut seen = BTreeSet::new();
        for b in backlog {
            metrics::gauge!("idem_outbox_backlog", "topic" => b.topic.clone())
                .set(b.pending as f64);
            metrics::gauge!("idem_outbox_parked", "topic" => b.topic.clone()).set(b.parked as f64);
            metrics::gauge!("idem_outbox_oldest_age_seconds", "topic" => b.topic.clone())
                .set(b.oldest_pending_ms as f64 / 1000.0);
            seen.insert(b.topic);
        }
        for gone in self.topics.difference(&seen) {
            metrics::gauge!("idem_outbox_backlog", "topic" => gone.clone()).set(0.0);
            metrics::gauge!("idem_outbox_parked", "topic" => gone.clone()).set(0.0);
            metrics::gauge!("idem_outbox_oldest_age_seconds", "topic" => gone.clone()).set(0.0);
        }
        self.topics = seen;
        Ok(())
    }
}
