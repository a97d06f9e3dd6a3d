# gdrpc: make demo | make test | make bench | make lint | make proto
GO       ?= go
PKGS     ?= ./...
APT_PKGS := gcc libucx-dev ucx-utils pkg-config protobuf-compiler iproute2 python3-grpcio
GO_MIN   := 1.26

.PHONY: all deps build abi test test-gpu gpu-bins bench bench-twohosts lint proto demo gdrinfo

all: build

# deps checks the Go toolchain and installs the system packages the build and tests
# need, only those missing (gcc among them: the UCX binding is cgo).
deps:
	@v=$$($(GO) env GOVERSION 2>/dev/null | sed 's/^go//'); \
	if [ -z "$$v" ] || [ "$$(printf '%s\n' $(GO_MIN) "$$v" | sort -V | head -n1)" != "$(GO_MIN)" ]; then \
		echo "gdrpc needs Go $(GO_MIN) or later (found: $${v:-none}); see https://go.dev/dl" >&2; exit 1; \
	fi
	@missing=""; for p in $(APT_PKGS); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		SUDO=; if [ "$$(id -u)" != 0 ]; then \
			command -v sudo >/dev/null || { echo "apt-get needs root: run this as root, or install:$$missing" >&2; exit 1; }; \
			SUDO=sudo; \
		fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

build:
	$(GO) build $(PKGS)
	CGO_ENABLED=0 $(GO) build $(PKGS)
	$(GO) build -tags nordma $(PKGS)

# abi checks rdma/ucxabi.h, gdrpc's own declarations of the UCX ABI, against the UCX
# development headers; missing headers fail it (elsewhere the check skips
# without them unless GDRPC_REQUIRE names ucx-headers).
abi: deps
	GDRPC_REQUIRE=ucx,ucx-headers $(GO) test -count=1 -run '^TestUCXABI' ./rdma

# test demands UCX and its headers (make deps installs both): a missing UCX
# fails instead of skipping. The demo's own run (what make demo does, over
# UCX) is skipped under -race and has no UCX without cgo: it runs once more
# with UCX required.
test: deps build abi
	$(GO) vet $(PKGS)
	CGO_ENABLED=0 $(GO) vet $(PKGS)
	GDRPC_REQUIRE=ucx,ucx-headers $(GO) test -race -timeout 25m $(PKGS)
	CGO_ENABLED=0 $(GO) test -timeout 10m $(PKGS)
	GDRPC_REQUIRE=ucx $(GO) test -count=1 -run '^TestDemo$$' ./examples/demo

# test-gpu runs the tests of the packages with GPU paths on a GPU host, where
# a missing GPU or UCX fails them instead of skipping. UCX_DIR names a UCX
# installation to use instead of the system's (a CUDA-enabled build: its lib/
# goes first on the library path); GPU paths are verified with both.
GPU_PKGS := ./devicebuf ./devicebuf/internal/cuda ./devicebuf/internal/nvmlinv ./rdma ./oob ./gdrcodec ./cmd/gdrperf ./examples/demo
UCX_ENV = $(if $(UCX_DIR),LD_LIBRARY_PATH=$(UCX_DIR)/lib$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH} UCX_MODULE_DIR=$(UCX_DIR)/lib/ucx)
test-gpu: deps
	env $(UCX_ENV) GDRPC_REQUIRE=ucx,cuda $(GO) test -count=1 -timeout 30m $(GPU_PKGS)

# gpu-bins builds those packages' test binaries into GPU_BINS, with
# scripts/gpu-tests, which runs them on a GPU host that has the checkout but no
# Go (from the checkout's root: GPU_BINS/gpu-tests, UCX_DIR as above).
GPU_BINS ?= .gpu-tests
gpu-bins: deps
	@mkdir -p $(GPU_BINS)
	for p in $(GPU_PKGS); do \
		$(GO) test -c -o $(GPU_BINS)/$$(echo $${p#./} | sed 's|/|__|g').test $$p || exit 1; \
	done
	cp scripts/gpu-tests $(GPU_BINS)/

bench: deps
	$(GO) test -run '^$$' -bench . -benchtime 20x $(PKGS)

# bench-twohosts measures gdrperf between two hosts emulated by two network
# namespaces joined by a veth pair (root; UCX over tcp, distinct host ids),
# in auto mode between peers that trust each other (a UCX session).
# GDRPERF_ARGS adds client flags, e.g. GDRPERF_ARGS="-sizes 1MiB,64MiB -iters 7";
# GDRPERF_SERVER_ARGS the server's (GPU memory on both ends: "-mem cuda" in both).
GDRPERF_ARGS ?= -sizes 1MiB,64MiB -iters 7
GDRPERF_SERVER_ARGS ?=
# BENCH_UCX_TLS is UCX_TLS in both namespaces (a CUDA-enabled UCX: tcp,cuda_copy).
# The client starts once the server printed that it listens; the server's
# output follows the client's, and the server is stopped however the run ends.
BENCH_UCX_TLS ?= tcp
bench-twohosts: deps
	$(GO) build -o $(CURDIR)/.gdrperf ./cmd/gdrperf
	@set -e; a=gdrpc-bench-a; b=gdrpc-bench-b; srv=; log=; \
	cleanup() { \
		if [ -n "$$srv" ]; then kill $$srv 2>/dev/null || true; wait $$srv 2>/dev/null || true; cat $$log; fi; \
		ip netns del $$a 2>/dev/null || true; ip netns del $$b 2>/dev/null || true; rm -f $$log; }; \
	trap cleanup EXIT; cleanup; log=$$(mktemp); \
	ip netns add $$a; ip netns add $$b; ip link add gbva type veth peer name gbvb; \
	ip link set gbva netns $$a; ip link set gbvb netns $$b; \
	ip -n $$a addr add 10.99.0.1/24 dev gbva; ip -n $$b addr add 10.99.0.2/24 dev gbvb; \
	for n in $$a $$b; do ip -n $$n link set lo up; done; ip -n $$a link set gbva up; ip -n $$b link set gbvb up; \
	ip netns exec $$a env GDRPC_HOST_ID=bench-host-a UCX_TLS=$(BENCH_UCX_TLS) $(CURDIR)/.gdrperf -server 10.99.0.1:7700 -trust-peers $(GDRPERF_SERVER_ARGS) >$$log 2>&1 & srv=$$!; \
	i=0; until grep -q '^gdrperf server:' $$log; do \
		kill -0 $$srv 2>/dev/null || { echo "bench-twohosts: the server exited"; exit 1; }; \
		i=$$((i+1)); [ $$i -le 300 ] || { echo "bench-twohosts: the server was not ready within 30 s"; exit 1; }; \
		sleep 0.1; \
	done; \
	ip netns exec $$b env GDRPC_HOST_ID=bench-host-b UCX_TLS=$(BENCH_UCX_TLS) $(CURDIR)/.gdrperf -connect 10.99.0.1:7700 -trust-peers $(GDRPERF_ARGS)

# lint lists the Go files itself (a checkout without git has them too), leaving
# out hidden directories (build outputs kept there).
lint:
	@out=$$(find . -path './.*' -prune -o -name '*.go' -print | xargs gofmt -l); \
	if [ -n "$$out" ]; then echo "gofmt:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

# proto installs the pinned protoc plugins into .bin and names them to protoc,
# so that no other plugin on PATH (Debian's older protoc-gen-go) is used.
PLUGINS := --plugin=protoc-gen-go=$(CURDIR)/.bin/protoc-gen-go --plugin=protoc-gen-go-grpc=$(CURDIR)/.bin/protoc-gen-go-grpc
proto: deps
	GOBIN=$(CURDIR)/.bin $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
	GOBIN=$(CURDIR)/.bin $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
	protoc $(PLUGINS) -I gdrcodec/proto --go_out=. --go_opt=module=github.com/gdrpc/gdrpc gdrcodec/proto/gdr/v1/gdr.proto
	protoc $(PLUGINS) -I gdrcodec/proto -I examples/tensor/tensorpb \
		--go_out=. --go_opt=module=github.com/gdrpc/gdrpc \
		--go-grpc_out=. --go-grpc_opt=module=github.com/gdrpc/gdrpc \
		examples/tensor/tensorpb/tensor.proto
	protoc $(PLUGINS) -I gdrcodec/proto -I gdrcodec/internal/nestedpb --go_out=. --go_opt=module=github.com/gdrpc/gdrpc \
		gdrcodec/internal/nestedpb/nested.proto

demo: deps
	$(GO) run ./examples/demo

gdrinfo: deps
	$(GO) run ./cmd/gdrinfo
