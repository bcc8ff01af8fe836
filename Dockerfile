# syntax=docker/dockerfile:1
#
# Builder: regenerates the BPF objects with the pinned clang (Debian bookworm's clang 14, the
# same as `make generate` uses in CI) and builds a static binary stamped with VERSION.
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
ARG VERSION=dev
RUN make generate \
 && make build VERSION="${VERSION}"

# Final: the binary plus iptables for the fallback backend. Debian's iptables package carries both
# modes (iptables-nft and iptables-legacy, and the ip6tables variants); nothing else is added.
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iptables \
 && rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /usr/share/doc /usr/share/man
COPY --from=build /src/bin/ip-masq-agent /usr/local/bin/ip-masq-agent
ENTRYPOINT ["/usr/local/bin/ip-masq-agent"]
