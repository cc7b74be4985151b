#!/bin/sh
# `BIN --help` exits 0 and lists the binary's flags with dashes (--name-with-dashes), none with
# underscores: the spelling the README uses.
set -eu
out=$("$1" --help) || { echo "$1 --help exited $?"; exit 1; }
echo "$out" | grep -q '^Usage: ' || { echo "no usage line:"; echo "$out"; exit 1; }
echo "$out" | grep -qE '^  --[a-z0-9]+(-[a-z0-9]+)*' || { echo "no flag listed:"; echo "$out"; exit 1; }
if echo "$out" | grep -qE '^  --[a-z0-9-]*_'; then
  echo "a flag listed with underscores:"; echo "$out"; exit 1
fi
echo "$out" | head -5
