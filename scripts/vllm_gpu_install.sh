#!/usr/bin/env bash
# On the GPU machine, first thing in every call that carries a .vllmN folder (or needs vLLM):
#
#   bash scripts/vllm_gpu_install.sh [--require] [--stage DIR] [--site DIR]
#
# Moves the bundle part(s) this call carried (.vllm0/part0, .vllm1/part1, ... made by scripts/vllm_gpu_wheels.sh)
# to /tmp/vllm-parts: a later call's carry replaces the carried folders, and what lies under /tmp stays while the
# machine is warm. Once every part the MANIFEST lists is there, it checks their sha256, unpacks the tree into
# /tmp/site, registers qwen35's vLLM plugin entry point there (the checkout is not pip-installed on the machine),
# precompiles the Python files with every core, and imports vLLM's API server as a smoke test. Each step prints
# its wall time. Exit status: 0 when installed (now or by an earlier call) or when parts are still to come;
# with --require, 3 while parts are missing (a cold machine: start again from the first part); 1 on errors.
#
# Afterwards:  export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
# (FlashInfer is not carried: vLLM 0.26 would import it for its top-k/top-p sampler on CUDA.)
set -uo pipefail

REQUIRE=0
STAGE=/tmp/vllm-parts
SITE=/tmp/site
while [ $# -gt 0 ]; do
  case "$1" in
    --require) REQUIRE=1; shift ;;
    --stage) STAGE=$2; shift 2 ;;
    --site) SITE=$2; shift 2 ;;
    *) echo "vllm_gpu_install.sh: unknown argument $1 (accepted: --require, --stage DIR, --site DIR)" >&2; exit 2 ;;
  esac
done
MARK="$SITE/.qwen35-vllm-bundle"
T0=$(date +%s.%N)
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f s", b - a}'; }
say() { echo "[vllm-install] $*"; }

mkdir -p "$STAGE"
t=$(now)
moved=0
for d in .vllm[0-9]; do
  [ -d "$d" ] || continue
  for f in "$d"/part[0-9]; do
    [ -f "$f" ] || continue
    mv -f "$f" "$STAGE/" && moved=$((moved + 1))
  done
  [ -f "$d/MANIFEST" ] && cp -f "$d/MANIFEST" "$STAGE/MANIFEST"
done
say "moved $moved part(s) to $STAGE in $(took "$t")"

if [ -f "$MARK" ]; then
  say "installed already: $(cat "$MARK")"
  exit 0
fi
if [ ! -f "$STAGE/MANIFEST" ]; then
  say "no MANIFEST yet (carry .vllm0 first); nothing installed"
  [ "$REQUIRE" = 1 ] && exit 3
  exit 0
fi
N=$(awk '$1 == "parts" {print $2}' "$STAGE/MANIFEST")
have=$(ls "$STAGE"/part[0-9] 2>/dev/null | wc -l)
missing=()
for i in $(seq 0 $((N - 1))); do [ -f "$STAGE/part$i" ] || missing+=(".vllm$i"); done
if [ ${#missing[@]} -gt 0 ]; then
  say "have $have of $N parts; still to carry: ${missing[*]}"
  [ "$REQUIRE" = 1 ] && exit 3
  exit 0
fi

t=$(now)
if ! (cd "$STAGE" && grep -E '^[0-9a-f]{64}  part[0-9]$' MANIFEST | sha256sum -c --quiet -); then
  say "a part does not match its sha256 in the MANIFEST (remake the parts with scripts/vllm_gpu_wheels.sh)"
  exit 1
fi
say "checked $N parts in $(took "$t")"

t=$(now)
rm -rf "$SITE" && mkdir -p "$SITE"
if ! cat $(for i in $(seq 0 $((N - 1))); do echo "$STAGE/part$i"; done) | python3 -c '
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as tar:
    tar.extractall(sys.argv[1], filter="fully_trusted")
' "$SITE"; then
  say "unpacking failed"
  exit 1
fi
rm -f "$STAGE"/part[0-9]
say "unpacked into $SITE ($(du -sm "$SITE" | cut -f1) MiB) in $(took "$t")"

# qwen35's plugin: vLLM finds general plugins through entry points; the checkout on PYTHONPATH has no dist-info.
EP="$SITE/qwen35_vllm_plugin-0.0.0.dist-info"
mkdir -p "$EP"
printf 'Metadata-Version: 2.1\nName: qwen35-vllm-plugin\nVersion: 0.0.0\n' > "$EP/METADATA"
printf '[vllm.general_plugins]\nqwen35 = qwen35.vllm_plugin:register\n' > "$EP/entry_points.txt"
: > "$EP/RECORD"

t=$(now)
python3 -m compileall -q -j 0 "$SITE" > /dev/null 2>&1 || true
say "precompiled in $(took "$t")"

t=$(now)
if ! out=$(PYTHONPATH="$SITE:$PWD" python3 -c '
import importlib.metadata as md, vllm, vllm.entrypoints.openai.api_server
from qwen35 import vllm_adapter
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "qwen35" in eps, eps
print(vllm.__version__, vllm_adapter.check_supported(), "plugins", eps)
' 2>&1); then
  echo "$out" | tail -20
  say "smoke import failed"
  exit 1
fi
say "smoke import in $(took "$t"): $(echo "$out" | tail -1)"
echo "vLLM $(echo "$out" | tail -1 | cut -d' ' -f1), installed $(date -u +%H:%M:%SZ)" > "$MARK"
say "done in $(took "$T0"); now: export PYTHONPATH=$SITE:\$PWD VLLM_USE_FLASHINFER_SAMPLER=0"
