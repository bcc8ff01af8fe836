package nftables_test

import (
	"context"
	"fmt"
	"net/netip"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// benchConfig has n non-masquerade /24s from 11.0.0.0/24 on, numbered from first, as the
// end-to-end apply benchmark writes them.
func benchConfig(n, first int) *policy.Policy {
	cfg := config.Config{MasqOutBound: true}
	for i := first; i < first+n; i++ {
		cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs,
			netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(11 + i/65536), byte(i / 256 % 256), byte(i % 256), 0}), 24))
	}
	return compile(cfg, false)
}

// BenchmarkApply: the backend's Apply against the kernel, in a namespace of its own. first:
// n CIDRs into a table that holds the defaults; replace: n CIDRs replaced by n others (every
// element deleted and added); again: the same policy applied again (the resync).
func BenchmarkApply(b *testing.B) {
	testutil.RequirePrivileged(b, "ip", "nft")
	for _, n := range []int{10000, 100000} {
		for _, kind := range []string{"first", "replace", "again"} {
			b.Run(fmt.Sprintf("cidrs=%d/%s", n, kind), func(b *testing.B) {
				ns := testutil.NewNetns(b)
				testutil.InNetns(b, ns, func() {
					ctx := context.Background()
					be, err := nftables.New(ctx, nftables.Options{})
					if err != nil {
						b.Fatal(err)
					}
					defaults := compile(config.Default(config.Options{}), false)
					policies := [2]*policy.Policy{benchConfig(n, 0), benchConfig(n, n)}
					for i := 0; i < b.N; i++ {
						b.StopTimer()
						before := defaults
						switch kind {
						case "replace":
							before = policies[(i+1)%2]
						case "again":
							before = policies[0]
						}
						if err := be.Apply(ctx, before); err != nil {
							b.Fatal(err)
						}
						next := policies[0]
						if kind == "replace" {
							next = policies[i%2]
						}
						b.StartTimer()
						if err := be.Apply(ctx, next); err != nil {
							b.Fatal(err)
						}
					}
				})
			})
		}
	}
}
