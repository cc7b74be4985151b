#!/usr/bin/env bash
# Static checks beyond clang-format: pyflakes over every tracked Python file (tools/, tests/,
# scripts/), and clang-tidy (.clang-tidy: a focused bug-finding set) over the C++ sources a change
# touches, against build/compile_commands.json (scripts/build.sh makes it).
#   scripts/lint.sh [BASE]   C++ files changed since git revision BASE (default HEAD~1: the last
#                            commit, what CI checks); BASE=all checks every source (minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-HEAD~1}
status=0

mapfile -t py < <(git ls-files '*.py')
if command -v pyflakes3 >/dev/null; then
  if ! pyflakes3 "${py[@]}"; then status=1; fi
  echo "lint: pyflakes over ${#py[@]} Python files"
else
  echo "lint: pyflakes3 not found (Debian package pyflakes3)" >&2
  status=2
fi

if ! command -v clang-tidy >/dev/null; then
  echo "lint: clang-tidy not found (Debian package clang-tidy)" >&2
  exit 2
fi
if [ ! -f build/compile_commands.json ]; then
  echo "lint: build/compile_commands.json missing: run scripts/build.sh first" >&2
  exit 2
fi
if [ "$base" = all ]; then
  mapfile -t cc < <(git ls-files '*.cc')
elif git rev-parse -q --verify "$base^{commit}" >/dev/null; then
  mapfile -t cc < <(git diff --name-only --diff-filter=d "$base" -- '*.cc')
else
  cc=()  # a clone with one commit: nothing to compare with
fi
# Only files the build compiles (fuzz targets and the CUDA emulator's need other configurations).
checked=()
for f in "${cc[@]}"; do
  if grep -q "\"file\": \"$PWD/$f\"" build/compile_commands.json; then checked+=("$f"); fi
done
if ((${#checked[@]})); then
  out=$(mktemp)
  if ! clang-tidy -p build --quiet "${checked[@]}" >"$out" 2>/dev/null; then status=1; fi
  grep -E -A3 "(warning|error):" "$out" || true
  rm -f "$out"
fi
echo "lint: clang-tidy over ${#checked[@]} changed C++ file(s) since $base"
exit $status
