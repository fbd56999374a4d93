//! The dependency tree, checked as `cargo deny` would check licences and
//! sources: every crate comes from crates.io, under a licence the project
//! accepts (SPDX expressions, `OR` satisfied by any side, `AND` by both).
//!
//! Why not `cargo deny` itself: the build on PyPI (0.14) panics on this
//! lockfile, and building the current one from crates.io costs CI several
//! minutes of its budget; security advisories need the RustSec database,
//! which these machines cannot fetch (no network beyond the registries), so
//! advisories are not checked here. What is checked: licences and sources,
//! from `cargo metadata --locked`, the same data `cargo deny` reads.

use std::collections::BTreeSet;
use std::process::Command;

/// Licences the project accepts for its dependencies (permissive ones).
const ALLOWED: &[&str] = &[
    "MIT",
    "Apache-2.0",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "ISC",
    "Zlib",
    "Unicode-3.0",
    "Unicode-DFS-2016",
    "BSL-1.0",
    "Unlicense",
    "CC0-1.0",
    "0BSD",
    // Permissive, for data: Mozilla's root certificates (webpki-root-certs,
    // under kube's rustls verifier on platforms without a system store).
    "CDLA-Permissive-2.0",
];

/// Whether an SPDX expression is satisfied by the allowed licences. Also
/// reads the old `A/B` form as `A OR B`; `X WITH exception` counts as `X`.
fn satisfied(expr: &str) -> bool {
    let spaced = expr
        .replace('/', " OR ")
        .replace('(', " ( ")
        .replace(')', " ) ");
    let tokens: Vec<&str> = spaced.split_whitespace().collect();
    let mut pos = 0;
    let ok = or_expr(&tokens, &mut pos);
    ok && pos == tokens.len()
}

fn or_expr(t: &[&str], pos: &mut usize) -> bool {
    let mut ok = and_expr(t, pos);
    while t.get(*pos) == Some(&"OR") {
        *pos += 1;
        ok |= and_expr(t, pos);
    }
    ok
}

fn and_expr(t: &[&str], pos: &mut usize) -> bool {
    let mut ok = atom(t, pos);
    while t.get(*pos) == Some(&"AND") {
        *pos += 1;
        ok &= atom(t, pos);
    }
    ok
}

fn atom(t: &[&str], pos: &mut usize) -> bool {
    match t.get(*pos) {
        Some(&"(") => {
            *pos += 1;
            let ok = or_expr(t, pos);
            assert_eq!(
                t.get(*pos),
                Some(&")"),
                "unbalanced licence expression {t:?}"
            );
            *pos += 1;
            ok
        }
        Some(id) => {
            *pos += 1;
            if t.get(*pos) == Some(&"WITH") {
                *pos += 2;
            }
            ALLOWED.contains(id)
        }
        None => false,
    }
}

#[test]
fn licence_expressions_are_read_as_spdx_means_them() {
    assert!(satisfied("MIT OR Apache-2.0"));
    assert!(satisfied("MIT/Apache-2.0"));
    assert!(satisfied("(MIT OR Apache-2.0) AND Unicode-3.0"));
    assert!(satisfied("Apache-2.0 WITH LLVM-exception OR MIT"));
    assert!(satisfied("MIT OR LGPL-2.1-or-later"));
    assert!(!satisfied("GPL-3.0"));
    assert!(!satisfied("MIT AND GPL-3.0"));
    assert!(!satisfied("(MIT OR Apache-2.0) AND AGPL-3.0"));
}

#[test]
fn every_dependency_is_from_crates_io_under_an_accepted_licence() {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut problems = BTreeSet::new();
    let mut n = 0;
    for p in meta["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        if name == env!("CARGO_PKG_NAME") {
            continue;
        }
        n += 1;
        let version = p["version"].as_str().unwrap();
        let source = p["source"].as_str().unwrap_or("");
        if source != "registry+https://github.com/rust-lang/crates.io-index" {
            problems.insert(format!(
                "{name} {version}: source `{source}` is not crates.io"
            ));
        }
        match p["license"].as_str() {
            Some(l) if satisfied(l) => {}
            Some(l) => {
                problems.insert(format!("{name} {version}: licence `{l}` is not accepted"));
            }
            None => {
                problems.insert(format!("{name} {version}: no SPDX licence"));
            }
        }
    }
    assert!(n > 100, "only {n} packages in the metadata");
    assert!(
        problems.is_empty(),
        "{}",
        problems.into_iter().collect::<Vec<_>>().join("\n")
    );
}
