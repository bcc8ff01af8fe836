package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
)

// sourceRulesConfig gives the topology's second and third pods rules of their own: the second
// keeps its address toward the public destinations the global keys masquerade; the third leaves
// behind the node's second address. The first pod matches no rule: the global keys decide.
var sourceRulesConfig = keepPodsConfig + `sourceRules:
- name: keep-public
  cidrs: [10.244.2.0/24, fd00:10:244:2::/64]
  nonMasqueradeCIDRs: [10.0.0.0/8, 8.8.8.0/24, ` + PodNet6.String() + `, 2001:4860::/32]
` + secondAddressRule

// secondAddressRule is sourceRulesConfig's second rule.
const secondAddressRule = `- name: second-address
  cidrs: [10.244.3.0/24, fd00:10:244:3::/64]
  masqueradeAddress: 10.99.0.11
  masqueradeAddressIPv6: 2001:db8:99::11
`

// TestSourceRules, on every backend: three pods send to the same destinations, and each leaves
// as its source rule says (a CIDR rule of the file config): the first as the node, the second
// with its own address, the third behind the node's second address. Then the second pod's rule
// goes away: its established connection keeps the verdict it started with, and its new flows
// are masqueraded.
func TestSourceRules(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		if err := env.AddAltAddresses(ctx); err != nil {
			t.Fatal(err)
		}
		ag := env.StartReady(ctx, t, b, sourceRulesConfig)
		StartLineEcho(t, env.Ext, []netip.Addr{public4, public6})
		pod2, pod2v4, pod2v6 := env.AddPod(ctx, t, 2)
		pod3, pod3v4, pod3v6 := env.AddPod(ctx, t, 3)
		type pod struct {
			ns         string
			addr       [2]netip.Addr
			want       [2]netip.Addr // what the external host sees, IPv4 and IPv6
			wantAfter  [2]netip.Addr // once the second pod's rule is gone
			persistent [2]*Conn
		}
		pods := []*pod{
			{ns: env.Pod, addr: [2]netip.Addr{PodAddr4, PodAddr6}, want: [2]netip.Addr{NodeAddr4, NodeAddr6},
				wantAfter: [2]netip.Addr{NodeAddr4, NodeAddr6}},
			{ns: pod2, addr: [2]netip.Addr{pod2v4, pod2v6}, want: [2]netip.Addr{pod2v4, pod2v6},
				wantAfter: [2]netip.Addr{NodeAddr4, NodeAddr6}},
			{ns: pod3, addr: [2]netip.Addr{pod3v4, pod3v6}, want: [2]netip.Addr{NodeAlt4, NodeAlt6},
				wantAfter: [2]netip.Addr{NodeAlt4, NodeAlt6}},
		}
		check := func(step string, after bool) {
			t.Helper()
			for i, p := range pods {
				for f, dst := range []netip.Addr{public4, public6} {
					want := p.want[f]
					if after {
						want = p.wantAfter[f]
					}
					for _, proto := range []string{"tcp", "udp"} {
						src, err := env.ProbeFrom(ctx, p.ns, p.addr[f], proto, dst)
						if err != nil {
							t.Errorf("%s: pod %d: %v", step, i+1, err)
						} else if src.Addr() != want {
							t.Errorf("%s: pod %d %s to %s: the external host saw %s, want %s", step, i+1, proto, dst, src.Addr(), want)
						}
					}
				}
			}
		}
		check("source rules", false)
		b.Verify(ctx, t, env)
		// Established connections of every pod, to see that they keep their verdicts.
		for i, p := range pods {
			for f, dst := range []netip.Addr{public4, public6} {
				c, err := DialLine(ctx, p.ns, netip.AddrPortFrom(p.addr[f], 0), dst)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				if src, err := c.Exchange(fmt.Sprintf("pod%d-before", i+1)); err != nil || src.Addr() != p.want[f] {
					t.Fatalf("pod %d's connection to %s: seen from %s, %v; want %s", i+1, dst, src, err, p.want[f])
				}
				p.persistent[f] = c
			}
		}

		applied := ag.Count("policy applied")
		after := keepPodsConfig + "sourceRules:\n" + secondAddressRule
		if err := env.Config.Write(after); err != nil {
			t.Fatal(err)
		}
		if err := ag.WaitLog(ctx, applied+1, "policy applied"); err != nil {
			t.Fatal(err)
		}
		env.SetGood(after, false)
		check("the second pod's rule removed", true)
		b.Verify(ctx, t, env)
		for i, p := range pods {
			for f := range p.persistent {
				if src, err := p.persistent[f].Exchange(fmt.Sprintf("pod%d-after", i+1)); err != nil || src.Addr() != p.want[f] {
					t.Errorf("pod %d's established connection after the change: seen from %s, %v; want %s as before", i+1, src, err, p.want[f])
				}
			}
		}
	})
}
