//! The supervisor of a service's background parts: consumers on in-process
//! deliveries (`consumer::testing::Memory`), the recovery worker on a memory
//! store, an outbox relay on a SQLite file. Conditions are waited for with
//! generous deadlines, never assumed after a sleep.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::consumer::{BrokerError, Runner, Source, testing::Memory};
use idem_runtime::outbox::{self, Message, Outgoing, Relay, sink::Sink};
use idem_runtime::recovery::{Recovery, Worker};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::sql::SqliteStore;
use idem_runtime::supervisor::{Health, PartFailed, PartState, PartStatus, Supervisor};
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};

const DEADLINE: Duration = Duration::from_secs(10);

/// What a broker hands out: deliveries, or its failure. Shared by every
/// source made from it, so a part started again reads on.
#[derive(Clone)]
struct Broker {
    tx: mpsc::UnboundedSender<Result<Memory, BrokerError>>,
    rx: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Result<Memory, BrokerError>>>>,
}

impl Broker {
    fn new() -> Broker {
        let (tx, rx) = mpsc::unbounded_channel();
        Broker {
            tx,
            rx: Arc::new(tokio::sync::Mutex::new(rx)),
        }
    }

    /// Delivers `n`; the returned log says what the runner did with it.
    fn deliver(&self, n: u32) -> Arc<Mutex<Vec<String>>> {
        let delivery = Memory::new(n.to_string().as_bytes());
        let log = delivery.log();
        self.tx.send(Ok(delivery)).unwrap();
        log
    }

    fn fail(&self, why: &'static str) {
        self.tx.send(Err(BrokerError::new("memory", why))).unwrap();
    }

    fn source(&self) -> Queue {
        Queue(self.rx.clone())
    }
}

struct Queue(Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Result<Memory, BrokerError>>>>);

#[async_trait::async_trait]
impl Source for Queue {
    type Delivery = Memory;

    async fn next(&mut self) -> Result<Memory, BrokerError> {
        match self.0.lock().await.recv().await {
            Some(next) => next,
            None => std::future::pending().await,
        }
    }
}

/// A handler that tells when it starts and ends only when released.
#[derive(Clone)]
struct Gate {
    started: Arc<Notify>,
    release: Arc<Semaphore>,
    ran: Arc<AtomicU32>,
}

impl Gate {
    fn new() -> Gate {
        Gate {
            started: Arc::new(Notify::new()),
            release: Arc::new(Semaphore::new(0)),
            ran: Arc::default(),
        }
    }

    fn handler(
        &self,
    ) -> impl Fn(u32) -> std::pin::Pin<Box<dyn Future<Output = Result<(), std::io::Error>> + Send>>
    + Send
    + Sync
    + 'static {
        let gate = self.clone();
        move |_n: u32| {
            let gate = gate.clone();
            Box::pin(async move {
                gate.started.notify_one();
                gate.release.acquire().await.unwrap().forget();
                gate.ran.fetch_add(1, SeqCst);
                Ok(())
            })
        }
    }
}

/// A consumer part on `broker`, counting how often it was started.
fn consumer(
    supervisor: Supervisor,
    name: &str,
    broker: &Broker,
    gate: &Gate,
    starts: Arc<AtomicU32>,
) -> Supervisor {
    let (broker, handler) = (broker.clone(), gate.handler());
    let runner = Runner::new().concurrency(4);
    let handler = Arc::new(handler);
    supervisor.consumer(name, move |stop| {
        starts.fetch_add(1, SeqCst);
        let (runner, source, handler) = (runner.clone(), broker.source(), handler.clone());
        async move {
            runner
                .run_spawned_until(source, move |n: u32| handler(n), stop)
                .await
        }
    })
}

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {DEADLINE:?}"))
}

async fn state_of(health: &mut Health, part: &str, state: PartState) -> PartStatus {
    let parts = within(&format!("{part} {state:?}"), async {
        health
            .wait_for(|parts| parts.iter().any(|p| p.name == part && p.state == state))
            .await
    })
    .await;
    parts.into_iter().find(|p| p.name == part).unwrap()
}

fn states(health: &Health) -> Vec<(String, PartState)> {
    health
        .parts()
        .into_iter()
        .map(|p| (p.name, p.state))
        .collect()
}

fn shutdown_signal() -> (oneshot::Sender<()>, impl Future<Output = ()> + Send) {
    let (tx, rx) = oneshot::channel::<()>();
    (tx, async move {
        let _ = rx.await;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_delivery_in_flight_and_takes_no_new_one() {
    let (broker, gate) = (Broker::new(), Gate::new());
    let supervisor = consumer(
        Supervisor::new(),
        "settlement",
        &broker,
        &gate,
        Arc::default(),
    );
    let mut health = supervisor.health();
    let (shutdown, signal) = shutdown_signal();
    let run = tokio::spawn(supervisor.run_until(signal));

    let started = gate.started.notified();
    let first = broker.deliver(1);
    within("the handler starts", started).await;
    shutdown.send(()).unwrap();
    state_of(&mut health, "settlement", PartState::Stopping).await;
    // Delivered after the shutdown: left to the broker, not taken.
    let late = broker.deliver(2);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !run.is_finished(),
        "returned with a delivery still in flight"
    );
    assert!(first.lock().unwrap().is_empty());

    gate.release.add_permits(1);
    within("run_until returns", run)
        .await
        .unwrap()
        .expect("a clean shutdown");
    assert_eq!(*first.lock().unwrap(), ["ack"], "finished before returning");
    assert!(
        late.lock().unwrap().is_empty(),
        "a delivery taken after the stop"
    );
    assert_eq!(gate.ran.load(SeqCst), 1);
    assert_eq!(
        states(&health),
        [("settlement".to_owned(), PartState::Stopped)]
    );
    assert!(!health.is_healthy());
}

/// A sink that holds each publish until released, so a shutdown comes while
/// the relay's round is in flight.
struct HeldSink {
    started: Arc<Notify>,
    release: Arc<Semaphore>,
    published: Arc<Mutex<Vec<String>>>,
}

#[async_trait::async_trait]
impl Sink for HeldSink {
    fn name(&self) -> &'static str {
        "held"
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        self.started.notify_one();
        self.release.acquire().await.unwrap().forget();
        let mut published = self.published.lock().unwrap();
        published.extend(batch.iter().map(|m| m.id.as_str().to_owned()));
        batch.iter().map(|_| Ok(())).collect()
    }
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reflects_each_part_and_the_relays_round_finishes_at_shutdown() {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = TempDir(
        std::env::temp_dir().join(format!("idem-supervisor-{}-{nanos}", std::process::id())),
    );
    std::fs::create_dir_all(&dir.0).unwrap();
    let db = SqliteStore::open(dir.0.join("outbox.db")).await.unwrap();
    let pool = db.pool().clone();
    let sink = HeldSink {
        started: Arc::new(Notify::new()),
        release: Arc::new(Semaphore::new(0)),
        published: Arc::default(),
    };
    let (started, release, published) = (
        sink.started.clone(),
        sink.release.clone(),
        sink.published.clone(),
    );
    let relay = Arc::new(
        Relay::builder(pool.clone(), sink)
            .poll_interval(Duration::from_millis(20))
            .build(),
    );
    let store = MemoryStore::new();
    let worker = Worker::builder(store, Recovery::new())
        .poll_interval(Duration::from_millis(20))
        .build();
    let (broker, gate) = (Broker::new(), Gate::new());
    let supervisor = Supervisor::new()
        .relay("outbox", relay.clone())
        .recovery("recovery", worker);
    let supervisor = consumer(supervisor, "settlement", &broker, &gate, Arc::default());
    let mut health = supervisor.health();
    let names = ["outbox", "recovery", "settlement"];
    assert_eq!(
        states(&health),
        names.map(|n| (n.to_owned(), PartState::Starting))
    );
    assert!(!health.is_healthy());

    let (shutdown, signal) = shutdown_signal();
    let run = tokio::spawn(supervisor.run_until(signal));
    within("every part runs", async {
        health
            .wait_for(|parts| parts.iter().all(|p| p.state == PartState::Running))
            .await
    })
    .await;
    assert!(health.is_healthy());
    for p in health.parts() {
        assert_eq!((p.restarts, p.last_error), (0, None), "{}", p.name);
    }

    let mut tx = pool.begin().await.unwrap();
    outbox::put(&mut tx, Message::bytes("orders", b"{}".to_vec()).id("m-1"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    within("the relay publishes", started.notified()).await;
    shutdown.send(()).unwrap();
    state_of(&mut health, "outbox", PartState::Stopping).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!run.is_finished(), "returned with a relay round in flight");

    release.add_permits(1);
    within("run_until returns", run).await.unwrap().unwrap();
    assert_eq!(*published.lock().unwrap(), ["m-1"]);
    let backlog = outbox::backlog(&pool, true).await.unwrap();
    assert_eq!(
        (backlog[0].pending, backlog[0].sent),
        (0, 1),
        "the round marked what the broker confirmed"
    );
    assert_eq!(relay.stats().published, 1);
    assert_eq!(
        states(&health),
        names.map(|n| (n.to_owned(), PartState::Stopped))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_part_is_reported_and_started_again_while_the_others_run() {
    let (broker, gate) = (Broker::new(), Gate::new());
    let starts = Arc::new(AtomicU32::new(0));
    let worker = Worker::builder(MemoryStore::new(), Recovery::new()).build();
    let supervisor = Supervisor::new()
        .restart_backoff(Duration::from_millis(50), Duration::from_secs(5))
        .recovery("recovery", worker);
    let supervisor = consumer(supervisor, "settlement", &broker, &gate, starts.clone());
    let mut health = supervisor.health();
    let (shutdown, signal) = shutdown_signal();
    let run = tokio::spawn(supervisor.run_until(signal));
    state_of(&mut health, "settlement", PartState::Running).await;

    broker.fail("connection reset");
    let failed = state_of(&mut health, "settlement", PartState::Restarting).await;
    assert_eq!(
        failed.last_error.as_deref(),
        Some("broker memory: connection reset")
    );
    assert!(!health.is_healthy(), "healthy with a part down");
    assert_eq!(
        health.part("recovery").unwrap().state,
        PartState::Running,
        "the other part goes on"
    );

    let again = state_of(&mut health, "settlement", PartState::Running).await;
    assert_eq!(again.restarts, 1);
    assert_eq!(
        again.last_error.as_deref(),
        Some("broker memory: connection reset"),
        "the last failure stays visible"
    );
    assert_eq!(starts.load(SeqCst), 2);
    assert!(health.is_healthy());
    // The part started again consumes.
    let log = broker.deliver(7);
    gate.release.add_permits(1);
    within("the restarted consumer acks", async {
        while log.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(*log.lock().unwrap(), ["ack"]);

    shutdown.send(()).unwrap();
    within("run_until returns", run).await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_part_is_reported_with_its_message() {
    let tries = Arc::new(AtomicU32::new(0));
    let counted = tries.clone();
    let supervisor = Supervisor::new()
        .restart_backoff(Duration::from_millis(20), Duration::from_millis(20))
        .consumer("ledger", move |stop| {
            let attempt = counted.fetch_add(1, SeqCst) + 1;
            async move {
                assert!(attempt > 1, "the ledger's first run broke");
                stop.await;
                Ok::<(), std::io::Error>(())
            }
        });
    let mut health = supervisor.health();
    let (shutdown, signal) = shutdown_signal();
    let run = tokio::spawn(supervisor.run_until(signal));
    let again = within("started again", async {
        health
            .wait_for(|p| p[0].state == PartState::Running && p[0].restarts == 1)
            .await
    })
    .await;
    let error = again[0].last_error.clone().unwrap();
    assert!(
        error.starts_with("panicked: ") && error.contains("the ledger's first run broke"),
        "{error}"
    );
    shutdown.send(()).unwrap();
    within("run_until returns", run).await.unwrap().unwrap();
    assert_eq!(health.part("ledger").unwrap().state, PartState::Stopped);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_all_on_failure_stops_the_others_and_returns_the_failure() {
    let (broker, gate) = (Broker::new(), Gate::new());
    let (other, other_gate) = (Broker::new(), Gate::new());
    let supervisor = Supervisor::new().stop_all_on_failure();
    let supervisor = consumer(supervisor, "settlement", &broker, &gate, Arc::default());
    let supervisor = consumer(supervisor, "refunds", &other, &other_gate, Arc::default());
    let mut health = supervisor.health();
    let run = tokio::spawn(supervisor.run_until(std::future::pending::<()>()));
    state_of(&mut health, "refunds", PartState::Running).await;
    // The other part has a delivery in flight when the first fails.
    let started = other_gate.started.notified();
    let in_flight = other.deliver(1);
    within("the refund starts", started).await;

    broker.fail("the broker is gone");
    state_of(&mut health, "refunds", PartState::Stopping).await;
    other_gate.release.add_permits(1);
    let failed = within("run_until returns", run).await.unwrap();
    let Err(PartFailed { part, error, .. }) = failed else {
        panic!("no failure returned: {failed:?}")
    };
    assert_eq!(
        (part.as_str(), error.as_str()),
        ("settlement", "broker memory: the broker is gone")
    );
    assert_eq!(*in_flight.lock().unwrap(), ["ack"]);
    assert_eq!(
        states(&health),
        [
            ("settlement".to_owned(), PartState::Failed),
            ("refunds".to_owned(), PartState::Stopped)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_that_does_not_stop_in_time_is_aborted_and_reported() {
    let dropped = Arc::new(AtomicBool::new(false));
    struct OnDrop(Arc<AtomicBool>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            self.0.store(true, SeqCst);
        }
    }
    let flag = dropped.clone();
    let supervisor = Supervisor::new()
        .shutdown_timeout(Duration::from_millis(100))
        .consumer("stuck", move |_stop| {
            let guard = OnDrop(flag.clone());
            async move {
                let _guard = guard;
                std::future::pending::<Result<(), std::io::Error>>().await
            }
        })
        .consumer("finishes", |_stop| async { Ok::<(), std::io::Error>(()) });
    let mut health = supervisor.health();
    let (shutdown, signal) = shutdown_signal();
    let run = tokio::spawn(supervisor.run_until(signal));
    state_of(&mut health, "finishes", PartState::Finished).await;
    state_of(&mut health, "stuck", PartState::Running).await;
    shutdown.send(()).unwrap();
    let failed = within("run_until returns", run).await.unwrap().unwrap_err();
    assert_eq!(failed.part, "stuck");
    assert!(
        failed.error.contains("did not stop within"),
        "{}",
        failed.error
    );
    assert_eq!(
        states(&health),
        [
            ("stuck".to_owned(), PartState::Failed),
            ("finishes".to_owned(), PartState::Finished)
        ]
    );
    assert!(dropped.load(SeqCst), "the stuck part still runs");
}

/// Settles `n` in the runner's transaction, and ends when the gate opens.
async fn settle_held(
    tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
    n: u32,
    gate: Gate,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO settled (n) VALUES (?)")
        .bind(n)
        .execute(&mut **tx)
        .await?;
    gate.started.notify_one();
    gate.release.acquire().await.unwrap().forget();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_in_tx_until_commits_the_delivery_in_flight_before_returning() {
    let db = SqliteStore::builder().in_memory().await.unwrap();
    let pool = db.pool().clone();
    sqlx::query("CREATE TABLE settled (n INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let (broker, gate) = (Broker::new(), Gate::new());
    let (shutdown, signal) = shutdown_signal();
    let run = {
        let (pool, gate, source) = (pool.clone(), gate.clone(), broker.source());
        tokio::spawn(async move {
            Runner::new()
                .run_in_tx_until(
                    source,
                    &pool,
                    move |tx, n: u32| Box::pin(settle_held(tx, n, gate.clone())),
                    signal,
                )
                .await
        })
    };
    let started = gate.started.notified();
    let log = broker.deliver(5);
    within("the handler starts", started).await;
    shutdown.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!run.is_finished(), "returned with a transaction in flight");
    gate.release.add_permits(1);
    within("run_in_tx_until returns", run)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(*log.lock().unwrap(), ["ack"]);
    let settled: Vec<i64> = sqlx::query_scalar("SELECT n FROM settled")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(settled, [5], "committed before returning");
}
