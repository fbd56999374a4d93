//! The simulated replica's GPUs as NVIDIA's dcgm-exporter shows them
//! (`GET /dcgm/metrics`): utilisation and framebuffer memory, one series per
//! GPU of the profile, with dcgm-exporter's labels (`gpu`, `UUID`,
//! `pci_bus_id`, `device`, `modelName`, `Hostname`, `DCGM_FI_DRIVER_VERSION`).
//!
//! - `DCGM_FI_DEV_GPU_UTIL` (percent) and `DCGM_FI_PROF_GR_ENGINE_ACTIVE`
//!   (ratio): the share of the last second the engine spent running steps
//!   (each step's interval is recorded in [`Busy`]; tensor-parallel GPUs
//!   run every step together, so they report alike).
//! - `DCGM_FI_DEV_FB_USED` / `DCGM_FI_DEV_FB_FREE` (MiB): the profile's fixed
//!   part per GPU (weights, activations, CUDA context) plus the KV blocks in
//!   use. A real vLLM reserves its whole KV pool at start, so its used
//!   memory is flat; the simulator reports the pool's used part instead, so
//!   KV pressure and leaks show in memory as in the reference articles'
//!   memory-leak pattern.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::Duration;

use tokio::time::Instant;

use super::profile::Profile;

/// Utilisation is measured over this much of the recent past (as
/// dcgm-exporter's default 1 s sampling of `DCGM_FI_DEV_GPU_UTIL`).
const SPAN: Duration = Duration::from_secs(1);

/// The NVIDIA driver the exporter reports (a current datacenter branch).
const DRIVER: &str = "550.127.08";

/// The engine's recent steps, as (start, end) intervals; a step in progress
/// is recorded with its planned end.
#[derive(Default)]
pub(crate) struct Busy {
    steps: parking_lot::Mutex<VecDeque<(Instant, Instant)>>,
}

impl Busy {
    pub(crate) fn record(&self, start: Instant, end: Instant) {
        let mut steps = self.steps.lock();
        while steps.front().is_some_and(|(_, e)| *e + SPAN < start) {
            steps.pop_front();
        }
        steps.push_back((start, end));
    }

    /// Share (0 to 1) of the last second covered by steps.
    pub(crate) fn utilisation(&self, now: Instant) -> f64 {
        let from = now.checked_sub(SPAN).unwrap_or(now);
        let busy: Duration = self
            .steps
            .lock()
            .iter()
            .map(|&(s, e)| e.min(now).saturating_duration_since(s.max(from)))
            .sum();
        (busy.as_secs_f64() / SPAN.as_secs_f64()).clamp(0.0, 1.0)
    }
}

/// What the exporter shows of one replica.
pub(crate) struct Gpus<'a> {
    pub profile: &'a Profile,
    /// KV-cache usage now (0 to 1).
    pub kv_usage: f64,
    /// Engine utilisation over the last second (0 to 1).
    pub utilisation: f64,
    /// Names the host (`Hostname`) and seeds the GPUs' UUIDs.
    pub host: &'a str,
}

/// The exposition, dcgm-exporter's text format.
pub(crate) fn render(g: &Gpus<'_>) -> String {
    let p = g.profile;
    let mib = 1024.0 * 1024.0;
    let pool =
        f64::from(p.num_blocks) * f64::from(p.block_size) * f64::from(p.kv_bytes_per_token) / mib;
    let used = (f64::from(p.fixed_mib) + pool * g.kv_usage.clamp(0.0, 1.0))
        .round()
        .min(f64::from(p.gpu_memory_mib));
    let free = f64::from(p.gpu_memory_mib) - used;
    let util = (g.utilisation * 100.0).round();
    let seed = super::text::seed_of(g.host.as_bytes());
    let labels: Vec<String> = (0..p.gpus.max(1))
        .map(|i| {
            let h = super::text::mix(seed ^ u64::from(i));
            let h2 = super::text::mix(h);
            format!(
                "gpu=\"{i}\",UUID=\"GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}\",pci_bus_id=\"00000000:{:02X}:00.0\",device=\"nvidia{i}\",modelName=\"{}\",Hostname=\"{}\",DCGM_FI_DRIVER_VERSION=\"{DRIVER}\"",
                h >> 32,
                (h >> 16) & 0xffff,
                h & 0xffff,
                h2 >> 48,
                h2 & 0xffff_ffff_ffff,
                0x18 + i * 0x10,
                p.gpu,
                g.host.replace('"', "'"),
            )
        })
        .collect();
    let mut out = String::new();
    let families: [(&str, &str, f64); 4] = [
        ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", util),
        (
            "DCGM_FI_DEV_FB_FREE",
            "Framebuffer memory free (in MiB).",
            free,
        ),
        (
            "DCGM_FI_DEV_FB_USED",
            "Framebuffer memory used (in MiB).",
            used,
        ),
        (
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
            "Ratio of time the graphics engine is active.",
            g.utilisation,
        ),
    ];
    for (name, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for l in &labels {
            let _ = writeln!(out, "{name}{{{l}}} {value}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utilisation_is_the_busy_share_of_the_last_second() {
        let busy = Busy::default();
        let t = Instant::now();
        assert_eq!(busy.utilisation(t), 0.0);
        // 300 ms of steps in the last second, one more long before.
        busy.record(t, t + Duration::from_millis(100));
        busy.record(
            t + Duration::from_millis(500),
            t + Duration::from_millis(700),
        );
        let now = t + Duration::from_millis(900);
        assert!((busy.utilisation(now) - 0.3).abs() < 1e-9);
        // A step still running counts up to now.
        busy.record(now, now + Duration::from_millis(50));
        assert!((busy.utilisation(now + Duration::from_millis(10)) - 0.31).abs() < 1e-9);
        // Two seconds later it is all in the past.
        assert_eq!(busy.utilisation(now + Duration::from_secs(2)), 0.0);
    }

    #[test]
    fn one_series_per_gpu_with_the_exporters_labels() {
        let p = super::super::profile::by_name("h100x4-llama3-70b")
            .copied()
            .unwrap_or(super::super::profile::PROFILES[0]);
        let text = render(&Gpus {
            profile: &p,
            kv_usage: 0.5,
            utilisation: 0.25,
            host: "sim-host",
        });
        assert_eq!(text.matches("DCGM_FI_DEV_GPU_UTIL{").count(), 4, "{text}");
        assert!(text.contains("# TYPE DCGM_FI_DEV_FB_USED gauge"), "{text}");
        assert!(
            text.contains("gpu=\"3\",UUID=\"GPU-") && text.contains("device=\"nvidia3\""),
            "{text}"
        );
        assert!(text.contains("} 25\n"), "{text}");
        let used: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with("DCGM_FI_DEV_FB_USED{"))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse().ok())
            .collect();
        let free: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with("DCGM_FI_DEV_FB_FREE{"))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse().ok())
            .collect();
        assert_eq!(used.len(), 4);
        assert_eq!(used[0] + free[0], f64::from(p.gpu_memory_mib));
        assert!(used[0] > f64::from(p.fixed_mib), "KV in use counts");
    }
}
