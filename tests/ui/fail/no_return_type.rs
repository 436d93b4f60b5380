use idem_runtime::idempotent;

#[idempotent(key = "order_id")]
async fn refund(order_id: u64) {
    let _ = order_id;
}

fn main() {}
