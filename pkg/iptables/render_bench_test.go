package iptables

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// BenchmarkRenderKeepingCounters: the payload of a reload that replaces every one of n CIDRs
// (nothing pairs up, the worst case for matching live lines).
func BenchmarkRenderKeepingCounters(b *testing.B) {
	for _, n := range []int{1000, 10_000, 100_000} {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			cidrs := func(first int) []netip.Prefix {
				out := make([]netip.Prefix, n)
				for i := range out {
					j := first + i
					out[i] = netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(11 + j/65536), byte(j / 256), byte(j), 0}), 24)
				}
				return out
			}
			old := policy.Compile(config.Config{NonMasqueradeCIDRs: cidrs(0), MasqOutBound: true}, policy.Options{})
			p := policy.Compile(config.Config{NonMasqueradeCIDRs: cidrs(n), MasqOutBound: true}, policy.Options{})
			var live []SavedRule
			for _, l := range ChainLines(old, policy.IPv4, DefaultChain) {
				live = append(live, SavedRule{Chain: l.Rule.Chain, Spec: l.Rule.Spec(), Packets: 1, Bytes: 60})
			}
			b.ResetTimer()
			for range b.N {
				RenderKeepingCounters(p, policy.IPv4, DefaultChain, false, live)
			}
		})
	}
}
