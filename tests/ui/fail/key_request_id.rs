use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

struct Transfer {
    account: String,
    request_id: String,
}

#[idempotent(key = "req.account|req.request_id")]
async fn transfer(req: Transfer) -> Result<String, AppError> {
    Ok(format!("{}{}", req.account, req.request_id))
}

fn main() {}
