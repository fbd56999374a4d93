//! The metrics-text parser on generated expositions (stable proptest) and on
//! the committed corpus (`tests/corpus/metrics/`: each engine's real
//! exposition with the values it must yield, in `expect:` comment lines).
//! Properties: arbitrary text never panics; an exposition with any labels,
//! comments, timestamps and unrelated families yields exactly the sums and
//! maxima of the series routing reads.

use proptest::prelude::*;

use super::*;

fn label_block() -> impl Strategy<Value = String> {
    proptest::collection::vec(("[a-z_]{1,10}", "[a-zA-Z0-9_./:-]{0,16}"), 0..4).prop_map(|ls| {
        if ls.is_empty() {
            return String::new();
        }
        let inner: Vec<String> = ls.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        format!("{{{}}}", inner.join(","))
    })
}

fn number() -> impl Strategy<Value = f64> {
    prop_oneof![(0u32..10_000).prop_map(f64::from), (0.0f64..1.0)]
}

/// Lines that are not the series routing reads.
fn noise() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("# HELP vllm:num_requests_waiting Number of requests waiting.".to_string()),
        Just("# TYPE vllm:kv_cache_usage_perc gauge".to_string()),
        Just(String::new()),
        (label_block(), number())
            .prop_map(|(l, v)| format!("vllm:e2e_request_latency_seconds_bucket{l} {v}")),
        (label_block(), number())
            .prop_map(|(l, v)| format!("python_gc_objects_collected_total{l} {v}")),
        (label_block(), number())
            .prop_map(|(l, v)| format!("vllm:num_requests_waiting_by_reason{l} {v}")),
    ]
}

#[derive(Debug, Clone)]
enum Series {
    Waiting(String, f64),
    Running(String, f64),
    Kv(String, f64),
    Noise(String),
}

fn series() -> impl Strategy<Value = Series> {
    prop_oneof![
        (label_block(), number()).prop_map(|(l, v)| Series::Waiting(l, v)),
        (label_block(), number()).prop_map(|(l, v)| Series::Running(l, v)),
        (label_block(), 0.0f64..1.0).prop_map(|(l, v)| Series::Kv(l, v)),
        noise().prop_map(Series::Noise),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_text_never_panics(text in "(?s).{0,400}") {
        let _ = parse(&text, EngineKind::Auto, Instant::now());
        let _ = parse(&text, EngineKind::Vllm, Instant::now());
    }

    #[test]
    fn vllm_series_are_summed_or_maxed_whatever_their_labels(
        lines in proptest::collection::vec(series(), 0..20),
        timestamps in any::<bool>(),
    ) {
        let mut text = String::new();
        let (mut waiting, mut running, mut kv): (Option<f64>, Option<f64>, Option<f64>) =
            (None, None, None);
        let ts = if timestamps { " 1795299051000" } else { "" };
        for s in &lines {
            let line = match s {
                Series::Waiting(l, v) => {
                    waiting = Some(waiting.unwrap_or(0.0) + v);
                    format!("vllm:num_requests_waiting{l} {v}{ts}")
                }
                Series::Running(l, v) => {
                    running = Some(running.unwrap_or(0.0) + v);
                    format!("vllm:num_requests_running{l} {v}{ts}")
                }
                Series::Kv(l, v) => {
                    kv = Some(kv.map_or(*v, |k: f64| k.max(*v)));
                    format!("vllm:kv_cache_usage_perc{l} {v}{ts}")
                }
                Series::Noise(n) => n.clone(),
            };
            text.push_str(&line);
            text.push('\n');
        }
        let s = parse(&text, EngineKind::Auto, Instant::now());
        let close = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => (a - b).abs() <= 1e-9 * a.abs().max(1.0),
            (a, b) => a == b,
        };
        prop_assert!(close(s.waiting, waiting), "{:?} {:?}\n{}", s.waiting, waiting, text);
        prop_assert!(close(s.running, running), "{:?} {:?}", s.running, running);
        prop_assert!(close(s.kv_usage, kv), "{:?} {:?}", s.kv_usage, kv);
    }
}

/// Each corpus file says what it must yield: `# expect: field=value ...`
/// with fields engine, kv, waiting, running, block_size, num_blocks, hit_rate.
#[test]
fn the_corpus_yields_what_each_file_expects() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/metrics");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let s = parse(&text, EngineKind::Auto, Instant::now());
        let name = path.display();
        let expect = text
            .lines()
            .find_map(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{name} has no `# expect:` line"));
        for kv in expect.split_whitespace() {
            let (k, v) = kv.split_once('=').unwrap();
            let num = |x: Option<f64>| x.map(|x| format!("{x}")).unwrap_or("none".into());
            let got = match k {
                "engine" => s.engine.as_str().to_string(),
                "kv" => num(s.kv_usage),
                "waiting" => num(s.waiting),
                "running" => num(s.running),
                "block_size" => num(s.block_size.map(f64::from)),
                "num_blocks" => num(s.num_blocks.map(f64::from)),
                "hit_rate" => num(s.prefix_hit_rate),
                other => panic!("{name}: unknown field {other}"),
            };
            assert_eq!(got, v, "{name}: {k}");
        }
        // And no prefix of it panics or invents values.
        for cut in (0..text.len()).filter(|&i| text.is_char_boundary(i)) {
            let _ = parse(&text[..cut], EngineKind::Auto, Instant::now());
        }
        n += 1;
    }
    assert!(n >= 4, "the corpus is in {}", dir.display());
}
