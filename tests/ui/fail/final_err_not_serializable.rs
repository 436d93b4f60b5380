use idem_runtime::idempotent;

#[derive(Debug)]
pub enum PayError {
    Declined,
    Idem(idem_runtime::Error),
}

impl From<idem_runtime::Error> for PayError {
    fn from(e: idem_runtime::Error) -> Self {
        PayError::Idem(e)
    }
}

impl PayError {
    fn is_final(&self) -> bool {
        matches!(self, PayError::Declined)
    }
}

#[idempotent(key = "order_id", final_err = PayError::is_final)]
async fn pay(order_id: u64) -> Result<u64, PayError> {
    Ok(order_id)
}

fn main() {}
