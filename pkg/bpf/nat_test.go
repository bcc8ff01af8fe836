package bpf

import (
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// flowsOf lists the flows of a family as "kind proto src->dst" of their egress halves, and
// fails when a flow lacks its ingress half.
func (h *harness) flowsOf(fam policy.Family) map[string]bool {
	h.t.Helper()
	type key struct {
		dir      Direction
		src, dst netip.AddrPort
	}
	all := map[key]NATEntry{}
	if err := h.dp.NATEntries(fam, func(e NATEntry) bool {
		all[key{e.Dir, e.Src, e.Dst}] = e
		return true
	}); err != nil {
		h.t.Fatal(err)
	}
	out := map[string]bool{}
	for k, e := range all {
		if k.dir != Egress {
			continue
		}
		s, d := partnerKey(e)
		if p, ok := all[key{Ingress, s, d}]; !ok || !pointsBack(e, p) {
			h.t.Fatalf("flow %s -> %s has no ingress half", e.Src, e.Dst)
		}
		out[e.Src.String()+"->"+e.Dst.String()] = true
	}
	if len(all) != 2*len(out) {
		h.t.Fatalf("%d entries for %d flows", len(all), len(out))
	}
	return out
}

// entryMap is the flow table that holds the entry at (dir, proto, src, dst).
func (h *harness) entryMap(dir Direction, proto uint8, src, dst netip.AddrPort) *ebpf.Map {
	h.t.Helper()
	e, ok, err := h.dp.LookupNAT(dir, proto, src, dst)
	if err != nil || !ok {
		h.t.Fatalf("no entry %s %s -> %s (%v)", dir, src, dst, err)
	}
	return h.dp.natTable(policy.FamilyOf(src.Addr())).tables()[e.Table]
}

// age sets an entry's last_seen, as if its last packet was that long ago.
func (h *harness) age(dir Direction, proto uint8, src, dst netip.AddrPort, ago time.Duration) {
	h.t.Helper()
	m := h.entryMap(dir, proto, src, dst)
	k := natKey(dir, proto, src, dst)
	var v masqNatEntry
	if err := m.Lookup(k, &v); err != nil {
		h.t.Fatalf("age %s %s -> %s: %v", dir, src, dst, err)
	}
	v.LastSeen = uint64(MonotonicNow() - ago)
	if err := m.Put(k, &v); err != nil {
		h.t.Fatal(err)
	}
}

// TestSweep: flows expire by protocol and state, both halves together; a half that lost its
// partner expires by itself.
func TestSweep(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	timeouts := Timeouts{TCPEstablished: time.Hour, TCPOpening: time.Minute, TCPClosing: 10 * time.Second,
		UDP: 30 * time.Second, ICMP: 5 * time.Second, Other: time.Minute}
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			r := remote(fam.v6)
			opening, established, closed := ap(pod(fam.v6, 1), 1001), ap(pod(fam.v6, 2), 1002), ap(pod(fam.v6, 3), 1003)
			udp, echo, orphan := ap(pod(fam.v6, 4), 1004), ap(pod(fam.v6, 5), 1005), ap(pod(fam.v6, 6), 1006)
			dst := ap(r, 443)

			h.mustPass(h.dp.Egress(), tcpPacket(opening, dst, tcpSYN, nil))
			nat := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(established, dst, tcpSYN, nil))).src
			h.mustPass(h.dp.Ingress(), tcpPacket(dst, nat, tcpSYN|tcpACK, nil))
			nat = tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(closed, dst, tcpSYN, nil))).src
			h.mustPass(h.dp.Ingress(), tcpPacket(dst, nat, tcpSYN|tcpACK, nil))
			h.mustPass(h.dp.Egress(), tcpPacket(closed, dst, tcpFIN|tcpACK, nil))
			h.mustPass(h.dp.Egress(), udpPacket(udp, ap(r, 53), payload))
			h.mustPass(h.dp.Egress(), echoPacket(echo.Addr(), r, echo.Port(), true, payload))
			orphanNat := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(orphan, ap(r, 123), payload))).src
			// The orphan loses its egress half, as an LRU eviction would do.
			if err := h.dp.deleteEntries(policy.FamilyOf(r), []NATEntry{{Dir: Egress, Proto: 17, Src: orphan, Dst: ap(r, 123)}}); err != nil {
				t.Fatal(err)
			}

			fam := policy.FamilyOf(r)
			sweep := func(after time.Duration) SweepResult {
				res, err := h.dp.Sweep(MonotonicNow()+after, timeouts)
				if err != nil {
					t.Fatal(err)
				}
				return res
			}
			if res := sweep(time.Second); res.Swept != (Swept{}) {
				t.Fatalf("sweep right away removed %+v", res)
			}
			if res := sweep(6 * time.Second); res.Flows != 1 { // the echo
				t.Fatalf("after 6s: %+v, want the echo flow", res)
			}
			if res := sweep(11 * time.Second); res.Flows != 1 { // the closed TCP flow
				t.Fatalf("after 11s: %+v, want the closed TCP flow", res)
			}
			if res := sweep(31 * time.Second); res.Flows != 1 || res.Orphans != 1 { // UDP, and the orphan's half
				t.Fatalf("after 31s: %+v, want the UDP flow and one orphan", res)
			}
			if _, ok, _ := h.dp.LookupNAT(Ingress, 17, ap(r, 123), orphanNat); ok {
				t.Fatalf("orphaned half survived")
			}
			if res := sweep(2 * time.Minute); res.Flows != 1 { // the unanswered SYN
				t.Fatalf("after 2m: %+v, want the opening TCP flow", res)
			}
			left := h.flowsOf(fam)
			if len(left) != 1 || !left[established.String()+"->"+dst.String()] {
				t.Fatalf("left after 2m: %v, want only the established flow", left)
			}
			// A flow that a packet refreshes after the sweep has read it stays.
			read, ok, err := h.dp.LookupNAT(Egress, 6, established, dst)
			if err != nil || !ok {
				t.Fatalf("established flow: %v %v", ok, err)
			}
			key := natKey(read.Dir, read.Proto, read.Src, read.Dst)
			if touched, err := touchedSince(h.entryMap(read.Dir, read.Proto, read.Src, read.Dst), key, uint64(read.LastSeen)); err != nil || touched {
				t.Fatalf("an untouched flow reads as touched (%v)", err)
			}
			h.age(Egress, 6, established, dst, 0)
			if touched, err := touchedSince(h.entryMap(read.Dir, read.Proto, read.Src, read.Dst), key, uint64(read.LastSeen)); err != nil || !touched {
				t.Fatalf("a refreshed flow reads as untouched: the sweep would delete it (%v)", err)
			}
			if res := sweep(2 * time.Hour); res.Flows != 1 || len(h.flowsOf(fam)) != 0 {
				t.Fatalf("after 2h: %+v, flows left %v", res, h.flowsOf(fam))
			}
		})
	}
}

// TestFlowStates: a flow is unreplied until a packet goes the other way, established then, and
// closing after a FIN or RST in either direction.
func TestFlowStates(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			f := policy.FamilyOf(remote(fam.v6))
			state := func() FlowState {
				t.Helper()
				var flows []Flow
				if err := h.dp.Flows(f, func(fl Flow) bool { flows = append(flows, fl); return true }); err != nil {
					t.Fatal(err)
				}
				if len(flows) != 1 || flows[0].Partial {
					t.Fatalf("flows: %+v", flows)
				}
				return flows[0].State
			}
			podEnd, dst := ap(pod(fam.v6, 21), 2100), ap(remote(fam.v6), 80)
			nat := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(podEnd, dst, tcpSYN, nil))).src
			if s := state(); s != StateUnreplied {
				t.Fatalf("after SYN: %s", s)
			}
			h.mustPass(h.dp.Ingress(), tcpPacket(dst, nat, tcpSYN|tcpACK, nil))
			if s := state(); s != StateEstablished {
				t.Fatalf("after SYN-ACK: %s", s)
			}
			h.mustPass(h.dp.Ingress(), tcpPacket(dst, nat, tcpRST, nil))
			if s := state(); s != StateClosing {
				t.Fatalf("after RST: %s", s)
			}
			if err := h.dp.deleteAllNAT(f); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestEvictedHalf: when the LRU evicts a flow's ingress half, the flow's next refresh puts it
// back; when another flow took its port meanwhile, the flow moves to a new port and both flows'
// replies reach their pods.
func TestEvictedHalf(t *testing.T) {
	h := newHarness(t, defaultPolicy(false), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			dst := ap(remote(fam.v6), 443)
			one := ap(pod(fam.v6, 11), 40100)
			nat := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(one, dst, tcpSYN, nil))).src
			drop := func() {
				if err := h.dp.deleteEntries(policy.FamilyOf(dst.Addr()), []NATEntry{{Dir: Ingress, Proto: 6, Src: dst, Dst: nat}}); err != nil {
					t.Fatal(err)
				}
			}

			drop()
			h.age(Egress, 6, one, dst, 2*time.Second)
			repairs := h.events()[Event(masqEventEV_REPAIR)]
			if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(one, dst, tcpACK, nil))).src; got != nat {
				t.Fatalf("flow moved from %s to %s although its port was free", nat, got)
			}
			if h.events()[Event(masqEventEV_REPAIR)] != repairs+1 {
				t.Fatalf("repair not counted")
			}
			if back := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpPacket(dst, nat, tcpACK, nil))); back.dst != one {
				t.Fatalf("reply after repair arrives at %s", back.dst)
			}

			// Evicted again, and another pod asks for the same port toward the same remote.
			drop()
			two := ap(pod(fam.v6, 12), nat.Port())
			if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(two, dst, tcpSYN, nil))).src; got != nat {
				t.Fatalf("second pod got %s, want the free port %s", got, nat)
			}
			h.age(Egress, 6, one, dst, 2*time.Second)
			reallocs := h.events()[Event(masqEventEV_REALLOC)]
			moved := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(one, dst, tcpACK, nil))).src
			if moved == nat || moved.Addr() != nat.Addr() {
				t.Fatalf("first flow kept %s, now the second flow's port", moved)
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
		})
	}
}

// TestUplinkAddressChange: a new uplink address flushes the flows of the old one (both
// halves), leaves inbound flows and the other family alone, and new flows use the new address.
func TestUplinkAddressChange(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	dst4, dst6 := ap(remote4, 443), ap(remote6, 443)
	h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(1), 1000), dst4, tcpSYN, nil))
	h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(2), 1000), ap(remote4, 53), payload))
	h.mustPass(h.dp.Egress(), tcpPacket(ap(snat4, 40000), dst4, tcpSYN, nil)) // host flow (a port of the range)
	h.mustPass(h.dp.Ingress(), tcpPacket(dst4, ap(pod4(3), 80), tcpSYN, nil)) // inbound flow
	h.mustPass(h.dp.Egress(), tcpPacket(ap(pod6(1), 1000), dst6, tcpSYN, nil))

	next := netip.MustParseAddr("192.0.2.99")
	n, err := h.dp.SetUplink(testIfindex, Uplink{IPv4: next, IPv6: snat6})
	if err != nil {
		t.Fatal(err)
	}
	if n != 6 {
		t.Fatalf("flushed %d entries, want 6 (3 flows)", n)
	}
	if left := h.flowsOf(policy.IPv4); len(left) != 1 || !left[ap(pod4(3), 80).String()+"->"+dst4.String()] {
		t.Fatalf("IPv4 flows left: %v, want the inbound one", left)
	}
	if len(h.flowsOf(policy.IPv6)) != 1 {
		t.Fatalf("IPv6 flow flushed")
	}
	if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(1), 1000), dst4, tcpSYN, nil))).src; got.Addr() != next {
		t.Fatalf("new flow leaves from %s, want %s", got, next)
	}
	u, ok, err := h.dp.Uplink(testIfindex)
	if err != nil || !ok || u.IPv4 != next || u.IPv6 != snat6 {
		t.Fatalf("uplink reads back as %+v (%v, %v)", u, ok, err)
	}

	// Without an address of the family, masquerading is impossible: dropped and counted.
	if _, err := h.dp.SetUplink(testIfindex, Uplink{IPv4: next}); err != nil {
		t.Fatal(err)
	}
	drops := h.events()[Event(masqEventEV_DROP_NO_ADDR)]
	if ret, _ := h.egress(tcpPacket(ap(pod6(2), 1000), dst6, tcpSYN, nil)); ret != tcActShot {
		t.Fatalf("IPv6 masquerade without an address: verdict %d", ret)
	}
	if h.events()[Event(masqEventEV_DROP_NO_ADDR)] != drops+1 {
		t.Fatalf("drop not counted")
	}
	if _, err := h.dp.RemoveUplinkHolding(testIfindex, nil); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := h.dp.Uplink(testIfindex); ok {
		t.Fatalf("uplink still present")
	}
}
