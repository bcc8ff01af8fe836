package e2e

import (
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// Backends are the datapaths every end-to-end test runs against, here and in the suites that
// build on this one (test/fleet). A new backend adds a Backend value here; nothing else in the
// tables changes.
func Backends() []Backend {
	return []Backend{
		IptablesBackend(iptables.ModeNFT),
		IptablesBackend(iptables.ModeLegacy),
		NftablesBackend(),
		BPFBackend(tc.ModeTCX),
		BPFBackend(tc.ModeTC),
	}
}
