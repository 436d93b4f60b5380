//! Every embedded store runs the whole conformance suite.

use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::sql::SqliteStore;
use idem_runtime::{ManualClock, StoreRef};
use idem_tests::conformance::Subject;

async fn memory() -> Subject {
    let clock = ManualClock::default();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    Subject::manual(StoreRef::new(store), clock)
}

async fn sqlite_in_memory() -> Subject {
    let clock = ManualClock::default();
    let store = SqliteStore::builder()
        .clock(clock.clone())
        .in_memory()
        .await
        .expect("in-memory sqlite");
    Subject::manual(StoreRef::new(store), clock)
}

async fn sqlite_file() -> Subject {
    let clock = ManualClock::default();
    let path = std::env::temp_dir().join(format!(
        "idem-conformance-{}-{}.db",
        std::process::id(),
        idem_runtime::Token::random().0[0] as u32 * 1000 + rand_suffix()
    ));
    let store = SqliteStore::builder()
        .clock(clock.clone())
        .open(&path)
        .await
        .expect("sqlite file");
    Subject::manual(StoreRef::new(store), clock)
}

fn rand_suffix() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

idem_tests::conformance_suite!(memory_store, memory());
idem_tests::conformance_suite!(sqlite_memory_store, sqlite_in_memory());
idem_tests::conformance_suite!(sqlite_file_store, sqlite_file());
