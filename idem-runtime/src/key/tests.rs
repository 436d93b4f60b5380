//! The encoding's injectivity, the keyed hashes and the key's text forms.

use super::part::{ENCODING_VERSION, tag};
use super::*;

use hmac::{Hmac, Mac};
use proptest::prelude::*;

type HmacSha256 = Hmac<Sha256>;

/// One key part of any supported shape.
#[derive(Debug, Clone)]
enum Part {
    U(u64),
    I(i64),
    B(bool),
    C(char),
    S(String),
    O(Option<String>),
    V(Vec<u32>),
}

/// What a part means, after the deliberate normalisation (every
/// non-negative integer is one integer, whatever its type).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decoded {
    UInt(u128),
    NegInt(i128),
    Bool(bool),
    Char(char),
    Str(String),
    None,
    Some(Box<Decoded>),
    Seq(Vec<Decoded>),
}

fn normalise(p: &Part) -> Decoded {
    match p {
        Part::U(v) => Decoded::UInt(u128::from(*v)),
        Part::I(v) if *v >= 0 => Decoded::UInt(*v as u128),
        Part::I(v) => Decoded::NegInt(i128::from(*v)),
        Part::B(v) => Decoded::Bool(*v),
        Part::C(v) => Decoded::Char(*v),
        Part::S(v) => Decoded::Str(v.clone()),
        Part::O(None) => Decoded::None,
        Part::O(Some(v)) => Decoded::Some(Box::new(Decoded::Str(v.clone()))),
        Part::V(v) => Decoded::Seq(v.iter().map(|x| Decoded::UInt(u128::from(*x))).collect()),
    }
}

fn encode(parts: &[Part]) -> Vec<u8> {
    let mut b = Key::builder("scope");
    for p in parts {
        match p {
            Part::U(v) => b.push(v),
            Part::I(v) => b.push(v),
            Part::B(v) => b.push(v),
            Part::C(v) => b.push(v),
            Part::S(v) => b.push(v),
            Part::O(v) => b.push(v),
            Part::V(v) => b.push(v),
        }
    }
    b.encoding().to_vec()
}

/// A decoder for the encoding: if it recovers every part list exactly,
/// no two different lists can share an encoding.
fn decode(mut buf: &[u8]) -> Vec<Decoded> {
    fn take<'a>(buf: &mut &'a [u8], n: usize) -> &'a [u8] {
        let (head, tail) = buf.split_at(n);
        *buf = tail;
        head
    }
    fn len(buf: &mut &[u8]) -> usize {
        u64::from_be_bytes(take(buf, 8).try_into().unwrap()) as usize
    }
    fn one(buf: &mut &[u8]) -> Decoded {
        match take(buf, 1)[0] {
            tag::UINT => Decoded::UInt(u128::from_be_bytes(take(buf, 16).try_into().unwrap())),
            tag::NEG_INT => Decoded::NegInt(i128::from_be_bytes(take(buf, 16).try_into().unwrap())),
            tag::BOOL => Decoded::Bool(take(buf, 1)[0] == 1),
            tag::CHAR => Decoded::Char(
                char::from_u32(u32::from_be_bytes(take(buf, 4).try_into().unwrap())).unwrap(),
            ),
            tag::STR => {
                let n = len(buf);
                Decoded::Str(String::from_utf8(take(buf, n).to_vec()).unwrap())
            }
            tag::NONE => Decoded::None,
            tag::SOME => Decoded::Some(Box::new(one(buf))),
            tag::SEQ => {
                let n = len(buf);
                Decoded::Seq((0..n).map(|_| one(buf)).collect())
            }
            t => panic!("unknown tag {t}"),
        }
    }
    assert_eq!(take(&mut buf, 1)[0], ENCODING_VERSION);
    assert_eq!(take(&mut buf, 1)[0], tag::SCOPE);
    let n = len(&mut buf);
    assert_eq!(take(&mut buf, n), b"scope");
    let mut out = Vec::new();
    while !buf.is_empty() {
        out.push(one(&mut buf));
    }
    out
}

fn part() -> impl Strategy<Value = Part> {
    prop_oneof![
        any::<u64>().prop_map(Part::U),
        any::<i64>().prop_map(Part::I),
        any::<bool>().prop_map(Part::B),
        any::<char>().prop_map(Part::C),
        // Separators and prefixes of each other are the interesting strings.
        "[a|b:,]{0,6}".prop_map(Part::S),
        proptest::option::of("[a|b]{0,4}").prop_map(Part::O),
        proptest::collection::vec(0u32..4, 0..4).prop_map(Part::V),
    ]
}

proptest! {
    #[test]
    fn encoding_decodes_to_exactly_the_parts(parts in proptest::collection::vec(part(), 0..6)) {
        let expected: Vec<Decoded> = parts.iter().map(normalise).collect();
        prop_assert_eq!(decode(&encode(&parts)), expected);
    }

    #[test]
    fn distinct_part_lists_never_share_a_key(
        a in proptest::collection::vec(part(), 0..5),
        b in proptest::collection::vec(part(), 0..5),
    ) {
        let same_meaning = a.iter().map(normalise).eq(b.iter().map(normalise));
        prop_assert_eq!(encode(&a) == encode(&b), same_meaning);
    }
}

fn secret(byte: u8) -> KeySecret {
    KeySecret::from_bytes(&[byte; 32]).unwrap()
}

fn keyed(secret: &KeySecret, parts: &[Part]) -> Key {
    let mut b = Key::keyed_builder("scope", secret);
    for p in parts {
        match p {
            Part::U(v) => b.push(v),
            Part::I(v) => b.push(v),
            Part::B(v) => b.push(v),
            Part::C(v) => b.push(v),
            Part::S(v) => b.push(v),
            Part::O(v) => b.push(v),
            Part::V(v) => b.push(v),
        }
    }
    b.finish()
}

proptest! {
    #[test]
    fn keyed_keys_are_as_distinct_as_their_parts(
        a in proptest::collection::vec(part(), 0..5),
        b in proptest::collection::vec(part(), 0..5),
    ) {
        let same_meaning = a.iter().map(normalise).eq(b.iter().map(normalise));
        let s = secret(0x5a);
        prop_assert_eq!(keyed(&s, &a) == keyed(&s, &b), same_meaning);
    }
}

#[test]
fn plain_keys_are_the_sha256_of_the_encoding() {
    let b = Key::builder("orders").part(&734211u64);
    let expected: [u8; 32] = Sha256::digest(b.encoding()).into();
    assert_eq!(b.finish().as_bytes(), &expected);
}

/// The encoding is built on the stack up to a size and on the heap past
/// it: a key that crosses over hashes every byte, in order.
#[test]
fn an_encoding_longer_than_the_inline_room_is_whole() {
    let long = "x".repeat(300);
    let b = Key::builder("orders").part(&1u8).part(long.as_str());
    // Version 1; the scope (tag 0x0a, its length, its bytes); the integer
    // (tag 0x01, 16 bytes big-endian); the string (tag 0x04, length, bytes).
    let mut expected = vec![1u8, 0x0a];
    expected.extend_from_slice(&6u64.to_be_bytes());
    expected.extend_from_slice(b"orders");
    expected.push(0x01);
    expected.extend_from_slice(&1u128.to_be_bytes());
    expected.push(0x04);
    expected.extend_from_slice(&300u64.to_be_bytes());
    expected.extend_from_slice(long.as_bytes());
    assert_eq!(b.encoding(), &expected[..]);
    let digest: [u8; 32] = Sha256::digest(&expected).into();
    assert_eq!(b.finish().as_bytes(), &digest);
}

#[test]
fn keyed_keys_are_the_hmac_sha256_of_the_encoding() {
    let raw = [0x5a; 32];
    let b = Key::keyed_builder("orders", &KeySecret::from_bytes(&raw).unwrap()).part(&734211u64);
    let mut mac = HmacSha256::new_from_slice(&raw).unwrap();
    mac.update(b.encoding());
    let expected: [u8; 32] = mac.finalize().into_bytes().into();
    let key = b.finish();
    assert_eq!(key.as_bytes(), &expected);
    assert_ne!(key, Key::builder("orders").part(&734211u64).finish());
}

#[test]
fn a_secret_gives_stable_keys_and_two_secrets_different_ones() {
    let (a, b) = (secret(1), secret(2));
    let parts = [Part::U(734211), Part::S("SKU-1".into())];
    assert_eq!(keyed(&a, &parts), keyed(&a, &parts));
    assert_eq!(keyed(&a, &parts), keyed(&a.clone(), &parts));
    assert_ne!(keyed(&a, &parts), keyed(&b, &parts));
    assert_ne!(a.id(), b.id());
}

#[test]
fn derived_keys_stay_keyed() {
    let plain = Key::builder("orders").part(&1u8).finish();
    let keyed = Key::keyed_builder("orders", &secret(3)).part(&1u8).finish();
    assert_ne!(keyed.derive("charge"), plain.derive("charge"));
    assert_ne!(
        keyed.derive_indexed("charge", 0),
        plain.derive_indexed("charge", 0)
    );
    let other = Key::keyed_builder("orders", &secret(4)).part(&1u8).finish();
    assert_ne!(keyed.derive("charge"), other.derive("charge"));
}

#[test]
fn fingerprints_are_keyed_too() {
    let plain = Fingerprint::builder().part(&100u32).finish();
    let a = Fingerprint::keyed_builder(&secret(1))
        .part(&100u32)
        .finish();
    assert_ne!(a, plain);
    assert_eq!(
        a,
        Fingerprint::keyed_builder(&secret(1))
            .part(&100u32)
            .finish()
    );
    assert_ne!(
        a,
        Fingerprint::keyed_builder(&secret(2))
            .part(&100u32)
            .finish()
    );
}

#[test]
fn the_secret_never_shows_in_debug_output() {
    let raw: Vec<u8> = (0xa0..0xc0).collect();
    let hex = hex::encode(&raw);
    let s = KeySecret::from_bytes(&raw).unwrap();
    let shown = [
        format!("{s:?}"),
        format!("{s:#?}"),
        format!("{:?}", Key::keyed_builder("orders", &s).part(&1u8)),
        format!("{:?}", Fingerprint::keyed_builder(&s).part(&1u8)),
    ];
    for shown in shown {
        assert!(shown.contains(&s.id()), "{shown}");
        assert!(!shown.contains(&hex[..8]), "the secret leaked: {shown}");
        assert!(!shown.contains("160, 161"), "the secret leaked: {shown}");
    }
}

#[test]
fn weak_or_malformed_secrets_are_refused_without_echoing_them() {
    let e = KeySecret::from_bytes(b"hunter2").unwrap_err();
    assert_eq!(e, KeySecretError::TooShort { len: 7 });
    assert!(!e.to_string().contains("hunter2"));
    let e = KeySecret::from_hex("zz-secret-zz").unwrap_err();
    assert_eq!(e, KeySecretError::NotHex);
    assert!(!e.to_string().contains("secret-zz"));
    assert!(KeySecret::from_hex(&format!("  {}\n", "ab".repeat(32))).is_ok());
    let e = KeySecret::from_env("IDEM_TEST_NO_SUCH_VARIABLE_FOR_KEY_SECRET").unwrap_err();
    assert!(matches!(e, KeySecretError::Missing { .. }), "{e}");
}

#[test]
fn joined_strings_do_not_collide() {
    let a = Key::builder("s").part("a|b").part("c").finish();
    let b = Key::builder("s").part("a").part("b|c").finish();
    assert_ne!(a, b);
}

#[test]
fn scope_separates_keys() {
    let a = Key::builder("orders").part(&1u8).finish();
    let b = Key::builder("refunds").part(&1u8).finish();
    assert_ne!(a, b);
}

#[test]
fn widening_an_integer_keeps_the_key() {
    let a = Key::builder("s").part(&5u32).finish();
    let b = Key::builder("s").part(&5u64).finish();
    let c = Key::builder("s").part(&5i64).finish();
    assert_eq!(a, b);
    assert_eq!(b, c);
    assert_ne!(c, Key::builder("s").part(&-5i64).finish());
}

#[test]
fn hex_round_trips_and_rejects_garbage() {
    let k = Key::builder("s").part("x").finish();
    assert_eq!(Key::from_hex(&k.to_hex()).unwrap(), k);
    let err = Key::from_hex("not-a-key").unwrap_err();
    assert!(err.to_string().contains("64 hexadecimal digits"));
}
