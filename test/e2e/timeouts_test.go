package e2e

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// TestIdleEstablishedSurvives: an established TCP connection, IPv4 and IPv6, idle far past the
// 6 hours the BPF datapath once kept one, keeps working on every backend: the default timeouts
// are conntrack's, here the node's own nf_conntrack_tcp_timeout_established, which conntrack
// (the iptables and nftables backends) and the BPF agent both read in the node's namespace.
// Time is scaled: the node's sysctl says 8 s where conntrack's default is 5 days, so 1 s stands
// for 15 hours, and the BPF sweep runs every 200 ms (--nat-sweep-interval). The connections
// idle 2 s (30 scaled hours), twice; on BPF the agent logs the timeout it took from the node,
// and its sweep removes the connections once they idle past those 8 s.
func TestIdleEstablishedSurvives(t *testing.T) {
	const (
		established = 8 * time.Second
		idle        = 2 * time.Second
	)
	eachBackend(t, backends(), []string{"--enable-ipv6", "--nat-sweep-interval=200ms"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		if err := WriteSysctl(env.Node, "net.netfilter.nf_conntrack_tcp_timeout_established", "8"); err != nil {
			t.Fatal(err)
		}
		ag := env.StartReadyNoFile(ctx, t, b)
		StartLineEcho(t, env.Ext, []netip.Addr{public4, public6})
		env.CutReturnRoutes(ctx, t)
		type conn struct {
			c   *Conn
			src netip.AddrPort
		}
		var conns []conn
		for _, dst := range []netip.Addr{public4, public6} {
			c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, dst)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			src, err := c.Exchange("hello")
			if err != nil || src.Addr() != NodeAddr4 && src.Addr() != NodeAddr6 {
				t.Fatalf("to %s: seen from %s (%v), want the node's address", dst, src, err)
			}
			conns = append(conns, conn{c, src})
		}
		for round := 1; round <= 2; round++ {
			time.Sleep(idle)
			for _, c := range conns {
				if src, err := c.c.Exchange("again"); err != nil || src != c.src {
					t.Fatalf("after idling %v (round %d): seen from %s (%v), want %s as before", idle, round, src, err, c.src)
				}
			}
		}
		if !b.NAT {
			return
		}
		if ag.Count("NAT timeouts", "tcp-established=\"8s (the node's conntrack sysctl)\"") == 0 {
			t.Errorf("the agent did not log the node's established timeout:\n%s", ag.Logs())
		}
		// Idle past the node's timeout, the sweep removes them (two halves each, and on pod0,
		// an uplink of IPv6, which the defaults masquerade toward the pods, the two of the IPv6
		// connection's record there).
		entries := func() float64 {
			m, err := ag.Scrape(ctx)
			if err != nil {
				t.Fatal(err)
			}
			n := 0.0
			for _, v := range m.Series("ip_masq_agent_nat_entries", Labels{"protocol": "tcp", "state": "established"}) {
				n += v
			}
			return n
		}
		if n := entries(); n < 4 {
			t.Fatalf("%v established TCP entries before the long idle, want the connections' (at least 4)", n)
		}
		if err := testutil.Poll(established+5*time.Second, 200*time.Millisecond, func() error {
			if n := entries(); n != 0 {
				return testutil.NotYet("the idle connections (%v entries) out of the table (the node's timeout: %v)", n, established)
			}
			return nil
		}); err != nil {
			t.Fatalf("%v after their last packet", err)
		}
	})
}
