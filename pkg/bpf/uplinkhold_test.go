package bpf

import (
	"net/netip"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestUplinkAddressChangeHeld: an SNAT address that changes while the old one stays on the node
// (a masqueradeAddress changed) keeps the flows of the old one, both ways, as conntrack keeps a
// flow's binding; new flows leave from the new address.
func TestUplinkAddressChangeHeld(t *testing.T) {
	h := newHarness(t, defaultPolicy(false), LoadOptions{})
	dst := ap(remote4, 443)
	pod := ap(pod4(1), 1000)
	was := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(pod, dst, tcpSYN, nil))).src
	if was.Addr() != snat4 {
		t.Fatalf("flow leaves from %s, want %s", was, snat4)
	}
	flows := len(h.flowsOf(policy.IPv4))

	next := netip.MustParseAddr("192.0.2.99")
	n, err := h.dp.SetUplinkHolding(testIfindex, Uplink{IPv4: next}, []netip.Addr{snat4, next})
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 || len(h.flowsOf(policy.IPv4)) != flows {
		t.Fatalf("flushed %d entries of an address the node still has", n)
	}
	if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(pod, dst, tcpACK, nil))).src; got != was {
		t.Fatalf("the open flow now leaves from %s, want %s", got, was)
	}
	if back := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpPacket(dst, was, tcpACK, nil))); back.dst != pod {
		t.Fatalf("the open flow's reply arrives at %s, want %s", back.dst, pod)
	}
	if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(2), 1000), dst, tcpSYN, nil))).src; got.Addr() != next {
		t.Fatalf("a new flow leaves from %s, want %s", got, next)
	}

	// Gone from the node, the address takes its flows.
	if n, err := h.dp.SetUplinkHolding(testIfindex, Uplink{IPv4: snat4}, []netip.Addr{snat4}); err != nil || n == 0 {
		t.Fatalf("address %s left the node: flushed %d entries (%v), want its flows", next, n, err)
	}
}

// TestRemoveUplinkShared: two uplinks sharing an SNAT address (a masqueradeAddress is every
// uplink's): removing one keeps the flows of the address the other still translates to, which
// removing both flushes; MasqueradedFlows counts a flow once, by its remote end.
func TestRemoveUplinkShared(t *testing.T) {
	h := newHarness(t, defaultPolicy(false), LoadOptions{})
	const other = 77 // a second uplink with the same address; the map takes any ifindex
	if _, err := h.dp.SetUplink(other, Uplink{IPv4: snat4}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(1+i), 1000), ap(remote4, 443), tcpSYN, nil))
	}
	count := func(through func(netip.Addr) bool) int {
		t.Helper()
		n, err := h.dp.MasqueradedFlows(snat4, through)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(nil); n != 2 {
		t.Fatalf("%d flows of %s, want 2", n, snat4)
	}
	if n := count(func(remote netip.Addr) bool { return remote != remote4 }); n != 0 {
		t.Fatalf("%d flows of %s toward another remote, want 0", n, snat4)
	}
	flows := len(h.flowsOf(policy.IPv4))
	if n, err := h.dp.RemoveUplinkHolding(other, []netip.Addr{snat4}); err != nil || n != 0 || len(h.flowsOf(policy.IPv4)) != flows {
		t.Fatalf("removing one of two uplinks of %s flushed %d entries (%v)", snat4, n, err)
	}
	if _, ok, _ := h.dp.Uplink(other); ok {
		t.Fatal("the uplink removed is still in uplink_snat")
	}
	// Nobody else's, the address takes its flows.
	if n, err := h.dp.RemoveUplinkHolding(testIfindex, nil); err != nil || n != 2*flows || count(nil) != 0 {
		t.Fatalf("removing the last uplink of %s flushed %d entries, want %d (both halves of %d flows) (%v)", snat4, n, 2*flows, flows, err)
	}
}
