use idem_runtime::idempotent;

type Result<T> = std::option::Option<T>;

#[idempotent(key = "order_id")]
async fn find(order_id: u64) -> Result<u64> {
    Some(order_id)
}

fn main() {}
