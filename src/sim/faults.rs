//! Fault injection for the simulator: a comma-separated spec, given per replica
//! (`sluice sim --fault SPEC`) or per request (header `x-sim-fault: SPEC`).
//!
//! | spec | effect |
//! |---|---|
//! | `error=503` | answer at once with that status and a vLLM-style error body |
//! | `first_token=2s` | extra delay before the first token |
//! | `stall=5:30s` | after 5 tokens, go silent for 30 s, then continue |
//! | `drop=5` | after 5 tokens, cut the connection (no terminating chunk) |
//! | `malformed=5` | after 5 tokens, send an event that is not JSON |
//! | `error_event=5` | after 5 tokens, send an in-band error event and end |
//! | `leak` | the engine never frees the request's KV blocks when it ends (an engine bug on some exit path); `POST /sim/reset` frees them, as a restart would |

use std::time::Duration;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    pub error: Option<u16>,
    pub first_token: Option<Duration>,
    pub stall: Option<(u32, Duration)>,
    pub drop_after: Option<u32>,
    pub malformed_after: Option<u32>,
    pub error_event_after: Option<u32>,
    /// The request's KV blocks stay allocated after it ends (engine model only).
    pub leak: bool,
}

pub(crate) const HEADER: &str = "x-sim-fault";

impl Faults {
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut f = Faults::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if part == "leak" {
                f.leak = true;
                continue;
            }
            let (key, val) = part
                .split_once('=')
                .ok_or_else(|| format!("fault `{part}` is not key=value"))?;
            let num = |v: &str| {
                v.parse::<u32>()
                    .map_err(|_| format!("fault `{key}`: `{v}` is not a number"))
            };
            let dur = |v: &str| {
                humantime::parse_duration(v)
                    .map_err(|_| format!("fault `{key}`: `{v}` is not a duration (e.g. 2s)"))
            };
            match key {
                "error" => {
                    let code = num(val)?;
                    if !(400..600).contains(&code) {
                        return Err(format!("fault `error`: {code} is not a 4xx/5xx status"));
                    }
                    f.error = Some(code as u16);
                }
                "first_token" => f.first_token = Some(dur(val)?),
                "stall" => {
                    let (n, d) = val.split_once(':').ok_or_else(|| {
                        "fault `stall` is N:DURATION, e.g. stall=5:30s".to_string()
                    })?;
                    f.stall = Some((num(n)?, dur(d)?));
                }
                "drop" => f.drop_after = Some(num(val)?),
                "malformed" => f.malformed_after = Some(num(val)?),
                "error_event" => f.error_event_after = Some(num(val)?),
                "leak" => return Err("fault `leak` takes no value: write `leak`".into()),
                other => return Err(format!("unknown fault `{other}`")),
            }
        }
        Ok(f)
    }

    pub(crate) fn is_empty(&self) -> bool {
        *self == Faults::default()
    }

    /// The spec that parses back to these faults.
    pub(crate) fn to_spec(&self) -> String {
        let mut parts = Vec::new();
        if let Some(c) = self.error {
            parts.push(format!("error={c}"));
        }
        if let Some(d) = self.first_token {
            parts.push(format!("first_token={}ms", d.as_millis()));
        }
        if let Some((n, d)) = self.stall {
            parts.push(format!("stall={n}:{}ms", d.as_millis()));
        }
        if let Some(n) = self.drop_after {
            parts.push(format!("drop={n}"));
        }
        if let Some(n) = self.malformed_after {
            parts.push(format!("malformed={n}"));
        }
        if let Some(n) = self.error_event_after {
            parts.push(format!("error_event={n}"));
        }
        if self.leak {
            parts.push("leak".into());
        }
        parts.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_fault() {
        let f = Faults::parse(
            "error=503, first_token=2s,stall=5:30s,drop=7,malformed=3,error_event=4,leak",
        )
        .unwrap_or_default();
        assert_eq!(f.error, Some(503));
        assert_eq!(f.first_token, Some(Duration::from_secs(2)));
        assert_eq!(f.stall, Some((5, Duration::from_secs(30))));
        assert_eq!(f.drop_after, Some(7));
        assert_eq!(f.malformed_after, Some(3));
        assert_eq!(f.error_event_after, Some(4));
        assert!(f.leak);
        assert_eq!(Faults::parse(&f.to_spec()), Ok(f));
    }

    #[test]
    fn rejects_nonsense() {
        assert!(Faults::parse("explode=1").is_err());
        assert!(Faults::parse("error=200").is_err());
        assert!(Faults::parse("stall=5").is_err());
        assert!(Faults::parse("drop").is_err());
        assert!(Faults::parse("leak=1").is_err());
        assert!(Faults::parse("leaky").is_err());
    }
}
