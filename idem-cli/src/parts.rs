//! Key parts typed on the command line, encoded exactly as the attribute
//! encodes the Rust values they name.
//!
//! The attribute hashes each part with its type's tag, so `"734211"` (a
//! string) and `734211` (an integer) are different keys: the operator must
//! say which one the handler's field is. Every integer type shares one
//! encoding (`u32:7` and `u64:7` are the same part), but the value is checked
//! against the type named.

use idem_runtime::{KeyEncoder, KeyPart};

/// One part, as `TYPE:VALUE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Uint(u128),
    Int(i128),
    Bool(bool),
    Char(char),
    Str(String),
    Bytes(Vec<u8>),
    None,
    Some(Box<Part>),
}

pub const TYPES: &str = "u8 u16 u32 u64 u128 usize i8 i16 i32 i64 i128 isize bool char str bytes (hex) none some:TYPE:VALUE";

impl KeyPart for Part {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        match self {
            Part::Uint(v) => enc.write_uint(*v),
            Part::Int(v) => enc.write_int(*v),
            Part::Bool(v) => enc.write_bool(*v),
            Part::Char(v) => enc.write_char(*v),
            Part::Str(v) => enc.write_str(v),
            Part::Bytes(v) => enc.write_bytes(v),
            Part::None => enc.write_none(),
            Part::Some(inner) => {
                enc.write_some();
                inner.encode_key(enc);
            }
        }
    }
}

/// Parses `TYPE:VALUE` (the value is everything after the first colon, so a
/// string may hold colons).
pub fn parse(arg: &str) -> Result<Part, String> {
    let (ty, value) = match arg.split_once(':') {
        Some((ty, value)) => (ty, value),
        None if arg == "none" => return Ok(Part::None),
        None => {
            return Err(format!(
                "part {arg:?} has no type: write TYPE:VALUE, e.g. u64:734211 or str:A-1 (types: {TYPES})"
            ));
        }
    };
    macro_rules! number {
        ($t:ty, $variant:ident, $wide:ty) => {
            value
                .parse::<$t>()
                .map(|v| Part::$variant(<$wide>::try_from(v).expect("widening")))
                .map_err(|e| format!("part {arg:?}: {value:?} is not a {}: {e}", stringify!($t)))
        };
    }
    match ty {
        "u8" => number!(u8, Uint, u128),
        "u16" => number!(u16, Uint, u128),
        "u32" => number!(u32, Uint, u128),
        "u64" => number!(u64, Uint, u128),
        "u128" => number!(u128, Uint, u128),
        "usize" => number!(usize, Uint, u128),
        "i8" => number!(i8, Int, i128),
        "i16" => number!(i16, Int, i128),
        "i32" => number!(i32, Int, i128),
        "i64" => number!(i64, Int, i128),
        "i128" => number!(i128, Int, i128),
        "isize" => number!(isize, Int, i128),
        "bool" => match value {
            "true" => Ok(Part::Bool(true)),
            "false" => Ok(Part::Bool(false)),
            _ => Err(format!("part {arg:?}: a bool is true or false")),
        },
        "char" => {
            let mut chars = value.chars();
            match (chars.next(), chars.next()) {
                (Some(c), None) => Ok(Part::Char(c)),
                _ => Err(format!("part {arg:?}: a char is exactly one character")),
            }
        }
        "str" | "string" | "String" => Ok(Part::Str(value.to_owned())),
        "bytes" => hex::decode(value)
            .map(Part::Bytes)
            .map_err(|e| format!("part {arg:?}: bytes are written in hex: {e}")),
        "none" if value.is_empty() => Ok(Part::None),
        "some" => parse(value).map(|inner| Part::Some(Box::new(inner))),
        _ => Err(format!(
            "part {arg:?}: unknown type {ty:?} (types: {TYPES})"
        )),
    }
}

#[cfg(test)]
mod tests {
    use idem_runtime::Key;

    use super::*;

    fn key(parts: &[&str]) -> Key {
        let mut b = Key::builder("s");
        for p in parts {
            b.push(&parse(p).unwrap());
        }
        b.finish()
    }

    #[test]
    fn parts_hash_as_the_rust_values_do() {
        assert_eq!(
            key(&["u64:734211", "str:A-1"]),
            Key::builder("s").part(&734211u64).part("A-1").finish()
        );
        assert_eq!(
            key(&["i64:-5", "bool:true", "char:é", "str:a:b"]),
            Key::builder("s")
                .part(&-5i64)
                .part(&true)
                .part(&'é')
                .part("a:b")
                .finish()
        );
        assert_eq!(
            key(&["some:u32:7", "none", "bytes:00ff"]),
            Key::builder("s")
                .part(&Some(7u32))
                .part(&None::<String>)
                .part(&KeyBytes(vec![0, 0xff]))
                .finish()
        );
        assert_ne!(key(&["str:734211"]), key(&["u64:734211"]));
    }

    struct KeyBytes(Vec<u8>);
    impl KeyPart for KeyBytes {
        fn encode_key(&self, enc: &mut KeyEncoder) {
            enc.write_bytes(&self.0);
        }
    }

    #[test]
    fn bad_parts_say_why() {
        assert!(parse("734211").unwrap_err().contains("no type"));
        assert!(parse("u8:300").unwrap_err().contains("not a u8"));
        assert!(parse("float:1.5").unwrap_err().contains("unknown type"));
        assert!(parse("bool:yes").is_err());
    }
}
