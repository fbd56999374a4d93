//! `GET /v1/models`: the union of the models healthy replicas serve, in
//! OpenAI's list shape, plus the configured aliases that point at one of them.

use axum::Json;

use serde::Serialize;

use crate::state::Current;

#[derive(Serialize)]
pub(crate) struct ModelList {
    object: &'static str,
    data: Vec<ModelCard>,
}

#[derive(Serialize)]
struct ModelCard {
    id: String,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
}

pub(crate) async fn list(Current(state): Current) -> Json<ModelList> {
    let created = state.started_unix;
    let data = state
        .pool
        .served_models()
        .into_iter()
        .map(|id| ModelCard {
            id,
            object: "model",
            created,
            owned_by: "sluice",
        })
        .collect();
    Json(ModelList {
        object: "list",
        data,
    })
}
