#!/usr/bin/env bash
# The demo: what the agent decides for a few destinations under the built-in default configuration.
set -euo pipefail
bin=${1:-bin/ip-masq-agent}
empty=$(mktemp -d)
trap 'rm -rf "$empty"' EXIT
echo "== explain: the default configuration (no config file)"
"$bin" explain --config "$empty/none" 10.1.2.3 172.20.0.5 192.168.1.1 169.254.169.254 8.8.8.8 1.1.1.1
echo
echo "== render: the chain the iptables backend installs"
"$bin" render --config "$empty/none"
