//! `#[idempotent]` and `#[step]` on every function shape they support. Each
//! case is called, not only compiled: the duplicate call must replay.
//!
//! This binary may install a process-wide store; only the test named
//! `install_provides_the_store_of_fns_without_one` relies on it, every other
//! function names its store.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};

use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::{RecordState, Store};
use idem_runtime::{Error, Key, KeyPart, idempotent, step};
use serde::Serialize;
use serde::de::DeserializeOwned;

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("out of stock")]
    OutOfStock,
}

fn shared_store() -> &'static MemoryStore {
    static STORE: OnceLock<MemoryStore> = OnceLock::new();
    STORE.get_or_init(MemoryStore::new)
}

fn count(c: &AtomicUsize) -> usize {
    c.load(SeqCst)
}

// --- a free async fn --------------------------------------------------------

static FREE_RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = "user_id|coupon", store = shared_store())]
async fn redeem(user_id: u64, coupon: &str) -> Result<String, AppError> {
    let n = FREE_RUNS.fetch_add(1, SeqCst) + 1;
    Ok(format!("{user_id}:{coupon}:{n}"))
}

#[tokio::test]
async fn free_async_fn() {
    assert_eq!(redeem(1, "SPRING").await.unwrap(), "1:SPRING:1");
    assert_eq!(redeem(1, "SPRING").await.unwrap(), "1:SPRING:1");
    assert_eq!(redeem(1, "SUMMER").await.unwrap(), "1:SUMMER:2");
    assert_eq!(count(&FREE_RUNS), 2);
}

// --- methods: &self, &mut self, store = self.store.clone() -----------------

struct Inventory {
    store: MemoryStore,
    runs: AtomicUsize,
}

impl Inventory {
    fn new() -> Self {
        Inventory {
            store: MemoryStore::new(),
            runs: AtomicUsize::new(0),
        }
    }

    #[idempotent(scope = "macro_pass.Inventory.reserve", key = "sku|qty", store = self.store)]
    async fn reserve(&self, sku: u64, qty: u32) -> Result<u64, AppError> {
        self.runs.fetch_add(1, SeqCst);
        if qty > 10 {
            return Err(AppError::OutOfStock);
        }
        Ok(sku * 1000 + u64::from(qty))
    }

    /// Holds a non-`Copy` value across an await: the future must still be `Send`.
    #[idempotent(scope = "macro_pass.Inventory.hold_across_await", key = "id", store = self.store)]
    async fn hold_across_await(&self, id: u64) -> Result<String, AppError> {
        let held = format!("held-{id}");
        tokio::task::yield_now().await;
        self.runs.fetch_add(1, SeqCst);
        Ok(held)
    }
}

#[tokio::test]
async fn method_on_shared_self() {
    let inv = Inventory::new();
    assert_eq!(inv.reserve(7, 2).await.unwrap(), 7002);
    assert_eq!(inv.reserve(7, 2).await.unwrap(), 7002);
    assert_eq!(count(&inv.runs), 1);
    assert!(matches!(
        inv.reserve(7, 11).await,
        Err(AppError::OutOfStock)
    ));
    assert_eq!(count(&inv.runs), 2);
}

struct Account {
    store: MemoryStore,
    balance: u64,
}

impl Account {
    #[idempotent(scope = "macro_pass.Account.deposit", key = "deposit_id", store = self.store.clone())]
    async fn deposit(&mut self, deposit_id: u64, amount: u64) -> Result<u64, AppError> {
        self.balance += amount;
        Ok(self.balance)
    }
}

#[tokio::test]
async fn method_on_mut_self_with_a_cloned_store() {
    let mut acct = Account {
        store: MemoryStore::new(),
        balance: 0,
    };
    assert_eq!(acct.deposit(1, 50).await.unwrap(), 50);
    assert_eq!(acct.deposit(1, 50).await.unwrap(), 50);
    assert_eq!(acct.balance, 50, "the duplicate deposit did not mutate");
    assert_eq!(acct.deposit(2, 25).await.unwrap(), 75);
    assert_eq!(acct.balance, 75);
}

fn assert_send<T: Send>(_: &T) {}

#[tokio::test]
async fn the_future_is_send_when_the_body_is() {
    let inv = Arc::new(Inventory::new());
    let fut = inv.hold_across_await(1);
    assert_send(&fut);
    assert_eq!(fut.await.unwrap(), "held-1");

    // And it really moves across threads.
    let spawned = tokio::spawn({
        let inv = inv.clone();
        async move { inv.hold_across_await(1).await }
    });
    assert_eq!(spawned.await.unwrap().unwrap(), "held-1");
    assert_eq!(count(&inv.runs), 1);
}

// --- a trait impl method (native async fn in a trait) ----------------------

trait Payments {
    async fn pay(&self, payment_id: u64, cents: u64) -> Result<String, AppError>;
}

struct Gateway {
    store: MemoryStore,
    runs: AtomicUsize,
}

impl Payments for Gateway {
    #[idempotent(scope = "macro_pass.Gateway.pay", key = "payment_id", store = self.store)]
    async fn pay(&self, payment_id: u64, cents: u64) -> Result<String, AppError> {
        let n = self.runs.fetch_add(1, SeqCst) + 1;
        Ok(format!("pay-{payment_id}: {cents} (charge #{n})"))
    }
}

async fn pay_through_trait(p: &impl Payments, id: u64, cents: u64) -> String {
    p.pay(id, cents).await.unwrap()
}

#[tokio::test]
async fn trait_impl_method() {
    let gw = Gateway {
        store: MemoryStore::new(),
        runs: AtomicUsize::new(0),
    };
    assert_eq!(
        pay_through_trait(&gw, 3, 999).await,
        "pay-3: 999 (charge #1)"
    );
    assert_eq!(
        pay_through_trait(&gw, 3, 999).await,
        "pay-3: 999 (charge #1)"
    );
    assert_eq!(count(&gw.runs), 1);
}

// --- pattern parameter ------------------------------------------------------

struct Json<T>(T);

struct CreateOrder {
    user_id: u64,
    sku: String,
    qty: u32,
}

static ORDER_RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = "req.user_id|req.sku", store = shared_store())]
async fn create_order(Json(req): Json<CreateOrder>) -> Result<String, AppError> {
    let n = ORDER_RUNS.fetch_add(1, SeqCst) + 1;
    Ok(format!(
        "{}x{} for {} (#{n})",
        req.qty, req.sku, req.user_id
    ))
}

#[tokio::test]
async fn pattern_parameter() {
    let req = |user_id, qty| {
        Json(CreateOrder {
            user_id,
            sku: "SKU-1".into(),
            qty,
        })
    };
    assert_eq!(create_order(req(5, 2)).await.unwrap(), "2xSKU-1 for 5 (#1)");
    // qty is not part of the key: the same intent, replayed.
    assert_eq!(create_order(req(5, 3)).await.unwrap(), "2xSKU-1 for 5 (#1)");
    assert_eq!(create_order(req(6, 2)).await.unwrap(), "2xSKU-1 for 6 (#2)");
    assert_eq!(count(&ORDER_RUNS), 2);
}

// --- tuple field segment ----------------------------------------------------

static PAIR_RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = "pair.0", store = shared_store())]
async fn by_first(pair: (u64, String)) -> Result<String, AppError> {
    PAIR_RUNS.fetch_add(1, SeqCst);
    Ok(pair.1)
}

#[tokio::test]
async fn tuple_field_segment() {
    assert_eq!(by_first((1, "one".into())).await.unwrap(), "one");
    assert_eq!(by_first((1, "uno".into())).await.unwrap(), "one");
    assert_eq!(by_first((2, "two".into())).await.unwrap(), "two");
    assert_eq!(count(&PAIR_RUNS), 2);
}

// --- generic fn -------------------------------------------------------------

static GENERIC_RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = "id", store = shared_store())]
async fn remember<K, T>(id: K, value: T) -> Result<T, AppError>
where
    K: KeyPart,
    T: Serialize + DeserializeOwned,
{
    GENERIC_RUNS.fetch_add(1, SeqCst);
    Ok(value)
}

#[tokio::test]
async fn generic_fn() {
    assert_eq!(remember(1u64, "first".to_owned()).await.unwrap(), "first");
    assert_eq!(remember(1u64, "second".to_owned()).await.unwrap(), "first");
    assert_eq!(remember("k2", vec![1u8, 2]).await.unwrap(), [1, 2]);
    assert_eq!(remember("k2", vec![9u8]).await.unwrap(), [1, 2]);
    assert_eq!(count(&GENERIC_RUNS), 2);
}

// --- crate = "…" through a re-export --------------------------------------

mod reexport {
    pub use idem_runtime;
}

static REEXPORT_RUNS: AtomicUsize = AtomicUsize::new(0);
static REEXPORT_STEP_RUNS: AtomicUsize = AtomicUsize::new(0);

#[reexport::idem_runtime::idempotent(
    key = "id",
    crate = "crate::reexport::idem_runtime",
    store = shared_store()
)]
async fn via_reexport(id: u64) -> Result<u64, AppError> {
    REEXPORT_RUNS.fetch_add(1, SeqCst);
    let doubled = double(id).await?;
    Ok(doubled + 1)
}

#[reexport::idem_runtime::step("double", crate = "crate::reexport::idem_runtime")]
async fn double(id: u64) -> Result<u64, AppError> {
    REEXPORT_STEP_RUNS.fetch_add(1, SeqCst);
    Ok(id * 2)
}

#[tokio::test]
async fn crate_path_through_a_reexport() {
    assert_eq!(via_reexport(20).await.unwrap(), 41);
    assert_eq!(via_reexport(20).await.unwrap(), 41);
    assert_eq!(count(&REEXPORT_RUNS), 1);
    assert_eq!(count(&REEXPORT_STEP_RUNS), 1);
}

// --- inner attributes in the body ------------------------------------------

static INNER_ATTR_RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = "id", store = shared_store())]
async fn with_inner_attribute(id: u64) -> Result<u64, AppError> {
    #![allow(clippy::needless_return)]
    INNER_ATTR_RUNS.fetch_add(1, SeqCst);
    return Ok(halve(id).await? + 1);
}

#[step("halve")]
async fn halve(id: u64) -> Result<u64, AppError> {
    #![allow(clippy::needless_return)]
    return Ok(id / 2);
}

#[tokio::test]
async fn inner_attributes_in_the_body() {
    assert_eq!(with_inner_attribute(40).await.unwrap(), 21);
    assert_eq!(with_inner_attribute(40).await.unwrap(), 21);
    assert_eq!(count(&INNER_ATTR_RUNS), 1);
}

// --- `step` on a method, inside a flow on another method --------------------

struct Flow {
    store: MemoryStore,
    step_runs: AtomicUsize,
}

impl Flow {
    #[idempotent(scope = "macro_pass.Flow.run", key = "id", store = self.store)]
    async fn run(&self, id: u64) -> Result<String, AppError> {
        let a = self.fetch(id).await?;
        Ok(format!("{a}!"))
    }

    #[step("fetch")]
    async fn fetch(&self, id: u64) -> Result<String, AppError> {
        self.step_runs.fetch_add(1, SeqCst);
        Ok(format!("item-{id}"))
    }
}

#[tokio::test]
async fn step_on_a_method() {
    let flow = Flow {
        store: MemoryStore::new(),
        step_runs: AtomicUsize::new(0),
    };
    assert_eq!(flow.run(1).await.unwrap(), "item-1!");
    assert_eq!(flow.run(1).await.unwrap(), "item-1!");
    assert_eq!(count(&flow.step_runs), 1);
}

// --- the process-wide store -----------------------------------------------

static INSTALLED_RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = "id", scope = "macro_pass.installed")]
async fn uses_the_installed_store(id: u64) -> Result<u64, AppError> {
    INSTALLED_RUNS.fetch_add(1, SeqCst);
    Ok(id * 2)
}

#[tokio::test]
async fn install_provides_the_store_of_fns_without_one() {
    let store = MemoryStore::new();
    idem_runtime::install(store.clone());

    assert_eq!(uses_the_installed_store(21).await.unwrap(), 42);
    assert_eq!(uses_the_installed_store(21).await.unwrap(), 42);
    assert_eq!(count(&INSTALLED_RUNS), 1);

    let key = Key::builder("macro_pass.installed").part(&21u64).finish();
    let record = store
        .inspect(&key)
        .await
        .unwrap()
        .expect("the record lives in the installed store");
    assert_eq!(record.state, RecordState::Done);
    assert_eq!(record.result.unwrap().payload, b"42");
}
