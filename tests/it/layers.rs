//! The module graph reads bottom-up: each top-level module imports only from
//! modules of lower layers, and within a folder the files do not import each
//! other in a cycle (a folder's `mod.rs` is the module itself: its files may
//! use it). A change that imports upward fails here with the file and the
//! import that broke the rule. Test modules (after `#[cfg(test)]`) are not
//! held to it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Bottom to top. A module may import from modules of strictly lower layers
/// only, so two modules of one layer never import each other.
const LAYERS: &[&[&str]] = &[
    &["vocab", "headers", "turn"],
    &["tokens", "term"],
    &["config"],
    &["error", "net"],
    &["telemetry"],
    &["limits", "upstream"],
    &["routing", "doctor"],
    &["flow"],
    &["request"],
    &["stream"],
    &["state"],
    &["api"],
    &["app", "epp"],
    &["server"],
    &["sim", "bench", "top"],
    &["cli"],
    &["demo"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without comments and without the items marked
/// `#[cfg(test)]` (a test module is skipped to its closing brace).
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut skip_next = false;
    // Brace depth inside a skipped item; `None` when not skipping.
    let mut skipping: Option<i64> = None;
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(depth) = skipping.as_mut() {
            *depth += t.matches('{').count() as i64 - t.matches('}').count() as i64;
            if *depth <= 0 {
                skipping = None;
            }
            continue;
        }
        if t.starts_with("#[cfg(test)]") {
            skip_next = true;
            continue;
        }
        if t.starts_with("//") || t.is_empty() {
            continue;
        }
        if skip_next {
            skip_next = false;
            let depth = t.matches('{').count() as i64 - t.matches('}').count() as i64;
            if depth > 0 {
                skipping = Some(depth);
            }
            continue;
        }
        // A trailing comment (the code here has no ` // ` inside strings that
        // matter to imports).
        let line = match line.find(" // ") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Identifiers following `prefix` in `code`: `prefix::a`, `prefix::{a, b::c}`.
fn after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().last();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

struct File {
    path: String,
    top: String,
    /// The file's name inside its folder (`None` for `mod.rs` and top-level files).
    sibling: Option<String>,
    code: String,
}

fn files() -> Vec<File> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    rust_files(&src, &mut paths);
    paths
        .into_iter()
        .filter_map(|p| {
            let rel = p.strip_prefix(&src).unwrap().to_path_buf();
            let parts: Vec<String> = rel
                .iter()
                .map(|s| s.to_string_lossy().trim_end_matches(".rs").to_string())
                .collect();
            if parts.len() == 1 && matches!(parts[0].as_str(), "lib" | "main") {
                return None;
            }
            let top = parts[0].clone();
            let sibling = (parts.len() == 2 && parts[1] != "mod").then(|| parts[1].clone());
            Some(File {
                path: rel.display().to_string(),
                top,
                sibling,
                code: code(&std::fs::read_to_string(&p).unwrap()),
            })
        })
        .collect()
}

#[test]
fn modules_import_only_from_lower_layers() {
    let files = files();
    let mut problems = Vec::new();
    for f in &files {
        let Some(mine) = layer_of(&f.top) else {
            problems.push(format!(
                "{}: module `{}` has no layer in LAYERS",
                f.path, f.top
            ));
            continue;
        };
        for used in after(&f.code, "crate::") {
            if used == f.top {
                continue;
            }
            match layer_of(&used) {
                Some(l) if l < mine => {}
                Some(_) => problems.push(format!(
                    "{}: `{}` (layer {mine}) imports `crate::{used}`, which is not below it",
                    f.path, f.top
                )),
                None => problems.push(format!(
                    "{}: imports `crate::{used}`, which is not a layered module",
                    f.path
                )),
            }
        }
    }
    assert!(
        problems.is_empty(),
        "upward imports:\n{}",
        problems.join("\n")
    );
}

#[test]
fn files_of_a_module_do_not_import_each_other_in_a_cycle() {
    let files = files();
    // folder -> file -> the sibling files it uses.
    let mut graph: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let siblings: BTreeMap<String, BTreeSet<String>> =
        files.iter().fold(BTreeMap::new(), |mut m, f| {
            if let Some(s) = &f.sibling {
                m.entry(f.top.clone()).or_default().insert(s.clone());
            }
            m
        });
    for f in &files {
        let Some(me) = &f.sibling else { continue };
        let known = &siblings[&f.top];
        let mut uses: BTreeSet<String> = after(&f.code, "super::");
        uses.extend(after(&f.code, &format!("crate::{}::", f.top)));
        let uses = uses
            .into_iter()
            .filter(|u| known.contains(u) && u != me)
            .collect();
        graph
            .entry(f.top.clone())
            .or_default()
            .insert(me.clone(), uses);
    }
    let mut cycles = Vec::new();
    for (folder, g) in &graph {
        // Depth-first search for a back edge.
        fn visit(
            n: &str,
            g: &BTreeMap<String, BTreeSet<String>>,
            path: &mut Vec<String>,
            done: &mut BTreeSet<String>,
            found: &mut Vec<String>,
        ) {
            if let Some(i) = path.iter().position(|p| p == n) {
                found.push(format!("{} -> {n}", path[i..].join(" -> ")));
                return;
            }
            if !done.insert(n.to_string()) {
                return;
            }
            path.push(n.to_string());
            for m in g.get(n).into_iter().flatten() {
                visit(m, g, path, done, found);
            }
            path.pop();
        }
        let mut done = BTreeSet::new();
        for n in g.keys() {
            let mut found = Vec::new();
            visit(n, g, &mut Vec::new(), &mut done, &mut found);
            cycles.extend(found.into_iter().map(|c| format!("{folder}: {c}")));
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_checker_sees_imports_in_every_form() {
    let c = code(
        "use crate::a::b;\nuse super::{x, y::z};\n// use crate::hidden;\nlet v = crate::c::f(); // crate::d\n#[cfg(test)]\nuse crate::e;\n#[cfg(test)]\nmod tests {\n    use crate::f;\n    fn g() {\n    }\n}\nfn h() -> crate::g::T {}\n",
    );
    assert_eq!(
        after(&c, "crate::"),
        ["a", "c", "g"].map(String::from).into()
    );
    assert_eq!(after(&c, "super::"), ["x", "y"].map(String::from).into());
}
