//! The metrics an operator watches: executions, replays, in-progress
//! duplicates, takeovers and steps, labelled by scope. A replay count stuck at
//! zero is how keys that change on every retry show up.

use std::time::Duration;

use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{ManualClock, idempotent, step};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};

#[derive(Debug)]
struct AppError(#[allow(dead_code)] idem_runtime::Error);

impl From<idem_runtime::Error> for AppError {
    fn from(e: idem_runtime::Error) -> Self {
        AppError(e)
    }
}

struct Svc {
    store: MemoryStore,
}

impl Svc {
    #[idempotent(key = "order_id", scope = "observe.create", store = self.store.clone())]
    async fn create(&self, order_id: u64) -> Result<u64, AppError> {
        reserve(order_id).await
    }
}

#[step("reserve")]
async fn reserve(order_id: u64) -> Result<u64, AppError> {
    Ok(order_id * 2)
}

type SnapshotRow = (
    CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
);
type Snapshot = [SnapshotRow];

fn counter(snapshot: &Snapshot, name: &str, labels: &[(&str, &str)]) -> u64 {
    snapshot
        .iter()
        .filter(|(key, ..)| key.kind() == MetricKind::Counter && key.key().name() == name)
        .filter(|(key, ..)| {
            labels
                .iter()
                .all(|(k, v)| key.key().labels().any(|l| l.key() == *k && l.value() == *v))
        })
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

/// What `calls` recorded, run to its end on a runtime of its own under a
/// recorder of its own (no other test's calls in it).
fn recorded(calls: impl std::future::Future<Output = ()>) -> Vec<SnapshotRow> {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(calls)
    });
    snapshotter.snapshot().into_vec()
}

#[test]
fn calls_are_counted_by_outcome_scope_and_kind() {
    let clock = ManualClock::default();
    let svc = Svc {
        store: MemoryStore::builder().clock(clock.clone()).build(),
    };
    let snapshot = recorded(async {
        assert_eq!(svc.create(1).await.unwrap(), 2);
        assert_eq!(svc.create(1).await.unwrap(), 2);
        assert_eq!(svc.create(1).await.unwrap(), 2);
        assert_eq!(svc.create(2).await.unwrap(), 4);
        // A claim whose owner died: the next call takes it over after the lease.
        let key = idem_runtime::Key::builder("observe.create")
            .part(&3u64)
            .finish();
        let stale = idem_runtime::store::Token::random();
        let req = idem_runtime::store::ClaimRequest {
            key: &key,
            token: stale,
            fingerprint: None,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        };
        idem_runtime::store::Store::claim(&svc.store, req)
            .await
            .unwrap();
        assert!(matches!(
            svc.create(3).await,
            Err(AppError(idem_runtime::Error::InProgress { .. }))
        ));
        clock.advance(Duration::from_secs(31));
        assert_eq!(svc.create(3).await.unwrap(), 6);
    });
    let calls = |outcome| {
        counter(
            &snapshot,
            "idem_calls_total",
            &[
                ("scope", "observe.create"),
                ("kind", "call"),
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!(calls("executed"), 3, "orders 1, 2 and 3");
    assert_eq!(calls("replayed"), 2, "order 1 twice more");
    assert_eq!(calls("in_progress"), 1);
    assert_eq!(
        counter(
            &snapshot,
            "idem_takeovers_total",
            &[("scope", "observe.create")]
        ),
        1
    );
    let steps = |outcome| {
        counter(
            &snapshot,
            "idem_calls_total",
            &[("scope", "reserve"), ("kind", "step"), ("outcome", outcome)],
        )
    };
    assert_eq!(steps("executed"), 3, "one reserve per executed order");
    assert_eq!(
        steps("replayed"),
        0,
        "replayed calls never reach their steps"
    );
}

/// The HTTP layer finds its scope's call site once, when it is built: two
/// layers of one scope count together, and layers of other scopes (the
/// default one among them) count apart, whichever was built or called first.
#[test]
fn the_http_layer_counts_its_calls_under_its_own_scope() {
    use axum::Router;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::post;
    use idem_runtime::http::IdempotencyLayer;
    use tower::ServiceExt;

    let store = MemoryStore::new();
    let app = |layer: IdempotencyLayer| {
        Router::new()
            .route("/orders", post(|| async { (StatusCode::CREATED, "made") }))
            .layer(layer.store(store.clone()))
    };
    // All built before any request.
    let a1 = app(IdempotencyLayer::new().scope("observe.http.a"));
    let b = app(IdempotencyLayer::new().scope("observe.http.b"));
    let a2 = app(IdempotencyLayer::new().scope("observe.http.a"));
    let default = app(IdempotencyLayer::new());
    let send = |app: &Router, key: &str| {
        let req = Request::post("/orders")
            .header("idempotency-key", key)
            .body(Body::empty())
            .unwrap();
        let app = app.clone();
        async move { app.oneshot(req).await.unwrap().status() }
    };
    let snapshot = recorded(async {
        for (app, key) in [(&b, "k-1"), (&a1, "k-1"), (&a2, "k-1"), (&b, "k-2")] {
            assert_eq!(send(app, key).await, StatusCode::CREATED);
        }
        assert_eq!(send(&default, "k-1").await, StatusCode::CREATED);
    });
    let calls = |scope, outcome| {
        counter(
            &snapshot,
            "idem_calls_total",
            &[("scope", scope), ("kind", "call"), ("outcome", outcome)],
        )
    };
    assert_eq!(calls("observe.http.a", "executed"), 1);
    assert_eq!(
        calls("observe.http.a", "replayed"),
        1,
        "a2 replays a1's k-1"
    );
    assert_eq!(
        calls("observe.http.b", "executed"),
        2,
        "k-1 again, in another scope"
    );
    assert_eq!(calls("observe.http.b", "replayed"), 0);
    assert_eq!(calls("http", "executed"), 1, "the default scope's own k-1");
    assert_eq!(calls("http", "replayed"), 0);
}
