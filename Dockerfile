# Sluice: a small, non-root image (distroless, the binary and nothing else).
#   docker build -t sluice .
#   docker run --rm -p 8080:8080 -p 9090:9090 sluice serve --backend http://vllm:8000
#   docker run --rm sluice demo --duration 20s
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# No debug info in the image; the binary is stripped.
ENV CARGO_PROFILE_RELEASE_DEBUG=false \
    CARGO_PROFILE_RELEASE_STRIP=symbols
# Dependencies first, so source edits reuse the cached dependency layer.
COPY Cargo.toml Cargo.lock ./
COPY .cargo ./.cargo
COPY benches ./benches
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked --bin sluice \
    && rm -rf src
COPY src ./src
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin sluice

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
COPY config/sluice.yaml /etc/sluice/sluice.yaml
USER 65532:65532
# 8080: the OpenAI-compatible API; 9090: metrics, probes, /admin (keep it private).
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["serve", "--config", "/etc/sluice/sluice.yaml"]
