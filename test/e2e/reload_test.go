package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"
)

// reloadConfigs are two configurations whose datapaths differ in every way an apply changes
// one, while deciding two destinations alike: 8.8.8.8 is masqueraded by the outbound rule in the
// first and by a masqueradeCIDRs entry in the second (which has no outbound rule), 10.1.2.3 kept
// by a /16 in the first and a /24 in the second. Each also holds n CIDRs the other has not, of
// another prefix length (on nftables, sets that come and go), so that an apply takes a while.
// Both keep the pods' range, as a cluster's configuration does (the BPF backend attaches to
// every device a masqueraded destination routes by, so the pods' device would come and go).
func reloadConfigs(n int) [2]string {
	var a, b strings.Builder
	limit := fmt.Sprintf("cidrLimit: %d\n", n+2)
	a.WriteString(limit)
	b.WriteString(limit)
	a.WriteString("masqOutBound: true\nnonMasqueradeCIDRs:\n- 10.244.0.0/16\n- 10.1.0.0/16\n")
	b.WriteString("masqOutBound: false\nmasqueradeCIDRs: [8.8.8.8/32]\nnonMasqueradeCIDRs:\n- 10.244.0.0/16\n- 10.1.2.0/24\n")
	for i := range n {
		fmt.Fprintf(&a, "- 11.%d.%d.0/24\n", i/256, i%256)
		fmt.Fprintf(&b, "- 12.%d.%d.0/23\n", i/128, i%128*2)
	}
	return [2]string{a.String(), b.String()}
}

// TestReloadUnderTraffic: while new TCP connections to 8.8.8.8 and 10.1.2.3 follow each other
// without pause, the configuration alternates between two that decide both alike (see
// reloadConfigs). Every connection must see the source both configurations give it: one opened
// while the datapath stood half applied (the outbound rule gone before the masqueradeCIDRs entry
// came, the /16 gone before the /24 came) would see the other.
func TestReloadUnderTraffic(t *testing.T) {
	const (
		reloads = 6
		cidrs   = 1000
	)
	configs := reloadConfigs(cidrs)
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		ag := env.StartReady(ctx, t, b, configs[0])

		masq, keep := netip.MustParseAddr("8.8.8.8"), netip.MustParseAddr("10.1.2.3")
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var mu sync.Mutex
		var failures []string
		probes := 0
		for _, w := range []struct {
			dst  netip.Addr
			want Want
		}{{masq, Masq}, {keep, Keep}} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					got, src, err := env.Observe(ctx, "tcp", w.dst)
					mu.Lock()
					probes++
					if err != nil || got != w.want {
						failures = append(failures, fmt.Sprintf("%s: %s: seen from %s (%s), want %s, %v",
							time.Now().Format("15:04:05.000"), w.dst, src, got, w.want, err))
					}
					mu.Unlock()
				}
			}()
		}
		for i := range reloads {
			applied := ag.Count("policy applied")
			cfg := configs[(i+1)%2]
			if err := env.Config.Write(cfg); err != nil {
				t.Fatal(err)
			}
			env.SetGood(cfg, false)
			if err := ag.WaitLog(ctx, applied+1, "policy applied"); err != nil {
				t.Fatal(err)
			}
			t.Logf("reload %d applied at %s", i+1, time.Now().Format("15:04:05.000"))
		}
		close(stop)
		wg.Wait()
		for _, f := range failures {
			t.Error(f)
		}
		if probes < 10*reloads {
			t.Errorf("only %d connections during %d reloads", probes, reloads)
		}
		t.Logf("%d connections during %d reloads, %d saw another source", probes, reloads, len(failures))
		b.Verify(ctx, t, env)
	})
}
