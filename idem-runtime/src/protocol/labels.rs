//! Names for the keys the explorer's trace shows (`crate::testing`): a
//! call's scope or a step's name, noted when the protocol first uses a key.
//! Only with the `testing` feature: without it there is no hook to call.
//! Names are kept only while an explorer runs, and forgotten when the last
//! one ends: a test process (or a service built with the feature) that makes
//! calls outside an explorer keeps nothing, however many it makes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::key::Key;
use crate::spec::Kind;

fn names() -> &'static Mutex<HashMap<Key, (Kind, &'static str)>> {
    static NAMES: OnceLock<Mutex<HashMap<Key, (Kind, &'static str)>>> = OnceLock::new();
    NAMES.get_or_init(Mutex::default)
}

/// How many explorers are running in the process.
static LISTENING: AtomicUsize = AtomicUsize::new(0);

/// Keeps names while it lives; the last one dropped forgets them all.
pub(crate) struct Listening(());

/// Names are kept from now until the returned guard is dropped.
pub(crate) fn listen() -> Listening {
    LISTENING.fetch_add(1, Ordering::SeqCst);
    Listening(())
}

impl Drop for Listening {
    fn drop(&mut self) {
        let mut names = names().lock().unwrap_or_else(|p| p.into_inner());
        // Under the map's lock, so a `listen` racing with this drop either
        // counts before the check (and the names stay) or after it.
        if LISTENING.fetch_sub(1, Ordering::SeqCst) == 1 {
            names.clear();
            names.shrink_to_fit();
        }
    }
}

/// The protocol is about to use `key` for a call or step named `scope`.
pub(crate) fn note(key: Key, kind: Kind, scope: &'static str) {
    if LISTENING.load(Ordering::Relaxed) == 0 {
        return;
    }
    names()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, (kind, scope));
}

/// How the trace names `key`: "step `charge`", "call `orders.create`", or
/// the key's short form for one the protocol never named (a give-up record,
/// a compensation's).
pub(crate) fn describe(key: &Key) -> String {
    match names().lock().unwrap_or_else(|p| p.into_inner()).get(key) {
        Some((Kind::Step, "idem.give_up")) => "the flow's give-up record".to_owned(),
        Some((Kind::Step, name)) => format!("step `{name}`"),
        Some((_, scope)) => format!("call `{scope}`"),
        None => format!("record {}", key.short()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(key: &Key) -> bool {
        names().lock().unwrap().contains_key(key)
    }

    #[test]
    fn names_are_kept_only_while_an_explorer_listens() {
        let key = |n: u64| Key::builder("labels.test").part(&n).finish();
        note(key(1), Kind::Call, "outside");
        assert!(!known(&key(1)), "a call outside an explorer is not kept");
        let first = listen();
        let second = listen();
        note(key(2), Kind::Call, "inside");
        assert_eq!(describe(&key(2)), "call `inside`");
        drop(first);
        assert!(known(&key(2)), "another explorer still listens");
        drop(second);
        assert!(!known(&key(2)), "the last one forgets every name");
    }
}
