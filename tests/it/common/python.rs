//! The Python interpreter the tests run (the official SDKs, the chart
//! tooling): `SLUICE_PYTHON` (scripts/test.sh sets it to the project's
//! `.venv`), else `.venv/bin/python` if it exists, else `python3`.

use std::path::Path;

pub fn python() -> String {
    if let Some(p) = std::env::var_os("SLUICE_PYTHON").filter(|p| !p.is_empty()) {
        return p.to_string_lossy().into_owned();
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    if venv.exists() {
        return venv.display().to_string();
    }
    "python3".into()
}

/// What to say when it cannot be run.
pub const MISSING: &str = "cannot run Python ($SLUICE_PYTHON, .venv/bin/python or python3): \
     run scripts/test.sh, which creates .venv with the test packages";
