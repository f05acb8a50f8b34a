#!/bin/sh
# tests/test_report.py renders the report in a headless Chromium; Debian's package is the one that installs here.
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium (Debian's package) for the report's browser test..." >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null && exit 0
fi
echo "note: no chromium; the report's browser test is skipped (outside CI). Install Debian's chromium for it." >&2
exit 0
