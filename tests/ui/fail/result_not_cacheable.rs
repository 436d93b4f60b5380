use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Order {
    pub id: u64,
}

#[idempotent(key = "order_id")]
async fn load(order_id: u64) -> Result<Order, AppError> {
    Ok(Order { id: order_id })
}

fn main() {}
