use idem_runtime::step;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[step("charge_item", key = "itme")]
async fn charge_item(item: u64) -> Result<u64, AppError> {
    Ok(item)
}

// `allow` exempts key segments: without a `key` it exempts nothing.
#[step("refund", allow = "refunded_at")]
async fn refund(item: u64) -> Result<u64, AppError> {
    Ok(item)
}

fn main() {}
