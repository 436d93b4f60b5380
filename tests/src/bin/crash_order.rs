//! One call of a four-step order flow (deduct stock → create order → issue
//! coupon → publish), run as its own process so `tests/crash_recovery.rs` can
//! kill it with SIGKILL at a known point inside step three and retry from a
//! second process.
//!
//! With the crash points `reject` and `reject-kill-in-restore` the process runs
//! the flow's giving-up variant instead: the coupon provider rejects the order
//! (an error `final_err` marks final), so the finished steps are compensated in
//! reverse order (cancel the order, restore the stock); with
//! `reject-kill-in-restore` it stops inside the stock restore, after the order
//! was cancelled, for the parent to kill it mid-compensation. It prints
//! `ran issue_coupon rejected`, `ran <compensation> <id> new|existing` for each
//! compensation body and `final coupon_rejected` at the end (exit status 0).
//!
//! The recoverable variants (`#[idempotent(…, recover)]`, see
//! `tests/crash_recovery/recovery.rs`): `recover` runs the flow through
//! `create_order_recoverable`, `recover-kill-in-step-two` stops inside step
//! two (`at insert_order before-write`) for the parent to kill it, and
//! `recover-reject` / `recover-reject-kill-in-step-two` do the same with the
//! giving-up variant. `worker` runs no flow: it runs a recovery worker with
//! both recoverable functions registered (`--reject 1`: step three rejects,
//! so recovered flows give up), prints `pass found=… recovered=… gave_up=…
//! failed=… parked=… busy=…` per pass that found something, and ends with
//! `worker recovered=… gave_up=… failed=… parked=… busy=…` after the first
//! pass that finds nothing (`--until-idle 1`) or after `--for-ms N`.
//!
//! ```text
//! crash_order <sqlite|postgres|redis> <client_order_no> <none|before-write|after-write|reject|reject-kill-in-restore
//!                                                       |recover|recover-kill-in-step-two|recover-reject|recover-reject-kill-in-step-two|worker>
//!             [--sqlite FILE] [--postgres URL --schema NAME] [--redis URL --prefix PREFIX]
//!             [--reject 1] [--until-idle 1 | --for-ms N]
//! ```
//!
//! The idem store is the one named first. The business tables live in the same
//! SQLite file (sqlite), in the private schema beside the idem records
//! (postgres), or in the SQLite file (redis, where Redis holds only the idem
//! records). Every effect is a row under a UNIQUE key of the intent, and each
//! row's id is drawn at random inside the step, so the ids in the final result
//! tell which process's step produced them.
//!
//! On stdout, one line per event, flushed at once:
//! `ran <step> <id> new|existing` when a step body runs, `at issue_coupon
//! <point>` just before blocking at a crash point (the parent kills the process
//! there), `in_progress` per retry while another process holds the key, and
//! `result <ticket> <order_no> <coupon> <message_id>` at the end. Exit status 0
//! only with a result.

use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::{Duration, Instant};

use idem_runtime::recovery::{Recovery, Worker};
use idem_runtime::store::StoreRef;
use idem_runtime::store::Token;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sql::{PgStore, SqliteStore};
use idem_runtime::{idempotent, recoverable, step};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{PgPool, SqlitePool};

const SKU: &str = "SKU-42";

/// How long the process keeps retrying while another one holds the key. Far
/// longer than the lease: a crashed owner's lease always runs out before it.
const GIVE_UP_AFTER: Duration = Duration::from_secs(60);

// Valid on SQLite and PostgreSQL alike. Each effect table holds at most one row
// per intent (the primary key), and ids never repeat (UNIQUE): the backstop
// that holds even if a duplicate got past idem.
const SCHEMA: [&str; 8] = [
    "CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, qty BIGINT NOT NULL CHECK (qty >= 0))",
    "CREATE TABLE IF NOT EXISTS stock_ledger (client_order_no TEXT PRIMARY KEY, id TEXT NOT NULL UNIQUE,
        refers_to TEXT NOT NULL, made_by BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS orders (client_order_no TEXT PRIMARY KEY, id TEXT NOT NULL UNIQUE,
        refers_to TEXT NOT NULL, made_by BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS coupons (client_order_no TEXT PRIMARY KEY, id TEXT NOT NULL UNIQUE,
        refers_to TEXT NOT NULL, made_by BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS messages (client_order_no TEXT PRIMARY KEY, id TEXT NOT NULL UNIQUE,
        refers_to TEXT NOT NULL, made_by BIGINT NOT NULL)",
    // One compensation row per undone effect: keyed by the id it undoes.
    "CREATE TABLE IF NOT EXISTS stock_restores (refers_to TEXT PRIMARY KEY, id TEXT NOT NULL UNIQUE,
        made_by BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS order_cancellations (refers_to TEXT PRIMARY KEY, id TEXT NOT NULL UNIQUE,
        made_by BIGINT NOT NULL)",
    "INSERT INTO stock (sku, qty) VALUES ('SKU-42', 10) ON CONFLICT (sku) DO NOTHING",
];

// Serialize for `final_err`, which stores the final error; only
// `CouponRejected` is ever final, the other variants are never stored.
#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
enum AppError {
    #[error(transparent)]
    #[serde(skip)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    #[serde(skip)]
    Store(#[from] idem_runtime::StoreError),
    #[error("database: {0}")]
    #[serde(skip)]
    Db(#[from] sqlx::Error),
    #[error("not enough stock for {0}")]
    OutOfStock(String),
    #[error("usage: {0}")]
    Usage(String),
    #[error("the coupon provider rejected the order")]
    CouponRejected,
}

impl AppError {
    fn is_final(&self) -> bool {
        matches!(self, AppError::CouponRejected)
    }
}

/// What the flow returns, and what idem stores and replays.
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    ticket: String,
    order_no: String,
    coupon: String,
    message_id: String,
}

/// Where step three stops for the parent to kill the process.
#[derive(Debug, Clone, Copy, PartialEq)]
enum CrashPoint {
    None,
    /// Inside step three, before its business write.
    BeforeWrite,
    /// After step three's business write committed, before idem marks the step done.
    AfterWrite,
    /// Step three fails with a final error: the flow gives up and compensates.
    Reject,
    /// Like `Reject`, and stops inside the stock restore (the second
    /// compensation, after the order was cancelled), before its write.
    RejectKillInRestore,
    /// Inside step two, before its business write (the recoverable variants).
    InStepTwo,
}

/// Which flow the process runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Plain,
    GiveUp,
    Recoverable,
    RecoverableGiveUp,
    Worker,
}

#[derive(Clone)]
enum Biz {
    Sqlite(SqlitePool),
    Pg(PgPool),
}

// The same statements run on either pool; the two arms differ only in types.
macro_rules! on_biz {
    ($biz:expr, $pool:ident => $body:expr) => {
        match $biz {
            Biz::Sqlite($pool) => $body,
            Biz::Pg($pool) => $body,
        }
    };
}

// Clone: compensations run on a clone of the service, after the flow's body.
#[derive(Clone)]
struct OrderService {
    store: StoreRef,
    biz: Biz,
    crash: CrashPoint,
}

impl OrderService {
    #[idempotent(key = "client_order_no", scope = "crash_order.create_order", lease = "1s", ttl = "10m", store = self.store.clone())]
    async fn create_order(&self, client_order_no: &str) -> Result<Receipt, AppError> {
        self.create_order_body(client_order_no).await
    }

    /// The giving-up variant: the same steps, with a final error from step three.
    #[idempotent(key = "client_order_no", scope = "crash_order.create_order_or_give_up", lease = "1s", ttl = "10m", final_err = AppError::is_final, store = self.store.clone())]
    async fn create_order_or_give_up(&self, client_order_no: &str) -> Result<Receipt, AppError> {
        self.create_order_body(client_order_no).await
    }

    /// The same flow, recoverable: its argument is stored with the claim, and
    /// a worker finishes it if this process dies.
    #[idempotent(key = "client_order_no", scope = "crash_order.create_order_recoverable", lease = "1s", ttl = "10m", store = self.store.clone(), recover)]
    async fn create_order_recoverable(&self, client_order_no: &str) -> Result<Receipt, AppError> {
        self.create_order_body(client_order_no).await
    }

    /// The giving-up variant, recoverable.
    #[idempotent(key = "client_order_no", scope = "crash_order.create_order_recoverable_or_give_up", lease = "1s", ttl = "10m", final_err = AppError::is_final, store = self.store.clone(), recover)]
    async fn create_order_recoverable_or_give_up(
        &self,
        client_order_no: &str,
    ) -> Result<Receipt, AppError> {
        self.create_order_body(client_order_no).await
    }

    async fn create_order_body(&self, client_order_no: &str) -> Result<Receipt, AppError> {
        let ticket = self.deduct_stock(client_order_no).await?;
        let order_no = self.insert_order(client_order_no, &ticket).await?;
        let coupon = self.issue_coupon(client_order_no, &order_no).await?;
        let message_id = self.publish(client_order_no, &coupon).await?;
        Ok(Receipt {
            ticket,
            order_no,
            coupon,
            message_id,
        })
    }

    #[step("deduct_stock", compensate = "restore_stock")]
    async fn deduct_stock(&self, client_order_no: &str) -> Result<String, AppError> {
        self.effect("deduct_stock", "stock_ledger", client_order_no, SKU, true)
            .await
    }

    #[step("insert_order", compensate = "cancel_order")]
    async fn insert_order(&self, client_order_no: &str, ticket: &str) -> Result<String, AppError> {
        if self.crash == CrashPoint::InStepTwo {
            block_at("insert_order", "before-write").await;
        }
        self.effect("insert_order", "orders", client_order_no, ticket, false)
            .await
    }

    // Stands for a call no transaction covers (a coupon provider): the kill
    // lands inside it, before or after its write.
    #[step("issue_coupon")]
    async fn issue_coupon(
        &self,
        client_order_no: &str,
        order_no: &str,
    ) -> Result<String, AppError> {
        if self.crash == CrashPoint::BeforeWrite {
            block_at("issue_coupon", "before-write").await;
        }
        if matches!(
            self.crash,
            CrashPoint::Reject | CrashPoint::RejectKillInRestore
        ) {
            say("ran issue_coupon rejected");
            return Err(AppError::CouponRejected);
        }
        let coupon = self
            .effect("issue_coupon", "coupons", client_order_no, order_no, false)
            .await?;
        if self.crash == CrashPoint::AfterWrite {
            block_at("issue_coupon", "after-write").await;
        }
        Ok(coupon)
    }

    #[step("publish")]
    async fn publish(&self, client_order_no: &str, coupon: &str) -> Result<String, AppError> {
        self.effect("publish", "messages", client_order_no, coupon, false)
            .await
    }

    /// Undoes `deduct_stock`: puts the unit back, once per ticket.
    async fn restore_stock(&self, ticket: String) -> Result<(), AppError> {
        if self.crash == CrashPoint::RejectKillInRestore {
            say("at restore_stock before-write");
            std::future::pending::<()>().await;
        }
        self.undo("restore_stock", "stock_restores", &ticket, true)
            .await
            .map(drop)
    }

    /// Undoes `insert_order`, once per order.
    async fn cancel_order(&self, order_no: String) -> Result<String, AppError> {
        self.undo("cancel_order", "order_cancellations", &order_no, false)
            .await
    }

    /// Writes the compensation row for the effect `refers_to` under a fresh
    /// random id, or takes the one an earlier process wrote (conflict is
    /// success); with `restock`, a new row also puts one unit of stock back in
    /// the same transaction. Prints `ran <compensation> <id> new|existing`.
    async fn undo(
        &self,
        compensation: &str,
        table: &str,
        refers_to: &str,
        restock: bool,
    ) -> Result<String, AppError> {
        let fresh = random_id(table);
        let insert = format!(
            "INSERT INTO {table} (refers_to, id, made_by) VALUES ($1, $2, $3)
             ON CONFLICT (refers_to) DO NOTHING RETURNING id"
        );
        let select = format!("SELECT id FROM {table} WHERE refers_to = $1");
        let (id, new) = on_biz!(&self.biz, pool => {
            let mut tx = pool.begin().await?;
            let inserted: Option<String> = sqlx::query_scalar(&insert)
                .bind(refers_to)
                .bind(&fresh)
                .bind(i64::from(std::process::id()))
                .fetch_optional(&mut *tx)
                .await?;
            match inserted {
                Some(id) => {
                    if restock {
                        sqlx::query("UPDATE stock SET qty = qty + 1 WHERE sku = $1")
                            .bind(SKU)
                            .execute(&mut *tx)
                            .await?;
                    }
                    tx.commit().await?;
                    (id, true)
                }
                None => {
                    let id: String = sqlx::query_scalar(&select)
                        .bind(refers_to)
                        .fetch_one(&mut *tx)
                        .await?;
                    (id, false)
                }
            }
        });
        let how = if new { "new" } else { "existing" };
        say(&format!("ran {compensation} {id} {how}"));
        Ok(id)
    }

    /// Writes the intent's row of `table` under a fresh random id, or — when
    /// the row is already there (an earlier process wrote it and died before
    /// idem marked the step done) — returns the id that stands: a conflict on
    /// the intent's key is success, never a second effect. With `deduct`, a
    /// new row also takes one unit of stock in the same transaction. Prints
    /// `ran <step> <id> new|existing` either way.
    async fn effect(
        &self,
        step: &str,
        table: &str,
        client_order_no: &str,
        refers_to: &str,
        deduct: bool,
    ) -> Result<String, AppError> {
        let fresh = random_id(table);
        let insert = format!(
            "INSERT INTO {table} (client_order_no, id, refers_to, made_by) VALUES ($1, $2, $3, $4)
             ON CONFLICT (client_order_no) DO NOTHING RETURNING id"
        );
        let select = format!("SELECT id FROM {table} WHERE client_order_no = $1");
        let (id, new) = on_biz!(&self.biz, pool => {
            let mut tx = pool.begin().await?;
            let inserted: Option<String> = sqlx::query_scalar(&insert)
                .bind(client_order_no)
                .bind(&fresh)
                .bind(refers_to)
                .bind(i64::from(std::process::id()))
                .fetch_optional(&mut *tx)
                .await?;
            match inserted {
                Some(id) => {
                    if deduct {
                        let moved = sqlx::query("UPDATE stock SET qty = qty - 1 WHERE sku = $1 AND qty >= 1")
                            .bind(SKU)
                            .execute(&mut *tx)
                            .await?;
                        if moved.rows_affected() == 0 {
                            return Err(AppError::OutOfStock(SKU.into()));
                        }
                    }
                    tx.commit().await?;
                    (id, true)
                }
                None => {
                    let id: String = sqlx::query_scalar(&select)
                        .bind(client_order_no)
                        .fetch_one(&mut *tx)
                        .await?;
                    (id, false)
                }
            }
        });
        let how = if new { "new" } else { "existing" };
        say(&format!("ran {step} {id} {how}"));
        Ok(id)
    }
}

fn random_id(prefix: &str) -> String {
    let hex: String = Token::random().as_bytes()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{prefix}-{hex}")
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    // The parent reads line by line and acts on what it reads: nothing may
    // wait in a buffer. A closed pipe means the parent is gone; nothing to do.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Announces the crash point and waits to be killed. The flow's heartbeat
/// keeps running meanwhile, exactly as in a process stuck in a slow call.
async fn block_at(step: &str, point: &str) {
    say(&format!("at {step} {point}"));
    std::future::pending::<()>().await;
}

struct Args {
    kind: String,
    client_order_no: String,
    crash: CrashPoint,
    mode: Mode,
    options: HashMap<String, String>,
}

impl Args {
    fn parse() -> Result<Args, AppError> {
        let mut argv = std::env::args().skip(1);
        let mut next = |what: &str| {
            argv.next()
                .ok_or_else(|| AppError::Usage(format!("missing {what}")))
        };
        let kind = next("the store kind")?;
        let client_order_no = next("the client_order_no")?;
        let (crash, mode) = match next("the crash point")?.as_str() {
            "none" => (CrashPoint::None, Mode::Plain),
            "before-write" => (CrashPoint::BeforeWrite, Mode::Plain),
            "after-write" => (CrashPoint::AfterWrite, Mode::Plain),
            "reject" => (CrashPoint::Reject, Mode::GiveUp),
            "reject-kill-in-restore" => (CrashPoint::RejectKillInRestore, Mode::GiveUp),
            "recover" => (CrashPoint::None, Mode::Recoverable),
            "recover-kill-in-step-two" => (CrashPoint::InStepTwo, Mode::Recoverable),
            "recover-reject" => (CrashPoint::Reject, Mode::RecoverableGiveUp),
            "recover-reject-kill-in-step-two" => (CrashPoint::InStepTwo, Mode::RecoverableGiveUp),
            "worker" => (CrashPoint::None, Mode::Worker),
            other => return Err(AppError::Usage(format!("unknown crash point {other}"))),
        };
        let mut options = HashMap::new();
        while let Ok(flag) = next("an option") {
            let name = flag
                .strip_prefix("--")
                .ok_or_else(|| AppError::Usage(format!("expected --option, got {flag}")))?
                .to_owned();
            let value = next(&flag)?;
            options.insert(name, value);
        }
        let crash = match options.get("reject").map(String::as_str) {
            Some("1") => CrashPoint::Reject,
            _ => crash,
        };
        Ok(Args {
            kind,
            client_order_no,
            crash,
            mode,
            options,
        })
    }

    fn option(&self, name: &str) -> Result<&str, AppError> {
        self.options
            .get(name)
            .map(String::as_str)
            .ok_or_else(|| AppError::Usage(format!("{} needs --{name}", self.kind)))
    }
}

async fn sqlite_pool(path: &str) -> Result<SqlitePool, AppError> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    Ok(SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?)
}

async fn service(args: &Args) -> Result<OrderService, AppError> {
    let (store, biz) = match args.kind.as_str() {
        "sqlite" => {
            let store = SqliteStore::open(args.option("sqlite")?).await?;
            let biz = Biz::Sqlite(store.pool().clone());
            (StoreRef::new(store), biz)
        }
        "postgres" => {
            let options = PgConnectOptions::from_str(args.option("postgres")?)?
                .options([("search_path", args.option("schema")?)]);
            let pool = PgPoolOptions::new()
                .max_connections(4)
                .connect_with(options)
                .await?;
            let store = PgStore::builder().pool(pool.clone()).await?;
            (StoreRef::new(store), Biz::Pg(pool))
        }
        "redis" => {
            let store = RedisStore::builder()
                .key_prefix(args.option("prefix")?)
                .connect(args.option("redis")?)
                .await?;
            let biz = Biz::Sqlite(sqlite_pool(args.option("sqlite")?).await?);
            (StoreRef::new(store), biz)
        }
        other => return Err(AppError::Usage(format!("unknown store {other}"))),
    };
    for statement in SCHEMA {
        on_biz!(&biz, pool => {
            sqlx::query(statement).execute(pool).await?;
        });
    }
    Ok(OrderService {
        store,
        biz,
        crash: args.crash,
    })
}

/// Runs recovery passes until one finds nothing (`--until-idle 1`) or for
/// `--for-ms`, then prints the totals.
async fn work(svc: OrderService, args: &Args) -> Result<(), AppError> {
    let recovery = Recovery::new()
        .register(recoverable!(
            OrderService::create_order_recoverable,
            svc.clone()
        ))
        .register(recoverable!(
            OrderService::create_order_recoverable_or_give_up,
            svc.clone()
        ));
    let worker = Worker::builder(svc.store.clone(), recovery)
        .backoff(Duration::from_millis(200), Duration::from_secs(1))
        .build();
    let until = args
        .options
        .get("for-ms")
        .map(|ms| {
            ms.parse()
                .map(|ms| Instant::now() + Duration::from_millis(ms))
        })
        .transpose()
        .map_err(|_| AppError::Usage("--for-ms takes milliseconds".into()))?;
    let deadline = Instant::now() + GIVE_UP_AFTER;
    loop {
        let pass = worker.run_once().await?;
        if pass.found > 0 {
            say(&format!(
                "pass found={} recovered={} gave_up={} failed={} parked={} busy={}",
                pass.found, pass.recovered, pass.gave_up, pass.failed, pass.parked, pass.busy
            ));
        }
        let done = match until {
            Some(until) => Instant::now() >= until,
            None => pass.found == 0 || Instant::now() >= deadline,
        };
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stats = worker.stats();
    say(&format!(
        "worker recovered={} gave_up={} failed={} parked={} busy={}",
        stats.recovered, stats.gave_up, stats.failed, stats.parked, stats.busy
    ));
    Ok(())
}

async fn run() -> Result<Option<Receipt>, AppError> {
    let args = Args::parse()?;
    let svc = service(&args).await?;

    if args.mode == Mode::Worker {
        return work(svc, &args).await.map(|()| None);
    }
    let deadline = Instant::now() + GIVE_UP_AFTER;
    loop {
        let out = match args.mode {
            Mode::GiveUp => svc.create_order_or_give_up(&args.client_order_no).await,
            Mode::Recoverable => svc.create_order_recoverable(&args.client_order_no).await,
            Mode::RecoverableGiveUp => {
                svc.create_order_recoverable_or_give_up(&args.client_order_no)
                    .await
            }
            Mode::Plain | Mode::Worker => svc.create_order(&args.client_order_no).await,
        };
        match out {
            Err(AppError::Idem(idem_runtime::Error::InProgress { retry_after, .. }))
                if Instant::now() < deadline =>
            {
                say("in_progress");
                let nap = retry_after.clamp(Duration::from_millis(20), Duration::from_millis(500));
                tokio::time::sleep(nap).await;
            }
            other => return other.map(Some),
        }
    }
}

fn main() -> ExitCode {
    // A debug build polls the giving-up flow's future (about 200 KB) with
    // copies of its large locals on the stack, and a recovery worker runs it
    // on a runtime worker thread, whose 2 MiB (tokio's default) that does
    // not hold; a service calling the flow from a spawned task needs the same.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(16 << 20)
        .build()
        .expect("a tokio runtime");
    runtime.block_on(main_async())
}

async fn main_async() -> ExitCode {
    match run().await {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(r)) => {
            say(&format!(
                "result {} {} {} {}",
                r.ticket, r.order_no, r.coupon, r.message_id
            ));
            ExitCode::SUCCESS
        }
        // The giving-up variant's expected end: compensated, final error stored.
        Err(AppError::CouponRejected) => {
            say("final coupon_rejected");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("crash_order: {e}");
            ExitCode::FAILURE
        }
    }
}
