package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// TestNexthopUplink: a node whose default routes go through nexthop objects (as a route daemon
// such as FRR installs them), with net.ipv4.nexthop_compat_mode off in the node's namespace so
// that a route dump carries the objects' ids alone: the IPv4 default route through a group, the
// IPv6 one through a single nexthop. Pod traffic is masqueraded behind the uplink on every
// backend; when the nexthop objects move to a second device (no route event says so), new
// flows leave by it masqueraded behind its address. On BPF the agent finds the uplinks through
// the objects, and follows them.
func TestNexthopUplink(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		if err := WriteSysctl(env.Node, "net.ipv4.nexthop_compat_mode", "0"); err != nil {
			t.Fatal(err)
		}
		if err := testutil.IPBatch(ctx, env.Node, fmt.Sprintf(`nexthop add id 1 via %s dev %s
nexthop add id 3 group 1
nexthop add id 2 via %s dev %s
route replace default nhid 3
route replace ::/0 nhid 2
`, ExtAddr4, Uplink, ExtAddr6, Uplink)); err != nil {
			t.Fatal(err)
		}
		if out, err := NSExec(ctx, env.Node, "", "ip", "route", "show", "default"); err != nil || string(out) != "default nhid 3 \n" {
			t.Fatalf("the default route shows %q (%v): want its nexthop id alone", out, err)
		}
		// The uplink's own subnets are kept, so that only the default routes make it one.
		env.StartReady(ctx, t, b, "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8, 2001:db8:99::/64]\n")
		env.Check(ctx, t, expect(Masq, "8.8.8.8", "2001:4860:4860::8888", "198.18.0.1"), nil)

		// The nexthops move to uplink2: its external host (which has ext2Masq4 and ext2Masq6,
		// as the first one does) sees them from uplink2's addresses.
		env.addSecondUplink(ctx, t)
		if err := testutil.IPBatch(ctx, env.Node, fmt.Sprintf("nexthop replace id 1 via %s dev uplink2\nnexthop replace id 2 via %s dev uplink2\n",
			ext2Addr4, ext2Addr6)); err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct{ dst, want netip.Addr }{{ext2Masq4, uplink2Addr4}, {ext2Masq6, uplink2Addr6}} {
			for _, proto := range []string{"tcp", "udp"} {
				if err := testutil.Poll(LiveChangeDeadline, 0, func() error {
					if got, err := env.Probe(ctx, proto, c.dst); err != nil || got.Addr() != c.want {
						return testutil.NotYet("the host saw %s (%v), want %s", got, err, c.want)
					}
					return nil
				}); err != nil {
					t.Fatalf("%s to %s after the nexthops moved: %v", proto, c.dst, err)
				}
			}
		}
		if b.NAT {
			if err := env.Agent.WaitLog(ctx, 1, "programs attached", "uplink2"); err != nil {
				t.Fatal(err)
			}
		}
	})
}
