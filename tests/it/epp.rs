//! Endpoint-picker mode: a gRPC ext_proc client plays Envoy's side of the
//! Gateway API Inference Extension protocol against the gateway's picker
//! (the same process as its API listener), over loopback, with simulated
//! replicas: the pick in header and metadata, fallbacks, the subset hint,
//! the error answers, routing shared with the proxy, the response path's
//! token accounting, health, and release of a dropped stream's accounting.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, Metadata, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    body_mutation::Mutation, external_processor_client::ExternalProcessorClient,
    processing_request::Request as Msg, processing_response::Response as Answer,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use sluice::config::{Config, PolicyKind, Role};
use sluice::server::Gateway;
use sluice::sim::SimHandle;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::common::*;
use crate::routing::{prefixed, routing_config, sims, start_routed, urls};

const DEST: &str = "x-gateway-destination-endpoint";
const PREFILLER: &str = "x-prefiller-host-port";

fn with_epp(mut c: Config) -> Config {
    c.epp.listen = Some("127.0.0.1:0".parse().unwrap());
    c.epp.health_listen = "127.0.0.1:0".parse().unwrap();
    c
}

/// One ext_proc stream, as Envoy opens one per HTTP request.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
    mode: BodySendMode,
}

/// What the picker answered to a request.
#[derive(Debug)]
enum Decided {
    Picked {
        header: String,
        metadata: String,
        /// The body as re-emitted, and its chunks' sizes.
        body: Vec<u8>,
        chunks: Vec<usize>,
        /// `x-prefiller-host-port` as set, and whether the picker removes
        /// the client's (a disaggregated model's prefill plan).
        prefiller: Option<String>,
        prefiller_removed: bool,
    },
    Immediate {
        status: u16,
        body: String,
    },
}

impl Decided {
    fn endpoints(&self) -> Vec<String> {
        match self {
            Decided::Picked {
                header, metadata, ..
            } => {
                assert_eq!(header, metadata, "header and metadata must agree");
                header.split(',').map(str::to_string).collect()
            }
            Decided::Immediate { status, body } => panic!("not picked: {status} {body}"),
        }
    }

    /// The prefill replica the pick names, and whether a client's own
    /// header naming one is removed.
    fn prefiller(&self) -> (Option<&str>, bool) {
        match self {
            Decided::Picked {
                prefiller,
                prefiller_removed,
                ..
            } => (prefiller.as_deref(), *prefiller_removed),
            Decided::Immediate { status, body } => panic!("not picked: {status} {body}"),
        }
    }

    fn immediate(&self) -> (u16, serde_json::Value) {
        match self {
            Decided::Immediate { status, body } => (*status, error_of(body)),
            other => panic!("picked: {other:?}"),
        }
    }
}

fn header(k: &str, v: &str) -> HeaderValue {
    HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..HeaderValue::default()
    }
}

/// A 200 answer's headers of `content_type`, more to come.
fn response_head(content_type: &str) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                header(":status", "200"),
                header("content-type", content_type),
            ],
        }),
        ..HttpHeaders::default()
    }
}

fn strings(ns: &str, key: &str, values: &[&str]) -> Metadata {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: values
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue(s.to_string())),
                })
                .collect(),
        })),
    };
    Metadata {
        filter_metadata: [(
            ns.to_string(),
            Struct {
                fields: [(key.to_string(), list)].into(),
            },
        )]
        .into(),
        ..Metadata::default()
    }
}

impl Stream {
    async fn open(gw: &Gateway) -> Self {
        Self::open_in(gw, BodySendMode::FullDuplexStreamed).await
    }

    async fn open_in(gw: &Gateway, mode: BodySendMode) -> Self {
        let url = format!("http://{}", gw.epp_addr.expect("epp on"));
        let mut client = ExternalProcessorClient::connect(url)
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20);
        let (tx, rx) = mpsc::channel(64);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Self { tx, rx, mode }
    }

    async fn send(&self, m: Msg, md: Option<Metadata>, first: bool) {
        let protocol_config = first.then(|| ProtocolConfiguration {
            request_body_mode: self.mode as i32,
            response_body_mode: self.mode as i32,
            ..ProtocolConfiguration::default()
        });
        let msg = ProcessingRequest {
            request: Some(m),
            metadata_context: md,
            protocol_config,
            ..ProcessingRequest::default()
        };
        self.tx.send(msg).await.unwrap();
    }

    async fn next(&mut self) -> Answer {
        let m = tokio::time::timeout(Duration::from_secs(20), self.rx.message())
            .await
            .expect("an answer within 20 s")
            .expect("the stream is up")
            .expect("a message");
        m.response.expect("a response")
    }

    /// The request's headers and body (in 16 KiB chunks); the answer.
    async fn decide(
        &mut self,
        headers: &[(&str, &str)],
        subset: Option<&[&str]>,
        body: &[u8],
    ) -> Decided {
        let mut hs = vec![header(":method", "POST")];
        if !headers.iter().any(|(k, _)| *k == ":path") {
            hs.push(header(":path", "/v1/chat/completions"));
        }
        hs.push(header("content-type", "application/json"));
        hs.extend(headers.iter().map(|(k, v)| header(k, v)));
        let md = subset.map(|s| {
            strings(
                "envoy.lb.subset_hint",
                "x-gateway-destination-endpoint-subset",
                s,
            )
        });
        let h = HttpHeaders {
            headers: Some(HeaderMap { headers: hs }),
            end_of_stream: body.is_empty(),
            ..HttpHeaders::default()
        };
        self.send(Msg::RequestHeaders(h), md, true).await;
        let buffered = self.mode == BodySendMode::Buffered;
        if buffered && !body.is_empty() {
            // Envoy sends a buffered body after the headers' answer.
            match self.next().await {
                Answer::RequestHeaders(_) => {}
                other => panic!("headers' answer expected: {other:?}"),
            }
        }
        let pieces: Vec<&[u8]> = if buffered {
            vec![body]
        } else {
            body.chunks(16 * 1024).collect()
        };
        for (i, piece) in pieces.iter().enumerate() {
            let b = HttpBody {
                body: piece.to_vec(),
                end_of_stream: i + 1 == pieces.len(),
                ..HttpBody::default()
            };
            self.send(Msg::RequestBody(b), None, false).await;
        }
        let first = self.tx_answer().await;
        let (answer, metadata) = first;
        let common = match answer {
            Answer::ImmediateResponse(r) => {
                return Decided::Immediate {
                    status: r.status.unwrap().code as u16,
                    body: String::from_utf8(r.body).unwrap(),
                };
            }
            Answer::RequestHeaders(h) if !buffered => h.response.unwrap(),
            Answer::RequestBody(b) if buffered => b.response.unwrap(),
            other => panic!("unexpected answer: {other:?}"),
        };
        let set = &common.header_mutation.as_ref().unwrap().set_headers;
        let dest = set
            .iter()
            .map(|o| o.header.as_ref().unwrap())
            .find(|h| h.key == DEST)
            .expect("the destination header");
        assert!(
            set.iter()
                .all(|o| o.append_action == HeaderAppendAction::OverwriteIfExistsOrAdd as i32),
            "the picker's headers replace the client's"
        );
        let header = String::from_utf8(dest.raw_value.clone()).unwrap();
        let prefiller = set
            .iter()
            .map(|o| o.header.as_ref().unwrap())
            .find(|h| h.key == PREFILLER)
            .map(|h| String::from_utf8(h.raw_value.clone()).unwrap());
        let prefiller_removed = common
            .header_mutation
            .as_ref()
            .unwrap()
            .remove_headers
            .iter()
            .any(|h| h == PREFILLER);
        let metadata = metadata.expect("dynamic metadata");
        let (mut body, mut chunks) = (Vec::new(), Vec::new());
        if buffered {
            if let Some(Mutation::Body(b)) = common.body_mutation.and_then(|m| m.mutation) {
                body = b;
            }
        } else {
            loop {
                let Answer::RequestBody(b) = self.next().await else {
                    panic!("body chunks expected");
                };
                let m = b.response.unwrap().body_mutation.unwrap().mutation.unwrap();
                let Mutation::StreamedResponse(s) = m else {
                    panic!("a streamed body expected");
                };
                chunks.push(s.body.len());
                body.extend_from_slice(&s.body);
                if s.end_of_stream {
                    break;
                }
            }
        }
        Decided::Picked {
            header,
            metadata,
            body,
            chunks,
            prefiller,
            prefiller_removed,
        }
    }

    /// The next answer with the pick's metadata value, if any.
    async fn tx_answer(&mut self) -> (Answer, Option<String>) {
        let m = tokio::time::timeout(Duration::from_secs(20), self.rx.message())
            .await
            .expect("an answer within 20 s")
            .expect("the stream is up")
            .expect("a message");
        let md = m.dynamic_metadata.as_ref().map(|s| {
            let Some(Kind::StructValue(inner)) = &s.fields["envoy.lb"].kind else {
                panic!("namespace envoy.lb expected");
            };
            let Some(Kind::StringValue(v)) = &inner.fields[DEST].kind else {
                panic!("a string value expected");
            };
            v.clone()
        });
        (m.response.unwrap(), md)
    }

    /// The replica's answer through the picker: its headers, its body in
    /// `chunks`; what the picker passed on.
    async fn respond(
        &mut self,
        content_type: &str,
        chunks: &[&[u8]],
        served: Option<&str>,
    ) -> Vec<u8> {
        self.respond_with("200", content_type, chunks, served).await
    }

    /// [`Self::respond`] with the replica's `status`.
    async fn respond_with(
        &mut self,
        status: &str,
        content_type: &str,
        chunks: &[&[u8]],
        served: Option<&str>,
    ) -> Vec<u8> {
        let h = HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":status", status),
                    header("content-type", content_type),
                ],
            }),
            end_of_stream: chunks.is_empty(),
            ..HttpHeaders::default()
        };
        let md = served.map(|s| {
            let mut m = strings("envoy.lb", "x-gateway-destination-endpoint-served", &[]);
            m.filter_metadata
                .get_mut("envoy.lb")
                .unwrap()
                .fields
                .insert(
                    "x-gateway-destination-endpoint-served".into(),
                    Value {
                        kind: Some(Kind::StringValue(s.into())),
                    },
                );
            m
        });
        self.send(Msg::ResponseHeaders(h), md, false).await;
        assert!(matches!(self.next().await, Answer::ResponseHeaders(_)));
        for (i, c) in chunks.iter().enumerate() {
            let b = HttpBody {
                body: c.to_vec(),
                end_of_stream: i + 1 == chunks.len(),
                ..HttpBody::default()
            };
            self.send(Msg::ResponseBody(b), None, false).await;
        }
        let mut out = Vec::new();
        if chunks.is_empty() {
            return out;
        }
        loop {
            let Answer::ResponseBody(b) = self.next().await else {
                panic!("response body expected");
            };
            let m = b.response.unwrap().body_mutation.unwrap().mutation.unwrap();
            let Mutation::StreamedResponse(s) = m else {
                panic!("a streamed body expected");
            };
            out.extend_from_slice(&s.body);
            if s.end_of_stream {
                return out;
            }
        }
    }
}

fn chat(content: &str, stream: bool) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "sim-model",
        "stream": stream,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": content}],
    }))
    .unwrap()
}

fn addrs(sims: &[SimHandle]) -> Vec<String> {
    sims.iter().map(|s| s.addr.to_string()).collect()
}

/// In-flight requests the gateway counts on its replicas.
fn in_flight(gw: &Gateway) -> u32 {
    gw.state()
        .pool
        .replicas()
        .iter()
        .map(|r| r.in_flight())
        .sum()
}

#[tokio::test]
async fn the_pick_is_a_live_replica_named_alike_in_header_and_metadata() {
    let sims = sims(3).await;
    let gw = start_gateway(with_epp(config_for(&urls(&sims))), 3).await;
    let mut s = Stream::open(&gw).await;
    // A 150 KB prompt: the body comes back in chunks of at most 62,000 bytes.
    let body = chat(&"lorem ipsum ".repeat(12_500), false);
    let d = s.decide(&[], None, &body).await;
    let ends = d.endpoints();
    assert!(addrs(&sims).contains(&ends[0]), "{ends:?}");
    let Decided::Picked {
        body: out, chunks, ..
    } = &d
    else {
        unreachable!()
    };
    assert!(
        chunks.len() >= 3 && chunks.iter().all(|&n| n <= 62_000),
        "{chunks:?}"
    );
    let sent: serde_json::Value = serde_json::from_slice(out).unwrap();
    assert_eq!(sent["model"], "sim-model");
    assert_eq!(
        sent["messages"][0]["content"].as_str().unwrap().len(),
        150_000
    );
    assert_eq!(in_flight(&gw), 1, "the pick counts in flight");
    let answer = br#"{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}"#;
    let passed = s.respond("application/json", &[answer], None).await;
    assert_eq!(passed, answer, "a whole answer passes unchanged");
    assert_eq!(in_flight(&gw), 0, "released at the response's end");
    assert_eq!(
        gateway_metric(
            &gw,
            r#"sluice_epp_decisions_total{model="sim-model",outcome="routed"}"#
        )
        .await,
        1.0
    );
    assert_eq!(
        gateway_metric(&gw, r#"sluice_generation_tokens_total{model="sim-model"}"#).await,
        2.0,
        "usage of a whole answer counted"
    );
}

#[tokio::test]
async fn a_disaggregated_model_gets_its_prefill_replica_named_for_the_decode_sidecar() {
    // One prefill and two decode replicas (the gateway's roles; the data
    // plane and the decode replica's sidecar are the client here).
    let sims = sims(3).await;
    let mut c = with_epp(routing_config(&urls(&sims)));
    c.backends[0].role = Role::Prefill;
    c.backends[1].role = Role::Decode;
    c.backends[2].role = Role::Decode;
    // A decode replica prefills a prompt it holds, however long.
    c.routing.disaggregation.local_max_tokens = None;
    let gw = start_routed(c, 3).await;
    let names = addrs(&sims);
    let body = serde_json::to_vec(&prefixed(0, 0)).unwrap();
    let answer = br#"{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}"#;

    let mut s = Stream::open(&gw).await;
    let d = s.decide(&[(PREFILLER, "10.9.9.9:80")], None, &body).await;
    let Decided::Picked { prefiller, .. } = &d else {
        unreachable!()
    };
    let decode = d.endpoints();
    assert!(
        decode.iter().all(|e| *e != names[0]),
        "only decode replicas are destinations: {decode:?}"
    );
    assert_eq!(
        prefiller.as_deref(),
        Some(names[0].as_str()),
        "a cold prompt is prefilled on the prefill replica, named over the client's"
    );
    s.respond("application/json", &[answer], None).await;
    assert_eq!(pd_decisions(&gw, "remote").await, 1.0);

    // The same prompt: routing sends it to the decode replica that holds
    // it, which prefills it itself; the client's header is removed.
    let mut s = Stream::open(&gw).await;
    let d = s.decide(&[(PREFILLER, "10.9.9.9:80")], None, &body).await;
    assert_eq!(d.endpoints()[0], decode[0], "the decode replica holding it");
    assert_eq!(
        d.prefiller(),
        (None, true),
        "none named, and a client never names the prefill replica"
    );
    s.respond("application/json", &[answer], None).await;
    assert_eq!(pd_decisions(&gw, "local_cached").await, 1.0);

    // Messages: the sidecar runs no prefill leg for it, so none is named
    // (and the client's header is removed); the decode replica prefills.
    let messages = serde_json::to_vec(&serde_json::json!({
        "model": "sim-model", "max_tokens": 5,
        "messages": [{"role": "user", "content": "a cold prompt in Anthropic's API ".repeat(50)}],
    }))
    .unwrap();
    let mut s = Stream::open(&gw).await;
    let d = s
        .decide(
            &[(":path", "/v1/messages"), (PREFILLER, "10.9.9.9:80")],
            None,
            &messages,
        )
        .await;
    assert!(d.endpoints().iter().all(|e| *e != names[0]), "{d:?}");
    assert_eq!(d.prefiller(), (None, true));
    s.respond(
        "application/json",
        &[br#"{"type":"message","content":[],"usage":{"input_tokens":10,"output_tokens":2}}"#],
        None,
    )
    .await;
    assert_eq!(pd_decisions(&gw, "local_api").await, 1.0);
    assert_eq!(pd_decisions(&gw, "remote").await, 1.0);
    assert_eq!(in_flight(&gw), 0);
}

#[test]
fn sglangs_protocol_through_the_picker_is_a_config_error() {
    let (ok, err) = check_config(
        "backends:\n  - url: http://10.0.0.1:8000\n    role: prefill\n    bootstrap_port: 8998\n  - url: http://10.0.0.2:8000\n    role: decode\nrouting:\n  disaggregation:\n    protocol: sglang\nepp:\n  listen: 127.0.0.1:9002\n",
    );
    assert!(!ok);
    assert!(
        err.contains("routing.disaggregation.protocol") && err.contains("x-prefiller-host-port"),
        "{err}"
    );
}

#[tokio::test]
async fn a_buffered_body_gets_the_pick_on_its_answer() {
    let sims = sims(2).await;
    let gw = start_gateway(with_epp(config_for(&urls(&sims))), 2).await;
    let mut s = Stream::open_in(&gw, BodySendMode::Buffered).await;
    // 5 MB in one message, above gRPC's default limit of 4 MiB.
    let d = s
        .decide(&[], None, &chat(&"lorem ipsum ".repeat(420_000), false))
        .await;
    assert!(addrs(&sims).contains(&d.endpoints()[0]));
    let Decided::Picked { body, .. } = &d else {
        unreachable!()
    };
    let sent: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(sent["model"], "sim-model");
    assert_eq!(
        sent["messages"][0]["content"].as_str().unwrap().len(),
        5_040_000
    );
}

#[tokio::test]
async fn fallbacks_follow_the_pick_in_order_of_least_work() {
    let sims = sims(3).await;
    let mut c = with_epp(config_for(&urls(&sims)));
    c.routing.policy = PolicyKind::LeastLoaded;
    c.epp.fallbacks = 2;
    let gw = start_gateway(c, 3).await;
    // A request held open keeps its replica busy.
    let mut busy = Stream::open(&gw).await;
    let held = busy
        .decide(&[], None, &chat("first", true))
        .await
        .endpoints()[0]
        .clone();
    let mut s = Stream::open(&gw).await;
    let ends = s.decide(&[], None, &chat("second", true)).await.endpoints();
    assert_eq!(ends.len(), 3, "{ends:?}");
    let distinct: std::collections::HashSet<_> = ends.iter().collect();
    assert_eq!(distinct.len(), 3, "{ends:?}");
    assert!(ends.iter().all(|e| addrs(&sims).contains(e)));
    assert_ne!(ends[0], held, "the busy replica is not picked");
    assert_eq!(ends[2], held, "the busy replica is the last fallback");
    // None: the pick alone.
    let mut c = with_epp(config_for(&urls(&sims)));
    c.epp.fallbacks = 0;
    let gw0 = start_gateway(c, 3).await;
    let mut s = Stream::open(&gw0).await;
    assert_eq!(
        s.decide(&[], None, &chat("x", true))
            .await
            .endpoints()
            .len(),
        1
    );
}

#[tokio::test]
async fn the_subset_hint_bounds_the_pick_and_an_ineligible_one_gets_503() {
    let sims = sims(3).await;
    let gw = start_gateway(with_epp(config_for(&urls(&sims))), 3).await;
    let only = addrs(&sims)[1].clone();
    for i in 0..6 {
        let mut s = Stream::open(&gw).await;
        let ends = s
            .decide(
                &[],
                Some(&[only.as_str()][..]),
                &chat(&format!("q{i}"), false),
            )
            .await
            .endpoints();
        assert_eq!(
            ends,
            vec![only.clone()],
            "only the subset, fallbacks included"
        );
    }
    let mut s = Stream::open(&gw).await;
    let (status, err) = s
        .decide(&[], Some(&["10.255.255.1:8000"][..]), &chat("q", false))
        .await
        .immediate();
    assert_eq!(status, 503);
    assert_eq!(err["code"], "no_healthy_backend", "{err}");
    let mut s = Stream::open(&gw).await;
    let (status, _) = s
        .decide(&[], Some(&[][..]), &chat("q", false))
        .await
        .immediate();
    assert_eq!(status, 503, "an empty subset has nothing eligible");
    assert_eq!(
        gateway_metric(
            &gw,
            r#"sluice_epp_decisions_total{model="sim-model",outcome="unavailable"}"#
        )
        .await,
        2.0
    );
}

#[tokio::test]
async fn bad_json_or_no_model_gets_400_in_the_openai_shape() {
    let sims = sims(1).await;
    let gw = start_gateway(with_epp(config_for(&urls(&sims))), 1).await;
    let mut s = Stream::open(&gw).await;
    let (status, err) = s.decide(&[], None, b"{not json").await.immediate();
    assert_eq!(status, 400);
    assert_eq!(err["type"], "invalid_request_error", "{err}");
    let mut s = Stream::open(&gw).await;
    let (status, _) = s
        .decide(
            &[],
            None,
            br#"{"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .await
        .immediate();
    assert_eq!(status, 400);
    let mut s = Stream::open(&gw).await;
    let (status, _) = s.decide(&[], None, b"").await.immediate();
    assert_eq!(status, 400, "no body names no model");
    assert_eq!(in_flight(&gw), 0);
}

#[tokio::test]
async fn prefix_affine_requests_pick_what_the_proxy_picks() {
    let sims = sims(4).await;
    // Two gateways sharing nothing: one proxies, the other picks.
    let proxy = start_routed(routing_config(&urls(&sims)), 4).await;
    let picker = start_routed(with_epp(routing_config(&urls(&sims))), 4).await;
    let names = addrs(&sims);
    let mut used = std::collections::HashSet::new();
    for p in 0..8 {
        let by_proxy = crate::routing::served_by(&proxy, &sims, &prefixed(p, 0)).await;
        let mut picks = Vec::new();
        for q in 1..3 {
            let mut s = Stream::open(&picker).await;
            let body = serde_json::to_vec(&prefixed(p, q)).unwrap();
            let ends = s.decide(&[], None, &body).await.endpoints();
            picks.push(names.iter().position(|n| *n == ends[0]).unwrap());
            // Finished before the next, as the proxy's were.
            s.respond("application/json", &[br#"{"choices":[]}"#], None)
                .await;
        }
        assert_eq!(picks, vec![by_proxy; 2], "prefix {p}");
        used.insert(by_proxy);
    }
    assert!(used.len() >= 2, "8 prefixes spread over replicas: {used:?}");
    assert_eq!(
        crate::routing::reasons(&picker, "prefix_new").await,
        8.0,
        "each prefix new to the picker once"
    );
}

#[tokio::test]
async fn three_pickers_given_the_same_inputs_pick_the_same_replica() {
    let sims = sims(4).await;
    // Three pickers sharing nothing but the replicas (and so their scrapes),
    // as three pods of the picker's Deployment behind one Gateway.
    let mut pickers = Vec::new();
    for _ in 0..3 {
        pickers.push(start_routed(with_epp(routing_config(&urls(&sims))), 4).await);
    }
    let names = addrs(&sims);
    let mut used = std::collections::HashSet::new();
    for key in 0..12 {
        // A shared prefix, and an agent session's turns (its id).
        let session = format!("agent-{key}");
        let cases: [(Vec<(&str, &str)>, serde_json::Value); 2] = [
            (vec![], prefixed(100 + key, 0)),
            (
                vec![("x-session-id", session.as_str())],
                prefixed(200 + key, 1),
            ),
        ];
        for (headers, body) in cases {
            let body = serde_json::to_vec(&body).unwrap();
            let mut picks = Vec::new();
            for gw in &pickers {
                let mut s = Stream::open(gw).await;
                let ends = s.decide(&headers, None, &body).await.endpoints();
                picks.push(ends);
                s.respond("application/json", &[br#"{"choices":[]}"#], None)
                    .await;
            }
            assert!(
                picks.iter().all(|p| p[0] == picks[0][0]),
                "key {key} {headers:?}: {picks:?}"
            );
            used.insert(names.iter().position(|n| *n == picks[0][0]).unwrap());
        }
    }
    assert!(
        used.len() >= 3,
        "24 keys spread over the replicas: {used:?}"
    );
}

const SSE: &[&[u8]] = &[
    b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
    b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" there\"}",
    b",\"finish_reason\":\"stop\"}]}\n\n",
    b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"total_tokens\":10}}\n\ndata: [DONE]\n\n",
];

#[tokio::test]
async fn a_streamed_answer_is_timed_and_counted_and_passes_through() {
    let sims = sims(1).await;
    let gw = start_gateway(with_epp(config_for(&urls(&sims))), 1).await;
    let metric = |name: &'static str| {
        let gw = &gw;
        async move { gateway_metric(gw, &format!("{name}{{model=\"sim-model\"}}")).await }
    };
    // The client asked for usage: the stream passes byte for byte.
    let mut s = Stream::open(&gw).await;
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "sim-model", "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hi"}],
    }))
    .unwrap();
    s.decide(&[], None, &body).await.endpoints();
    let passed = s.respond("text/event-stream", SSE, None).await;
    assert_eq!(passed, SSE.concat());
    assert_eq!(metric("sluice_generation_tokens_total").await, 3.0);
    assert_eq!(
        metric("sluice_time_to_first_token_seconds_count").await,
        1.0
    );
    assert_eq!(
        metric("sluice_inter_token_latency_seconds_count").await,
        2.0
    );
    // It did not: the usage chunk the picker asked for is taken out again.
    let mut s = Stream::open(&gw).await;
    let d = s.decide(&[], None, &chat("hi", true)).await;
    let Decided::Picked { body, .. } = &d else {
        panic!("{d:?}")
    };
    let sent: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true, "usage asked");
    let passed = String::from_utf8(s.respond("text/event-stream", SSE, None).await).unwrap();
    assert!(!passed.contains("usage"), "{passed}");
    assert!(passed.ends_with("data: [DONE]\n\n"), "{passed}");
    assert_eq!(metric("sluice_generation_tokens_total").await, 6.0);
    assert_eq!(in_flight(&gw), 0);
}

#[tokio::test]
async fn the_served_fallback_takes_the_attempt_over() {
    let sims = sims(2).await;
    let mut c = with_epp(config_for(&urls(&sims)));
    c.epp.fallbacks = 1;
    let gw = start_gateway(c, 2).await;
    let mut s = Stream::open(&gw).await;
    let ends = s.decide(&[], None, &chat("hi", false)).await.endpoints();
    let replica = |e: &str| {
        gw.state()
            .pool
            .replicas()
            .iter()
            .find(|r| r.base.ends_with(e))
            .unwrap()
            .in_flight()
    };
    assert_eq!((replica(&ends[0]), replica(&ends[1])), (1, 0));
    let h = response_head("application/json");
    let mut md = strings("envoy.lb", "unused", &[]);
    md.filter_metadata
        .get_mut("envoy.lb")
        .unwrap()
        .fields
        .insert(
            "x-gateway-destination-endpoint-served".into(),
            Value {
                kind: Some(Kind::StringValue(ends[1].clone())),
            },
        );
    s.send(Msg::ResponseHeaders(h), Some(md), false).await;
    assert!(matches!(s.next().await, Answer::ResponseHeaders(_)));
    assert_eq!((replica(&ends[0]), replica(&ends[1])), (0, 1));
}

#[tokio::test]
async fn a_dropped_stream_releases_its_replica_and_its_seat() {
    let sims = sims(1).await;
    let mut c = with_epp(config_for(&urls(&sims)));
    c.backends[0].max_concurrency = Some(1);
    c.flow_control.max_queue = 0;
    let gw = start_gateway(c, 1).await;
    let mut first = Stream::open(&gw).await;
    first
        .decide(&[], None, &chat("one", true))
        .await
        .endpoints();
    assert_eq!(in_flight(&gw), 1);
    // The one seat is taken and nothing may wait: dropped, 429.
    let mut s = Stream::open(&gw).await;
    let (status, _) = s.decide(&[], None, &chat("two", true)).await.immediate();
    assert_eq!(status, 429);
    // Envoy goes away mid-request: everything it held is released.
    drop(first);
    wait_until("in-flight released", Duration::from_secs(10), || async {
        in_flight(&gw) == 0
    })
    .await;
    let mut s = Stream::open(&gw).await;
    let ends = s.decide(&[], None, &chat("three", true)).await.endpoints();
    assert_eq!(ends[0], sims[0].addr.to_string(), "the seat came back");
}

/// A picker in front of one replica with one seat, taken by a first request
/// (`stream`ed or not) already picked: flow control holds the next ones.
async fn one_seat_taken(stream: bool) -> (Vec<SimHandle>, Gateway, Stream) {
    let sims = sims(1).await;
    let mut c = with_epp(config_for(&urls(&sims)));
    c.backends[0].max_concurrency = Some(1);
    let gw = start_gateway(c, 1).await;
    let mut first = Stream::open(&gw).await;
    first
        .decide(&[], None, &chat("one", stream))
        .await
        .endpoints();
    (sims, gw, first)
}

/// Until flow control holds one request.
async fn one_waiting(gw: &Gateway) {
    wait_until("a request waits", Duration::from_secs(10), || async {
        gateway_metric(gw, r#"sluice_flow_waiting_requests{model="sim-model"}"#).await == 1.0
    })
    .await;
}

#[tokio::test]
async fn a_full_pool_holds_the_request_until_a_seat_frees() {
    let (sims, gw, mut first) = one_seat_taken(false).await;
    let gw2 = &gw;
    let second = async move {
        let mut s = Stream::open(gw2).await;
        s.decide(&[], None, &chat("two", false)).await
    };
    let waiting = async {
        one_waiting(&gw).await;
        first
            .respond("application/json", &[br#"{"choices":[]}"#], None)
            .await;
    };
    let (d, ()) = tokio::join!(second, waiting);
    assert_eq!(d.endpoints()[0], sims[0].addr.to_string());
}

#[tokio::test]
async fn at_the_drain_deadline_the_pickers_streams_end_with_an_answer_not_a_reset() {
    // One request picked, its streamed response under way.
    let (_sims, gw, mut first) = one_seat_taken(true).await;
    let h = response_head("text/event-stream");
    first.send(Msg::ResponseHeaders(h), None, false).await;
    assert!(matches!(first.next().await, Answer::ResponseHeaders(_)));
    // A second held by flow control: the one seat is taken.
    let mut second = Stream::open(&gw).await;
    let held = tokio::spawn(async move { second.decide(&[], None, &chat("two", true)).await });
    one_waiting(&gw).await;

    // The drain deadline passes with both open.
    let stopping = tokio::spawn(gw.shutdown(Duration::from_millis(200)));
    // The held request is answered, 503 in its API's shape.
    let (status, body) = held.await.unwrap().immediate();
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "shutdown", "{body}");
    // The picked one's stream ends with gRPC's UNAVAILABLE, not a reset.
    let ended = tokio::time::timeout(Duration::from_secs(20), first.rx.message())
        .await
        .expect("the stream ends");
    let status = ended.expect_err("an error status ends it");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("shutting down"), "{status:?}");
    tokio::time::timeout(Duration::from_secs(20), stopping)
        .await
        .expect("the shutdown ends")
        .unwrap();
}

#[tokio::test]
async fn the_health_services_answer() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let sims = sims(1).await;
    let gw = start_gateway(with_epp(config_for(&urls(&sims))), 1).await;
    // A gateway whose only replica is down: alive, not ready.
    let gone = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!("http://{}", gone.local_addr().unwrap());
    drop(gone);
    let down = sluice::server::start(with_epp(config_for(&[dead])))
        .await
        .unwrap();
    let status = |gw: &Gateway, service: &'static str| {
        let url = format!("http://{}", gw.epp_health_addr.unwrap());
        async move {
            let channel = tonic::transport::Endpoint::from_shared(url)
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut c = HealthClient::new(channel);
            c.check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .ok()
            .map(|r| r.into_inner().status)
        }
    };
    let services = [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "",
    ];
    let serving = Some(ServingStatus::Serving as i32);
    wait_until("ready", Duration::from_secs(10), || async {
        let mut all = true;
        for svc in services {
            all &= status(&gw, svc).await == serving;
        }
        all
    })
    .await;
    let not = Some(ServingStatus::NotServing as i32);
    wait_until("not ready", Duration::from_secs(10), || async {
        status(&down, "readiness").await == not && status(&down, "").await == not
    })
    .await;
    assert_eq!(status(&down, "liveness").await, serving);
    assert_eq!(
        status(&down, "envoy.service.ext_proc.v3.ExternalProcessor").await,
        not
    );
}

/// A picker over a disaggregated model meeting only new prompts (a
/// hundred and more in 5-10 s, the sampling's threshold lowered from its
/// thousand, none homed by another gateway), sharing
/// prefix homes through Redis, samples each pool's homes apart, as the
/// proxy does: the prefill replicas it names and the decode replicas it
/// picks each start sampling at their own hundredth new prompt, and a
/// prompt used again is written in both pools.
#[tokio::test]
async fn a_picker_meeting_only_new_prompts_samples_each_pools_homes_apart() {
    let redis = crate::common::redis::start().await;
    let sims = sims(4).await;
    let mut c = with_epp(routing_config(&urls(&sims)));
    crate::routing::shared_table_sampled_soon(&mut c, &redis);
    for (i, b) in c.backends.iter_mut().enumerate() {
        b.role = if i < 2 { Role::Prefill } else { Role::Decode };
    }
    // Every prompt prefilled in the pool (none by a decode replica by
    // choice), so that every pick places a home in both pools.
    c.routing.disaggregation.local_when_idle = false;
    c.routing.disaggregation.local_stall_share = 0.0;
    let gw = start_routed(c, 4).await;
    let answer = br#"{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}"#;
    const PROMPTS: usize = crate::routing::SAMPLED_PROMPTS;
    // Every prefix twice: first all new, 16 at a time, then with another
    // question (the decode replica holds the prefix, not the question), one
    // at a time: two decode replicas two streams apart would spill one to
    // the other, and a spill leaves the table's home alone.
    for pass in 0..2 {
        for batch in (0..PROMPTS)
            .collect::<Vec<_>>()
            .chunks(if pass == 0 { 16 } else { 1 })
        {
            let gw = &gw;
            futures_util::future::join_all(batch.iter().map(|&p| async move {
                let body = serde_json::to_vec(&prefixed(p, pass)).unwrap();
                let mut s = Stream::open(gw).await;
                let d = s.decide(&[], None, &body).await;
                assert!(d.prefiller().0.is_some(), "prefilled in the pool: {d:?}");
                s.respond("application/json", &[answer], None).await;
            }))
            .await;
        }
        if pass == 0 {
            crate::routing::each_pool_sampled(&gw, &redis).await;
        }
    }
    crate::routing::each_pool_homes_all(&gw, &redis, PROMPTS).await;
    assert_eq!(pd_decisions(&gw, "remote").await, 2.0 * PROMPTS as f64);
    assert_eq!(in_flight(&gw), 0);
}

/// A short prompt of `i`'s own words (40 tokens or so: a decode replica
/// may prefill it), streamed or not.
fn short_chat(i: usize, stream: bool) -> Vec<u8> {
    let text: String = (0..20).map(|w| format!("q{i}w{w} ")).collect();
    chat(&text, stream)
}

/// One SSE event of content, as a chunk.
fn event(text: &str) -> Vec<u8> {
    format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n")
        .into_bytes()
}

/// Through the picker as through the proxy: a local prefill planned on a
/// decode replica decoding a stream (`local_stall_budget`) that the replica
/// refused (503) gives back what it spent of the allowance, so the next
/// prompt, which would not fit beside a charge kept, is prefilled there too.
#[tokio::test]
async fn a_local_prefill_refused_through_the_picker_gives_its_allowance_back() {
    use sluice::sim::disagg::Role as SimRole;
    // The prefill replica holds every request 30 s.
    let sims = [
        crate::disagg::replica(SimRole::Prefill, crate::disagg::holding).await,
        crate::disagg::replica(SimRole::Decode, |_| {}).await,
    ];
    let mut c = with_epp(routing_config(&urls(&sims)));
    c.backends[0].role = Role::Prefill;
    c.backends[1].role = Role::Decode;
    c.routing.disaggregation.local_stall_share = 0.009;
    let gw = start_routed(c, 2).await;
    // A first prompt of ~400 tokens queued in the pool through the
    // gateway's own proxy (sent remote: the pool was idle); its decode leg
    // has not started. (Through the picker its decode replica would count
    // it in flight from the pick on.)
    let url = format!("{}/v1/chat/completions", api(&gw));
    let queued = crate::disagg::first_prompt_queued(&sims[0], &url).await;
    // A stream of 200 events prefilled on the idle decode replica: 199 gaps
    // relayed, an allowance of 0.009 x 199 = 1.8 stalls.
    let mut earning = Stream::open(&gw).await;
    let d = earning.decide(&[], None, &short_chat(1, true)).await;
    assert_eq!(d.prefiller(), (None, true), "prefilled there while idle");
    let mut events: Vec<Vec<u8>> = (0..200).map(|i| event(&format!("t{i}"))).collect();
    events.push(b"data: [DONE]\n\n".to_vec());
    let chunks: Vec<&[u8]> = events.iter().map(Vec::as_slice).collect();
    earning.respond("text/event-stream", &chunks, None).await;
    assert_eq!(pd_decisions(&gw, "local_idle").await, 1.0);
    // A stream held mid-way on the decode replica (prefilled there: idle).
    let mut running = Stream::open(&gw).await;
    let d = running.decide(&[], None, &short_chat(2, true)).await;
    assert_eq!(d.prefiller(), (None, true));
    running
        .send(
            Msg::ResponseHeaders(response_head("text/event-stream")),
            None,
            false,
        )
        .await;
    assert!(matches!(running.next().await, Answer::ResponseHeaders(_)));
    // Within the allowance (one stall of 1.8), planned there; refused.
    let mut refused = Stream::open(&gw).await;
    let d = refused.decide(&[], None, &short_chat(3, false)).await;
    assert_eq!(d.prefiller(), (None, true), "within the allowance");
    refused
        .respond_with("503", "application/json", &[br#"{"error":"busy"}"#], None)
        .await;
    assert_eq!(pd_decisions(&gw, "local_stall_budget").await, 1.0);
    // One stall more: 2 of 1.8 had the refused one's been kept (then it
    // would go to the pool).
    let mut next = Stream::open(&gw).await;
    let d = next.decide(&[], None, &short_chat(4, false)).await;
    assert_eq!(d.prefiller(), (None, true), "prefilled there: {d:?}");
    let answer = br#"{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":40,"completion_tokens":2,"total_tokens":42}}"#;
    next.respond("application/json", &[answer], None).await;
    assert_eq!(pd_decisions(&gw, "local_stall_budget").await, 2.0);
    assert_eq!(
        pd_decisions(&gw, "remote").await,
        0.0,
        "the queued one has not ended"
    );
    drop((queued, running));
}

/// Through the picker a request is in flight on its decode replica from
/// the pick on, but the replica's sidecar sends it to the engine only after
/// its remote prefill: until then it is no stream that a local prefill
/// there would stall. With one such request waiting for the prefill pool,
/// the next prompt finds the decode replica idle and is prefilled there
/// (`local_idle`), as through the proxy.
#[tokio::test]
async fn a_request_waiting_for_its_remote_prefill_is_no_stream_on_its_decode_replica() {
    let sims = sims(2).await;
    let mut c = with_epp(routing_config(&urls(&sims)));
    c.backends[0].role = Role::Prefill;
    c.backends[1].role = Role::Decode;
    let gw = start_routed(c, 2).await;
    let names = addrs(&sims);
    // A first prompt of ~300 tokens named to the prefill replica (the pool
    // was idle), its prefill not done: the pool is busy now, and the
    // request in flight on the decode replica.
    let mut waiting = Stream::open(&gw).await;
    let long: String = (0..200).map(|w| format!("q0w{w} ")).collect();
    let d = waiting.decide(&[], None, &chat(&long, false)).await;
    assert_eq!(d.prefiller().0, Some(names[0].as_str()), "{d:?}");
    assert_eq!(in_flight(&gw), 1);
    // The decode replica decodes nothing: a short prompt is prefilled there.
    let mut next = Stream::open(&gw).await;
    let d = next.decide(&[], None, &short_chat(1, false)).await;
    assert_eq!(d.endpoints(), [names[1].clone()]);
    assert_eq!(d.prefiller(), (None, true), "prefilled there");
    // That one is at the engine (no remote prefill to wait for): a stream
    // there, so the next prompt goes to the busy pool.
    let mut third = Stream::open(&gw).await;
    let d = third.decide(&[], None, &short_chat(2, false)).await;
    assert_eq!(d.prefiller().0, Some(names[0].as_str()), "not idle: {d:?}");
    let answer = br#"{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":30,"completion_tokens":2,"total_tokens":32}}"#;
    next.respond("application/json", &[answer], None).await;
    assert_eq!(pd_decisions(&gw, "local_idle").await, 1.0);
    drop((waiting, third));
}
