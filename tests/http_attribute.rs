//! `#[idempotent]` on axum handlers over real loopback HTTP; the retry hint
//! and the replay signal of the protocol.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idem_runtime::protocol::{Kind, Spec, execute, track_replays};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{Error, Key, StoreRef};

fn unique(scope: &str) -> Key {
    use std::hash::{BuildHasher, RandomState};
    let n = RandomState::new().hash_one(std::time::SystemTime::now());
    Key::builder(scope).part(&n).finish()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_hints_when_the_result_is_likely_ready_not_the_lease() {
    // A 30 s lease, calls that take about 300 ms: the remaining lease (~30 s)
    // would send a duplicate away a hundred times too long.
    const SPEC: Spec = Spec::new("http_attribute.hint", Kind::Call).lease(Duration::from_secs(30));
    let store = StoreRef::new(MemoryStore::new());
    let quick = || async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok::<u32, Error>(1)
    };
    execute(
        &SPEC,
        Some(store.clone()),
        unique(SPEC.scope),
        None,
        quick(),
    )
    .await
    .unwrap();

    let key = unique(SPEC.scope);
    let started = Arc::new(tokio::sync::Notify::new());
    let first = tokio::spawn({
        let (store, started) = (store.clone(), started.clone());
        async move {
            execute(&SPEC, Some(store), key, None, async {
                started.notify_one();
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<u32, Error>(2)
            })
            .await
        }
    });
    started.notified().await;
    let dup: Result<u32, Error> =
        execute(&SPEC, Some(store.clone()), key, None, async { Ok(3) }).await;
    match dup {
        Err(Error::InProgress { retry_after, .. }) => {
            assert!(retry_after <= Duration::from_secs(1), "{retry_after:?}");
            assert!(retry_after > Duration::ZERO);
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    assert_eq!(first.await.unwrap().unwrap(), 2);
}

#[tokio::test]
async fn a_replay_is_told_apart_from_a_first_execution() {
    const SPEC: Spec = Spec::new("http_attribute.replays", Kind::Call);
    const INNER: Spec = Spec::new("http_attribute.replays.inner", Kind::Call);
    let store = StoreRef::new(MemoryStore::new());
    let (key, inner_key) = (unique(SPEC.scope), unique(INNER.scope));
    let runs = Arc::new(AtomicUsize::new(0));
    // The inner call is already done: inside the outer body it replays, which
    // does not make the outer call a replay.
    execute::<u32, Error, _>(&INNER, Some(store.clone()), inner_key, None, async {
        Ok(5)
    })
    .await
    .unwrap();
    let call = || {
        let (store, runs) = (store.clone(), runs.clone());
        execute::<u32, Error, _>(&SPEC, Some(store.clone()), key, None, async move {
            runs.fetch_add(1, SeqCst);
            execute::<u32, Error, _>(&INNER, Some(store), inner_key, None, async { Ok(6) }).await
        })
    };
    let (first, replayed) = track_replays(call()).await;
    assert_eq!((first.unwrap(), replayed), (5, false));
    let (again, replayed) = track_replays(call()).await;
    assert_eq!((again.unwrap(), replayed), (5, true));
    assert_eq!(runs.load(SeqCst), 1);
}
