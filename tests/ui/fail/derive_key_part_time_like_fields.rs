use idem_runtime::KeyPart;

#[derive(KeyPart)]
struct CreateOrder {
    user_id: u64,
    created_at: u64,
}

#[derive(KeyPart)]
enum Delivery {
    Redelivered { order_id: u64, delivery_attempt: u32 },
    Fresh { order_id: u64, request_id: String },
}

fn main() {}
