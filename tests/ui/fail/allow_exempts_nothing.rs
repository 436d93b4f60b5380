use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

struct Batch {
    merchant_id: u64,
    settle_date: String,
}

// A typo in `allow` must not pass silently: it exempts nothing today and would
// exempt a field of that name added tomorrow.
#[idempotent(key = "b.merchant_id|b.settle_date", allow = "settle_date|setle_date")]
async fn settle(b: Batch) -> Result<u64, AppError> {
    Ok(b.merchant_id)
}

fn main() {}
