//! The config loader on generated and arbitrary text (stable proptest) and
//! on the committed corpus (`tests/corpus/config/`). Properties: no input
//! panics, and every line an error names is in the file; a config written
//! out (as JSON, which YAML reads) loads back equal; corpus files named
//! `ok-*` load, files named `bad-*` fail with the message their first line
//! gives (`# error: ...`), on the line it gives (`# line: N`), if any.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::config::{BackendConfig, PolicyKind, Secret, TierConfig};

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_text_never_panics_and_errors_point_inside(text in "(?s).{0,300}") {
        if let Err(e) = parse_str(&text, "x.yaml") {
            // YAML breaks lines at `\n`, `\r\n` and a lone `\r`.
            let lines = text.replace("\r\n", "\n").replace('\r', "\n").matches('\n').count() as u64 + 1;
            for p in &e.problems {
                prop_assert!(p.line.is_none_or(|l| l >= 1 && l <= lines), "{:?} in {} lines", p, lines);
            }
        }
    }

    #[test]
    fn yaml_shaped_text_never_panics(
        lines in proptest::collection::vec(
            ("( {0,4})", "[a-z_]{1,12}", prop_oneof![
                Just(String::new()), "[ -~]{0,12}", Just("[1, 2]".into()), Just("{a: 1}".into()),
                Just("30s".into()), Just("- x".into()),
            ]),
            0..20,
        ),
    ) {
        let text: String = lines
            .iter()
            .map(|(ind, k, v)| format!("{ind}{k}: {v}\n"))
            .collect();
        let _ = parse_str(&text, "x.yaml");
    }

    #[test]
    fn a_config_written_out_loads_back_equal(
        ports in proptest::collection::vec(1024u16..65535, 1..5),
        policy in prop_oneof![
            Just(PolicyKind::RoundRobin), Just(PolicyKind::LeastLoaded), Just(PolicyKind::PrefixKv),
        ],
        idle_ms in 1u64..600_000,
        retries in 0u32..5,
        rpm in proptest::option::of(1u32..100_000),
        kv_high in 0.5f64..1.0,
        redis_password in "[a-z0-9]{0,12}",
    ) {
        let backends = ports
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut b = BackendConfig::from_url(format!("http://10.0.0.{i}:{p}").parse().unwrap());
                b.models = vec![format!("model-{i}")];
                b
            })
            .collect();
        let mut c = Config {
            backends,
            ..Config::default()
        };
        c.routing.policy = policy;
        c.routing.prefix_kv.kv_high = Some(kv_high);
        c.upstream.timeouts.idle = Duration::from_millis(idle_ms);
        c.upstream.max_retries = retries;
        c.tiers.insert("free".into(), TierConfig { requests_per_minute: rpm, ..TierConfig::default() });
        let url = format!("redis://:{redis_password}@127.0.0.1:6379");
        c.rate_limits.redis.url = Secret::new(url.clone());
        c.routing.sessions.redis.url = Secret::new(url.clone());
        // Secrets print as `[redacted]`: put the real ones back in the text.
        let mut v = serde_json::to_value(&c).unwrap();
        v["rate_limits"]["redis"]["url"] = serde_json::Value::String(url.clone());
        v["routing"]["sessions"]["redis"]["url"] = serde_json::Value::String(url);
        let text = serde_json::to_string_pretty(&v).unwrap();
        let back = parse_str(&text, "x.json");
        prop_assert!(back.is_ok(), "{:?}\n{}", back.err().map(|e| e.to_string()), text);
        prop_assert_eq!(back.ok(), Some(c));
    }
}

#[test]
fn the_corpus_loads_or_fails_as_each_file_says() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/config");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    // The documented example config is part of the corpus.
    files.push(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/sluice.yaml"));
    let mut n = 0;
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let got = parse_str(&text, &name);
        if name.starts_with("bad-") {
            let want = text
                .lines()
                .find_map(|l| l.strip_prefix("# error: "))
                .unwrap_or_else(|| panic!("{name}: no `# error:` line"));
            let e = match got {
                Err(e) => e,
                Ok(_) => panic!("{name} loaded"),
            };
            let msg = e.to_string();
            assert!(msg.contains(want), "{name}: {msg}");
            if let Some(line) = text.lines().find_map(|l| l.strip_prefix("# line: ")) {
                assert!(msg.contains(&format!("{name}:{line}:")), "{name}: {msg}");
            }
        } else if let Err(e) = got {
            panic!("{name}: {e}");
        }
        // No file cut short after any of its lines panics.
        for (cut, _) in text.match_indices('\n') {
            let _ = parse_str(&text[..cut], &name);
        }
        n += 1;
    }
    assert!(n >= 6, "the corpus is in {}", dir.display());
}
