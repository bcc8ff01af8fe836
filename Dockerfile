# syntax=docker/dockerfile:1
#
# For users with a registry. `make image` builds the same image here without pulling anything
# (internal/image: mmdebstrap from the Debian archive); internal/image's tests keep this file
# and that build in step (suite, packages, removals, binary, user, entrypoint).
#
# Builder: regenerates the BPF objects with the pinned clang (Debian bookworm's clang 14, the
# same as `make generate` uses in CI) and builds the static binary as make build does (release
# version from VERSION, commit from git).
FROM golang:1.26-bookworm AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends clang-14 llvm-14 \
 && ln -s /usr/bin/clang-14 /usr/local/bin/clang \
 && ln -s /usr/bin/llvm-strip-14 /usr/local/bin/llvm-strip \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN make generate \
 && make build

# Final: the binary plus the fallback backends' tools: Debian's iptables package carries both modes
# (iptables-nft and iptables-legacy, and the ip6tables variants), its nftables package the nft
# command the nftables backend runs; nothing else is added.
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iptables nftables \
 && rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man /var/cache/debconf/*-old
COPY --from=build /src/bin/ip-masq-agent /usr/local/bin/ip-masq-agent
# Root: the agent needs its capabilities (the DaemonSet runs it as uid 0 and drops all others).
USER 0:0
ENTRYPOINT ["/usr/local/bin/ip-masq-agent"]
