//! A request's session key, from the configured sources in order: a header,
//! a body field, or (none sent) what identifies the conversation in the
//! prompt. Hashed and bound to the served model, so the same id under two
//! models is two sessions.

use super::inbound::SessionFields;
use crate::config::{SessionSource, SessionsConfig};
use crate::headers::Lookup;
use crate::routing::SessionKey;

/// The session of a request, if sessions are on and it has one.
pub(crate) fn key(
    cfg: &SessionsConfig,
    headers: &impl Lookup,
    fields: &SessionFields,
    model: &str,
) -> Option<SessionKey> {
    if !cfg.enabled {
        return None;
    }
    let (hash, explicit) = cfg.sources.iter().find_map(|src| {
        let h = match src {
            SessionSource::Header(name) => headers.first(name).filter(|v| !v.is_empty()).map(|v| {
                xxhash_rust::xxh3::xxh3_64_with_seed(
                    v,
                    xxhash_rust::xxh3::xxh3_64(name.as_str().as_bytes()),
                )
            }),
            SessionSource::PromptCacheKey => fields.prompt_cache_key,
            SessionSource::MetadataUserId => fields.metadata_user_id,
            SessionSource::PreviousResponseId => fields.previous_response_id,
            SessionSource::User => fields.user,
            SessionSource::Derived => return fields.derived.map(|h| (h, false)),
        };
        h.map(|h| (h, true))
    })?;
    let key = xxhash_rust::xxh3::xxh3_64_with_seed(
        &hash.to_le_bytes(),
        xxhash_rust::xxh3::xxh3_64(model.as_bytes()),
    );
    Some(SessionKey {
        key,
        explicit,
        continuing: fields.continuing,
    })
}
