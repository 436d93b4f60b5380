use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

struct OrderPaid {
    order_id: u64,
    delivery_count: u32,
    redelivered: bool,
}

// A broker's delivery counter grows with every redelivery of the same message.
#[idempotent(scope = "settle", consumer, key = "e.order_id|e.delivery_count")]
async fn settle(e: OrderPaid) -> Result<u64, AppError> {
    Ok(e.order_id + u64::from(e.delivery_count))
}

// The redelivery flag is false on the first delivery and true on the next.
#[idempotent(scope = "ship", consumer, key = "e.order_id|e.redelivered")]
async fn ship(e: OrderPaid) -> Result<u64, AppError> {
    Ok(e.order_id + u64::from(e.redelivered))
}

// Client-side retry counters, as parameters, in several spellings.
#[idempotent(key = "order_id|retry_count")]
async fn charge(order_id: u64, retry_count: u32) -> Result<u64, AppError> {
    Ok(order_id + u64::from(retry_count))
}

#[idempotent(key = "order_id|attempt")]
async fn refund(order_id: u64, attempt: u32) -> Result<u64, AppError> {
    Ok(order_id + u64::from(attempt))
}

#[idempotent(key = "order_id|numRetries")]
#[allow(non_snake_case)]
async fn cancel(order_id: u64, numRetries: u32) -> Result<u64, AppError> {
    Ok(order_id + u64::from(numRetries))
}

#[idempotent(key = "order_id|attempt_no")]
async fn notify(order_id: u64, attempt_no: u32) -> Result<u64, AppError> {
    Ok(order_id + u64::from(attempt_no))
}

fn main() {}
