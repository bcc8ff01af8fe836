package policy

import (
	"net/netip"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// BenchmarkCompileCIDRs: Compile of a configuration of 100k non-masquerade CIDRs.
func BenchmarkCompileCIDRs(b *testing.B) {
	const n = 100_000
	cfg := config.Config{MasqOutBound: true}
	for i := range n {
		cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs,
			netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(11 + i/65536), byte(i / 256), byte(i), 0}), 24))
	}
	for b.Loop() {
		if p := Compile(cfg, Options{}); len(p.IPv4) != n+2 {
			b.Fatal(len(p.IPv4))
		}
	}
}
