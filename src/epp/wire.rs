//! Envoy's ext_proc messages as the picker reads and writes them: header
//! maps, the data plane's metadata (subset hint, served endpoint), and the
//! answers (the pick's header and metadata, body chunks, immediate errors).
//! Only builders and readers here; the exchange's order is `exchange.rs`'s.

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader, HeaderValueOption, Metadata,
    header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use http::{HeaderMap, HeaderName, HeaderValue};

/// The header (and metadata key) naming the pick and its fallbacks.
pub(crate) const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The subset hint's key in its namespace.
pub(crate) const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The served endpoint's key, reported by the data plane on the response.
pub(crate) const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The prefill replica named to a disaggregated decode replica's sidecar
/// (llm-d's routing sidecar reads it: `ip:port`).
pub(crate) const PREFILLER: &str = "x-prefiller-host-port";
/// Largest body chunk sent back: some Envoys cap a streamed chunk at 64 KiB
/// (the reference picker's choice).
pub(crate) const MAX_CHUNK: usize = 62_000;

/// A message's headers: the pseudo-headers the picker reads, and the rest
/// as a map (a header that is not valid HTTP is skipped).
#[derive(Debug, Default)]
pub(crate) struct Headers {
    pub(crate) method: Option<String>,
    pub(crate) path: Option<String>,
    pub(crate) status: Option<u16>,
    pub(crate) map: HeaderMap,
}

pub(crate) fn headers(from: Option<&EnvoyHeaders>) -> Headers {
    let mut out = Headers::default();
    for h in from.map(|h| h.headers.as_slice()).unwrap_or_default() {
        let value = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            &h.raw_value[..]
        };
        let text = || String::from_utf8_lossy(value).into_owned();
        match h.key.as_str() {
            ":method" => out.method = Some(text()),
            ":path" => out.path = Some(text()),
            ":status" => out.status = text().trim().parse().ok(),
            k if k.starts_with(':') => {}
            k => {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(k.as_bytes()),
                    HeaderValue::from_bytes(value),
                ) {
                    out.map.append(name, value);
                }
            }
        }
    }
    out
}

/// The strings under `namespace`/`key` of the data plane's metadata: a
/// list of strings, or one string (comma-separated). `None`: the key is
/// absent.
pub(crate) fn metadata_strings(
    md: Option<&Metadata>,
    namespace: &str,
    key: &str,
) -> Option<Vec<String>> {
    let value = md?.filter_metadata.get(namespace)?.fields.get(key)?;
    let mut out = Vec::new();
    let mut add = |s: &str| {
        out.extend(
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
        );
    };
    match &value.kind {
        Some(Kind::StringValue(s)) => add(s),
        Some(Kind::ListValue(l)) => {
            for v in &l.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    add(s);
                }
            }
        }
        _ => {}
    }
    Some(out)
}

fn set(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(EnvoyHeader {
            key: key.to_string(),
            raw_value: value.to_vec(),
            ..EnvoyHeader::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// The pick, named the same in the header and in the dynamic metadata
/// (`namespace`/`x-gateway-destination-endpoint`): `ip:port[,ip:port...]`.
/// `body_len`: the length of the body that follows, when the picker
/// rewrote it (model alias, usage asked).
/// `prefiller`: a disaggregated model's prefill plan.
fn pick_mutation(
    destination: &str,
    body_len: Option<usize>,
    prefiller: Prefiller<'_>,
) -> HeaderMutation {
    let mut set_headers = vec![set(DESTINATION, destination.as_bytes())];
    if let Some(n) = body_len {
        set_headers.push(set("content-length", n.to_string().as_bytes()));
    }
    let mut remove_headers = Vec::new();
    match prefiller {
        Prefiller::None => {}
        Prefiller::Remote(at) => set_headers.push(set(PREFILLER, at.as_bytes())),
        // A client's own header never names a prefill replica.
        Prefiller::Local => remove_headers.push(PREFILLER.to_string()),
    }
    HeaderMutation {
        set_headers,
        remove_headers,
    }
}

/// What the pick says of the prefill (a disaggregated model, vLLM's
/// protocol): nothing (another model), local on the decode replica, or on
/// the prefill replica at `ip:port`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Prefiller<'a> {
    None,
    Local,
    Remote(&'a str),
}

fn pick_metadata(namespace: &str, destination: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION.to_string(),
            Value {
                kind: Some(Kind::StringValue(destination.to_string())),
            },
        )]
        .into(),
    };
    Struct {
        fields: [(
            namespace.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// The answer to the request's headers (streamed bodies) or to its body
/// (buffered ones) that carries the pick; `clear_route_cache`: the route
/// may depend on the header (the buffered answer comes after Envoy chose a
/// route once).
pub(crate) fn picked(
    namespace: &str,
    destination: &str,
    body_len: Option<usize>,
    prefiller: Prefiller<'_>,
    on_body: bool,
) -> ProcessingResponse {
    let common = CommonResponse {
        header_mutation: Some(pick_mutation(destination, body_len, prefiller)),
        clear_route_cache: on_body,
        ..CommonResponse::default()
    };
    let response = if on_body {
        Response::RequestBody(BodyResponse {
            response: Some(common),
        })
    } else {
        Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })
    };
    ProcessingResponse {
        dynamic_metadata: Some(pick_metadata(namespace, destination)),
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

/// Carry on unchanged: the answer to a message the picker only reads.
pub(crate) fn proceed(kind: Proceed) -> ProcessingResponse {
    let headers = || HeadersResponse {
        response: Some(CommonResponse::default()),
    };
    let body = || BodyResponse {
        response: Some(CommonResponse::default()),
    };
    let response = match kind {
        Proceed::RequestHeaders => Response::RequestHeaders(headers()),
        Proceed::ResponseHeaders => Response::ResponseHeaders(headers()),
        Proceed::RequestBody => Response::RequestBody(body()),
        Proceed::ResponseBody => Response::ResponseBody(body()),
        Proceed::RequestTrailers => Response::RequestTrailers(TrailersResponse::default()),
        Proceed::ResponseTrailers => Response::ResponseTrailers(TrailersResponse::default()),
    };
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proceed {
    RequestHeaders,
    ResponseHeaders,
    RequestBody,
    ResponseBody,
    RequestTrailers,
    ResponseTrailers,
}

/// `body` as streamed body responses of at most [`MAX_CHUNK`] bytes, the
/// last one marked `end_of_stream` when `end` (an empty body is one empty
/// chunk).
pub(crate) fn streamed(body: &Bytes, end: bool, response: bool) -> Vec<ProcessingResponse> {
    let mut out = Vec::with_capacity(body.len() / MAX_CHUNK + 1);
    let mut rest = body.clone();
    loop {
        let piece = rest.split_to(rest.len().min(MAX_CHUNK));
        let last = rest.is_empty();
        let mutation = BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body: piece.to_vec(),
                    end_of_stream: last && end,
                    ..StreamedBodyResponse::default()
                },
            )),
        };
        let common = Some(CommonResponse {
            body_mutation: Some(mutation),
            ..CommonResponse::default()
        });
        let r = BodyResponse { response: common };
        out.push(ProcessingResponse {
            response: Some(if response {
                Response::ResponseBody(r)
            } else {
                Response::RequestBody(r)
            }),
            ..ProcessingResponse::default()
        });
        if last {
            return out;
        }
    }
}

/// The buffered body's answer `r` (a pick) also puts `body` in the
/// request's body's place.
pub(crate) fn with_body(r: &mut ProcessingResponse, body: &Bytes) {
    if let Some(Response::RequestBody(BodyResponse {
        response: Some(common),
    })) = r.response.as_mut()
    {
        common.body_mutation = Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::Body(body.to_vec())),
        });
    }
}

/// A buffered body answered with `body` in its place.
pub(crate) fn replaced(body: &Bytes, response: bool) -> ProcessingResponse {
    let r = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::Body(body.to_vec())),
            }),
            ..CommonResponse::default()
        }),
    };
    ProcessingResponse {
        response: Some(if response {
            Response::ResponseBody(r)
        } else {
            Response::RequestBody(r)
        }),
        ..ProcessingResponse::default()
    }
}

/// The request answered here, not forwarded: `status` with `body` (JSON).
pub(crate) fn immediate(status: u16, body: &[u8], extra: &HeaderMap) -> ProcessingResponse {
    let mut set_headers = vec![set("content-type", b"application/json")];
    for (k, v) in extra {
        set_headers.push(set(k.as_str(), v.as_bytes()));
    }
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                ..HeaderMutation::default()
            }),
            body: body.to_vec(),
            details: "sluice_epp".into(),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}
