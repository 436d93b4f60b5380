//! Names for the keys the explorer's trace shows (`crate::testing`): a
//! call's scope or a step's name, noted when the protocol first uses a key.
//! Only with the `testing` feature: without it there is no hook to call.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::key::Key;
use crate::spec::Kind;

fn names() -> &'static Mutex<HashMap<Key, (Kind, &'static str)>> {
    static NAMES: OnceLock<Mutex<HashMap<Key, (Kind, &'static str)>>> = OnceLock::new();
    NAMES.get_or_init(Mutex::default)
}

/// The protocol is about to use `key` for a call or step named `scope`.
pub(crate) fn note(key: Key, kind: Kind, scope: &'static str) {
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
