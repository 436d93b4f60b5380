//! The Redis store on a single node (`IDEM_REDIS_URL`, default 127.0.0.1:6379)
//! and on a Redis Cluster (`IDEM_REDIS_CLUSTER_URLS`, started by
//! `scripts/test`): the whole conformance suite on both, then what only a
//! server can show — scripts reloaded after `SCRIPT FLUSH`, a re-sent claim
//! recognised, the completion's path (`SET … IFEQ` or the script, by server),
//! failing closed when Redis is unreachable, stops, or loses the
//! connection between claim and complete, and the server's limits
//! (`proto-max-bulk-len`, `maxmemory`). `scripts/test` runs this binary
//! twice: on Redis 7 (script completion) and on Valkey 8.1 (`IDEM_REDIS_URL`
//! and `IDEM_REDIS_SERVER` pointing at it; plain-command completion).
//!
//! Every store here gets a key prefix of its own, so runs and cases never see
//! each other's records (and a purge in one case cannot delete another's). The
//! shared servers are never stopped: the tests that stop Redis start their own
//! `redis-server` on a free loopback port.
//!
//! One module per topic; the stores, the settling service and the
//! `redis-server` of a test's own that several topics use are here.

mod claim;
mod completion;
mod fail_closed;
mod layout;
mod limits;
mod purge;
mod records;
mod recovery_index;
mod scripts;

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idem_runtime::store::StoreRef;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::{ClaimRequest, Completion, StoredOutcome, Token};
use idem_runtime::{Error, Key, idempotent};
use idem_tests::conformance::Subject;
use idem_tests::proxy::Proxy;
use idem_tests::services;
use redis::IntoConnectionInfo;

/// The conformance unit: leases of 3 units, ttls of 20. Redis keeps time to
/// the millisecond; 200 ms keeps the cases well clear of scheduling noise.
const UNIT: Duration = Duration::from_millis(200);

/// A key prefix no other store, case or run shares.
fn unique_prefix() -> String {
    let t = *Token::random().as_bytes();
    let hex: String = t[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("idem-test:{hex}:")
}

/// host:port of a URL, for messages (never the URL: it may hold a password).
fn address(url: &str) -> String {
    url.into_connection_info()
        .map(|i| i.addr().to_string())
        .unwrap_or_else(|_| "an unparsable URL".into())
}

/// A store on the shared server under a fresh prefix, and a proxy in front
/// of that server, for a second store on the same records (the same
/// prefix) whose connection a test can stall or cut.
async fn direct_and_proxy() -> Option<(RedisStore, Proxy, String)> {
    let url = services::redis_url();
    let prefix = unique_prefix();
    let direct = RedisStore::builder()
        .key_prefix(&prefix)
        .connect(&url)
        .await;
    let direct = services::reachable("Redis", &address(&url), direct)?;
    let proxy = Proxy::start(address(&url)).await;
    Some((direct, proxy, prefix))
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
        .part(&Token::random().as_bytes()[..])
        .finish()
}

fn completion(payload: &[u8]) -> Completion<'_> {
    Completion {
        outcome: StoredOutcome::Success,
        payload,
        ttl: Duration::from_secs(600),
    }
}

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

/// A `redis-server` of this test's own on a free loopback port (never the
/// shared 6379, never scripts/test's cluster ports), killed when dropped.
struct OwnRedis {
    child: Child,
    port: u16,
}

impl OwnRedis {
    fn start() -> Option<OwnRedis> {
        OwnRedis::start_with(&[])
    }

    /// With `args` added to the command line: a limit lowered for one test.
    fn start_with(args: &[&str]) -> Option<OwnRedis> {
        let port = StdListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        OwnRedis::start_on(port, args)
    }

    fn start_on(port: u16, args: &[&str]) -> Option<OwnRedis> {
        // `IDEM_REDIS_SERVER`: the server binary of the run (scripts/test
        // runs this binary once on Redis and once on Valkey).
        let binary = std::env::var("IDEM_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(args)
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

/// Waits for a store's walk of the keyspace for records under the earlier
/// layout's names to find none (on a server of a test's own), after which
/// its claims send nothing for them: for tests that count commands.
async fn wait_until_earlier_names_are_not_read(store: &RedisStore) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.reads_earlier_names() {
        assert!(
            Instant::now() < deadline,
            "the walk for earlier names did not end"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
