# txlimit — every task is one target; CI (.ci/run) runs the same targets.
.DEFAULT_GOAL := help
SHELL := /bin/bash

GO     ?= go
GOBIN  := $(shell $(GO) env GOPATH)/bin
SQLC_VERSION := v1.31.1
SQLC   := $(GOBIN)/sqlc

export TEST_DATABASE_URL ?=

.PHONY: help
help: ## Show the targets and what they do.
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: demo
demo: ## Run the runnable examples (migrates; needs Postgres, see README).
	$(GO) run ./examples/demo
	$(GO) run ./examples/llmbudget

.PHONY: test
test: ## Run every test with the race detector, one package at a time (needs Postgres, see README).
	$(GO) test -race -count=1 -p 1 -timeout 15m ./...

.PHONY: lint
lint: ## gofmt and go vet over every module.
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

.PHONY: generate
generate: $(SQLC) ## Regenerate the sqlc query layer from migrations/ and internal/dbsqlc/queries/.
	$(SQLC) generate

.PHONY: verify
verify: $(SQLC) ## Fail when the generated query layer is stale (sqlc diff) or go.mod is untidy.
	$(SQLC) diff
	$(GO) mod tidy -diff

$(SQLC):
	CGO_ENABLED=1 $(GO) install github.com/sqlc-dev/sqlc/cmd/sqlc@$(SQLC_VERSION)

.PHONY: bench
bench: ## Benchmarks side by side (quick mode, < 2 min); writes docs/bench.md and docs/bench.svg.
	cd bench && $(GO) run . -quick

.PHONY: bench-lateness
bench-lateness: ## How late reserved River jobs start after their RetryAt: p50/p99/max over 200 jobs, 3 runs.
	$(GO) test -run '^$$' -bench BenchmarkLateness -benchtime 1x -count 3 ./scheduler/

.PHONY: bench-full
bench-full: ## The full benchmark run (< 15 min).
	cd bench && $(GO) run .
