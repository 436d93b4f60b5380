//! Calls under a process-wide key secret: they deduplicate as before, and what
//! the store holds is the keyed hash, not the plain SHA-256 anyone could
//! recompute from the fields.
//!
//! A binary of its own: `install_key_secret` changes every key the process
//! derives, and no other test's keys may change under it. Every test here
//! installs the same secret first, so their order does not matter.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use idem_runtime::store::Store;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{Error, Fingerprint, Key, KeySecret, idempotent, install_key_secret};
use sha2::{Digest, Sha256};

const SCOPE: &str = "idem-tests::keyed::pay";

fn secret() -> KeySecret {
    KeySecret::from_bytes(b"the idem-tests keyed binary's own secret").unwrap()
}

fn with_secret() {
    install_key_secret(secret());
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
}

struct Transfer {
    user_id: u64,
    amount: u64,
}

#[derive(Default)]
struct Payments {
    store: MemoryStore,
    runs: AtomicUsize,
    keys: Mutex<Vec<Key>>,
}

impl Payments {
    #[idempotent(key = "t.user_id", fingerprint = "t.amount", scope = "idem-tests::keyed::pay", store = self.store)]
    async fn pay(&self, t: Transfer) -> Result<u64, AppError> {
        self.runs.fetch_add(1, SeqCst);
        let key = idem_runtime::current_key().expect("inside the call");
        self.keys.lock().unwrap().push(key);
        Ok(t.amount)
    }
}

/// The plain SHA-256 key of one user id: what a reader of the store could
/// compute for every candidate id without the secret.
fn plain_key(user_id: u64) -> Key {
    let encoding = Key::builder(SCOPE).part(&user_id).encoding().to_vec();
    Key::from_bytes(Sha256::digest(encoding).into())
}

#[tokio::test]
async fn a_call_deduplicates_under_the_installed_secret() {
    with_secret();
    let svc = Payments::default();
    let t = || Transfer {
        user_id: 734211,
        amount: 100,
    };
    assert_eq!(svc.pay(t()).await.unwrap(), 100);
    assert_eq!(svc.pay(t()).await.unwrap(), 100, "replayed");
    assert_eq!(svc.runs.load(SeqCst), 1);
    let other = Transfer { amount: 999, ..t() };
    assert!(
        matches!(
            svc.pay(other).await,
            Err(AppError::Idem(Error::KeyReuse { .. }))
        ),
        "the keyed fingerprint still tells payloads apart"
    );
    assert_eq!(svc.runs.load(SeqCst), 1);

    let keyed = Key::keyed_builder(SCOPE, &secret())
        .part(&734211u64)
        .finish();
    assert_eq!(Key::builder(SCOPE).part(&734211u64).finish(), keyed);
    assert_eq!(*svc.keys.lock().unwrap(), [keyed], "the body's current_key");
    assert_ne!(keyed, plain_key(734211));

    let record = svc
        .store
        .inspect(&keyed)
        .await
        .unwrap()
        .expect("the record");
    let stored = record.result.expect("done").fingerprint;
    assert_eq!(
        stored,
        Some(Fingerprint::keyed_builder(&secret()).part(&100u64).finish())
    );
    assert!(
        svc.store
            .inspect(&plain_key(734211))
            .await
            .unwrap()
            .is_none(),
        "a record under the plain SHA-256 key"
    );
}

/// Keys derived for steps and downstream calls come from the keyed hash, so
/// they cannot be recomputed from the fields either.
#[tokio::test]
async fn derived_keys_come_from_the_keyed_hash() {
    with_secret();
    let svc = Payments::default();
    svc.pay(Transfer {
        user_id: 42,
        amount: 1,
    })
    .await
    .unwrap();
    let key = svc.keys.lock().unwrap()[0];
    assert_eq!(
        key.derive("psp:charge"),
        Key::keyed_builder(SCOPE, &secret())
            .part(&42u64)
            .finish()
            .derive("psp:charge")
    );
    assert_ne!(key.derive("psp:charge"), plain_key(42).derive("psp:charge"));
}
