//! What a call allocates, counted by a global allocator on this test's own
//! thread: a store of a known type is polled in place, so a call on it
//! allocates nothing for the store's futures, nor for the handle its steps
//! would use; a `StoreRef` boxes its claim's and its completion's futures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use idem_runtime::idempotent;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::{AsStore, StoreRef};

/// Counts the allocations of the thread that asked, while it asks.
struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters are thread-locals of `Copy` cells, which allocate nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = COUNTING.try_with(|on| {
            if on.get() {
                ALLOCATIONS.with(|n| n.set(n.get() + 1));
            }
        });
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

struct Svc<S> {
    store: S,
}

impl<S: AsStore> Svc<S> {
    #[idempotent(key = "id", scope = "allocations.create", store = self.store)]
    async fn create(&self, id: u64) -> Result<u64, AppError> {
        Ok(id)
    }
}

/// The fewest allocations of a first call with a fresh key, over several:
/// a call that happens to grow a map (the store's shard, the in-progress
/// hint's) allocates once more, and is not what is measured.
async fn allocations_of_a_call<S: AsStore>(svc: &Svc<S>, from: u64) -> usize {
    let mut fewest = usize::MAX;
    for id in from..from + 8 {
        COUNTING.with(|on| on.set(true));
        ALLOCATIONS.with(|n| n.set(0));
        svc.create(id).await.unwrap();
        COUNTING.with(|on| on.set(false));
        fewest = fewest.min(ALLOCATIONS.with(|n| n.get()));
    }
    fewest
}

#[test]
fn a_store_of_known_type_boxes_no_future_and_makes_no_handle() {
    let shared = Svc {
        store: StoreRef::new(MemoryStore::new()),
    };
    let known = Svc {
        store: MemoryStore::new(),
    };
    let in_arc = Svc {
        store: Arc::new(MemoryStore::new()),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (shared, known, in_arc) = rt.block_on(async {
        // Unmeasured first: the thread's lazily built state (metric keys,
        // the token generator, the site's slots) and the maps' first tables.
        for id in 0..100 {
            shared.create(id).await.unwrap();
            known.create(id).await.unwrap();
            in_arc.create(id).await.unwrap();
        }
        (
            allocations_of_a_call(&shared, 1_000).await,
            allocations_of_a_call(&known, 2_000).await,
            allocations_of_a_call(&in_arc, 3_000).await,
        )
    });
    eprintln!("allocations: StoreRef {shared}, MemoryStore {known}, Arc {in_arc}");
    // Through a `StoreRef`, the claim's and the completion's futures are
    // boxed; on the store itself, neither is, and no `StoreRef` is made for
    // the call's steps (the store shares the `Arc` it already has).
    assert_eq!(shared, known + 2, "StoreRef {shared}, MemoryStore {known}");
    assert_eq!(
        in_arc, known,
        "Arc<MemoryStore> {in_arc}, MemoryStore {known}"
    );
    // What is left: the result's stored bytes, and the store's copy of them.
    assert_eq!(known, 2, "a call on MemoryStore allocated {known} times");
}
