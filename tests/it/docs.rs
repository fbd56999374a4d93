//! The docs held to the code: every relative link and anchor in `README.md`
//! and `docs/*.md` resolves, and the generated references (the config keys
//! with their defaults, the metric families, the commands' `--help`) say what
//! the code says. `SLUICE_BLESS=1 cargo test --test it docs::` rewrites the
//! generated parts from the code (a config key's meaning is kept; a new key
//! gets an empty one, which this test then asks for).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn bless() -> bool {
    std::env::var("SLUICE_BLESS").is_ok_and(|v| v == "1")
}

const HOW: &str = "regenerate with `SLUICE_BLESS=1 cargo test --test it docs::`";

/// The byte range between `<!-- BEGIN GENERATED: what ... -->\n` and
/// `<!-- END GENERATED: what -->` in `text`.
fn region(text: &str, file: &str, what: &str) -> std::ops::Range<usize> {
    let begin = format!("<!-- BEGIN GENERATED: {what}");
    let start = text
        .find(&begin)
        .and_then(|i| text[i..].find("-->\n").map(|j| i + j + 4))
        .unwrap_or_else(|| panic!("{file} has no `{begin} ... -->` marker"));
    let end_marker = format!("<!-- END GENERATED: {what} -->");
    let end = text[start..]
        .find(&end_marker)
        .map(|j| start + j)
        .unwrap_or_else(|| panic!("{file} has no `{end_marker}` marker"));
    start..end
}

/// Compare a generated region with what the code makes now; rewrite it when
/// blessing, else fail naming the first line that differs.
fn hold(file: &str, what: &str, want: &str) {
    let text = read(file);
    let range = region(&text, file, what);
    let have = &text[range.clone()];
    if have == want {
        return;
    }
    if bless() {
        let mut new = text.clone();
        new.replace_range(range, want);
        std::fs::write(root().join(file), new).unwrap_or_else(|e| panic!("{file}: {e}"));
        return;
    }
    let first = have
        .lines()
        .zip(want.lines())
        .find(|(a, b)| a != b)
        .map(|(a, b)| format!("docs:  {a}\ncode:  {b}"))
        .unwrap_or_else(|| {
            format!(
                "{} lines in the docs, {} from the code",
                have.lines().count(),
                want.lines().count()
            )
        });
    panic!("{file}: the generated {what} differs from the code; {HOW}\n{first}");
}

// ---------------------------------------------------------------- config keys

/// Cells of a Markdown table row (`| a | b |`), `\|` kept inside a cell.
fn cells(row: &str) -> Vec<String> {
    let inner = row.trim().trim_start_matches('|').trim_end_matches('|');
    let mut out = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                out.last_mut().unwrap().push_str("\\|");
                chars.next();
            }
            '|' => out.push(String::new()),
            c => out.last_mut().unwrap().push(c),
        }
    }
    out.into_iter().map(|c| c.trim().to_string()).collect()
}

fn code_cell(s: &str) -> String {
    match s {
        "required" | "none" => s.to_string(),
        s => format!("`{s}`"),
    }
}

#[test]
fn the_configuration_reference_lists_every_key_with_the_codes_default() {
    let file = "docs/configuration.md";
    let what = "config keys";
    let keys = sluice::config::reference().unwrap();
    assert!(keys.len() > 100, "{keys:?}");
    let text = read(file);
    let range = region(&text, file, what);
    let mut meanings: BTreeMap<String, String> = BTreeMap::new();
    let mut documented = BTreeSet::new();
    for row in text[range].lines().filter(|l| l.starts_with("| `")) {
        let c = cells(row);
        let key = c[0].trim_matches('`').to_string();
        documented.insert(key.clone());
        meanings.insert(key, c.get(3).cloned().unwrap_or_default());
    }
    let mut table = String::from("| key | default | applied by | meaning |\n|---|---|---|---|\n");
    for k in &keys {
        table.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            k.key,
            code_cell(&k.default),
            if k.restart { "restart" } else { "reload" },
            meanings.get(&k.key).map(String::as_str).unwrap_or(""),
        ));
    }
    let in_code: BTreeSet<String> = keys.iter().map(|k| k.key.clone()).collect();
    let missing: Vec<&String> = in_code.difference(&documented).collect();
    let stale: Vec<&String> = documented.difference(&in_code).collect();
    if !bless() {
        assert!(
            missing.is_empty() && stale.is_empty(),
            "{file}: keys in the code but not documented: {missing:?}; documented but not in the code: {stale:?}; {HOW}"
        );
    }
    hold(file, what, &table);
    let unexplained: Vec<&str> = keys
        .iter()
        .filter(|k| meanings.get(&k.key).is_none_or(|m| m.is_empty()))
        .map(|k| k.key.as_str())
        .collect();
    assert!(
        unexplained.is_empty(),
        "{file}: write the meaning of {unexplained:?} in its table"
    );
}

// ------------------------------------------------------------------- metrics

#[test]
fn the_metrics_reference_lists_every_family_the_gateway_registers() {
    let table = sluice::telemetry::metrics::Metrics::reference_table();
    assert!(
        table.contains(
            "| `sluice_time_to_first_token_seconds` | histogram | model, endpoint, tier |"
        ),
        "{table}"
    );
    hold("docs/metrics.md", "metric families", &table);
}

// ------------------------------------------------------------------ commands

#[test]
fn the_commands_reference_is_their_help() {
    let mut out = String::new();
    for command in [
        "serve",
        "check-config",
        "demo",
        "sim",
        "bench",
        "diagnose",
        "top",
    ] {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([command, "--help"])
            .output()
            .unwrap();
        assert!(run.status.success(), "sluice {command} --help failed");
        let help = String::from_utf8(run.stdout).unwrap();
        out.push_str(&format!(
            "### `sluice {command}`\n\n```text\n{}\n```\n\n",
            help.trim_end()
        ));
    }
    hold("docs/commands.md", "help", &out);
}

// --------------------------------------------------------------------- links

/// `README.md` and `docs/*.md`, repository-relative.
fn markdown_files() -> Vec<String> {
    let mut files = vec!["README.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The lines of `text` outside fenced code blocks, with their numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// A line without its inline code spans (a link's syntax inside one is text).
fn without_code(line: &str) -> String {
    let mut out = String::new();
    let mut parts = line.split('`');
    let mut inside = false;
    for p in parts.by_ref() {
        if !inside {
            out.push_str(p);
        }
        inside = !inside;
    }
    out
}

/// Targets of the inline links and images on a line: `[text](target)`.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code(line);
    let mut out = Vec::new();
    let mut rest = line.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(end) = after.find(')') else { break };
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.trim_matches(|c| c == '<' || c == '>').to_string());
        rest = &after[end..];
    }
    out
}

/// A heading's anchor as GitHub makes it: the text lowercased, punctuation
/// other than `-` and `_` dropped, spaces turned into `-`.
fn slug(heading: &str) -> String {
    // The rendered text: links keep their text, code and emphasis marks go.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(i) = rest.find('[') {
        text.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        match (after.find("]("), after.find(')')) {
            (Some(close), Some(end)) if close < end => {
                text.push_str(&after[..close]);
                rest = &after[end + 1..];
            }
            _ => {
                text.push('[');
                rest = after;
            }
        }
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (repeats get `-1`, `-2`, ...).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let t = line.trim_start_matches('#');
        if t.len() == line.len() || !t.starts_with(' ') {
            continue;
        }
        let base = slug(t.trim());
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

#[test]
fn slugs_are_githubs() {
    assert_eq!(slug("SluiceTTFTHigh"), "sluicettfthigh");
    assert_eq!(
        slug("output_length_drift, latency_drift, throughput_drift"),
        "output_length_drift-latency_drift-throughput_drift"
    );
    assert_eq!(
        slug("Flow control: when the fleet is full"),
        "flow-control-when-the-fleet-is-full"
    );
    assert_eq!(slug("`sluice serve`"), "sluice-serve");
    assert_eq!(slug("Hot path vs nginx (CPU)"), "hot-path-vs-nginx-cpu");
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = read(&file);
        let dir = Path::new(&file).parent().unwrap_or(Path::new(""));
        for (n, line) in prose(&text) {
            for target in link_targets(line) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target.as_str(), None),
                };
                let resolved: PathBuf = if path.is_empty() {
                    PathBuf::from(&file)
                } else {
                    normalise(&dir.join(path))
                };
                if !root().join(&resolved).exists() {
                    broken.push(format!("{file}:{n}: {target}: no {}", resolved.display()));
                    continue;
                }
                let Some(anchor) = anchor else { continue };
                if resolved.extension().is_some_and(|e| e == "md") {
                    let target_text =
                        std::fs::read_to_string(root().join(&resolved)).unwrap_or_default();
                    if !anchors(&target_text).contains(anchor) {
                        broken.push(format!(
                            "{file}:{n}: {target}: no heading with anchor #{anchor} in {}",
                            resolved.display()
                        ));
                    }
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: is the parser right?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// `a/b/../c` as `a/c` (the path need not exist).
fn normalise(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

// ------------------------------------------------------------ the example

/// `config/sluice.yaml`, the documented example, names every key (set or in
/// a comment), so that a new key is shown where operators copy from.
#[test]
fn the_example_config_names_every_key() {
    let example = read("config/sluice.yaml");
    let missing: Vec<String> = sluice::config::reference()
        .unwrap()
        .into_iter()
        .map(|k| k.key)
        .filter(|key| {
            let last = key.rsplit('.').next().unwrap_or(key);
            !example.contains(&format!("{}:", last.trim_end_matches("[]")))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "config/sluice.yaml does not name {missing:?}"
    );
}
