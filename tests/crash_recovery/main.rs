//! Crash recovery across real processes: a process running the four-step
//! order flow (`src/bin/crash_order.rs`: deduct stock → create order → issue
//! coupon → publish) is killed with SIGKILL inside step three; a second process
//! retries the same intent after the lease. Each effect must end in the
//! business tables exactly once, and steps one and two must be replayed from
//! their saved outputs (the first process's ticket and order number come back,
//! and their bodies do not run again).
//!
//! Two kill points: before step three's business write (the retry runs it),
//! and after that write committed but before idem marked the step done (the
//! retry runs it again, meets the UNIQUE key and takes the existing coupon).
//!
//! Once per store: SQLite (idem records and business tables in one file),
//! PostgreSQL (both in a schema of the test's own), and Redis (idem records
//! only, under a prefix of their own; the business tables in a SQLite file).
//! Files and schemas are removed at the end, and left in place when a test
//! fails, for a look. A server that cannot be reached makes its
//! test say SKIPPED, or fail with `IDEM_REQUIRE_SERVICES=1`.
//!
//! `recovery.rs`: the same flow made recoverable, killed in step two, and
//! finished by a recovery worker in another process.

mod recovery;

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use idem_runtime::store::Token;
use idem_runtime::store::redis::RedisStore;
use idem_tests::services;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{PgPool, SqlitePool};

const BIN: &str = env!("CARGO_BIN_EXE_crash_order");

/// How long a process may take to reach the kill point or to finish. Generous:
/// nothing here measures time, it only keeps a hung child from hanging the run.
const DEADLINE: Duration = Duration::from_secs(120);

/// Stock before any order (the binary seeds it).
const STOCK: i64 = 10;

const KILL_POINTS: [&str; 2] = ["before-write", "after-write"];

fn random_hex() -> String {
    Token::random().as_bytes()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Where one scenario's business tables are, as the test reads them.
enum Tables {
    Sqlite(PathBuf),
    Pg { admin: PgPool, schema: String },
}

/// One effect row: the id drawn inside the step, what it refers to (the
/// previous step's id) and the pid of the process that wrote it.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    id: String,
    refers_to: String,
    made_by: i64,
}

#[derive(Debug)]
struct Effects {
    ledger: Vec<Row>,
    orders: Vec<Row>,
    coupons: Vec<Row>,
    messages: Vec<Row>,
    restores: Vec<Row>,
    cancellations: Vec<Row>,
    stock_left: i64,
}

impl Tables {
    async fn read(&self) -> Effects {
        match self {
            Tables::Sqlite(path) => {
                let options = SqliteConnectOptions::new().filename(path);
                let pool = SqlitePool::connect_with(options)
                    .await
                    .expect("open sqlite");
                let effects = Effects {
                    ledger: pool.read_rows("stock_ledger").await,
                    orders: pool.read_rows("orders").await,
                    coupons: pool.read_rows("coupons").await,
                    messages: pool.read_rows("messages").await,
                    restores: pool.read_rows("stock_restores").await,
                    cancellations: pool.read_rows("order_cancellations").await,
                    stock_left: pool.read_stock("stock").await,
                };
                pool.close().await;
                effects
            }
            Tables::Pg { admin, schema } => Effects {
                ledger: admin.read_rows(&format!("{schema}.stock_ledger")).await,
                orders: admin.read_rows(&format!("{schema}.orders")).await,
                coupons: admin.read_rows(&format!("{schema}.coupons")).await,
                messages: admin.read_rows(&format!("{schema}.messages")).await,
                restores: admin.read_rows(&format!("{schema}.stock_restores")).await,
                cancellations: admin
                    .read_rows(&format!("{schema}.order_cancellations"))
                    .await,
                stock_left: admin.read_stock(&format!("{schema}.stock")).await,
            },
        }
    }
}

// Written once for both pools: the statements are plain enough for either.
macro_rules! table_readers {
    ($($pool:ty),*) => {
        trait ReadRows {
            async fn read_rows(&self, table: &str) -> Vec<Row>;
            async fn read_stock(&self, table: &str) -> i64;
        }
        $(impl ReadRows for $pool {
            async fn read_rows(&self, table: &str) -> Vec<Row> {
                let sql = format!("SELECT id, refers_to, made_by FROM {table} ORDER BY id");
                let rows: Vec<(String, String, i64)> =
                    sqlx::query_as(&sql).fetch_all(self).await.expect("read rows");
                rows.into_iter()
                    .map(|(id, refers_to, made_by)| Row { id, refers_to, made_by })
                    .collect()
            }
            async fn read_stock(&self, table: &str) -> i64 {
                let sql = format!("SELECT qty FROM {table} WHERE sku = 'SKU-42'");
                sqlx::query_scalar(&sql).fetch_one(self).await.expect("read stock")
            }
        })*
    };
}
table_readers!(SqlitePool, PgPool);

/// Collects a pipe's lines on a thread, handing each over as it arrives.
fn lines_of(pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn text_of(pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = BufReader::new(pipe).read_to_string(&mut text);
        text
    })
}

/// A run of the binary.
struct Proc {
    child: Child,
    stdout: mpsc::Receiver<String>,
    stderr: Option<JoinHandle<String>>,
    seen: Vec<String>,
}

impl Proc {
    fn start(store_args: &[String], client_order_no: &str, crash: &str) -> Proc {
        let mut child = Command::new(BIN)
            .arg(store_args[0].as_str())
            .args([client_order_no, crash])
            .args(&store_args[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start crash_order");
        let stdout = lines_of(child.stdout.take().expect("stdout"));
        let stderr = Some(text_of(child.stderr.take().expect("stderr")));
        Proc {
            child,
            stdout,
            stderr,
            seen: Vec::new(),
        }
    }

    fn pid(&self) -> i64 {
        i64::from(self.child.id())
    }

    /// Everything the process printed, kept in `seen` and returned with its
    /// stderr for failure messages. Call once it has ended: reads stdout to
    /// its end, as the reader thread may still hold the last lines.
    fn transcript(&mut self) -> String {
        let deadline = Instant::now() + DEADLINE;
        let left = || deadline.saturating_duration_since(Instant::now());
        while let Ok(line) = self.stdout.recv_timeout(left()) {
            self.seen.push(line);
        }
        let stderr = self
            .stderr
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        format!(
            "stdout:\n  {}\nstderr:\n  {}",
            self.seen.join("\n  "),
            stderr.trim_end().replace('\n', "\n  ")
        )
    }

    /// Reads stdout until `line`, failing if the process ends first or the
    /// deadline passes.
    fn wait_for(&mut self, line: &str) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(got) => {
                    let done = got == line;
                    self.seen.push(got);
                    if done {
                        return;
                    }
                }
                Err(why) => {
                    let _ = self.child.kill();
                    let status = self.child.wait();
                    panic!(
                        "the first process never printed {line:?} ({why:?}; {status:?})\n{}",
                        self.transcript()
                    );
                }
            }
        }
    }

    fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL: no destructor, no release, no completion runs.
    fn kill(&mut self) -> ExitStatus {
        self.child.kill().expect("SIGKILL the first process");
        self.child.wait().expect("reap the first process")
    }

    /// Waits for the process to exit by itself.
    fn finish(&mut self) -> ExitStatus {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll the child") {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the retrying process did not finish\n{}", self.transcript());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A failed assertion must not leave a child blocked at its crash point.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `ran <step> <id> <new|existing>` lines of `step`, as (id, how).
fn ran<'a>(lines: &'a [String], step: &str) -> Vec<(&'a str, &'a str)> {
    lines
        .iter()
        .filter_map(|l| {
            let mut words = l.strip_prefix("ran ")?.split(' ');
            (words.next()? == step).then_some(())?;
            Some((words.next()?, words.next()?))
        })
        .collect()
}

/// What the two processes printed.
struct Runs {
    first_pid: i64,
    first_out: Vec<String>,
    second_pid: i64,
    second_out: Vec<String>,
    /// Both transcripts, for failure messages.
    context: String,
}

/// Kills a first process inside step three at `point`, then runs a second one
/// to the end. Blocks: run it off the async workers.
fn crash_then_retry(store_args: &[String], client_order_no: &str, point: &str) -> Runs {
    let mut first = Proc::start(store_args, client_order_no, point);
    first.wait_for(&format!("at issue_coupon {point}"));
    let status = first.kill();
    assert_eq!(
        status.signal(),
        Some(9),
        "the first process must die by SIGKILL, not {status:?}"
    );
    let first_pid = first.pid();
    let first_log = first.transcript();
    let first_out = first.seen.clone();

    let mut second = Proc::start(store_args, client_order_no, "none");
    let status = second.finish();
    let second_pid = second.pid();
    let second_log = second.transcript();
    let context = format!(
        "kill point {point}\n-- first process (pid {first_pid}, killed) --\n{first_log}\n-- second process (pid {second_pid}) --\n{second_log}"
    );
    assert!(status.success(), "the retry failed: {status:?}\n{context}");
    Runs {
        first_pid,
        first_out,
        second_pid,
        second_out: second.seen.clone(),
        context,
    }
}

/// Kills a first process inside step three at `point`, retries from a second
/// one, and checks both transcripts and the tables.
async fn kill_and_retry(store_args: &[String], tables: &Tables, point: &'static str) {
    let client_order_no = format!("c-{}", random_hex());
    let args = store_args.to_vec();
    let runs =
        tokio::task::spawn_blocking(move || crash_then_retry(&args, &client_order_no, point))
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    let Runs {
        first_pid,
        ref first_out,
        second_pid,
        ref second_out,
        ref context,
    } = runs;

    // What the first process made before it died.
    let [(ticket, "new")] = ran(first_out, "deduct_stock")[..] else {
        panic!("the first process should have deducted stock once\n{context}");
    };
    let [(order_no, "new")] = ran(first_out, "insert_order")[..] else {
        panic!("the first process should have created the order once\n{context}");
    };
    let first_coupon = ran(first_out, "issue_coupon");
    match point {
        "before-write" => assert!(first_coupon.is_empty(), "{context}"),
        _ => assert!(matches!(first_coupon[..], [(_, "new")]), "{context}"),
    }

    // Steps one and two were replayed, not re-run: their bodies print a line
    // whenever they run, even when the UNIQUE key makes them find their row.
    assert!(
        ran(second_out, "deduct_stock").is_empty(),
        "the retry ran deduct_stock again instead of replaying it\n{context}"
    );
    assert!(
        ran(second_out, "insert_order").is_empty(),
        "the retry ran insert_order again instead of replaying it\n{context}"
    );
    // Step three ran in the retry: from scratch, or meeting the coupon the
    // killed process had committed and taking it (conflict is success).
    let [(coupon, how)] = ran(second_out, "issue_coupon")[..] else {
        panic!("the retry should have run issue_coupon once\n{context}");
    };
    match point {
        "before-write" => assert_eq!(how, "new", "{context}"),
        _ => {
            assert_eq!(how, "existing", "{context}");
            assert_eq!(coupon, first_coupon[0].0, "{context}");
        }
    }
    let [(message_id, "new")] = ran(second_out, "publish")[..] else {
        panic!("the retry should have published once\n{context}");
    };
    let result = format!("result {ticket} {order_no} {coupon} {message_id}");
    assert_eq!(
        second_out.last(),
        Some(&result),
        "the retry's result must carry the first process's ticket and order number\n{context}"
    );

    // The tables: one row per effect, written by the process the story says.
    let coupon_by = if point == "before-write" {
        second_pid
    } else {
        first_pid
    };
    let row = |id: &str, refers_to: &str, made_by| Row {
        id: id.to_owned(),
        refers_to: refers_to.to_owned(),
        made_by,
    };
    let got = tables.read().await;
    assert_eq!(
        got.ledger,
        [row(ticket, "SKU-42", first_pid)],
        "stock_ledger\n{context}"
    );
    assert_eq!(
        got.orders,
        [row(order_no, ticket, first_pid)],
        "orders\n{context}"
    );
    assert_eq!(
        got.coupons,
        [row(coupon, order_no, coupon_by)],
        "coupons\n{context}"
    );
    assert_eq!(
        got.messages,
        [row(message_id, coupon, second_pid)],
        "messages\n{context}"
    );
    assert_eq!(got.stock_left, STOCK - 1, "stock moved once\n{context}");
}

/// Kills a first process mid-compensation: step three failed with a final
/// error, the order was cancelled (the first compensation), and the process
/// dies inside the stock restore (the second). A second process retries and
/// must finish the compensations without redoing the cancellation, without
/// running any step forward, and answer with the final error; a third retry
/// only replays it. Blocks: run it off the async workers.
fn kill_mid_compensation_then_retry(store_args: &[String], client_order_no: &str) -> Runs {
    let mut first = Proc::start(store_args, client_order_no, "reject-kill-in-restore");
    first.wait_for("at restore_stock before-write");
    let status = first.kill();
    assert_eq!(
        status.signal(),
        Some(9),
        "not killed by SIGKILL: {status:?}"
    );
    let first_pid = first.pid();
    let first_log = first.transcript();
    let first_out = first.seen.clone();

    let mut second = Proc::start(store_args, client_order_no, "reject");
    let status = second.finish();
    let second_pid = second.pid();
    let second_log = second.transcript();
    let mut context = format!(
        "-- first process (pid {first_pid}, killed mid-compensation) --\n{first_log}\n-- second process (pid {second_pid}) --\n{second_log}"
    );
    assert!(status.success(), "the retry failed: {status:?}\n{context}");

    // Retried once more after the flow finished giving up: a replay.
    let mut third = Proc::start(store_args, client_order_no, "reject");
    let status = third.finish();
    let third_log = third.transcript();
    context.push_str(&format!("\n-- third process --\n{third_log}"));
    assert!(
        status.success(),
        "the second retry failed: {status:?}\n{context}"
    );
    assert_eq!(
        third.seen,
        ["final coupon_rejected"],
        "a retry of a flow that gave up must only replay its final error\n{context}"
    );
    Runs {
        first_pid,
        first_out,
        second_pid,
        second_out: second.seen.clone(),
        context,
    }
}

async fn kill_mid_compensation(store_args: &[String], tables: &Tables) {
    let client_order_no = format!("c-{}", random_hex());
    let args = store_args.to_vec();
    let runs = tokio::task::spawn_blocking(move || {
        kill_mid_compensation_then_retry(&args, &client_order_no)
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    let Runs {
        first_pid,
        ref first_out,
        second_pid,
        ref second_out,
        ref context,
    } = runs;

    // The first process: both steps, the rejection, the cancellation, then death.
    let [(ticket, "new")] = ran(first_out, "deduct_stock")[..] else {
        panic!("the first process should have deducted stock once\n{context}");
    };
    let [(order_no, "new")] = ran(first_out, "insert_order")[..] else {
        panic!("the first process should have created the order once\n{context}");
    };
    assert!(
        first_out.iter().any(|l| l == "ran issue_coupon rejected"),
        "the first process should have met the rejection\n{context}"
    );
    let [(cancellation, "new")] = ran(first_out, "cancel_order")[..] else {
        panic!("the first process should have cancelled the order once\n{context}");
    };
    assert!(ran(first_out, "restore_stock").is_empty(), "{context}");

    // The retry: no step ran forward (not even the rejected one), the finished
    // cancellation was replayed, the restore ran once.
    for step in ["deduct_stock", "insert_order", "publish", "cancel_order"] {
        assert!(
            ran(second_out, step).is_empty(),
            "the retry ran {step} again\n{context}"
        );
    }
    assert!(
        !second_out.iter().any(|l| l.starts_with("ran issue_coupon")),
        "the retry ran the rejected step forward again\n{context}"
    );
    let [(restore, "new")] = ran(second_out, "restore_stock")[..] else {
        panic!("the retry should have restored the stock once\n{context}");
    };
    assert_eq!(
        second_out.last().map(String::as_str),
        Some("final coupon_rejected"),
        "{context}"
    );

    let row = |id: &str, refers_to: &str, made_by| Row {
        id: id.to_owned(),
        refers_to: refers_to.to_owned(),
        made_by,
    };
    let got = tables.read().await;
    assert_eq!(
        got.ledger,
        [row(ticket, "SKU-42", first_pid)],
        "stock_ledger\n{context}"
    );
    assert_eq!(
        got.orders,
        [row(order_no, ticket, first_pid)],
        "orders\n{context}"
    );
    assert!(got.coupons.is_empty(), "coupons\n{context}");
    assert!(got.messages.is_empty(), "messages\n{context}");
    assert_eq!(
        got.cancellations,
        [row(cancellation, order_no, first_pid)],
        "order_cancellations: the order is cancelled once\n{context}"
    );
    assert_eq!(
        got.restores,
        [row(restore, ticket, second_pid)],
        "stock_restores: the stock is restored once\n{context}"
    );
    assert_eq!(
        got.stock_left, STOCK,
        "deducted once and restored once\n{context}"
    );
}

fn remove_sqlite(path: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

fn sqlite_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("idem-crash-{tag}-{}.db", random_hex()))
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_a_kill_inside_step_three_leaves_each_effect_once() {
    for point in KILL_POINTS {
        let path = sqlite_path("sqlite");
        let args = [
            "sqlite".to_owned(),
            "--sqlite".into(),
            path.display().to_string(),
        ];
        let tables = Tables::Sqlite(path.clone());
        kill_and_retry(&args, &tables, point).await;
        remove_sqlite(&path);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_a_kill_mid_compensation_compensates_each_step_once() {
    let path = sqlite_path("sqlite-comp");
    let args = [
        "sqlite".to_owned(),
        "--sqlite".into(),
        path.display().to_string(),
    ];
    kill_mid_compensation(&args, &Tables::Sqlite(path.clone())).await;
    remove_sqlite(&path);
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_kill_mid_compensation_compensates_each_step_once() {
    let url = services::postgres_url();
    let Some(admin) = services::reachable(
        "PostgreSQL",
        &url,
        PgPoolOptions::new().max_connections(2).connect(&url).await,
    ) else {
        return;
    };
    let schema = format!("idem_test_crash_comp_{}", random_hex());
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await
        .expect("create schema");
    let args = [
        "postgres".to_owned(),
        "--postgres".into(),
        url.clone(),
        "--schema".into(),
        schema.clone(),
    ];
    let tables = Tables::Pg {
        admin: admin.clone(),
        schema: schema.clone(),
    };
    kill_mid_compensation(&args, &tables).await;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&admin)
        .await
        .expect("drop schema");
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_a_kill_mid_compensation_compensates_each_step_once() {
    let url = services::redis_url();
    if services::reachable("Redis", &url, RedisStore::connect(&url).await).is_none() {
        return;
    }
    let path = sqlite_path("redis-comp");
    let prefix = format!("idem-test:crash-comp:{}:", random_hex());
    let args = [
        "redis".to_owned(),
        "--redis".into(),
        url.clone(),
        "--prefix".into(),
        prefix,
        "--sqlite".into(),
        path.display().to_string(),
    ];
    kill_mid_compensation(&args, &Tables::Sqlite(path.clone())).await;
    remove_sqlite(&path);
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_kill_inside_step_three_leaves_each_effect_once() {
    let url = services::postgres_url();
    let Some(admin) = services::reachable(
        "PostgreSQL",
        &url,
        PgPoolOptions::new().max_connections(2).connect(&url).await,
    ) else {
        return;
    };
    for point in KILL_POINTS {
        let schema = format!("idem_test_crash_{}", random_hex());
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&admin)
            .await
            .expect("create schema");
        let args = [
            "postgres".to_owned(),
            "--postgres".into(),
            url.clone(),
            "--schema".into(),
            schema.clone(),
        ];
        let tables = Tables::Pg {
            admin: admin.clone(),
            schema: schema.clone(),
        };
        kill_and_retry(&args, &tables, point).await;
        sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
            .execute(&admin)
            .await
            .expect("drop schema");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_a_kill_inside_step_three_leaves_each_effect_once() {
    let url = services::redis_url();
    if services::reachable("Redis", &url, RedisStore::connect(&url).await).is_none() {
        return;
    }
    for point in KILL_POINTS {
        let path = sqlite_path("redis");
        // Records expire with the flow's ttl; a prefix of its own keeps this
        // run's records apart from every other.
        let prefix = format!("idem-test:crash:{}:", random_hex());
        let args = [
            "redis".to_owned(),
            "--redis".into(),
            url.clone(),
            "--prefix".into(),
            prefix,
            "--sqlite".into(),
            path.display().to_string(),
        ];
        let tables = Tables::Sqlite(path.clone());
        kill_and_retry(&args, &tables, point).await;
        remove_sqlite(&path);
    }
}
