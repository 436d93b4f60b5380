use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

// The body moves into the expansion token for token: a type error in it must
// point at the user's line, not at the attribute.
#[idempotent(key = "order_id")]
async fn total(order_id: u64) -> Result<u64, AppError> {
    let label: u64 = "not a number";
    Ok(order_id + label)
}

fn main() {}
