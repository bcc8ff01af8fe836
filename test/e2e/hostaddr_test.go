package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Host sockets on node addresses other than the uplink's SNAT address: a secondary address of
// the uplink, the address of another device, and a VIP added while the agent runs (keepalived,
// kube-vip). They are host traffic, whatever the datapath saw of their flows: conntrack on the
// node knows them however their packets came and went.

// keepLocalConfig leaves 10.0.0.0/8 and fd00::/8 alone (the pod networks, the side link below,
// and the external host's 10.1.2.3 and fd00::1), and masquerades the rest.
const keepLocalConfig = "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\n"

// A second link between the node and the external host ("side0" on both), on networks the
// policy of keepLocalConfig leaves alone, so that it is no uplink: requests come in by it, their
// answers leave by the uplink (the route to the clients), as on a node with a management or
// storage network.
var (
	sideNode4, sideExt4 = netip.MustParseAddr("10.98.0.1"), netip.MustParseAddr("10.98.0.2")
	sideNode6, sideExt6 = netip.MustParseAddr("fd00:98::1"), netip.MustParseAddr("fd00:98::2")
	// vip4 and vip6 are addresses the node gets at run time, on its loopback, routed to it by the
	// external host over the side link.
	vip4, vip6 = netip.MustParseAddr("10.98.7.7"), netip.MustParseAddr("fd00:98:7::7")
)

// addSideLink builds the side link and the external host's routes to the VIPs over it. Neither
// end checks reverse paths: requests from the clients come by the side link, their answers
// reach the external host by the uplink.
func addSideLink(ctx context.Context, t testing.TB, env *Env) {
	t.Helper()
	if err := testutil.IPBatch(ctx, env.Node, fmt.Sprintf(`link add side0 type veth peer name side0 netns %s
addr add %s/24 dev side0
addr add %s/64 dev side0 nodad
link set side0 up
`, env.Ext, sideNode4, sideNode6)); err != nil {
		t.Fatalf("side link: %v", err)
	}
	if err := testutil.IPBatch(ctx, env.Ext, fmt.Sprintf(`addr add %s/24 dev side0
addr add %s/64 dev side0 nodad
link set side0 up
route add %s/32 via %s dev side0
route add %s/128 via %s dev side0
`, sideExt4, sideExt6, vip4, sideNode4, vip6, sideNode6)); err != nil {
		t.Fatalf("side link: %v", err)
	}
	for ns, devs := range map[string][]string{env.Ext: {"eth0", "side0"}, env.Node: {Uplink, "side0"}} {
		for _, dev := range append(devs, "all", "default") {
			if err := WriteSysctl(ns, "net.ipv4.conf."+dev+".rp_filter", "0"); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestHostSocketsOnNodeAddresses: host sockets answer clients the policy masquerades, over TCP
// and UDP, IPv4 and IPv6, on the address of a device that is no uplink and on a VIP added while
// the agent runs (their requests come by the side link, their answers leave by the uplink); and
// a connection to the uplink's secondary address opened before the agent started keeps working
// once it runs.
func TestHostSocketsOnNodeAddresses(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		addSideLink(ctx, t, env)
		if err := env.AddAltAddresses(ctx); err != nil {
			t.Fatal(err)
		}
		StartLineEcho(t, env.Node, []netip.Addr{sideNode4, sideNode6, NodeAlt4, NodeAlt6})
		var early []*Conn
		for _, c := range []struct{ from, to netip.Addr }{{public4, NodeAlt4}, {public6, NodeAlt6}} {
			conn, err := DialLine(ctx, env.Ext, netip.AddrPortFrom(c.from, 0), c.to)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := conn.Exchange("before-the-agent"); err != nil {
				t.Fatal(err)
			}
			early = append(early, conn)
		}

		env.StartReady(ctx, t, b, keepLocalConfig)
		if err := testutil.IPBatch(ctx, env.Node, fmt.Sprintf("addr add %s/32 dev lo\naddr add %s/128 dev lo nodad\n", vip4, vip6)); err != nil {
			t.Fatal(err)
		}
		StartLineEchoUDP(t, env.Node, []netip.Addr{vip4, vip6})
		var failed []string
		for _, c := range early {
			if _, err := c.Exchange("after-the-agent-started"); err != nil {
				failed = append(failed, fmt.Sprintf("the connection to %s opened before the agent: %v", c.c.RemoteAddr(), err))
			}
		}
		for _, c := range []struct{ from, to netip.Addr }{
			{public4, sideNode4}, {public6, sideNode6}, {public4, vip4}, {public6, vip6},
		} {
			for _, proto := range []string{"tcp", "udp"} {
				p := connProbe{what: fmt.Sprintf("%s -> %s", c.from, c.to), ns: env.Ext, from: c.from,
					dst:  netip.AddrPortFrom(c.to, LinePort),
					want: func(l netip.AddrPort) netip.Addr { return l.Addr().Unmap() }}
				if msg := p.run(ctx, proto); msg != "" {
					failed = append(failed, proto+" "+msg)
				}
			}
		}
		if len(failed) > 0 {
			t.Errorf("%d host sockets did not answer:\n%s", len(failed), strings.Join(failed, "\n"))
		}
	})
}
