//! The runner's outcome-to-action mapping on the in-memory delivery.

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::testing::Memory;
use super::{Acked, Action, Runner};
use crate::Key;
use crate::protocol::{Kind, Spec, execute_keeping_final};
use crate::store::StoreRef;
use crate::store::memory::MemoryStore;

const SPEC: Spec = Spec::new("consumer.tests", Kind::Consumer);

#[derive(Debug, Serialize, Deserialize)]
enum Failure {
    Declined,
    Downstream,
    // Read through `Debug`, in failure messages.
    #[allow(dead_code)]
    #[serde(skip)]
    Idem(String),
}

impl From<crate::Error> for Failure {
    fn from(e: crate::Error) -> Self {
        Failure::Idem(e.to_string())
    }
}

fn runner() -> Runner {
    Runner::new()
        .max_deliveries(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(400))
}

/// The annotated call: `Declined` is its final error, stored and replayed.
async fn settle(store: &StoreRef, id: &str, declined: bool) -> Result<u32, Failure> {
    let key = Key::builder(SPEC.scope).part(id).finish();
    execute_keeping_final(
        &SPEC,
        Some(store.clone()),
        key,
        None,
        |e: &Failure| matches!(e, Failure::Declined),
        async move {
            if declined {
                Err(Failure::Declined)
            } else {
                Ok(7)
            }
        },
    )
    .await
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// A message that crashed every earlier consumer comes back with its
/// count past the limit: it is parked before it can crash this one too.
#[test]
fn a_delivery_past_max_deliveries_is_parked_without_running_the_handler() {
    block_on(async {
        let calls = AtomicU32::new(0);
        let handler = |_: String| {
            calls.fetch_add(1, SeqCst);
            async { Ok::<(), Failure>(()) }
        };
        let d = Memory::new(br#""m-1""#).attempt(4);
        let log = d.log();
        let action = runner().process(d, &handler).await.unwrap();
        assert_eq!(calls.load(SeqCst), 0, "the handler must not run");
        let Action::Parked { reason } = action else {
            panic!("{action:?}")
        };
        assert!(
            reason.contains("delivered 4 times") && reason.contains("not run"),
            "{reason}"
        );
        assert_eq!(log.lock().unwrap().len(), 1, "{:?}", log.lock().unwrap());
    });
}

/// A panic is a counted failure: retried with backoff, parked at the
/// limit, and the runner goes on.
#[test]
fn a_panicking_handler_is_retried_then_parked() {
    block_on(async {
        let handler = |_: String| async {
            if true {
                panic!("the handler broke");
            }
            Ok::<(), Failure>(())
        };
        let first = runner()
            .process(Memory::new(br#""m-1""#), &handler)
            .await
            .unwrap();
        assert_eq!(
            first,
            Action::Retried {
                after: Duration::from_millis(100),
                attempt: 1
            }
        );
        let last = runner()
            .process(Memory::new(br#""m-1""#).attempt(3), &handler)
            .await
            .unwrap();
        let Action::Parked { reason } = last else {
            panic!("{last:?}")
        };
        assert!(
            reason.starts_with("failed 3 counted deliveries")
                && reason.contains("the handler broke"),
            "{reason}"
        );
    });
}

/// The call recorded `Ok`, and the handler's own next effect failed: that
/// effect is not recorded anywhere, so the message must come back.
#[test]
fn an_err_after_a_call_that_succeeded_is_retried() {
    block_on(async {
        let store = StoreRef::new(MemoryStore::new());
        let next_effect_fails = AtomicU32::new(1);
        let handler = |id: String| {
            let store = store.clone();
            let fail = next_effect_fails.load(SeqCst) > 0;
            async move {
                settle(&store, &id, false).await?;
                if fail {
                    return Err(Failure::Downstream);
                }
                Ok(())
            }
        };
        let r = runner();
        let first = r.process(Memory::new(br#""m-1""#), &handler).await.unwrap();
        assert_eq!(
            first,
            Action::Retried {
                after: Duration::from_millis(100),
                attempt: 1
            }
        );
        // The redelivery replays the recorded `Ok` and fails the same way:
        // a replay acks only what the record holds.
        let second = r
            .process(Memory::new(br#""m-1""#).attempt(2), &handler)
            .await
            .unwrap();
        assert!(
            matches!(second, Action::Retried { attempt: 2, .. }),
            "{second:?}"
        );
        next_effect_fails.store(0, SeqCst);
        let third = r
            .process(Memory::new(br#""m-1""#).attempt(3), &handler)
            .await
            .unwrap();
        assert_eq!(third, Action::Acked(Acked::Deduplicated));
        assert_eq!(r.stats().final_errors, 0, "{:?}", r.stats());
    });
}

/// The counterpart: an `Err` the call stored as final is acked, first
/// time and on replay.
#[test]
fn a_stored_final_error_is_acked() {
    block_on(async {
        let store = StoreRef::new(MemoryStore::new());
        let handler = |id: String| {
            let store = store.clone();
            async move { settle(&store, &id, true).await.map(|_| ()) }
        };
        let r = runner();
        let first = r.process(Memory::new(br#""m-1""#), &handler).await.unwrap();
        assert_eq!(first, Action::Acked(Acked::FinalError));
        let again = r.process(Memory::new(br#""m-1""#), &handler).await.unwrap();
        assert_eq!(again, Action::Acked(Acked::Deduplicated));
    });
}

/// The same with a final error stored in its own form (`final_err`
/// returning `Option<S>`): an error type that is not serde, whose final
/// errors are stored as `Declined`, is acked, and its replay is the same
/// error.
#[test]
fn a_final_error_stored_in_its_form_is_acked() {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Declined {
        reason: String,
    }

    #[derive(Debug)]
    enum SettleError {
        Declined(Declined),
        // Read through `Debug`, in failure messages.
        #[allow(dead_code)]
        Idem(crate::Error),
    }

    impl From<crate::Error> for SettleError {
        fn from(e: crate::Error) -> Self {
            SettleError::Idem(e)
        }
    }

    impl From<Declined> for SettleError {
        fn from(d: Declined) -> Self {
            SettleError::Declined(d)
        }
    }

    fn declined(e: &SettleError) -> Option<Declined> {
        match e {
            SettleError::Declined(d) => Some(d.clone()),
            SettleError::Idem(_) => None,
        }
    }

    block_on(async {
        let store = StoreRef::new(MemoryStore::new());
        let runs = AtomicU32::new(0);
        let seen = std::sync::Mutex::new(Vec::new());
        let handler = |id: String| {
            let (store, runs, seen) = (store.clone(), &runs, &seen);
            async move {
                let key = Key::builder(SPEC.scope).part(&id).finish();
                let out: Result<u32, SettleError> =
                    execute_keeping_final(&SPEC, Some(store), key, None, declined, async {
                        runs.fetch_add(1, SeqCst);
                        Err(Declined {
                            reason: "card expired".into(),
                        }
                        .into())
                    })
                    .await;
                if let Err(SettleError::Declined(d)) = &out {
                    seen.lock().unwrap().push(d.clone());
                }
                out.map(drop)
            }
        };
        let r = runner();
        let first = r.process(Memory::new(br#""m-1""#), &handler).await.unwrap();
        assert_eq!(first, Action::Acked(Acked::FinalError));
        let again = r.process(Memory::new(br#""m-1""#), &handler).await.unwrap();
        assert_eq!(again, Action::Acked(Acked::Deduplicated));
        assert_eq!(runs.load(SeqCst), 1);
        let declined = Declined {
            reason: "card expired".into(),
        };
        assert_eq!(*seen.lock().unwrap(), [declined.clone(), declined]);
    });
}

/// A source fed through a channel; closing it is the broker failing.
struct Channel(tokio::sync::mpsc::UnboundedReceiver<Memory>);

#[async_trait::async_trait]
impl super::Source for Channel {
    type Delivery = Memory;

    async fn next(&mut self) -> Result<Memory, super::BrokerError> {
        self.0
            .recv()
            .await
            .ok_or_else(|| super::BrokerError::new("memory", "closed"))
    }
}

/// Ten deliveries `"m-0"` … `"m-9"` queued on `tx`, and their logs.
fn queue_ten(
    tx: &tokio::sync::mpsc::UnboundedSender<Memory>,
) -> Vec<std::sync::Arc<std::sync::Mutex<Vec<String>>>> {
    (0..10)
        .map(|i| {
            let d = Memory::new(format!("\"m-{i}\"").as_bytes());
            let log = d.log();
            tx.send(d).unwrap();
            log
        })
        .collect()
}

/// `run` keeps `concurrency` deliveries in flight, never more; when the
/// source fails, the ones in flight still finish and are acked before `run`
/// returns the error.
#[test]
fn run_keeps_concurrency_deliveries_in_flight_and_finishes_them_on_error() {
    block_on(async {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let logs = queue_ten(&tx);
        let running = AtomicU32::new(0);
        let most = AtomicU32::new(0);
        let release = tokio::sync::Semaphore::new(0);
        let handler = |_: String| async {
            let now = running.fetch_add(1, SeqCst) + 1;
            most.fetch_max(now, SeqCst);
            release.acquire().await.unwrap().forget();
            running.fetch_sub(1, SeqCst);
            Ok::<(), Failure>(())
        };
        let r = runner().concurrency(4);
        let control = async {
            while running.load(SeqCst) < 4 {
                tokio::task::yield_now().await;
            }
            // Every delivery in flight is waiting on `release` now, and no
            // fifth one started while they waited.
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
            assert_eq!(most.load(SeqCst), 4);
            release.add_permits(10);
            drop(tx);
        };
        let (err, ()) = futures_util::future::join(r.run(Channel(rx), &handler), control).await;
        assert_eq!(err.to_string(), "broker memory: closed");
        assert_eq!(most.load(SeqCst), 4);
        let stats = r.stats();
        assert_eq!((stats.delivered, stats.processed), (10, 10), "{stats:?}");
        for log in logs {
            assert_eq!(*log.lock().unwrap(), ["ack"]);
        }
    });
}

/// `run_spawned`: each delivery's handler runs on a task of its own (not
/// the task running the runner), still never more than `concurrency` at
/// once, every delivery acked.
#[test]
fn run_spawned_runs_each_delivery_on_a_task_of_its_own() {
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};
    block_on(async {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let logs = queue_ten(&tx);
        let running = Arc::new(AtomicU32::new(0));
        let most = Arc::new(AtomicU32::new(0));
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let tasks: Arc<Mutex<HashSet<tokio::task::Id>>> = Arc::default();
        let handler = {
            let (running, most, release, tasks) = (
                running.clone(),
                most.clone(),
                release.clone(),
                tasks.clone(),
            );
            move |_: String| {
                let (running, most, release, tasks) = (
                    running.clone(),
                    most.clone(),
                    release.clone(),
                    tasks.clone(),
                );
                async move {
                    tasks.lock().unwrap().insert(tokio::task::id());
                    let now = running.fetch_add(1, SeqCst) + 1;
                    most.fetch_max(now, SeqCst);
                    release.acquire().await.unwrap().forget();
                    running.fetch_sub(1, SeqCst);
                    Ok::<(), Failure>(())
                }
            }
        };
        let r = runner().concurrency(4);
        let runner_task = tokio::spawn({
            let r = r.clone();
            async move { r.run_spawned(Channel(rx), handler).await }
        });
        while running.load(SeqCst) < 4 {
            tokio::task::yield_now().await;
        }
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert_eq!(most.load(SeqCst), 4, "never more than concurrency");
        release.add_permits(10);
        drop(tx);
        let err = runner_task.await.unwrap();
        assert_eq!(err.to_string(), "broker memory: closed");
        let stats = r.stats();
        assert_eq!((stats.delivered, stats.processed), (10, 10), "{stats:?}");
        for log in logs {
            assert_eq!(*log.lock().unwrap(), ["ack"]);
        }
        assert_eq!(tasks.lock().unwrap().len(), 10, "a task per delivery");
    });
}

/// Dropping `run_spawned`'s future stops the deliveries it started, as
/// dropping `run`'s does: none goes on to its handler's end and its ack.
#[test]
fn dropping_run_spawned_stops_the_deliveries_it_started() {
    use std::sync::Arc;
    block_on(async {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let logs = queue_ten(&tx);
        let started = Arc::new(AtomicU32::new(0));
        let finished = Arc::new(AtomicU32::new(0));
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let handler = {
            let (started, finished, release) = (started.clone(), finished.clone(), release.clone());
            move |_: String| {
                let (started, finished, release) =
                    (started.clone(), finished.clone(), release.clone());
                async move {
                    started.fetch_add(1, SeqCst);
                    release.acquire().await.unwrap().forget();
                    finished.fetch_add(1, SeqCst);
                    Ok::<(), Failure>(())
                }
            }
        };
        let r = runner().concurrency(2);
        let runner_task = tokio::spawn(async move { r.run_spawned(Channel(rx), handler).await });
        while started.load(SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        runner_task.abort();
        assert!(runner_task.await.unwrap_err().is_cancelled());
        release.add_permits(10);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            finished.load(SeqCst),
            0,
            "a delivery went on after run_spawned was dropped"
        );
        for log in logs {
            assert!(log.lock().unwrap().is_empty(), "{:?}", log.lock().unwrap());
        }
        drop(tx);
    });
}

/// A delivery whose broker call panics (the handler's own panics are
/// caught and parked; this one is past them).
struct PanicsOnAck;

#[async_trait::async_trait]
impl super::Delivery for PanicsOnAck {
    fn payload(&self) -> Option<&[u8]> {
        Some(br#""m-1""#)
    }
    fn attempt(&self) -> u32 {
        1
    }
    async fn ack(self) -> Result<(), super::BrokerError> {
        panic!("the adapter broke on ack")
    }
    async fn retry(self, _: Duration) -> Result<(), super::BrokerError> {
        Ok(())
    }
    async fn defer(self, _: Duration) -> Result<Option<Self>, super::BrokerError> {
        Ok(None)
    }
    async fn park(self, _: &str) -> Result<(), super::BrokerError> {
        Ok(())
    }
}

struct OnePanicking(Option<PanicsOnAck>);

#[async_trait::async_trait]
impl super::Source for OnePanicking {
    type Delivery = PanicsOnAck;

    async fn next(&mut self) -> Result<PanicsOnAck, super::BrokerError> {
        match self.0.take() {
            Some(d) => Ok(d),
            None => std::future::pending().await,
        }
    }
}

/// A panic past the handler, on the delivery's own task under
/// `run_spawned`, unwinds through `run_spawned` as it would through `run`.
#[test]
fn a_panic_past_the_handler_unwinds_through_run_spawned() {
    let caught = std::panic::catch_unwind(|| {
        block_on(async {
            runner()
                .run_spawned(OnePanicking(Some(PanicsOnAck)), |_: String| async {
                    Ok::<(), Failure>(())
                })
                .await
        })
    });
    let panic = caught.expect_err("the panic reaches the caller");
    assert_eq!(
        panic.downcast_ref::<&str>(),
        Some(&"the adapter broke on ack")
    );
}

/// Two deliveries of one key in flight together: the second meets the
/// first's claim and is deferred, and the body runs once.
#[test]
fn two_deliveries_of_one_key_in_flight_run_the_body_once() {
    block_on(async {
        let store = StoreRef::new(MemoryStore::new());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (first, second) = (Memory::new(br#""m-1""#), Memory::new(br#""m-1""#));
        let (log1, log2) = (first.log(), second.log());
        tx.send(first).unwrap();
        tx.send(second).unwrap();
        let bodies = AtomicU32::new(0);
        let release = tokio::sync::Semaphore::new(0);
        let handler = |id: String| {
            let store = store.clone();
            let (bodies, release) = (&bodies, &release);
            async move {
                let key = Key::builder(SPEC.scope).part(&id).finish();
                execute_keeping_final(
                    &SPEC,
                    Some(store),
                    key,
                    None,
                    |_: &Failure| false,
                    async move {
                        bodies.fetch_add(1, SeqCst);
                        release.acquire().await.unwrap().forget();
                        Ok::<u32, Failure>(7)
                    },
                )
                .await
            }
        };
        let r = runner().concurrency(2);
        let control = async {
            while log2.lock().unwrap().is_empty() {
                tokio::task::yield_now().await;
            }
            release.add_permits(1);
            while log1.lock().unwrap().is_empty() {
                tokio::task::yield_now().await;
            }
            drop(tx);
        };
        let (_, ()) = futures_util::future::join(r.run(Channel(rx), &handler), control).await;
        assert_eq!(bodies.load(SeqCst), 1);
        assert_eq!(*log1.lock().unwrap(), ["ack"]);
        assert_eq!(*log2.lock().unwrap(), ["defer 2s"]);
        let stats = r.stats();
        assert_eq!((stats.processed, stats.deferred), (1, 1), "{stats:?}");
    });
}
