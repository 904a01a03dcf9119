# The one developer command file: CI (.ci/run), the README and docs/development.md call these
# targets. It uses the Python on PATH (no virtualenv needed); override with `make PYTHON=...`.

PYTHON ?= python
PIP := $(PYTHON) -m pip

# The editable build, the Rust tests and clippy all use this cargo profile (release without fat
# LTO, see Cargo.toml), so `./target` is one warm cache shared by every target.
CARGO_PROFILE := ci

# Builds dataset_rt/_native.abi3.so in place, next to the Python sources (maturin's editable
# mode). No build isolation: maturin comes from the environment, and the build happens once.
BUILD_EXTENSION := MATURIN_PEP517_ARGS="--profile $(CARGO_PROFILE)" \
	$(PIP) install --no-build-isolation --editable

MATURIN ?= $(PYTHON) -m maturin

# Extra flags for `make release`, e.g. RELEASE_ARGS="--target aarch64-apple-darwin".
RELEASE_ARGS ?=

# `make build-all`: the Linux wheels, cross-compiled with Zig as the linker against an old glibc.
# manylinux2014 (glibc 2.17) is the oldest level Rust's standard library supports.
LINUX_TARGETS := x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu
MANYLINUX := manylinux2014

# `make docs`: the `docs` extra of pyproject.toml (installed alone: no rebuild of the package).
DOCS_REQUIREMENT := mkdocs-material>=9.5,<10

# `make wheel-test`: where the wheel it installs is written (emptied first), and the Pythons.
WHEEL_TEST_DIR := dist/wheel-test
WHEEL_TEST_PYTHONS ?= 3.10 3.11 3.12 3.13

.PHONY: install build release build-all wheel-test lint docs test test-frameworks ci demo bench \
	clean fuzz fuzz-ci fuzz-install soak

## install: toolchain prerequisites, Python deps (runtime, test, dev, examples; torch once), then
## the build
install:
	@command -v cargo >/dev/null || { echo "error: no Rust toolchain; install it from https://rustup.rs" >&2; exit 1; }
	command -v cc >/dev/null || { apt-get update && apt-get install -y --no-install-recommends build-essential; }
	@# Chromium renders the `dataset-rt view` page in the browser test (tests/test_viewer.py).
	command -v chromium >/dev/null || { apt-get update && apt-get install -y --no-install-recommends chromium; }
	cargo fmt --version >/dev/null 2>&1 && cargo clippy --version >/dev/null 2>&1 || rustup component add rustfmt clippy
	cargo nextest --version >/dev/null 2>&1 || cargo install --locked cargo-nextest
	$(PIP) install 'maturin>=1.7,<2'
	@# The `torch` extra is a CUDA build of several GB: install it once per machine.
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install 'torch>=2.1'
	$(BUILD_EXTENSION) '.[test,dev,examples,view,lightning,accelerate,ray]'

## build: rebuild the extension in place after a Rust change (same build as `install`)
build:
	$(BUILD_EXTENSION) . --no-deps

## release: an optimised abi3 wheel (fat LTO, one codegen unit) for this host into dist/
release:
	$(MATURIN) build --release --out dist $(RELEASE_ARGS)

## build-all: the release artifacts into dist/ (emptied first): manylinux abi3 wheels for x86_64
## and aarch64, cross-compiled with Zig, and an sdist; then checks them (scripts/check_wheels.py)
build-all:
	$(PYTHON) -m ziglang version >/dev/null 2>&1 || $(PIP) install ziglang
	$(PYTHON) -m auditwheel --version >/dev/null 2>&1 || $(PIP) install auditwheel
	for t in $(LINUX_TARGETS); do \
		rustup target list --installed | grep -qx "$$t" || rustup target add "$$t" || exit 1; \
	done
	rm -rf dist
	for t in $(LINUX_TARGETS); do \
		$(MATURIN) build --release --zig --target "$$t" --compatibility $(MANYLINUX) --out dist \
			|| exit 1; \
	done
	$(MATURIN) sdist --out dist
	$(PYTHON) scripts/check_wheels.py dist $(LINUX_TARGETS)

## wheel-test: packages the `ci` build of `install`/`build` as a wheel (no recompilation: same
## profile, features, interpreter and target directory), installs it into a virtualenv per Python
## in WHEEL_TEST_PYTHONS and runs scripts/wheel_smoke.py there, outside the source tree
wheel-test:
	rm -rf $(WHEEL_TEST_DIR)
	$(MATURIN) build --profile $(CARGO_PROFILE) --out $(WHEEL_TEST_DIR) \
		--interpreter "$$($(PYTHON) -c 'import sys; print(sys.executable)')"
	$(PYTHON) scripts/wheel_test.py $(WHEEL_TEST_DIR)/*.whl --pythons $(WHEEL_TEST_PYTHONS)

## lint: formatters, linters, type checker, and the stub checked against the built module
lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --profile $(CARGO_PROFILE) -- -D warnings
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy
	$(PYTHON) -m mypy.stubtest dataset_rt._native

## docs: the docs site from docs/ into site/ (git-ignored) with mkdocs-material, strict: a
## broken link or anchor, or a page missing from mkdocs.yml's nav, fails the build
docs:
	$(PYTHON) -c "import material" 2>/dev/null || $(PIP) install '$(DOCS_REQUIREMENT)'
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

## test: Rust tests, then pytest against the extension built by `install`/`build` (no rebuild).
## pytest exits 5 when it collects nothing, which fails this target like any other error.
test:
	cargo nextest run --workspace --cargo-profile $(CARGO_PROFILE) --no-fail-fast
	$(PYTHON) -m pytest

## test-frameworks: the tests under Lightning, Accelerate and Ray Train (tests/frameworks),
## installing the `lightning`, `accelerate` and `ray` extras first (torch itself is not
## replaced); a framework that cannot be imported fails the run instead of skipping
FRAMEWORK_REQUIREMENTS := 'lightning>=2.6,<3' 'accelerate>=1.15,<2' 'torchdata>=0.11' \
	'ray[train,data]>=2.60,<3'
test-frameworks:
	$(PIP) install $(FRAMEWORK_REQUIREMENTS)
	DATASET_RT_REQUIRE_FRAMEWORKS=1 $(PYTHON) -m pytest tests/frameworks

## ci: what CI runs (.ci/run), in order, stopping at the first failure
ci:
	$(MAKE) install
	$(MAKE) lint
	$(MAKE) docs
	$(MAKE) test
	$(MAKE) wheel-test
	$(MAKE) fuzz-ci

## fuzz-install: cargo-fuzz (libFuzzer) from crates.io, when missing
fuzz-install:
	cargo fuzz --version >/dev/null 2>&1 || cargo install --locked cargo-fuzz

## fuzz: every fuzz target for FUZZ_SECONDS each (default 600; docs/fuzzing.md)
FUZZ_SECONDS ?= 600
fuzz: fuzz-install
	FUZZ_SECONDS=$(FUZZ_SECONDS) ./fuzz/run.sh

## fuzz-ci: the bounded run: every fuzz target for 25 s, failing on any crash
fuzz-ci: fuzz-install
	FUZZ_SECONDS=25 ./fuzz/run.sh

## soak: the full kill-and-resume soaks (pytest runs bounded versions of both; docs/development.md)
soak:
	$(PYTHON) soak/writer_kill.py --cycles 50
	$(PYTHON) soak/loader_kill.py --cycles 100

## demo: write the embedded synthetic dataset to ./demo-cache, read it back shuffled, summarise,
## then decode it with the shared-memory loader (2 workers), resume it mid-epoch, time it
demo:
	$(PYTHON) -m dataset_rt demo

## bench: all benchmarks (bench/run_all.py)
bench:
	$(PYTHON) bench/run_all.py

clean:
	cargo clean
	rm -rf dist site demo-cache .pytest_cache .ruff_cache .mypy_cache dataset_rt/_native*.so
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
