//! Every config key, its default and whether a reload applies it, read from
//! the typed tree itself (serde's view of it): the reference table of
//! `docs/configuration.md` is held to this, and `Gateway::reload` refuses the
//! keys listed in [`RESTART`].

use serde_json::{Map, Value, json};

use super::Config;

/// Keys a reload (SIGHUP) cannot change, with every key under them: the
/// listeners are bound once, and histogram buckets are fixed when the
/// registry is made. Changing one needs a restart.
pub const RESTART: &[&str] = &[
    "server.listen",
    "server.admin_listen",
    "server.header_timeout",
    "server.http1",
    "server.tls",
    "telemetry.buckets",
    "epp.listen",
    "epp.health_listen",
];

/// One key of the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigKey {
    /// Dotted path; `[]` stands for any element of a list, `NAME` and
    /// `MODEL` for a map's key (a tier's name, a served model).
    pub key: String,
    /// The default as serde writes it (`none`: unset), or `required`.
    pub default: String,
    /// Only a restart applies it (under [`RESTART`]); else a reload does.
    pub restart: bool,
}

/// The keys of [`RESTART`] whose values differ between two configs.
pub fn needs_restart(old: &Config, new: &Config) -> Vec<&'static str> {
    let (a, b) = (
        serde_json::to_value(old).unwrap_or_default(),
        serde_json::to_value(new).unwrap_or_default(),
    );
    RESTART
        .iter()
        .copied()
        .filter(|k| at(&a, k) != at(&b, k))
        .collect()
}

fn at<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    key.split('.').try_fold(v, |v, k| v.get(k))
}

/// One element of each list and map, with only what it cannot do without:
/// decoding fills in the rest with its defaults.
fn minimal() -> Value {
    let mut v = serde_json::to_value(Config::default()).unwrap_or_default();
    v["backends"] = json!([{ "url": "http://replica:8000/" }]);
    v["discovery"]["dns"] = json!([{ "name": "replicas.example", "port": 8000 }]);
    v["discovery"]["kubernetes"] = json!([{}]);
    v["auth"]["keys"] = json!([{ "name": "NAME", "tier": "NAME", "sha256": "0".repeat(64) }]);
    v["tiers"] = json!({ "NAME": { "models": { "MODEL": {} } } });
    v
}

/// The config keys with their defaults, sorted by key.
pub fn reference() -> Result<Vec<ConfigKey>, String> {
    let input = minimal();
    let decoded: Config = serde_json::from_value(input.clone())
        .map_err(|e| format!("the reference's sample config does not decode: {e}"))?;
    let mut full = serde_json::to_value(&decoded).map_err(|e| e.to_string())?;
    // Secrets serialise as `[redacted]`; the one with a default is shown.
    full["rate_limits"]["redis"]["url"] =
        Value::from(Config::default().rate_limits.redis.url.expose());
    full["routing"]["sessions"]["redis"]["url"] =
        Value::from(Config::default().routing.sessions.redis.url.expose());
    let mut out = Vec::new();
    walk(&full, &mut Vec::new(), &input, &mut out);
    Ok(out)
}

/// A step of a key's path: a field, or the element of a list.
#[derive(Clone)]
enum Step {
    Field(String),
    Element,
}

fn walk(v: &Value, path: &mut Vec<Step>, input: &Value, out: &mut Vec<ConfigKey>) {
    match v {
        Value::Object(fields) if !fields.is_empty() => {
            for (k, f) in fields {
                path.push(Step::Field(k.clone()));
                walk(f, path, input, out);
                path.pop();
            }
        }
        Value::Array(items) if items.first().is_some_and(Value::is_object) => {
            path.push(Step::Element);
            if let Some(first) = items.first() {
                walk(first, path, input, out);
            }
            path.pop();
        }
        leaf => {
            let key = name(path);
            let restart = RESTART
                .iter()
                .any(|r| key == *r || key.starts_with(&format!("{r}.")));
            let default = if required(input, path) {
                "required".to_string()
            } else {
                show(leaf)
            };
            out.push(ConfigKey {
                key,
                default,
                restart,
            });
        }
    }
}

fn name(path: &[Step]) -> String {
    let mut s = String::new();
    for step in path {
        match step {
            Step::Field(f) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(f);
            }
            Step::Element => s.push_str("[]"),
        }
    }
    s
}

/// Whether the sample gives this key a value and decoding fails without it.
fn required(input: &Value, path: &[Step]) -> bool {
    let mut without = input.clone();
    let Some((Step::Field(last), parents)) = path.split_last() else {
        return false;
    };
    let mut node = &mut without;
    for step in parents {
        let next = match step {
            Step::Field(f) => node.get_mut(f.as_str()),
            Step::Element => node.get_mut(0),
        };
        match next {
            Some(n) => node = n,
            None => return false,
        }
    }
    let removed = node
        .as_object_mut()
        .and_then(|o: &mut Map<String, Value>| o.remove(last.as_str()));
    removed.is_some() && serde_json::from_value::<Config>(without).is_err()
}

fn show(v: &Value) -> String {
    match v {
        Value::Null => "none".into(),
        Value::String(s) => s.clone(),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(show).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(_) => "{}".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_defaults_and_requirements_come_from_the_tree() {
        let keys = reference().unwrap_or_default();
        let get = |k: &str| keys.iter().find(|c| c.key == k).cloned();
        let listen = get("server.listen").unwrap_or_else(|| panic!("{keys:?}"));
        assert_eq!(listen.default, "0.0.0.0:8080");
        assert!(listen.restart);
        assert_eq!(
            get("backends[].url").map(|c| c.default),
            Some("required".into())
        );
        assert_eq!(
            get("backends[].name").map(|c| c.default),
            Some("none".into())
        );
        assert_eq!(
            get("discovery.dns[].interval").map(|c| c.default),
            Some("10s".into())
        );
        assert_eq!(
            get("rate_limits.redis.url").map(|c| c.default),
            Some("redis://127.0.0.1:6379".into())
        );
        assert!(get("tiers.NAME.models.MODEL.max_tokens").is_some());
        assert!(get("telemetry.buckets.ttft").is_some_and(|c| c.restart));
        assert!(get("upstream.timeouts.idle").is_some_and(|c| !c.restart));
        assert!(get("models.aliases").is_some_and(|c| c.default == "{}"));
    }

    #[test]
    fn a_reload_is_refused_for_exactly_the_restart_keys() {
        let old = Config::default();
        let mut new = old.clone();
        new.upstream.timeouts.idle = std::time::Duration::from_secs(1);
        assert!(needs_restart(&old, &new).is_empty());
        new.server.http1 = super::super::Http1Server::Hyper;
        new.telemetry.buckets.ttft = vec![1.0];
        assert_eq!(
            needs_restart(&old, &new),
            ["server.http1", "telemetry.buckets"]
        );
    }
}
