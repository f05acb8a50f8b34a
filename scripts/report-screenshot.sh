#!/bin/sh
# `make screenshots`: the README's picture of `kvscope report` on the shipped lesson race (top of the page).
set -eu
KVSCOPE=${KVSCOPE:-kvscope}
out=${1:-screenshots/report-race-lesson.png}
page=$(mktemp --suffix=.html)
trap 'rm -f "$page"' EXIT
rm -f "$page"
"$KVSCOPE" report traces/race-lesson/*.kvtrace --html "$page"
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
    --window-size=1000,2300 --screenshot="$out" "file://$page" 2>/dev/null
echo "wrote $out" >&2
