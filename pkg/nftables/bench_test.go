package nftables_test

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// cpuTime is the CPU time (user and system) this process and its waited-for children (nft)
// have used: a steadier figure than the wall time on a busy machine.
func cpuTime(b *testing.B) time.Duration {
	var self, children unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &self); err != nil {
		b.Fatal(err)
	}
	if err := unix.Getrusage(unix.RUSAGE_CHILDREN, &children); err != nil {
		b.Fatal(err)
	}
	var d time.Duration
	for _, t := range []unix.Timeval{self.Utime, self.Stime, children.Utime, children.Stime} {
		d += time.Duration(t.Nano())
	}
	return d
}

// BenchmarkApply: the backend's Apply against the kernel, in a namespace of its own. first:
// n CIDRs into a table that holds the defaults; replace: n CIDRs replaced by n others (every
// element deleted and added); again: the same policy applied again (the resync). cpu-ms/op is
// the CPU time the applies took (cpuTime), the kernel's share included.
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
					var cpu time.Duration
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
						runtime.GC() // the garbage of the applies before, not this one's
						start := cpuTime(b)
						b.StartTimer()
						if err := be.Apply(ctx, next); err != nil {
							b.Fatal(err)
						}
						b.StopTimer()
						cpu += cpuTime(b) - start
						b.StartTimer()
					}
					b.ReportMetric(float64(cpu.Milliseconds())/float64(b.N), "cpu-ms/op")
				})
			})
		}
	}
}

// BenchmarkCounters: the backend's Counters (what a metrics scrape reads) against the kernel,
// for a table of n CIDRs.
func BenchmarkCounters(b *testing.B) {
	testutil.RequirePrivileged(b, "ip", "nft")
	for _, n := range []int{10000, 100000} {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			ns := testutil.NewNetns(b)
			testutil.InNetns(b, ns, func() {
				ctx := context.Background()
				be, err := nftables.New(ctx, nftables.Options{})
				if err != nil {
					b.Fatal(err)
				}
				if err := be.Apply(ctx, benchConfig(n, 0)); err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				for range b.N {
					cs, err := be.Counters(ctx)
					if err != nil || len(cs) != n+2 {
						b.Fatalf("%d counters, %v", len(cs), err)
					}
				}
			})
		})
	}
}
