# ip-masq-agent with an eBPF SNAT datapath.
#
#   make demo      run the agent in a throwaway namespace sandbox (root)
#   make test      all tests: unit, BPF datapath and end to end, and the kernel matrix (root)
#   make test-kernels  the BPF tests on every kernel of the matrix and the host's (root)
#   make image     the runtime image, built here from the Debian archive, loaded into podman (root)
#   make bench     benchmarks (root)
#   make generate  rebuild the BPF objects and Go bindings (clang)

GO       ?= go
BIN      := bin/ip-masq-agent
# The release version: the VERSION file is its one source (the manifests' image tags and the
# chart's appVersion are checked against it by deploy's tests).
VERSION  ?= $(shell cat VERSION)
# The commit, recorded here rather than left to Go's VCS stamping, which a git worktree or a
# GOFLAGS=-buildvcs=false defeats.
COMMIT   ?= $(shell git rev-parse HEAD 2>/dev/null)$(shell test -z "$$(git status --porcelain 2>/dev/null)" || echo -dirty)
LDFLAGS  := -s -w -X github.com/ip-masq-agent/ip-masq-agent/pkg/version.Version=$(VERSION) \
	-X github.com/ip-masq-agent/ip-masq-agent/pkg/version.Commit=$(COMMIT)
# Packages whose tests need nothing but Go; the rest need root and the tools `make deps` installs.
TESTFLAGS ?= -count=1 -timeout 25m

# Pinned clang flags for the BPF objects (read by the go:generate lines through the environment).
export BPF_CFLAGS := -O2 -g -Wall -Werror -mcpu=v3

.PHONY: all build image test test-main test-late test-k8s-e2e-smoke coredns-idle k8s-e2e-idle test-kernels test-k8s-e2e unit e2e demo generate check-generate bench lint deps clean k8s k8s-e2e coredns cluster-up cluster-down

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/ip-masq-agent

## image: the runtime image without pulling anything: mmdebstrap makes a Debian root filesystem
## (internal/image.Runtime: the essential set and iptables) with bin/ip-masq-agent in it, written
## as an OCI archive ($(IMAGE_OUT), for `ctr images import` or a registry) and loaded into podman
## as ghcr.io/ip-masq-agent/ip-masq-agent:$(VERSION), the reference the manifests run.
## Reproducible: every timestamp is SOURCE_DATE_EPOCH, by default the last commit's time.
IMAGE_OUT ?= bin/ip-masq-agent-image.tar
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null)
image: deps build
	SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) $(GO) run ./internal/image/mkimage -bin $(BIN) -out $(IMAGE_OUT) -version $(VERSION)
	podman load --input $(IMAGE_OUT)

## test: every test, privileged ones included (run as root; CI=true makes a test that cannot run fail).
## The cluster tests run the Kubernetes components make k8s builds (once per version) and the
## CoreDNS make coredns builds.
## Three phases. First the main packages (test-main), with make coredns and make k8s-e2e beside
## them at the lowest CPU priority, which takes only what their waits leave. Then the container
## and cluster suites (test-late), one package at a time: their image builds (mmdebstrap, dpkg)
## and clusters take the machine's CPU and disk for minutes, which would slow the time-bound
## end-to-end tests of the first phase; beside them, in a cluster of its own, Kubernetes' e2e
## smoke set (test-k8s-e2e-smoke: the masquerade focus without its slow tests, on the default
## backend). The kernel matrix comes last, alone (it keeps both CPUs busy), on the kernels other
## than the host's (whose run is the first phase's), with the end-to-end suite on the oldest.
## make test-k8s-e2e runs the rest of Kubernetes' e2e tests.
LATE_TESTS := ./test/container ./internal/cluster ./test/cluster ./internal/vm
test: deps build k8s
	$(MAKE) -j3 --output-sync=target test-late test-k8s-e2e-smoke
	$(MAKE) test-kernels KERNELS="$(VM_KERNELS)" KERNEL_E2E=oldest

# make test's phases, by themselves: the main packages; make coredns, then make k8s-e2e, at the
# lowest CPU priority; the container and cluster suites; Kubernetes' e2e smoke set.
test-main:
	$(GO) test $(TESTFLAGS) $$($(GO) list ./... | grep -v -x -F "$$($(GO) list $(LATE_TESTS) ./test/kernels)")
coredns-idle:
	nice -n 19 $(MAKE) coredns
k8s-e2e-idle: coredns-idle
	nice -n 19 $(MAKE) k8s-e2e
test-late: test-main coredns-idle
	$(GO) test $(TESTFLAGS) -p 1 -skip '$(K8S_E2E_TESTS)' $(LATE_TESTS)
test-k8s-e2e-smoke: test-main k8s-e2e-idle
	IP_MASQ_AGENT_K8S_E2E=smoke $(GO) test -count=1 -timeout 40m -v -run '^TestKubernetesE2E$$' ./test/cluster

## test-kernels: pkg/bpf, pkg/bpfbackend, the end-to-end suite on the BPF backend and the demo,
## on each kernel of KERNELS: Debian's kernels booted in QEMU (test/kernels, internal/vm; the
## packages are fetched once into bin/kernels) and the host's ("host"). KERNEL_E2E=oldest runs
## the end-to-end suite on the oldest only; KERNEL_SUITES and KERNEL_JOBS: test/kernels.
VM_KERNELS    ?= 5.10 6.1 6.12
KERNELS       ?= $(VM_KERNELS) host
KERNEL_E2E    ?= all
KERNEL_SUITES ?=
test-kernels: deps build
	KERNELS="$(KERNELS)" KERNEL_E2E="$(KERNEL_E2E)" KERNEL_SUITES="$(KERNEL_SUITES)" \
		$(GO) test -count=1 -timeout 150m -v ./test/kernels

## e2e: the end-to-end suite only, against the binary in bin/ (root)
e2e: deps build
	IP_MASQ_AGENT_BIN=$(CURDIR)/$(BIN) $(GO) test $(TESTFLAGS) -v ./test/e2e

## unit: only the tests that need no privileges
unit:
	$(GO) test -count=1 -short ./...

## demo: a throwaway namespace sandbox (two pods, the node running the agent, an external host);
## DEMO_BACKEND=iptables shows the fallback datapath
DEMO_BACKEND ?= bpf
demo: deps build
	$(GO) run ./test/demo -bin $(BIN) -backend $(DEMO_BACKEND)

## k8s: the Kubernetes components the cluster tests run, built from the Go module proxy by the
## tools module in test/cluster/k8s (its own go.mod: k8s.io/kubernetes and its staging modules at
## one version) and kept in bin/k8s/VERSION, so a version is built once. Cold: about 5 minutes.
K8S_MODULE     := test/cluster/k8s
K8S_VERSION    := $(shell awk '$$1 == "k8s.io/kubernetes" { print $$2 }' $(K8S_MODULE)/go.mod)
K8S_BIN        := bin/k8s/$(K8S_VERSION)
K8S_COMPONENTS := kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl
K8S_LDFLAGS    := -s -w -X k8s.io/component-base/version.gitVersion=$(K8S_VERSION) \
	-X k8s.io/component-base/version.gitMajor=$(word 1,$(subst ., ,$(K8S_VERSION:v%=%))) \
	-X k8s.io/component-base/version.gitMinor=$(word 2,$(subst ., ,$(K8S_VERSION:v%=%))) \
	-X k8s.io/client-go/pkg/version.gitVersion=$(K8S_VERSION)
k8s: $(K8S_BIN)/.built
$(K8S_BIN)/.built: $(K8S_MODULE)/go.mod $(K8S_MODULE)/go.sum
	mkdir -p $(K8S_BIN)
	cd $(K8S_MODULE) && CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(K8S_LDFLAGS)" \
		-o $(CURDIR)/$(K8S_BIN)/ $(addprefix k8s.io/kubernetes/cmd/,$(K8S_COMPONENTS))
	touch $@

## k8s-e2e: Kubernetes' sig-network end-to-end tests and what their pods run, built by the tools
## module into $(K8S_BIN): e2e-network.test (test/cluster/k8s/e2enet: the tests of
## test/e2e/network and test/e2e/common/network, with upstream e2e.test's flags), ginkgo (the
## command that runs it in parallel processes, of the version the tests are built with), agnhost (its
## version, the image tag the tests ask for, read from upstream's test/images/agnhost/VERSION)
## and regression-issue-74839. internal/cluster.BuildE2EImages packs them. Once per version.
k8s-e2e: $(K8S_BIN)/.e2e-built $(K8S_BIN)/ginkgo
$(K8S_BIN)/.e2e-built: $(K8S_MODULE)/go.mod $(K8S_MODULE)/go.sum $(wildcard $(K8S_MODULE)/e2enet/*.go)
	mkdir -p $(K8S_BIN)
	cd $(K8S_MODULE) && CGO_ENABLED=0 $(GO) test -c -trimpath -vet=off -ldflags "$(K8S_LDFLAGS)" \
		-o $(CURDIR)/$(K8S_BIN)/e2e-network.test ./e2enet
	cd $(K8S_MODULE) && agnhost=$$($(GO) list -m -f '{{.Dir}}' k8s.io/kubernetes)/test/images/agnhost && \
		CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w -X main.Version=$$(cat $$agnhost/VERSION)" \
		-o $(CURDIR)/$(K8S_BIN)/agnhost k8s.io/kubernetes/test/images/agnhost
	cd $(K8S_MODULE) && CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" \
		-o $(CURDIR)/$(K8S_BIN)/regression-issue-74839 k8s.io/kubernetes/test/images/regression-issue-74839
	touch $@
$(K8S_BIN)/ginkgo: $(K8S_MODULE)/go.mod $(K8S_MODULE)/go.sum
	mkdir -p $(K8S_BIN)
	cd $(K8S_MODULE) && CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o $(CURDIR)/$@ github.com/onsi/ginkgo/v2/ginkgo

## coredns: CoreDNS for the cluster tests' DNS (cluster.ClusterOptions.DNS), built from the Go
## module proxy by its own module in test/cluster/coredns (a narrowed plugin list; coredns's
## dependencies would otherwise move the tools module's) and kept in bin/coredns/VERSION.
COREDNS_MODULE  := test/cluster/coredns
COREDNS_VERSION := $(shell awk '$$1 == "require" && $$2 == "github.com/coredns/coredns" { print $$3 } $$1 == "github.com/coredns/coredns" { print $$2 }' $(COREDNS_MODULE)/go.mod)
COREDNS_BIN     := bin/coredns/$(COREDNS_VERSION)/coredns
coredns: $(COREDNS_BIN)
$(COREDNS_BIN): $(COREDNS_MODULE)/go.mod $(COREDNS_MODULE)/go.sum $(COREDNS_MODULE)/main.go
	mkdir -p $(dir $@)
	cd $(COREDNS_MODULE) && CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o $(CURDIR)/$@ .

## test-k8s-e2e: Kubernetes' own sig-network e2e tests (make k8s-e2e) on a two-node cluster with
## CoreDNS: the images they need built and checked, then the masquerade focus without the agent
## (the reference) and with the chart on each backend, and the sig-network conformance tests
## without the agent and on the default backend (root; K8S_E2E=smoke: the focus without its slow
## tests, on the default backend, as make test runs it). About 30 minutes on 2 CPUs. JUnit
## reports and logs: bin/k8s-e2e.
K8S_E2E       ?= full
K8S_E2E_TESTS := ^(TestE2EImages|TestKubernetesE2E)$$
test-k8s-e2e: deps build k8s coredns k8s-e2e
	$(GO) test -count=1 -timeout 30m -v -run '^TestE2EImages$$' ./internal/cluster
	IP_MASQ_AGENT_K8S_E2E=$(K8S_E2E) $(GO) test -count=1 -timeout 8h -v -run '^TestKubernetesE2E$$' ./test/cluster

## cluster-up: a Kubernetes cluster of CLUSTER_NODES nodes (control plane, containerd, kubelet,
## kube-proxy, bridge CNI; CoreDNS with CLUSTER_DNS=1) in namespaces of its own, as the cluster
## tests run it, until make cluster-down (root). It imports $(IMAGE_OUT) into the nodes when
## make image made one.
CLUSTER_DIR        ?= bin/cluster
CLUSTER_PROXY_MODE ?= iptables
CLUSTER_NODES      ?= 1
CLUSTER_DNS        ?=
cluster-up: deps build k8s $(if $(CLUSTER_DNS),coredns)
	$(GO) run ./test/cluster/up -dir $(CLUSTER_DIR) -proxy-mode $(CLUSTER_PROXY_MODE) -nodes $(CLUSTER_NODES) $(if $(CLUSTER_DNS),-dns) $(if $(wildcard $(IMAGE_OUT)),-image $(IMAGE_OUT))

## cluster-down: tear down what make cluster-up runs, and wait until nothing of it is left; then
## remove what dead runs (a killed cluster-up, a test binary killed by its timeout) left
cluster-down:
	@pid=$$(cat $(CLUSTER_DIR)/pid 2>/dev/null) || { echo "no cluster is up ($(CLUSTER_DIR)/pid)"; }; \
	if [ -n "$$pid" ] && kill -TERM $$pid 2>/dev/null; then while kill -0 $$pid 2>/dev/null; do sleep 0.5; done; echo "cluster down"; fi
	$(GO) run ./test/cluster/up -reap

generate:
	$(GO) generate ./...

## check-generate: regenerate the BPF objects, bindings and event names and fail when they differ from the commit
check-generate: generate
	@git diff --exit-code --stat -- '*.o' '*_bpfel.go' '*_string.go' || { echo "generated BPF files are stale: run make generate and commit"; exit 1; }

## bench: BPF_PROG_TEST_RUN microbenchmarks, the iptables control plane beside kube-proxy's rules,
## the nftables apply and counter reads, and end-to-end benchmarks (no agent; BPF, iptables and
## nftables, each also with --random-fully=false), and a big node's (a million flows, conntrack's
## memory per flow, 100k CIDRs swapped live, two CPUs at once);
## writes docs/benchmarks.md and the plots in docs/. Raw results stay in $(BENCH_OUT).
BENCH_OUT ?= bin/bench
bench: build
	./test/deps.sh bench
	mkdir -p $(BENCH_OUT)
	$(GO) test -run '^$$' -bench 'Egress|Ingress|TestRunFloor|Connection|SourceRules' -benchtime 3000x -count 3 -timeout 30m ./pkg/bpf | tee $(BENCH_OUT)/micro.txt
	$(GO) test -run '^$$' -bench 'SyncPolicy|CheckPolicy' -benchtime 10x -timeout 30m ./pkg/bpf | tee $(BENCH_OUT)/control.txt
	$(GO) test -run '^$$' -bench 'Apply|Counters' -benchtime 5x -timeout 30m ./pkg/nftables | tee $(BENCH_OUT)/nftables.txt
	$(GO) test -run '^$$' -bench BenchmarkSweep -benchtime 5x -benchmem -timeout 30m ./pkg/bpf | tee $(BENCH_OUT)/sweep.txt
	$(GO) test -run '^$$' -bench BenchmarkMigrate -benchtime 5x -count 3 -timeout 30m ./pkg/bpf | tee $(BENCH_OUT)/migrate.txt
	$(GO) test -run '^$$' -bench ControlPlane -benchtime 20x -count 5 -timeout 30m ./pkg/iptables | tee $(BENCH_OUT)/iptables-control.txt
	$(GO) test -run '^$$' -bench EndToEnd -benchtime 1x -timeout 60m ./test/bench -args -out $(abspath $(BENCH_OUT))
	$(GO) test -run '^$$' -bench NATLoad -benchtime 1x -timeout 20m ./test/bench | tee $(BENCH_OUT)/natload.txt
	$(GO) test -run '^$$' -bench Parallel -benchtime 20000x -count 3 -timeout 10m ./pkg/bpf | tee $(BENCH_OUT)/parallel.txt
	$(GO) test -run '^$$' -bench 'TrieWrite|SyncPolicyReplace/cidrs=100000$$|SyncPolicyChange' -benchtime 5x -count 3 -timeout 20m ./pkg/bpf | tee $(BENCH_OUT)/synctries.txt
	mkdir -p $(BENCH_OUT)/lean
	$(GO) test -run '^$$' -bench 'Floor' -benchtime 3000x -count 3 -timeout 10m ./pkg/bpf | tee $(BENCH_OUT)/lean/floor.txt
	$(GO) test -run '^$$' -bench 'MillionFlows|ConntrackMemory|LiveCIDRs' -benchtime 1x -timeout 60m ./test/bench -args -out $(abspath $(BENCH_OUT))
	KERNELS="$(KERNELS)" $(GO) test -run '^$$' -bench Kernels -benchtime 1x -timeout 120m ./test/kernels -args -out $(abspath $(BENCH_OUT))
	$(GO) run ./test/bench/report -in $(BENCH_OUT) -docs docs

## lint: gofmt; go build (each package without its tests, which go vet's build would hide); go vet
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) build ./...
	$(GO) vet ./...

deps:
	./test/deps.sh

clean:
	rm -rf bin

## headers: refresh the vendored libbpf and kernel uapi headers from the pinned Debian packages
.PHONY: headers
headers:
	./headers/update.sh
