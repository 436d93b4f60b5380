//! The Redis store on a single node (`IDEM_REDIS_URL`, default 127.0.0.1:6379)
//! and on a Redis Cluster (`IDEM_REDIS_CLUSTER_URLS`, started by
//! `scripts/test`): the whole conformance suite on both, then what only a
//! server can show — scripts reloaded after `SCRIPT FLUSH`, a re-sent claim
//! recognised, and failing closed when Redis is unreachable, stops, or loses
//! the connection between claim and complete.
//!
//! Every store here gets a key prefix of its own, so runs and cases never see
//! each other's records (and a purge in one case cannot delete another's). The
//! shared servers are never stopped: the tests that stop Redis start their own
//! `redis-server` on a free loopback port.

use std::collections::BTreeMap;
use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idem_runtime::store::redis::RedisStore;
use idem_runtime::{
    Claim, ClaimRequest, Completion, Error, Key, Outcome, RecordState, Store, StoreRef, Token,
    idempotent,
};
use idem_tests::conformance::Subject;
use idem_tests::proxy::Proxy;
use idem_tests::services;
use redis::IntoConnectionInfo;

/// The conformance unit: leases of 3 units, ttls of 20. Redis keeps time to
/// the millisecond; 200 ms keeps the cases well clear of scheduling noise.
const UNIT: Duration = Duration::from_millis(200);

/// A key prefix no other store, case or run shares.
fn unique_prefix() -> String {
    let t = Token::random().0;
    let hex: String = t[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("idem-test:{hex}:")
}

/// host:port of a URL, for messages (never the URL: it may hold a password).
fn address(url: &str) -> String {
    url.into_connection_info()
        .map(|i| i.addr().to_string())
        .unwrap_or_else(|_| "an unparsable URL".into())
}

async fn single_store() -> Option<RedisStore> {
    let url = services::redis_url();
    let store = RedisStore::builder()
        .key_prefix(unique_prefix())
        .connect(&url)
        .await;
    services::reachable("Redis", &address(&url), store)
}

async fn cluster_store() -> Option<RedisStore> {
    let urls = services::redis_cluster_urls();
    let at = urls
        .iter()
        .map(|u| address(u))
        .collect::<Vec<_>>()
        .join(",");
    let store = RedisStore::builder()
        .key_prefix(unique_prefix())
        .connect_cluster(&urls)
        .await;
    services::reachable("Redis Cluster", &at, store)
}

async fn single() -> Option<Subject> {
    let store = single_store().await?;
    Some(Subject::real(StoreRef::new(store), UNIT).expiring_by_itself())
}

async fn cluster() -> Option<Subject> {
    let store = cluster_store().await?;
    Some(Subject::real(StoreRef::new(store), UNIT).expiring_by_itself())
}

idem_tests::conformance_suite!(redis_single, single());
idem_tests::conformance_suite!(redis_cluster, cluster());

fn request(key: &Key, token: Token) -> ClaimRequest<'_> {
    ClaimRequest {
        key,
        token,
        fingerprint: None,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(600),
    }
}

fn key(case: &str) -> Key {
    Key::builder("idem-tests::redis")
        .part(case)
        .part(&Token::random().0[..])
        .finish()
}

// ---------------------------------------------------------------------------
// Scripts: EVALSHA, reloaded on NOSCRIPT
// ---------------------------------------------------------------------------

/// The claim is a plain command; the completion is the script every first
/// call runs.
fn complete_script_sha() -> String {
    redis::Script::new(include_str!("../idem-runtime/src/store/redis/complete.lua"))
        .get_hash()
        .to_owned()
}

/// Whether the server (every master, on a cluster) has the completion script.
async fn script_loaded(conn: &mut impl redis::aio::ConnectionLike) -> bool {
    let exists: Vec<bool> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(complete_script_sha())
        .query_async(conn)
        .await
        .expect("SCRIPT EXISTS");
    exists == [true]
}

async fn script_flush(conn: &mut impl redis::aio::ConnectionLike) {
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(conn)
        .await
        .expect("SCRIPT FLUSH");
}

async fn completes_fresh_key(store: &RedisStore, case: &str) {
    let (key, token) = (key(case), Token::random());
    let claim = store.claim(request(&key, token)).await;
    assert!(
        matches!(claim, Ok(Claim::Acquired { fence: 1, .. })),
        "{case}: {claim:?}"
    );
    let done = store.complete(&key, token, completion(b"1")).await;
    assert!(matches!(done, Ok(true)), "{case}: {done:?}");
}

/// After `SCRIPT FLUSH` the server has forgotten every script: the next
/// completion gets NOSCRIPT, loads the script once and succeeds. On a server of the
/// test's own, so no other test reloads the script in between and the
/// server's counters show exactly that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_reloads_scripts_after_script_flush() {
    let Some(server) = OwnRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    completes_fresh_key(&store, "before-flush").await;
    assert!(script_loaded(&mut admin).await);

    script_flush(&mut admin).await;
    assert!(
        !script_loaded(&mut admin).await,
        "SCRIPT FLUSH left the script"
    );
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await
        .unwrap();
    completes_fresh_key(&store, "after-flush").await;
    assert!(
        script_loaded(&mut admin).await,
        "the completion reloaded the script"
    );

    let errors: String = redis::cmd("INFO")
        .arg("errorstats")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(errors.contains("errorstat_NOSCRIPT:count=1"), "{errors}");
    let calls = command_calls(&mut admin).await;
    assert!(calls.contains(&("script|load".to_owned(), 1)), "{calls:?}");

    completes_fresh_key(&store, "after-reload").await;
}

/// The same on the cluster: SCRIPT FLUSH and SCRIPT EXISTS go to every
/// master, and EXISTS is true only when all of them have the script. The
/// cluster is shared with the other tests of this binary, which may reload
/// the script at any moment, so only the outcome is checked here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_reloads_scripts_after_script_flush() {
    let Some(store) = cluster_store().await else {
        return;
    };
    let client = redis::cluster::ClusterClient::new(services::redis_cluster_urls()).unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    completes_fresh_key(&store, "before-flush").await;
    script_flush(&mut conn).await;
    // Keys spread over the masters: each one that answers NOSCRIPT reloads.
    for i in 0..8 {
        completes_fresh_key(&store, &format!("after-flush-{i}")).await;
    }
    assert!(
        script_loaded(&mut conn).await,
        "the completions reloaded the script"
    );
}

// ---------------------------------------------------------------------------
// A re-sent claim is the same claim
// ---------------------------------------------------------------------------

/// redis-rs's cluster client re-sends a request after an I/O error, so one
/// claim can reach the server twice, even at once. Both answers are the same
/// acquisition; another caller is still busy.
async fn resent_claim_is_recognised(store: RedisStore) {
    let key = key("resent");
    let token = Token::random();
    let (a, b) = tokio::join!(
        store.claim(request(&key, token)),
        store.claim(request(&key, token))
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(
        a,
        Claim::Acquired {
            fence: 1,
            takeover: false
        }
    );
    assert_eq!(a, b, "the re-sent claim got another answer");
    assert_eq!(
        store.claim(request(&key, token)).await.unwrap(),
        a,
        "re-sent later"
    );
    assert!(matches!(
        store.claim(request(&key, Token::random())).await.unwrap(),
        Claim::Busy { .. }
    ));
    let info = store.inspect(&key).await.unwrap().expect("record");
    assert_eq!((info.state, info.fence), (RecordState::Processing, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_recognises_a_resent_claim() {
    if let Some(store) = single_store().await {
        resent_claim_is_recognised(store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_recognises_a_resent_claim() {
    if let Some(store) = cluster_store().await {
        resent_claim_is_recognised(store).await;
    }
}

/// The record is one hash-tagged key: on the cluster its slot is the slot of
/// the tag, so every script touches one slot (no CROSSSLOT), and records
/// spread over the masters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_are_hash_tagged_and_spread() {
    let Some(store) = cluster_store().await else {
        return;
    };
    let client = redis::cluster::ClusterClient::new(services::redis_cluster_urls()).unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    let mut slots = std::collections::BTreeSet::new();
    for i in 0..32u32 {
        let k = Key::builder("idem-tests::spread").part(&i).finish();
        let name = store.redis_key(&k);
        let tag = format!("{{{}}}", k.to_hex());
        assert!(name.ends_with(&tag), "{name} does not end with {tag}");
        let (of_key, of_tag): (u16, u16) = (
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(&name)
                .query_async(&mut conn)
                .await
                .unwrap(),
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(k.to_hex())
                .query_async(&mut conn)
                .await
                .unwrap(),
        );
        assert_eq!(of_key, of_tag, "the prefix changed the slot of {name}");
        slots.insert(of_key / 5462); // 3 masters own about 5461 slots each
    }
    assert!(slots.len() > 1, "32 records all landed on one master");
}

// ---------------------------------------------------------------------------
// Fail closed
// ---------------------------------------------------------------------------

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
}

fn store_error<T: std::fmt::Debug>(r: Result<T, AppError>) -> idem_runtime::StoreError {
    match r {
        Err(AppError::Idem(Error::Store(e))) => e,
        other => panic!("expected Error::Store, got {other:?}"),
    }
}

/// A service whose calls are settled once per order; `cut` (if set) is run by
/// the body, after the claim and before the completion.
struct Ledger {
    store: RedisStore,
    runs: AtomicUsize,
    cut: Option<Proxy>,
}

impl Ledger {
    fn new(store: RedisStore) -> Self {
        Ledger {
            store,
            runs: AtomicUsize::new(0),
            cut: None,
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(SeqCst)
    }

    #[idempotent(
        key = "order_id",
        scope = "idem-tests::redis::settle",
        store = self.store,
        lease = "600ms",
        ttl = "10m"
    )]
    async fn settle(&self, order_id: u64) -> Result<u64, AppError> {
        self.runs.fetch_add(1, SeqCst);
        if let Some(proxy) = &self.cut {
            proxy.cut().await;
        }
        Ok(order_id * 2)
    }
}

fn assert_names_redis_at(e: &idem_runtime::StoreError, at: &str, secret: Option<&str>) {
    let shown = format!("{e} / {e:?}");
    assert!(e.backend().starts_with("redis"), "backend: {shown}");
    assert_eq!(e.location(), at, "location: {shown}");
    assert!(shown.contains("redis") && shown.contains(at), "{shown}");
    if let Some(secret) = secret {
        assert!(!shown.contains(secret), "the password leaked: {shown}");
    }
}

/// (a) A store pointed at a closed port: connecting fails naming redis and
/// the address, never the password; a lazily connected store fails every
/// call with `Error::Store` and the body never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_port_fails_closed_without_showing_the_password() {
    let url = "redis://:s3cret@127.0.0.1:1";
    let err = RedisStore::connect(url)
        .await
        .expect_err("port 1 is closed");
    assert_names_redis_at(&err, "127.0.0.1:1", Some("s3cret"));
    assert!(!format!("{err:?}").contains("s3cret"));

    let store = RedisStore::builder()
        .reconnect_retries(1)
        .connect_lazy(url)
        .expect("a well-formed URL");
    assert!(!format!("{store:?}").contains("s3cret"));
    let ledger = Ledger::new(store);
    for order in [1, 1, 2] {
        let e = store_error(ledger.settle(order).await);
        assert_names_redis_at(&e, "127.0.0.1:1", Some("s3cret"));
        let whole = AppError::Idem(Error::Store(e)).to_string();
        assert!(!whole.contains("s3cret"), "{whole}");
    }
    assert_eq!(ledger.runs(), 0, "a body ran without a claim");
}

/// A `redis-server` of this test's own on a free loopback port (never the
/// shared 6379, never scripts/test's cluster ports), killed when dropped.
struct OwnRedis {
    child: Child,
    port: u16,
}

impl OwnRedis {
    fn start() -> Option<OwnRedis> {
        let port = StdListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        OwnRedis::start_on(port)
    }

    fn start_on(port: u16) -> Option<OwnRedis> {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = services::reachable("redis-server (binary)", "PATH", child)?;
        let server = OwnRedis { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(server)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn at(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// (b) Redis stops mid-test: the next calls return `Error::Store` naming
/// redis and the address, and their bodies never run. When Redis is back, the
/// same store reconnects by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_test_fails_closed() {
    let Some(mut server) = OwnRedis::start() else {
        return;
    };
    let store = RedisStore::builder()
        .reconnect_retries(1)
        .connect(&server.url())
        .await
        .expect("own redis-server");
    let ledger = Ledger::new(store);
    assert_eq!(ledger.settle(7).await.unwrap(), 14);
    assert_eq!(ledger.settle(7).await.unwrap(), 14, "replayed");
    assert_eq!(ledger.runs(), 1);

    server.kill();
    for order in [8, 8, 9] {
        let started = Instant::now();
        let e = store_error(ledger.settle(order).await);
        assert_names_redis_at(&e, &server.at(), None);
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "failing took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(ledger.runs(), 1, "a body ran while Redis was down");

    // Back on the same port (empty: it kept nothing): calls work again.
    let port = server.port;
    drop(server);
    let Some(_server) = OwnRedis::start_on(port) else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match ledger.settle(8).await {
            Ok(v) => {
                assert_eq!(v, 16);
                break;
            }
            Err(e) if Instant::now() < deadline => {
                let _ = store_error::<u64>(Err(e));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the store did not reconnect: {e}"),
        }
    }
    assert_eq!(ledger.runs(), 2);
}

/// (c) The connection is lost between claim and complete: the body ran, the
/// caller gets its result, but the record stays PROCESSING. A duplicate is
/// told the call is in progress; once the lease has run out, a later caller
/// takes over (with a higher fence) and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_lost_between_claim_and_complete_is_taken_over_after_the_lease() {
    let url = services::redis_url();
    let prefix = unique_prefix();
    let direct = RedisStore::builder()
        .key_prefix(&prefix)
        .connect(&url)
        .await;
    let Some(direct) = services::reachable("Redis", &address(&url), direct) else {
        return;
    };
    let proxy = Proxy::start(address(&url)).await;
    let through_proxy = RedisStore::builder()
        // The same records as `direct`: same server, same prefix.
        .key_prefix(&prefix)
        .reconnect_retries(0)
        .connect(&format!("redis://127.0.0.1:{}", proxy.port()))
        .await
        .expect("through the proxy");
    let mut first = Ledger::new(through_proxy);
    first.cut = Some(proxy);
    let order = u64::from(Token::random().0[0]) + 1_000;
    assert_eq!(
        first.settle(order).await.unwrap(),
        order * 2,
        "the body's result"
    );
    assert_eq!(first.runs(), 1);

    let later = Ledger::new(direct.clone());
    let k = Key::builder("idem-tests::redis::settle")
        .part(&order)
        .finish();
    let info = direct
        .inspect(&k)
        .await
        .unwrap()
        .expect("the record is left");
    assert_eq!(info.state, RecordState::Processing, "{info:?}");
    assert_eq!(info.fence, 1);

    match later.settle(order).await {
        Err(AppError::Idem(Error::InProgress { retry_after, .. })) => {
            assert!(retry_after <= Duration::from_millis(600));
        }
        other => panic!("expected InProgress within the lease, got {other:?}"),
    }
    assert_eq!(later.runs(), 0);

    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(later.settle(order).await.unwrap(), order * 2);
    assert_eq!(
        later.runs(),
        1,
        "the later caller took over and ran the body"
    );
    let info = direct.inspect(&k).await.unwrap().expect("record");
    assert_eq!((info.state, info.fence), (RecordState::Done, 2));
    assert_eq!(later.settle(order).await.unwrap(), order * 2, "replayed");
    assert_eq!(later.runs(), 1);
}

/// Commands the server ran, by name, since the last `CONFIG RESETSTAT`.
async fn command_calls(conn: &mut redis::aio::MultiplexedConnection) -> Vec<(String, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        // The admin connection's own commands.
        .filter(|(name, _)| !name.starts_with("config") && name != "info")
        .collect()
}

/// Round trips, counted by the server: a first call is one `SET` to claim and
/// one `EVALSHA` to complete (commandstats also counts the `GET` and `SET`
/// that complete.lua runs inside the server); a duplicate is one `SET` that
/// finds the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_costs_a_set_and_an_evalsha_and_a_replay_one_set() {
    let Some(server) = OwnRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let ledger = Ledger::new(store);
    ledger.settle(1).await.unwrap(); // loads the scripts
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();

    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await
        .unwrap();
    ledger.settle(2).await.unwrap();
    let first = command_calls(&mut admin).await;
    let sorted: std::collections::BTreeMap<_, _> = first.into_iter().collect();
    let expected = [("evalsha", 1), ("get", 1), ("set", 2)]
        .map(|(n, c)| (n.to_owned(), c))
        .into();
    assert_eq!(sorted, expected);

    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await
        .unwrap();
    ledger.settle(2).await.unwrap();
    assert_eq!(command_calls(&mut admin).await, [("set".to_owned(), 1)]);
    assert_eq!(ledger.runs(), 2);
}

// ---------------------------------------------------------------------------
// Purging released records
// ---------------------------------------------------------------------------

/// Purging deletes released records under the store's own prefix, at most
/// `limit` per call, and nothing live nor another prefix's.
async fn purge_respects_limit_and_prefix(store: RedisStore, other: RedisStore) {
    let mut released = Vec::new();
    for i in 0..20 {
        let k = key(&format!("purge-{i}"));
        let t = Token::random();
        assert!(matches!(
            store.claim(request(&k, t)).await.unwrap(),
            Claim::Acquired { .. }
        ));
        assert!(store.release(&k, t).await.unwrap());
        released.push(k);
    }
    let live = key("purge-live");
    store.claim(request(&live, Token::random())).await.unwrap();
    let elsewhere = key("purge-elsewhere");
    let t = Token::random();
    other.claim(request(&elsewhere, t)).await.unwrap();
    assert!(other.release(&elsewhere, t).await.unwrap());

    assert_eq!(store.purge_expired(7).await.unwrap(), 7);
    assert_eq!(store.purge_expired(1000).await.unwrap(), 13);
    assert_eq!(store.purge_expired(1000).await.unwrap(), 0);
    for k in &released {
        assert!(!store.evict(k).await.unwrap(), "a released record survived");
    }
    assert!(
        store.inspect(&live).await.unwrap().is_some(),
        "a live record was purged"
    );
    // Still there: its fence counts on (a purged record would start at 1).
    let again = other
        .claim(request(&elsewhere, Token::random()))
        .await
        .unwrap();
    assert!(
        matches!(again, Claim::Acquired { fence: 2, .. }),
        "another prefix's record was purged: {again:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_purge_respects_limit_and_prefix() {
    let (Some(a), Some(b)) = (single_store().await, single_store().await) else {
        return;
    };
    purge_respects_limit_and_prefix(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_purge_respects_limit_and_prefix() {
    let (Some(a), Some(b)) = (cluster_store().await, cluster_store().await) else {
        return;
    };
    purge_respects_limit_and_prefix(a, b).await;
}

// ---------------------------------------------------------------------------
// Record integrity: a re-sent completion, an unknown state, a renewal past
// the ttl
// ---------------------------------------------------------------------------

async fn single_admin() -> redis::aio::MultiplexedConnection {
    redis::Client::open(services::redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn cluster_admin() -> redis::cluster_async::ClusterConnection {
    redis::cluster::ClusterClient::new(services::redis_cluster_urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap()
}

/// Everything Redis holds for a record: its value and its expiry
/// (`PEXPIRETIME`, -2 once the key is gone).
async fn raw_record(
    conn: &mut impl redis::aio::ConnectionLike,
    name: &str,
) -> (Option<Vec<u8>>, i64) {
    let value: Option<Vec<u8>> = redis::cmd("GET").arg(name).query_async(conn).await.unwrap();
    let expiry: i64 = redis::cmd("PEXPIRETIME")
        .arg(name)
        .query_async(conn)
        .await
        .unwrap();
    (value, expiry)
}

/// A hash's fields and its expiry.
async fn raw_hash(
    conn: &mut impl redis::aio::ConnectionLike,
    name: &str,
) -> (BTreeMap<Vec<u8>, Vec<u8>>, i64) {
    let fields: BTreeMap<Vec<u8>, Vec<u8>> = redis::cmd("HGETALL")
        .arg(name)
        .query_async(conn)
        .await
        .unwrap();
    let expiry: i64 = redis::cmd("PEXPIRETIME")
        .arg(name)
        .query_async(conn)
        .await
        .unwrap();
    (fields, expiry)
}

fn completion(payload: &[u8]) -> Completion<'_> {
    Completion {
        outcome: Outcome::Success,
        payload,
        ttl: Duration::from_secs(600),
    }
}

/// The cluster client re-sends a request after an I/O error, so a completion
/// whose reply was lost can reach the server twice. The second finds the
/// record DONE under its own token: that is the same completion, a success
/// that changes nothing. Another token (a stale owner) is still refused.
async fn resent_complete_is_the_same_completion(
    store: RedisStore,
    admin: &mut impl redis::aio::ConnectionLike,
) {
    let key = key("resent-complete");
    let name = store.redis_key(&key);
    let token = Token::random();
    assert!(matches!(
        store.claim(request(&key, token)).await.unwrap(),
        Claim::Acquired { fence: 1, .. }
    ));
    assert!(store.complete(&key, token, completion(b"1")).await.unwrap());
    let done = raw_record(admin, &name).await;

    assert!(
        store.complete(&key, token, completion(b"1")).await.unwrap(),
        "the re-sent completion was reported as a lost claim"
    );
    assert_eq!(
        raw_record(admin, &name).await,
        done,
        "the re-sent completion changed the record"
    );

    assert!(
        !store
            .complete(&key, Token::random(), completion(b"stale"))
            .await
            .unwrap(),
        "another token completed a DONE record"
    );
    assert_eq!(raw_record(admin, &name).await, done);
    let claim = store.claim(request(&key, Token::random())).await.unwrap();
    let Claim::Done(stored) = claim else {
        panic!("expected a replay, got {claim:?}");
    };
    assert_eq!(stored.payload, b"1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_resent_complete_is_the_same_completion() {
    if let Some(store) = single_store().await {
        resent_complete_is_the_same_completion(store, &mut single_admin().await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_resent_complete_is_the_same_completion() {
    if let Some(store) = cluster_store().await {
        resent_complete_is_the_same_completion(store, &mut cluster_admin().await).await;
    }
}

/// A value at a record's key that this version cannot read (a kind it does
/// not know, written by a newer version or by hand; a truncated record;
/// another application's value under the same prefix) is not an absent
/// record: claiming and inspecting it fail with a `StoreError` that names the
/// problem, the body never runs, and the value is left as it was.
async fn unknown_state_fails_closed(
    store: RedisStore,
    admin: &mut impl redis::aio::ConnectionLike,
) {
    let ledger = Ledger::new(store.clone());
    let mut truncated = b"P1".to_vec();
    truncated.extend_from_slice(&[7; 16]);
    truncated.extend_from_slice(b"-4:");
    for (i, value) in [
        b"A1archived".to_vec(),
        b"another application".to_vec(),
        truncated,
        b"R1".to_vec(),
    ]
    .into_iter()
    .enumerate()
    {
        let order = u64::from(Token::random().0[0]) + 10_000 * (i as u64 + 1);
        let key = Key::builder("idem-tests::redis::settle")
            .part(&order)
            .finish();
        let name = store.redis_key(&key);
        let () = redis::cmd("SET")
            .arg(&name)
            .arg(&value)
            .arg("PX")
            .arg(600_000)
            .query_async(admin)
            .await
            .unwrap();
        let written = raw_record(admin, &name).await;

        let e = store
            .claim(request(&key, Token::random()))
            .await
            .expect_err("a claim over an unreadable record");
        let shown = e.to_string();
        assert!(e.backend().starts_with("redis"), "{shown}");
        assert!(
            shown.contains(&name) && shown.contains("cannot read"),
            "the error does not say why: {shown}"
        );
        let e = store
            .inspect(&key)
            .await
            .expect_err("inspecting an unreadable record");
        assert!(e.to_string().contains("cannot read"), "{e}");
        let e = store_error(ledger.settle(order).await);
        assert!(e.to_string().contains("cannot read"), "{e}");
        assert_eq!(ledger.runs(), 0, "a body ran over an unreadable record");
        assert_eq!(
            raw_record(admin, &name).await,
            written,
            "the unreadable record was changed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_unknown_state_fails_closed() {
    if let Some(store) = single_store().await {
        unknown_state_fails_closed(store, &mut single_admin().await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_unknown_state_fails_closed() {
    if let Some(store) = cluster_store().await {
        unknown_state_fails_closed(store, &mut cluster_admin().await).await;
    }
}

/// Records written by the earlier layout (one hash per record, written by
/// the old claim.lua and complete.lua) are never replayed wrongly nor claimed
/// over: every operation on one fails with a `StoreError` saying the key
/// holds a hash of the earlier layout, no body runs, and the hash is left as
/// it was, to expire at its own ttl (or be evicted). A purge walks past it.
async fn earlier_layout_is_a_clear_error(
    store: RedisStore,
    admin: &mut impl redis::aio::ConnectionLike,
) {
    let ledger = Ledger::new(store.clone());
    let token = String::from_utf8_lossy(&[b'k'; 16]).into_owned();
    let old: [&[(&str, &str)]; 3] = [
        &[
            ("state", "done"),
            ("token", &token),
            ("fence", "2"),
            ("outcome", "1"),
            ("result", "424242"),
            ("fingerprint", ""),
            ("expires_at", "99999999999999"),
        ],
        &[
            ("state", "processing"),
            ("token", &token),
            ("fence", "1"),
            ("lease_until", "1"),
            ("expires_at", "99999999999999"),
            ("ttl", "600000"),
            ("fingerprint", ""),
        ],
        &[("state", "released"), ("fence", "3")],
    ];
    for (i, fields) in old.into_iter().enumerate() {
        let order = u64::from(Token::random().0[0]) + 10_000 * (i as u64 + 1);
        let key = Key::builder("idem-tests::redis::settle")
            .part(&order)
            .finish();
        let name = store.redis_key(&key);
        let () = redis::pipe()
            .hset_multiple(&name, fields)
            .ignore()
            .pexpire(&name, 600_000)
            .ignore()
            .query_async(admin)
            .await
            .unwrap();
        let written = raw_hash(admin, &name).await;

        let says_why = |e: &idem_runtime::StoreError| {
            let shown = e.to_string();
            assert!(
                shown.contains(&name) && shown.contains("earlier Redis layout"),
                "the error does not say why: {shown}"
            );
        };
        says_why(
            &store
                .claim(request(&key, Token::random()))
                .await
                .expect_err("a claim over a record of the earlier layout"),
        );
        says_why(&store.inspect(&key).await.expect_err("inspect"));
        let owner = Token([b'k'; 16]);
        says_why(
            &store
                .complete(&key, owner, completion(b"1"))
                .await
                .expect_err("complete"),
        );
        says_why(
            &store
                .renew(&key, owner, Duration::from_secs(1))
                .await
                .expect_err("renew"),
        );
        says_why(&store.release(&key, owner).await.expect_err("release"));
        says_why(&store_error(ledger.settle(order).await));
        assert_eq!(ledger.runs(), 0, "a body ran over an earlier record");
        store
            .purge_expired(1000)
            .await
            .expect("a purge walks past it");
        assert_eq!(
            raw_hash(admin, &name).await,
            written,
            "the earlier record was changed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_earlier_layout_is_a_clear_error() {
    if let Some(store) = single_store().await {
        earlier_layout_is_a_clear_error(store, &mut single_admin().await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_earlier_layout_is_a_clear_error() {
    if let Some(store) = cluster_store().await {
        earlier_layout_is_a_clear_error(store, &mut cluster_admin().await).await;
    }
}

/// A body that outlives its ttl but heartbeats is alive: every renewal keeps
/// the key (Redis must not expire it under a live lease), a newcomer stays
/// Busy throughout, and the owner completes at the end.
async fn renewals_keep_a_live_claim_past_its_ttl(
    store: RedisStore,
    admin: &mut impl redis::aio::ConnectionLike,
) {
    let key = key("renew-past-ttl");
    let name = store.redis_key(&key);
    let token = Token::random();
    let ttl = Duration::from_secs(1);
    let claim = store
        .claim(ClaimRequest {
            lease: Duration::from_millis(500),
            ttl,
            ..request(&key, token)
        })
        .await
        .unwrap();
    assert!(
        matches!(claim, Claim::Acquired { fence: 1, .. }),
        "{claim:?}"
    );
    // A lease far longer than the pause between beats, so a slow machine
    // cannot let it lapse; the ttl is what must not end the claim.
    let lease = Duration::from_secs(3);
    let started = Instant::now();
    let mut beats = 0;
    while started.elapsed() < ttl * 3 {
        assert!(
            store.renew(&key, token, lease).await.unwrap(),
            "the live owner lost its claim after {beats} renewals, {:?} into a {ttl:?} ttl",
            started.elapsed()
        );
        beats += 1;
        let newcomer = store.claim(request(&key, Token::random())).await.unwrap();
        assert!(
            matches!(newcomer, Claim::Busy { .. }),
            "a live claim was taken after {:?}: {newcomer:?}",
            started.elapsed()
        );
        let (fields, expiry) = raw_record(admin, &name).await;
        assert!(fields.is_some() && expiry > 0, "the key expired");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        store
            .complete(&key, token, completion(b"late"))
            .await
            .unwrap()
    );
    let info = store.inspect(&key).await.unwrap().expect("record");
    assert_eq!((info.state, info.fence), (RecordState::Done, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_renewals_keep_a_live_claim_past_its_ttl() {
    if let Some(store) = single_store().await {
        renewals_keep_a_live_claim_past_its_ttl(store, &mut single_admin().await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_renewals_keep_a_live_claim_past_its_ttl() {
    if let Some(store) = cluster_store().await {
        renewals_keep_a_live_claim_past_its_ttl(store, &mut cluster_admin().await).await;
    }
}
