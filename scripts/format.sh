#!/usr/bin/env bash
# clang-format (.clang-format: Google, 100 columns) over every C++ and CUDA file git tracks.
#   scripts/format.sh          rewrites the files in place
#   scripts/format.sh --check  changes nothing; lists the files that differ and fails (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
if ! command -v "$CLANG_FORMAT" >/dev/null; then
  echo "format: $CLANG_FORMAT not found (Debian package clang-format)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files --cached --others --exclude-standard -- \
  '*.cc' '*.h' '*.cu' '*.cuh' | while read -r f; do [ -f "$f" ] && echo "$f"; done)
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${files[@]}"; do
    if ! "$CLANG_FORMAT" --dry-run --Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
  done
  if ((${#bad[@]})); then
    echo "format: ${#bad[@]} of ${#files[@]} files differ from clang-format (run scripts/format.sh):"
    printf '  %s\n' "${bad[@]}"
    exit 1
  fi
  echo "format: ${#files[@]} files clean"
else
  "$CLANG_FORMAT" -i "${files[@]}"
fi
