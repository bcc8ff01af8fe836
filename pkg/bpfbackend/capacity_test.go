package bpfbackend

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// bigPolicy has n non-masquerade /24s besides 10.0.0.0/8 (kept first, so it is "the same rule"
// as in the defaults).
func bigPolicy(t *testing.T, n int) *policy.Policy {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "cidrLimit: %d\nnonMasqueradeCIDRs:\n  - 10.0.0.0/8\n", n+1)
	for i := range n {
		fmt.Fprintf(&b, "  - 11.%d.%d.0/24\n", i/256, i%256)
	}
	return compile(t, b.String(), false)
}

func counterOf(t *testing.T, b *Backend, prefix string) datapath.RuleCounter {
	t.Helper()
	cs, err := b.Counters(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cs {
		if c.Prefix.String() == prefix {
			return c
		}
	}
	t.Fatalf("no counter for %s", prefix)
	return datapath.RuleCounter{}
}

// A policy with more rules than the maps were sized for grows them: the larger rule maps are
// loaded over the same pins, rules that stay keep their counters, the new rules decide, and a
// restarted agent reuses the larger maps.
func TestRuleMapsGrow(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	inNetns(t, func() {
		link := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "uplink0"}, PeerName: "peer0"}
		if err := netlink.LinkAdd(link); err != nil {
			t.Fatal(err)
		}
		addr, _ := netlink.ParseAddr("192.0.2.1/24")
		if err := netlink.AddrAdd(link, addr); err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetUp(link); err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		newBackend := func() *Backend {
			b, err := New(ctx, Options{BPFFS: bpffs, Interfaces: []string{"uplink0"}})
			if err != nil {
				t.Fatal(err)
			}
			return b
		}
		b := newBackend()
		if err := b.Apply(ctx, compile(t, "", false)); err != nil {
			t.Fatal(err)
		}
		small := b.dp.Load()
		if small.RuleCapacity() != int(bpf.DefaultMaxRules()) {
			t.Fatalf("capacity %d for the defaults, want %d", small.RuleCapacity(), bpf.DefaultMaxRules())
		}
		pod, kept := netip.MustParseAddrPort("10.244.0.5:1000"), netip.MustParseAddrPort("10.1.2.3:53")
		for range 3 {
			run(t, small.Egress(), udp(t, pod, kept))
		}

		// n+5 slots during the sync (the defaults' 5 rules still hold theirs): more than the maps have.
		n := small.RuleCapacity() + 904
		big := bigPolicy(t, n)
		last := fmt.Sprintf("11.%d.%d.0/24", (n-1)/256, (n-1)%256)
		if err := b.Apply(ctx, big); err != nil {
			t.Fatal(err)
		}
		grown := b.dp.Load()
		if grown == small || grown.RuleCapacity() != int(bpf.CapacityFor(n+5)) {
			t.Fatalf("capacity %d after a %d-rule policy, want %d", grown.RuleCapacity(), n+2, bpf.CapacityFor(n+5))
		}
		if c := counterOf(t, b, "10.0.0.0/8"); c.Packets != 3 {
			t.Errorf("10.0.0.0/8 counted %d packets across the growth, want 3", c.Packets)
		}
		run(t, grown.Egress(), udp(t, pod, kept))
		run(t, grown.Egress(), udp(t, pod, netip.AddrPortFrom(netip.MustParsePrefix(last).Addr().Next(), 53))) // the last /24
		if c := counterOf(t, b, "10.0.0.0/8"); c.Packets != 4 {
			t.Errorf("10.0.0.0/8 counted %d packets, want 4", c.Packets)
		}
		if c := counterOf(t, b, last); c.Packets != 1 || c.Action != policy.Return {
			t.Errorf("the last new rule: %+v, want 1 packet, RETURN", c)
		}
		pinned, err := bpf.OpenPinnedReadOnly(b.pinDir)
		if err != nil {
			t.Fatal(err)
		}
		if pinned.RuleCapacity() != int(bpf.CapacityFor(n+5)) {
			t.Errorf("pinned capacity %d, want %d", pinned.RuleCapacity(), bpf.CapacityFor(n+5))
		}
		pinned.Close()
		// The programs on the uplink are the grown datapath's: they see its counters.
		st, err := b.attach.Check(ctx, link.Attrs().Index, tc.Programs{Egress: grown.Egress(), Ingress: grown.Ingress()})
		if err != nil {
			t.Fatal(err)
		}
		if !st.Runs {
			t.Errorf("uplink0 does not run the grown datapath's programs (%s)", b.Mode())
		}
		if err := b.Apply(ctx, big); err != nil || b.dp.Load() != grown {
			t.Errorf("a second apply of the same policy reloaded the maps (%v)", err)
		}

		// A restarted agent keeps the larger maps and their counters.
		b.Close()
		again := newBackend()
		defer again.Close()
		if err := again.Apply(ctx, big); err != nil {
			t.Fatal(err)
		}
		if c := counterOf(t, again, "10.0.0.0/8"); c.Packets != 4 || again.dp.Load().RuleCapacity() != grown.RuleCapacity() {
			t.Errorf("after a restart: 10.0.0.0/8 counted %d packets, capacity %d", c.Packets, again.dp.Load().RuleCapacity())
		}
	})
}
