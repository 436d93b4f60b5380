use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

struct CreateOrder {
    user_id: u64,
    created_at: u64,
}

#[idempotent(key = "req.user_id|req.created_at")]
async fn create_order(req: CreateOrder) -> Result<u64, AppError> {
    Ok(req.user_id + req.created_at)
}

fn main() {}
