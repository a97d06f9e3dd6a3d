# gdrpc: make demo | make test | make bench | make lint | make proto
GO       ?= go
PKGS     ?= ./...
APT_PKGS := libucx-dev ucx-utils pkg-config protobuf-compiler iproute2 python3-grpcio
export PATH := $(PATH):$(shell $(GO) env GOPATH)/bin

.PHONY: all deps build abi test test-nordma bench lint proto demo gdrinfo

all: build

# deps installs the system packages the build and tests need, only those missing.
deps:
	@missing=""; for p in $(APT_PKGS); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

build:
	$(GO) build $(PKGS)
	CGO_ENABLED=0 $(GO) build $(PKGS)
	$(GO) build -tags nordma $(PKGS)

# abi checks rdma/ucxabi.h, gdrpc's own declarations of the UCX ABI, against the UCX
# development headers; missing headers fail it.
abi: deps
	GDRPC_REQUIRE=ucx $(GO) test -count=1 -run '^TestUCXABI' ./rdma

# test demands UCX: a missing UCX fails instead of skipping.
test: deps build abi
	$(GO) vet $(PKGS)
	CGO_ENABLED=0 $(GO) vet $(PKGS)
	GDRPC_REQUIRE=ucx $(GO) test -race -timeout 25m $(PKGS)
	CGO_ENABLED=0 $(GO) test -timeout 10m $(PKGS)

bench: deps
	$(GO) test -run '^$$' -bench . -benchtime 20x $(PKGS)

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

proto: deps
	$(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
	$(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
	protoc -I gdrcodec/proto --go_out=. --go_opt=module=github.com/gdrpc/gdrpc gdrcodec/proto/gdr/v1/gdr.proto
	protoc -I gdrcodec/proto -I examples/tensor/tensorpb \
		--go_out=. --go_opt=module=github.com/gdrpc/gdrpc \
		--go-grpc_out=. --go-grpc_opt=module=github.com/gdrpc/gdrpc \
		examples/tensor/tensorpb/tensor.proto

demo: deps
	$(GO) run ./examples/demo

gdrinfo: deps
	$(GO) run ./cmd/gdrinfo
