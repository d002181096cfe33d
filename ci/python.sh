#!/usr/bin/env bash
# The Python package: builds the abi3 wheel with maturin, installs it into a
# fresh virtual environment, and runs its tests (pytest).
#   ci/python.sh            # build (release), install, test
#   KVXFER_WHEEL_PROFILE="--profile dev" ci/python.sh
#                           # the dev build (the test command: it reuses the
#                           # crates `cargo test` built; no figure comes of it)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv
rm -rf "$venv" target/wheels
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.9,<2" "pytest>=7"
"$venv/bin/maturin" build --quiet ${KVXFER_WHEEL_PROFILE:---release} -m python/Cargo.toml -o target/wheels
"$venv/bin/pip" install -q --disable-pip-version-check target/wheels/kvxfer-*.whl
# Imported from the installed wheel, not the source tree.
(cd /tmp && "$OLDPWD/$venv/bin/python" -c "import kvxfer, sys; print('kvxfer', kvxfer.__version__, 'on Python', sys.version.split()[0])")
# The real Mooncake (CPU wheel, TCP transport) for the differential tests;
# where it cannot be installed they say SKIPPED and why.
"$venv/bin/pip" install -q --disable-pip-version-check "mooncake-transfer-engine-non-cuda==0.3.13.post1" ||
  echo "the real Mooncake could not be installed: its differential test will be skipped"
# The real NIXL (UCX backend, DRAM): its Python API needs numpy only (torch
# is imported for type checking alone), so it goes in without its declared
# dependencies.
{ "$venv/bin/pip" install -q --disable-pip-version-check numpy &&
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "nixl-cu12==1.5.1"; } ||
  echo "the real NIXL could not be installed: its differential test will be skipped"
"$venv/bin/python" -m pytest -q -rs -p no:cacheprovider python/tests
