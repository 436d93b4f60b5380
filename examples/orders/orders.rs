//! The README's story, end to end, on the embedded default (SQLite, one file):
//! a double click, a replay five minutes later, a retry after a flaky downstream
//! and a genuinely new order. Each order's "order created" message goes into
//! the transactional outbox with the order, and a relay hands it to an
//! in-process consumer that ships each order once, even when the relay
//! publishes a message twice. Every scenario is checked against the tables; any
//! difference makes the program exit with status 1.
//!
//! Run: `cargo run --example orders`

use std::collections::HashMap;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use idem_runtime::consumer::testing::Memory;
use idem_runtime::consumer::{Acked, Action, BrokerError, Envelope, Runner};
use idem_runtime::outbox::sink::{MemorySink, Sink};
use idem_runtime::outbox::{self, Message, Outgoing, Relay};
use idem_runtime::store::sql::SqliteStore;
use idem_runtime::store::{AsStore, StoreRef};
use idem_runtime::unique::{Found, InsertOnce};
use idem_runtime::{ManualClock, idempotent, step};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, SqlitePool};

const SKU: &str = "SKU-42";

// The business tables live beside idem's records. Their UNIQUE constraints are
// the backstop (唯一索引兜底): even if a duplicate slipped past idem, the database
// would refuse a second order or a second stock movement for the same intent.
const SCHEMA: &str = "
CREATE TABLE orders (
    id INTEGER PRIMARY KEY, user_id INTEGER NOT NULL, client_order_no TEXT NOT NULL,
    sku TEXT NOT NULL, qty INTEGER NOT NULL,
    UNIQUE (user_id, client_order_no));
CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL CHECK (qty >= 0));
CREATE TABLE stock_ledger (
    id INTEGER PRIMARY KEY, user_id INTEGER NOT NULL, client_order_no TEXT NOT NULL,
    sku TEXT NOT NULL, delta INTEGER NOT NULL,
    UNIQUE (user_id, client_order_no, sku));
INSERT INTO stock (sku, qty) VALUES ('SKU-42', 10);";

#[derive(Debug, Clone)]
struct CreateOrder {
    user_id: i64,
    sku: String,
    qty: i64,
    client_order_no: String, // the client's stable anchor: the same on every retry
}

/// What the caller gets, and what idem stores and replays to duplicates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Order {
    id: i64,
    coupon: String,
}

/// The message every new order publishes, through the outbox.
#[derive(Debug, Serialize, Deserialize)]
struct OrderCreated {
    order_id: i64,
    sku: String,
    qty: i64,
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    Codec(#[from] idem_runtime::CodecError),
    #[error(transparent)]
    Outbox(#[from] outbox::OutboxError),
    #[error("not enough stock for {0}")]
    OutOfStock(String),
    #[error("the coupon service is down")]
    CouponServiceDown,
}

struct OrderService {
    store: StoreRef,         // idem's records (here the same SQLite file)
    db: SqlitePool,          // the business tables and the outbox
    coupon_down: AtomicBool, // set: the next coupon call fails
    // The (pretend) coupon provider: the coupons it handed out, by the
    // idempotency key it was sent (a real provider deduplicates on it too).
    coupons: Mutex<HashMap<String, String>>,
    shipped: AtomicU32, // what the consumer of "order created" shipped
}

impl OrderService {
    fn db(&self) -> &SqlitePool {
        &self.db
    }

    fn coupons_issued(&self) -> usize {
        self.coupons.lock().unwrap().len()
    }

    // The key is the business intent, never a timestamp or a request id. `wait`
    // makes a concurrent duplicate wait for the first call and get its result.
    #[idempotent(scope = "orders.create", key = "req.user_id|req.sku|req.client_order_no", ttl = "24h", wait = "5s", store = self.store.clone())]
    async fn create_order(&self, req: CreateOrder) -> Result<Order, AppError> {
        self.deduct_stock(&req).await?;
        let id = self.insert_order(&req).await?;
        let coupon = self.issue_coupon(id).await?;
        Ok(Order { id, coupon })
    }

    // 唯一流水 + 条件更新: the ledger row is written first, under its UNIQUE key, and
    // stock moves only if that row is new; both commit together. If a crash lands
    // between this commit and idem marking the step done, the retry finds the row
    // and returns it (冲突即成功) instead of deducting again or failing forever.
    #[step("deduct_stock")]
    async fn deduct_stock(&self, req: &CreateOrder) -> Result<i64, AppError> {
        // `InsertOnce` appends `ON CONFLICT (…) DO NOTHING` and says whether the
        // row is new; a duplicate is counted in `idem_unique_conflicts_total`.
        let ledger = InsertOnce::<Sqlite>::new(
            "orders.stock_ledger",
            "INSERT INTO stock_ledger (user_id, client_order_no, sku, delta) VALUES (?1, ?2, ?3, ?4)",
            &["user_id", "client_order_no", "sku"],
        )?;
        let mut tx = self.db().begin().await?;
        let new = ledger
            .run(&mut *tx, |q| {
                q.bind(req.user_id)
                    .bind(&req.client_order_no)
                    .bind(&req.sku)
                    .bind(-req.qty)
            })
            .await?;
        let ledger_id = sqlx::query_scalar(
            "SELECT id FROM stock_ledger WHERE user_id = ?1 AND client_order_no = ?2 AND sku = ?3",
        )
        .bind(req.user_id)
        .bind(&req.client_order_no)
        .bind(&req.sku)
        .fetch_one(&mut *tx)
        .await?;
        if !new {
            return Ok(ledger_id);
        }
        let updated = sqlx::query("UPDATE stock SET qty = qty - ?1 WHERE sku = ?2 AND qty >= ?1")
            .bind(req.qty)
            .bind(&req.sku)
            .execute(&mut *tx)
            .await?;
        if updated.rows_affected() == 0 {
            // Dropping `tx` rolls the ledger row back with it.
            return Err(AppError::OutOfStock(req.sku.clone()));
        }
        tx.commit().await?;
        Ok(ledger_id)
    }

    // The order and its "order created" message commit together (the
    // transactional outbox): no order without its message, no message for an
    // order that rolled back. Its id derives from the step's key: the same on
    // every run of the step, so what deduplicates the step's write also
    // deduplicates its message. 冲突即成功 again: if a crash lands between
    // this commit and idem marking the step done, the retry finds the order
    // (and its message, committed with it) and returns it.
    #[step("insert_order")]
    async fn insert_order(&self, req: &CreateOrder) -> Result<i64, AppError> {
        let order = InsertOnce::<Sqlite>::new(
            "orders.create",
            "INSERT INTO orders (user_id, client_order_no, sku, qty) VALUES (?1, ?2, ?3, ?4)",
            &["user_id", "client_order_no"],
        )?
        .returning(&["id"])?;
        let mut tx = self.db().begin().await?;
        let found = order
            .run(&mut tx, |q| {
                q.bind(req.user_id)
                    .bind(&req.client_order_no)
                    .bind(&req.sku)
                    .bind(req.qty)
            })
            .await?;
        let id = match found {
            Found::New((id,)) => id,
            Found::Existing((id,)) => return Ok(id),
        };
        let created = OrderCreated {
            order_id: id,
            sku: req.sku.clone(),
            qty: req.qty,
        };
        outbox::put(&mut tx, Message::json("orders.created", &created)?).await?;
        tx.commit().await?;
        Ok(id)
    }

    // The consumer of "order created", keyed on the message id alone: the
    // relay publishes at least once, and a second delivery is a replay.
    #[idempotent(consumer, event = "SHIP", key = "m.id", scope = "orders.ship", store = self.store.clone())]
    async fn ship(&self, m: Envelope<OrderCreated>) -> Result<(), AppError> {
        let _ = (m.body.order_id, m.body.qty); // hand the parcel over
        self.shipped.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    // An external call: no transaction can cover it. The step record keeps a
    // retry from calling again once the coupon is recorded; the step's key,
    // sent as the provider's idempotency key, covers a crash between the
    // provider's answer and that record (the provider hands the same coupon
    // back).
    #[step("issue_coupon")]
    async fn issue_coupon(&self, order_id: i64) -> Result<String, AppError> {
        if self.coupon_down.swap(false, Ordering::SeqCst) {
            return Err(AppError::CouponServiceDown);
        }
        let key = idem_runtime::current_key().expect("inside a step").to_hex();
        let mut coupons = self.coupons.lock().unwrap();
        Ok(coupons
            .entry(key)
            .or_insert(format!("CPN-{order_id}"))
            .clone())
    }
}

/// A broker that takes the first batch but whose confirmations never reach
/// the relay (the connection dropped after the publish): the relay cannot
/// tell that from a lost publish, so it publishes those messages again.
struct LostConfirmations {
    broker: MemorySink,
    lose_next: AtomicBool,
}

#[async_trait::async_trait]
impl Sink for LostConfirmations {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let confirmed = self.broker.publish(batch).await;
        if !self.lose_next.swap(false, Ordering::SeqCst) {
            return confirmed;
        }
        let lost = || Err(BrokerError::new("memory", "the confirmation was lost"));
        confirmed.iter().map(|_| lost()).collect()
    }
}

/// Prints each check and remembers the ones that failed.
#[derive(Default)]
struct Report {
    scenario: String,
    checks: usize,
    failed: Vec<String>,
}

impl Report {
    fn scenario(&mut self, title: &str) {
        println!("\n{title}");
        self.scenario = title.split(':').next().unwrap_or(title).to_owned();
    }

    fn check(&mut self, what: &str, ok: bool) {
        self.checks += 1;
        println!("  [{}] {what}", if ok { "ok " } else { "BAD" });
        if !ok {
            self.failed.push(format!("{}: {what}", self.scenario));
        }
    }

    /// Counts orders, stock movements, stock left and coupons issued, and
    /// compares them with what one execution per intent leaves behind.
    async fn tables(&mut self, svc: &OrderService, want: [i64; 4]) {
        let count = |sql| async move {
            let n = sqlx::query_scalar(sql).fetch_one(svc.db()).await;
            n.unwrap_or(-1)
        };
        let got = [
            count("SELECT COUNT(*) FROM orders").await,
            count("SELECT COUNT(*) FROM stock_ledger").await,
            count("SELECT qty FROM stock WHERE sku = 'SKU-42'").await,
            svc.coupons_issued() as i64,
        ];
        let [o, m, s, c] = got;
        let mut line = format!("orders {o}, stock movements {m}, stock left {s}, coupons {c}");
        if got != want {
            line += &format!(" -- expected {want:?}");
        }
        self.check(&line, got == want);
    }
}

fn request(client_order_no: &str) -> CreateOrder {
    CreateOrder {
        user_id: 7,
        sku: SKU.into(),
        qty: 2,
        client_order_no: client_order_no.into(),
    }
}

fn show(who: &str, r: &Result<Order, AppError>) {
    match r {
        Ok(o) => println!("  {who}: order #{} with coupon {}", o.id, o.coupon),
        Err(e) => println!("  {who}: error: {e}"),
    }
}

async fn scenarios(svc: &OrderService, clock: &ManualClock, report: &mut Report) {
    report.scenario("1. Double click: the same request twice, at the same time");
    let (a, b) = tokio::join!(
        svc.create_order(request("c-1001")),
        svc.create_order(request("c-1001"))
    );
    show("caller A", &a);
    show("caller B", &b);
    println!("  (wait = \"5s\": the duplicate waits for the first call and gets its order)");
    let first = a.as_ref().ok().or(b.as_ref().ok()).cloned();
    let same = matches!((&a, &b), (Ok(x), Ok(y)) if x == y);
    report.check("both callers got the same order", same);
    report.tables(svc, [1, 1, 8, 1]).await; // orders, movements, stock left, coupons

    report.scenario("2. Replay: the same request again, five minutes later");
    clock.advance(Duration::from_secs(5 * 60));
    println!("  (the store's ManualClock moved 5 minutes forward; nobody slept)");
    let again = svc.create_order(request("c-1001")).await;
    show("caller", &again);
    report.check(
        "the first order was replayed",
        again.is_ok() && again.ok() == first,
    );
    report.tables(svc, [1, 1, 8, 1]).await;

    report.scenario("3. Retry after a failure: the coupon service is down for the first call");
    svc.coupon_down.store(true, Ordering::SeqCst);
    let failed = svc.create_order(request("c-1002")).await;
    show("first call", &failed);
    let coupon_failed = matches!(failed, Err(AppError::CouponServiceDown));
    report.check("the call failed on the coupon", coupon_failed);
    println!("  stock deducted and order inserted stay; the coupon is still owed:");
    report.tables(svc, [2, 2, 6, 1]).await;
    let retry = svc.create_order(request("c-1002")).await;
    show("retry", &retry);
    println!("  (deduct_stock and insert_order replayed their saved outputs; issue_coupon ran)");
    report.check("the retry succeeded", retry.is_ok());
    report.tables(svc, [2, 2, 6, 2]).await;

    report.scenario("4. A genuinely new order: another client_order_no");
    let new = svc.create_order(request("c-1003")).await;
    show("caller", &new);
    report.check("a new order was created", new.is_ok());
    report.tables(svc, [3, 3, 4, 3]).await;

    report.scenario("5. The backstop: insert order c-1001 again, bypassing idem");
    let bypass = sqlx::query(
        "INSERT INTO orders (user_id, client_order_no, sku, qty) VALUES (7, 'c-1001', 'SKU-42', 2)",
    )
    .execute(svc.db())
    .await;
    let refused = matches!(&bypass, Err(sqlx::Error::Database(e)) if e.is_unique_violation());
    report.check("refused by UNIQUE (user_id, client_order_no)", refused);
    report.tables(svc, [3, 3, 4, 3]).await;

    report.scenario("6. A crash after the stock commit, before idem marked the step done");
    // Simulated by running the step outside any idempotent call: its business
    // commit lands, no step record does.
    let ticket = svc.deduct_stock(&request("c-1004")).await;
    report.check("the stock moved with no step record", ticket.is_ok());
    report.tables(svc, [3, 4, 2, 3]).await;
    let resumed = svc.create_order(request("c-1004")).await;
    show("the client's retry", &resumed);
    println!(
        "  (deduct_stock found its ledger row and returned it: 冲突即成功, no second deduction)"
    );
    report.check("the retry completed the order", resumed.is_ok());
    report.tables(svc, [4, 4, 2, 4]).await;
}

async fn relay_and_consume(
    svc: &OrderService,
    report: &mut Report,
) -> Result<(), Box<dyn std::error::Error>> {
    report.scenario("7. The outbox: each order's message, relayed once its transaction committed");
    let count = |sql| sqlx::query_scalar::<_, i64>(sql).fetch_one(svc.db());
    let written = count("SELECT COUNT(*) FROM idem_outbox").await?;
    report.check(
        &format!("{written} messages waiting for 4 orders (duplicates and retries wrote none)"),
        written == 4,
    );
    let (broker, mut inbox) = MemorySink::channel(64);
    let sink = LostConfirmations {
        broker,
        lose_next: AtomicBool::new(true),
    };
    // No backoff, so the retry is due in the next round rather than in a second.
    let relay = Relay::builder(svc.db().clone(), sink)
        .backoff(Duration::ZERO, Duration::ZERO)
        .build();
    let round = relay.run_once().await?;
    println!(
        "  relay round 1: {} claimed, {} confirmed, {} failed (the broker took them; the confirmations were lost)",
        round.claimed, round.published, round.failed
    );
    let round = relay.run_once().await?;
    println!(
        "  relay round 2: {} claimed, {} confirmed and marked sent (the same messages again: at least once)",
        round.claimed, round.published
    );

    let runner = Runner::new();
    let ship = |m: Envelope<OrderCreated>| svc.ship(m);
    while let Ok(m) = inbox.try_recv() {
        let order: OrderCreated = serde_json::from_slice(&m.payload)?;
        let delivery = Memory::new(&m.payload).with_message_id(m.id.as_str());
        let what = match runner.process(delivery, &ship).await? {
            Action::Acked(Acked::Processed) => "shipped".to_owned(),
            Action::Acked(Acked::Deduplicated) => "a duplicate: acked, not shipped".to_owned(),
            other => format!("{other:?}"),
        };
        println!(
            "  consumer: message {}… (order #{}): {what}",
            &m.id.as_str()[..8],
            order.order_id
        );
    }
    let stats = runner.stats();
    let shipped = svc.shipped.load(Ordering::SeqCst);
    report.check(
        &format!(
            "{} deliveries: {} shipped, {} deduplicated on the message id",
            stats.delivered, shipped, stats.deduplicated
        ),
        stats.delivered == 8 && shipped == 4 && stats.deduplicated == 4,
    );
    let pending = count("SELECT COUNT(*) FROM idem_outbox WHERE state <> 1").await?;
    report.check(&format!("messages still to send: {pending}"), pending == 0);
    Ok(())
}

fn remove_db(path: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    // A fresh file per run (the pid keeps parallel runs apart), removed at the end.
    let path = std::env::temp_dir().join(format!("idem-orders-{}.db", std::process::id()));
    remove_db(&path);
    // The store's clock drives leases and expiry; a ManualClock lets us jump ahead.
    let clock = ManualClock::default();
    let store = SqliteStore::builder()
        .clock(clock.clone())
        .open(&path)
        .await?;
    println!(
        "SQLite file: {} (idem records beside the business tables)",
        path.display()
    );
    sqlx::raw_sql(SCHEMA).execute(store.pool()).await?;
    println!("stock: {SKU} = 10; every order takes 2");

    let svc = OrderService {
        db: store.pool().clone(),
        store: store.store_ref(),
        coupon_down: AtomicBool::new(false),
        coupons: Mutex::default(),
        shipped: AtomicU32::new(0),
    };
    let mut report = Report::default();
    scenarios(&svc, &clock, &mut report).await;
    relay_and_consume(&svc, &mut report).await?;
    svc.db.close().await;
    remove_db(&path);

    let (n, failed) = (report.checks, &report.failed);
    if failed.is_empty() {
        println!(
            "\nsummary: all {n} checks passed: one order, one stock movement, one shipment per intent"
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!("\nsummary: {} of {n} checks FAILED:", failed.len());
        failed.iter().for_each(|f| println!("  - {f}"));
        Ok(ExitCode::FAILURE)
    }
}

/// The explorer (`idem_runtime::testing`) over this flow: at every claim and
/// record of the call and its three steps, a caller cut off, a duplicate, a
/// stale owner; the tables and the coupons must come out as one clean run
/// leaves them. (It found `insert_order` failing on its own row after a
/// crash before its record; `tests/explorer.rs` shows the reports of the
/// broken variants.)
#[cfg(test)]
mod explored {
    use std::sync::Arc;

    use idem_runtime::testing::Explorer;

    use super::*;

    async fn fresh(store: StoreRef) -> Arc<OrderService> {
        // The business tables (and the outbox's) on a database of their own.
        let tables = SqliteStore::builder().in_memory().await.expect("SQLite");
        sqlx::raw_sql(SCHEMA)
            .execute(tables.pool())
            .await
            .expect("schema");
        Arc::new(OrderService {
            store,
            db: tables.pool().clone(),
            coupon_down: AtomicBool::new(false),
            coupons: Mutex::default(),
            shipped: AtomicU32::new(0),
        })
    }

    async fn snapshot(svc: Arc<OrderService>) -> [i64; 5] {
        let count = |sql| sqlx::query_scalar::<_, i64>(sql).fetch_one(svc.db());
        [
            count("SELECT COUNT(*) FROM orders").await.unwrap(),
            count("SELECT COUNT(*) FROM stock_ledger").await.unwrap(),
            count("SELECT qty FROM stock WHERE sku = 'SKU-42'")
                .await
                .unwrap(),
            count("SELECT COUNT(*) FROM idem_outbox").await.unwrap(),
            svc.coupons_issued() as i64,
        ]
    }

    // Two broken versions of the flow, which the explorer must catch.
    impl OrderService {
        /// Stock taken by a write in the body, outside any step.
        #[idempotent(scope = "orders.create.broken_body", key = "req.client_order_no", store = self.store.clone())]
        async fn create_order_writing_in_the_body(
            &self,
            req: CreateOrder,
        ) -> Result<Order, AppError> {
            self.deduct_stock(&req).await?;
            let id = self.insert_order(&req).await?;
            sqlx::query("UPDATE stock SET qty = qty - 1 WHERE sku = ?1")
                .bind(&req.sku)
                .execute(self.db())
                .await?;
            let coupon = self.issue_coupon(id).await?;
            Ok(Order { id, coupon })
        }

        /// `insert_order` as it was: a plain INSERT, which fails on the
        /// order a crashed attempt already committed.
        #[idempotent(scope = "orders.create.broken_step", key = "req.client_order_no", store = self.store.clone())]
        async fn create_order_failing_on_its_own_row(
            &self,
            req: CreateOrder,
        ) -> Result<Order, AppError> {
            self.deduct_stock(&req).await?;
            let id = self.insert_order_plainly(&req).await?;
            let coupon = self.issue_coupon(id).await?;
            Ok(Order { id, coupon })
        }

        #[step("insert_order")]
        async fn insert_order_plainly(&self, req: &CreateOrder) -> Result<i64, AppError> {
            let id = sqlx::query_scalar(
                "INSERT INTO orders (user_id, client_order_no, sku, qty) VALUES (?1, ?2, ?3, ?4) RETURNING id",
            )
            .bind(req.user_id)
            .bind(&req.client_order_no)
            .bind(&req.sku)
            .bind(req.qty)
            .fetch_one(self.db())
            .await?;
            Ok(id)
        }
    }

    #[tokio::test]
    async fn a_write_in_the_body_is_caught() {
        let report = Explorer::new(
            fresh,
            |svc: Arc<OrderService>| async move {
                svc.create_order_writing_in_the_body(request("c-1")).await
            },
            snapshot,
        )
        .run()
        .await;
        let failure = report.failure().expect("caught");
        assert_eq!(
            failure.schedule(),
            "call 1 stalls past its lease before its store operation #2 (claim step `deduct_stock`), another takes over, then call 1 goes on",
            "{report}"
        );
        assert_eq!(
            failure.problem(),
            "the state differs from the clean run's:\n  clean run: 7,\n  this run:  6,",
            "{report}"
        );
    }

    #[tokio::test]
    async fn a_step_that_fails_on_its_own_row_is_caught() {
        let report = Explorer::new(
            fresh,
            |svc: Arc<OrderService>| async move {
                svc.create_order_failing_on_its_own_row(request("c-1"))
                    .await
            },
            snapshot,
        )
        .run()
        .await;
        let failure = report.failure().expect("caught");
        assert_eq!(
            failure.schedule(),
            "call 1 cut off before its store operation #5 (record the outcome of step `insert_order`)",
            "{report}"
        );
        assert_eq!(
            failure.problem(),
            "the call did not succeed in 5 retries",
            "{report}"
        );
        assert!(
            report
                .to_string()
                .contains("UNIQUE constraint failed: orders.user_id, orders.client_order_no"),
            "{report}"
        );
    }

    #[tokio::test]
    async fn every_fault_point_leaves_one_order_one_movement_one_message_one_coupon() {
        let report = Explorer::new(
            fresh,
            |svc: Arc<OrderService>| async move { svc.create_order(request("c-1")).await },
            snapshot,
        )
        .step_history(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/steps/orders.create.txt"
        ))
        .run()
        .await;
        report.assert_passed();
        assert_eq!(report.explored(), 33, "{report}");
    }
}
