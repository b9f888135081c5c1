#!/usr/bin/env bash
# Prepare vLLM 0.26.0 for the GPU machine (run here, where PyPI is reachable; the GPU machine reaches nothing).
#
#   bash scripts/vllm_gpu_wheels.sh [--out REPO_ROOT] [--part-mib 57] [--keep-fa2] [--cache DIR]
#
# 1. downloads the cp312 manylinux wheels of scripts/vllm_gpu_requirements.txt (vLLM 0.26.0 and only what the GPU
#    image lacks; cached under --cache, default /tmp/qwen35-vllm-bundle);
# 2. installs them here into a site tree for python 3.12 (pip --target --python-version 3.12 --platform ...: no
#    interpreter of that version is needed), then drops what a Hopper text-only serve never loads: FlashAttention 2's
#    extension (305 MB; vLLM picks FA3 on sm90, FA2 only on other GPUs; --keep-fa2 keeps it), the Rust front end
#    binary (vllm-rs, used only with VLLM_RUST_FRONTEND_PATH) and deep_gemm's extensions for other Pythons;
# 3. packs the tree as one xz-compressed tar (xz shrinks the CUDA extensions ~3x more than the wheel's zip does)
#    and splits it into parts of at most --part-mib MiB (57 MiB = 59.8 MB: a part plus the ~4 MiB working tree
#    stays under the device tool's 64 MiB per call), one part per folder: REPO_ROOT/.vllm0, .vllm1, ... (each with
#    the same MANIFEST), ignored through the repository's .git/info/exclude (shared by all its worktrees).
#
# On the GPU machine, scripts/vllm_gpu_install.sh takes one folder per call (carry [".vllmN"]) and installs the
# tree into /tmp/site once every part has arrived; tuning/notes_vllm_gpu.md has the call sequence.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=$(git -C "$HERE" rev-parse --show-toplevel)
PART_MIB=57
KEEP_FA2=0
CACHE=/tmp/qwen35-vllm-bundle
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$(cd "$2" && pwd); shift 2 ;;
    --part-mib) PART_MIB=$2; shift 2 ;;
    --keep-fa2) KEEP_FA2=1; shift ;;
    --cache) CACHE=$2; shift 2 ;;
    -h|--help) sed -n 2,20p "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "vllm_gpu_wheels.sh: unknown argument $1 (accepted: --out DIR, --part-mib N, --keep-fa2, --cache DIR)" >&2; exit 2 ;;
  esac
done
case "$PART_MIB" in ''|*[!0-9]*) echo "vllm_gpu_wheels.sh: --part-mib must be a whole number of MiB, got '$PART_MIB'" >&2; exit 2 ;; esac
if [ "$PART_MIB" -lt 8 ] || [ "$PART_MIB" -gt 58 ]; then
  echo "vllm_gpu_wheels.sh: --part-mib $PART_MIB is outside 8..58 (a part plus the working tree must stay under 64 MiB)" >&2
  exit 2
fi
REQS="$HERE/vllm_gpu_requirements.txt"
PY=${PYTHON:-python3}
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64)
step() { echo "[vllm-wheels] $*"; }
t_start=$(date +%s)

mkdir -p "$CACHE/wheels"
mapfile -t PINS < <(grep -v '^\s*#' "$REQS" | sed 's/\s*#.*//' | grep -v '^\s*$')
step "downloading ${#PINS[@]} pinned wheels into $CACHE/wheels"
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$CACHE/wheels" "${PINS[@]}"
# exactly one wheel per pin (an older download of another version would install twice)
WHEELS=()
for pin in "${PINS[@]}"; do
  name=${pin%%==*}; version=${pin#*==}
  norm=$(echo "$name" | tr 'A-Z-.' 'a-z__')
  match=$(cd "$CACHE/wheels" && ls | awk -v n="$norm" -v v="$version" 'BEGIN{IGNORECASE=1} {split($0,a,"-"); m=tolower(a[1]); gsub(/[-.]/,"_",m); if (m==n && a[2]==v) print}' | head -1)
  [ -n "$match" ] || { echo "vllm_gpu_wheels.sh: no wheel for $pin in $CACHE/wheels" >&2; exit 1; }
  WHEELS+=("$CACHE/wheels/$match")
done

SITE="$CACHE/site"
rm -rf "$SITE"
step "installing for python 3.12 into $SITE"
"$PY" -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "${PLATFORM[@]}" "${WHEELS[@]}"
rm -rf "$SITE/bin"
if [ "$KEEP_FA2" = 0 ]; then rm -f "$SITE"/vllm/vllm_flash_attn/_vllm_fa2_C*.so; fi
rm -f "$SITE/vllm/vllm-rs"
find "$SITE/vllm/third_party/deep_gemm" -maxdepth 1 -name '_C.cpython-3*-x86_64-linux-gnu.so' ! -name '*cpython-312*' -delete 2>/dev/null || true
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
step "site tree: $(du -sm "$SITE" | cut -f1) MiB"

BUNDLE="$CACHE/vllm-0.26.0-site.tar.xz"
step "packing (xz -6, all cores)"
tar -C "$SITE" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | xz -T0 -6 > "$BUNDLE"
size=$(stat -c %s "$BUNDLE")
step "bundle: $((size / 1048576)) MiB"

rm -rf "$CACHE/parts" && mkdir -p "$CACHE/parts"
split -b "${PART_MIB}m" -d -a 1 "$BUNDLE" "$CACHE/parts/part"
PARTS=("$CACHE"/parts/part*)
N=${#PARTS[@]}
[ "$N" -le 10 ] || { echo "vllm_gpu_wheels.sh: $N parts; at most 10 (one digit) are supported" >&2; exit 1; }
{
  echo "bundle vllm-0.26.0-site.tar.xz"
  echo "parts $N"
  echo "bytes $size"
  echo "sha256 $(sha256sum "$BUNDLE" | cut -d' ' -f1)"
  echo "made $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(basename "$REQS") ($(sha256sum "$REQS" | cut -c1-12))"
  (cd "$CACHE/parts" && sha256sum part*)
} > "$CACHE/parts/MANIFEST"

rm -rf "$OUT"/.vllm[0-9]
for i in $(seq 0 $((N - 1))); do
  mkdir -p "$OUT/.vllm$i"
  cp "$CACHE/parts/part$i" "$CACHE/parts/MANIFEST" "$OUT/.vllm$i/"
done
EXCLUDE="$(git -C "$OUT" rev-parse --path-format=absolute --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.vllm[0-9]*/' "$EXCLUDE" 2>/dev/null || echo '/.vllm[0-9]*/' >> "$EXCLUDE"
if git -C "$OUT" status --porcelain --ignored=no | grep -q '\.vllm'; then
  echo "vllm_gpu_wheels.sh: the .vllmN folders are not ignored in $OUT; they would travel with every call" >&2
  exit 1
fi
step "$N parts of <= $PART_MIB MiB in $OUT/.vllm0 .. .vllm$((N - 1)) ($(($(date +%s) - t_start)) s)"
du -sh "$OUT"/.vllm[0-9]
