#!/usr/bin/env bash
# The cargo fuzz targets (fuzz/), each for SECS seconds (default 60) from
# its committed corpus, without a sanitizer (the stable toolchain). The
# test command runs no fuzzer: it replays every committed input through
# the same entry points (src/fuzzing.rs, unit tests `fuzzing::corpus`).
# A crash fails the run and names its input; new coverage stays in a copy
# of the corpus (printed), for `cargo fuzz cmin` and a commit.
#   ci/fuzz.sh [SECS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install-deps.sh test >/dev/null
secs=${1:-60}
shift || true
targets=${*:-agent_desc tcp_frames kv_wire handshake}
command -v cargo-fuzz >/dev/null 2>&1 || cargo install --locked cargo-fuzz --version 0.13.2
out=$(mktemp -d /tmp/kvxfer-fuzz.XXXXXX)
for t in $targets; do
  cp -r "fuzz/corpus/$t" "$out/$t"
  if ! cargo fuzz run -s none "$t" "$out/$t" -- -max_total_time="$secs" \
      -rss_limit_mb=2048 -print_final_stats=1 >"$out/$t.log" 2>&1; then
    tail -n 60 "$out/$t.log"
    echo "fuzz target $t failed (log: $out/$t.log)" >&2
    exit 1
  fi
  echo "$t: $(grep -E '^Done' "$out/$t.log")"
done
echo "corpora with what this run added: $out"
