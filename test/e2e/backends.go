package e2e

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// BackendsEnv narrows Backends to those whose names start with one of its comma-separated
// prefixes ("bpf": both attach modes); the kernel matrix (test/kernels) runs the suite on
// the BPF backend alone.
const BackendsEnv = "IP_MASQ_AGENT_E2E_BACKENDS"

// Backends are the datapaths every end-to-end test runs against, here and in the suites that
// build on this one (test/fleet): the BPF backend in each attach mode the kernel has (BPFModes).
// A new backend adds a Backend value here; nothing else in the tables changes.
func Backends() []Backend {
	all := []Backend{
		IptablesBackend(iptables.ModeNFT),
		IptablesBackend(iptables.ModeLegacy),
		NftablesBackend(),
	}
	for _, mode := range BPFModes() {
		all = append(all, BPFBackend(mode))
	}
	want := strings.Split(os.Getenv(BackendsEnv), ",")
	if want[0] == "" {
		return all
	}
	var out []Backend
	for _, w := range want {
		w = strings.TrimSpace(w)
		matched := false
		for _, b := range all {
			if !strings.HasPrefix(b.Name, w) {
				continue
			}
			matched = true
			if !slices.ContainsFunc(out, func(o Backend) bool { return o.Name == b.Name }) {
				out = append(out, b)
			}
		}
		if !matched {
			// A misspelt name would leave the tables empty and every scenario passing unrun.
			panic(fmt.Sprintf("%s=%q: %q names none of the backends %v", BackendsEnv, os.Getenv(BackendsEnv), w, names(all)))
		}
	}
	return out
}

func names(bs []Backend) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = b.Name
	}
	return out
}

// BPFModes are the attach modes of the BPF backend this kernel has, the best first: tcx (Linux
// 6.6+, probed) and tc. Where the probe cannot tell (no privileges) both are listed, and the
// tests stop on their own: a skip without privileges, a failure in CI.
var BPFModes = sync.OnceValue(func() []string {
	if has, err := tc.HaveTCX(); err == nil && !has {
		return []string{tc.ModeTC}
	}
	return []string{tc.ModeTCX, tc.ModeTC}
})

// BestBPFBackend is the BPF backend in the kernel's best attach mode: for the tests of what the
// datapath does whatever the hook.
func BestBPFBackend() Backend { return BPFBackend(BPFModes()[0]) }
