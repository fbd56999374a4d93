//! Config of endpoint-picker mode (`epp`): Sluice as the picker of a
//! Gateway API Inference Extension `InferencePool`, over Envoy's ext_proc.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// `epp`: beside the API listener, the gateway answers Envoy's external
/// processing (`envoy.service.ext_proc.v3.ExternalProcessor`) as the
/// `InferencePool`'s endpoint picker, deciding with the same routing and
/// flow control as the proxy. Off without `listen`. The namespaces are the
/// Gateway API Inference Extension protocol's defaults; change them only
/// with the data plane's.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EppConfig {
    /// The ext_proc gRPC listener (the `InferencePool`'s
    /// `endpointPickerRef` port, 9002 by convention). Unset: no picker.
    pub listen: Option<SocketAddr>,
    /// The gRPC health listener (`grpc.health.v1`: `liveness`,
    /// `readiness`, the processor's own name and `""`), for the probes and
    /// Envoy's health check of the picker.
    pub health_listen: SocketAddr,
    /// Where the data plane puts the endpoints a request may go to
    /// (`metadata_context.filter_metadata`, key
    /// `x-gateway-destination-endpoint-subset`).
    pub subset_hint_namespace: String,
    /// The dynamic-metadata namespace of the pick
    /// (`x-gateway-destination-endpoint`) and of the served endpoint the
    /// data plane reports (`x-gateway-destination-endpoint-served`).
    pub destination_namespace: String,
    /// Replicas named after the pick, in order, for the data plane's
    /// retries (`ip:port,ip:port,...`); 0: the pick alone.
    pub fallbacks: u32,
}

impl Default for EppConfig {
    fn default() -> Self {
        Self {
            listen: None,
            health_listen: SocketAddr::from(([0, 0, 0, 0], 9003)),
            subset_hint_namespace: "envoy.lb.subset_hint".into(),
            destination_namespace: "envoy.lb".into(),
            fallbacks: 2,
        }
    }
}
