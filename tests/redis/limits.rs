//! The store at the server's limits, each on a `redis-server` of the test's
//! own with the limit lowered (never on the shared server): the largest
//! value one command may carry (`proto-max-bulk-len`) and memory
//! (`maxmemory`, with `noeviction` and with an evicting policy).

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use idem_runtime::store::Store;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::{Error, idempotent};
use redis::aio::MultiplexedConnection;

use crate::{AppError, Ledger, OwnRedis, store_error, unique_prefix};

const MIB: usize = 1024 * 1024;

/// Results of the size asked for: `size` bytes of JSON (a string of
/// `size - 2` letters between its quotes).
struct Reports {
    store: RedisStore,
    runs: AtomicUsize,
}

impl Reports {
    #[idempotent(
        key = "size",
        scope = "idem-tests::redis::report",
        store = self.store,
        lease = "30s",
        ttl = "10m"
    )]
    async fn report(&self, size: usize) -> Result<String, AppError> {
        self.runs.fetch_add(1, SeqCst);
        Ok("x".repeat(size - 2))
    }
}

/// A server whose `proto-max-bulk-len` is 1 MiB, a store asked to keep
/// results of up to 2 MiB: the store keeps only what the server can take
/// (1 MiB less a DONE record's head). A result exactly at that cap is stored
/// and replayed; one byte over, and one over the server's own limit, are
/// handed to the caller and not stored, and duplicates get
/// `ResultTooLarge` without running the body (was: the completion's
/// argument over the limit made Redis close the connection, the record
/// stayed PROCESSING, a duplicate was told the call was in progress and ran
/// the body again once the lease was over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_result_bytes_is_capped_to_what_proto_max_bulk_len_takes() {
    let Some(server) = OwnRedis::start_with(&["--proto-max-bulk-len", "1mb"]) else {
        return;
    };
    let store = RedisStore::builder()
        .key_prefix(unique_prefix())
        .max_result_bytes(2 * MIB)
        .connect(&server.url())
        .await
        .expect("own redis-server");
    let cap = store.max_result_bytes();
    assert!((MIB - 128..MIB).contains(&cap), "cap {cap}");
    let reports = Reports {
        store,
        runs: AtomicUsize::new(0),
    };

    assert_eq!(reports.report(cap).await.unwrap().len(), cap - 2);
    assert_eq!(
        reports.report(cap).await.unwrap().len(),
        cap - 2,
        "replayed"
    );
    assert_eq!(reports.runs.load(SeqCst), 1);

    for size in [cap + 1, MIB + 1] {
        let runs = reports.runs.load(SeqCst);
        assert_eq!(reports.report(size).await.unwrap().len(), size - 2);
        match reports.report(size).await {
            Err(AppError::Idem(Error::ResultTooLarge {
                size: told, limit, ..
            })) => assert_eq!((told, limit), (size, cap)),
            other => panic!("{size} bytes: expected ResultTooLarge, got {other:?}"),
        }
        assert_eq!(reports.runs.load(SeqCst), runs + 1, "{size} bytes");
    }
}

/// Writes values of `size` bytes under keys of their own until `enough`
/// says so (and says whether it did before `max` of them).
async fn fill<F, Fut>(
    conn: &mut MultiplexedConnection,
    size: usize,
    max: usize,
    mut enough: F,
) -> bool
where
    F: FnMut(MultiplexedConnection) -> Fut,
    Fut: Future<Output = bool>,
{
    for i in 0..max {
        if enough(conn.clone()).await {
            return true;
        }
        let _: () = redis::cmd("SET")
            .arg(format!("filler:{i}"))
            .arg(vec![b'f'; size])
            .query_async(conn)
            .await
            .unwrap();
    }
    enough(conn.clone()).await
}

/// A ledger on `server` under `prefix` whose order 1 has run once and
/// replayed, and a connection of the test's own to the server.
async fn settled_once(server: &OwnRedis, prefix: &str) -> (Ledger, MultiplexedConnection) {
    let store = RedisStore::builder()
        .key_prefix(prefix)
        .connect(&server.url())
        .await
        .expect("own redis-server");
    let ledger = Ledger::new(store);
    assert_eq!(ledger.settle(1).await.unwrap(), 2);
    assert_eq!(ledger.settle(1).await.unwrap(), 2, "replayed");
    assert_eq!(ledger.runs(), 1);
    let client = redis::Client::open(server.url()).unwrap();
    let conn = client.get_multiplexed_async_connection().await.unwrap();
    (ledger, conn)
}

/// `maxmemory` with `noeviction` (what the table asks for): with memory to
/// spare a call runs once and replays; once the server refuses writes
/// (`-OOM`), a new call fails closed with `Error::Store` naming the refusal
/// and its body does not run, and so does a duplicate of the completed call
/// (the claim is a write), rather than replaying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maxmemory_with_noeviction_fails_closed() {
    let Some(server) =
        OwnRedis::start_with(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    else {
        return;
    };
    let (ledger, mut conn) = settled_once(&server, &unique_prefix()).await;
    // 600 KiB of other data, then a limit below what the server holds: every
    // write is refused from then on. (Filling up to the limit says less:
    // used memory hovers around it, as a write's own query buffer counts
    // against maxmemory and is freed with its refusal.)
    fill(&mut conn, 100 * 1024, 6, |_| std::future::ready(false)).await;
    let used = |info: String| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory in INFO")
    };
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await
        .unwrap();
    let held = used(info);
    assert!(
        held < 2 * MIB as u64,
        "{held} bytes held: the fill was refused"
    );
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(held / 2)
        .query_async(&mut conn)
        .await
        .unwrap();

    for order in [2, 1] {
        let e = store_error(ledger.settle(order).await);
        assert!(e.to_string().contains("OOM"), "order {order}: {e}");
    }
    assert_eq!(ledger.runs(), 1, "a body ran without its claim");
}

/// `maxmemory` with an evicting policy (`allkeys-lru`) breaks deduplication:
/// once Redis has evicted a completed call's record to make room, a
/// duplicate finds no record and runs the body again. The deployment rule
/// the table states (`noeviction`), pinned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maxmemory_with_an_evicting_policy_lets_a_duplicate_run_again() {
    let Some(server) =
        OwnRedis::start_with(&["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"])
    else {
        return;
    };
    let prefix = unique_prefix();
    let (ledger, mut conn) = settled_once(&server, &prefix).await;
    let records = |mut conn: MultiplexedConnection| {
        let pattern = format!("{prefix}*");
        async move {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(pattern)
                .query_async(&mut conn)
                .await
                .unwrap();
            keys.is_empty()
        }
    };
    assert!(
        fill(&mut conn, 10 * 1024, 2000, records).await,
        "20 MiB written and the record still there"
    );

    assert_eq!(ledger.settle(1).await.unwrap(), 2);
    assert_eq!(
        ledger.runs(),
        2,
        "the record was evicted: the body ran again"
    );
}
