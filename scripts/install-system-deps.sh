#!/usr/bin/env bash
# System packages the end-to-end tests start themselves: Prometheus 2.x (and promtool), tmux, and
# Debian's chromium, which the web view's browser tests drive headless through Playwright (never
# `playwright install`: no browser download), and iproute2, whose `ip netns` gives the multi-node
# launcher test two "nodes" on one machine.
set -euo pipefail
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
