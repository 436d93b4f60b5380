//! `idem outbox …`: the transactional outbox's backlog, its parked messages,
//! and a relay for a service that runs none of its own.

use std::future::Future;
use std::time::Duration;

use clap::{Subcommand, ValueEnum};
use idem_runtime::StoreError;
use idem_runtime::outbox::sink::{JetStreamSink, KafkaSink, RabbitMqSink, RedisStreamsSink, Sink};
use idem_runtime::outbox::{self, MessageState, OutboxDatabase, Relay, RelayStats};
use serde_json::json;

mod print;

use print::{print_list, print_stats};

use crate::store::{self, SqlPool};
use crate::{Cli, Failure, store_url, table};

pub const AFTER_HELP: &str = "\
The outbox is the table idem_outbox in the service's SQL database (--store a
SQLite path, postgres:// or mysql://); the store's migrations create it, and
`idem schema` prints them. Messages are pending (waiting for a relay, or
backing off after a failed publish), sent, or parked (given up after the
relay's max attempts, with the reason: `list` shows it, `retry ID` sends the
message again).
relay --to: redis://[:PASSWORD@]HOST[:PORT][/DB] (a stream per topic),
nats://[USER:PASSWORD@]HOST[:PORT] (a JetStream subject per topic; the streams
must exist), amqp://USER:PASSWORD@HOST[:PORT]/VHOST (RabbitMQ, the topic is the
queue's name on the default exchange; the queues must exist),
kafka://HOST:PORT[,HOST:PORT…] (a Kafka topic per topic, the ordering key as the
Kafka key; the idempotent producer).
Exit status: 0 done, 1 error, 2 usage, 3 (retry) no unsent message with that id.";

#[derive(Debug, Subcommand)]
pub enum OutboxCommand {
    /// Count the messages per topic: pending, parked, sent (until purged),
    /// and the age of the oldest pending one.
    Stats,
    /// List the messages in one state, oldest first.
    List {
        /// Which messages. The default, parked, is the ones that need an
        /// operator.
        #[arg(long, value_enum, default_value_t = State::Parked)]
        state: State,
        /// Show at most this many.
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Make a parked (or backing-off) message due now, its attempts reset: a
    /// running relay publishes it on its next round.
    Retry {
        /// The message id, as `list` shows it.
        id: String,
    },
    /// Delete sent messages (a relay does this itself, after its retention).
    Purge {
        /// Only those sent longer ago than this: 30s, 15m, 24h, 7d.
        #[arg(long, default_value = "24h", value_parser = parse_duration)]
        older_than: Duration,
        /// Delete at most this many (default: all of them, in batches).
        #[arg(long)]
        limit: Option<u64>,
    },
    /// Publish committed messages to a broker until Ctrl-C or SIGTERM (the
    /// round in progress is finished first).
    Relay {
        /// The broker: redis://…, nats://…, amqp://… or kafka://… (see below). Never
        /// written to a log: it may hold a password.
        #[arg(
            long,
            value_name = "URL",
            env = "IDEM_RELAY_TO",
            hide_env_values = true
        )]
        to: String,
        /// Messages claimed per round.
        #[arg(long, default_value_t = 500)]
        batch: usize,
        /// Claims of one message before it is parked.
        #[arg(long, default_value_t = 10)]
        max_attempts: u32,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum State {
    Pending,
    Parked,
    Sent,
}

impl State {
    fn message_state(self) -> MessageState {
        match self {
            State::Pending => MessageState::Pending,
            State::Parked => MessageState::Parked,
            State::Sent => MessageState::Sent,
        }
    }

    fn name(self) -> &'static str {
        match self {
            State::Pending => "pending",
            State::Parked => "parked",
            State::Sent => "sent",
        }
    }
}

/// `30s`, `15m`, `24h`, `7d` (or `500ms`); a bare `0` too.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let bad =
        || format!("{s:?} is not a duration: use a number and a unit, like 30s, 15m, 24h or 7d");
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let millis_per = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" if n == 0 => 0,
        _ => return Err(bad()),
    };
    n.checked_mul(millis_per)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{s:?} is too long"))
}

/// A duration as `--older-than` takes it: `24h`, `90s`.
fn shown_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".into();
    }
    [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1000, "s"),
    ]
    .into_iter()
    .find(|(per, _)| ms % per == 0)
    .map_or_else(
        || format!("{ms}ms"),
        |(per, unit)| format!("{}{unit}", ms / per),
    )
}

/// The relay's broker, known from `--to`'s scheme before anything connects.
#[derive(Clone, Copy)]
enum Broker {
    Redis,
    Nats,
    Amqp,
    Kafka,
}

struct SinkUrl<'a> {
    broker: Broker,
    url: &'a str,
    /// `redis (127.0.0.1:6379)`: what messages may show of the URL.
    shown: String,
}

const SINK_SCHEMES: [&str; 8] = [
    "redis", "rediss", "nats", "tls", "amqp", "amqps", "unix", "kafka",
];

fn parse_sink(url: &str) -> Result<SinkUrl<'_>, Failure> {
    let Some((scheme, rest)) = url.split_once("://") else {
        // Never quote the string back: a mistyped URL may hold a password.
        if let Some((s, _)) = url.split_once(':') {
            if SINK_SCHEMES.iter().any(|k| s.eq_ignore_ascii_case(k)) {
                let s = s.to_ascii_lowercase();
                return Err(Failure::Error(format!(
                    "malformed --to URL: `{s}:` must be followed by `//` (e.g. {s}://host); the rest is not shown, it may hold a password"
                )));
            }
        }
        return Err(Failure::Error(
            "--to must be a broker URL: redis://…, nats://…, amqp://… or kafka://… (the value is not shown, it may hold a password)".into(),
        ));
    };
    let scheme = scheme.to_ascii_lowercase();
    let broker = match scheme.as_str() {
        "redis" | "redis+unix" | "unix" => Broker::Redis,
        "nats" => Broker::Nats,
        "amqp" => Broker::Amqp,
        "kafka" => Broker::Kafka,
        "rediss" | "tls" | "amqps" => {
            return Err(Failure::Error(format!(
                "--to {scheme}:// needs TLS, which this build of idem does not have: relay to the broker on loopback or through a TLS-terminating proxy"
            )));
        }
        _ => {
            // The scheme is quoted only when it looks like one: a password
            // typed in its place must not be echoed.
            let shown = if scheme.len() <= 16
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
            {
                format!(" {scheme:?}")
            } else {
                String::new()
            };
            return Err(Failure::Error(format!(
                "unknown --to URL scheme{shown}: use redis://, nats://, amqp:// or kafka://"
            )));
        }
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let name = match broker {
        Broker::Redis => "redis",
        Broker::Nats => "nats",
        Broker::Amqp => "amqp",
        Broker::Kafka => "kafka",
    };
    Ok(SinkUrl {
        broker,
        url,
        shown: format!("{name} ({host})"),
    })
}

impl SinkUrl<'_> {
    /// A connection error as it may be printed: a client that quotes its URL
    /// back must not leak the credentials in it.
    fn failed(&self, e: impl std::fmt::Display) -> Failure {
        let mut msg = e.to_string();
        if let Some((_, rest)) = self.url.split_once("://") {
            let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
            if let Some((userinfo, _)) = authority.rsplit_once('@') {
                let password = userinfo.split_once(':').map_or("", |(_, p)| p);
                for secret in [userinfo, password] {
                    if !secret.is_empty() {
                        msg = msg.replace(secret, "…");
                    }
                }
            }
        }
        Failure::Error(format!("cannot relay to {}: {msg}", self.shown))
    }
}

/// The store's error, with a hint when the outbox table is missing.
fn failure(e: StoreError) -> Failure {
    let msg = e.to_string();
    let lower = msg.to_ascii_lowercase();
    let missing = ["no such table", "does not exist", "doesn't exist"]
        .iter()
        .any(|m| lower.contains(m));
    if lower.contains("idem_outbox") && missing {
        return Failure::Error(format!(
            "{msg}\n  no outbox table: is --store the service's database (and schema)? The store's migrations create it when the service starts (unless it skips them); `idem schema` prints the SQL"
        ));
    }
    Failure::Error(msg)
}

pub async fn run(cli: &Cli, cmd: &OutboxCommand) -> Result<(), Failure> {
    let url = store_url(cli)?;
    // A bad --to is refused before anything connects.
    let sink = match cmd {
        OutboxCommand::Relay { to, .. } => Some(parse_sink(to)?),
        _ => None,
    };
    // The relay claims, marks and refreshes its gauges on a pool of its own,
    // beside PostgreSQL's LISTEN connection.
    let connections = if sink.is_some() { 4 } else { 2 };
    match store::open_sql(url, connections).await? {
        SqlPool::Sqlite(pool) => on(cli, cmd, pool, sink).await,
        SqlPool::Postgres(pool) => on(cli, cmd, pool, sink).await,
        SqlPool::MySql(pool) => on(cli, cmd, pool, sink).await,
    }
}

async fn on<DB: OutboxDatabase>(
    cli: &Cli,
    cmd: &OutboxCommand,
    pool: sqlx::Pool<DB>,
    sink: Option<SinkUrl<'_>>,
) -> Result<(), Failure> {
    match cmd {
        OutboxCommand::Stats => {
            let backlog = outbox::backlog(&pool, true).await.map_err(failure)?;
            print_stats(cli, &backlog);
            Ok(())
        }
        OutboxCommand::List { state, limit } => {
            let listed = outbox::list(&pool, state.message_state(), *limit)
                .await
                .map_err(failure)?;
            print_list(cli, *state, *limit, &listed);
            Ok(())
        }
        OutboxCommand::Retry { id } => {
            let retried = outbox::retry(&pool, id).await.map_err(failure)?;
            if cli.json {
                println!("{}", json!({"retried": retried, "id": id}));
            } else if retried {
                println!("retried {id}: due now, attempts reset");
            }
            if retried {
                Ok(())
            } else {
                Err(Failure::NotFound(format!(
                    "no unsent message with id {id:?}: ids are exact (`idem outbox list` shows them), and a sent message is not sent again"
                )))
            }
        }
        OutboxCommand::Purge { older_than, limit } => {
            const BATCH: u64 = 10_000;
            let mut purged = 0u64;
            loop {
                let room = limit.map_or(BATCH, |m| (m - purged).min(BATCH));
                if room == 0 {
                    break;
                }
                let n = outbox::purge(&pool, *older_than, room as usize)
                    .await
                    .map_err(failure)?;
                purged += n;
                if n < room {
                    break;
                }
            }
            if cli.json {
                println!("{}", json!({"purged": purged}));
            } else {
                println!(
                    "purged {purged} messages sent more than {} ago",
                    shown_duration(*older_than)
                );
            }
            Ok(())
        }
        OutboxCommand::Relay {
            batch,
            max_attempts,
            ..
        } => {
            let sink = sink.expect("parsed above for relay");
            // The relay logs database errors and retries forever; a missing
            // table is better said once, here.
            outbox::backlog(&pool, false).await.map_err(failure)?;
            let settings = (*batch, *max_attempts);
            // Bounded: a blackholed broker must not hang the command unseen.
            let connect = Duration::from_secs(10);
            match sink.broker {
                Broker::Redis => {
                    let client = redis::Client::open(sink.url).map_err(|e| sink.failed(e))?;
                    let s = tokio::time::timeout(connect, RedisStreamsSink::connect(&client))
                        .await
                        .map_err(|e| sink.failed(e))?
                        .map_err(|e| sink.failed(e))?;
                    relay(cli, pool, s, &sink, settings).await
                }
                Broker::Nats => {
                    let client = tokio::time::timeout(connect, async_nats::connect(sink.url))
                        .await
                        .map_err(|e| sink.failed(e))?
                        .map_err(|e| sink.failed(e))?;
                    let s = JetStreamSink::new(async_nats::jetstream::new(client));
                    relay(cli, pool, s, &sink, settings).await
                }
                Broker::Kafka => {
                    // librdkafka connects lazily: a broker that does not
                    // answer fails each message after its delivery timeout,
                    // and the relay backs off and tries again.
                    let brokers = sink.url.split_once("://").map_or("", |(_, r)| r);
                    let brokers = brokers.split(['/', '?', '#']).next().unwrap_or("");
                    let s = KafkaSink::connect(brokers).map_err(|e| sink.failed(e))?;
                    relay(cli, pool, s, &sink, settings).await
                }
                Broker::Amqp => {
                    // Reconnects by itself after the broker closed the
                    // connection (a restart): the relay outlives it.
                    let s = tokio::time::timeout(connect, RabbitMqSink::connect(sink.url))
                        .await
                        .map_err(|e| sink.failed(e))?
                        .map_err(|e| sink.failed(e))?;
                    relay(cli, pool, s, &sink, settings).await
                }
            }
        }
    }
}

/// How often a running relay reports its counts (when they changed).
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

async fn relay<DB: OutboxDatabase, S: Sink + 'static>(
    cli: &Cli,
    pool: sqlx::Pool<DB>,
    sink: S,
    to: &SinkUrl<'_>,
    (batch, max_attempts): (usize, u32),
) -> Result<(), Failure> {
    // Installed before the first round, so an early signal stops the relay
    // cleanly instead of killing it.
    let stop = stop_signal()?;
    let relay = Relay::builder(pool, sink)
        .batch(batch)
        .max_attempts(max_attempts)
        .build();
    eprintln!(
        "idem: relaying the outbox to {} (batch {batch}, max attempts {max_attempts}); Ctrl-C or SIGTERM stops it",
        to.shown
    );
    let progress = async {
        let mut last = RelayStats::default();
        loop {
            tokio::time::sleep(PROGRESS_EVERY).await;
            let now = relay.stats();
            if now != last {
                // Failures are logged nowhere else: the table keeps each
                // message's last error for `list`.
                eprintln!(
                    "idem: claimed {}, published {}, failed {}, parked {} (why a publish failed: `idem outbox list --state pending` or `--state parked`)",
                    now.claimed, now.published, now.failed, now.parked
                );
                last = now;
            }
        }
    };
    tokio::select! {
        _ = relay.run_until(stop) => {}
        _ = progress => {}
    }
    let s = relay.stats();
    if cli.json {
        println!(
            "{}",
            json!({"claimed": s.claimed, "published": s.published, "failed": s.failed, "parked": s.parked})
        );
    } else {
        table(&[
            ("claimed", s.claimed.to_string()),
            ("published", s.published.to_string()),
            ("failed", s.failed.to_string()),
            ("parked", s.parked.to_string()),
        ]);
    }
    Ok(())
}

fn stop_signal() -> Result<impl Future<Output = ()>, Failure> {
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Failure::Error(format!("cannot watch for SIGTERM: {e}")))?;
    Ok(async move {
        let ctrl_c = async {
            // Without a handler Ctrl-C still ends the process; the relay must
            // not read the failure as a request to stop.
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        #[cfg(unix)]
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
        #[cfg(not(unix))]
        ctrl_c.await;
    })
}

#[cfg(test)]
mod tests {
    use super::print::iso_utc;
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for shown in ["1d", "7d", "2h", "90s", "15m", "250ms", "0s"] {
            assert_eq!(shown_duration(parse_duration(shown).unwrap()), shown);
        }
        for bad in ["", "5", "h", "1.5h", "-1s", "3w", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn utc_times() {
        assert_eq!(iso_utc(0), "1970-01-01 00:00:00");
        assert_eq!(iso_utc(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(iso_utc(1_714_564_984_999), "2024-05-01 12:03:04");
    }

    #[test]
    fn sink_urls_never_show_passwords() {
        let ok = parse_sink("redis://:s3cret@127.0.0.1:6379/2").ok().unwrap();
        assert_eq!(ok.shown, "redis (127.0.0.1:6379)");
        let f = match ok.failed("auth failed for redis://:s3cret@127.0.0.1") {
            Failure::Error(m) => m,
            Failure::NotFound(m) => m,
        };
        assert!(!f.contains("s3cret"), "{f}");
        let ok = parse_sink("nats://TOKEN123@127.0.0.1:4222").ok().unwrap();
        assert_eq!(ok.shown, "nats (127.0.0.1:4222)");
        let ok = parse_sink("kafka://10.0.0.1:9092,10.0.0.2:9092")
            .ok()
            .unwrap();
        assert!(matches!(ok.broker, Broker::Kafka));
        assert_eq!(ok.shown, "kafka (10.0.0.1:9092,10.0.0.2:9092)");
        for bad in [
            "redis:/:s3cret@h",
            "amqp:u:s3cret@h",
            "s3cret",
            "ftp://s3cret@h",
            "s3cret:pw@h://x",
        ] {
            let Err(Failure::Error(m)) = parse_sink(bad) else {
                panic!("{bad} accepted");
            };
            assert!(!m.contains("s3cret"), "{bad}: {m}");
        }
    }
}
