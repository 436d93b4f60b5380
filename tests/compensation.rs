//! Compensation (saga): a flow that gives up with a final error undoes its
//! finished steps in reverse order, each once, on every store — also when the
//! call is retried, and when a compensation fails and a retry resumes the
//! compensations where they stopped. The kill-mid-compensation case across
//! processes is in `crash_recovery.rs`.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use std::time::Duration;

use idem_runtime::ManualClock;
use idem_runtime::store::StoreRef;
use idem_runtime::store::Token;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sql::{PgStore, SqliteStore};
use idem_runtime::{idempotent, step};
use idem_tests::services;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, oneshot};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
enum AppError {
    // idem's own errors are never final: kept as text, never stored.
    #[error("idem: {0}")]
    Idem(String),
    #[error("the coupon provider rejected the order")]
    CouponRejected,
    #[error("the stock service timed out")]
    StockTimeout,
}

impl From<idem_runtime::Error> for AppError {
    fn from(e: idem_runtime::Error) -> Self {
        AppError::Idem(e.to_string())
    }
}

impl AppError {
    fn is_final(&self) -> bool {
        matches!(self, AppError::CouponRejected)
    }
}

/// Every effect and undo, in the order it happened.
#[derive(Default)]
struct Ledger {
    events: Mutex<Vec<String>>,
    /// Coupon requests still rejected (final) before one is issued.
    rejections: AtomicUsize,
    /// Stock restores that still time out before one goes through.
    restore_timeouts: AtomicUsize,
    /// Stalls the next coupon request: it says it started, waits to be
    /// resumed, then is rejected (a stale owner coming back late).
    stall_coupon: Mutex<Option<(oneshot::Sender<()>, Arc<Notify>)>>,
}

/// A service with its store: `Clone`, as compensations run on a clone of it.
#[derive(Clone)]
struct Shop {
    store: StoreRef,
    ledger: Arc<Ledger>,
}

impl Shop {
    fn new(store: StoreRef) -> Shop {
        Shop {
            store,
            ledger: Arc::default(),
        }
    }

    fn log(&self, event: String) {
        self.ledger.events.lock().unwrap().push(event);
    }

    fn events(&self) -> Vec<String> {
        self.ledger.events.lock().unwrap().clone()
    }

    #[idempotent(scope = "compensation.order", key = "order_no", final_err = AppError::is_final, store = self.store.clone())]
    async fn order(&self, order_no: &str) -> Result<String, AppError> {
        let ticket = self.deduct_stock(order_no).await?;
        let order = self.insert_order(order_no, &ticket).await?;
        let coupon = self.issue_coupon(order_no).await?;
        Ok(format!("{ticket} {order} {coupon}"))
    }

    #[step("deduct_stock", compensate = "restore_stock")]
    async fn deduct_stock(&self, order_no: &str) -> Result<String, AppError> {
        let ticket = format!("ticket-{order_no}");
        self.log(format!("deduct {ticket}"));
        Ok(ticket)
    }

    async fn restore_stock(&self, ticket: String) -> Result<(), AppError> {
        let timed_out = self
            .ledger
            .restore_timeouts
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if timed_out {
            self.log(format!("restore {ticket} timed out"));
            return Err(AppError::StockTimeout);
        }
        self.log(format!("restore {ticket}"));
        Ok(())
    }

    #[step("insert_order", compensate = "cancel_order")]
    async fn insert_order(&self, order_no: &str, ticket: &str) -> Result<u64, AppError> {
        let id = 1000 + ticket.len() as u64;
        self.log(format!("insert order {order_no} {id}"));
        Ok(id)
    }

    async fn cancel_order(&self, id: u64) -> Result<String, AppError> {
        self.log(format!("cancel order {id}"));
        Ok(format!("cancelled {id}"))
    }

    #[step("issue_coupon")]
    async fn issue_coupon(&self, order_no: &str) -> Result<String, AppError> {
        let stall = self.ledger.stall_coupon.lock().unwrap().take();
        if let Some((started, resume)) = stall {
            started.send(()).unwrap();
            resume.notified().await;
            self.log("coupon rejected late".into());
            return Err(AppError::CouponRejected);
        }
        let rejected = self
            .ledger
            .rejections
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if rejected {
            self.log("coupon rejected".into());
            return Err(AppError::CouponRejected);
        }
        self.log(format!("coupon {order_no}"));
        Ok(format!("coupon-{order_no}"))
    }
}

fn order_no() -> String {
    let hex: String = Token::random().as_bytes()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("o-{hex}")
}

/// A final failure at step three: steps two and one are compensated, in that
/// order, once; a retry replays the final error and compensates nothing.
async fn a_final_failure_compensates_in_reverse_once(store: StoreRef) {
    let shop = Shop::new(store);
    let no = order_no();
    shop.ledger.rejections.store(1, SeqCst);
    assert_eq!(shop.order(&no).await, Err(AppError::CouponRejected));
    let id = 1000 + format!("ticket-{no}").len();
    let expected = [
        format!("deduct ticket-{no}"),
        format!("insert order {no} {id}"),
        "coupon rejected".to_owned(),
        format!("cancel order {id}"),
        format!("restore ticket-{no}"),
    ];
    assert_eq!(shop.events(), expected);

    // Retried: the final error replays; nothing runs, nothing is undone twice,
    // even though the coupon provider would now accept.
    assert_eq!(shop.order(&no).await, Err(AppError::CouponRejected));
    assert_eq!(shop.order(&no).await, Err(AppError::CouponRejected));
    assert_eq!(shop.events(), expected);
}

/// A compensation that fails releases the call; the retry resumes: the
/// compensation that finished replays, the failed one runs again, and the step
/// that gave up does not run forward even though it would now succeed.
async fn a_failed_compensation_resumes_on_retry(store: StoreRef) {
    let shop = Shop::new(store);
    let no = order_no();
    shop.ledger.rejections.store(1, SeqCst);
    shop.ledger.restore_timeouts.store(1, SeqCst);
    let first = shop.order(&no).await.unwrap_err();
    assert!(
        matches!(&first, AppError::Idem(m) if m.contains("restore_stock")),
        "{first:?}"
    );
    let id = 1000 + format!("ticket-{no}").len();
    assert_eq!(
        shop.events(),
        [
            format!("deduct ticket-{no}"),
            format!("insert order {no} {id}"),
            "coupon rejected".to_owned(),
            format!("cancel order {id}"),
            format!("restore ticket-{no} timed out"),
        ]
    );

    // The retry: the coupon provider would accept now, but the flow gave up.
    assert_eq!(shop.order(&no).await, Err(AppError::CouponRejected));
    let after_retry = [
        format!("deduct ticket-{no}"),
        format!("insert order {no} {id}"),
        "coupon rejected".to_owned(),
        format!("cancel order {id}"),
        format!("restore ticket-{no} timed out"),
        format!("restore ticket-{no}"),
    ];
    assert_eq!(shop.events(), after_retry);

    assert_eq!(shop.order(&no).await, Err(AppError::CouponRejected));
    assert_eq!(shop.events(), after_retry);
}

/// A flow that finishes compensates nothing; one that fails with a retryable
/// error compensates nothing either and runs forward on the retry.
async fn only_a_final_failure_compensates(store: StoreRef) {
    let shop = Shop::new(store);
    let no = order_no();
    let receipt = shop.order(&no).await.unwrap();
    assert_eq!(shop.order(&no).await.unwrap(), receipt);
    assert!(
        !shop
            .events()
            .iter()
            .any(|e| e.starts_with("cancel") || e.starts_with("restore")),
        "{:?}",
        shop.events()
    );
}

async fn all(store: StoreRef) {
    a_final_failure_compensates_in_reverse_once(store.clone()).await;
    a_failed_compensation_resumes_on_retry(store.clone()).await;
    only_a_final_failure_compensates(store).await;
}

#[tokio::test]
async fn memory() {
    all(StoreRef::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn sqlite() {
    all(StoreRef::new(SqliteStore::in_memory().await.unwrap())).await;
}

#[tokio::test]
async fn postgres() {
    let url = services::postgres_url();
    if let Some(store) = services::reachable("PostgreSQL", &url, PgStore::connect(&url).await) {
        all(StoreRef::new(store)).await;
    }
}

#[tokio::test]
async fn redis() {
    let url = services::redis_url();
    if let Some(store) = services::reachable("Redis", &url, RedisStore::connect(&url).await) {
        all(StoreRef::new(store)).await;
    }
}

/// Owner 1 stalls inside step three past its lease; owner 2 takes the key
/// over, replays steps one and two, finishes the flow. Owner 1 then comes back
/// with a final error: it must neither write the give-up record nor undo the
/// steps its successor's finished order relies on.
#[tokio::test]
async fn a_stale_owner_never_compensates_a_flow_its_successor_finished() {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = StoreRef::new(MemoryStore::builder().clock(clock.clone()).build());
    let shop = Shop::new(store.clone());
    let no = order_no();
    let (started, stalled) = oneshot::channel();
    let resume = Arc::new(Notify::new());
    *shop.ledger.stall_coupon.lock().unwrap() = Some((started, resume.clone()));

    let stale = tokio::spawn({
        let shop = shop.clone();
        let no = no.clone();
        async move { shop.order(&no).await }
    });
    stalled.await.unwrap();
    // Past the flow's lease on the store's clock (the heartbeat, on real time,
    // has not beaten yet: the stale owner does not know).
    clock.advance(Duration::from_secs(31));
    let receipt = shop
        .order(&no)
        .await
        .expect("the successor finishes the flow");

    resume.notify_one();
    let late = stale.await.unwrap().unwrap_err();
    assert!(
        matches!(&late, AppError::Idem(m) if m.contains("lease")),
        "the stale owner stops with LeaseLost: {late:?}"
    );
    let events = shop.events();
    assert!(
        !events
            .iter()
            .any(|e| e.starts_with("cancel") || e.starts_with("restore")),
        "nothing the successor finished was undone: {events:?}"
    );
    // Every duplicate replays the successor's order, whose stock is still deducted.
    assert_eq!(shop.order(&no).await.unwrap(), receipt);
}

/// Outside a flow a compensated step just runs, and nothing is compensated.
#[tokio::test]
async fn outside_a_flow_a_compensated_step_just_runs() {
    let shop = Shop::new(StoreRef::new(MemoryStore::new()));
    assert_eq!(shop.deduct_stock("x").await.unwrap(), "ticket-x");
    assert_eq!(shop.events(), ["deduct ticket-x"]);
}

// A free fn step with a free fn compensation.
static FREE_UNDONE: AtomicUsize = AtomicUsize::new(0);

#[step("reserve_seat", compensate = "release_seat")]
async fn reserve_seat(seat: u32) -> Result<u32, AppError> {
    Ok(seat)
}

async fn release_seat(seat: u32) -> Result<(), AppError> {
    FREE_UNDONE.fetch_add(seat as usize, SeqCst);
    Ok(())
}

#[idempotent(scope = "compensation.book", key = "booking", final_err = AppError::is_final, store = StoreRef::new(MemoryStore::new()))]
async fn book(booking: u64) -> Result<u32, AppError> {
    reserve_seat(7).await?;
    Err(AppError::CouponRejected)
}

#[tokio::test]
async fn a_free_fn_step_is_compensated_by_a_free_fn() {
    assert_eq!(book(1).await, Err(AppError::CouponRejected));
    assert_eq!(FREE_UNDONE.load(SeqCst), 7);
}

// --- an error type that is not serde: only its final errors are stored -----

/// What a duplicate is told of a declined payment: the stored form of
/// `PayError`'s final errors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Declined {
    reason: String,
}

/// An error type as services write them: it wraps errors that are not serde
/// (idem's own, an I/O error), so it cannot be stored whole.
#[derive(Debug, thiserror::Error)]
enum PayError {
    #[error("declined: {}", .0.reason)]
    Declined(Declined),
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl From<Declined> for PayError {
    fn from(d: Declined) -> Self {
        PayError::Declined(d)
    }
}

impl PayError {
    /// `final_err`: the final errors, as they are stored.
    fn declined(&self) -> Option<Declined> {
        match self {
            PayError::Declined(d) => Some(d.clone()),
            _ => None,
        }
    }
}

static PAY_STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);
static PAY_RUNS: AtomicUsize = AtomicUsize::new(0);
static HELD: AtomicUsize = AtomicUsize::new(0);
static RELEASED: AtomicUsize = AtomicUsize::new(0);
/// I/O failures still to come before `pay` gets as far as the card.
static IO_FAILURES: AtomicUsize = AtomicUsize::new(0);

#[step("hold_funds", compensate = "release_funds")]
async fn hold_funds(cents: u64) -> Result<u64, PayError> {
    HELD.fetch_add(1, SeqCst);
    Ok(cents)
}

async fn release_funds(_cents: u64) -> Result<(), PayError> {
    RELEASED.fetch_add(1, SeqCst);
    Ok(())
}

#[idempotent(scope = "compensation.pay", key = "card", final_err = PayError::declined, store = &*PAY_STORE)]
async fn pay(card: String, cents: u64) -> Result<u64, PayError> {
    PAY_RUNS.fetch_add(1, SeqCst);
    hold_funds(cents).await?;
    if IO_FAILURES
        .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return Err(std::io::Error::other("the card network hung up").into());
    }
    Err(Declined {
        reason: format!("{card}: insufficient funds"),
    }
    .into())
}

#[tokio::test]
async fn a_final_error_of_a_type_that_is_not_serde_is_stored_in_its_form_and_compensated_once() {
    let declined = Declined {
        reason: "card-1: insufficient funds".into(),
    };
    // A retryable error (not final) releases the key and undoes nothing.
    IO_FAILURES.store(1, SeqCst);
    assert!(matches!(
        pay("card-1".into(), 500).await,
        Err(PayError::Io(_))
    ));
    assert_eq!((HELD.load(SeqCst), RELEASED.load(SeqCst)), (1, 0));

    // The retry runs again (the hold replays) and is declined: final, so the
    // hold is released and the decline stored.
    match pay("card-1".into(), 500).await {
        Err(PayError::Declined(d)) => assert_eq!(d, declined),
        other => panic!("expected the decline, got {other:?}"),
    }
    assert_eq!(PAY_RUNS.load(SeqCst), 2);
    assert_eq!((HELD.load(SeqCst), RELEASED.load(SeqCst)), (1, 1));

    // A duplicate gets the same decline back, rebuilt from its stored form,
    // without running the body or releasing anything again.
    match pay("card-1".into(), 500).await {
        Err(PayError::Declined(d)) => assert_eq!(d, declined),
        other => panic!("expected the replayed decline, got {other:?}"),
    }
    assert_eq!(PAY_RUNS.load(SeqCst), 2);
    assert_eq!(RELEASED.load(SeqCst), 1);
}
