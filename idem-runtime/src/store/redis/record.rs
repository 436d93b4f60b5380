//! The record layout: one string value per record.
//!
//! ```text
//! PROCESSING  "P1" token[16] fp fence ":" ttl_ms ":" margin_ms
//! DONE        "D1" token[16] fp fence ":" outcome ":" payload
//! RELEASED    "R1" fence
//! fp          "-" (no fingerprint) | "#" fingerprint[32]
//! ```
//!
//! Numbers are ASCII decimal; the token and fingerprint are raw bytes at fixed
//! offsets, so the Lua scripts find them with `string.sub` and never decode
//! anything; the payload comes last and is kept byte for byte.
//!
//! The key's own expiry (`PX`) is the record's life. A PROCESSING record lives
//! `max(ttl, lease)` from its claim (and from each renewal), and its lease ends
//! `margin` milliseconds before the key expires: `lease end = PEXPIRETIME -
//! margin`. So the claim needs no server clock, and a plain `SET … PX` can
//! write it. A DONE record lives its ttl from completion; a RELEASED record
//! keeps the fence, and the rest of the claim's life, for the next claim.
//!
//! Anything else at a record's key (another kind, a truncated value, a hash of
//! the earlier layout) is never read as an absent record.

use std::fmt;

use crate::key::Fingerprint;
use crate::store::{StoredOutcome, StoredResult, Token};

/// The longest head a DONE record puts before its payload: kind, token, a
/// fingerprint, a fence of 20 digits, and the outcome between its colons.
/// (A claim's sealed arguments, `S`, a digest and the JSON, have a shorter
/// one.)
pub(super) const DONE_HEAD_MAX: usize = 2 + 16 + 1 + 32 + 20 + 3;

/// What a record's value says.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Record {
    Processing {
        token: Token,
        fence: u64,
    },
    Done {
        token: Token,
        fence: u64,
        result: StoredResult,
    },
    Released,
}

/// The head of a PROCESSING record: kind, token and fingerprint.
pub(super) fn processing_head(token: Token, fp: Option<Fingerprint>) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + 16 + 1 + 32 + 40);
    v.extend_from_slice(b"P1");
    v.extend_from_slice(token.as_bytes());
    match fp {
        Some(fp) => {
            v.push(b'#');
            v.extend_from_slice(fp.as_bytes());
        }
        None => v.push(b'-'),
    }
    v
}

/// Completes a PROCESSING head (as [`processing_head`] sized it) into the
/// whole record the claim writes: fence 1, the claim's ttl, and how long the
/// key outlives the lease.
pub(super) fn push_processing_tail(head: &mut Vec<u8>, ttl_ms: u64, lives_ms: u64, lease_ms: u64) {
    head.extend_from_slice(b"1:");
    push_decimal(head, ttl_ms);
    head.push(b':');
    push_decimal(head, lives_ms - lease_ms);
}

/// Writes `n` in decimal, as the records and the scripts spell numbers
/// (`itoa`: a claim and a completion each write some, and `fmt` cost more
/// than the rest of building the record).
fn push_decimal(v: &mut Vec<u8>, n: u64) {
    v.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// The DONE record that replaces the PROCESSING record `v` (same token,
/// fingerprint and fence) with the outcome `code` (an ASCII digit) and
/// `payload`: what `complete.lua` writes, built by the owner for `SET …
/// IFEQ`.
pub(super) fn done_from_processing(v: &[u8], code: u8, payload: &[u8]) -> Option<Vec<u8>> {
    if v.get(..2) != Some(b"P1") {
        return None;
    }
    let (_, at) = fingerprint_at(v).ok()?;
    let (fence, _) = number(&v[at..], Some(b':')).ok()?;
    let mut done = Vec::with_capacity(at + 24 + payload.len());
    done.extend_from_slice(b"D1");
    done.extend_from_slice(&v[2..at]);
    push_decimal(&mut done, fence);
    done.push(b':');
    done.push(code);
    done.push(b':');
    done.extend_from_slice(payload);
    Some(done)
}

/// Rewrites the margin at the end of the PROCESSING record `v`, as
/// `renew.lua` did on the server.
pub(super) fn set_margin(v: &mut Vec<u8>, margin: u64) {
    if let Some(last) = v.iter().rposition(|&b| b == b':') {
        v.truncate(last + 1);
        push_decimal(v, margin);
    }
}

/// The PROCESSING record `reclaim.lua` writes for `head` at `fence`.
pub(super) fn processing_at(head: &[u8], fence: u64, ttl_ms: u64, lease_ms: u64) -> Vec<u8> {
    let mut v = head.to_vec();
    push_decimal(&mut v, fence);
    v.push(b':');
    push_decimal(&mut v, ttl_ms);
    v.push(b':');
    push_decimal(&mut v, ttl_ms.max(lease_ms) - lease_ms);
    v
}

/// A value at a record's key that is not one of ours, or not whole.
#[derive(Debug)]
pub(super) struct Unreadable(pub(super) &'static str);

impl fmt::Display for Unreadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

fn token_at(v: &[u8]) -> Result<Token, Unreadable> {
    v.get(2..18)
        .and_then(|t| <[u8; 16]>::try_from(t).ok())
        .map(Token)
        .ok_or(Unreadable("a record too short for its token"))
}

/// The fingerprint block after the token, and where the numbers start.
fn fingerprint_at(v: &[u8]) -> Result<(Option<Fingerprint>, usize), Unreadable> {
    match v.get(18) {
        Some(b'-') => Ok((None, 19)),
        Some(b'#') => v
            .get(19..51)
            .and_then(|f| <[u8; 32]>::try_from(f).ok())
            .map(|f| (Some(Fingerprint::from_bytes(f)), 51))
            .ok_or(Unreadable("a record too short for its fingerprint")),
        _ => Err(Unreadable("a record without a fingerprint marker")),
    }
}

/// A decimal number ending at `sep` (or at the end when `sep` is `None`);
/// returns it and what follows the separator.
fn number(v: &[u8], sep: Option<u8>) -> Result<(u64, &[u8]), Unreadable> {
    let end = match sep {
        Some(s) => v
            .iter()
            .position(|&b| b == s)
            .ok_or(Unreadable("a record missing a separator"))?,
        None => v.len(),
    };
    let digits = &v[..end];
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(Unreadable("a record with a malformed number"));
    }
    let n = std::str::from_utf8(digits)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(Unreadable("a record with a malformed number"))?;
    Ok((n, &v[(end + 1).min(v.len())..]))
}

/// The PROCESSING fields past the head: fence, ttl, margin.
pub(super) fn processing_tail(v: &[u8]) -> Result<(u64, u64, u64), Unreadable> {
    let (_, at) = fingerprint_at(v)?;
    let (fence, rest) = number(&v[at..], Some(b':'))?;
    let (ttl, rest) = number(rest, Some(b':'))?;
    let (margin, _) = number(rest, None)?;
    Ok((fence, ttl, margin))
}

/// Reads a record's value.
pub(super) fn decode(v: &[u8]) -> Result<Record, Unreadable> {
    match v.get(..2) {
        Some(b"P1") => {
            let token = token_at(v)?;
            let (fence, _, _) = processing_tail(v)?;
            Ok(Record::Processing { token, fence })
        }
        Some(b"D1") => {
            let token = token_at(v)?;
            let (fingerprint, at) = fingerprint_at(v)?;
            let (fence, rest) = number(&v[at..], Some(b':'))?;
            let (code, payload) = match rest {
                [c, b':', payload @ ..] if c.is_ascii_digit() => (i64::from(c - b'0'), payload),
                _ => return Err(Unreadable("a DONE record without an outcome")),
            };
            let outcome = StoredOutcome::from_code(code)
                .ok_or(Unreadable("a DONE record with an unknown outcome"))?;
            Ok(Record::Done {
                token,
                fence,
                result: StoredResult {
                    fingerprint,
                    outcome,
                    payload: payload.to_vec(),
                },
            })
        }
        Some(b"R1") => {
            number(&v[2..], None)?;
            Ok(Record::Released)
        }
        _ => Err(Unreadable(
            "a value that is not an idem record of this layout",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processing_round_trips() {
        let t = Token::from_bytes([9; 16]);
        let fp = Fingerprint::from_bytes([7; 32]);
        for fp in [None, Some(fp)] {
            let mut v = processing_head(t, fp);
            push_processing_tail(&mut v, 600_000, 600_000, 30_000);
            assert_eq!(
                decode(&v).unwrap(),
                Record::Processing { token: t, fence: 1 }
            );
            assert_eq!(processing_tail(&v).unwrap(), (1, 600_000, 570_000));
        }
    }

    #[test]
    fn the_done_record_built_for_ifeq_is_what_complete_lua_writes() {
        let t = Token::from_bytes([9; 16]);
        for fp in [None, Some(Fingerprint::from_bytes([7; 32]))] {
            let mut v = processing_head(t, fp);
            v.extend_from_slice(b"42:600000:570000");
            let done = done_from_processing(&v, b'1', b"\x00{}").unwrap();
            let Record::Done {
                token,
                fence,
                result,
            } = decode(&done).unwrap()
            else {
                panic!("not DONE");
            };
            assert_eq!((token, fence, result.fingerprint), (t, 42, fp));
            assert_eq!(result.payload, b"\x00{}");
            let mut renewed = v.clone();
            set_margin(&mut renewed, 12);
            assert_eq!(processing_tail(&renewed).unwrap(), (42, 600_000, 12));
            let head = processing_head(t, fp);
            assert_eq!(processing_at(&head, 42, 600_000, 30_000), v);
        }
    }

    #[test]
    fn done_keeps_binary_payloads() {
        let mut v = b"D1".to_vec();
        v.extend_from_slice(&[3; 16]);
        v.push(b'-');
        v.extend_from_slice(b"12:2:");
        v.extend_from_slice(b"a:b\0\xff");
        assert_eq!(
            decode(&v).unwrap(),
            Record::Done {
                token: Token::from_bytes([3; 16]),
                fence: 12,
                result: StoredResult {
                    fingerprint: None,
                    outcome: StoredOutcome::FinalError,
                    payload: b"a:b\0\xff".to_vec(),
                },
            }
        );
    }

    #[test]
    fn anything_else_is_unreadable() {
        for v in [
            &b""[..],
            b"archived",
            b"P1short",
            b"D1xxxxxxxxxxxxxxxx-1:9:x",
            b"R1",
            b"R1x",
            b"Z1whatever",
        ] {
            assert!(decode(v).is_err(), "{:?}", String::from_utf8_lossy(v));
        }
        assert_eq!(decode(b"R17").unwrap(), Record::Released);
    }
}
