//! `#[idempotent]` on axum handlers over real loopback HTTP; the retry hint
//! and the replay signal of the protocol.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idem_runtime::protocol::{Kind, Spec, execute, track_replays};
use idem_runtime::store::StoreRef;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{Error, Key};

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
            // Learnt from the first call (about 300 ms), on whichever worker
            // thread it finished: not the 1 s guess for a scope never seen.
            assert!(retry_after < Duration::from_millis(600), "{retry_after:?}");
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
    execute::<u32, _, Error, _>(&INNER, Some(store.clone()), inner_key, None, async {
        Ok(5)
    })
    .await
    .unwrap();
    let call = || {
        let (store, runs) = (store.clone(), runs.clone());
        execute::<u32, _, Error, _>(&SPEC, Some(store.clone()), key, None, async move {
            runs.fetch_add(1, SeqCst);
            execute::<u32, _, Error, _>(&INNER, Some(store), inner_key, None, async { Ok(6) }).await
        })
    };
    let (first, replayed) = track_replays(call()).await;
    assert_eq!((first.unwrap(), replayed), (5, false));
    let (again, replayed) = track_replays(call()).await;
    assert_eq!((again.unwrap(), replayed), (5, true));
    assert_eq!(runs.load(SeqCst), 1);
}

mod axum_handlers {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use axum::Extension;
    use axum::extract::{Path, State};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::{Json, Router};
    use idem_runtime::http::{IdempotencyKey, KeyCaller, ReplayedHeaderLayer};
    use idem_runtime::idempotent;
    use idem_runtime::store::memory::MemoryStore;
    use reqwest::StatusCode;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Transfer {
        account: u64,
        cents: u64,
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Receipt {
        run: usize,
        cents: u64,
    }

    struct Bank {
        store: MemoryStore,
        runs: AtomicUsize,
    }

    enum AppError {
        Idem(idem_runtime::Error),
    }

    impl From<idem_runtime::Error> for AppError {
        fn from(e: idem_runtime::Error) -> Self {
            AppError::Idem(e)
        }
    }

    impl IntoResponse for AppError {
        fn into_response(self) -> Response {
            match self {
                AppError::Idem(e) => e.into_response(),
            }
        }
    }

    /// `Result<Json<T>, AppError>`, `State`, `Path`, the shipped key
    /// extractor and a `Json(req)` pattern: nothing added for idem's sake.
    #[idempotent(
        key = "account|key",
        fingerprint = "req.cents",
        store = bank.store
    )]
    async fn transfer(
        State(bank): State<Arc<Bank>>,
        Path(account): Path<u64>,
        key: IdempotencyKey,
        Json(req): Json<Transfer>,
    ) -> Result<Json<Receipt>, AppError> {
        let run = bank.runs.fetch_add(1, SeqCst) + 1;
        assert_eq!(req.account, account);
        Ok(Json(Receipt {
            run,
            cents: req.cents,
        }))
    }

    #[tokio::test]
    async fn an_annotated_axum_handler_replays_with_the_header_and_the_extractor_rejects_bad_keys()
    {
        let bank = Arc::new(Bank {
            store: MemoryStore::new(),
            runs: AtomicUsize::new(0),
        });
        let app = Router::new()
            .route("/accounts/{account}/transfers", post(transfer))
            .layer(ReplayedHeaderLayer)
            // One caller for the whole test: the account in the path scopes the key.
            .layer(Extension(KeyCaller::new(|_| Some(String::new()))))
            .with_state(bank.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/accounts/7/transfers",
            listener.local_addr().unwrap()
        );
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let c = reqwest::Client::new();
        let send = |key: Option<&str>, cents: u64| {
            let mut rb = c
                .post(&url)
                .json(&serde_json::json!({"account": 7, "cents": cents}));
            if let Some(k) = key {
                rb = rb.header("idempotency-key", k);
            }
            rb.send()
        };

        let first = send(Some("t-1"), 500).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        assert!(first.headers().get("idempotent-replayed").is_none());
        let first = first.bytes().await.unwrap();
        let again = send(Some("t-1"), 500).await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.bytes().await.unwrap(), first);
        assert_eq!(bank.runs.load(SeqCst), 1);

        let reused = send(Some("t-1"), 900).await.unwrap();
        assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(reused.headers()["content-type"], "application/problem+json");
        // Only the fingerprint's fields are compared on this path, not the
        // method, path or body as under the layer: the detail says so.
        let detail = reused.text().await.unwrap();
        assert!(detail.contains("different payload"), "{detail}");
        assert!(!detail.contains("method, path or body"), "{detail}");

        for bad in [None, Some("no spaces")] {
            let r = send(bad, 500).await.unwrap();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{bad:?}");
            assert_eq!(r.headers()["content-type"], "application/problem+json");
        }
        assert_eq!(bank.runs.load(SeqCst), 1);
    }

    /// The header key alone: the extractor's caller is what scopes it.
    #[idempotent(key = "key", store = bank.store)]
    async fn tip(
        State(bank): State<Arc<Bank>>,
        key: IdempotencyKey,
    ) -> Result<Json<Receipt>, AppError> {
        let run = bank.runs.fetch_add(1, SeqCst) + 1;
        Ok(Json(Receipt { run, cents: 1 }))
    }

    fn bank() -> Arc<Bank> {
        Arc::new(Bank {
            store: MemoryStore::new(),
            runs: AtomicUsize::new(0),
        })
    }

    async fn serve_app(app: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        format!("http://{addr}")
    }

    /// The caller is the `X-Tenant` header.
    fn by_tenant() -> Extension<KeyCaller> {
        Extension(KeyCaller::new(|p| {
            p.headers.get("x-tenant")?.to_str().ok().map(str::to_owned)
        }))
    }

    /// `/tips` with the caller read from `X-Tenant`.
    fn tips_by_tenant(bank: Arc<Bank>) -> Router {
        Router::new()
            .route("/tips", post(tip))
            .layer(ReplayedHeaderLayer)
            .layer(by_tenant())
            .with_state(bank)
    }

    async fn tip_as(c: &reqwest::Client, base: &str, tenant: &str, key: &str) -> reqwest::Response {
        c.post(format!("{base}/tips"))
            .header("x-tenant", tenant)
            .header("idempotency-key", key)
            .send()
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_header_key_never_crosses_tenants_on_the_attribute_path() {
        let bank = bank();
        let base = serve_app(tips_by_tenant(bank.clone())).await;
        let c = reqwest::Client::new();
        let a = tip_as(&c, &base, "tenant-a", "shared-1").await;
        assert_eq!(a.status(), StatusCode::OK);
        let a: Receipt = a.json().await.unwrap();
        let b = tip_as(&c, &base, "tenant-b", "shared-1").await;
        assert_eq!(b.status(), StatusCode::OK);
        assert!(
            b.headers().get("idempotent-replayed").is_none(),
            "tenant B got tenant A's response"
        );
        let b: Receipt = b.json().await.unwrap();
        assert_ne!(a, b);
        let a_again = tip_as(&c, &base, "tenant-a", "shared-1").await;
        assert_eq!(a_again.headers()["idempotent-replayed"], "true");
        assert_eq!(a_again.json::<Receipt>().await.unwrap(), a);
        assert_eq!(bank.runs.load(SeqCst), 2);
    }

    #[tokio::test]
    async fn the_key_extractor_refuses_to_run_unscoped_or_with_two_keys() {
        let bank = bank();
        // No caller set on the router: the key could not be scoped.
        let unscoped = Router::new()
            .route("/tips", post(tip))
            .with_state(bank.clone());
        let base = serve_app(unscoped).await;
        let c = reqwest::Client::new();
        let r = tip_as(&c, &base, "tenant-a", "k-1").await;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        assert_eq!(bank.runs.load(SeqCst), 0);

        let base = serve_app(tips_by_tenant(bank.clone())).await;
        let r = c
            .post(format!("{base}/tips"))
            .header("x-tenant", "tenant-a")
            .header("idempotency-key", "k-1")
            .header("idempotency-key", "k-2")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        // A request the caller function cannot place is refused too.
        let r = c
            .post(format!("{base}/tips"))
            .header("idempotency-key", "k-1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(bank.runs.load(SeqCst), 0);
    }

    /// An application's own authentication: the tenant a bearer token was
    /// issued to, or 401.
    #[derive(Debug, Clone, PartialEq)]
    struct AuthUser {
        tenant: String,
    }

    impl<S: Send + Sync> axum::extract::FromRequestParts<S> for AuthUser {
        type Rejection = (StatusCode, &'static str);

        async fn from_request_parts(
            parts: &mut axum::http::request::Parts,
            _: &S,
        ) -> Result<Self, Self::Rejection> {
            let token = parts
                .headers
                .get("authorization")
                .and_then(|v| v.to_str().ok());
            let tenant = match token {
                Some("Bearer token-of-a") => "tenant-a",
                Some("Bearer token-of-b") => "tenant-b",
                _ => return Err((StatusCode::UNAUTHORIZED, "who are you?")),
            };
            Ok(AuthUser {
                tenant: tenant.to_owned(),
            })
        }
    }

    impl idem_runtime::http::Caller for AuthUser {
        fn caller_id(&self) -> String {
            self.tenant.clone()
        }
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct TenantReceipt {
        run: usize,
        tenant: String,
    }

    /// The body names a tenant too, as clients' bodies do: only the verified
    /// one scopes the key, and the handler reads it from the key.
    #[idempotent(key = "key", store = bank.store)]
    async fn verified_tip(
        State(bank): State<Arc<Bank>>,
        key: IdempotencyKey<AuthUser>,
        Json(_claimed): Json<serde_json::Value>,
    ) -> Result<Json<TenantReceipt>, AppError> {
        let run = bank.runs.fetch_add(1, SeqCst) + 1;
        Ok(Json(TenantReceipt {
            run,
            tenant: key.identity().tenant.clone(),
        }))
    }

    async fn verified_tip_as(
        c: &reqwest::Client,
        base: &str,
        token: Option<&str>,
        key: &str,
    ) -> reqwest::Response {
        let mut rb = c
            .post(format!("{base}/verified-tips"))
            // What a client may claim, in a header and in the body alike.
            .header("x-tenant", "tenant-a")
            .json(&serde_json::json!({"tenant": "tenant-a"}))
            .header("idempotency-key", key);
        if let Some(token) = token {
            rb = rb.header("authorization", format!("Bearer {token}"));
        }
        rb.send().await.unwrap()
    }

    fn verified_tips(bank: Arc<Bank>) -> Router {
        Router::new()
            .route("/verified-tips", post(verified_tip))
            .layer(ReplayedHeaderLayer)
            // A `KeyCaller` that trusts the client's header: the
            // authenticated key must not use it.
            .layer(by_tenant())
            .with_state(bank)
    }

    #[tokio::test]
    async fn a_key_scoped_by_a_verified_caller_never_returns_another_tenants_response() {
        let bank = bank();
        let base = serve_app(verified_tips(bank.clone())).await;
        let c = reqwest::Client::new();
        let a = verified_tip_as(&c, &base, Some("token-of-a"), "shared-1").await;
        assert_eq!(a.status(), StatusCode::OK);
        let a: TenantReceipt = a.json().await.unwrap();
        assert_eq!(a.tenant, "tenant-a");

        // Tenant B sends A's key value, and claims to be A in the header and
        // the body: it gets a run of its own, as itself.
        let b = verified_tip_as(&c, &base, Some("token-of-b"), "shared-1").await;
        assert_eq!(b.status(), StatusCode::OK);
        assert!(
            b.headers().get("idempotent-replayed").is_none(),
            "tenant B got tenant A's response"
        );
        let b: TenantReceipt = b.json().await.unwrap();
        assert_eq!((b.run, b.tenant.as_str()), (2, "tenant-b"));

        let a_again = verified_tip_as(&c, &base, Some("token-of-a"), "shared-1").await;
        assert_eq!(a_again.headers()["idempotent-replayed"], "true");
        assert_eq!(a_again.json::<TenantReceipt>().await.unwrap(), a);
        let b_again = verified_tip_as(&c, &base, Some("token-of-b"), "shared-1").await;
        assert_eq!(b_again.headers()["idempotent-replayed"], "true");
        assert_eq!(b_again.json::<TenantReceipt>().await.unwrap(), b);
        assert_eq!(bank.runs.load(SeqCst), 2);
    }

    #[tokio::test]
    async fn a_rejecting_authenticator_answers_before_the_key_is_read_or_claimed() {
        let bank = bank();
        let base = serve_app(verified_tips(bank.clone())).await;
        let c = reqwest::Client::new();
        // No token, a forged one, and no token with a malformed key: the
        // authenticator's own 401 each time, never the key's 400.
        for (token, key) in [
            (None, "k-1"),
            (Some("token-of-nobody"), "k-1"),
            (None, "not a key"),
        ] {
            let r = verified_tip_as(&c, &base, token, key).await;
            assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "{token:?} {key:?}");
            assert_eq!(r.text().await.unwrap(), "who are you?");
        }
        assert_eq!(bank.runs.load(SeqCst), 0);
        // The key was left free (a claim would answer 409 or replay): the
        // first authenticated request runs.
        let r = verified_tip_as(&c, &base, Some("token-of-a"), "k-1").await;
        assert_eq!(r.status(), StatusCode::OK);
        assert!(r.headers().get("idempotent-replayed").is_none());
        // An authenticated request with a malformed key is the key's 400.
        let r = verified_tip_as(&c, &base, Some("token-of-a"), "not a key").await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        assert_eq!(bank.runs.load(SeqCst), 1);
    }

    /// A service moving from a `KeyCaller` to an authenticating extractor
    /// with the same ids keeps its records: both keys are the same key.
    #[test]
    fn a_verified_callers_key_is_the_key_a_key_caller_of_that_id_makes() {
        fn scoped<C>(key: &IdempotencyKey<C>) -> idem_runtime::Key {
            idem_runtime::Key::builder("tips").part(key).finish()
        }
        let verified = IdempotencyKey::of(
            AuthUser {
                tenant: "tenant-a".into(),
            },
            "k-1",
        );
        assert_eq!(
            scoped(&verified),
            scoped(&IdempotencyKey::new("tenant-a", "k-1"))
        );
        assert_ne!(
            scoped(&verified),
            scoped(&IdempotencyKey::new("tenant-b", "k-1"))
        );
    }

    /// `(StatusCode, HeaderMap, Json<T>)`: the handler sets `Location` and a
    /// custom header (and a cookie, which must not be replayed).
    #[idempotent(key = "key", store = bank.store)]
    async fn open_account(
        State(bank): State<Arc<Bank>>,
        key: IdempotencyKey,
    ) -> Result<(axum::http::StatusCode, axum::http::HeaderMap, Json<Receipt>), AppError> {
        let run = bank.runs.fetch_add(1, SeqCst) + 1;
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("location", format!("/accounts/{run}").parse().unwrap());
        headers.append("x-audit", "first".parse().unwrap());
        headers.append("x-audit", "second".parse().unwrap());
        headers.insert("set-cookie", "session=abc".parse().unwrap());
        Ok((
            axum::http::StatusCode::CREATED,
            headers,
            Json(Receipt { run, cents: 0 }),
        ))
    }

    /// `(HeaderMap, Json<T>)`: 200 with the handler's header.
    #[idempotent(key = "key", store = bank.store)]
    async fn touch(
        State(bank): State<Arc<Bank>>,
        key: IdempotencyKey,
    ) -> Result<(axum::http::HeaderMap, Json<Receipt>), AppError> {
        let run = bank.runs.fetch_add(1, SeqCst) + 1;
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("etag", format!("\"v{run}\"").parse().unwrap());
        Ok((headers, Json(Receipt { run, cents: 0 })))
    }

    #[tokio::test]
    async fn a_handler_returning_headers_has_them_replayed_except_set_cookie() {
        let bank = bank();
        let app = Router::new()
            .route("/accounts", post(open_account))
            .route("/touch", post(touch))
            .layer(ReplayedHeaderLayer)
            .layer(by_tenant())
            .with_state(bank.clone());
        let base = serve_app(app).await;
        let c = reqwest::Client::new();
        let send = |path: &'static str| {
            c.post(format!("{base}{path}"))
                .header("x-tenant", "t")
                .header("idempotency-key", "h-1")
                .send()
        };
        let first = send("/accounts").await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        assert_eq!(first.headers()["location"], "/accounts/1");
        assert!(first.headers().get("set-cookie").is_some());
        let again = send("/accounts").await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.status(), StatusCode::CREATED);
        assert_eq!(again.headers()["location"], "/accounts/1");
        let audit: Vec<_> = again.headers().get_all("x-audit").iter().collect();
        assert_eq!(audit, ["first", "second"]);
        // A session minted for the first exchange is not handed to a retry.
        assert!(again.headers().get("set-cookie").is_none());
        assert_eq!(again.json::<Receipt>().await.unwrap().run, 1);
        assert_eq!(bank.runs.load(SeqCst), 1);

        let first = send("/touch").await.unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(first.headers()["etag"], "\"v2\"");
        let again = send("/touch").await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.status(), StatusCode::OK);
        assert_eq!(again.headers()["etag"], "\"v2\"");
        assert_eq!(bank.runs.load(SeqCst), 2);
    }
}

static HINTED: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);

#[idem_runtime::idempotent(key = "id", scope = "http_attribute.hint.attr", store = &*HINTED)]
async fn takes_300ms(id: u64) -> Result<u64, Error> {
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(id)
}

/// An annotated function keeps the way to its scope's average in its call
/// site: its duplicates are hinted from what its calls took, and so is a
/// hand-built `Spec` of the same scope (the average is the scope's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_annotated_call_learns_how_long_its_scope_takes() {
    use std::hash::{BuildHasher, RandomState};
    let base = RandomState::new().hash_one(std::time::SystemTime::now()) >> 8;
    takes_300ms(base).await.unwrap();

    let first = tokio::spawn(takes_300ms(base + 1));
    // The first call claims at once and then sleeps: give it the claim.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let hinted = |out: Result<u64, Error>| match out {
        Err(Error::InProgress { retry_after, .. }) => retry_after,
        other => panic!("expected InProgress, got {other:?}"),
    };
    let attr = hinted(takes_300ms(base + 1).await);
    // Not the 1 s guess for a scope never seen: about 300 ms, less what the
    // first call has run.
    assert!(attr < Duration::from_millis(600), "{attr:?}");

    const BY_HAND: Spec = Spec::new("http_attribute.hint.attr", Kind::Call);
    let key = Key::builder(BY_HAND.scope).part(&(base + 1)).finish();
    let by_hand = hinted(
        execute(
            &BY_HAND,
            Some(StoreRef::new(HINTED.clone())),
            key,
            None,
            async { Ok(0) },
        )
        .await,
    );
    assert!(by_hand < Duration::from_millis(600), "{by_hand:?}");
    assert_eq!(first.await.unwrap().unwrap(), base + 1);
}
