//! Small value types of the config: sizes with units and secrets that never print.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A byte count written as a number or with a unit: `1048576`, `512KiB`, `16MiB`, `1GB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s
            .find(|c: char| !c.is_ascii_digit() && c != '_')
            .unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let num: u64 = num
            .replace('_', "")
            .parse()
            .map_err(|_| format!("`{s}` is not a size (e.g. 16MiB)"))?;
        let mult: u64 = match unit.trim() {
            "" | "B" => 1,
            "KB" | "kB" => 1_000,
            "KiB" => 1 << 10,
            "MB" => 1_000_000,
            "MiB" => 1 << 20,
            "GB" => 1_000_000_000,
            "GiB" => 1 << 30,
            other => {
                return Err(format!(
                    "unknown size unit `{other}` (use B, KiB, MiB, GiB)"
                ));
            }
        };
        num.checked_mul(mult)
            .map(ByteSize)
            .ok_or_else(|| format!("`{s}` is too large"))
    }

    pub fn as_usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => ByteSize::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

/// A credential. Debug, Display and Serialize print `[redacted]`; only
/// [`Secret::expose`] reveals it, at the one place it is sent.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("[redacted]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(ByteSize::parse("1024"), Ok(ByteSize(1024)));
        assert_eq!(ByteSize::parse("16MiB"), Ok(ByteSize(16 << 20)));
        assert_eq!(ByteSize::parse("2 KB"), Ok(ByteSize(2000)));
        assert!(ByteSize::parse("12 parsecs").is_err());
        assert!(ByteSize::parse("MiB").is_err());
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("sk-very-secret");
        assert_eq!(format!("{s:?}"), "[redacted]");
        assert_eq!(
            serde_json::to_string(&s).unwrap_or_default(),
            "\"[redacted]\""
        );
    }
}
