use idem_runtime::step;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

// A step keyed on a time changes its key on every retry: the retry never finds
// the call's record and charges again.
#[step("charge_item", key = "item.sku|item.added_at")]
async fn charge_item(item: Item) -> Result<u64, AppError> {
    Ok(item.sku)
}

struct Item {
    sku: u64,
    added_at: u64,
}

fn main() {}
