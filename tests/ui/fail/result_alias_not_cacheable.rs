use idem_runtime::idempotent;

#[idempotent(key = "path")]
async fn read_len(path: String) -> std::io::Result<u64> {
    Ok(path.len() as u64)
}

fn main() {}
