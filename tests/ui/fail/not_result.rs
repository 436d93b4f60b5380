use idem_runtime::idempotent;

#[idempotent(key = "order_id")]
async fn refund(order_id: u64) -> Option<u64> {
    Some(order_id)
}

fn main() {}
