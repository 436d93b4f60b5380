//! A recoverable call's arguments as the store keeps them: encoded once by
//! the call, sealed under the key secret, capped like results.
//!
//! ```text
//! sealed      'S' seal[32] JSON     the arguments, as a JSON array in parameter order
//! not stored  'U' JSON               why not: too large, or they did not encode
//! ```
//!
//! The seal (`key::seal`) covers the key, the scope and the JSON, keyed like
//! keys and fingerprints. A worker checks it before it decodes anything, so
//! bytes that no caller of this deployment wrote under this key (someone
//! with write access to the store, a record copied under another key, a
//! changed secret) are never run. Arguments over the store's result cap are
//! not stored, as results are not: the call still runs, and the marker tells
//! the worker, which parks such a claim for an operator rather than skip it
//! silently.

use serde::{Deserialize, Serialize};

use crate::key::{Key, seal as seal_digest};

/// The arguments of one call, encoded by the expansion before the body takes
/// them (or why they could not be).
#[derive(Debug)]
pub struct CallArgs(pub(crate) Result<Vec<u8>, String>);

/// Encodes a call's arguments, a tuple of references in parameter order (the
/// expansion writes them one by one with `__private::ArgsWriter`).
#[cfg(test)]
pub(crate) fn encode<A: Serialize + ?Sized>(args: &A) -> CallArgs {
    // The category only: serde's message may quote the value.
    CallArgs(serde_json::to_vec(args).map_err(|e| format!("{:?}", e.classify())))
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum NotStored {
    TooLarge { size: usize, limit: usize },
    EncodeFailed { category: String },
}

/// The bytes the store keeps for `args` of the call under `key` in `scope`.
pub(crate) fn seal(key: &Key, scope: &str, args: &CallArgs, limit: usize) -> Vec<u8> {
    let json = match &args.0 {
        Ok(json) if json.len() <= limit => json,
        Ok(json) => {
            tracing::error!(
                size = json.len(),
                limit,
                "recoverable call's arguments over the store's cap: not stored, a worker cannot finish this call"
            );
            return not_stored(&NotStored::TooLarge {
                size: json.len(),
                limit,
            });
        }
        Err(category) => {
            tracing::error!(%category, "recoverable call's arguments do not encode: not stored");
            return not_stored(&NotStored::EncodeFailed {
                category: category.clone(),
            });
        }
    };
    let mut out = Vec::with_capacity(1 + 32 + json.len());
    out.push(b'S');
    out.extend_from_slice(&seal_digest(key, scope, json));
    out.extend_from_slice(json);
    out
}

fn not_stored(why: &NotStored) -> Vec<u8> {
    let mut out = vec![b'U'];
    out.extend_from_slice(&serde_json::to_vec(why).expect("NotStored always encodes"));
    out
}

/// Why stored arguments cannot be used: the note a parked claim carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unusable(pub(crate) String);

/// The JSON of sealed arguments, once their seal checks out.
pub(crate) fn open<'a>(key: &Key, scope: &str, stored: &'a [u8]) -> Result<&'a [u8], Unusable> {
    match stored.split_first() {
        Some((b'S', rest)) if rest.len() >= 32 => {
            let (seal, json) = rest.split_at(32);
            if seal == seal_digest(key, scope, json) {
                Ok(json)
            } else {
                Err(Unusable(
                    "the stored arguments fail their seal: written by someone without this deployment's key secret, under another key, or before the secret changed"
                        .into(),
                ))
            }
        }
        Some((b'U', rest)) => Err(Unusable(match serde_json::from_slice(rest) {
            Ok(NotStored::TooLarge { size, limit }) => format!(
                "the arguments were not stored: {size} bytes, over the store's cap of {limit}"
            ),
            Ok(NotStored::EncodeFailed { category }) => {
                format!("the arguments were not stored: they did not encode as JSON ({category})")
            }
            Err(_) => "the arguments were not stored".into(),
        })),
        _ => Err(Unusable(
            "the stored arguments are in a format this version cannot read".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_arguments_open_only_under_their_key_and_scope() {
        let key = Key::builder("s").part("k").finish();
        let other = Key::builder("s").part("j").finish();
        let sealed = seal(&key, "s", &encode(&(&7u64, "x")), 1024);
        assert_eq!(open(&key, "s", &sealed).unwrap(), br#"[7,"x"]"#);
        assert!(open(&other, "s", &sealed).is_err());
        assert!(open(&key, "t", &sealed).is_err());
        let mut tampered = sealed.clone();
        *tampered.last_mut().unwrap() = b'y';
        assert!(open(&key, "s", &tampered).is_err());
    }

    #[test]
    fn arguments_over_the_cap_are_not_stored_and_say_why() {
        let key = Key::builder("s").part("k").finish();
        let sealed = seal(&key, "s", &encode(&("a long argument",)), 8);
        let why = open(&key, "s", &sealed).unwrap_err();
        assert!(why.0.contains("over the store's cap of 8"), "{why:?}");
    }
}
