//! The explorer (`idem_runtime::testing`, feature `testing`) on a small order
//! flow of three steps: it passes the correct flow, every time, and catches
//! each broken variant with a report that says what happened.
//!
//! The shop keeps its tables in memory, so a schedule's fresh state is a
//! fresh `Shop`: stock with a ledger (a unique row per order), orders (a
//! unique order number), and a payment provider that deduplicates on the
//! idempotency key it is given.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use idem_runtime::store::StoreRef;
use idem_runtime::testing::{Explorer, Faults, Report};
use idem_runtime::{idempotent, step};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Correct,
    /// The body writes a row itself, outside any step.
    WriteInTheBody,
    /// `insert_order` fails on its own row instead of returning it.
    NoConflictIsSuccess,
    /// The charge goes to the provider without the step's key.
    ChargeWithoutKey,
    /// A later build: `deduct_stock` renamed `take_stock`.
    RenamedStep,
    /// A later build: the order inserted before the stock moves.
    ReorderedSteps,
    /// A later build: no charge step.
    RemovedStep,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Tables {
    stock: i64,
    ledger: BTreeSet<String>,
    orders: BTreeMap<String, u64>,
    /// The provider's charges, by the idempotency key it was given (or a
    /// fresh one per request without).
    charges: BTreeMap<String, u64>,
    emails: u32,
}

#[derive(Debug, thiserror::Error)]
enum ShopError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error("order {0} exists")]
    Duplicate(String),
}

struct Shop {
    store: StoreRef,
    variant: Variant,
    /// The call with a short lease: for a store on its server's clock,
    /// whose leases run out in real time.
    short_lease: bool,
    tables: Mutex<Tables>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Placed {
    order_id: u64,
    charge: String,
}

impl Shop {
    fn new(store: StoreRef, variant: Variant, short_lease: bool) -> Arc<Shop> {
        Arc::new(Shop {
            store,
            variant,
            short_lease,
            tables: Mutex::new(Tables {
                stock: 10,
                ..Tables::default()
            }),
        })
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap()
    }

    async fn order(&self, order_no: String) -> Result<Placed, ShopError> {
        if self.short_lease {
            self.place_with_a_short_lease(order_no).await
        } else {
            self.place(order_no).await
        }
    }

    #[idempotent(scope = "tests.explorer.place", key = "order_no", store = self.store.clone())]
    async fn place(&self, order_no: String) -> Result<Placed, ShopError> {
        self.flow(order_no).await
    }

    #[idempotent(scope = "tests.explorer.place", key = "order_no", lease = "300ms", store = self.store.clone())]
    async fn place_with_a_short_lease(&self, order_no: String) -> Result<Placed, ShopError> {
        self.flow(order_no).await
    }

    async fn flow(&self, order_no: String) -> Result<Placed, ShopError> {
        let order_id = match self.variant {
            Variant::RenamedStep => {
                self.take_stock(&order_no).await?;
                self.insert_order(&order_no).await?
            }
            Variant::ReorderedSteps => {
                let id = self.insert_order(&order_no).await?;
                self.deduct_stock(&order_no).await?;
                id
            }
            _ => {
                self.deduct_stock(&order_no).await?;
                self.insert_order(&order_no).await?
            }
        };
        if self.variant == Variant::WriteInTheBody {
            self.tables().emails += 1;
        }
        let charge = match self.variant {
            Variant::RemovedStep => String::from("none"),
            _ => self.charge(order_id).await?,
        };
        Ok(Placed { order_id, charge })
    }

    /// `deduct_stock` under another name.
    #[step("take_stock")]
    async fn take_stock(&self, order_no: &str) -> Result<(), ShopError> {
        self.deduct_stock_now(order_no);
        Ok(())
    }

    fn deduct_stock_now(&self, order_no: &str) {
        let mut t = self.tables();
        if t.ledger.insert(order_no.to_owned()) {
            t.stock -= 1;
        }
    }

    /// A ledger row unique per order; stock moves only with a new row.
    #[step("deduct_stock")]
    async fn deduct_stock(&self, order_no: &str) -> Result<(), ShopError> {
        self.deduct_stock_now(order_no);
        Ok(())
    }

    /// The order's row, or the one already there (conflict is success).
    #[step("insert_order")]
    async fn insert_order(&self, order_no: &str) -> Result<u64, ShopError> {
        let mut t = self.tables();
        if let Some(&id) = t.orders.get(order_no) {
            if self.variant == Variant::NoConflictIsSuccess {
                return Err(ShopError::Duplicate(order_no.to_owned()));
            }
            return Ok(id);
        }
        let id = t.orders.len() as u64 + 1;
        t.orders.insert(order_no.to_owned(), id);
        Ok(id)
    }

    /// The payment provider, given the step's key as its idempotency key:
    /// a charge sent again under the same key is the same charge.
    #[step("charge")]
    async fn charge(&self, order_id: u64) -> Result<String, ShopError> {
        let key = match self.variant {
            Variant::ChargeWithoutKey => format!("request-{}", self.tables().charges.len()),
            _ => idem_runtime::current_key().expect("inside a step").to_hex(),
        };
        let mut t = self.tables();
        let n = t.charges.len() as u64 + 1;
        let id = *t.charges.entry(key).or_insert(n);
        Ok(format!("ch-{order_id}-{id}"))
    }
}

fn explorer(variant: Variant) -> Explorer<Arc<Shop>, Placed, ShopError, Tables> {
    explorer_with(variant, false)
}

fn explorer_with(
    variant: Variant,
    short_lease: bool,
) -> Explorer<Arc<Shop>, Placed, ShopError, Tables> {
    Explorer::new(
        move |store| async move { Shop::new(store, variant, short_lease) },
        |shop: Arc<Shop>| async move { shop.order("order-7".to_owned()).await },
        |shop: Arc<Shop>| async move {
            let mut t = shop.tables().clone();
            // Which key the provider saw differs per run; how many charges
            // it made does not.
            t.charges = t
                .charges
                .values()
                .map(|id| (String::from("charge"), *id))
                .collect();
            t
        },
    )
}

fn kinds(report: &Report) -> Vec<&'static str> {
    report.by_kind().iter().map(|(k, _)| *k).collect()
}

#[tokio::test]
async fn the_correct_flow_passes_every_schedule_three_runs_in_a_row() {
    for _ in 0..3 {
        let report = explorer(Variant::Correct).run().await;
        report.assert_passed();
        // 3 steps and the call: a claim and a record each, 8 points; 4
        // schedules per point and one duplicate after the result.
        assert_eq!(report.explored(), 8 * 4 + 1, "{report}");
        assert_eq!(
            kinds(&report),
            [
                "cut off before a store operation",
                "cut off after a store operation",
                "duplicate while the first call runs",
                "stale owner going on after a takeover",
                "duplicate after the result is stored",
            ],
            "{report}"
        );
        assert!(report.by_kind().iter().all(|(_, n)| *n > 0), "{report}");
        let text = report.to_string();
        assert!(
            text.starts_with("idem explorer: 33 schedules passed"),
            "{text}"
        );
    }
}

#[tokio::test]
async fn a_write_in_the_body_is_caught_with_the_state_it_doubled() {
    let report = explorer(Variant::WriteInTheBody).run().await;
    let failure = report.failure().expect("caught");
    let text = report.to_string();
    // The first schedule that shows it: a stale owner. The caller that took
    // over ran the body, the write with it; the first caller, going on,
    // replays every step and writes again before its record is refused.
    assert_eq!(
        failure.schedule(),
        "call 1 stalls past its lease before its store operation #2 (claim step `deduct_stock`), another takes over, then call 1 goes on",
        "{text}"
    );
    assert_eq!(
        failure.problem(),
        "the state differs from the clean run's:\n  clean run: emails: 1,\n  this run:  emails: 2,",
        "{text}"
    );
    let events = failure.events().join("\n");
    for line in [
        "call 1: claim call `tests.explorer.place` → acquired (fence 1)",
        "call 1: held before: claim step `deduct_stock`",
        "call 1 stalls there; the clock moves 31s: its lease runs out",
        "call 2: claim call `tests.explorer.place` → acquired (fence 2, taken over)",
        "call 2: record the outcome of call `tests.explorer.place` → ok",
        "call 1 goes on",
        "call 1: claim step `charge` → done (a stored outcome to replay)",
        "call 1: record the outcome of call `tests.explorer.place` → refused (no longer this caller's)",
    ] {
        assert!(events.contains(line), "missing {line:?} in:\n{text}");
    }
    // Narrowed to cut offs, the retry after a cut off shows it too.
    let report = explorer(Variant::WriteInTheBody)
        .only(Faults::CUT_OFFS)
        .run()
        .await;
    let failure = report.failure().expect("caught");
    assert_eq!(
        failure.schedule(),
        "call 1 cut off before its store operation #6 (claim step `charge`)",
        "{report}"
    );
}

#[tokio::test]
async fn a_step_that_fails_on_its_own_row_is_caught() {
    let report = explorer(Variant::NoConflictIsSuccess).run().await;
    let failure = report.failure().expect("caught");
    let text = report.to_string();
    assert_eq!(
        failure.schedule(),
        "call 1 cut off before its store operation #5 (record the outcome of step `insert_order`)",
        "{text}"
    );
    assert_eq!(
        failure.problem(),
        "the call did not succeed in 5 retries",
        "{text}"
    );
    assert!(
        text.contains("call 2 returns Duplicate(\"order-7\") (idem: Failed)"),
        "{text}"
    );
}

#[tokio::test]
async fn a_charge_without_the_steps_key_is_caught() {
    let report = explorer(Variant::ChargeWithoutKey).run().await;
    let failure = report.failure().expect("caught");
    let text = report.to_string();
    assert_eq!(
        failure.schedule(),
        "call 1 cut off before its store operation #7 (record the outcome of step `charge`)",
        "{text}"
    );
    assert_eq!(
        failure.problem(),
        "call 2 returned Ok(Placed { order_id: 1, charge: \"ch-1-2\" }); the clean run returned Ok(Placed { order_id: 1, charge: \"ch-1-1\" })",
        "{text}"
    );
}

#[tokio::test]
async fn narrowed_to_one_kind_and_one_step() {
    let report = explorer(Variant::Correct)
        .only(Faults::CUT_OFFS)
        .step("charge")
        .run()
        .await;
    report.assert_passed();
    assert_eq!(
        report.by_kind(),
        [
            ("cut off before a store operation", 2),
            ("cut off after a store operation", 2)
        ],
        "{report}"
    );
}

#[tokio::test]
async fn on_sqlite_as_on_the_memory_store() {
    use idem_runtime::store::AsStore;
    use idem_runtime::store::sql::SqliteStore;
    let report = explorer(Variant::Correct)
        .store(|clock| async move {
            let store = SqliteStore::builder().clock(clock).in_memory().await;
            store.expect("an in-memory SQLite store").store_ref()
        })
        .run()
        .await;
    report.assert_passed();
    assert_eq!(report.explored(), 33, "{report}");
}

/// On PostgreSQL, whose leases run on the server's clock: each schedule on a
/// schema of its own, the call's lease 300 ms, the explorer waiting 400 ms
/// of real time where a lease must run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgresql_with_real_time_leases() {
    use idem_runtime::store::AsStore;
    use std::sync::atomic::{AtomicU32, Ordering};

    let url = idem_tests::services::postgres_url();
    let Some(admin) =
        idem_tests::services::reachable("PostgreSQL", &url, sqlx::PgPool::connect(&url).await)
    else {
        return;
    };
    let run = format!("idem_explorer_{}", std::process::id());
    let schemas = Arc::new(AtomicU32::new(0));
    let report = {
        let (url, run, schemas, admin) = (url.clone(), run.clone(), schemas.clone(), admin.clone());
        explorer_with(Variant::Correct, true)
            .real_time_leases(std::time::Duration::from_millis(400))
            .store(move |_clock| {
                let (url, admin) = (url.clone(), admin.clone());
                let schema = format!("{run}_{}", schemas.fetch_add(1, Ordering::SeqCst));
                async move {
                    idem_tests::sql::pg_store_in_schema(&admin, &url, &schema)
                        .await
                        .store_ref()
                }
            })
            .run()
            .await
    };
    for n in 0..schemas.load(Ordering::SeqCst) {
        sqlx::query(&format!("DROP SCHEMA {run}_{n} CASCADE"))
            .execute(&admin)
            .await
            .unwrap();
    }
    report.assert_passed();
    assert_eq!(report.explored(), 33, "{report}");
}

/// The step history: the first run writes the file; a rename, a reorder and
/// a removal each fail, naming the step; accepting writes the new history,
/// which then holds.
#[tokio::test]
async fn the_step_history_names_a_rename_a_reorder_and_a_removal() {
    let dir = std::env::temp_dir().join(format!(
        "idem-explorer-steps-{}",
        idem_tests::consumer::suffix()
    ));
    let path = dir.join("place.txt");
    let check = |variant: Variant, accept: bool| {
        explorer(variant)
            .only(Faults::CUT_OFFS)
            .step_history(&path)
            .accept_step_history(accept)
            .run()
    };
    let lines = || -> Vec<String> {
        std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(str::to_owned)
            .collect()
    };
    let first = check(Variant::Correct, true).await;
    first.assert_passed();
    assert_eq!(lines(), ["deduct_stock", "insert_order", "charge"]);
    assert!(
        first.to_string().contains("wrote the step history to"),
        "{first}"
    );
    check(Variant::Correct, false).await.assert_passed();

    for (variant, change) in [
        (
            Variant::RenamedStep,
            "step `deduct_stock` is now `take_stock` (renamed)",
        ),
        (
            Variant::ReorderedSteps,
            "the steps `deduct_stock`, `insert_order` run in another order",
        ),
        (Variant::RemovedStep, "step `charge` removed"),
    ] {
        let report = check(variant, false).await;
        let failure = report.failure().expect("a changed history fails");
        assert_eq!(failure.schedule(), "the step history", "{report}");
        assert!(failure.problem().contains(change), "{variant:?}: {report}");
        assert!(
            failure.problem().contains("IDEM_ACCEPT_STEPS=1"),
            "{report}"
        );
        assert_eq!(report.explored(), 0, "no schedule runs: {report}");
    }

    let accepted = check(Variant::RenamedStep, true).await;
    accepted.assert_passed();
    assert!(
        accepted
            .to_string()
            .contains("accepted the new step history"),
        "{accepted}"
    );
    assert_eq!(lines(), ["take_stock", "insert_order", "charge"]);
    check(Variant::RenamedStep, false).await.assert_passed();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README's example: the correct flow, with its step history committed
/// in `tests/steps/place.txt`.
#[tokio::test]
async fn the_readme_example() {
    let report = Explorer::new(
        |store| async move { Shop::new(store, Variant::Correct, false) }, // fresh state around the store it gives
        |shop: Arc<Shop>| async move { shop.order("order-7".to_owned()).await },
        |shop: Arc<Shop>| async move { shop.tables().clone() }, // what must come out the same
    )
    .step_history(concat!(env!("CARGO_MANIFEST_DIR"), "/steps/place.txt"))
    .run()
    .await;
    report.assert_passed();
    assert!(
        report.to_string().contains("the step history in"),
        "{report}"
    );
}

/// A booking that gives up: a room held (compensated by releasing it), then
/// a payment the card declines, a final error. Every schedule must end with
/// that error and the room released once.
mod giving_up {
    use super::*;

    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    pub enum BookError {
        Idem(String),
        Declined,
    }

    impl From<idem_runtime::Error> for BookError {
        fn from(e: idem_runtime::Error) -> Self {
            BookError::Idem(e.to_string())
        }
    }

    impl BookError {
        fn is_final(&self) -> bool {
            matches!(self, BookError::Declined)
        }
    }

    #[derive(Debug, Default, Clone, PartialEq)]
    pub struct Rooms {
        free: i64,
        held: BTreeSet<String>,
    }

    #[derive(Clone)]
    pub struct Hotel {
        store: StoreRef,
        /// The release adds the room back without looking whether it did.
        blind_release: bool,
        rooms: Arc<Mutex<Rooms>>,
    }

    impl Hotel {
        #[idempotent(scope = "tests.explorer.book", key = "booking", final_err = BookError::is_final, store = self.store.clone())]
        pub async fn book(&self, booking: String) -> Result<String, BookError> {
            let hold = self.hold_room(&booking).await?;
            self.pay().await?;
            Ok(hold)
        }

        #[step("hold_room", compensate = "release_room")]
        async fn hold_room(&self, booking: &str) -> Result<String, BookError> {
            let mut r = self.rooms.lock().unwrap();
            if r.held.insert(booking.to_owned()) {
                r.free -= 1;
            }
            Ok(booking.to_owned())
        }

        /// Conflict is success on the undone hold: releasing a hold that is
        /// gone changes nothing.
        async fn release_room(&self, hold: String) -> Result<(), BookError> {
            let mut r = self.rooms.lock().unwrap();
            if r.held.remove(&hold) || self.blind_release {
                r.free += 1;
            }
            Ok(())
        }

        #[step("pay")]
        async fn pay(&self) -> Result<(), BookError> {
            Err(BookError::Declined)
        }
    }

    pub fn explorer(blind_release: bool) -> Explorer<Hotel, String, BookError, Rooms> {
        Explorer::new(
            move |store| async move {
                Hotel {
                    store,
                    blind_release,
                    rooms: Arc::new(Mutex::new(Rooms {
                        free: 3,
                        ..Rooms::default()
                    })),
                }
            },
            |hotel: Hotel| async move { hotel.book("booking-9".to_owned()).await },
            |hotel: Hotel| async move { hotel.rooms.lock().unwrap().clone() },
        )
    }
}

#[tokio::test]
async fn a_flow_that_gives_up_reaches_its_final_error_with_each_hold_released_once() {
    let report = giving_up::explorer(false).run().await;
    report.assert_passed();
    // The compensation's claim and record are fault points too.
    assert!(report.explored() > 8 * 4, "{report}");
}

#[tokio::test]
async fn a_compensation_that_undoes_twice_is_caught() {
    let report = giving_up::explorer(true).run().await;
    let failure = report.failure().expect("caught");
    let text = report.to_string();
    assert!(
        failure
            .schedule()
            .contains("(record the outcome of step `release_room`)"),
        "{text}"
    );
    assert_eq!(
        failure.problem(),
        "the state differs from the clean run's:\n  clean run: free: 3,\n  this run:  free: 4,",
        "{text}"
    );
    assert!(
        text.contains("returns the clean run's final error"),
        "{text}"
    );
}

/// A `recover` flow: each cut off is tried once more with the recovery
/// worker finishing the call, and the caller coming back gets the clean
/// outcome. A desk that books a seat (a step) and sends a confirmation:
/// correct in a step with the step's key, broken in the body.
mod recovering {
    use idem_runtime::recoverable;
    use idem_runtime::recovery::Recovery;

    use super::*;

    #[derive(Debug, Default, Clone, PartialEq)]
    pub struct Seats {
        booked: BTreeSet<String>,
        /// Confirmations the mail service sent, by the key it was given.
        confirmations: BTreeSet<String>,
        /// Confirmations sent from the body, where no key is stable.
        sent_from_the_body: u32,
    }

    #[derive(Clone)]
    pub struct Desk {
        store: StoreRef,
        confirm_in_the_body: bool,
        seats: Arc<Mutex<Seats>>,
    }

    impl Desk {
        #[idempotent(scope = "tests.explorer.desk", key = "seat", store = self.store.clone(), recover)]
        pub async fn book(&self, seat: String) -> Result<String, ShopError> {
            self.take_seat(&seat).await?;
            if self.confirm_in_the_body {
                self.seats.lock().unwrap().sent_from_the_body += 1;
            } else {
                self.confirm().await?;
            }
            Ok(format!("seat {seat}"))
        }

        #[step("take_seat")]
        async fn take_seat(&self, seat: &str) -> Result<(), ShopError> {
            self.seats.lock().unwrap().booked.insert(seat.to_owned());
            Ok(())
        }

        /// The mail service deduplicates on the step's key.
        #[step("confirm")]
        async fn confirm(&self) -> Result<(), ShopError> {
            let key = idem_runtime::current_key().expect("in a step").to_hex();
            self.seats.lock().unwrap().confirmations.insert(key);
            Ok(())
        }
    }

    pub fn explorer(confirm_in_the_body: bool) -> Explorer<Desk, String, ShopError, Seats> {
        Explorer::new(
            move |store| async move {
                Desk {
                    store,
                    confirm_in_the_body,
                    seats: Arc::default(),
                }
            },
            |desk: Desk| async move { desk.book("12A".to_owned()).await },
            |desk: Desk| async move { desk.seats.lock().unwrap().clone() },
        )
        .only(Faults::CUT_OFFS)
        .recover_with(|desk: Desk| Recovery::new().register(recoverable!(Desk::book, desk)))
    }
}

#[tokio::test]
async fn the_recovery_worker_finishes_each_cut_off_call() {
    let report = recovering::explorer(false).run().await;
    report.assert_passed();
    let worker = report
        .by_kind()
        .iter()
        .find(|(k, _)| *k == "cut off, then finished by the recovery worker")
        .map(|(_, n)| *n);
    // 6 fault points (the call's claim and record, each step's claim and
    // record), two schedules each with the worker.
    assert_eq!(worker, Some(12), "{report}");
    assert!(report.finished_by_the_worker() >= 6, "{report}");
}

#[tokio::test]
async fn a_confirmation_in_a_recovered_body_is_caught() {
    let report = recovering::explorer(true).run().await;
    let failure = report.failure().expect("caught");
    let text = report.to_string();
    assert!(
        failure.problem().contains("sent_from_the_body: 2"),
        "{text}"
    );
}
