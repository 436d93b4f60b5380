use idem_runtime::{Key, KeyPart};

// A settlement date is fixed per batch: the intent, not the time of a retry.
#[derive(KeyPart)]
struct Settlement {
    #[key_part(allow)]
    settle_date: String,
    merchant_id: u64,
    // Names that only contain the suspicious letters pass without `allow`.
    candidate_id: u64,
    update_count: u32,
}

fn main() {
    let s = Settlement {
        settle_date: "2024-05-01".into(),
        merchant_id: 7,
        candidate_id: 1,
        update_count: 2,
    };
    let _ = Key::builder("settle").part(&s).finish();
}
