//! Prove your own handlers idempotent (feature `testing`): an explorer that
//! runs your call once cleanly, then once per fault point of that run, each
//! on fresh state, and compares what came out.
//!
//! idem makes the claim, the steps and the replays safe; your body can still
//! break the rule that one run and N runs leave the same state and the same
//! number of side effects: a write made in the body instead of in a
//! `#[step]`, a step that is not "conflict is success" on its own row, a
//! step whose output depends on the clock. The explorer finds those before
//! production does.
//!
//! You give it three closures: how to make fresh state around a store (your
//! service, on fresh tables, its `#[idempotent]` functions given that store
//! with `store = …`), the call to make, and a snapshot of what must come out
//! the same (your business rows and your effect counters, any `PartialEq +
//! Debug` value). The store it hands you is the one to use: it passes every
//! operation to a real store (a [`MemoryStore`] on a [`ManualClock`] unless
//! you give [`Explorer::store`]) and holds the operation a schedule names.
//! The fault points are your call's store operations in the clean run: each
//! claim and each record of the call and of every step. At each one:
//!
//! - **cut off** (before the operation reaches the store, and after it did):
//!   the caller's future is dropped, as a timeout or a killed process drops
//!   it; the lease runs out on the clock, and the call is retried until it
//!   succeeds;
//! - **duplicate**: a second call arrives while the first is held there, and
//!   then the first goes on; one more schedule sends the duplicate after the
//!   first call's result is stored;
//! - **stale owner**: the first call is held there past its lease, a second
//!   call takes the record over and finishes, then the first goes on;
//! - **recovered** (with [`Explorer::recover_with`], for a `recover`
//!   function): cut off there, then a recovery worker's pass finishes the
//!   call, and the caller comes back.
//!
//! The clean run may also end with a final error idem records
//! (`final_err`): then the compensations' claims and records are fault
//! points too, and every schedule must reach that same error with each
//! effect undone once. The explorer does not make your steps fail: to give
//! up at each step in turn, explore one call per step whose test double
//! fails there (a card declined at `pay`, a carrier refusing at `ship`).
//!
//! After each schedule every call that returned `Ok` must have returned the
//! clean run's value, every `Err` must be one idem documents for that
//! situation (`InProgress`, `KeyReuse`, a lost lease, a fenced completion;
//! read from idem's own report of the call, whatever your error type), the
//! call must succeed within a few retries, and the snapshot must equal the
//! clean run's. The first failing schedule is reported as what happened in
//! order, with the snapshot's difference.
//!
//! ```
//! use std::collections::BTreeSet;
//! use std::sync::{Arc, Mutex};
//! use idem_runtime::store::StoreRef;
//! use idem_runtime::testing::Explorer;
//! use idem_runtime::{idempotent, step};
//!
//! struct Shop {
//!     store: StoreRef,
//!     /// The payment provider's charges, by the idempotency key sent.
//!     charges: Mutex<BTreeSet<String>>,
//! }
//!
//! impl Shop {
//!     #[idempotent(scope = "doc.checkout", key = "order", store = self.store.clone())]
//!     async fn checkout(&self, order: u64) -> Result<u64, idem_runtime::Error> {
//!         self.charge(order).await
//!     }
//!
//!     /// The provider gets the step's key: a charge sent again after a
//!     /// crash is the same charge. (Send none, and the explorer reports
//!     /// two charges after a cut off before the step's record.)
//!     #[step("charge")]
//!     async fn charge(&self, order: u64) -> Result<u64, idem_runtime::Error> {
//!         let key = idem_runtime::current_key().expect("inside a step").to_hex();
//!         self.charges.lock().unwrap().insert(key);
//!         Ok(order * 100)
//!     }
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let report = Explorer::new(
//!     |store| async move { Arc::new(Shop { store, charges: Mutex::default() }) },
//!     |shop: Arc<Shop>| async move { shop.checkout(7).await },
//!     |shop: Arc<Shop>| async move { shop.charges.lock().unwrap().len() },
//! )
//! .run()
//! .await;
//! report.assert_passed();
//! assert_eq!(report.explored(), 17); // 4 points, 4 schedules each, and one more
//! # });
//! ```
//!
//! What it cannot see: effects outside the process that your snapshot does
//! not read; a crash between two system calls of one await (a cut off drops
//! the future at an await, as a killed process stops at one); code that
//! behaves differently on every run (the fault points come from the clean
//! run; a point a later run does not reach is counted as skipped).
//!
//! [`MemoryStore`]: crate::store::memory::MemoryStore

mod faults;
mod history;
mod report;
mod run;
mod schedule;
mod verdict;

pub use history::ACCEPT_ENV;
pub use report::{Failure, Report};
pub use schedule::Faults;

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::clock::ManualClock;
use crate::store::StoreRef;
use crate::store::memory::MemoryStore;

type Fresh<S> = Box<dyn Fn(StoreRef) -> BoxFuture<'static, S> + Send + Sync>;
type Call<S, T, E> = Box<dyn Fn(S) -> BoxFuture<'static, Result<T, E>> + Send + Sync>;
type Snapshot<S, P> = Box<dyn Fn(S) -> BoxFuture<'static, P> + Send + Sync>;
type MakeStore = Box<dyn Fn(ManualClock) -> BoxFuture<'static, StoreRef> + Send + Sync>;

/// The explorer: see the [module docs](self).
pub struct Explorer<S, T, E, P> {
    fresh: Fresh<S>,
    call: Call<S, T, E>,
    snapshot: Snapshot<S, P>,
    store: MakeStore,
    faults: Faults,
    step: Option<String>,
    retries: u32,
    real_lease: Option<Duration>,
    history: Option<std::path::PathBuf>,
    accept: Option<bool>,
    recovery: Option<Box<dyn Fn(S) -> crate::recovery::Recovery + Send + Sync>>,
    /// Calls the recovery worker finished (with their result or a final
    /// error), over all schedules.
    finished_by_worker: std::sync::atomic::AtomicUsize,
}

impl<S, T, E, P> Explorer<S, T, E, P>
where
    S: Clone + Send + Sync + 'static,
    T: PartialEq + Debug + Send + 'static,
    E: Debug + Send + 'static,
    P: PartialEq + Debug + Send + 'static,
{
    /// `fresh` makes your service around the store it is given (fresh
    /// tables, fresh counters: it runs once per schedule), `call` makes the
    /// call under test, `snapshot` reads what must come out the same.
    pub fn new<FF, FFut, CF, CFut, SF, SFut>(fresh: FF, call: CF, snapshot: SF) -> Self
    where
        FF: Fn(StoreRef) -> FFut + Send + Sync + 'static,
        FFut: Future<Output = S> + Send + 'static,
        CF: Fn(S) -> CFut + Send + Sync + 'static,
        CFut: Future<Output = Result<T, E>> + Send + 'static,
        SF: Fn(S) -> SFut + Send + Sync + 'static,
        SFut: Future<Output = P> + Send + 'static,
    {
        Explorer {
            fresh: Box::new(move |store| Box::pin(fresh(store))),
            call: Box::new(move |s| Box::pin(call(s))),
            snapshot: Box::new(move |s| Box::pin(snapshot(s))),
            store: Box::new(|clock| {
                Box::pin(async move { StoreRef::new(MemoryStore::builder().clock(clock).build()) })
            }),
            faults: Faults::ALL,
            step: None,
            retries: 5,
            real_lease: None,
            history: None,
            accept: None,
            recovery: None,
            finished_by_worker: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// For a `recover` function: the registry a recovery worker runs it
    /// with, on the schedule's state. Each cut off is then tried once more
    /// with the worker finishing the call instead of its caller (the caller
    /// comes back afterwards and must get the clean outcome).
    ///
    /// ```no_run
    /// # use idem_runtime::recovery::Recovery;
    /// # fn go<S: Clone + Send + Sync + 'static>(explorer: idem_runtime::testing::Explorer<S, (), (), ()>, register: fn(S) -> Recovery) -> idem_runtime::testing::Explorer<S, (), (), ()> {
    /// // e.g. |desk: Desk| Recovery::new().register(recoverable!(Desk::book, desk))
    /// explorer.recover_with(register)
    /// # }
    /// ```
    pub fn recover_with<F>(mut self, registry: F) -> Self
    where
        F: Fn(S) -> crate::recovery::Recovery + Send + Sync + 'static,
    {
        self.recovery = Some(Box::new(registry));
        self
    }

    /// Checks the clean run's steps, in order, against the history in
    /// `path` (a file you commit, e.g. `tests/steps/orders.create.txt`),
    /// before any schedule: a rename, a reorder or a removal fails, naming
    /// the step, until accepted with [`ACCEPT_ENV`]`=1` (or
    /// [`Explorer::accept_step_history`]), which rewrites the file. A
    /// missing file is written, except under `CI`, where it fails.
    ///
    /// ```no_run
    /// # fn go(explorer: idem_runtime::testing::Explorer<(), (), (), ()>) -> idem_runtime::testing::Explorer<(), (), (), ()> {
    /// explorer.step_history(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/steps/orders.create.txt"))
    /// # }
    /// ```
    pub fn step_history(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.history = Some(path.into());
        self
    }

    /// Whether a changed step history is accepted (default: whether
    /// [`ACCEPT_ENV`] is set to anything but `0`).
    pub fn accept_step_history(mut self, accept: bool) -> Self {
        self.accept = Some(accept);
        self
    }

    /// The store under the explorer's, made once per schedule on the clock
    /// the explorer moves (a SQLite or PostgreSQL store built with that
    /// clock, on fresh tables). Default: a [`MemoryStore`].
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")] {
    /// # use idem_runtime::testing::Explorer;
    /// # use idem_runtime::store::AsStore;
    /// use idem_runtime::store::sql::SqliteStore;
    /// # fn go(explorer: Explorer<(), (), (), ()>) -> Explorer<(), (), (), ()> {
    /// explorer.store(|clock| async move {
    ///     let store = SqliteStore::builder().clock(clock).in_memory().await;
    ///     store.expect("an in-memory SQLite store").store_ref()
    /// })
    /// # }
    /// # }
    /// ```
    pub fn store<F, Fut>(mut self, make: F) -> Self
    where
        F: Fn(ManualClock) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = StoreRef> + Send + 'static,
    {
        self.store = Box::new(move |clock| Box::pin(make(clock)));
        self
    }

    /// For a store that keeps time itself (PostgreSQL, MySQL and Redis use
    /// the server's clock, so moving the explorer's clock ends no lease):
    /// wait this long in real time wherever a lease must run out. Give the
    /// call under test a lease shorter than this (`lease = "200ms"`).
    pub fn real_time_leases(mut self, wait: Duration) -> Self {
        self.real_lease = Some(wait);
        self
    }

    /// Only these faults.
    pub fn only(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// Only the fault points at the store operations of the step `name`.
    pub fn step(mut self, name: &str) -> Self {
        self.step = Some(name.to_owned());
        self
    }

    /// How many times the call is retried after a fault before the schedule
    /// fails for never succeeding (default 5).
    pub fn retries(mut self, n: u32) -> Self {
        self.retries = n;
        self
    }

    /// Runs the clean call, then every schedule, and reports.
    pub async fn run(self) -> Report {
        // The trace names keys by their call or step only while this runs.
        let _names = crate::protocol::labels::listen();
        self.explore().await
    }
}

/// The clock every schedule starts from: any fixed instant does.
const START_MILLIS: i64 = 1_800_000_000_000;
