package bpf

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestPerDestinationAddress: the destinations of masqueradeCIDRs entries with addresses of their
// own leave from those addresses, the rest from the uplink's, over TCP and UDP; replies to each
// address come back to the pod. A policy change that moves destinations to another address keeps
// the open flows on the address they were created with, both ways, as conntrack keeps a flow's
// binding; new flows take the new address.
func TestPerDestinationAddress(t *testing.T) {
	addr := netip.MustParseAddr
	altA, altB, alt6 := addr("192.0.2.11"), addr("192.0.2.12"), addr("2001:db8::11")
	netA, netB, net6 := "198.51.100.0/24", "203.0.113.0/24", "2001:db8:ffff::/48"
	before := withAddrs(prefixes(netA, netB, net6), nil, true, map[string]string{netA: altA.String(), netB: altB.String(), net6: alt6.String()})
	after := withAddrs(prefixes(netA, netB, net6), nil, true, map[string]string{netA: altB.String(), netB: altA.String()})
	h := newHarness(t, before, LoadOptions{})

	type flow struct {
		name     string
		pod, dst netip.AddrPort
		tcp      bool
		from     netip.Addr // the address it leaves from
		out      tuple
	}
	var flows []*flow
	for i, c := range []struct {
		dst  netip.Addr
		from netip.Addr
	}{
		{remote4, altA}, {addr("203.0.113.9"), altB}, {addr("8.8.8.8"), snat4},
		{remote6, alt6}, {addr("2001:4860::8888"), snat6},
	} {
		for _, tcp := range []bool{false, true} {
			pod := pod4(i + 1)
			if c.dst.Is6() {
				pod = pod6(i + 1)
			}
			flows = append(flows, &flow{name: fmt.Sprintf("%s tcp=%v", c.dst, tcp), pod: ap(pod, 1000),
				dst: ap(c.dst, 443), tcp: tcp, from: c.from})
		}
	}
	packet := func(src, dst netip.AddrPort, tcp bool, flags int) []byte {
		if tcp {
			return tcpPacket(src, dst, flags, nil)
		}
		return udpPacket(src, dst, payload)
	}
	// send sends a packet of f out and its reply back, and checks both.
	send := func(f *flow, flags int) {
		t.Helper()
		got := tupleOf(t, h.mustPass(h.dp.Egress(), packet(f.pod, f.dst, f.tcp, flags)))
		if got.src.Addr() != f.from || got.dst != f.dst {
			t.Fatalf("%s: leaves as %s, want from %s", f.name, got, f.from)
		}
		if f.out != (tuple{}) && got != f.out {
			t.Fatalf("%s: leaves as %s, earlier as %s", f.name, got, f.out)
		}
		f.out = got
		back := tupleOf(t, h.mustPass(h.dp.Ingress(), packet(got.dst, got.src, f.tcp, tcpSYN|tcpACK)))
		if back.src != f.dst || back.dst != f.pod {
			t.Fatalf("%s: the reply to %s arrives as %s, want %s -> %s", f.name, got.src, back, f.dst, f.pod)
		}
	}
	for _, f := range flows {
		send(f, tcpSYN)
	}

	// The addresses of the two IPv4 entries swapped, IPv6's dropped: open flows keep theirs.
	if err := h.dp.SyncPolicy(after); err != nil {
		t.Fatal(err)
	}
	for _, f := range flows {
		send(f, tcpACK)
	}
	// New flows (another pod port) take the new addresses.
	for _, f := range flows {
		g := *f
		g.pod, g.out = ap(f.pod.Addr(), 2000), tuple{}
		switch f.from {
		case altA:
			g.from = altB
		case altB:
			g.from = altA
		case alt6:
			g.from = snat6
		}
		send(&g, tcpSYN)
	}
}

// TestRemapKeepsAddress: a masqueraded flow whose port another flow took after the LRU evicted
// its reply half moves to a new port on the address it was created with, whatever address the
// policy gives its destination by then (conntrack keeps a flow's binding), and both flows' replies
// reach their pods.
func TestRemapKeepsAddress(t *testing.T) {
	alt, next := netip.MustParseAddr("192.0.2.11"), "192.0.2.12"
	dst := ap(remote4, 443)
	// Ports kept where free (no --random-fully), so that the second pod can ask for the first's.
	policyTo := func(addr string) *policy.Policy {
		cfg := config.Config{MasqOutBound: true, MasqueradeCIDRs: []config.MasqueradeCIDR{
			{CIDR: netip.MustParsePrefix("198.51.100.0/24"), Address: netip.MustParseAddr(addr)}}}
		return policy.Compile(cfg, policy.Options{})
	}
	h := newHarness(t, policyTo(alt.String()), LoadOptions{})
	one := ap(pod4(11), 40100)
	nat := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(one, dst, tcpSYN, nil))).src
	if nat.Addr() != alt {
		t.Fatalf("flow leaves from %s, want %s", nat, alt)
	}
	if err := h.dp.deleteEntries(policy.IPv4, []NATEntry{{Dir: Ingress, Proto: 6, Src: dst, Dst: nat}}); err != nil {
		t.Fatal(err)
	}
	two := ap(pod4(12), nat.Port())
	if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(two, dst, tcpSYN, nil))).src; got != nat {
		t.Fatalf("second pod got %s, want the free port %s", got, nat)
	}
	if err := h.dp.SyncPolicy(policyTo(next)); err != nil {
		t.Fatal(err)
	}
	h.age(Egress, 6, one, dst, 2*time.Second)
	reallocs := h.events()[Event(masqEventEV_REALLOC)]
	moved := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(one, dst, tcpACK, nil))).src
	if moved == nat || moved.Addr() != alt {
		t.Fatalf("first flow moved from %s to %s, want another port of %s", nat, moved, alt)
	}
	if h.events()[Event(masqEventEV_REALLOC)] != reallocs+1 {
		t.Fatalf("reallocation not counted")
	}
	if back := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpPacket(dst, moved, tcpACK, nil))); back.dst != one {
		t.Fatalf("first flow's reply arrives at %s", back.dst)
	}
	if back := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpPacket(dst, nat, tcpACK, nil))); back.dst != two {
		t.Fatalf("second flow's reply arrives at %s", back.dst)
	}
}

// TestMasqueradeAddressHome: a family's masqueradeAddress has one home in the maps, nat_config's
// family_cfg.snat, where the programs read it. With the uplinks' entries holding their own
// addresses only, the flows of the outbound rule and of a masqueradeCIDRs entry without an
// address of its own leave from the family's masqueradeAddress, an entry's own address still
// wins, and the replies come back to the pods. The tries hold no address but the entry's own,
// and the installed rules show each masquerade rule's address, the outbound rules' too.
func TestMasqueradeAddressHome(t *testing.T) {
	addr := netip.MustParseAddr
	masq4, masq6, own := addr("192.0.2.21"), addr("2001:db8::21"), addr("192.0.2.22")
	netOwn, netFamily := netip.MustParsePrefix("198.51.100.0/24"), netip.MustParsePrefix("203.0.113.0/24")
	cfg := config.Config{MasqOutBound: true, MasqOutBoundIPv6: true, MasqueradeAddress: masq4, MasqueradeAddressIPv6: masq6,
		MasqueradeCIDRs: []config.MasqueradeCIDR{{CIDR: netOwn, Address: own}, {CIDR: netFamily}}}
	h := newHarness(t, policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true}), LoadOptions{})
	// The harness gave the uplinks their own addresses, snat4 and snat6, and nothing else.
	for i, c := range []struct{ dst, from netip.Addr }{
		{remote4, own}, {addr("203.0.113.9"), masq4}, {addr("8.8.8.8"), masq4}, {remote6, masq6},
	} {
		pod := ap(pod4(i+1), 1000)
		if c.dst.Is6() {
			pod = ap(pod6(i+1), 1000)
		}
		dst := ap(c.dst, 53)
		out := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(pod, dst, payload)))
		if out.src.Addr() != c.from || out.dst != dst {
			t.Errorf("%s -> %s leaves as %s, want from %s", pod, dst, out, c.from)
			continue
		}
		if back := tupleOf(t, h.mustPass(h.dp.Ingress(), udpPacket(dst, out.src, payload))); back.src != dst || back.dst != pod {
			t.Errorf("the reply to %s arrives as %s, want %s -> %s", out.src, back, dst, pod)
		}
	}

	// What the maps hold, read back from them.
	if err := h.dp.Refresh(); err != nil {
		t.Fatal(err)
	}
	for _, tr := range h.dp.tries {
		for prefix, v := range tr.held {
			if v.snat.IsValid() && (prefix != netOwn || v.snat != own) {
				t.Errorf("trie %v holds %s for %s; only %s's own address belongs there", tr.trieKind, v.snat, prefix, netOwn)
			}
		}
	}
	rules, err := h.dp.InstalledRules()
	if err != nil {
		t.Fatal(err)
	}
	want := map[netip.Prefix]netip.Addr{netOwn: own, netFamily: masq4,
		netip.MustParsePrefix("0.0.0.0/0"): masq4, netip.MustParsePrefix("::/0"): masq6}
	for _, r := range rules {
		if w, ok := want[r.Prefix]; ok && r.Action == policy.Masquerade {
			if r.Address != w {
				t.Errorf("installed %s rule %s (%s) masquerades to %v, want %s", r.Family, r.Prefix, r.Origin, r.Address, w)
			}
			delete(want, r.Prefix)
		}
	}
	if len(want) > 0 {
		t.Errorf("no installed masquerade rule for %v", want)
	}
}
