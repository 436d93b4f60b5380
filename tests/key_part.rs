//! `#[derive(KeyPart)]`: the encoding it generates is injective per type, so
//! two different business values never share a key, and it is stable where
//! the README says it is (newtypes key like their field, field names are not
//! in the encoding).

use idem_runtime::{Key, KeyEncoder, KeyPart};
use proptest::prelude::*;

#[derive(Debug, Clone, KeyPart)]
struct Pair {
    a: String,
    b: String,
}

#[derive(Debug, Clone, KeyPart)]
struct Sku(u64);

#[derive(Debug, Clone, KeyPart)]
struct Line(String, Option<u32>, Vec<u8>);

#[derive(Debug, Clone, KeyPart)]
enum Target {
    Account { user_id: u64 },
    Card(String),
    Split(String, String),
    Anonymous,
    Nobody,
}

#[derive(Debug, Clone, KeyPart)]
struct Wrapped<T> {
    inner: T,
    tag: char,
}

#[derive(Debug, Clone, KeyPart)]
struct Unit;

#[derive(Debug, Clone, KeyPart)]
struct Settlement {
    // Fixed per settlement batch, so exempted from the name check.
    #[key_part(allow)]
    settle_date: String,
    batch_no: u32,
}

fn encoding<P: KeyPart + ?Sized>(p: &P) -> Vec<u8> {
    let mut enc = KeyEncoder::new();
    p.encode_key(&mut enc);
    enc.as_bytes().to_vec()
}

fn key<P: KeyPart + ?Sized>(p: &P) -> Key {
    Key::builder("key_part").part(p).finish()
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        any::<u64>().prop_map(|user_id| Target::Account { user_id }),
        "[ab|]{0,3}".prop_map(Target::Card),
        ("[ab|]{0,3}", "[ab|]{0,3}").prop_map(|(a, b)| Target::Split(a, b)),
        Just(Target::Anonymous),
        Just(Target::Nobody),
    ]
}

/// The value a `Target` stands for, as plain data to compare.
fn target_repr(t: &Target) -> (u8, u64, String, String) {
    match t {
        Target::Account { user_id } => (0, *user_id, String::new(), String::new()),
        Target::Card(c) => (1, 0, c.clone(), String::new()),
        Target::Split(a, b) => (2, 0, a.clone(), b.clone()),
        Target::Anonymous => (3, 0, String::new(), String::new()),
        Target::Nobody => (4, 0, String::new(), String::new()),
    }
}

proptest! {
    // Separators and prefixes of each other are the strings that collide under
    // a joined encoding: ("a|b", "c") against ("a", "b|c").
    #[test]
    fn structs_of_two_strings_never_share_a_key(
        a1 in "[ab|]{0,4}", b1 in "[ab|]{0,4}", a2 in "[ab|]{0,4}", b2 in "[ab|]{0,4}",
    ) {
        let (x, y) = (Pair { a: a1.clone(), b: b1.clone() }, Pair { a: a2.clone(), b: b2.clone() });
        prop_assert_eq!((a1, b1) == (a2, b2), encoding(&x) == encoding(&y));
        prop_assert_eq!(encoding(&x) == encoding(&y), key(&x) == key(&y));
    }

    #[test]
    fn enum_values_never_share_a_key(x in target(), y in target()) {
        prop_assert_eq!(target_repr(&x) == target_repr(&y), encoding(&x) == encoding(&y));
    }

    #[test]
    fn tuple_structs_never_share_a_key(
        x in ("[ab]{0,3}", proptest::option::of(0u32..3), proptest::collection::vec(0u8..3, 0..3)),
        y in ("[ab]{0,3}", proptest::option::of(0u32..3), proptest::collection::vec(0u8..3, 0..3)),
    ) {
        let (lx, ly) = (Line(x.0.clone(), x.1, x.2.clone()), Line(y.0.clone(), y.1, y.2.clone()));
        prop_assert_eq!(x == y, encoding(&lx) == encoding(&ly));
    }

    // Sequences of derived values stay injective: each value's encoding is
    // prefix-free, so a list of them decodes one way only.
    #[test]
    fn lists_of_derived_values_never_share_a_key(
        x in proptest::collection::vec(target(), 0..4),
        y in proptest::collection::vec(target(), 0..4),
    ) {
        let rx: Vec<_> = x.iter().map(target_repr).collect();
        let ry: Vec<_> = y.iter().map(target_repr).collect();
        prop_assert_eq!(rx == ry, key(&x) == key(&y));
    }
}

#[test]
fn a_newtype_keys_like_the_value_it_wraps() {
    assert_eq!(key(&Sku(42)), key(&42u64));
    assert_ne!(key(&Sku(42)), key(&43u64));
}

#[test]
fn a_struct_is_its_field_count_then_its_fields_in_order() {
    let mut enc = KeyEncoder::new();
    enc.write_seq_len(2);
    enc.write_str("x");
    enc.write_str("y");
    let pair = Pair {
        a: "x".into(),
        b: "y".into(),
    };
    assert_eq!(encoding(&pair), enc.as_bytes());
}

#[test]
fn an_enum_is_its_variant_name_then_its_fields() {
    let mut enc = KeyEncoder::new();
    enc.write_str("Account");
    enc.write_seq_len(1);
    enc.write_uint(7);
    assert_eq!(encoding(&Target::Account { user_id: 7 }), enc.as_bytes());
    // Two unit variants differ by name alone.
    assert_ne!(encoding(&Target::Anonymous), encoding(&Target::Nobody));
}

#[test]
fn generic_and_unit_and_allowed_fields_derive() {
    let w = Wrapped {
        inner: Sku(1),
        tag: 'x',
    };
    let v = Wrapped {
        inner: Sku(2),
        tag: 'x',
    };
    assert_ne!(key(&w), key(&v));
    assert_eq!(encoding(&Unit), {
        let mut enc = KeyEncoder::new();
        enc.write_seq_len(0);
        enc.as_bytes().to_vec()
    });
    let s = Settlement {
        settle_date: "2024-05-01".into(),
        batch_no: 3,
    };
    assert_ne!(
        key(&s),
        key(&Settlement {
            settle_date: "2024-05-02".into(),
            batch_no: 3
        })
    );
}
