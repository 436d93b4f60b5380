//! The claim protocol as users meet it: through `#[idempotent]` and `#[step]`.
//!
//! Every annotated function names its store with `store = …` (a field of the
//! service it belongs to), and nothing here calls `idem_runtime::install`: one
//! test checks that a call with no store at all fails with `Error::NoStore`.
//!
//! Time-dependent cases run on a `ManualClock` and never sleep; the two that
//! need real concurrency (heartbeat, wait) stay well under two seconds.

use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::store::StoreRef;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::sql::SqliteStore;
use idem_runtime::store::{Claim, ClaimRequest, Completion, RecordInfo, Store, Token};
use idem_runtime::{Error, Key, ManualClock, StoreError, idempotent, step};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

const HOUR: Duration = Duration::from_secs(3600);
const MINUTE: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("the body failed on purpose")]
    Boom,
}

/// The idempotency error inside `r`, or a panic naming what came instead.
fn idem_err<T: Debug>(r: Result<T, AppError>) -> Error {
    match r {
        Err(AppError::Idem(e)) => e,
        other => panic!("expected an idempotency error, got {other:?}"),
    }
}

fn count(c: &AtomicUsize) -> usize {
    c.load(SeqCst)
}

fn manual_store() -> (MemoryStore, ManualClock) {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    (store, clock)
}

// ---------------------------------------------------------------------------
// Replay, ttl, and the error policy
// ---------------------------------------------------------------------------

#[derive(Default)]
struct Orders {
    store: MemoryStore,
    runs: AtomicUsize,
    fail_next: AtomicBool,
}

impl Orders {
    fn on(store: MemoryStore) -> Self {
        Orders {
            store,
            ..Orders::default()
        }
    }

    #[idempotent(scope = "protocol.Orders.create", key = "order_id", store = self.store)]
    async fn create(&self, order_id: u64) -> Result<String, AppError> {
        let n = self.runs.fetch_add(1, SeqCst) + 1;
        if self.fail_next.swap(false, SeqCst) {
            return Err(AppError::Boom);
        }
        Ok(format!("order-{order_id}-run-{n}"))
    }
}

#[tokio::test]
async fn a_duplicate_replays_the_first_result_and_another_key_runs() {
    let orders = Orders::default();

    assert_eq!(orders.create(1).await.unwrap(), "order-1-run-1");
    assert_eq!(orders.create(1).await.unwrap(), "order-1-run-1");
    assert_eq!(
        count(&orders.runs),
        1,
        "the duplicate must not run the body"
    );

    assert_eq!(orders.create(2).await.unwrap(), "order-2-run-2");
    assert_eq!(count(&orders.runs), 2, "a different key runs the body");
    assert_eq!(orders.create(2).await.unwrap(), "order-2-run-2");
    assert_eq!(orders.create(1).await.unwrap(), "order-1-run-1");
    assert_eq!(count(&orders.runs), 2);
}

#[tokio::test]
async fn a_record_replays_for_its_whole_ttl_and_then_expires() {
    let (store, clock) = manual_store();
    let orders = Orders::on(store);

    assert_eq!(orders.create(7).await.unwrap(), "order-7-run-1");

    clock.advance(23 * HOUR + 59 * MINUTE);
    assert_eq!(orders.create(7).await.unwrap(), "order-7-run-1");
    assert_eq!(count(&orders.runs), 1, "still within the 24h ttl: replayed");

    clock.advance(2 * MINUTE); // 24h01m after completion
    assert_eq!(orders.create(7).await.unwrap(), "order-7-run-2");
    assert_eq!(count(&orders.runs), 2, "past the ttl: a fresh execution");

    assert_eq!(orders.create(7).await.unwrap(), "order-7-run-2");
    assert_eq!(count(&orders.runs), 2);
}

#[tokio::test]
async fn an_err_releases_the_claim_so_a_retry_runs_again() {
    let orders = Orders::default();
    orders.fail_next.store(true, SeqCst);

    assert!(matches!(orders.create(3).await, Err(AppError::Boom)));
    assert_eq!(count(&orders.runs), 1);

    // Right away, not after a lease: the claim was released.
    assert_eq!(orders.create(3).await.unwrap(), "order-3-run-2");
    assert_eq!(count(&orders.runs), 2);

    assert_eq!(orders.create(3).await.unwrap(), "order-3-run-2");
    assert_eq!(orders.create(3).await.unwrap(), "order-3-run-2");
    assert_eq!(count(&orders.runs), 2, "the success is replayed");
}

/// An error type that can be stored: its final variants are replayed.
#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
enum PayError {
    #[error("declined: {reason}")]
    Declined { reason: String },
    #[error("the gateway timed out")]
    GatewayTimeout,
    #[error(transparent)]
    #[serde(skip)]
    Idem(#[from] Error),
}

impl PayError {
    fn is_final(&self) -> bool {
        matches!(self, PayError::Declined { .. })
    }
}

#[derive(Default)]
struct Payments {
    store: MemoryStore,
    runs: AtomicUsize,
}

impl Payments {
    #[idempotent(scope = "protocol.Payments.charge", key = "card", final_err = PayError::is_final, store = self.store)]
    async fn charge(&self, card: &str) -> Result<u64, PayError> {
        let n = self.runs.fetch_add(1, SeqCst) + 1;
        match card {
            "declined" => Err(PayError::Declined {
                reason: format!("insufficient funds (attempt {n})"),
            }),
            "flaky" => Err(PayError::GatewayTimeout),
            _ => Ok(100),
        }
    }
}

#[tokio::test]
async fn a_final_error_is_stored_and_replayed_a_non_final_one_is_not() {
    let pay = Payments::default();

    for _ in 0..3 {
        match pay.charge("declined").await {
            Err(PayError::Declined { reason }) => {
                assert_eq!(reason, "insufficient funds (attempt 1)")
            }
            other => panic!("expected the stored decline, got {other:?}"),
        }
    }
    assert_eq!(
        count(&pay.runs),
        1,
        "a final error is replayed, not retried"
    );

    for attempt in 1..=3 {
        assert!(matches!(
            pay.charge("flaky").await,
            Err(PayError::GatewayTimeout)
        ));
        assert_eq!(
            count(&pay.runs),
            1 + attempt,
            "a non-final error is retried"
        );
    }
}

// ---------------------------------------------------------------------------
// Concurrency: leases, takeover, heartbeat, waiting
// ---------------------------------------------------------------------------

/// A service whose first execution blocks until the test opens the gate.
#[derive(Default)]
struct Gated {
    store: MemoryStore,
    runs: AtomicUsize,
    started: Notify,
    gate: Notify,
}

impl Gated {
    fn on(store: MemoryStore) -> Self {
        Gated {
            store,
            ..Gated::default()
        }
    }

    async fn body(&self) -> String {
        let n = self.runs.fetch_add(1, SeqCst) + 1;
        if n == 1 {
            self.started.notify_one();
            self.gate.notified().await;
        }
        format!("run-{n}")
    }

    #[idempotent(key = "id", scope = "gated.run", store = self.store)]
    async fn run(&self, id: u64) -> Result<String, AppError> {
        Ok(self.body().await)
    }

    /// The same records as `run`, but a duplicate waits for the first call.
    #[idempotent(key = "id", scope = "gated.run", wait = "2s", store = self.store)]
    async fn run_waiting(&self, id: u64) -> Result<String, AppError> {
        Ok(self.body().await)
    }
}

#[tokio::test]
async fn a_lease_past_its_end_is_taken_over_and_the_stale_owner_is_fenced() {
    let (store, clock) = manual_store();
    let svc = Arc::new(Gated::on(store));

    let first = tokio::spawn({
        let svc = svc.clone();
        async move { svc.run(1).await }
    });
    svc.started.notified().await;

    // Within the (default 30 s) lease the claim holds.
    match idem_err(svc.run(1).await) {
        // A hint of when the first call is likely done, not the 30 s lease.
        Error::InProgress { retry_after, .. } => assert!(retry_after < Duration::from_secs(30)),
        other => panic!("expected InProgress, got {other:?}"),
    }
    assert_eq!(count(&svc.runs), 1);

    // The owner looks dead: its lease ran out without a heartbeat.
    clock.advance(Duration::from_secs(31));
    assert_eq!(
        svc.run(1).await.unwrap(),
        "run-2",
        "the second call takes over"
    );
    assert_eq!(count(&svc.runs), 2);

    // The stale owner finishes late: its caller gets its value...
    svc.gate.notify_one();
    assert_eq!(first.await.unwrap().unwrap(), "run-1");
    // ...but it cannot overwrite the record of the caller that took over.
    assert_eq!(svc.run(1).await.unwrap(), "run-2");
    assert_eq!(count(&svc.runs), 2);
}

#[derive(Default)]
struct LongRunning {
    store: MemoryStore,
    runs: AtomicUsize,
}

impl LongRunning {
    #[idempotent(scope = "protocol.LongRunning.work", key = "id", lease = "300ms", store = self.store)]
    async fn work(&self, id: u64) -> Result<usize, AppError> {
        let n = self.runs.fetch_add(1, SeqCst) + 1;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        Ok(n)
    }
}

#[tokio::test]
async fn a_heartbeat_keeps_a_long_body_from_being_taken_over() {
    let svc = Arc::new(LongRunning::default());
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { svc.work(1).await }
    });

    // Twice the lease: without renewals the claim would have been free to take.
    tokio::time::sleep(Duration::from_millis(600)).await;
    match idem_err(svc.work(1).await) {
        Error::InProgress { retry_after, .. } => {
            assert!(retry_after <= Duration::from_millis(300), "{retry_after:?}")
        }
        other => panic!("expected InProgress from a renewed lease, got {other:?}"),
    }
    assert_eq!(count(&svc.runs), 1, "the live owner was not taken over");

    assert_eq!(first.await.unwrap().unwrap(), 1);
    assert_eq!(svc.work(1).await.unwrap(), 1);
    assert_eq!(count(&svc.runs), 1);
}

#[tokio::test]
async fn with_wait_a_duplicate_returns_the_first_result_without_it_fails_fast() {
    let svc = Arc::new(Gated::default());
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { svc.run(5).await }
    });
    svc.started.notified().await;

    // No `wait`: fail fast.
    assert!(matches!(
        idem_err(svc.run(5).await),
        Error::InProgress { .. }
    ));

    // `wait = "2s"`: the duplicate polls the record until the first call is done.
    let waiter = tokio::spawn({
        let svc = svc.clone();
        async move { svc.run_waiting(5).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "the duplicate is waiting");

    svc.gate.notify_one();
    assert_eq!(first.await.unwrap().unwrap(), "run-1");
    assert_eq!(waiter.await.unwrap().unwrap(), "run-1");
    assert_eq!(count(&svc.runs), 1);
}

// ---------------------------------------------------------------------------
// Payload fingerprint, codec and size errors
// ---------------------------------------------------------------------------

struct Transfer {
    client_ref: String,
    amount: u64,
    currency: String,
}

#[derive(Default)]
struct Transfers {
    store: MemoryStore,
    runs: AtomicUsize,
}

impl Transfers {
    #[idempotent(scope = "protocol.Transfers.send", 
        key = "t.client_ref",
        fingerprint = "t.amount|t.currency",
        store = self.store
    )]
    async fn send(&self, t: Transfer) -> Result<String, AppError> {
        self.runs.fetch_add(1, SeqCst);
        Ok(format!("sent {} {}", t.amount, t.currency))
    }
}

#[tokio::test]
async fn same_key_with_another_fingerprint_is_key_reuse_not_a_replay() {
    let svc = Transfers::default();
    let t = |amount: u64, currency: &str| Transfer {
        client_ref: "tr-1".into(),
        amount,
        currency: currency.into(),
    };

    assert_eq!(svc.send(t(100, "EUR")).await.unwrap(), "sent 100 EUR");
    assert_eq!(svc.send(t(100, "EUR")).await.unwrap(), "sent 100 EUR");
    assert_eq!(count(&svc.runs), 1);

    for other in [t(999, "EUR"), t(100, "USD")] {
        match idem_err(svc.send(other).await) {
            Error::KeyReuse { scope } => assert!(scope.ends_with("send"), "{scope}"),
            e => panic!("expected KeyReuse, got {e:?}"),
        }
    }
    assert_eq!(count(&svc.runs), 1);
}

#[derive(Default)]
struct Codec {
    store: MemoryStore,
    text_runs: AtomicUsize,
    number_runs: AtomicUsize,
}

impl Codec {
    #[idempotent(key = "id", scope = "codec.shared", store = self.store)]
    async fn as_text(&self, id: u64) -> Result<String, AppError> {
        self.text_runs.fetch_add(1, SeqCst);
        Ok(format!("id {id}"))
    }

    #[idempotent(key = "id", scope = "codec.shared", store = self.store)]
    async fn as_email(&self, id: u64) -> Result<String, AppError> {
        Ok("jane.doe@example.com".into())
    }

    #[idempotent(key = "id", scope = "codec.shared", store = self.store)]
    async fn as_number(&self, id: u64) -> Result<u64, AppError> {
        self.number_runs.fetch_add(1, SeqCst);
        Ok(id)
    }
}

#[tokio::test]
async fn a_codec_error_never_quotes_the_stored_value() {
    let svc = Codec::default();
    // serde_json alone would say `invalid type: string "jane.doe@example.com"`.
    assert_eq!(svc.as_email(5).await.unwrap(), "jane.doe@example.com");
    let err = idem_err(svc.as_number(5).await);
    let Error::Codec { source, .. } = &err else {
        panic!("expected a codec error, got {err:?}");
    };
    assert_eq!(source.category(), serde_json::error::Category::Data);
    assert_eq!((source.line(), source.column()), (1, 22));
    for text in [err.to_string(), format!("{err:?}"), format!("{source:#?}")] {
        assert!(!text.contains("jane"), "the stored value leaked: {text}");
    }
    assert!(err.to_string().contains("line 1, column 22"), "{err}");
}

#[tokio::test]
async fn a_stored_result_of_another_type_is_a_codec_error_and_the_body_does_not_run() {
    let svc = Codec::default();
    assert_eq!(svc.as_text(4).await.unwrap(), "id 4");

    let err = idem_err(svc.as_number(4).await);
    assert!(matches!(&err, Error::Codec { scope, .. } if scope == "codec.shared"));
    assert!(err.to_string().contains("codec.shared"), "{err}");
    assert_eq!(count(&svc.number_runs), 0);
    assert_eq!(count(&svc.text_runs), 1);
}

#[derive(Default)]
struct Reports {
    store: MemoryStore,
    runs: AtomicUsize,
}

impl Reports {
    #[idempotent(scope = "protocol.Reports.render", key = "id", store = self.store)]
    async fn render(&self, id: u64) -> Result<String, AppError> {
        self.runs.fetch_add(1, SeqCst);
        Ok("x".repeat(1024))
    }
}

#[tokio::test]
async fn a_result_over_the_cap_reaches_its_caller_and_duplicates_get_result_too_large() {
    let svc = Reports {
        store: MemoryStore::builder().max_result_bytes(64).build(),
        ..Reports::default()
    };

    assert_eq!(svc.render(1).await.unwrap().len(), 1024);
    for _ in 0..2 {
        match idem_err(svc.render(1).await) {
            Error::ResultTooLarge { size, limit, .. } => {
                assert_eq!(limit, 64);
                assert!(size >= 1024, "{size}");
            }
            e => panic!("expected ResultTooLarge, got {e:?}"),
        }
    }
    assert_eq!(count(&svc.runs), 1, "never a second execution");
}

// ---------------------------------------------------------------------------
// Store failures and a missing store
// ---------------------------------------------------------------------------

/// A store whose every operation fails.
struct BrokenStore;

fn broken<T>() -> Result<T, StoreError> {
    Err(StoreError::new(
        "broken",
        "test:0",
        std::io::Error::other("connection refused"),
    ))
}

impl Store for BrokenStore {
    fn backend(&self) -> &'static str {
        "broken"
    }

    async fn claim(&self, _: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        broken()
    }

    async fn complete(&self, _: &Key, _: Token, _: Completion<'_>) -> Result<bool, StoreError> {
        broken()
    }

    async fn release(&self, _: &Key, _: Token) -> Result<bool, StoreError> {
        broken()
    }

    async fn renew(&self, _: &Key, _: Token, _: Duration) -> Result<bool, StoreError> {
        broken()
    }

    async fn inspect(&self, _: &Key) -> Result<Option<RecordInfo>, StoreError> {
        broken()
    }

    async fn evict(&self, _: &Key) -> Result<bool, StoreError> {
        broken()
    }

    async fn purge_expired(&self, _: usize) -> Result<u64, StoreError> {
        broken()
    }
}

struct Guarded {
    store: StoreRef,
    runs: AtomicUsize,
}

impl Guarded {
    fn on(store: StoreRef) -> Self {
        Guarded {
            store,
            runs: AtomicUsize::new(0),
        }
    }

    #[idempotent(scope = "protocol.Guarded.debit", key = "id", store = self.store)]
    async fn debit(&self, id: u64) -> Result<u64, AppError> {
        self.runs.fetch_add(1, SeqCst);
        Ok(id)
    }
}

#[tokio::test]
async fn a_failing_store_fails_closed_and_the_body_never_runs() {
    let svc = Guarded::on(StoreRef::new(BrokenStore));
    for _ in 0..2 {
        match idem_err(svc.debit(1).await) {
            Error::Store(e) => {
                assert_eq!(e.backend(), "broken");
                assert_eq!(e.location(), "test:0");
                assert!(e.to_string().contains("connection refused"), "{e}");
            }
            e => panic!("expected Error::Store, got {e:?}"),
        }
    }
    assert_eq!(count(&svc.runs), 0);
}

#[tokio::test]
async fn a_closed_sqlite_pool_fails_closed_with_an_error_naming_sqlite() {
    let sqlite = SqliteStore::in_memory().await.unwrap();
    let svc = Guarded::on(StoreRef::new(sqlite.clone()));

    // Working first, so the failure below is the closed pool and nothing else.
    assert_eq!(svc.debit(1).await.unwrap(), 1);
    assert_eq!(svc.debit(1).await.unwrap(), 1);
    assert_eq!(count(&svc.runs), 1);

    sqlite.pool().close().await;
    for id in [1, 2] {
        let err = idem_err(svc.debit(id).await);
        assert!(
            matches!(&err, Error::Store(e) if e.backend() == "sqlite"),
            "{err:?}"
        );
        assert!(err.to_string().contains("sqlite"), "{err}");
    }
    assert_eq!(count(&svc.runs), 1, "no body runs without a claim");
}

static NO_STORE_RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = "id")]
async fn without_a_store(id: u64) -> Result<u64, AppError> {
    NO_STORE_RUNS.fetch_add(1, SeqCst);
    Ok(id)
}

#[tokio::test]
async fn no_store_passed_and_none_installed_is_no_store() {
    assert!(matches!(idem_err(without_a_store(1).await), Error::NoStore));
    assert!(matches!(idem_err(without_a_store(1).await), Error::NoStore));
    assert_eq!(count(&NO_STORE_RUNS), 0);
}

// ---------------------------------------------------------------------------
// Steps
// ---------------------------------------------------------------------------

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    ticket: String,
    charge: String,
    notice: String,
}

#[derive(Default)]
struct Shop {
    store: MemoryStore,
    checkout_runs: AtomicUsize,
    reserve_runs: AtomicUsize,
    charge_runs: AtomicUsize,
    notify_runs: AtomicUsize,
    fail_notify_once: AtomicBool,
    ship_runs: AtomicUsize,
    label_runs: AtomicUsize,
    labels_seen: Mutex<Vec<Vec<String>>>,
    fail_ship_once: AtomicBool,
}

impl Shop {
    #[idempotent(scope = "protocol.Shop.checkout", key = "order_id", store = self.store)]
    async fn checkout(&self, order_id: u64) -> Result<Receipt, AppError> {
        self.checkout_runs.fetch_add(1, SeqCst);
        let ticket = self.reserve(order_id).await?;
        let charge = self.charge(order_id, &ticket).await?;
        let notice = self.notify(order_id).await?;
        Ok(Receipt {
            ticket,
            charge,
            notice,
        })
    }

    #[step("reserve")]
    async fn reserve(&self, order_id: u64) -> Result<String, AppError> {
        let n = self.reserve_runs.fetch_add(1, SeqCst) + 1;
        Ok(format!("ticket-{order_id}-{n}"))
    }

    #[step("charge")]
    async fn charge(&self, order_id: u64, ticket: &str) -> Result<String, AppError> {
        let n = self.charge_runs.fetch_add(1, SeqCst) + 1;
        Ok(format!("charge-{order_id}-{n} for {ticket}"))
    }

    #[step("notify")]
    async fn notify(&self, order_id: u64) -> Result<String, AppError> {
        let n = self.notify_runs.fetch_add(1, SeqCst) + 1;
        if self.fail_notify_once.swap(false, SeqCst) {
            return Err(AppError::Boom);
        }
        Ok(format!("notice-{order_id}-{n}"))
    }

    #[idempotent(scope = "protocol.Shop.ship", key = "shipment_id", store = self.store)]
    async fn ship(&self, shipment_id: u64, skus: Vec<u64>) -> Result<Vec<String>, AppError> {
        self.ship_runs.fetch_add(1, SeqCst);
        let mut labels = Vec::new();
        for sku in skus {
            labels.push(self.label(sku).await?);
        }
        self.labels_seen.lock().unwrap().push(labels.clone());
        if self.fail_ship_once.swap(false, SeqCst) {
            return Err(AppError::Boom);
        }
        Ok(labels)
    }

    #[step("label")]
    async fn label(&self, sku: u64) -> Result<String, AppError> {
        let n = self.label_runs.fetch_add(1, SeqCst) + 1;
        Ok(format!("label-{sku}-{n}"))
    }
}

#[tokio::test]
async fn a_retried_flow_resumes_at_the_step_that_failed() {
    let shop = Shop::default();
    shop.fail_notify_once.store(true, SeqCst);

    assert!(matches!(shop.checkout(9).await, Err(AppError::Boom)));
    let runs = |s: &Shop| {
        (
            count(&s.reserve_runs),
            count(&s.charge_runs),
            count(&s.notify_runs),
        )
    };
    assert_eq!(runs(&shop), (1, 1, 1));

    let receipt = shop.checkout(9).await.unwrap();
    assert_eq!(runs(&shop), (1, 1, 2), "steps 1 and 2 were not run again");
    assert_eq!(
        receipt,
        Receipt {
            ticket: "ticket-9-1".into(),
            charge: "charge-9-1 for ticket-9-1".into(),
            notice: "notice-9-2".into(),
        },
        "finished steps return the outputs saved by the first attempt"
    );
    assert_eq!(count(&shop.checkout_runs), 2);

    assert_eq!(shop.checkout(9).await.unwrap(), receipt);
    assert_eq!(runs(&shop), (1, 1, 2));
    assert_eq!(
        count(&shop.checkout_runs),
        2,
        "the final result is replayed"
    );
}

#[tokio::test]
async fn a_step_called_in_a_loop_records_each_iteration() {
    let shop = Shop::default();
    shop.fail_ship_once.store(true, SeqCst);

    assert!(matches!(
        shop.ship(1, vec![10, 20, 30]).await,
        Err(AppError::Boom)
    ));
    assert_eq!(count(&shop.label_runs), 3);

    let labels = shop.ship(1, vec![10, 20, 30]).await.unwrap();
    assert_eq!(labels, ["label-10-1", "label-20-2", "label-30-3"]);
    assert_eq!(
        count(&shop.label_runs),
        3,
        "each iteration replays its own output"
    );
    assert_eq!(
        *shop.labels_seen.lock().unwrap(),
        [labels.clone(), labels.clone()],
        "both attempts saw the same labels"
    );

    assert_eq!(shop.ship(1, vec![10, 20, 30]).await.unwrap(), labels);
    assert_eq!(count(&shop.ship_runs), 2);
    assert_eq!(count(&shop.label_runs), 3);
}

#[tokio::test]
async fn a_step_outside_an_idempotent_call_just_runs() {
    let shop = Shop::default();
    assert_eq!(shop.reserve(4).await.unwrap(), "ticket-4-1");
    assert_eq!(shop.reserve(4).await.unwrap(), "ticket-4-2");
    assert_eq!(count(&shop.reserve_runs), 2);

    // And it left nothing behind that a later flow would mistake for its own.
    shop.checkout(4).await.unwrap();
    assert_eq!(count(&shop.reserve_runs), 3);
}

// ---------------------------------------------------------------------------
// Downstream key propagation
// ---------------------------------------------------------------------------

#[derive(Default)]
struct Psp {
    store: MemoryStore,
    keys_seen: Mutex<Vec<Option<Key>>>,
    fail_once: AtomicBool,
}

impl Psp {
    #[idempotent(key = "order_id", scope = "psp.charge", store = self.store)]
    async fn charge(&self, order_id: u64) -> Result<String, AppError> {
        let key = idem_runtime::current_key();
        self.keys_seen.lock().unwrap().push(key);
        if self.fail_once.swap(false, SeqCst) {
            return Err(AppError::Boom);
        }
        let key = key.expect("inside an idempotent call");
        // What a payment provider would get as its Idempotency-Key.
        Ok(key.derive("psp").to_hex())
    }
}

#[tokio::test]
async fn current_key_is_stable_across_retries_and_absent_outside() {
    assert!(idem_runtime::current_key().is_none());

    let psp = Psp::default();
    psp.fail_once.store(true, SeqCst);
    assert!(matches!(psp.charge(7).await, Err(AppError::Boom)));
    let provider_key = psp.charge(7).await.unwrap();
    assert!(idem_runtime::current_key().is_none());

    let seen = psp.keys_seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    let (first, retry) = (seen[0].expect("Some inside"), seen[1].expect("Some inside"));
    assert_eq!(
        first, retry,
        "the same key on the failed attempt and its retry"
    );
    assert_eq!(first, Key::builder("psp.charge").part(&7u64).finish());

    assert_eq!(first.derive("psp"), retry.derive("psp"));
    assert_ne!(first.derive("psp"), first.derive("sms"));
    assert_eq!(provider_key, first.derive("psp").to_hex());

    let other = psp.charge(8).await.unwrap();
    assert_ne!(other, provider_key);
}

// ---------------------------------------------------------------------------
// Consumers
// ---------------------------------------------------------------------------

struct OrderEvent {
    order_id: u64,
}

#[derive(Default)]
struct Ledger {
    store: MemoryStore,
    settles: AtomicUsize,
    refunds: AtomicUsize,
}

impl Ledger {
    #[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "orders.events", store = self.store)]
    async fn on_settle(&self, e: OrderEvent) -> Result<String, AppError> {
        let n = self.settles.fetch_add(1, SeqCst) + 1;
        Ok(format!("settled {} #{n}", e.order_id))
    }

    #[idempotent(consumer, event = "REFUND", key = "e.order_id", scope = "orders.events", store = self.store)]
    async fn on_refund(&self, e: OrderEvent) -> Result<String, AppError> {
        let n = self.refunds.fetch_add(1, SeqCst) + 1;
        Ok(format!("refunded {} #{n}", e.order_id))
    }
}

#[tokio::test]
async fn consumers_of_different_events_on_one_order_do_not_share_records() {
    let (store, clock) = manual_store();
    let ledger = Ledger {
        store,
        ..Ledger::default()
    };
    let ev = || OrderEvent { order_id: 42 };

    assert_eq!(ledger.on_settle(ev()).await.unwrap(), "settled 42 #1");
    assert_eq!(ledger.on_refund(ev()).await.unwrap(), "refunded 42 #1");
    assert_eq!((count(&ledger.settles), count(&ledger.refunds)), (1, 1));

    // Redelivered two days later: a consumer's record outlives a call's 24h.
    clock.advance(48 * HOUR);
    assert_eq!(ledger.on_settle(ev()).await.unwrap(), "settled 42 #1");
    assert_eq!(ledger.on_refund(ev()).await.unwrap(), "refunded 42 #1");
    assert_eq!((count(&ledger.settles), count(&ledger.refunds)), (1, 1));
}

struct Panicky {
    store: MemoryStore,
    runs: AtomicUsize,
}

impl Panicky {
    #[idempotent(key = "id", scope = "panicky.run", store = self.store)]
    async fn run(&self, id: u64, explode: bool) -> Result<u64, AppError> {
        self.runs.fetch_add(1, SeqCst);
        if explode {
            panic!("the body panicked");
        }
        Ok(id)
    }
}

/// A body that panics is a crash: its claim stays until the lease runs out,
/// duplicates get `InProgress` meanwhile, and then a retry takes over.
#[tokio::test]
async fn a_panicking_body_keeps_its_claim_until_the_lease_and_is_then_taken_over() {
    use futures_util::FutureExt as _;

    let (store, clock) = manual_store();
    let svc = Panicky {
        store,
        runs: AtomicUsize::new(0),
    };
    let crashed = std::panic::AssertUnwindSafe(svc.run(5, true))
        .catch_unwind()
        .await;
    assert!(crashed.is_err(), "the body's panic reaches the caller");
    assert!(matches!(
        idem_err(svc.run(5, false).await),
        Error::InProgress { .. }
    ));
    clock.advance(Duration::from_secs(31)); // past the default 30 s lease
    assert_eq!(svc.run(5, false).await.unwrap(), 5);
    assert_eq!(count(&svc.runs), 2, "the crashed run and the takeover");
}
