# The one source of truth for building, checking and running jobplane.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: constraints all dev test unit faults soak fuzz mutate lint format typecheck proto migrate services bench clean events-node fleet fleet-postgres fleet-stop fleet-test fleet-rabbitmq fleet-rabbitmq-stop

all: lint typecheck test

CONSTRAINTS := requirements/dev-constraints.txt

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

## Re-pin the test environment: resolve the dev extra afresh in a scratch venv
## (pyproject.toml's ranges only) and write what it got to $(CONSTRAINTS).
constraints:
	rm -rf .venv-constraints && $(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install -q --upgrade pip
	.venv-constraints/bin/python -m pip install -q -e '.[dev]'
	{ sed -n '1,3p' $(CONSTRAINTS); .venv-constraints/bin/python -m pip freeze --exclude-editable \
	  | grep -v '^jobplane'; } > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf .venv-constraints

venv: $(STAMP)

services:
	@scripts/services.sh

## Run jobplane against the local services, show one demo job live, then
## upload a file and show its ingestion into Qdrant (local mode) stage by stage.
## Without JOBPLANE_S3_URL, blobs go to a local S3 server that stops with it
## (scripts/dev-s3.sh).
DEV_INGEST ?= examples/ingest/guide.pdf examples/ingest/pipelines.md
## The demo job's steps (150 ms each): long enough to open it on the dashboard.
DEV_DEMO_STEPS ?= 200
## Handlers besides the demos: the README's reports.render, so its first snippets run.
DEV_HANDLERS ?= examples.reports:registry
## builtin:dev routes every job type (yours too) and has the ingest.file pipeline.
dev: $(STAMP) services
	JOBPLANE_S3_ACCESS_KEY_ID=$${JOBPLANE_S3_ACCESS_KEY_ID:-dev} \
	JOBPLANE_S3_SECRET_ACCESS_KEY=$${JOBPLANE_S3_SECRET_ACCESS_KEY:-dev} \
	JOBPLANE_TOPOLOGY=$${JOBPLANE_TOPOLOGY:-builtin:dev} \
	VENV=$(VENV) scripts/dev-s3.sh \
	$(BIN)/jobplane dev --handlers $(DEV_HANDLERS) --demo --demo-steps $(DEV_DEMO_STEPS) \
	  $(foreach f,$(DEV_INGEST),--ingest $(f))

## Everything CI runs: lint, types, unit + integration tests on real services;
## the slowest thirty tests are listed at the end, to keep the run short.
## TEST_WORKERS=2 runs the tests in two processes, a test file to one (each makes
## its own databases and vhost): 15 to 20 minutes instead of 26 (ADR-0058). The
## default stays one process while a Ctrl-C test of `jobplane dev` can fail under
## that load (a part killed by the Ctrl-C while its interpreter starts).
TEST_WORKERS ?= 0
test: $(STAMP) services lint typecheck
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

## Only the fault-injection suite (part of `make test` too).
faults: $(STAMP) services
	$(BIN)/python -m pytest tests/faults $(PYTEST_ARGS)

## 5,000 jobs and 500 pipelines with workers killed and a broker restart; prints L/D/O counts.
soak: $(STAMP) services
	$(BIN)/python -m pytest -m soak -s tests/faults/test_soak.py $(PYTEST_ARGS)

## A three-node RabbitMQ cluster on this host (jp1..jp3@localhost, AMQP on
## 5681-5683, data in build/fleet/rabbitmq/), for the fleet tests and for trying
## a node's loss by hand (docs/operations.md, "A RabbitMQ node lost"). Idempotent;
## prints the JOBPLANE_AMQP_URL naming the three nodes.
fleet-rabbitmq:
	scripts/fleet/rabbitmq.sh start

## Stop the three nodes (their data stays; `scripts/fleet/rabbitmq.sh reset` deletes it).
fleet-rabbitmq-stop:
	scripts/fleet/rabbitmq.sh stop

## The Node consumer of docs/events.md against the real services (installs its npm packages).
events-node: $(STAMP) services
	cd examples/events/node && npm install --no-audit --no-fund --silent
	$(BIN)/python -m pytest -m node tests/integration/test_event_consumer_node.py $(PYTEST_ARGS)

## A Postgres pair with failover (Patroni + etcd) and PgBouncer, and a
## three-node RabbitMQ cluster, on loopback under build/fleet/ (docs/fleet.md);
## a no-op when it runs already.
fleet: fleet-postgres fleet-rabbitmq

fleet-postgres:
	scripts/fleet/postgres.sh start

fleet-stop:
	scripts/fleet/postgres.sh stop
	scripts/fleet/rabbitmq.sh stop

## Failover and pooling tests against the fleet (Postgres and RabbitMQ);
## prints the recovery times and the broker pause.
fleet-test: $(STAMP) services fleet
	$(BIN)/python -m pytest -m fleet -s tests/fleet $(PYTEST_ARGS)

## Property-based fuzzing of every RPC, ten times deeper than in `make test`
## (several minutes); failing examples are kept in .hypothesis/ and replayed first.
fuzz: $(STAMP) services
	HYPOTHESIS_PROFILE=deep $(BIN)/python -m pytest -s tests/fuzz $(PYTEST_ARGS)

## Mutation testing of store/, workers/ and server/ (not part of `make test`).
## Narrow it with a mutant glob: make mutate MUTATE='jobplane.store.attempts.*'
## Or run a random sample and get the kill rate with a 95% interval:
## make mutate MUTATE_SAMPLE=300 MUTATE_SEED=1
MUTATE ?=
MUTATE_JOBS ?= 2
MUTATE_SAMPLE ?=
MUTATE_SEED ?= 1
MUTATE_TREE := build/mutate
mutate: $(STAMP) services
	$(BIN)/python scripts/mutation_tree.py $(MUTATE_TREE)
ifeq ($(MUTATE_SAMPLE),)
	cd $(MUTATE_TREE) && $(abspath $(BIN))/mutmut run --max-children $(MUTATE_JOBS) $(MUTATE)
	cd $(MUTATE_TREE) && $(abspath $(BIN))/python scripts/mutation_report.py $(MUTATE)
else
	cd $(MUTATE_TREE) && $(abspath $(BIN))/python scripts/mutation_sample.py --size $(MUTATE_SAMPLE) \
	  --seed $(MUTATE_SEED) --jobs $(MUTATE_JOBS) $(MUTATE)
	cd $(MUTATE_TREE) && $(abspath $(BIN))/python scripts/mutation_children.py \
	  --size $(MUTATE_SAMPLE) --seed $(MUTATE_SEED) $(MUTATE)
	cd $(MUTATE_TREE) && $(abspath $(BIN))/python scripts/mutation_sample.py --size $(MUTATE_SAMPLE) \
	  --seed $(MUTATE_SEED) --report-only $(MUTATE)
endif

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: $(STAMP)
	$(BIN)/mypy

## Regenerate the gRPC stubs (a test fails when they are stale).
proto: $(STAMP)
	$(BIN)/python scripts/protogen.py core

migrate: $(STAMP) services
	$(BIN)/jobplane migrate

## Throughput, latency, streams and relay figures with their floors (not a test).
bench: $(STAMP) services
	$(BIN)/python -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .venv-protogen .cache build dist .mypy_cache .ruff_cache .pytest_cache .hypothesis
