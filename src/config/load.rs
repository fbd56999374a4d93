//! Reading a config file: decode with field paths and lines, then validate.

use std::fmt;
use std::path::Path;

use super::{Config, validate};

/// Everything wrong with a config, each problem naming its key and, where it can
/// be found, its line.
#[derive(Debug)]
pub struct ConfigError {
    pub file: String,
    pub problems: Vec<Problem>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key path, e.g. `backends[0].url`; empty for whole-document errors.
    pub path: String,
    pub line: Option<u64>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}", self.file)?;
            if let Some(line) = p.line {
                write!(f, ":{line}")?;
            }
            if p.path.is_empty() {
                write!(f, ": {}", p.message)?;
            } else {
                write!(f, ": `{}`: {}", p.path, p.message)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Read and check a config file.
pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
    load_file_with(path, |_| {})
}

/// Read a config file, apply `adjust` (command-line overrides), then check
/// the result: the one validation of a load, with lines from the file.
pub fn load_file_with(
    path: &Path,
    adjust: impl FnOnce(&mut Config),
) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: file.clone(),
        problems: vec![Problem {
            path: String::new(),
            line: None,
            message: format!("cannot read: {e}"),
        }],
    })?;
    parse_str_with(&text, &file, adjust)
}

/// Decode and validate config text; `file` only names the source in errors.
pub fn parse_str(text: &str, file: &str) -> Result<Config, ConfigError> {
    parse_str_with(text, file, |_| {})
}

/// Decode config text, apply `adjust`, validate once.
pub fn parse_str_with(
    text: &str,
    file: &str,
    adjust: impl FnOnce(&mut Config),
) -> Result<Config, ConfigError> {
    let fail = |problems| ConfigError {
        file: file.to_string(),
        problems,
    };
    // An empty document (or only comments) is the all-defaults config.
    let mut config = if text.lines().all(|l| {
        let t = l.trim();
        t.is_empty() || t.starts_with('#') || t == "---"
    }) {
        Config::default()
    } else {
        let mut path = String::new();
        let decoded = serde_saphyr::with_deserializer_from_str(text, |de| {
            serde_path_to_error::deserialize(de).map_err(|e| {
                path = e.path().to_string();
                e.into_inner()
            })
        });
        match decoded {
            Ok(c) => c,
            Err(e) => {
                let line = e.location().map(|l| l.line()).filter(|l| *l > 0);
                let path = if path == "." { String::new() } else { path };
                let line = line.or_else(|| locate(text, &path));
                let message = e.without_snippet().to_string();
                // The decoder's message may repeat the location; keep the first line.
                let message = message.lines().next().unwrap_or_default().to_string();
                return Err(fail(vec![Problem {
                    path,
                    line,
                    message,
                }]));
            }
        }
    };
    adjust(&mut config);
    let problems: Vec<Problem> = validate(&config)
        .into_iter()
        .map(|inv| Problem {
            line: locate(text, &inv.path),
            path: inv.path,
            message: inv.message,
        })
        .collect();
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(fail(problems))
    }
}

/// The 1-based line of a dotted key path (`a.b[2].c`) in block-style YAML, found
/// by walking indentation. Flow-style sections are not searched; `None` then.
pub(crate) fn locate(text: &str, path: &str) -> Option<u64> {
    if path.is_empty() {
        return None;
    }
    let lines: Vec<&str> = text.lines().collect();
    let content = |i: usize| {
        let t = lines[i].trim_start();
        !t.is_empty() && !t.starts_with('#')
    };
    // The window of lines holding the current node's children.
    let (mut start, mut end) = (0usize, lines.len());
    let mut found = None;
    for seg in split_path(path) {
        let (hit, col) = match seg {
            Seg::Key(key) => (start..end)
                .filter(|&i| content(i))
                .filter_map(|i| {
                    let (col, rest) = key_part(lines[i]);
                    let named = rest.strip_prefix(key).is_some_and(|r| r.starts_with(':'))
                        || rest
                            .strip_prefix(&format!("\"{key}\""))
                            .is_some_and(|r| r.starts_with(':'));
                    named.then_some((i, col))
                })
                .min_by_key(|&(i, col)| (col, i))?,
            Seg::Index(n) => {
                let items: Vec<usize> = (start..end)
                    .filter(|&i| content(i))
                    .filter(|&i| {
                        let t = lines[i].trim_start();
                        t.starts_with("- ") || t == "-"
                    })
                    .collect();
                let seq_indent = items.iter().map(|&i| indent(lines[i])).min()?;
                let i = items
                    .into_iter()
                    .filter(|&i| indent(lines[i]) == seq_indent)
                    .nth(n)?;
                (i, seq_indent)
            }
        };
        found = Some(hit);
        let next = (hit + 1..end)
            .find(|&i| content(i) && indent(lines[i]) <= col)
            .unwrap_or(end);
        // A list item's first key sits on the item's own line, after `- `.
        start = if let Seg::Index(_) = seg {
            hit
        } else {
            hit + 1
        };
        end = next;
    }
    found.map(|i| i as u64 + 1)
}

/// The column where a line's key starts (after any `- `) and the text from there.
fn key_part(line: &str) -> (usize, &str) {
    let ind = indent(line);
    let t = &line[ind..];
    match t.strip_prefix("- ") {
        Some(rest) => (ind + 2, rest),
        None => (ind, t),
    }
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

enum Seg<'a> {
    Key(&'a str),
    Index(usize),
}

fn split_path(path: &str) -> Vec<Seg<'_>> {
    let mut out = Vec::new();
    for part in path.split('.') {
        let (key, rest) = part.split_once('[').unwrap_or((part, ""));
        if !key.is_empty() {
            out.push(Seg::Key(key));
        }
        for idx in rest.split('[') {
            if let Ok(n) = idx.trim_end_matches(']').parse() {
                out.push(Seg::Index(n));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "\
server:
  listen: 0.0.0.0:8080
backends:
  - url: http://a:8000
  - url: http://b:8000
    name: b
models:
  aliases:
    gpt: llama
";

    #[test]
    fn locates_keys_and_list_items() {
        assert_eq!(locate(DOC, "server.listen"), Some(2));
        assert_eq!(locate(DOC, "backends[0].url"), Some(4));
        assert_eq!(locate(DOC, "backends[1].url"), Some(5));
        assert_eq!(locate(DOC, "backends[1].name"), Some(6));
        assert_eq!(locate(DOC, "models.aliases.gpt"), Some(9));
        assert_eq!(locate(DOC, "nope"), None);
    }

    #[test]
    fn decode_errors_name_key_and_line() {
        let err = parse_str(
            "server:\n  listen: 0.0.0.0:8080\n  drain_timeout: soon\n",
            "x.yaml",
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(err.starts_with("x.yaml:3: `server.drain_timeout`"), "{err}");
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = parse_str("server:\n  listn: 1.2.3.4:5\n", "x.yaml")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("listn"), "{err}");
        assert!(err.contains(":2"), "{err}");
    }

    #[test]
    fn validation_errors_name_key_and_line() {
        let err = parse_str(DOC.replace("http://b", "ftp://b").as_str(), "x.yaml")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("x.yaml:5: `backends[1].url`"), "{err}");
    }

    #[test]
    fn empty_file_is_defaults() {
        assert!(parse_str("# nothing\n", "x.yaml").is_ok());
    }
}

#[cfg(test)]
mod prop;
