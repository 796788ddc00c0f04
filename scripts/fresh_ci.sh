#!/usr/bin/env bash
# CI as a newcomer's machine sees it: clone this repository's HEAD into a new directory (with
# ../shared beside it), then run `CI=true bash .ci/run` there, as CI does. Prints the wall time of
# the whole run split into installs, the main suite and the vLLM suite, and each suite's counts.
#
#   scripts/fresh_ci.sh [--load N] [--no-redis-benchmark] [--keep] [--dir DIR]
#
#   --load N               keep N busy loops running (one core each) for the whole run: a loaded machine
#   --no-redis-benchmark   hide redis-benchmark from PATH (a fresh machine has none)
#   --keep                 keep the clone (default: removed after a passing run)
#   --dir DIR              clone into DIR (default: a new directory under /tmp)
#
# Exit status: .ci/run's. The log is DIR.log beside the clone.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
load=0 hide=0 keep=0 dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --load) load="${2:?--load needs a number}"; shift 2 ;;
    --no-redis-benchmark) hide=1; shift ;;
    --keep) keep=1; shift ;;
    --dir) dir="${2:?--dir needs a path}"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$load" in ''|*[!0-9]*) echo "--load needs a whole number, got '$load'" >&2; exit 2 ;; esac
[ -d "$here/../shared" ] || { echo "no ../shared beside $here: CI has one" >&2; exit 2; }
[ -n "$dir" ] || dir="$(mktemp -d /tmp/opsd-fresh-ci.XXXXXX)/main"
[ ! -e "$dir" ] || [ -z "$(ls -A "$dir" 2>/dev/null)" ] || { echo "$dir is not empty" >&2; exit 2; }
git clone -q "$here" "$dir"
# .ci/run and the tests find ../shared beside the clone.
[ -e "$dir/../shared" ] || ln -s "$(cd "$here/../shared" && pwd)" "$dir/../shared"
log="$dir.log"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for _ in $(seq 1 "$load"); do
  ( while :; do :; done ) &
  pids+=("$!")
done

path="$PATH"
if [ "$hide" = 1 ]; then
  # Each PATH folder holding redis-benchmark is replaced by a folder of links to all its other files.
  shadow="$(mktemp -d /tmp/opsd-path.XXXXXX)"
  path=""
  IFS=: read -r -a parts <<< "$PATH"
  for d in "${parts[@]}"; do
    if [ -x "$d/redis-benchmark" ]; then
      s="$shadow/$(echo "$d" | tr / _)"
      mkdir -p "$s"
      for f in "$d"/*; do [ "$(basename "$f")" = redis-benchmark ] || ln -s "$f" "$s/"; done
      d="$s"
    fi
    path="${path:+$path:}$d"
  done
  if PATH="$path" command -v redis-benchmark >/dev/null; then echo "could not hide redis-benchmark" >&2; exit 2; fi
fi

echo "fresh clone of $(git -C "$here" rev-parse --short HEAD) in $dir; load $load busy loop(s); redis-benchmark" \
     "$([ "$hide" = 1 ] && echo hidden || (command -v redis-benchmark >/dev/null && echo present || echo absent));" \
     "log $log"
start=$(date +%s)
set +e
( cd "$dir" && PATH="$path" CI=true bash .ci/run ) > "$log" 2>&1
rc=$?
set -e
total=$(( $(date +%s) - start ))

# pytest's last line per suite: "N passed, M failed ... in 992.78s (0:16:32)"; main first, then vLLM.
mapfile -t summaries < <(grep -E '^(=+ )?[0-9]+ (passed|failed|error).* in [0-9.]+s' "$log" | sed 's/=//g; s/^ *//')
secs() { echo "$1" | sed -E 's/.* in ([0-9.]+)s.*/\1/' | cut -d. -f1; }
main_s=0 vllm_s=0
[ "${#summaries[@]}" -ge 1 ] && main_s=$(secs "${summaries[0]}")
[ "${#summaries[@]}" -ge 2 ] && vllm_s=$(secs "${summaries[1]}")
echo "exit $rc; wall $((total / 60)) min $((total % 60)) s in all"
echo "  main suite: ${summaries[0]:-did not finish} (${main_s} s)"
echo "  vLLM suite: ${summaries[1]:-did not run} (${vllm_s} s)"
echo "  installs and the rest: $((total - main_s - vllm_s)) s"
if [ "$rc" = 0 ] && [ "$keep" = 0 ]; then rm -rf "$dir"; fi
exit "$rc"
