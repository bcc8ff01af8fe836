package e2e

import (
	"context"
	"net/netip"
	"testing"
)

// TestEveryProtocol: GRE, an unassigned protocol and SCTP (raw sockets: no kernel module of
// theirs is needed), ICMP timestamp requests and IPv6 UDP behind a destination options header all
// leave the pod with the node's address and their replies come back, on every backend (iptables
// is the reference: conntrack tracks them all); an SCTP port is the NAT's, and the CRC32c stays
// valid both ways. A destination the policy keeps sees the pod's address.
func TestEveryProtocol(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReady(ctx, t, b, "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\n")
		startRawResponders(t, env)
		env.Check(ctx, t, join(expect(Masq, "8.8.8.8", "2001:4860:4860::8888"), expect(Keep, "10.1.2.3", "fd00::1")), nil)
		for _, dst := range []netip.Addr{netip.MustParseAddr("8.8.8.8"), netip.MustParseAddr("2001:4860:4860::8888")} {
			node := NodeAddr4
			if dst.Is6() {
				node = NodeAddr6
			}
			for _, c := range []struct {
				name  string
				proto int
			}{{"gre", ProtoGRE}, {"protocol 253", ProtoUnknown}, {"sctp", ProtoSCTP}} {
				got, err := env.RawProbe(ctx, c.proto, dst)
				if err != nil {
					t.Errorf("%s to %s: %v", c.name, dst, err)
					continue
				}
				if got.Addr() != node {
					t.Errorf("%s to %s: the external host saw %s, want the node's address %s", c.name, dst, got, node)
				}
			}
		}
		// A second pod's GRE to the same remote: one mapping per protocol and remote, so
		// it is dropped while the first pod's lives (conntrack drops the clash too); to
		// another remote it has its own.
		pod2, pod2v4, _ := env.AddPod(ctx, t, 2)
		if got, err := env.RawProbeFrom(ctx, pod2, pod2v4, ProtoGRE, netip.MustParseAddr("8.8.8.8")); err == nil {
			t.Errorf("a second pod's GRE to the first one's remote was answered (seen from %s), want it dropped", got)
		}
		stop, err := StartRawResponder(env.Ext, []netip.Addr{netip.MustParseAddr("203.0.113.1")}, ProtoGRE)
		if err != nil {
			t.Fatal(err)
		}
		defer stop()
		if got, err := env.RawProbeFrom(ctx, pod2, pod2v4, ProtoGRE, netip.MustParseAddr("203.0.113.1")); err != nil || got.Addr() != NodeAddr4 {
			t.Errorf("a second pod's GRE to another remote: seen from %s (%v), want the node's address", got, err)
		}
		if got, err := env.ICMPTimestamp(ctx, netip.MustParseAddr("8.8.8.8")); err != nil || got != NodeAddr4 {
			t.Errorf("ICMP timestamp: seen from %s (%v), want the node's address", got, err)
		}
		for _, dst := range []string{"2001:4860:4860::8888", "fd00::1"} {
			want := NodeAddr6
			if dst == "fd00::1" {
				want = PodAddr6
			}
			got, err := env.UDPWithDestOpts(ctx, netip.MustParseAddr(dst))
			if err != nil || got.Addr() != want {
				t.Errorf("IPv6 UDP with destination options to %s: seen from %s (%v), want %s", dst, got, err, want)
			}
		}
	})
}
