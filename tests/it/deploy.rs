//! The Helm chart and the Dockerfile, checked without a cluster or a Docker
//! engine: rendered by Helm's own engine, validated against the Kubernetes API
//! schemas, the rendered config passed through this very binary's
//! `check-config`, the Dockerfile linted (tests/deploy/check_chart.py says
//! everything it asserts).

use std::path::Path;
use std::process::Command;

#[test]
fn the_chart_renders_valid_manifests_and_a_config_the_gateway_accepts() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(crate::common::python::python())
        .arg(root.join("tests/deploy/check_chart.py"))
        .arg(env!("CARGO_BIN_EXE_sluice"))
        .current_dir(root)
        .output()
        .expect(crate::common::python::MISSING);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "chart check failed:\n{text}");
    assert!(text.contains("chart and Dockerfile OK"), "{text}");
}
