# txlimit — every task is one target; CI (.ci/run) runs the same targets.
.DEFAULT_GOAL := help
SHELL := /bin/bash

GO     ?= go
GOBIN  := $(shell $(GO) env GOPATH)/bin
SQLC_VERSION := v1.31.1
SQLC   := $(GOBIN)/sqlc
# Tools pinned by version go into bin/ of the repository (ignored by git), one file per version.
BIN    := $(CURDIR)/bin
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(BIN)/staticcheck-$(STATICCHECK_VERSION)

export TEST_DATABASE_URL ?=

# The pgx exec modes docs/deploy.md calls safe behind a transaction pooler (pgbouncertest.SafeModes;
# scheduler's TestMakefileListsEverySafeMode keeps the two equal). make test runs ./scheduler/ once
# in each directly, make test-pgbouncer once in each through PgBouncer. The targets set the two
# variables that choose the scheduler tests' connection (scheduler/setup_test.go), and ignore them
# in the environment.
SAFE_MODES := exec simple_protocol cache_describe
unexport TXLIMIT_TEST_EXEC_MODE TXLIMIT_TEST_VIA

# scheduler-modes,VIA: go test ./scheduler/ once in each of SAFE_MODES, reached VIA (direct or
# pgbouncer); stops at the first mode that fails.
scheduler-modes = for mode in $(SAFE_MODES); do \
		echo "== TXLIMIT_TEST_EXEC_MODE=$$mode TXLIMIT_TEST_VIA=$(1) go test ./scheduler/"; \
		TXLIMIT_TEST_EXEC_MODE=$$mode TXLIMIT_TEST_VIA=$(1) $(GO) test -race -count=1 -timeout 10m ./scheduler/ || exit 1; \
	done

# make reliability: how long the soak runs and with how many workers, how many inputs the fuzz runs,
# and which tests of internal/reliability run (all by default). By hand: make reliability SOAK=10m FUZZTIME=300000x
# FUZZTIME is a count of inputs, not a duration: docs/reliability.md says why.
SOAK     ?= 60s
WORKERS  ?= 16
FUZZTIME ?= 30000x
FUZZMINIMIZETIME ?= 10s
RELIABILITY_RUN     ?= .
RELIABILITY_TIMEOUT ?= 30m

.PHONY: help
help: ## Show the targets and what they do.
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: demo
demo: ## Run the examples one after the other: demo, llmbudget, httpserver (each in a schema of its own; finds or starts a Postgres, see README).
	$(GO) run ./internal/cmd/withdb -- $(GO) run ./examples/demo -- $(GO) run ./examples/llmbudget -- $(GO) run ./examples/httpserver -demo

.PHONY: test
test: ## Run every test with the race detector, one package at a time, then the scheduler's once in each safe exec mode (needs Postgres, see README).
	$(GO) test -race -count=1 -p 1 -timeout 15m ./...
	@$(call scheduler-modes,direct)

.PHONY: test-pgbouncer
test-pgbouncer: ## Tests through a PgBouncer in transaction pooling mode: internal/pgbouncertest, then the scheduler's once in each safe exec mode (.ci/pgbouncer.sh starts one unless TXLIMIT_PGBOUNCER_URL is set).
	@run='$(GO) test -race -count=1 -v -timeout 10m ./internal/pgbouncertest/ && \
		$(call scheduler-modes,pgbouncer)'; \
	if [ -n "$$TXLIMIT_PGBOUNCER_URL" ]; then bash -c "$$run"; else .ci/pgbouncer.sh bash -c "$$run"; fi

.PHONY: lint
lint: $(STATICCHECK) ## gofmt, go vet and staticcheck over every module (the root, bench/, and internal/reliability with -tags reliability).
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags reliability ./internal/reliability/
	cd bench && $(GO) vet ./...
	$(STATICCHECK) ./...
	$(STATICCHECK) -tags reliability ./internal/reliability/
	cd bench && $(STATICCHECK) ./...

$(STATICCHECK):
	mkdir -p $(BIN)
	GOBIN=$(BIN) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	mv $(BIN)/staticcheck $@

.PHONY: reliability
reliability: ## Soak, restart, bad input, least privilege, then the model fuzz; prints one summary line each (SOAK, WORKERS, FUZZTIME, FUZZMINIMIZETIME).
	@dir=$$(mktemp -d "$${TMPDIR:-/tmp}/txlimit-reliability.XXXXXX"); log=$$dir/reliability.log; status=0; \
	echo "== reliability: package tests, soak $(SOAK) with $(WORKERS) workers (log: $$log)"; \
	TXLIMIT_SOAK_DURATION=$(SOAK) TXLIMIT_SOAK_WORKERS=$(WORKERS) \
		$(GO) test -tags reliability -race -count=1 -v -timeout $(RELIABILITY_TIMEOUT) -run '$(RELIABILITY_RUN)' ./internal/reliability/ 2>&1 | tee "$$log"; \
	[ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	echo "== reliability: fuzz FuzzModel, -fuzztime $(FUZZTIME) (log: $$dir/fuzz.log)"; \
	$(GO) test -run '^$$' -fuzz '^FuzzModel$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZETIME) ./ratelimit/ 2>&1 | tee "$$dir/fuzz.log"; \
	fuzzstatus=$${PIPESTATUS[0]}; [ $$fuzzstatus -eq 0 ] || status=1; \
	internal/reliability/fuzz-summary.sh $(FUZZTIME) $$fuzzstatus < "$$dir/fuzz.log" >> "$$log"; \
	echo "== reliability: summary ($$log)"; \
	grep -aE '^reliability: |^  (failing input|the fuzz run)' "$$log" || true; \
	for part in soak restart badinput privilege fuzz; do \
		grep -aq "^reliability: $$part:" "$$log" || echo "  (no summary line from $$part: it did not run to its end, or RELIABILITY_RUN left it out)"; \
	done; \
	exit $$status

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
