package bpf

import (
	"bytes"
	"maps"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The flow-state promises of bpf/nat.h, one test per promise, each through the real programs.

// seg is a TCP segment with explicit sequence numbers: what the RST and FIN checks read.
type seg struct {
	flags    int
	seq, ack uint32
	win      uint16
	wscale   int // the window scale option of a SYN; -1 for none
	payload  []byte
}

func tcpSegment(src, dst netip.AddrPort, s seg) []byte {
	tcp := &layers.TCP{SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()),
		Seq: s.seq, Ack: s.ack, Window: s.win, SYN: s.flags&tcpSYN != 0, ACK: s.flags&tcpACK != 0,
		FIN: s.flags&tcpFIN != 0, RST: s.flags&tcpRST != 0}
	if s.wscale >= 0 && tcp.SYN {
		tcp.Options = []layers.TCPOption{
			{OptionType: layers.TCPOptionKindMSS, OptionLength: 4, OptionData: []byte{0x05, 0xb4}},
			{OptionType: layers.TCPOptionKindNop, OptionLength: 1},
			{OptionType: layers.TCPOptionKindWindowScale, OptionLength: 3, OptionData: []byte{byte(s.wscale)}},
		}
	}
	return serialize(src.Addr(), dst.Addr(), layers.IPProtocolTCP, tcp, gopacket.Payload(s.payload))
}

// countEntries counts a family's entries in both flow tables.
func (h *harness) countEntries(fam policy.Family) int {
	h.t.Helper()
	n := 0
	if err := h.dp.NATEntries(fam, func(NATEntry) bool { n++; return true }); err != nil {
		h.t.Fatal(err)
	}
	return n
}

func (h *harness) entry(dir Direction, proto uint8, src, dst netip.AddrPort) (NATEntry, bool) {
	h.t.Helper()
	e, ok, err := h.dp.LookupNAT(dir, proto, src, dst)
	if err != nil {
		h.t.Fatal(err)
	}
	return e, ok
}

// handshake opens a masqueraded TCP flow from podEnd to dst with a real three-way handshake:
// the pod's ISN 1000 and window scale 7, the remote's ISN 5000 and scale 8, windows of 502 units
// (64 KiB and 128 KiB). It returns the NAT end.
func (h *harness) handshake(podEnd, dst netip.AddrPort) netip.AddrPort {
	h.t.Helper()
	nat := tupleOf(h.t, h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpSYN, seq: 1000, win: 64240, wscale: 7}))).src
	h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpSYN | tcpACK, seq: 5000, ack: 1001, win: 65160, wscale: 8}))
	h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpACK, seq: 1001, ack: 5001, win: 502, wscale: -1}))
	h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpACK, seq: 5001, ack: 1001, win: 502, wscale: -1}))
	if e, ok := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst); !ok || e.Table != TableConfirmed || StateOf(e.Flags, 0) != StateEstablished {
		h.t.Fatalf("after the handshake: %+v (found %v), want an established, confirmed flow", e, ok)
	}
	return nat
}

// TestHostRepliesStayOutOfTheTable: packets of host sockets on ports outside the NAT range (a
// SYN flood at sshd answered with SYN-ACKs, here) create no entry, and ingress packets to such
// ports are not looked up at all; host flows on ports inside the range are recorded.
func TestHostRepliesStayOutOfTheTable(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			f := policy.FamilyOf(remote(fam.v6))
			host := snatFor(remote(fam.v6))
			before := h.countEntries(f)
			for i := range 500 {
				client := ap(remote(fam.v6), uint16(10000+i))
				h.mustPass(h.dp.Ingress(), tcpPacket(client, ap(host, 22), tcpSYN, nil))
				h.mustPass(h.dp.Egress(), tcpPacket(ap(host, 22), client, tcpSYN|tcpACK, nil))
			}
			if n := h.countEntries(f) - before; n != 0 {
				t.Fatalf("500 SYNs at a host port and their SYN-ACKs made %d entries, want none", n)
			}

			// An entry at a key outside the range is never consulted: ingress to host ports is
			// not looked up (planted here as a stale entry pointing at a pod).
			client := ap(remote(fam.v6), 4242)
			planted := keyTuple(Ingress, unix.IPPROTO_TCP, client, ap(host, 8443))
			v := masqNatEntry{Addr: addrBytes(pod(fam.v6, 1)), Port: htons(8443), Kind: masqNatKind(KindMasq),
				Flags: masqNatFlags(FlagReplied), LastSeen: uint64(MonotonicNow())}
			if err := h.dp.natTable(f).tables()[TableConfirmed].Put(planted.key(), &v); err != nil {
				t.Fatal(err)
			}
			in := tcpPacket(client, ap(host, 8443), tcpACK, nil)
			if out := h.mustPass(h.dp.Ingress(), in); !bytes.Equal(out, in) {
				t.Fatalf("a packet to a host port outside the range was translated to %s", tupleOf(t, out).dst)
			}

			// Inside the range a host socket's flow is recorded, so no pod mapping takes its port.
			h.mustPass(h.dp.Egress(), tcpPacket(ap(host, 40123), ap(remote(fam.v6), 443), tcpSYN, nil))
			if e, ok := h.entry(Egress, unix.IPPROTO_TCP, ap(host, 40123), ap(remote(fam.v6), 443)); !ok || e.Kind != KindHost {
				t.Fatalf("host flow on a port of the range not recorded: %+v", e)
			}
		})
	}
}

// TestHostListenerFloodSparesPods: a SYN flood at a host listener on a port inside the NAT range
// (the range is Linux's ephemeral range by default) costs the table nothing: the host's SYN-ACKs
// answer connections opened from outside, recorded by the host's next packet once the far side
// completed the handshake. The pods' flows being opened meanwhile keep their mappings, where the
// flood's entries (two per SYN-ACK) used to evict them from the unreplied table. Conntrack makes
// an entry per SYN and, full, drops unassured ones (early_drop) or the new SYN.
func TestHostListenerFloodSparesPods(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 1 << 12}) // 2048 unreplied
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			f := policy.FamilyOf(remote(fam.v6))
			listener := ap(snatFor(remote(fam.v6)), 40000)
			var pending []netip.AddrPort
			for i := range 100 {
				podEnd := ap(pod(fam.v6, 700+i), 43000)
				h.mustPass(h.dp.Egress(), tcpPacket(podEnd, ap(remote(fam.v6), 443), tcpSYN, nil))
				pending = append(pending, podEnd)
			}
			before := h.countEntries(f)
			for i := range 5000 {
				client := ap(remote(fam.v6), uint16(10000+i))
				h.mustPass(h.dp.Ingress(), tcpPacket(client, listener, tcpSYN, nil))
				h.mustPass(h.dp.Egress(), tcpPacket(listener, client, tcpSYN|tcpACK, nil))
			}
			if n := h.countEntries(f) - before; n != 0 {
				t.Errorf("5000 SYNs at a host listener of the range and their SYN-ACKs made %d entries, want none", n)
			}
			for _, podEnd := range pending {
				if _, ok := h.entry(Egress, unix.IPPROTO_TCP, podEnd, ap(remote(fam.v6), 443)); !ok {
					t.Fatalf("the flood evicted the pod flow being opened from %s", podEnd)
				}
			}
			// A client that completes the handshake: the host's next packet records the flow.
			client := ap(remote(fam.v6), 9999)
			h.mustPass(h.dp.Ingress(), tcpPacket(client, listener, tcpSYN, nil))
			h.mustPass(h.dp.Egress(), tcpPacket(listener, client, tcpSYN|tcpACK, nil))
			h.mustPass(h.dp.Ingress(), tcpPacket(client, listener, tcpACK, payload))
			h.mustPass(h.dp.Egress(), tcpPacket(listener, client, tcpACK, payload))
			if e, ok := h.entry(Egress, unix.IPPROTO_TCP, listener, client); !ok || e.Kind != KindHost {
				t.Fatalf("the listener's connection is not recorded after the handshake: %+v", e)
			}
		})
	}
}

// TestInboundOnlyByOpenersTowardLocalAddresses: only a connection-opening packet (TCP SYN, UDP
// datagram, echo request) toward an address behind the node (routed out another device than the
// one it came by, another uplink included) opens an inbound flow: stray ACKs toward a pod and
// anything toward an address routed back out the device it came by create nothing.
func TestInboundOnlyByOpenersTowardLocalAddresses(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			f := policy.FamilyOf(remote(fam.v6))
			podAddr := pod(fam.v6, 77)
			elsewhere := netip.MustParseAddr("203.0.113.50") // routed back out lo, the device it came by
			if fam.v6 {
				elsewhere = netip.MustParseAddr("2001:db8:7777::50")
			}
			before := h.countEntries(f)
			for i := range 300 {
				client := ap(remote(fam.v6), uint16(20000+i))
				h.mustPass(h.dp.Ingress(), tcpPacket(client, ap(podAddr, 8080), tcpACK, nil))
				h.mustPass(h.dp.Ingress(), tcpPacket(client, ap(podAddr, 8080), tcpACK|tcpFIN, nil))
				h.mustPass(h.dp.Ingress(), tcpPacket(client, ap(podAddr, 8080), tcpSYN|tcpACK, nil))
				h.mustPass(h.dp.Ingress(), udpPacket(client, ap(elsewhere, 53), payload))
				h.mustPass(h.dp.Ingress(), tcpPacket(client, ap(elsewhere, 80), tcpSYN, nil))
			}
			if n := h.countEntries(f) - before; n != 0 {
				t.Fatalf("stray ACKs toward a pod and packets toward an address routed out made %d entries, want none", n)
			}
			if n := h.events()[Event(masqEventEV_INBOUND_NOT_LOCAL)]; n == 0 {
				t.Fatalf("openers toward an address routed out not counted as inbound_not_local")
			}
			for i, b := range builders(fam.v6) {
				client := ap(remote(fam.v6), uint16(30000+i))
				server := ap(podAddr, 9000)
				if b.name == "icmp-echo" {
					server = ap(podAddr, 0)
				}
				h.mustPass(h.dp.Ingress(), b.out(client, server))
				rt := tupleOf(t, b.back(server, client))
				if e, ok := h.entry(Egress, b.proto, rt.src, rt.dst); !ok || e.Kind != KindInbound {
					t.Fatalf("%s opener toward a pod did not open an inbound flow: %+v", b.name, e)
				}
			}
			// Toward an address routed out another uplink (up0), whose egress masquerades the
			// flow: its replies, translated back on that uplink, must leave this one untouched.
			transit := ap(remote(fam.v6), 8080) // the default route: up0
			client := ap(remote(fam.v6), 40000)
			h.mustPass(h.dp.Ingress(), tcpPacket(client, transit, tcpSYN, nil))
			if e, ok := h.entry(Egress, unix.IPPROTO_TCP, transit, client); !ok || e.Kind != KindInbound {
				t.Fatalf("a SYN toward an address routed out another uplink opened no inbound flow: %+v", e)
			}
			reply := tcpPacket(transit, client, tcpSYN|tcpACK, nil)
			if out := h.mustPass(h.dp.Egress(), reply); !bytes.Equal(out, reply) {
				t.Fatalf("the reply of a flow through another uplink was translated to %s", tupleOf(t, out).src)
			}
		})
	}
}

// TestHandshakeRetransmissionsFindTheirFlow: a bare SYN and a SYN-ACK are looked up in the
// unreplied table first (bpf/masq.c), where a handshake's flow is; retransmitted while the flow is
// unanswered, answered and confirmed, each still finds it, the same mapping either way and no
// second one.
func TestHandshakeRetransmissionsFindTheirFlow(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			podEnd, dst := ap(pod(fam.v6, 41), 41000), ap(remote(fam.v6), 443)
			syn := tcpSegment(podEnd, dst, seg{flags: tcpSYN, seq: 1000, win: 64240, wscale: 7})
			nat := tupleOf(t, h.mustPass(h.dp.Egress(), syn)).src
			synack := tcpSegment(dst, nat, seg{flags: tcpSYN | tcpACK, seq: 5000, ack: 1001, win: 65160, wscale: 8})
			check := func(when string, want Table, packets ...[]byte) {
				t.Helper()
				for _, pkt := range packets {
					if string(pkt) == string(syn) {
						if got := tupleOf(t, h.mustPass(h.dp.Egress(), pkt)).src; got != nat {
							t.Fatalf("%s: the SYN left as %s, want %s", when, got, nat)
						}
					} else if got := tupleOf(t, h.mustPass(h.dp.Ingress(), pkt)).dst; got != podEnd {
						t.Fatalf("%s: the SYN-ACK arrived at %s, want %s", when, got, podEnd)
					}
				}
				e, eok := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst)
				r, rok := h.entry(Ingress, unix.IPPROTO_TCP, dst, nat)
				if !eok || !rok || e.Table != want || r.Table != want {
					t.Fatalf("%s: the halves are %+v (%v) and %+v (%v), want both in table %d", when, e, eok, r, rok, want)
				}
				if n := h.countEntries(policy.FamilyOf(podEnd.Addr())); n != 2 {
					t.Fatalf("%s: %d entries for one flow", when, n)
				}
			}
			check("unanswered", TableUnreplied, syn)
			check("answered", TableUnreplied, synack, synack, syn)
			h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpACK, seq: 1001, ack: 5001, win: 502, wscale: -1}))
			check("confirmed", TableConfirmed, syn, synack)
		})
	}
}

// TestOutOfWindowRSTIgnored: an RST or FIN from outside that the pod would not accept (outside
// its window, or in it but not at the next expected byte for an RST) leaves the flow
// established, so the sweep keeps it; the RST the pod would accept closes it.
func TestOutOfWindowRSTIgnored(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	timeouts := DefaultTimeouts
	timeouts.TCPClosing = time.Second
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			podEnd, dst := ap(pod(fam.v6, 31), 31000), ap(remote(fam.v6), 443)
			nat := h.handshake(podEnd, dst)
			ignored := h.events()[Event(masqEventEV_TCP_OUT_OF_WINDOW)]
			// The pod acknowledged 5001 with a window of 502 << 7 = 64256 bytes.
			for _, s := range []seg{
				{flags: tcpRST, seq: 5001 + 70000},          // beyond the window
				{flags: tcpRST, seq: 5001 - 100},            // before it
				{flags: tcpRST | tcpACK, seq: 123456789},    // a blind guess
				{flags: tcpRST, seq: 5001 + 1000},           // in the window, not the next byte
				{flags: tcpFIN | tcpACK, seq: 5001 + 90000}, // a FIN beyond the window
			} {
				s.wscale = -1
				h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, s))
				e, _ := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst)
				r, _ := h.entry(Ingress, unix.IPPROTO_TCP, dst, nat)
				if st := StateOf(e.Flags, r.Flags); st != StateEstablished {
					t.Fatalf("after an implausible %+v the flow is %s", s, st)
				}
			}
			if n := h.events()[Event(masqEventEV_TCP_OUT_OF_WINDOW)] - ignored; n != 5 {
				t.Fatalf("%d implausible FIN/RST counted, want 5", n)
			}
			// Long after, with closing flows expiring after a second, the flow is still there.
			if _, err := h.dp.Sweep(MonotonicNow()+time.Minute, timeouts); err != nil {
				t.Fatal(err)
			}
			if _, ok := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst); !ok {
				t.Fatalf("the sweep removed the flow after implausible RSTs")
			}

			// The remote aborting right after its last segment (the train case), then an RST at the
			// byte the pod expects: both plausible.
			h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpACK, seq: 5001, ack: 1001, win: 502, wscale: -1, payload: make([]byte, 100)}))
			h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpRST, seq: 5101, wscale: -1}))
			e, _ := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst)
			if StateOf(e.Flags, 0) != StateClosing {
				t.Fatalf("an RST right after the sender's last segment did not close the flow: %v", e.Flags)
			}
		})
	}
	t.Run("exact", func(t *testing.T) {
		h.t = t
		podEnd, dst := ap(pod4(32), 32000), ap(remote4, 443)
		nat := h.handshake(podEnd, dst)
		h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpRST, seq: 5001, wscale: -1}))
		e, _ := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst)
		r, _ := h.entry(Ingress, unix.IPPROTO_TCP, dst, nat)
		if e.Flags&r.Flags&FlagRST == 0 {
			t.Fatalf("an RST at the pod's next expected byte is not recorded on both halves: %v %v", e.Flags, r.Flags)
		}
		if res, err := h.dp.Sweep(MonotonicNow()+2*time.Second, timeouts); err != nil || res.Flows == 0 {
			t.Fatalf("the closed flow was not swept: %+v %v", res, err)
		}
	})
}

// flipPolicies are a policy that leaves 10.0.0.0/8 alone and one that masquerades all of it.
func flipPolicies() (ret, masq *policy.Policy) {
	c := config.Default(config.Options{EnableIPv6: true})
	ret = policy.Compile(c, policy.Options{EnableIPv6: true, RandomFully: true})
	c.MasqueradeCIDRs = []config.MasqueradeCIDR{{CIDR: netip.MustParsePrefix("10.0.0.0/8")}, {CIDR: netip.MustParsePrefix("fc00::/7")}}
	masq = policy.Compile(c, policy.Options{EnableIPv6: true, RandomFully: true})
	return ret, masq
}

// ageKept sets the last_seen of the kept verdict of the pod's flow (src, dst), as if its last
// packet was that long ago.
func (h *harness) ageKept(proto uint8, src, dst netip.AddrPort, ago time.Duration) {
	h.t.Helper()
	m := h.dp.objs.KeepV4
	if src.Addr().Is6() {
		m = h.dp.objs.KeepV6
	}
	k := natKey(Egress, proto, src, dst)
	var v masqKeepEntry
	if err := m.Lookup(k, &v); err != nil {
		h.t.Fatalf("no kept verdict %s -> %s: %v", src, dst, err)
	}
	v.LastSeen = uint64(MonotonicNow() - ago)
	if err := m.Put(k, &v); err != nil {
		h.t.Fatal(err)
	}
}

// TestKeptVerdictRefreshedByReplies: a flow the policy left alone whose far side does the talking
// keeps its verdict: the far side's packets refresh it as the pod's do (conntrack refreshes a
// connection on either direction's packets), so it outlives the idle timeout that the pod's own
// last packet began, and a policy flip then leaves it alone. UDP and TCP, both families.
func TestKeptVerdictRefreshedByReplies(t *testing.T) {
	c := config.Default(config.Options{EnableIPv6: true})
	c.NonMasqueradeCIDRs = append(c.NonMasqueradeCIDRs, netip.MustParsePrefix("fd12::/16"))
	ret := policy.Compile(c, policy.Options{EnableIPv6: true, RandomFully: true})
	c.MasqueradeCIDRs = []config.MasqueradeCIDR{{CIDR: netip.MustParsePrefix("10.0.0.0/8")}, {CIDR: netip.MustParsePrefix("fd12::/16")}}
	masq := policy.Compile(c, policy.Options{EnableIPv6: true, RandomFully: true})
	timeouts := Timeouts{TCPEstablished: time.Hour, TCPOpening: time.Minute, TCPClosing: time.Minute,
		UDP: time.Minute, ICMP: time.Minute, Other: time.Minute}
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h := newHarness(t, ret, LoadOptions{})
			dst := ap(netip.MustParseAddr("10.20.30.40"), 8080)
			if fam.v6 {
				dst = ap(netip.MustParseAddr("fd12::40"), 8080)
			}
			udpEnd, tcpEnd := ap(pod(fam.v6, 7), 41000), ap(pod(fam.v6, 8), 41001)
			h.mustPass(h.dp.Egress(), udpPacket(udpEnd, dst, payload))
			h.mustPass(h.dp.Egress(), tcpPacket(tcpEnd, dst, tcpSYN, nil))
			h.mustPass(h.dp.Ingress(), tcpPacket(dst, tcpEnd, tcpSYN|tcpACK, nil))
			h.mustPass(h.dp.Egress(), tcpPacket(tcpEnd, dst, tcpACK, nil))
			// The pod's last packets were an idle timeout ago; the far side has talked since.
			h.ageKept(unix.IPPROTO_UDP, udpEnd, dst, timeouts.UDP+time.Second)
			h.ageKept(unix.IPPROTO_TCP, tcpEnd, dst, timeouts.TCPEstablished+time.Second)
			for _, in := range [][]byte{udpPacket(dst, udpEnd, payload), tcpPacket(dst, tcpEnd, tcpACK, payload)} {
				if got := tupleOf(t, h.mustPass(h.dp.Ingress(), in)).dst; got != udpEnd && got != tcpEnd {
					t.Fatalf("the far side's packet arrived at %s", got)
				}
			}
			if res, err := h.dp.Sweep(MonotonicNow(), timeouts); err != nil || res.Kept != 0 {
				t.Fatalf("the sweep removed %d kept verdicts whose far side is talking (%v)", res.Kept, err)
			}
			if err := h.dp.SyncPolicy(masq); err != nil {
				t.Fatal(err)
			}
			if got := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(udpEnd, dst, payload))).src; got != udpEnd {
				t.Errorf("the UDP flow left as %s after the flip, want the pod's %s", got, udpEnd)
			}
			ret, out := h.egress(tcpPacket(tcpEnd, dst, tcpACK, payload))
			if ret != tcNext {
				t.Fatalf("the TCP connection's packet got verdict %d after the flip", int32(ret))
			}
			if got := tupleOf(t, out).src; got != tcpEnd {
				t.Errorf("the TCP connection left as %s after the flip, want the pod's %s", got, tcpEnd)
			}
		})
	}
}

// TestPolicyFlipKeepsVerdict: a flow keeps the verdict it was created with when the policy
// changes, TCP and UDP, both ways; new flows follow the new policy.
func TestPolicyFlipKeepsVerdict(t *testing.T) {
	ret, masq := flipPolicies()
	h := newHarness(t, ret, LoadOptions{})
	podEnd := func(i int) netip.AddrPort { return ap(pod4(100+i), uint16(41000+i)) }
	dst := ap(netip.MustParseAddr("10.20.30.40"), 8080)
	udpOut := func(src netip.AddrPort) tuple {
		return tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(src, dst, payload)))
	}
	tcpOut := func(src netip.AddrPort, flags int) tuple {
		return tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(src, dst, flags, payload)))
	}
	sync := func(p *policy.Policy) {
		t.Helper()
		if err := h.dp.SyncPolicy(p); err != nil {
			t.Fatal(err)
		}
	}

	// Opened under RETURN.
	if got := udpOut(podEnd(1)); got.src != podEnd(1) {
		t.Fatalf("UDP to a RETURN destination left as %s", got.src)
	}
	if got := tcpOut(podEnd(2), tcpSYN); got.src != podEnd(2) {
		t.Fatalf("TCP to a RETURN destination left as %s", got.src)
	}
	h.mustPass(h.dp.Ingress(), tcpPacket(dst, podEnd(2), tcpSYN|tcpACK, nil))
	sync(masq)
	if got := udpOut(podEnd(1)); got.src != podEnd(1) {
		t.Fatalf("a UDP flow opened under RETURN is masqueraded after the flip: %s", got.src)
	}
	if got := tcpOut(podEnd(2), tcpACK); got.src != podEnd(2) {
		t.Fatalf("a TCP flow opened under RETURN is masqueraded after the flip: %s", got.src)
	}
	if got := udpOut(podEnd(3)); got.src.Addr() != snat4 {
		t.Fatalf("a new UDP flow after the flip left as %s, want masqueraded", got.src)
	}
	natTCP := tcpOut(podEnd(4), tcpSYN).src
	if natTCP.Addr() != snat4 {
		t.Fatalf("a new TCP flow after the flip left as %s, want masqueraded", natTCP)
	}
	h.mustPass(h.dp.Ingress(), tcpPacket(dst, natTCP, tcpSYN|tcpACK, nil))
	natUDP := udpOut(podEnd(3)).src

	// And back: the flows opened under MASQUERADE stay masqueraded.
	sync(ret)
	if got := udpOut(podEnd(3)); got.src != natUDP {
		t.Fatalf("a masqueraded UDP flow left as %s after the flip back, was %s", got.src, natUDP)
	}
	if got := tcpOut(podEnd(4), tcpACK); got.src != natTCP {
		t.Fatalf("a masqueraded TCP flow left as %s after the flip back, was %s", got.src, natTCP)
	}
	if got := udpOut(podEnd(5)); got.src != podEnd(5) {
		t.Fatalf("a new UDP flow after the flip back left as %s", got.src)
	}
	if got := tcpOut(podEnd(6), tcpSYN); got.src != podEnd(6) {
		t.Fatalf("a new TCP flow after the flip back left as %s", got.src)
	}
	// A closed masqueraded connection reopened now follows the policy in force.
	h.mustPass(h.dp.Egress(), tcpPacket(podEnd(4), dst, tcpRST, nil))
	if got := tcpOut(podEnd(4), tcpSYN); got.src != podEnd(4) {
		t.Fatalf("a connection reopened after the flip back left as %s, want the pod's address", got.src)
	}
	// Every flow opened under RETURN has its verdict in the keep table (the reopened connection
	// too); a pod's FIN marks its kept connection closing, for the shorter timeout.
	h.mustPass(h.dp.Egress(), tcpPacket(podEnd(6), dst, tcpFIN|tcpACK, nil))
	kept := map[netip.AddrPort]bool{}
	if err := eachEntry(h.dp.objs.KeepV4, func(k masqNat4Key, v *masqKeepEntry) {
		kept[k.tuple().decode(&masqNatEntry{}).Src] = v.Closing != 0
	}); err != nil {
		t.Fatal(err)
	}
	want := map[netip.AddrPort]bool{podEnd(1): false, podEnd(2): false, podEnd(4): false, podEnd(5): false, podEnd(6): true}
	if !maps.Equal(kept, want) {
		t.Fatalf("kept verdicts (source: closing) %v, want %v", kept, want)
	}

	// A TCP packet of no known flow that is not a SYN, to a masqueraded destination: its state
	// is gone, no mapping can serve it, and it is dropped rather than sent with the pod's address.
	sync(masq)
	untranslatable := h.events()[Event(masqEventEV_DROP_UNTRANSLATABLE)]
	if ret, _ := h.egress(tcpPacket(podEnd(7), dst, tcpACK, payload)); ret != tcActShot {
		t.Fatalf("a midstream TCP packet of no known flow to a masqueraded destination: verdict %d, want a drop", ret)
	}
	if h.events()[Event(masqEventEV_DROP_UNTRANSLATABLE)] != untranslatable+1 {
		t.Fatal("the midstream drop is not counted as untranslatable")
	}
}

// TestOrphanedHalves: the reply of an inbound flow whose egress half the LRU evicted leaves
// untouched and restores that half; the reply half of a masqueraded flow whose egress half was
// evicted and re-mapped is removed at its next refresh, so its port is free again.
func TestOrphanedHalves(t *testing.T) {
	p := policy.Compile(config.Default(config.Options{}), policy.Options{RandomFully: true,
		ToPorts: policy.PortRanges{{First: 40000, Last: 40001}}})
	h := newHarness(t, p, LoadOptions{})
	client := ap(remote4, 5353)
	server := ap(pod4(40), 53)
	for _, b := range builders(false)[:2] { // tcp, udp
		t.Run("inbound/"+b.name, func(t *testing.T) {
			h.t = t
			h.mustPass(h.dp.Ingress(), b.out(client, server))
			if err := h.dp.deleteEntries(policy.IPv4, []NATEntry{{Dir: Egress, Proto: b.proto, Src: server, Dst: client}}); err != nil {
				t.Fatal(err)
			}
			reply := b.back(server, client)
			if out := h.mustPass(h.dp.Egress(), reply); !bytes.Equal(out, reply) {
				t.Fatalf("the reply of an inbound flow whose egress half was evicted was translated to %s", tupleOf(t, out).src)
			}
			if e, ok := h.entry(Egress, b.proto, server, client); !ok || e.Kind != KindInbound {
				t.Fatalf("egress half not restored: %+v", e)
			}
		})
	}
	t.Run("masqueraded", func(t *testing.T) {
		h.t = t
		dst := ap(remote4, 123)
		one := ap(pod4(41), 1000)
		first := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(one, dst, payload))).src
		if err := h.dp.deleteEntries(policy.IPv4, []NATEntry{{Dir: Egress, Proto: 17, Src: one, Dst: dst}}); err != nil {
			t.Fatal(err)
		}
		second := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(one, dst, payload))).src
		if second == first {
			t.Fatalf("re-mapped to %s, the port its orphaned reply half holds", second)
		}
		// The remote still sends to the old port: at the orphan's next refresh it is removed.
		h.age(Ingress, 17, dst, first, 2*time.Second)
		orphans := h.events()[Event(masqEventEV_ORPHAN)]
		h.mustPass(h.dp.Ingress(), udpPacket(dst, first, payload))
		if h.events()[Event(masqEventEV_ORPHAN)] != orphans+1 {
			t.Fatalf("orphaned reply half not removed")
		}
		// Both ports of the range are held otherwise; the freed one goes to the next flow.
		if got := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(42), 1000), dst, payload))).src; got != first {
			t.Fatalf("a new flow got %s, want the port the orphan held, %s", got, first)
		}
	})
}

// TestPortAllocationAt95: with a 1,024-port range, 973 concurrent flows toward one remote
// endpoint (95% of the ports) all but a handful get a port, and at 95% occupancy new flows
// still find one at least 99 times in 100 (conntrack serves 972 of 973 in the same range).
func TestPortAllocationAt95(t *testing.T) {
	const ports, flows, more = 1024, 973, 2000
	p := policy.Compile(config.Default(config.Options{}), policy.Options{RandomFully: true,
		ToPorts: policy.PortRanges{{First: 50000, Last: 50000 + ports - 1}}})
	h := newHarness(t, p, LoadOptions{})
	dst := ap(remote4, 443)
	alloc := func(i int) (netip.AddrPort, bool) {
		ret, out := h.egress(tcpPacket(ap(pod4(1+i/60000), uint16(1024+i%60000)), dst, tcpSYN, nil))
		if ret == tcActShot {
			return netip.AddrPort{}, false
		}
		return tupleOf(t, out).src, true
	}
	concurrent := 0 // flows that got no port
	for i := range flows {
		if _, ok := alloc(i); !ok {
			concurrent++
		}
	}
	t.Logf("%d of %d concurrent flows toward one endpoint got a port", flows-concurrent, flows)
	if concurrent > flows/100 {
		t.Fatalf("%d of %d flows got no port, want at most 1%%", concurrent, flows)
	}
	// At 95%: each new flow is removed again after its allocation, so occupancy stays.
	failed := 0
	for i := range more {
		nat, ok := alloc(flows + i)
		if !ok {
			failed++
			continue
		}
		src := ap(pod4(1+(flows+i)/60000), uint16(1024+(flows+i)%60000))
		if err := h.dp.deleteEntries(policy.IPv4, []NATEntry{{Dir: Egress, Proto: 6, Src: src, Dst: dst},
			{Dir: Ingress, Proto: 6, Src: dst, Dst: nat}}); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("at 95%% occupancy: %d of %d allocations failed", failed, more)
	if failed > more/100 {
		t.Fatalf("at 95%% occupancy %d of %d allocations failed, want at most 1%%", failed, more)
	}
	hist, err := h.dp.PortAttempts()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("probes per allocation: %+v", hist)
	var n uint64
	for _, c := range hist.Counts {
		n += c
	}
	// Every allocation that got a port, in both phases.
	if want := uint64(flows + more - concurrent - failed); n != want || hist.Sum < n {
		t.Fatalf("histogram counts %d allocations (sum %d), want %d", n, hist.Sum, want)
	}
}

// TestEvictionSparesEstablished: with small tables, a flood of unreplied flows churns through
// the table of unreplied flows and evicts none of the established ones; when the confirmed
// table itself is full, new two-way flows stay evictable (counted), established ones stay.
func TestEvictionSparesEstablished(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{NATEntries: 256, NATEntriesV6: 256})
	dst := ap(remote4, 443)
	type flow struct{ pod, nat netip.AddrPort }
	var established []flow
	for i := range 100 {
		podEnd := ap(pod4(1), uint16(2000+i))
		nat := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, payload))).src
		h.mustPass(h.dp.Ingress(), udpPacket(dst, nat, payload))
		h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, payload))
		established = append(established, flow{podEnd, nat})
	}
	// 10,000 unreplied flows: SYNs to remotes that never answer, and UDP datagrams.
	for i := range 5000 {
		r := ap(remoteN(1000+i), 80)
		h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(2+i/1000), uint16(3000+i%1000)), r, tcpSYN, nil))
		h.mustPass(h.dp.Egress(), udpPacket(ap(pod4(2+i/1000), uint16(3000+i%1000)), r, payload))
	}
	for _, f := range established {
		if got := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(f.pod, dst, payload))).src; got != f.nat {
			t.Fatalf("established flow %s moved from %s to %s: its entries were evicted", f.pod, f.nat, got)
		}
		if back := tupleOf(t, h.mustPass(h.dp.Ingress(), udpPacket(dst, f.nat, payload))).dst; back != f.pod {
			t.Fatalf("reply of established flow %s reaches %s", f.pod, back)
		}
	}
	// 28 more two-way flows fill the 256 confirmed entries; the ones beyond stay unconfirmed.
	full := h.events()[Event(masqEventEV_CONFIRM_FULL)]
	for i := range 40 {
		podEnd := ap(pod4(9), uint16(2000+i))
		nat := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, payload))).src
		h.mustPass(h.dp.Ingress(), udpPacket(dst, nat, payload))
		h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, payload))
	}
	if n := h.events()[Event(masqEventEV_CONFIRM_FULL)] - full; n != 12 {
		t.Fatalf("%d flows found the confirmed table full, want 12", n)
	}
	for _, f := range established {
		if got := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(f.pod, dst, payload))).src; got != f.nat {
			t.Fatalf("established flow %s moved from %s to %s once the table was full", f.pod, f.nat, got)
		}
	}
}

// TestConfirmRace: a packet that confirms its flow (the first after the first reply) and finds
// the other half confirmed already (another CPU confirming the flow from that half meanwhile)
// leaves the rest of the move to that CPU, rather than taking the confirmed table for full. On
// kernels before 6.4 the insert's -EEXIST comes back without its sign's upper half
// (bpf/compat.h: map_update), and the flow was marked as finding no room.
func TestConfirmRace(t *testing.T) {
	h := newHarness(t, defaultPolicy(false), LoadOptions{})
	podEnd, dst := ap(pod4(1), 2000), ap(remote4, 53)
	nat := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, nil))).src
	h.mustPass(h.dp.Ingress(), udpPacket(dst, nat, nil))
	// The ingress half, confirmed as the other CPU would have confirmed it.
	var k masqNat4Key
	var v masqNatEntry
	it := h.dp.objs.NatNewV4.Iterate()
	for it.Next(&k, &v) {
		if k.Dir != masqNatDirDIR_INGRESS {
			continue
		}
		if err := h.dp.objs.NatV4.Put(&k, &v); err != nil {
			t.Fatal(err)
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	full := h.events()[Event(masqEventEV_CONFIRM_FULL)]
	if got := tupleOf(t, h.mustPass(h.dp.Egress(), udpPacket(podEnd, dst, nil))).src; got != nat {
		t.Fatalf("the flow leaves from %s, want %s", got, nat)
	}
	if n := h.events()[Event(masqEventEV_CONFIRM_FULL)] - full; n != 0 {
		t.Errorf("the confirmation counted %d confirm_full: it took the other CPU's insert for a full table", n)
	}
	if e, ok := h.entry(Egress, unix.IPPROTO_UDP, podEnd, dst); !ok || e.Flags&FlagNoRoom != 0 {
		t.Errorf("the flow's entry %+v (found %v): marked as finding no room", e, ok)
	}
}

// TestNATMemory: what NATMemory says (and --nat-max-entries' help prints) is what the kernel
// accounts for the tables, within 5%.
func TestNATMemory(t *testing.T) {
	const n = 1 << 16
	h := newHarness(t, nil, LoadOptions{NATEntries: n, NATEntriesV6: n})
	if !reportsMemoryUse(t) {
		testutil.NotOnThisKernel(t, "its map info gives an estimate from the maps' sizes, not the memory they use")
	}
	maps := map[bool][]*ebpf.Map{false: {h.dp.objs.NatV4, h.dp.objs.NatNewV4, h.dp.objs.KeepV4, h.dp.objs.InboundV4},
		true: {h.dp.objs.NatV6, h.dp.objs.NatNewV6, h.dp.objs.KeepV6, h.dp.objs.InboundV6}}
	for v6, ms := range maps {
		var got uint64
		for _, m := range ms {
			info, err := m.Info()
			if err != nil {
				t.Fatal(err)
			}
			b, ok := info.Memlock()
			if !ok {
				testutil.Unavailable(t, "kernel does not report map memory")
			}
			got += b
		}
		want := NATMemory(n, v6)
		t.Logf("ipv6=%v: the kernel accounts %d bytes, NATMemory says %d", v6, got, want)
		if d := float64(got) - float64(want); d > 0.05*float64(want) || d < -0.05*float64(want) {
			t.Errorf("ipv6=%v: the kernel accounts %d bytes for the NAT tables, NATMemory says %d", v6, got, want)
		}
	}
}

// reportsMemoryUse tells whether the kernel's map info gives the memory a map uses, rather than
// an estimate from its sizes (as kernels before the maps' own memory accounting do): an empty
// hash map without preallocation uses a fraction of what its entries would.
func reportsMemoryUse(t *testing.T) bool {
	t.Helper()
	const entries, value = 4096, 1024
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: value, MaxEntries: entries, Flags: unix.BPF_F_NO_PREALLOC})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	b, ok := info.Memlock()
	if !ok {
		testutil.Unavailable(t, "kernel does not report map memory")
	}
	return b < entries*value/4
}

// TestReopenFollowsAddress: a closed connection reopened with the same tuple keeps its mapping
// only while its destination is still masqueraded to the address the mapping has; after a
// change of the rule's masquerade address it starts over from the new one, as conntrack binds a
// new connection by the rules in force.
func TestReopenFollowsAddress(t *testing.T) {
	alt, other := netip.MustParseAddr("192.0.2.11"), netip.MustParseAddr("192.0.2.12")
	const dstNet = "198.51.100.0/24" // remote4's
	h := newHarness(t, withAddrs(prefixes(dstNet), nil, true, map[string]string{dstNet: alt.String()}), LoadOptions{})
	podEnd, dst := ap(pod4(1), 1000), ap(remote4, 443)
	// closed opens the connection (handshake) and closes it with FINs each way, in the windows.
	closed := func() netip.AddrPort {
		t.Helper()
		nat := h.handshake(podEnd, dst)
		h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpFIN | tcpACK, seq: 1001, ack: 5001, win: 502, wscale: -1}))
		h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpFIN | tcpACK, seq: 5001, ack: 1002, win: 502, wscale: -1}))
		if e, _ := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst); StateOf(e.Flags, 0) != StateClosing {
			t.Fatalf("after the FINs the flow is %s", StateOf(e.Flags, 0))
		}
		return nat
	}
	first := closed()
	if first.Addr() != alt {
		t.Fatalf("the connection left from %s, want %s", first, alt)
	}
	if again := closed(); again != first {
		t.Fatalf("reopened under the same address it left from %s, want its mapping %s", again, first)
	}
	if err := h.dp.SyncPolicy(withAddrs(prefixes(dstNet), nil, true, map[string]string{dstNet: other.String()})); err != nil {
		t.Fatal(err)
	}
	if got := h.handshake(podEnd, dst); got.Addr() != other {
		t.Fatalf("reopened after the address changed, it left from %s, want %s", got, other)
	}
}

// TestNewConnectionOnOldTuple: a new connection on the tuple of one never seen closing (the pod
// lost it: a restart, a crash) gets the window state of its own handshake, so that its FINs
// count and it closes; as conntrack, which ignores the SYN and gets in sync from the SYN-ACK that
// answers it. The new ISNs lie behind the old connection's, where no acknowledgment of the old
// one would ever move. Both families.
func TestNewConnectionOnOldTuple(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			podEnd, dst := ap(pod(fam.v6, 41), 41000), ap(remote(fam.v6), 443)
			nat := h.handshake(podEnd, dst)
			h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpACK, seq: 1001, ack: 5001, win: 502, wscale: -1, payload: make([]byte, 100)}))
			h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpACK, seq: 5001, ack: 1101, win: 502, wscale: -1, payload: make([]byte, 100)}))
			before := h.events()

			const podISN, srvISN uint32 = 1<<32 + 1000 - 100_000, 1<<32 + 5000 - 200_000
			out := tupleOf(t, h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpSYN, seq: podISN, win: 64240, wscale: 7})))
			if out.src != nat {
				t.Fatalf("the new connection's SYN left from %s, want the mapping %s", out.src, nat)
			}
			back := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpSYN | tcpACK, seq: srvISN, ack: podISN + 1, win: 65160, wscale: 8})))
			if back.dst != podEnd {
				t.Fatalf("the SYN-ACK arrived at %s, want %s", back.dst, podEnd)
			}
			h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpACK, seq: podISN + 1, ack: srvISN + 1, win: 502, wscale: -1}))
			h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpACK, seq: srvISN + 1, ack: podISN + 1, win: 502, wscale: -1, payload: make([]byte, 10)}))
			// The server closes, then the pod.
			h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpFIN | tcpACK, seq: srvISN + 11, ack: podISN + 1, win: 502, wscale: -1}))
			h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpFIN | tcpACK, seq: podISN + 1, ack: srvISN + 12, win: 502, wscale: -1}))
			e, _ := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst)
			r, _ := h.entry(Ingress, unix.IPPROTO_TCP, dst, nat)
			if st := StateOf(e.Flags, r.Flags); st != StateClosing {
				t.Errorf("after both FINs of the new connection the flow is %s", st)
			}
			after := h.events()
			if n := after[Event(masqEventEV_TCP_OUT_OF_WINDOW)] - before[Event(masqEventEV_TCP_OUT_OF_WINDOW)]; n != 0 {
				t.Errorf("%d of the new connection's FINs judged out of window", n)
			}
			if n := after[Event(masqEventEV_REOPEN)] - before[Event(masqEventEV_REOPEN)]; n != 1 {
				t.Errorf("the new connection counted %d times in reopen, want 1", n)
			}
		})
	}
}

// TestRemoteSYNReopensNothing: a remote's SYN on the mapping of a connection its pod opened
// reaches the pod neither after an RST (or FINs) closed it nor while it lives, and changes
// nothing: conntrack holds a SYN from the replying side invalid and applies no NAT to it. The pod
// reopening the tuple still keeps its port, and the remote side of a connection from outside
// still reopens its own. Both families.
func TestRemoteSYNReopensNothing(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			remoteSYN := func(dst, nat netip.AddrPort) {
				t.Helper()
				before := h.events()[Event(masqEventEV_REOPEN)]
				got := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpSegment(dst, nat, seg{flags: tcpSYN, seq: 777, win: 64240, wscale: 7})))
				if got.dst != nat {
					t.Fatalf("the remote's SYN went on to %s, want it left at %s", got.dst, nat)
				}
				if n := h.events()[Event(masqEventEV_REOPEN)]; n != before {
					t.Fatalf("the remote's SYN reopened the mapping")
				}
			}
			podEnd, dst := ap(pod(fam.v6, 42), 42000), ap(remote(fam.v6), 443)
			nat := h.handshake(podEnd, dst)
			remoteSYN(dst, nat) // established
			if e, _ := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst); StateOf(e.Flags, 0) != StateEstablished {
				t.Fatalf("after the remote's SYN the flow is %s", StateOf(e.Flags, 0))
			}
			h.mustPass(h.dp.Egress(), tcpSegment(podEnd, dst, seg{flags: tcpRST, seq: 1001, wscale: -1}))
			if e, _ := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst); StateOf(e.Flags, 0) != StateClosing {
				t.Fatalf("the pod's RST left the flow %s", StateOf(e.Flags, 0))
			}
			remoteSYN(dst, nat) // closed
			e, _ := h.entry(Egress, unix.IPPROTO_TCP, podEnd, dst)
			r, _ := h.entry(Ingress, unix.IPPROTO_TCP, dst, nat)
			if e.Flags&FlagOrig == 0 || r.Flags&FlagOrig != 0 || StateOf(e.Flags, r.Flags) != StateClosing {
				t.Fatalf("the remote's SYN changed the closed flow: %v %v", e.Flags, r.Flags)
			}
			if again := h.handshake(podEnd, dst); again != nat {
				t.Fatalf("the pod reopened the tuple from %s, want its mapping %s", again, nat)
			}

			// A connection from outside to the pod, closed by the remote's RST: its next SYN opens
			// a connection toward the pod again.
			client, server := ap(remote(fam.v6), 33000), ap(pod(fam.v6, 43), 8443)
			h.mustPass(h.dp.Ingress(), tcpSegment(client, server, seg{flags: tcpSYN, seq: 100, win: 64240, wscale: 7}))
			h.mustPass(h.dp.Egress(), tcpSegment(server, client, seg{flags: tcpSYN | tcpACK, seq: 900, ack: 101, win: 64240, wscale: 7}))
			h.mustPass(h.dp.Ingress(), tcpSegment(client, server, seg{flags: tcpRST, seq: 101, wscale: -1}))
			before := h.events()[Event(masqEventEV_REOPEN)]
			if got := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpSegment(client, server, seg{flags: tcpSYN, seq: 5000, win: 64240, wscale: 7}))).dst; got != server {
				t.Fatalf("the client's new SYN arrived at %s, want %s", got, server)
			}
			if n := h.events()[Event(masqEventEV_REOPEN)]; n != before+1 {
				t.Fatalf("the client's new SYN did not reopen its connection")
			}
		})
	}
}
