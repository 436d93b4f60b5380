use idem_runtime::step;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

// Not a path: an error, as for `#[idempotent]`, not a silent fall back to `::idem_runtime`.
#[step("deduct_stock", crate = "1 + 2")]
async fn deduct_stock(sku: u64) -> Result<u64, AppError> {
    Ok(sku)
}

fn main() {}
