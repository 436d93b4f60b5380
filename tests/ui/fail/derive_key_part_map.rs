use std::collections::{BTreeMap, HashMap};

use idem_runtime::KeyPart;

#[derive(KeyPart)]
struct Request {
    order_id: u64,
    headers: HashMap<String, String>,
}

#[derive(KeyPart)]
enum Batch {
    Items(BTreeMap<String, u32>),
}

fn main() {}
