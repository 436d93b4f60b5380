//! Multi-step flows under the failures a reliability review reproduced: a
//! retry loop inside the body, a retry with another payload, and an owner that
//! lost its lease while it was still running.
//!
//! Each case fails on a step runner that numbers attempts instead of finished
//! steps, that keys step records by the flow key alone, or that lets a stale
//! owner start new steps.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::{Claim, ClaimRequest, Store, Token};
use idem_runtime::{Error, Key, ManualClock, idempotent, step};
use tokio::sync::{Notify, oneshot};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("the payment provider timed out")]
    Flaky,
    #[error("shipping failed")]
    Shipping,
}

// ---------------------------------------------------------------------------
// 1. A retry loop inside the body
// ---------------------------------------------------------------------------

#[derive(Default)]
struct Checkout {
    store: MemoryStore,
    /// How many charge attempts still time out before one goes through.
    flaky_charges: AtomicUsize,
    /// Cards actually charged, by amount.
    charged: Mutex<Vec<u64>>,
    ships_to_fail: AtomicUsize,
}

impl Checkout {
    #[idempotent(scope = "flow-tests.pay", key = "order_id", store = self.store)]
    async fn pay(&self, order_id: u64) -> Result<String, AppError> {
        // The retry loop a user writes around a flaky provider.
        let mut attempts = 0;
        let charge = loop {
            match self.charge(order_id, 100).await {
                Ok(charge) => break charge,
                Err(AppError::Flaky) if attempts < 5 => attempts += 1,
                Err(e) => return Err(e),
            }
        };
        self.ship(order_id).await?;
        Ok(charge)
    }

    #[idempotent(scope = "flow-tests.pay-amount", key = "order_id", fingerprint = "amount", store = self.store)]
    async fn pay_amount(&self, order_id: u64, amount: u64) -> Result<String, AppError> {
        let charge = self.charge(order_id, amount).await?;
        self.ship(order_id).await?;
        Ok(charge)
    }

    #[step("charge")]
    async fn charge(&self, order_id: u64, amount: u64) -> Result<String, AppError> {
        let timed_out = self
            .flaky_charges
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if timed_out {
            return Err(AppError::Flaky);
        }
        let mut charged = self.charged.lock().unwrap();
        charged.push(amount);
        Ok(format!(
            "order {order_id}: charged {amount} (charge #{})",
            charged.len()
        ))
    }

    #[step("ship")]
    async fn ship(&self, order_id: u64) -> Result<u64, AppError> {
        let failed = self
            .ships_to_fail
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failed {
            return Err(AppError::Shipping);
        }
        Ok(order_id)
    }
}

#[tokio::test]
async fn a_step_retried_inside_the_body_is_not_run_again_when_the_flow_is_retried() {
    let shop = Checkout::default();
    // Attempt 0 of the charge times out, attempt 1 charges the card; then
    // shipping fails and the whole call is released for a retry.
    shop.flaky_charges.store(1, SeqCst);
    shop.ships_to_fail.store(1, SeqCst);
    assert!(matches!(shop.pay(1).await, Err(AppError::Shipping)));
    assert_eq!(*shop.charged.lock().unwrap(), [100]);

    // The retry must find the finished charge, not the released timed-out attempt.
    let receipt = shop.pay(1).await.unwrap();
    assert_eq!(
        *shop.charged.lock().unwrap(),
        [100],
        "the card was charged twice"
    );
    assert_eq!(receipt, "order 1: charged 100 (charge #1)");
}

#[tokio::test]
async fn a_step_that_keeps_failing_inside_a_loop_runs_once_it_succeeds_and_only_then() {
    let shop = Checkout::default();
    shop.flaky_charges.store(3, SeqCst);
    let receipt = shop.pay(2).await.unwrap();
    assert_eq!(*shop.charged.lock().unwrap(), [100]);
    assert_eq!(receipt, "order 2: charged 100 (charge #1)");
    // And the finished call replays.
    assert_eq!(shop.pay(2).await.unwrap(), receipt);
    assert_eq!(shop.charged.lock().unwrap().len(), 1);
}

// ---------------------------------------------------------------------------
// 1b. A loop over items that goes on past a failed call
// ---------------------------------------------------------------------------

/// Charges each item of a basket: an item's charge is retried once inside the
/// body, then the body goes on to the next item and fails at the end if any
/// item is left uncharged, so that a retry of the flow charges only those.
#[derive(Default)]
struct Basket {
    store: MemoryStore,
    /// How many more charges of an item time out.
    failures: Mutex<std::collections::HashMap<u64, usize>>,
    /// Items actually charged, in order.
    charged: Mutex<Vec<u64>>,
    /// The key each charge attempt ran under, by item.
    keys: Mutex<Vec<(u64, Key)>>,
}

impl Basket {
    #[idempotent(scope = "flow-tests.basket", key = "order_id", store = self.store)]
    async fn charge_all(&self, order_id: u64, items: Vec<u64>) -> Result<Vec<String>, AppError> {
        let mut receipts = Vec::new();
        let mut uncharged = 0;
        for &item in &items {
            let mut attempt = 0;
            loop {
                match self.charge_item(order_id, item).await {
                    Ok(receipt) => {
                        receipts.push(receipt);
                        break;
                    }
                    Err(AppError::Flaky) if attempt == 0 => attempt += 1,
                    Err(AppError::Flaky) => {
                        uncharged += 1;
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        if uncharged > 0 {
            return Err(AppError::Flaky);
        }
        Ok(receipts)
    }

    #[step("charge_item", key = "item")]
    async fn charge_item(&self, order_id: u64, item: u64) -> Result<String, AppError> {
        let key = idem_runtime::current_key().expect("inside the step");
        self.keys.lock().unwrap().push((item, key));
        let mut failures = self.failures.lock().unwrap();
        if let Some(n) = failures.get_mut(&item).filter(|n| **n > 0) {
            *n -= 1;
            return Err(AppError::Flaky);
        }
        self.charged.lock().unwrap().push(item);
        Ok(format!("order {order_id}: item {item} charged"))
    }
}

#[tokio::test]
async fn a_keyed_step_in_a_loop_that_goes_on_past_a_failure_charges_each_item_once() {
    let basket = Basket::default();
    // Item 2 times out on both attempts of the first run and on the first
    // attempt of the retry; item 3 is charged after item 2 gave up.
    basket.failures.lock().unwrap().insert(2, 3);
    assert!(matches!(
        basket.charge_all(9, vec![1, 2, 3]).await,
        Err(AppError::Flaky)
    ));
    assert_eq!(*basket.charged.lock().unwrap(), [1, 3]);

    let receipts = basket.charge_all(9, vec![1, 2, 3]).await.unwrap();
    assert_eq!(
        *basket.charged.lock().unwrap(),
        [1, 3, 2],
        "an item was charged twice, or never"
    );
    assert_eq!(
        receipts,
        [
            "order 9: item 1 charged",
            "order 9: item 2 charged",
            "order 9: item 3 charged"
        ],
        "a call replayed another item's saved output"
    );
    // The call is finished: it replays, and nothing more is charged.
    assert_eq!(basket.charge_all(9, vec![1, 2, 3]).await.unwrap(), receipts);
    assert_eq!(basket.charged.lock().unwrap().len(), 3);

    // Each item ran under one key in both runs (what the client middleware
    // sends as `Idempotency-Key`), and no two items shared one.
    let keys = basket.keys.lock().unwrap();
    let of = |item: u64| -> std::collections::BTreeSet<Key> {
        keys.iter()
            .filter(|(i, _)| *i == item)
            .map(|(_, k)| *k)
            .collect()
    };
    for item in [1, 2, 3] {
        assert_eq!(of(item).len(), 1, "item {item} ran under several keys");
    }
    assert_eq!(keys.iter().filter(|(i, _)| *i == 2).count(), 4);
    assert!(of(1).is_disjoint(&of(2)) && of(2).is_disjoint(&of(3)));
}

#[tokio::test]
async fn a_keyed_step_called_twice_for_one_item_records_each_call() {
    // Two finished calls for the same item are two records (numbered within
    // the item), as two calls of an unkeyed step are.
    #[derive(Default)]
    struct Twice {
        store: MemoryStore,
        charged: Mutex<Vec<u64>>,
    }
    impl Twice {
        #[idempotent(scope = "flow-tests.twice", key = "id", store = self.store)]
        async fn run(&self, id: u64) -> Result<Vec<usize>, AppError> {
            Ok(vec![self.charge(5).await?, self.charge(5).await?])
        }
        #[step("charge", key = "item")]
        async fn charge(&self, item: u64) -> Result<usize, AppError> {
            let mut charged = self.charged.lock().unwrap();
            charged.push(item);
            Ok(charged.len())
        }
    }
    let twice = Twice::default();
    assert_eq!(twice.run(1).await.unwrap(), [1, 2]);
    assert_eq!(twice.run(1).await.unwrap(), [1, 2]);
    assert_eq!(twice.charged.lock().unwrap().len(), 2);
}

// ---------------------------------------------------------------------------
// 2. A released record and another payload
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_released_flow_never_replays_its_steps_to_another_payload() {
    let shop = Checkout::default();
    shop.ships_to_fail.store(1, SeqCst);
    assert!(matches!(
        shop.pay_amount(7, 100).await,
        Err(AppError::Shipping)
    ));
    assert_eq!(*shop.charged.lock().unwrap(), [100]);

    // Same key, another amount: never "charged 100" for a request of 200.
    let other = shop.pay_amount(7, 200).await.unwrap();
    assert!(
        !other.contains("charged 100"),
        "a request for 200 was answered with the saved charge of 100: {other}"
    );
    assert_eq!(other, "order 7: charged 200 (charge #2)");

    // The finished record now belongs to the 200 payload.
    let reuse = shop.pay_amount(7, 100).await.unwrap_err();
    assert!(
        matches!(reuse, AppError::Idem(Error::KeyReuse { .. })),
        "{reuse:?}"
    );
    assert_eq!(shop.pay_amount(7, 200).await.unwrap(), other);
    assert_eq!(*shop.charged.lock().unwrap(), [100, 200]);
}

#[tokio::test]
async fn a_released_flow_still_replays_its_steps_to_the_same_payload() {
    let shop = Checkout::default();
    shop.ships_to_fail.store(1, SeqCst);
    assert!(shop.pay_amount(8, 100).await.is_err());
    let receipt = shop.pay_amount(8, 100).await.unwrap();
    assert_eq!(receipt, "order 8: charged 100 (charge #1)");
    assert_eq!(*shop.charged.lock().unwrap(), [100]);
}

// ---------------------------------------------------------------------------
// 13. A stale owner stops
// ---------------------------------------------------------------------------

/// The running body's key and fence.
type Started = (Key, Option<u64>);

struct Slow {
    store: MemoryStore,
    steps_run: Mutex<Vec<&'static str>>,
    /// The body's key and fence, sent out once step one finished.
    started: Mutex<Option<oneshot::Sender<Started>>>,
    resume: Notify,
}

impl Slow {
    #[idempotent(scope = "flow-tests.slow", key = "id", lease = "300ms", ttl = "1h", store = self.store)]
    async fn run(&self, id: u64) -> Result<Vec<String>, AppError> {
        let first = self.step_one(id).await?;
        let key = idem_runtime::current_key().expect("inside the call");
        let started = self.started.lock().unwrap().take().expect("runs once");
        started.send((key, idem_runtime::current_fence())).unwrap();
        self.resume.notified().await;
        // The body can see that its heartbeat found the lease gone.
        lease_lost_seen().await;
        // A stale owner must not start its next step.
        let second = self.step_two(id).await?;
        Ok(vec![first, second])
    }

    /// As `run`, but the lease is lost before any step ran: the call's shared
    /// context (made on a step's first use) does not exist yet when the
    /// heartbeat finds the lease gone.
    #[idempotent(scope = "flow-tests.slow-first", key = "id", lease = "300ms", ttl = "1h", store = self.store)]
    async fn run_before_any_step(&self, id: u64) -> Result<String, AppError> {
        let key = idem_runtime::current_key().expect("inside the call");
        let started = self.started.lock().unwrap().take().expect("runs once");
        started.send((key, idem_runtime::current_fence())).unwrap();
        self.resume.notified().await;
        lease_lost_seen().await;
        self.step_one(id).await
    }

    #[step("one")]
    async fn step_one(&self, id: u64) -> Result<String, AppError> {
        self.steps_run.lock().unwrap().push("one");
        Ok(format!("one-{id}"))
    }

    #[step("two")]
    async fn step_two(&self, id: u64) -> Result<String, AppError> {
        self.steps_run.lock().unwrap().push("two");
        Ok(format!("two-{id}"))
    }
}

/// A `Slow` on a store whose clock the test moves, and where it reports
/// that its body started.
fn slow_on_a_manual_clock() -> (
    ManualClock,
    MemoryStore,
    std::sync::Arc<Slow>,
    oneshot::Receiver<Started>,
) {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let (tx, rx) = oneshot::channel();
    let slow = std::sync::Arc::new(Slow {
        store: store.clone(),
        steps_run: Mutex::new(Vec::new()),
        started: Mutex::new(Some(tx)),
        resume: Notify::new(),
    });
    (clock, store, slow, rx)
}

/// Waits until the body sees that its heartbeat found the lease gone.
async fn lease_lost_seen() {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !idem_runtime::lease_lost() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the heartbeat never reported the lost lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Another caller claims `key` once its owner's lease ran out; its fence.
async fn take_over(store: &MemoryStore, key: &Key) -> u64 {
    let newcomer = store
        .claim(ClaimRequest {
            key,
            token: Token::random(),
            fingerprint: None,
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(3600),
        })
        .await
        .unwrap();
    let Claim::Acquired {
        fence,
        takeover: true,
    } = newcomer
    else {
        panic!("expected a takeover, got {newcomer:?}");
    };
    fence
}

#[tokio::test]
async fn an_owner_whose_lease_was_taken_over_starts_no_new_step_and_knows_its_fence() {
    let (clock, store, slow, rx) = slow_on_a_manual_clock();
    assert!(idem_runtime::current_fence().is_none());
    assert!(!idem_runtime::lease_lost());

    let call = tokio::spawn({
        let slow = slow.clone();
        async move { slow.run(5).await }
    });
    let (key, fence) = rx.await.unwrap();
    let fence = fence.expect("a store-backed call knows its fence");

    // The owner stalls (a GC pause, a stuck socket) past its lease on the
    // store's clock, and another caller takes the key over.
    clock.advance(Duration::from_secs(5));
    let newer = take_over(&store, &key).await;
    assert!(
        newer > fence,
        "the newcomer's fence {newer} is above {fence}"
    );

    // The stale owner resumes; its next heartbeat finds the lease gone.
    slow.resume.notify_one();

    let err = call.await.unwrap().unwrap_err();
    assert!(
        matches!(err, AppError::Idem(Error::LeaseLost { .. })),
        "{err:?}"
    );
    assert_eq!(
        *slow.steps_run.lock().unwrap(),
        ["one"],
        "step two never started after the lease was lost"
    );
}

/// The lease is taken over before the body's first step: that step is
/// refused too, though the flag was set before anything asked for the
/// call's step context.
#[tokio::test]
async fn an_owner_whose_lease_was_taken_over_before_any_step_starts_none() {
    let (clock, store, slow, rx) = slow_on_a_manual_clock();
    let call = tokio::spawn({
        let slow = slow.clone();
        async move { slow.run_before_any_step(6).await }
    });
    let (key, _) = rx.await.unwrap();
    clock.advance(Duration::from_secs(5));
    take_over(&store, &key).await;
    slow.resume.notify_one();

    let err = call.await.unwrap().unwrap_err();
    assert!(
        matches!(err, AppError::Idem(Error::LeaseLost { .. })),
        "{err:?}"
    );
    assert!(
        slow.steps_run.lock().unwrap().is_empty(),
        "no step started after the lease was lost"
    );
}

// ---------------------------------------------------------------------------
// 10. Two methods of one name in one module
// ---------------------------------------------------------------------------

trait Settle {
    async fn settle(&self, order_id: u64) -> Result<String, AppError>;
}

struct Card {
    store: MemoryStore,
}

struct Wallet {
    store: MemoryStore,
}

impl Settle for Card {
    #[idempotent(scope = "flow-tests.card.settle", key = "order_id", store = self.store)]
    async fn settle(&self, order_id: u64) -> Result<String, AppError> {
        Ok(format!("card settled {order_id}"))
    }
}

impl Settle for Wallet {
    #[idempotent(scope = "flow-tests.wallet.settle", key = "order_id", store = self.store)]
    async fn settle(&self, order_id: u64) -> Result<String, AppError> {
        Ok(format!("wallet settled {order_id}"))
    }
}

#[tokio::test]
async fn two_trait_impls_of_one_method_in_one_module_keep_their_own_keys() {
    // One store for both, as a service would have: the default scope (module +
    // `settle`) would have made the wallet replay the card's result. The
    // attribute refuses a method without a scope (tests/ui/fail/method_without_scope.rs).
    let store = MemoryStore::new();
    let card = Card {
        store: store.clone(),
    };
    let wallet = Wallet { store };
    assert_eq!(card.settle(3).await.unwrap(), "card settled 3");
    assert_eq!(wallet.settle(3).await.unwrap(), "wallet settled 3");
    assert_eq!(card.settle(3).await.unwrap(), "card settled 3");
}
