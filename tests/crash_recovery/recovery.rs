//! Abandoned flows finish on their own: the order flow made recoverable
//! (`#[idempotent(…, recover)]`), a process killed with SIGKILL inside step
//! two (after step one deducted the stock), and a recovery worker in another
//! process (`crash_order … worker`) that finishes it from the stored
//! argument. Each effect lands once; the client that comes back replays the
//! recovered result; a final error met during recovery compensates the
//! finished steps once; two workers at once recover each flow once; and a
//! worker never touches a live claim whose owner still heartbeats.
//!
//! On SQLite, PostgreSQL and Redis, like the rest of this file's crate.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use idem_runtime::store::redis::RedisStore;
use idem_tests::services;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::{Proc, Row, STOCK, Tables, ran, random_hex, remove_sqlite, sqlite_path};

/// Longer than the flows' 1 s lease: a killed owner's claim is abandoned by then.
const PAST_THE_LEASE: Duration = Duration::from_millis(1500);

/// One store and its business tables, removed at the end.
struct Env {
    args: Vec<String>,
    tables: Tables,
    cleanup: Cleanup,
}

enum Cleanup {
    File(std::path::PathBuf),
    Schema(PgPool, String),
}

impl Env {
    async fn new(kind: &str) -> Option<Env> {
        match kind {
            "sqlite" => {
                let path = sqlite_path("recovery");
                Some(Env {
                    args: vec![
                        "sqlite".into(),
                        "--sqlite".into(),
                        path.display().to_string(),
                    ],
                    tables: Tables::Sqlite(path.clone()),
                    cleanup: Cleanup::File(path),
                })
            }
            "postgres" => {
                let url = services::postgres_url();
                let admin = services::reachable(
                    "PostgreSQL",
                    &url,
                    PgPoolOptions::new().max_connections(2).connect(&url).await,
                )?;
                let schema = format!("idem_test_recovery_{}", random_hex());
                sqlx::query(&format!("CREATE SCHEMA {schema}"))
                    .execute(&admin)
                    .await
                    .expect("create schema");
                Some(Env {
                    args: vec![
                        "postgres".into(),
                        "--postgres".into(),
                        url,
                        "--schema".into(),
                        schema.clone(),
                    ],
                    tables: Tables::Pg {
                        admin: admin.clone(),
                        schema: schema.clone(),
                    },
                    cleanup: Cleanup::Schema(admin, schema),
                })
            }
            "redis" => {
                let url = services::redis_url();
                services::reachable("Redis", &url, RedisStore::connect(&url).await)?;
                let path = sqlite_path("recovery-redis");
                Some(Env {
                    args: vec![
                        "redis".into(),
                        "--redis".into(),
                        url,
                        "--prefix".into(),
                        format!("idem-test:recovery:{}:", random_hex()),
                        "--sqlite".into(),
                        path.display().to_string(),
                    ],
                    tables: Tables::Sqlite(path.clone()),
                    cleanup: Cleanup::File(path),
                })
            }
            other => panic!("no store {other}"),
        }
    }

    async fn remove(self) {
        match self.cleanup {
            Cleanup::File(path) => remove_sqlite(&path),
            Cleanup::Schema(admin, schema) => {
                sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
                    .execute(&admin)
                    .await
                    .expect("drop schema");
            }
        }
    }

    fn with(&self, extra: &[&str]) -> Vec<String> {
        let mut args = self.args.clone();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }
}

/// Starts a client that runs the recoverable flow (`mode`), lets it finish
/// step one and stop inside step two, and kills it there.
fn client_killed_in_step_two(env_args: &[String], client_order_no: &str, mode: &str) -> Proc {
    let mut client = Proc::start(env_args, client_order_no, mode);
    client.wait_for("at insert_order before-write");
    let status = client.kill();
    assert_eq!(
        status.signal(),
        Some(9),
        "not killed by SIGKILL: {status:?}"
    );
    client
}

/// Runs a worker process to its end; returns it and its final counts line.
fn worker(env_args: &[String], until: &[&str]) -> (Proc, String) {
    let mut args = env_args.to_vec();
    args.extend(until.iter().map(|s| s.to_string()));
    let mut worker = Proc::start(&args, "-", "worker");
    let status = worker.finish();
    let log = worker.transcript();
    assert!(status.success(), "the worker failed: {status:?}\n{log}");
    let last = worker
        .seen
        .iter()
        .rev()
        .find(|l| l.starts_with("worker "))
        .cloned()
        .unwrap_or_else(|| panic!("the worker printed no totals\n{log}"));
    (worker, last)
}

fn row(id: &str, refers_to: &str, made_by: i64) -> Row {
    Row {
        id: id.to_owned(),
        refers_to: refers_to.to_owned(),
        made_by,
    }
}

/// A client killed after step one; a worker finishes the flow; the client
/// comes back and replays the result.
async fn killed_client_is_finished_by_a_worker(env: &Env) {
    let order = format!("c-{}", random_hex());
    let args = env.args.clone();
    let (client, worker, back) = tokio::task::spawn_blocking(move || {
        let client = client_killed_in_step_two(&args, &order, "recover-kill-in-step-two");
        std::thread::sleep(PAST_THE_LEASE);
        let (worker, totals) = worker(&args, &["--until-idle", "1"]);
        assert_eq!(
            totals, "worker recovered=1 gave_up=0 failed=0 parked=0 busy=0",
            "{:?}",
            worker.seen
        );
        let mut back = Proc::start(&args, &order, "recover");
        let ok = back.finish().success();
        let log = back.transcript();
        assert!(ok, "{log}");
        (client, worker, back)
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    let context = format!(
        "client: {:?}\nworker: {:?}\nclient again: {:?}",
        client.seen, worker.seen, back.seen
    );

    let [(ticket, "new")] = ran(&client.seen, "deduct_stock")[..] else {
        panic!("the client should have deducted stock once\n{context}");
    };
    assert!(ran(&client.seen, "insert_order").is_empty(), "{context}");
    // The worker replayed step one and ran the rest.
    assert!(ran(&worker.seen, "deduct_stock").is_empty(), "{context}");
    let [(order_no, "new")] = ran(&worker.seen, "insert_order")[..] else {
        panic!("the worker should have created the order once\n{context}");
    };
    let [(coupon, "new")] = ran(&worker.seen, "issue_coupon")[..] else {
        panic!("the worker should have issued the coupon once\n{context}");
    };
    let [(message_id, "new")] = ran(&worker.seen, "publish")[..] else {
        panic!("the worker should have published once\n{context}");
    };
    // The client that came back ran nothing: it replayed the worker's result.
    assert_eq!(
        back.seen,
        [format!("result {ticket} {order_no} {coupon} {message_id}")],
        "{context}"
    );

    let got = env.tables.read().await;
    let (client_pid, worker_pid) = (client.pid(), worker.pid());
    assert_eq!(got.ledger, [row(ticket, "SKU-42", client_pid)], "{context}");
    assert_eq!(got.orders, [row(order_no, ticket, worker_pid)], "{context}");
    assert_eq!(
        got.coupons,
        [row(coupon, order_no, worker_pid)],
        "{context}"
    );
    assert_eq!(
        got.messages,
        [row(message_id, coupon, worker_pid)],
        "{context}"
    );
    assert_eq!(got.stock_left, STOCK - 1, "{context}");
}

/// A client of the giving-up variant killed after step one; the worker's run
/// meets the final error in step three and compensates step one once.
async fn final_error_during_recovery_compensates_once(env: &Env) {
    let order = format!("c-{}", random_hex());
    let args = env.args.clone();
    let reject = env.with(&["--reject", "1"]);
    let (client, worker, back) = tokio::task::spawn_blocking(move || {
        let client = client_killed_in_step_two(&args, &order, "recover-reject-kill-in-step-two");
        std::thread::sleep(PAST_THE_LEASE);
        let (worker, totals) = worker(&reject, &["--until-idle", "1"]);
        assert_eq!(
            totals, "worker recovered=0 gave_up=1 failed=0 parked=0 busy=0",
            "{:?}",
            worker.seen
        );
        let mut back = Proc::start(&args, &order, "recover-reject");
        let ok = back.finish().success();
        let log = back.transcript();
        assert!(ok, "{log}");
        (client, worker, back)
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    let context = format!(
        "client: {:?}\nworker: {:?}\nclient again: {:?}",
        client.seen, worker.seen, back.seen
    );
    let [(ticket, "new")] = ran(&client.seen, "deduct_stock")[..] else {
        panic!("the client should have deducted stock once\n{context}");
    };
    let [(order_no, "new")] = ran(&worker.seen, "insert_order")[..] else {
        panic!("the worker should have created the order once\n{context}");
    };
    assert!(
        worker.seen.iter().any(|l| l == "ran issue_coupon rejected"),
        "{context}"
    );
    let [(cancellation, "new")] = ran(&worker.seen, "cancel_order")[..] else {
        panic!("the worker should have cancelled the order once\n{context}");
    };
    let [(restore, "new")] = ran(&worker.seen, "restore_stock")[..] else {
        panic!("the worker should have restored the stock once\n{context}");
    };
    assert_eq!(back.seen, ["final coupon_rejected"], "{context}");

    let got = env.tables.read().await;
    let worker_pid = worker.pid();
    assert_eq!(
        got.ledger,
        [row(ticket, "SKU-42", client.pid())],
        "{context}"
    );
    assert_eq!(got.orders, [row(order_no, ticket, worker_pid)], "{context}");
    assert!(
        got.coupons.is_empty() && got.messages.is_empty(),
        "{context}"
    );
    assert_eq!(
        got.cancellations,
        [row(cancellation, order_no, worker_pid)],
        "{context}"
    );
    assert_eq!(
        got.restores,
        [row(restore, ticket, worker_pid)],
        "{context}"
    );
    assert_eq!(
        got.stock_left, STOCK,
        "deducted once, restored once\n{context}"
    );
}

/// Three abandoned flows and two workers started at once: each flow is
/// recovered by one of them, once.
async fn two_workers_recover_each_flow_once(env: &Env) {
    let args = env.args.clone();
    let (clients, workers) = tokio::task::spawn_blocking(move || {
        let clients: Vec<Proc> = (0..3)
            .map(|_| {
                let order = format!("c-{}", random_hex());
                client_killed_in_step_two(&args, &order, "recover-kill-in-step-two")
            })
            .collect();
        std::thread::sleep(PAST_THE_LEASE);
        let both: Vec<_> = (0..2)
            .map(|_| {
                let args = args.clone();
                std::thread::spawn(move || worker(&args, &["--until-idle", "1"]))
            })
            .collect();
        let workers: Vec<(Proc, String)> = both
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect();
        (clients, workers)
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    let context = format!(
        "worker 1: {:?}\nworker 2: {:?}",
        workers[0].0.seen, workers[1].0.seen
    );
    let recovered: u32 = workers
        .iter()
        .map(|(_, totals)| {
            let n = totals
                .split(' ')
                .find_map(|w| w.strip_prefix("recovered="))
                .expect("a recovered count");
            n.parse::<u32>().expect("a number")
        })
        .sum();
    assert_eq!(recovered, 3, "{context}");
    let ran_in_workers = |step| {
        workers
            .iter()
            .map(|(w, _)| ran(&w.seen, step).len())
            .sum::<usize>()
    };
    for step in ["insert_order", "issue_coupon", "publish"] {
        assert_eq!(
            ran_in_workers(step),
            3,
            "{step} ran once per flow\n{context}"
        );
    }
    assert_eq!(ran_in_workers("deduct_stock"), 0, "{context}");
    for (w, _) in &workers {
        assert!(
            ran(&w.seen, "insert_order")
                .iter()
                .all(|(_, how)| *how == "new"),
            "a step met a row another worker wrote: it ran twice\n{context}"
        );
    }
    let got = env.tables.read().await;
    assert_eq!(got.ledger.len(), 3, "{context}");
    for table in [&got.orders, &got.coupons, &got.messages] {
        assert_eq!(table.len(), 3, "{context}");
    }
    assert_eq!(got.stock_left, STOCK - 3, "{context}");
    drop(clients);
}

/// A client alive in step two, its heartbeat renewing a 1 s lease: a worker
/// passing for several leases touches nothing. Once the client is killed,
/// the next worker finishes the flow (so the first one had something to find).
async fn a_live_claim_is_never_touched(env: &Env) {
    let order = format!("c-{}", random_hex());
    let args = env.args.clone();
    let (idle, after) = tokio::task::spawn_blocking(move || {
        let mut client = Proc::start(&args, &order, "recover-kill-in-step-two");
        client.wait_for("at insert_order before-write");
        let (idle, totals) = worker(&args, &["--for-ms", "3500"]);
        assert_eq!(
            totals, "worker recovered=0 gave_up=0 failed=0 parked=0 busy=0",
            "{:?}",
            idle.seen
        );
        assert!(
            idle.seen.iter().all(|l| l.starts_with("worker ")),
            "the worker found or ran something beside a live owner: {:?}",
            idle.seen
        );
        assert!(
            client.is_running(),
            "the owner must still be alive at the end: {:?}",
            client.seen
        );
        client.kill();
        std::thread::sleep(PAST_THE_LEASE);
        let (after, totals) = worker(&args, &["--until-idle", "1"]);
        assert_eq!(
            totals, "worker recovered=1 gave_up=0 failed=0 parked=0 busy=0",
            "{:?}",
            after.seen
        );
        (idle, after)
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    assert_eq!(
        ran(&after.seen, "insert_order").len(),
        1,
        "{:?}",
        after.seen
    );
    assert!(ran(&idle.seen, "insert_order").is_empty());
    let got = env.tables.read().await;
    assert_eq!(got.orders.len(), 1);
    assert_eq!(got.stock_left, STOCK - 1);
}

macro_rules! on_each_store {
    ($($scenario:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $scenario() {
                let env = super::Env::new("sqlite").await.expect("sqlite needs no server");
                super::$scenario(&env).await;
                env.remove().await;
            })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $scenario() {
                let Some(env) = super::Env::new("postgres").await else { return };
                super::$scenario(&env).await;
                env.remove().await;
            })*
        }
        mod redis {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $scenario() {
                let Some(env) = super::Env::new("redis").await else { return };
                super::$scenario(&env).await;
                env.remove().await;
            })*
        }
    };
}

on_each_store!(
    killed_client_is_finished_by_a_worker,
    final_error_during_recovery_compensates_once,
    two_workers_recover_each_flow_once,
    a_live_claim_is_never_touched,
);
