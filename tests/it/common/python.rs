//! The Python interpreter the tests run (the official SDKs, the chart
//! tooling): `SLUICE_PYTHON` (scripts/test.sh sets it to the project's
//! `.venv`), else `.venv/bin/python` if it exists, else `python3`.

use std::path::Path;

pub fn python() -> String {
    if let Ok(p) = std::env::var("SLUICE_PYTHON") {
        return p;
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    if venv.exists() {
        return venv.display().to_string();
    }
    "python3".into()
}

/// What to say when it is missing.
pub const MISSING: &str =
    "Python with the test packages: run scripts/test.sh (it creates .venv and installs them)";
