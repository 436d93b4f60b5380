//! The recovery worker in one process, on the memory store with a manual
//! clock: a flow abandoned after its first step (its future dropped, as a
//! cancelled request leaves it) is finished by the worker; a final error
//! compensates once; a live claim is never touched; two workers recover each
//! flow once; attempts are counted, spaced and parked; arguments that cannot
//! be used are parked, and scopes without a function are reported. The same
//! across real processes and the server stores is `recovery_crash.rs`.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::recovery::{Recovery, Worker};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::{ClaimRequest, RecoveryArgs, Store, Token};
use idem_runtime::{Key, ManualClock, idempotent, recoverable, step};
use serde::{Deserialize, Serialize};

static CLOCK: LazyLock<ManualClock> = LazyLock::new(|| ManualClock::new(1_000_000));
/// The tests move one clock: they take turns.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
static STORE: LazyLock<MemoryStore> =
    LazyLock::new(|| MemoryStore::builder().clock(CLOCK.clone()).build());

#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
enum AppError {
    #[error(transparent)]
    #[serde(skip)]
    Idem(#[from] idem_runtime::Error),
    #[error("rejected")]
    Rejected,
    #[error("flaky")]
    Flaky,
}

impl AppError {
    fn is_final(&self) -> bool {
        matches!(self, AppError::Rejected)
    }
}

/// Counts of what the steps did, per test (each test has its own flow).
#[derive(Default)]
struct Effects {
    reserved: AtomicUsize,
    charged: AtomicUsize,
    released: AtomicUsize,
    /// Step two waits while set (the caller is "killed" there).
    hold: AtomicBool,
    /// Step two fails with `Rejected` while set.
    reject: AtomicBool,
    /// Step two fails retryably while set.
    flaky: AtomicBool,
    /// How many times step two was entered.
    entered: AtomicUsize,
}

static ORDERS: LazyLock<Effects> = LazyLock::new(Effects::default);

#[idempotent(scope = "recovery.order", key = "order_no", lease = "1s", store = &*STORE, recover)]
async fn order(order_no: String, qty: u32, note: &str) -> Result<String, AppError> {
    let ticket = reserve(&ORDERS, qty).await?;
    let charge = charge(&ORDERS, &order_no).await?;
    Ok(format!("{order_no}:{ticket}:{charge}:{note}"))
}

#[step("reserve", compensate = "unreserve")]
async fn reserve(fx: &'static Effects, qty: u32) -> Result<u64, AppError> {
    fx.reserved.fetch_add(1, Ordering::SeqCst);
    Ok(u64::from(qty) * 10)
}

async fn unreserve(_ticket: u64) -> Result<(), AppError> {
    GIVE_UPS.released.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

#[step("charge")]
async fn charge(fx: &'static Effects, order_no: &str) -> Result<String, AppError> {
    fx.entered.fetch_add(1, Ordering::SeqCst);
    while fx.hold.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if fx.reject.load(Ordering::SeqCst) {
        return Err(AppError::Rejected);
    }
    if fx.flaky.load(Ordering::SeqCst) {
        return Err(AppError::Flaky);
    }
    fx.charged.fetch_add(1, Ordering::SeqCst);
    Ok(format!("charge-{order_no}"))
}

static GIVE_UPS: LazyLock<Effects> = LazyLock::new(Effects::default);

#[idempotent(scope = "recovery.give_up", key = "order_no", lease = "1s", store = &*STORE, final_err = AppError::is_final, recover)]
async fn give_up(order_no: String) -> Result<String, AppError> {
    let ticket = reserve(&GIVE_UPS, 1).await?;
    let charge = charge(&GIVE_UPS, &order_no).await?;
    Ok(format!("{ticket}:{charge}"))
}

static FLAKY: LazyLock<Effects> = LazyLock::new(Effects::default);

#[idempotent(scope = "recovery.flaky", key = "order_no", lease = "1s", store = &*STORE, recover)]
async fn flaky(order_no: String) -> Result<String, AppError> {
    reserve(&FLAKY, 1).await?;
    charge(&FLAKY, &order_no).await
}

static DROPS: LazyLock<Effects> = LazyLock::new(Effects::default);

#[idempotent(scope = "recovery.dropped_worker", key = "order_no", lease = "1s", store = &*STORE, recover)]
async fn dropped_worker(order_no: String) -> Result<String, AppError> {
    reserve(&DROPS, 1).await?;
    charge(&DROPS, &order_no).await
}

/// A service whose method recovers on the value given at registration.
#[derive(Clone)]
struct Shop {
    fx: &'static Effects,
}

static SHOP: LazyLock<Effects> = LazyLock::new(Effects::default);

impl Shop {
    #[idempotent(scope = "recovery.shop", key = "order_no", lease = "1s", store = &*STORE, recover)]
    async fn buy(&self, order_no: &str) -> Result<String, AppError> {
        reserve(self.fx, 2).await?;
        charge(self.fx, order_no).await
    }
}

/// Starts `call`, lets it finish step one and hold in step two, then drops
/// it there (as a cancelled request or a dead process leaves it), and lets
/// the lease run out.
async fn abandon_in_step_two<F>(fx: &Effects, call: F)
where
    F: std::future::Future + Send + 'static,
    F::Output: Send,
{
    fx.hold.store(true, Ordering::SeqCst);
    let before = fx.reserved.load(Ordering::SeqCst);
    let task = tokio::spawn(call);
    while fx.reserved.load(Ordering::SeqCst) == before {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    task.abort();
    let _ = task.await;
    fx.hold.store(false, Ordering::SeqCst);
    CLOCK.advance(Duration::from_secs(2));
}

fn worker(recovery: Recovery) -> Worker {
    Worker::builder(&*STORE, recovery)
        .backoff(Duration::from_secs(10), Duration::from_secs(60))
        .max_attempts(2)
        .build()
}

#[tokio::test]
async fn an_abandoned_flow_is_finished_by_the_worker_and_replayed_to_its_caller() {
    let _serial = SERIAL.lock().await;
    abandon_in_step_two(&ORDERS, order("o-1".into(), 3, "gift")).await;
    assert_eq!(ORDERS.reserved.load(Ordering::SeqCst), 1);
    assert_eq!(ORDERS.charged.load(Ordering::SeqCst), 0);

    let w = worker(Recovery::new().register(recoverable!(order)));
    let pass = w.run_once().await.unwrap();
    assert_eq!((pass.found, pass.recovered), (1, 1), "{pass:?}");
    // Step one replayed, step two ran: each effect once.
    assert_eq!(ORDERS.reserved.load(Ordering::SeqCst), 1);
    assert_eq!(ORDERS.charged.load(Ordering::SeqCst), 1);

    // The caller comes back and gets the recovered result, without a run.
    assert_eq!(
        order("o-1".into(), 3, "gift").await.unwrap(),
        "o-1:30:charge-o-1:gift"
    );
    assert_eq!(ORDERS.charged.load(Ordering::SeqCst), 1);
    // Nothing is left for the next pass.
    assert_eq!(w.run_once().await.unwrap().found, 0);
    assert_eq!(w.stats().recovered, 1);
}

#[tokio::test]
async fn a_method_recovers_on_the_registered_service() {
    let _serial = SERIAL.lock().await;
    let shop = Shop { fx: &SHOP };
    let caller = shop.clone();
    abandon_in_step_two(&SHOP, async move { caller.buy("s-1").await }).await;
    let w = worker(Recovery::new().register(recoverable!(Shop::buy, shop.clone())));
    let pass = w.run_once().await.unwrap();
    assert_eq!(pass.recovered, 1, "{pass:?}");
    assert_eq!(SHOP.charged.load(Ordering::SeqCst), 1);
    assert_eq!(shop.buy("s-1").await.unwrap(), "charge-s-1");
    assert_eq!(SHOP.charged.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_final_error_during_recovery_compensates_the_finished_steps_once() {
    let _serial = SERIAL.lock().await;
    abandon_in_step_two(&GIVE_UPS, give_up("g-1".into())).await;
    GIVE_UPS.reject.store(true, Ordering::SeqCst);
    let w = worker(Recovery::new().register(recoverable!(give_up)));
    let pass = w.run_once().await.unwrap();
    assert_eq!((pass.gave_up, pass.recovered), (1, 0), "{pass:?}");
    assert_eq!(GIVE_UPS.released.load(Ordering::SeqCst), 1);
    // The final error is stored: the caller gets it, nothing runs or undoes again.
    assert!(matches!(
        give_up("g-1".into()).await,
        Err(AppError::Rejected)
    ));
    assert_eq!(w.run_once().await.unwrap().found, 0);
    assert_eq!(GIVE_UPS.released.load(Ordering::SeqCst), 1);
    assert_eq!(GIVE_UPS.reserved.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn failed_recoveries_back_off_then_park_and_an_operator_retries() {
    let _serial = SERIAL.lock().await;
    abandon_in_step_two(&FLAKY, flaky("f-1".into())).await;
    FLAKY.flaky.store(true, Ordering::SeqCst);
    let w = worker(Recovery::new().register(recoverable!(flaky)));
    let key = Key::builder("recovery.flaky").part("f-1").finish();

    let pass = w.run_once().await.unwrap();
    assert_eq!(pass.failed, 1, "{pass:?}");
    // The failed recovery kept its claim: the lease first, then the backoff.
    CLOCK.advance(Duration::from_secs(2));
    assert_eq!(w.run_once().await.unwrap().found, 0, "still in its backoff");
    CLOCK.advance(Duration::from_secs(10));
    assert_eq!(w.run_once().await.unwrap().failed, 1);
    CLOCK.advance(Duration::from_secs(30));
    let pass = w.run_once().await.unwrap();
    assert_eq!(
        pass.parked, 1,
        "the third turn parks after two attempts: {pass:?}"
    );
    let info = STORE.recovery_info(&key).await.unwrap().unwrap();
    assert_eq!(info.attempts, 2);
    assert!(info.parked.unwrap().contains("gave up after 2"));
    CLOCK.advance(Duration::from_secs(600));
    assert_eq!(w.run_once().await.unwrap().found, 0, "parked: left alone");

    // `idem recover`: the worker tries again, and this time it finishes.
    FLAKY.flaky.store(false, Ordering::SeqCst);
    assert!(STORE.retry_recovery(&key).await.unwrap());
    assert_eq!(w.run_once().await.unwrap().recovered, 1);
    assert_eq!(FLAKY.charged.load(Ordering::SeqCst), 1);
    assert_eq!(flaky("f-1".into()).await.unwrap(), "charge-f-1");
}

#[tokio::test]
async fn a_live_heartbeating_claim_is_never_touched() {
    let _serial = SERIAL.lock().await;
    static LIVE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
    static FX: LazyLock<Effects> = LazyLock::new(Effects::default);
    #[idempotent(scope = "recovery.live", key = "order_no", lease = "300ms", store = &*LIVE, recover)]
    async fn live(order_no: String) -> Result<String, AppError> {
        reserve(&FX, 1).await?;
        charge(&FX, &order_no).await
    }
    FX.hold.store(true, Ordering::SeqCst);
    let running = tokio::spawn(live("l-1".into()));
    let w = Worker::builder(&*LIVE, Recovery::new().register(recoverable!(live))).build();
    // Several leases long: the owner heartbeats, so nothing is abandoned.
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let pass = w.run_once().await.unwrap();
        assert_eq!(pass.found, 0, "{pass:?}");
    }
    FX.hold.store(false, Ordering::SeqCst);
    assert_eq!(running.await.unwrap().unwrap(), "charge-l-1");
    assert_eq!(FX.charged.load(Ordering::SeqCst), 1);
    assert_eq!(w.stats().recovered, 0);
}

#[tokio::test]
async fn two_workers_at_once_recover_each_flow_once() {
    let _serial = SERIAL.lock().await;
    static TWO: LazyLock<Effects> = LazyLock::new(Effects::default);
    #[idempotent(scope = "recovery.two", key = "order_no", lease = "1s", store = &*STORE, recover)]
    async fn two(order_no: u32) -> Result<String, AppError> {
        reserve(&TWO, 1).await?;
        charge(&TWO, &order_no.to_string()).await
    }
    for n in 0..6 {
        abandon_in_step_two(&TWO, two(n)).await;
    }
    let a = worker(Recovery::new().register(recoverable!(two)));
    let b = worker(Recovery::new().register(recoverable!(two)));
    let (pa, pb) = tokio::join!(a.run_once(), b.run_once());
    let (pa, pb) = (pa.unwrap(), pb.unwrap());
    assert_eq!(pa.recovered + pb.recovered, 6, "{pa:?} {pb:?}");
    // One turn per flow: the other worker never even ran the function.
    assert_eq!(pa.busy + pb.busy, 0, "{pa:?} {pb:?}");
    assert_eq!(TWO.reserved.load(Ordering::SeqCst), 6);
    assert_eq!(TWO.charged.load(Ordering::SeqCst), 6);
}

#[tokio::test]
async fn arguments_that_derive_another_key_are_parked_not_run() {
    let _serial = SERIAL.lock().await;
    static BEFORE: LazyLock<Effects> = LazyLock::new(Effects::default);
    // The call as it was made, keyed by `a`…
    #[idempotent(scope = "recovery.rekeyed", key = "a", lease = "1s", store = &*STORE, recover)]
    async fn rekeyed_then(a: u32, b: u32) -> Result<String, AppError> {
        reserve(&BEFORE, a).await?;
        charge(&BEFORE, &b.to_string()).await
    }
    // …and the function registered now, its key segments changed to `b`.
    #[idempotent(scope = "recovery.rekeyed", key = "b", lease = "1s", store = &*STORE, recover)]
    async fn rekeyed_now(a: u32, b: u32) -> Result<String, AppError> {
        reserve(&BEFORE, a).await?;
        charge(&BEFORE, &b.to_string()).await
    }
    abandon_in_step_two(&BEFORE, rekeyed_then(1, 2)).await;
    let w = worker(Recovery::new().register(recoverable!(rekeyed_now)));
    let pass = w.run_once().await.unwrap();
    assert_eq!(pass.parked, 1, "{pass:?}");
    // Nothing ran under the other key: it would have been another intent.
    assert_eq!(BEFORE.reserved.load(Ordering::SeqCst), 1);
    assert_eq!(BEFORE.charged.load(Ordering::SeqCst), 0);
    let key = Key::builder("recovery.rekeyed").part(&1u32).finish();
    let info = STORE.recovery_info(&key).await.unwrap().unwrap();
    assert!(info.parked.unwrap().contains("another key"));
}

#[tokio::test]
async fn unusable_arguments_are_parked_and_unknown_scopes_reported() {
    let _serial = SERIAL.lock().await;
    static OWN: LazyLock<MemoryStore> =
        LazyLock::new(|| MemoryStore::builder().clock(CLOCK.clone()).build());
    let claim = |key: &Key| ClaimRequest {
        key: Box::leak(Box::new(*key)),
        token: Token::random(),
        fingerprint: None,
        lease: Duration::from_secs(1),
        ttl: Duration::from_secs(3600),
    };
    // Bytes no caller of this deployment sealed, under a registered scope.
    let forged = Key::builder("recovery.order").part("forged").finish();
    let args = RecoveryArgs {
        scope: "recovery.order",
        args: br#"S0123456789012345678901234567890["forged",1,"x"]"#,
    };
    OWN.claim_recoverable(claim(&forged), args).await.unwrap();
    // A scope this worker has no function for.
    let foreign = Key::builder("billing.invoice").part(&7u64).finish();
    let args = RecoveryArgs {
        scope: "billing.invoice",
        args: b"[7]",
    };
    OWN.claim_recoverable(claim(&foreign), args).await.unwrap();
    CLOCK.advance(Duration::from_secs(2));

    let w = Worker::builder(&*OWN, Recovery::new().register(recoverable!(order))).build();
    let pass = w.run_once().await.unwrap();
    assert_eq!(pass.parked, 1, "{pass:?}");
    assert_eq!(pass.unregistered.get("billing.invoice"), Some(&1));
    let parked = OWN.recovery_info(&forged).await.unwrap().unwrap();
    assert!(parked.parked.unwrap().contains("seal"));
    // The foreign claim is untouched: no attempt counted, nothing parked.
    let foreign = OWN.recovery_info(&foreign).await.unwrap().unwrap();
    assert_eq!((foreign.attempts, foreign.parked), (0, None));
    assert_eq!(w.stats().unregistered.get("billing.invoice"), Some(&1));
}

static STALLS: LazyLock<Effects> = LazyLock::new(Effects::default);
/// Times the stalling step was entered (by the caller, then by the worker).
static STALL_ENTERED: AtomicUsize = AtomicUsize::new(0);
static QUICK: LazyLock<Effects> = LazyLock::new(Effects::default);

#[idempotent(scope = "recovery.stalls", key = "order_no", lease = "1s", store = &*STORE, recover)]
async fn stalls(order_no: String) -> Result<String, AppError> {
    reserve(&STALLS, 1).await?;
    stall(&order_no).await
}

/// Hangs while `STALLS.hold` is set, as a step waiting on a dead peer does.
#[step("stall")]
async fn stall(order_no: &str) -> Result<String, AppError> {
    STALL_ENTERED.fetch_add(1, Ordering::SeqCst);
    while STALLS.hold.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(format!("stalled-{order_no}"))
}

#[idempotent(scope = "recovery.quick", key = "order_no", lease = "1s", store = &*STORE, recover)]
async fn quick(order_no: String) -> Result<String, AppError> {
    reserve(&QUICK, 1).await?;
    charge(&QUICK, &order_no).await
}

async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_flow_hanging_in_a_step_does_not_stop_the_next_passes() {
    let _serial = SERIAL.lock().await;
    abandon_in_step_two(&STALLS, stalls("h-1".into())).await;
    // The worker's turn at it will hang in its second step too.
    STALLS.hold.store(true, Ordering::SeqCst);
    let w = Worker::builder(
        &*STORE,
        Recovery::new()
            .register(recoverable!(stalls))
            .register(recoverable!(quick)),
    )
    .poll_interval(Duration::from_millis(20))
    .concurrency(2)
    // No backoff to hide behind: only the worker's own running set keeps a
    // later pass from a second turn at the hanging claim, whose lease looks
    // run out each time the clock moves past it before its next heartbeat.
    .backoff(Duration::from_millis(1), Duration::from_millis(1))
    .build();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let w = w.clone();
        async move { w.run_until(stopped).await }
    });
    eventually("the worker's turn entered the hanging step", || {
        STALL_ENTERED.load(Ordering::SeqCst) == 2
    })
    .await;

    // Abandoned while the other turn hangs (and, as the clock moves on, its
    // lease looks run out too): the passes go on and finish it.
    abandon_in_step_two(&QUICK, quick("q-1".into())).await;
    eventually("a flow abandoned meanwhile was recovered", || {
        QUICK.charged.load(Ordering::SeqCst) == 1
    })
    .await;
    for _ in 0..5 {
        CLOCK.advance(Duration::from_secs(2));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert!(w.stats().passes >= 2, "{:?}", w.stats());
    // Never a second turn at the claim this worker is still running.
    assert_eq!(STALL_ENTERED.load(Ordering::SeqCst), 2);
    assert_eq!(w.stats().recovered, 1, "{:?}", w.stats());

    STALLS.hold.store(false, Ordering::SeqCst);
    stop.send(()).unwrap();
    running.await.unwrap();
    // Shutdown let the turn in progress finish.
    assert_eq!(w.stats().recovered, 2, "{:?}", w.stats());
    assert_eq!(
        stalls("h-1".into()).await.unwrap(),
        "stalled-h-1",
        "the caller coming back gets the recovered result"
    );
    assert_eq!(STALL_ENTERED.load(Ordering::SeqCst), 2);
}

/// Runs `calls` to its end on a runtime of its own, under `recorder` alone.
fn recorded(
    recorder: &metrics_util::debugging::DebuggingRecorder,
    calls: impl Future<Output = ()>,
) {
    metrics::with_local_recorder(recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(calls)
    });
}

/// The gauges of a scope go back to 0 once its abandoned claims are gone,
/// whether the store still lists the scope or not (they kept their last
/// value, so a dashboard showed a backlog that no longer existed).
#[test]
fn the_recovery_gauges_return_to_0_once_nothing_is_abandoned() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let clock = ManualClock::new(1_000_000);
    let own = MemoryStore::builder().clock(clock.clone()).build();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // A snapshot resets what it read (to 0, keys kept): the second pass gets
    // a recorder of its own, so only what that pass set is in its snapshot.
    type Snapshot = Vec<(
        metrics_util::CompositeKey,
        Option<metrics::Unit>,
        Option<metrics::SharedString>,
        DebugValue,
    )>;
    let gauge = |snapshot: &Snapshot, name: &str, scope: &str| -> Option<f64> {
        snapshot.iter().find_map(|(k, _, _, v)| {
            let key = k.key();
            let labelled = key
                .labels()
                .any(|l| l.key() == "scope" && l.value() == scope);
            match v {
                DebugValue::Gauge(g) if key.name() == name && labelled => Some(g.into_inner()),
                _ => None,
            }
        })
    };
    let foreign = Key::builder("billing.refund").part(&9u64).finish();
    let mine = Key::builder("recovery.order").part("gauged").finish();
    let foreign_token = Token::random();
    let w = Worker::builder(own.clone(), Recovery::new().register(recoverable!(order))).build();
    recorded(&recorder, async {
        for (key, scope, token) in [
            (&foreign, "billing.refund", foreign_token),
            (&mine, "recovery.order", Token::random()),
        ] {
            let req = ClaimRequest {
                key,
                token,
                fingerprint: None,
                lease: Duration::from_secs(1),
                ttl: Duration::from_secs(3600),
            };
            // Arguments nobody sealed: the registered scope's claim is parked.
            let args = RecoveryArgs {
                scope,
                args: b"[9]",
            };
            own.claim_recoverable(req, args).await.unwrap();
        }
        clock.advance(Duration::from_secs(60));
        w.run_once().await.unwrap();
    });
    let first = snapshotter.snapshot().into_vec();
    assert_eq!(
        gauge(&first, "idem_recovery_unregistered", "billing.refund"),
        Some(1.0)
    );
    let oldest = gauge(
        &first,
        "idem_recovery_oldest_abandoned_seconds",
        "billing.refund",
    );
    assert!(oldest >= Some(59.0), "{oldest:?}");
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorded(&recorder, async {
        // Its owner's service came back and gave it up: nothing of
        // the scope is left in the store's answer.
        assert!(own.release(&foreign, foreign_token).await.unwrap());
        w.run_once().await.unwrap();
    });
    let second = snapshotter.snapshot().into_vec();
    assert_eq!(
        gauge(&second, "idem_recovery_unregistered", "billing.refund"),
        Some(0.0)
    );
    assert_eq!(
        gauge(
            &second,
            "idem_recovery_oldest_abandoned_seconds",
            "billing.refund"
        ),
        Some(0.0)
    );
    // The parked claim is not waiting for the worker any more either.
    assert_eq!(
        gauge(
            &second,
            "idem_recovery_oldest_abandoned_seconds",
            "recovery.order"
        ),
        Some(0.0)
    );
}

/// The README's "Recovery" example, line for line.
mod readme {
    use super::*;

    #[derive(Clone)]
    pub struct OrderService;

    #[derive(Serialize, Deserialize)]
    pub struct CreateOrder {
        pub client_order_no: String,
        pub qty: u32,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    pub struct Order {
        pub client_order_no: String,
        pub qty: u32,
    }

    impl OrderService {
        #[idempotent(scope = "orders.create", key = "req.client_order_no", final_err = AppError::is_final, recover)]
        async fn create_order(&self, req: CreateOrder) -> Result<Order, AppError> {
            self.order_flow(req).await // its steps, as any flow's
        }

        async fn order_flow(&self, req: CreateOrder) -> Result<Order, AppError> {
            Ok(Order {
                client_order_no: req.client_order_no,
                qty: req.qty,
            })
        }
    }

    #[idempotent(scope = "orders.cancel", key = "client_order_no", recover)]
    async fn cancel_order(client_order_no: String) -> Result<(), AppError> {
        let _ = client_order_no;
        Ok(())
    }

    #[tokio::test]
    async fn the_readme_example_registers_and_runs() {
        let store = MemoryStore::new();
        // This binary's other tests pass their store explicitly.
        idem_runtime::install(store.clone());
        let service = OrderService;
        // At start-up, one line per function, then the worker beside the service:
        let recovery = Recovery::new()
            .register(recoverable!(OrderService::create_order, service.clone())) // a method: the service it runs on
            .register(recoverable!(cancel_order)); // a free fn
        let worker = Worker::builder(store.clone(), recovery).build();
        tokio::spawn(async move { worker.run().await });
        let req = CreateOrder {
            client_order_no: "c-1".into(),
            qty: 2,
        };
        assert_eq!(service.create_order(req).await.unwrap().qty, 2);
    }
}

/// The guide's "On an axum handler": the handler extracts and answers, the
/// service method it calls carries `recover`. A request dropped inside the
/// method's second step is finished by the worker, and the client's retry of
/// the request (same `Idempotency-Key`) gets the stored result.
mod axum_handler {
    use std::sync::Arc;

    use axum::body::Body;
    use axum::extract::State;
    use axum::http::{Request, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::{Extension, Json, Router, routing::post};
    use http_body_util::BodyExt;
    use idem_runtime::http::{IdempotencyKey, KeyCaller};
    use tower::ServiceExt;

    use super::*;

    static SEATS: LazyLock<Effects> = LazyLock::new(Effects::default);

    #[derive(Serialize, Deserialize)]
    pub struct Reserve {
        seats: u32,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    pub struct Reservation {
        hold: u64,
        charge: String,
    }

    pub struct Reservations;

    impl Reservations {
        #[idempotent(scope = "recovery.reservations", key = "caller|key", lease = "1s", store = &*STORE, recover)]
        async fn create(
            &self,
            caller: String,
            key: String,
            req: Reserve,
        ) -> Result<Reservation, AppError> {
            let _ = caller;
            let hold = reserve(&SEATS, req.seats).await?;
            let charge = charge(&SEATS, &key).await?;
            Ok(Reservation { hold, charge })
        }
    }

    impl IntoResponse for AppError {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    async fn reserve_seats(
        State(service): State<Arc<Reservations>>,
        key: IdempotencyKey,
        Json(req): Json<Reserve>,
    ) -> Result<Json<Reservation>, AppError> {
        let reservation = service
            .create(key.caller().into(), key.key().into(), req)
            .await?;
        Ok(Json(reservation))
    }

    fn request() -> Request<Body> {
        Request::post("/reservations")
            .header("idempotency-key", "k-1")
            .header("x-tenant", "acme")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"seats":2}"#))
            .unwrap()
    }

    #[tokio::test]
    async fn a_request_dropped_mid_flow_is_finished_by_the_worker_and_its_retry_replays() {
        let _serial = SERIAL.lock().await;
        let service = Arc::new(Reservations);
        let router = Router::new()
            .route("/reservations", post(reserve_seats))
            .layer(Extension(KeyCaller::new(|p| {
                p.headers.get("x-tenant")?.to_str().ok().map(str::to_owned)
            })))
            .with_state(service.clone());

        let dropped = router.clone();
        abandon_in_step_two(&SEATS, async move { dropped.oneshot(request()).await }).await;
        assert_eq!(SEATS.charged.load(Ordering::SeqCst), 0);

        let w = worker(Recovery::new().register(recoverable!(Reservations::create, service)));
        let pass = w.run_once().await.unwrap();
        assert_eq!(pass.recovered, 1, "{pass:?}");
        assert_eq!(SEATS.charged.load(Ordering::SeqCst), 1);

        // The client retries its request: the stored result, nothing runs again.
        let response = router.oneshot(request()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let reservation: Reservation = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            reservation,
            Reservation {
                hold: 20,
                charge: "charge-k-1".into()
            }
        );
        assert_eq!(SEATS.reserved.load(Ordering::SeqCst), 1);
        assert_eq!(SEATS.charged.load(Ordering::SeqCst), 1);
    }
}

/// Dropping the worker's future (its task aborted) stops the recovered call
/// it was running, as dropping any idempotent call's future does: the call
/// must not run on unwatched, charging after the worker is gone.
#[tokio::test]
async fn dropping_the_worker_stops_the_call_it_was_recovering() {
    let _serial = SERIAL.lock().await;
    abandon_in_step_two(&DROPS, dropped_worker("d-1".into())).await;
    DROPS.hold.store(true, Ordering::SeqCst);
    let entered = DROPS.entered.load(Ordering::SeqCst);
    let w = Worker::builder(
        &*STORE,
        Recovery::new().register(recoverable!(dropped_worker)),
    )
    .poll_interval(Duration::from_millis(20))
    .build();
    let running = tokio::spawn(async move { w.run().await });
    eventually("the worker's turn entered step two", || {
        DROPS.entered.load(Ordering::SeqCst) > entered
    })
    .await;
    running.abort();
    let _ = running.await;
    DROPS.hold.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        DROPS.charged.load(Ordering::SeqCst),
        0,
        "the call went on charging after its worker was dropped"
    );
}
