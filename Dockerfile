# Sluice: a small, non-root image (distroless, the binary and nothing else).
#   docker build -t sluice .
#   docker run --rm -p 8080:8080 -p 9090:9090 sluice serve --backend http://vllm:8000
#   docker run --rm sluice demo --duration 20s
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# BOLT (LLVM's post-link optimiser) lays the binary out from a profile of its
# own work: 1-3% more requests per second on a capped core than the same build
# without it (scripts/bolt.sh; docs/benchmarks-log.md, "2026-11-26 afternoon").
# On x86-64 only: BOLT 15 does not instrument arm64 binaries, which get the
# plain release build.
RUN if [ "$(uname -m)" = x86_64 ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends 'bolt-15=1:15.0.6-4*' \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# No debug info in the image. Symbols stay until BOLT is done (it needs
# them), then the binary is stripped.
ENV CARGO_PROFILE_RELEASE_DEBUG=false
# Dependencies first, so source edits reuse the cached dependency layer:
# built as scripts/bolt.sh builds (its target directory, its link flags).
COPY Cargo.toml Cargo.lock ./
COPY .cargo ./.cargo
COPY benches ./benches
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && CARGO_TARGET_DIR=target/bolt RUSTFLAGS="-C link-args=-Wl,--emit-relocs" \
       cargo build --release --locked --bin sluice \
    && rm -rf src
COPY src ./src
COPY scripts/bolt.sh ./scripts/bolt.sh
# The build, its training load on loopback (the gateway before `sluice sim`,
# driven by `sluice bench`), the layout, a check under the same load.
RUN touch src/main.rs src/lib.rs \
    && if [ "$(uname -m)" = x86_64 ]; then \
        scripts/bolt.sh /src/sluice; \
    else \
        CARGO_TARGET_DIR=target/bolt RUSTFLAGS="-C link-args=-Wl,--emit-relocs" \
            cargo build --release --locked --bin sluice \
        && cp target/bolt/release/sluice /src/sluice; \
    fi \
    && strip /src/sluice

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/sluice /usr/local/bin/sluice
COPY config/sluice.yaml /etc/sluice/sluice.yaml
USER 65532:65532
# 8080: the OpenAI-compatible API; 9090: metrics, probes, /admin (keep it private).
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["serve", "--config", "/etc/sluice/sluice.yaml"]
