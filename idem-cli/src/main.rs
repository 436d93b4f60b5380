//! `idem`: the operator's tool for idempotency records.
//!
//! ```text
//! idem --store idem.db inspect --scope orders.create --part u64:734211 --part str:A-1
//! idem --store postgres://ops@db/orders recover --hash 72f5f0af…
//! idem --store postgres://ops@db/orders --json stats
//! idem schema --dialect postgres > idem.sql
//! idem --store postgres://ops@db/orders outbox stats
//! idem --store postgres://ops@db/orders outbox list --state parked
//! idem --store postgres://ops@db/orders outbox retry order-7-created
//! idem --store orders.db outbox relay --to redis://127.0.0.1:6379
//! ```
//!
//! Exit status: 0 done, 1 an error (a bad store or broker URL, an unreachable
//! store, a bad part or key secret), 2 a usage error, 3 no record under that
//! key (`outbox retry`: no unsent message with that id).

mod outbox;
mod parts;
mod store;

use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::{Args, Parser, Subcommand};
use idem_runtime::store::{
    RecordInfo, RecordState, RecordStats, RecoveryInfo, Store as _, StoredOutcome,
};
use idem_runtime::{Key, KeySecret};
use serde_json::{Value, json};

/// Inspect, evict, purge and count idem's records; print its schema; watch,
/// retry and relay its outbox.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, after_help = AFTER_HELP)]
struct Cli {
    /// The store: a SQLite file path (or sqlite:PATH), postgres://…,
    /// mysql://…, or redis://…. Never written to a log: it may hold a password.
    #[arg(long, env = "IDEM_STORE", global = true, hide_env_values = true)]
    store: Option<String>,

    /// Print JSON (one object) instead of a table.
    #[arg(long, global = true)]
    json: bool,

    /// The Redis store's key prefix, as the service configured it.
    #[arg(
        long,
        env = "IDEM_REDIS_PREFIX",
        default_value = "idem:",
        global = true
    )]
    redis_prefix: String,

    /// The environment variable holding the key secret (hex), as the service
    /// reads it with `KeySecret::from_env`. Unset: keys are plain SHA-256.
    #[arg(long, default_value = "IDEM_KEY_SECRET", global = true)]
    key_secret_env: String,

    #[command(subcommand)]
    command: Command,
}

const AFTER_HELP: &str = "\
Key parts are TYPE:VALUE, one --part per key segment, in the order of the
attribute's `key = \"…\"`, with the Rust type of each field: the hash covers the
type, so str:42 and u64:42 are different keys. Types: u8 u16 u32 u64 u128 usize
i8 i16 i32 i64 i128 isize bool char str bytes(hex) none some:TYPE:VALUE.
A consumer's key has the event type first: --part str:SETTLE --part u64:…
`idem outbox --help`: the transactional outbox's commands.
Exit status: 0 done, 1 error, 2 usage, 3 no record under that key (or, for
`outbox retry`, no unsent message with that id).";

#[derive(Debug, Subcommand)]
enum Command {
    /// Show the record under a key.
    Inspect(KeyArgs),
    /// End the record under a key so the next call runs the body again. A
    /// DONE record is released; a PROCESSING one under a live lease (a body
    /// may be running) needs --force. Fences keep growing either way.
    Evict {
        #[command(flatten)]
        key: KeyArgs,
        /// Also end a PROCESSING record whose lease is live: its owner, if
        /// still running, can no longer complete, and the next call takes
        /// over with a higher fence. Whatever the owner already did outside
        /// the record (a charge, a message) is not undone.
        #[arg(long)]
        force: bool,
    },
    /// Let the recovery worker try a recoverable call again
    /// (`#[idempotent(…, recover)]`): clears its parking, its count of
    /// recoveries and its backoff. The worker takes it up once its lease has
    /// run out. Exit status 3 when there is no PROCESSING record with stored
    /// arguments under the key.
    Recover(KeyArgs),
    /// Delete expired and released records.
    Purge {
        /// Delete at most this many (default: all of them, in batches).
        #[arg(long)]
        max: Option<u64>,
        /// Records per statement (or per SCAN page batch on Redis).
        #[arg(long, default_value_t = 1000)]
        batch: usize,
    },
    /// Count the records by state.
    Stats,
    /// Print the SQL a DBA applies when the service account may not run DDL
    /// (then build the store with `.skip_migrations()`).
    Schema {
        /// sqlite, postgres or mysql; default: the dialect of --store.
        #[arg(long)]
        dialect: Option<String>,
    },
    /// Print the hash of a key (no store needed).
    Key(KeyArgs),
    /// The transactional outbox (a SQL store's idem_outbox table): count,
    /// list, retry and purge its messages, or relay them to a broker.
    #[command(subcommand, after_help = outbox::AFTER_HELP)]
    Outbox(outbox::OutboxCommand),
}

#[derive(Debug, Args)]
struct KeyArgs {
    /// The attribute's `scope`.
    #[arg(long, required_unless_present = "hash")]
    scope: Option<String>,
    /// One key segment as TYPE:VALUE (repeat, in order).
    #[arg(long = "part", value_name = "TYPE:VALUE", conflicts_with = "hash")]
    parts: Vec<String>,
    /// The key's 64-hex hash, as logs and `current_key()` show it.
    #[arg(long, value_name = "HEX")]
    hash: Option<String>,
}

/// What went wrong, and the exit status it means.
enum Failure {
    Error(String),
    NotFound(String),
}

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Self {
        let msg = e.to_string();
        if msg.contains("idem_records") {
            // The table is missing: the wrong database or schema, or one
            // never migrated.
            return Failure::Error(format!(
                "{msg}\n  is --store the service's database (and schema)? `idem schema` prints the SQL that creates the table"
            ));
        }
        Failure::Error(msg)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match rt.block_on(run(&cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Error(msg)) => {
            eprintln!("idem: {msg}");
            ExitCode::from(1)
        }
        Err(Failure::NotFound(msg)) => {
            eprintln!("idem: {msg}");
            ExitCode::from(3)
        }
    }
}

/// The key and how it was hashed.
struct Resolved {
    key: Key,
    scope: Option<String>,
    keyed: Option<String>,
}

fn resolve(cli: &Cli, args: &KeyArgs) -> Result<Resolved, Failure> {
    if let Some(hash) = &args.hash {
        let key = Key::from_hex(hash.trim()).map_err(|_| {
            Failure::Error(format!(
                "--hash must be the key's 64 hex digits, got {} characters",
                hash.trim().len()
            ))
        })?;
        return Ok(Resolved {
            key,
            scope: args.scope.clone(),
            keyed: None,
        });
    }
    let scope = args
        .scope
        .clone()
        .expect("clap requires --scope without --hash");
    if args.parts.is_empty() {
        return Err(Failure::Error(
            "give the key's parts (--part TYPE:VALUE, one per segment) or its --hash".into(),
        ));
    }
    let secret = match std::env::var_os(&cli.key_secret_env) {
        Some(_) => Some(KeySecret::from_env(&cli.key_secret_env)?),
        None => None,
    };
    let mut builder = match &secret {
        Some(s) => Key::keyed_builder(&scope, s),
        None => Key::builder(&scope),
    };
    for p in &args.parts {
        builder.push(&parts::parse(p).map_err(Failure::Error)?);
    }
    Ok(Resolved {
        key: builder.finish(),
        scope: Some(scope),
        keyed: secret.map(|s| s.id()),
    })
}

fn no_record(r: &Resolved, cli: &Cli) -> Failure {
    let scope = r.scope.as_deref().unwrap_or("?");
    let hashing = match &r.keyed {
        Some(id) => format!(
            "hashed under the key secret {id} from ${}",
            cli.key_secret_env
        ),
        None => format!("plain SHA-256, ${} unset", cli.key_secret_env),
    };
    Failure::NotFound(format!(
        "no record for scope {scope:?} key {} ({hashing}); check the scope, each part's type and order, and the key secret",
        r.key.to_hex()
    ))
}

async fn run(cli: &Cli) -> Result<(), Failure> {
    match &cli.command {
        Command::Key(args) => {
            let r = resolve(cli, args)?;
            if cli.json {
                println!(
                    "{}",
                    json!({"key": r.key.to_hex(), "scope": r.scope, "key_secret": r.keyed})
                );
            } else {
                println!("{}", r.key.to_hex());
            }
            Ok(())
        }
        Command::Schema { dialect } => {
            let dialect = match dialect {
                Some(d) => d.clone(),
                None => store::dialect_of(store_url(cli)?)?.to_owned(),
            };
            let sql = idem_runtime::store::sql::schema_sql(&dialect).ok_or_else(|| {
                Failure::Error(format!(
                    "no schema for {dialect:?}: the SQL stores are sqlite, postgres and mysql (Redis needs none)"
                ))
            })?;
            print!("{sql}");
            Ok(())
        }
        Command::Inspect(args) => {
            let r = resolve(cli, args)?;
            let store = store::open(store_url(cli)?, &cli.redis_prefix).await?;
            match store.inspect(&r.key).await? {
                Some(info) => {
                    let recovery = store.recovery_info(&r.key).await?;
                    print_record(cli, &r, &info, recovery.as_ref());
                    Ok(())
                }
                None => {
                    if cli.json {
                        println!(
                            "{}",
                            json!({"found": false, "key": r.key.to_hex(), "scope": r.scope})
                        );
                    }
                    Err(no_record(&r, cli))
                }
            }
        }
        Command::Evict { key: args, force } => {
            let r = resolve(cli, args)?;
            let store = store::open(store_url(cli)?, &cli.redis_prefix).await?;
            if !force {
                let live = store.inspect(&r.key).await?.filter(|info| {
                    info.state == RecordState::Processing && info.lease_until_millis > now_millis()
                });
                if let Some(info) = live {
                    return Err(Failure::Error(format!(
                        "not evicted: {} is PROCESSING under a live lease (fence {}, for {} ms more): a body may be running, and evicting lets the next call run beside it. Wait for the lease, or pass --force",
                        r.key.to_hex(),
                        info.fence,
                        info.lease_until_millis - now_millis()
                    )));
                }
            }
            if store.evict(&r.key).await? {
                if cli.json {
                    println!(
                        "{}",
                        json!({"evicted": true, "key": r.key.to_hex(), "scope": r.scope})
                    );
                } else {
                    println!("evicted {}", r.key.to_hex());
                }
                Ok(())
            } else {
                if cli.json {
                    println!(
                        "{}",
                        json!({"evicted": false, "key": r.key.to_hex(), "scope": r.scope})
                    );
                }
                Err(no_record(&r, cli))
            }
        }
        Command::Recover(args) => {
            let r = resolve(cli, args)?;
            let store = store::open(store_url(cli)?, &cli.redis_prefix).await?;
            if store.retry_recovery(&r.key).await? {
                if cli.json {
                    println!(
                        "{}",
                        json!({"recover": true, "key": r.key.to_hex(), "scope": r.scope})
                    );
                } else {
                    println!(
                        "recovery of {} cleared: the worker takes it up once its lease has run out",
                        r.key.to_hex()
                    );
                }
                Ok(())
            } else {
                if cli.json {
                    println!(
                        "{}",
                        json!({"recover": false, "key": r.key.to_hex(), "scope": r.scope})
                    );
                }
                Err(Failure::NotFound(format!(
                    "no recoverable call under {}: no PROCESSING record with stored arguments (finished, released, never made with `recover`, or the key is wrong); `idem inspect` shows what is there",
                    r.key.to_hex()
                )))
            }
        }
        Command::Purge { max, batch } => {
            let store = store::open(store_url(cli)?, &cli.redis_prefix).await?;
            let batch = (*batch).max(1);
            let mut purged = 0u64;
            loop {
                let room = max.map_or(batch as u64, |m| (m - purged).min(batch as u64));
                if room == 0 {
                    break;
                }
                let n = store.purge_expired(room as usize).await?;
                purged += n;
                if n < room {
                    break;
                }
            }
            if cli.json {
                println!("{}", json!({"purged": purged}));
            } else {
                println!("purged {purged} expired or released records");
            }
            Ok(())
        }
        Command::Stats => {
            let store = store::open(store_url(cli)?, &cli.redis_prefix).await?;
            let s = store.stats().await?;
            print_stats(cli, &s);
            Ok(())
        }
        Command::Outbox(cmd) => outbox::run(cli, cmd).await,
    }
}

fn store_url(cli: &Cli) -> Result<&str, Failure> {
    cli.store.as_deref().ok_or_else(|| {
        Failure::Error("no store: pass --store (or set IDEM_STORE) to a SQLite path or a postgres://, mysql:// or redis:// URL".into())
    })
}

fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `in 3h 12m` or `4m 2s ago`, against this machine's clock (a server store
/// keeps the server's: small skews show here).
fn relative(at: i64) -> String {
    let delta = at - now_millis();
    let text = span(delta.unsigned_abs() / 1000);
    if delta >= 0 {
        format!("in {text}")
    } else {
        format!("{text} ago")
    }
}

/// `4m 2s`: a span of seconds, to its two largest units.
fn span(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86400, (s % 86400) / 3600),
    }
}

fn outcome_name(o: StoredOutcome) -> &'static str {
    match o {
        StoredOutcome::Success => "success",
        StoredOutcome::FinalError => "final_error",
        StoredOutcome::Unstored => "unstored",
    }
}

/// A stored payload: JSON when it is (idem stores results as JSON), else hex.
fn payload_value(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|_| json!({"hex": hex::encode(bytes)}))
}

fn print_record(cli: &Cli, r: &Resolved, info: &RecordInfo, recovery: Option<&RecoveryInfo>) {
    let state = match info.state {
        RecordState::Processing => "processing",
        RecordState::Done => "done",
    };
    let stalled = info.state == RecordState::Processing && info.lease_until_millis <= now_millis();
    if cli.json {
        let mut obj = json!({
            "found": true,
            "scope": r.scope,
            "key": r.key.to_hex(),
            "key_secret": r.keyed,
            "state": state,
            "fence": info.fence,
            "expires_at_ms": info.expires_at_millis,
        });
        if info.state == RecordState::Processing {
            obj["lease_until_ms"] = json!(info.lease_until_millis);
            obj["lease_expired"] = json!(stalled);
        }
        if let Some(res) = &info.result {
            obj["outcome"] = json!(outcome_name(res.outcome));
            obj["result"] = payload_value(&res.payload);
            obj["fingerprint"] = json!(res.fingerprint.map(|f| hex::encode(f.as_bytes())));
        }
        if let Some(rec) = recovery {
            obj["recovery"] = json!({
                "scope": rec.scope,
                "attempts": rec.attempts,
                "next_attempt_ms": rec.next_attempt_millis,
                "parked": rec.parked.is_some(),
                "parked_because": rec.parked,
                "args_bytes": rec.args_bytes,
            });
        }
        println!("{obj}");
        return;
    }
    let mut rows: Vec<(&str, String)> = Vec::new();
    if let Some(scope) = &r.scope {
        rows.push(("scope", scope.clone()));
    }
    rows.push(("key", r.key.to_hex()));
    rows.push((
        "hashing",
        match &r.keyed {
            Some(id) => format!("HMAC-SHA-256, key secret {id}"),
            None if r.scope.is_some() => "plain SHA-256".into(),
            None => "given as --hash".into(),
        },
    ));
    rows.push((
        "state",
        if stalled {
            "processing (lease run out: the next call takes over)".into()
        } else {
            state.into()
        },
    ));
    rows.push(("fence", info.fence.to_string()));
    if info.state == RecordState::Processing {
        rows.push((
            "lease until",
            format!(
                "{} ({})",
                info.lease_until_millis,
                relative(info.lease_until_millis)
            ),
        ));
    }
    rows.push((
        "expires at",
        format!(
            "{} ({})",
            info.expires_at_millis,
            relative(info.expires_at_millis)
        ),
    ));
    if let Some(res) = &info.result {
        rows.push(("outcome", outcome_name(res.outcome).into()));
        let mut shown = payload_value(&res.payload).to_string();
        if shown.chars().count() > 200 {
            shown = shown.chars().take(200).collect::<String>() + "…";
        }
        rows.push(("result", shown));
        if let Some(fp) = res.fingerprint {
            rows.push(("fingerprint", hex::encode(fp.as_bytes())));
        }
    }
    if let Some(rec) = recovery {
        rows.push((
            "recovery",
            format!(
                "arguments stored ({} bytes) for scope {}; {} recoveries attempted",
                rec.args_bytes, rec.scope, rec.attempts
            ),
        ));
        match &rec.parked {
            Some(why) => rows.push((
                "parked",
                format!("{why}; `idem recover` lets the worker try again"),
            )),
            None if rec.next_attempt_millis > now_millis() => rows.push((
                "next recovery",
                format!(
                    "{} ({})",
                    rec.next_attempt_millis,
                    relative(rec.next_attempt_millis)
                ),
            )),
            None => {}
        }
    }
    table(&rows);
}

fn print_stats(cli: &Cli, s: &RecordStats) {
    if cli.json {
        println!(
            "{}",
            json!({
                "processing": s.processing,
                "stalled": s.stalled,
                "done": s.done,
                "dead": s.dead,
                "unknown": s.unknown,
            })
        );
        return;
    }
    table(&[
        (
            "processing",
            format!("{:>10}  running under a live lease", s.processing),
        ),
        (
            "stalled",
            format!(
                "{:>10}  lease run out: owner crashed or stalled; next call takes over",
                s.stalled
            ),
        ),
        (
            "done",
            format!("{:>10}  finished; duplicates replay them", s.done),
        ),
        (
            "dead",
            format!(
                "{:>10}  released or expired; `idem purge` deletes them",
                s.dead
            ),
        ),
        (
            "unknown",
            format!(
                "{:>10}  unknown state: calls on them fail closed",
                s.unknown
            ),
        ),
    ]);
}

fn table(rows: &[(&str, String)]) {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        println!("{k:<width$}  {v}");
    }
}
