package bpf

import (
	"bytes"
	"fmt"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket/layers"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

var families = []struct {
	name string
	v6   bool
}{{"ipv4", false}, {"ipv6", true}}

// builder makes a packet of one protocol between two ends, and its reply.
type builder struct {
	name  string
	proto uint8
	// kind is what the NAT translates of the protocol: pktPorts, pktEcho (an identifier), or
	// pktAddr (the address alone).
	kind int
	// ext: IPv6 extension headers precede the L4 header.
	ext  bool
	make func(src, dst netip.AddrPort, data []byte, reply bool) []byte
}

// out is a packet of the flow's direction, back one of its replies.
func (b builder) out(src, dst netip.AddrPort) []byte  { return b.make(src, dst, payload, false) }
func (b builder) back(src, dst netip.AddrPort) []byte { return b.make(src, dst, payload, true) }

// ends are a flow's two ends as the NAT keys them: a query's identifier is on the local end
// (the remote's port is 0), and a protocol without ports has none.
func (b builder) ends(local, remote netip.AddrPort) (netip.AddrPort, netip.AddrPort) {
	switch b.kind {
	case pktEcho:
		return local, ap(remote.Addr(), 0)
	case pktAddr:
		return ap(local.Addr(), 0), ap(remote.Addr(), 0)
	}
	return local, remote
}

var payload = []byte("0123456789abcdefghijklmnopqrstuvwxyz")

// builders are a packet maker for every kind of protocol the NAT translates, in a family.
func builders(v6 bool) []builder {
	icmp := uint8(layers.IPProtocolICMPv4)
	if v6 {
		icmp = uint8(layers.IPProtocolICMPv6)
	}
	query := func(request, reply uint8) func(s, d netip.AddrPort, data []byte, back bool) []byte {
		return func(s, d netip.AddrPort, data []byte, back bool) []byte {
			if back {
				return icmpQuery(s.Addr(), d.Addr(), reply, d.Port(), data)
			}
			return icmpQuery(s.Addr(), d.Addr(), request, s.Port(), data)
		}
	}
	bs := []builder{
		{"tcp", uint8(layers.IPProtocolTCP), pktPorts, false, func(s, d netip.AddrPort, _ []byte, reply bool) []byte {
			if reply {
				return tcpPacket(s, d, tcpSYN|tcpACK, nil)
			}
			return tcpPacket(s, d, tcpSYN, nil)
		}},
		{"udp", uint8(layers.IPProtocolUDP), pktPorts, false, func(s, d netip.AddrPort, data []byte, _ bool) []byte {
			return udpPacket(s, d, data)
		}},
		{"icmp-echo", icmp, pktEcho, false, func(s, d netip.AddrPort, data []byte, reply bool) []byte {
			if reply {
				return echoPacket(s.Addr(), d.Addr(), d.Port(), false, data)
			}
			return echoPacket(s.Addr(), d.Addr(), s.Port(), true, data)
		}},
		{"sctp", protoSCTP, pktPorts, false, func(s, d netip.AddrPort, data []byte, _ bool) []byte { return sctpPacket(s, d, data) }},
		{"udplite", protoUDPLite, pktPorts, false, func(s, d netip.AddrPort, data []byte, _ bool) []byte {
			return portsPacket(protoUDPLite, s, d, data)
		}},
		{"dccp", protoDCCP, pktPorts, false, func(s, d netip.AddrPort, data []byte, _ bool) []byte {
			return portsPacket(protoDCCP, s, d, data)
		}},
		{"gre", uint8(layers.IPProtocolGRE), pktAddr, false, func(s, d netip.AddrPort, data []byte, _ bool) []byte {
			return rawPacket(s.Addr(), d.Addr(), layers.IPProtocolGRE, append([]byte{0, 0, 0x08, 0x00}, data...))
		}},
		{"esp", uint8(layers.IPProtocolESP), pktAddr, false, func(s, d netip.AddrPort, data []byte, _ bool) []byte {
			return rawPacket(s.Addr(), d.Addr(), layers.IPProtocolESP, append([]byte{0, 0, 0x10, 0x01, 0, 0, 0, 1}, data...))
		}},
		{"proto-253", 253, pktAddr, false, func(s, d netip.AddrPort, data []byte, _ bool) []byte {
			return rawPacket(s.Addr(), d.Addr(), 253, data)
		}},
	}
	if v6 {
		return append(bs,
			builder{"icmpv6-node-info", icmp, pktEcho, false, query(139, 140)},
			builder{"udp-dstopts", uint8(layers.IPProtocolUDP), pktPorts, true, func(s, d netip.AddrPort, data []byte, _ bool) []byte {
				return withExt6(udpPacket(s, d, data), 60)
			}},
			builder{"tcp-hbh-routing-dstopts", uint8(layers.IPProtocolTCP), pktPorts, true, func(s, d netip.AddrPort, _ []byte, reply bool) []byte {
				flags := tcpSYN
				if reply {
					flags |= tcpACK
				}
				return withExt6(tcpPacket(s, d, flags, nil), 0, 43, 60)
			}},
		)
	}
	return append(bs,
		builder{"icmp-timestamp", icmp, pktEcho, false, query(13, 14)},
		builder{"icmp-info", icmp, pktEcho, false, query(15, 16)},
		builder{"icmp-address-mask", icmp, pktEcho, false, query(17, 18)},
	)
}

// TestRoundTrip: a masqueraded flow leaves with the uplink address and valid checksums, its
// reply comes back to the pod, and every later packet uses the same mapping.
func TestRoundTrip(t *testing.T) {
	for _, randomFully := range []bool{false, true} {
		h := newHarness(t, defaultPolicy(randomFully), LoadOptions{})
		for _, fam := range families {
			for i, b := range builders(fam.v6) {
				t.Run(fmt.Sprintf("%s/%s/random-fully=%v", fam.name, b.name, randomFully), func(t *testing.T) {
					h.t = t
					podEnd, remoteEnd := b.ends(ap(pod(fam.v6, i+1), 40000+uint16(i)), ap(remote(fam.v6), 443))
					in := b.out(podEnd, remoteEnd)
					out := h.mustPass(h.dp.Egress(), in)
					got := tupleOf(t, out)
					if got.src.Addr() != snatFor(podEnd.Addr()) {
						t.Fatalf("egress source %s, want the uplink address %s", got.src, snatFor(podEnd.Addr()))
					}
					if got.dst != remoteEnd {
						t.Fatalf("egress destination %s, want %s", got.dst, remoteEnd)
					}
					switch port := got.src.Port(); {
					case b.kind == pktAddr && port != 0:
						t.Fatalf("a protocol without ports got port %d", port)
					case b.kind != pktAddr && port < policy.DefaultPortRange.First:
						t.Fatalf("NAT port %d outside the default range %s", port, policy.DefaultPortRange)
					case !randomFully && port != podEnd.Port():
						t.Fatalf("port %d not preserved without --random-fully: got %d", podEnd.Port(), port)
					}
					// Only the source changed: same length, payload intact.
					if len(out) != len(in) {
						t.Fatalf("egress changed the length: %d -> %d", len(in), len(out))
					}
					if b.proto != uint8(layers.IPProtocolTCP) && !bytes.Equal(out[len(out)-len(payload):], payload) {
						t.Fatalf("egress changed the payload")
					}

					reply := b.back(got.dst, got.src)
					back := h.mustPass(h.dp.Ingress(), reply)
					if rt := tupleOf(t, back); rt.dst != podEnd || rt.src != remoteEnd {
						t.Fatalf("reply arrives as %s, want %s -> %s", rt, remoteEnd, podEnd)
					}

					// Later packets of the flow take the same mapping.
					again := h.mustPass(h.dp.Egress(), in)
					if tupleOf(t, again) != got {
						t.Fatalf("second packet %s, first %s", tupleOf(t, again), got)
					}
					e, ok, err := h.dp.LookupNAT(Egress, b.proto, podEnd, remoteEnd)
					if err != nil || !ok {
						t.Fatalf("no egress entry for the flow (err %v)", err)
					}
					if e.Kind != KindMasq || e.To != got.src || e.Flags&FlagOrig == 0 {
						t.Fatalf("egress entry %+v", e)
					}
					s, d := partnerKey(e)
					r, ok, err := h.dp.LookupNAT(Ingress, b.proto, s, d)
					if err != nil || !ok || r.To != podEnd || r.Flags&FlagReplied == 0 {
						t.Fatalf("ingress entry %+v (found %v, err %v)", r, ok, err)
					}
				})
			}
		}
	}
}

// TestSameSourcePortTwoPods: port uniqueness is per remote end, so two pods using the same
// source port toward the same destination must get distinct ports.
func TestSameSourcePortTwoPods(t *testing.T) {
	for _, randomFully := range []bool{false, true} {
		h := newHarness(t, defaultPolicy(randomFully), LoadOptions{})
		for _, fam := range families {
			t.Run(fmt.Sprintf("%s/random-fully=%v", fam.name, randomFully), func(t *testing.T) {
				h.t = t
				dst := ap(remote(fam.v6), 80)
				seen := map[uint16]bool{}
				for i := 1; i <= 20; i++ {
					out := h.mustPass(h.dp.Egress(), tcpPacket(ap(pod(fam.v6, 100+i), 45000), dst, tcpSYN, nil))
					got := tupleOf(t, out)
					if seen[got.src.Port()] {
						t.Fatalf("pod %d got port %d, already given to another pod", i, got.src.Port())
					}
					seen[got.src.Port()] = true
				}
				// The same port toward another destination does not collide.
				out := h.mustPass(h.dp.Egress(), tcpPacket(ap(pod(fam.v6, 200), 45000), ap(remote(fam.v6), 81), tcpSYN, nil))
				if !randomFully && tupleOf(t, out).src.Port() != 45000 {
					t.Fatalf("port toward another destination not preserved: %s", tupleOf(t, out))
				}
			})
		}
	}
}

// TestReopenKeepsMapping: a pod closing a connection and opening the same tuple again keeps
// its NAT port even with random ports, and the flow's state starts over.
func TestReopenKeepsMapping(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			podEnd, dst := ap(pod(fam.v6, 7), 51000), ap(remote(fam.v6), 8080)
			first := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(podEnd, dst, tcpSYN, nil)))
			h.mustPass(h.dp.Ingress(), tcpPacket(dst, first.src, tcpSYN|tcpACK, nil))
			h.mustPass(h.dp.Egress(), tcpPacket(podEnd, dst, tcpFIN|tcpACK, nil))
			h.mustPass(h.dp.Ingress(), tcpPacket(dst, first.src, tcpFIN|tcpACK, nil))
			e, _, _ := h.dp.LookupNAT(Egress, 6, podEnd, dst)
			if e.Flags&FlagFIN == 0 {
				t.Fatalf("FIN not recorded: %+v", e)
			}
			before := h.events()[Event(masqEventEV_REOPEN)]
			again := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(podEnd, dst, tcpSYN, nil)))
			if again.src != first.src {
				t.Fatalf("reopened flow got %s, first time %s", again.src, first.src)
			}
			if n := h.events()[Event(masqEventEV_REOPEN)]; n != before+1 {
				t.Fatalf("reopen events %d, want %d", n, before+1)
			}
			e, _, _ = h.dp.LookupNAT(Egress, 6, podEnd, dst)
			s, d := partnerKey(e)
			r, _, _ := h.dp.LookupNAT(Ingress, 6, s, d)
			if e.Flags&(FlagFIN|FlagRST) != 0 || r.Flags != 0 {
				t.Fatalf("state not reset on reopen: egress %v ingress %v", e.Flags, r.Flags)
			}
			// The reopened flow is established again by its reply, wherever its entries are.
			h.mustPass(h.dp.Ingress(), tcpPacket(dst, first.src, tcpSYN|tcpACK, nil))
			e, _, _ = h.dp.LookupNAT(Egress, 6, podEnd, dst)
			r, _, _ = h.dp.LookupNAT(Ingress, 6, s, d)
			if st := StateOf(e.Flags, r.Flags); st != StateEstablished {
				t.Fatalf("reopened flow after its SYN-ACK: %s (egress %v ingress %v)", st, e.Flags, r.Flags)
			}
		})
	}
}

// TestHostFlows: a host socket on the uplink address keeps its port and is recorded, so a pod
// never gets that port toward that remote; a host socket whose port a pod mapping already holds
// is remapped, and its replies come back to its own port.
func TestHostFlows(t *testing.T) {
	h := newHarness(t, defaultPolicy(false), LoadOptions{})
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			h.t = t
			host := snatFor(pod(fam.v6, 1))
			dst := ap(remote(fam.v6), 443)

			// Host first: untouched, recorded.
			in := tcpPacket(ap(host, 40001), dst, tcpSYN, nil)
			if out := h.mustPass(h.dp.Egress(), in); !bytes.Equal(out, in) {
				t.Fatalf("host packet rewritten: %s", tupleOf(t, out))
			}
			if e, ok, _ := h.dp.LookupNAT(Egress, 6, ap(host, 40001), dst); !ok || e.Kind != KindHost {
				t.Fatalf("host flow not recorded: %+v", e)
			}
			// A pod asking for the same port toward the same remote gets another one.
			got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(pod(fam.v6, 3), 40001), dst, tcpSYN, nil)))
			if got.src.Port() == 40001 {
				t.Fatalf("pod mapping took the host socket's port")
			}
			// The host's reply path is untouched.
			reply := tcpPacket(dst, ap(host, 40001), tcpSYN|tcpACK, nil)
			if out := h.mustPass(h.dp.Ingress(), reply); !bytes.Equal(out, reply) {
				t.Fatalf("reply to the host rewritten: %s", tupleOf(t, out))
			}

			// Pod first: the pod holds 40002 toward dst; a host socket on 40002 is remapped.
			pm := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(pod(fam.v6, 4), 40002), dst, tcpSYN, nil)))
			if pm.src.Port() != 40002 {
				t.Fatalf("pod port not preserved: %s", pm)
			}
			remaps := h.events()[Event(masqEventEV_HOST_REMAP)]
			hm := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(host, 40002), dst, tcpSYN, nil)))
			if hm.src.Addr() != host || hm.src.Port() == 40002 {
				t.Fatalf("host flow %s not remapped away from the pod's port", hm.src)
			}
			if h.events()[Event(masqEventEV_HOST_REMAP)] != remaps+1 {
				t.Fatalf("host remap not counted")
			}
			back := tupleOf(t, h.mustPass(h.dp.Ingress(), tcpPacket(dst, hm.src, tcpSYN|tcpACK, nil)))
			if back.dst != ap(host, 40002) {
				t.Fatalf("remapped host reply arrives at %s, want %s", back.dst, ap(host, 40002))
			}
			// And the pod's replies still reach the pod.
			back = tupleOf(t, h.mustPass(h.dp.Ingress(), tcpPacket(dst, pm.src, tcpSYN|tcpACK, nil)))
			if back.dst != ap(pod(fam.v6, 4), 40002) {
				t.Fatalf("pod reply arrives at %s", back.dst)
			}
		})
	}
}

// TestInboundReplyUntouched: a connection opened from outside toward a pod is recorded on
// ingress, so the pod's replies leave with the pod's address even though the policy would
// masquerade traffic to that remote.
func TestInboundReplyUntouched(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	for _, fam := range families {
		for i, b := range builders(fam.v6) {
			t.Run(fam.name+"/"+b.name, func(t *testing.T) {
				h.t = t
				client, server := b.ends(ap(remote(fam.v6), 33000+uint16(i)), ap(pod(fam.v6, 50+i), 8443))
				if v := h.p.Decide(client.Addr()); v.Action != policy.Masquerade {
					t.Fatalf("test needs a masqueraded remote, got %v", v)
				}
				req := b.out(client, server)
				if out := h.mustPass(h.dp.Ingress(), req); !bytes.Equal(out, req) {
					t.Fatalf("inbound packet rewritten")
				}
				reply := b.back(server, client)
				for n := 0; n < 3; n++ {
					if out := h.mustPass(h.dp.Egress(), reply); !bytes.Equal(out, reply) {
						t.Fatalf("reply to an inbound flow rewritten: %s", tupleOf(t, out))
					}
				}
				e, ok, _ := h.dp.LookupNAT(Egress, b.proto, tupleOf(t, reply).src, tupleOf(t, reply).dst)
				if !ok || e.Kind != KindInbound {
					t.Fatalf("inbound flow not recorded: %+v", e)
				}
			})
		}
	}
}

// TestInboundOnlyForThisHost: only packets addressed to this host open inbound flows; frames
// for other hosts (promiscuous mode) and multicast do not fill the table.
func TestInboundOnlyForThisHost(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	other := udpPacket(ap(remote4, 5000), ap(pod4(1), 53), payload)
	copy(other[0:6], []byte{2, 0, 0, 0, 0, 9}) // another host's MAC: PACKET_OTHERHOST
	mcast4 := udpPacket(ap(remote4, 5000), ap(netip.MustParseAddr("239.1.2.3"), 53), payload)
	copy(mcast4[0:6], []byte{0x01, 0x00, 0x5e, 0x01, 0x02, 0x03})
	mcast6 := udpPacket(ap(remote6, 5000), ap(netip.MustParseAddr("ff05::1:3"), 547), payload)
	copy(mcast6[0:6], []byte{0x33, 0x33, 0, 1, 0, 3})
	for name, frame := range map[string][]byte{"other host": other, "multicast": mcast4, "ipv6 multicast": mcast6} {
		if out := h.mustPass(h.dp.Ingress(), frame); !bytes.Equal(out, frame) {
			t.Fatalf("%s: rewritten", name)
		}
	}
	if n := h.events()[Event(masqEventEV_INBOUND_FLOW)]; n != 0 {
		t.Fatalf("%d inbound flows recorded", n)
	}
}

// TestICMPErrorTranslated: ICMP errors quoting a masqueraded flow are translated in the outer
// and the quoted headers, with valid checksums everywhere, in both directions.
func TestICMPErrorTranslated(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	router4, router6 := netip.MustParseAddr("203.0.113.9"), netip.MustParseAddr("2001:db8:eeee::9")
	type errKind struct {
		name      string
		typ, code uint8
		rest      uint32
	}
	for _, fam := range families {
		router := router4
		kinds := []errKind{{"frag-needed", 3, 4, 1400}, {"port-unreachable", 3, 3, 0}, {"time-exceeded", 11, 0, 0}}
		if fam.v6 {
			router = router6
			kinds = []errKind{{"packet-too-big", 2, 0, 1280}, {"port-unreachable", 1, 4, 0}, {"time-exceeded", 3, 0, 0}}
		}
		for _, b := range builders(fam.v6) {
			if b.ext {
				continue // extension headers in a quote are not walked: see TestUntranslatable
			}
			for _, k := range kinds {
				t.Run(fam.name+"/"+b.name+"/"+k.name, func(t *testing.T) {
					h.t = t
					podEnd, dst := b.ends(ap(pod(fam.v6, 77), 41000), ap(remote(fam.v6), 53))
					orig := b.out(podEnd, dst)
					sent := h.mustPass(h.dp.Egress(), orig)
					nat := tupleOf(t, sent).src

					// Ingress: a router's error about the packet as it left (from the NAT end).
					errIn := icmpErrorPacket(router, nat.Addr(), k.typ, k.code, k.rest, sent)
					got := h.mustPass(h.dp.Ingress(), errIn)
					want := icmpErrorPacket(router, podEnd.Addr(), k.typ, k.code, k.rest, orig)
					if !bytes.Equal(got, want) {
						t.Fatalf("ingress error not translated back to the original flow:\ngot\n%s\nwant\n%s", describe(got), describe(want))
					}

					// Egress: the pod reports an error about a reply it received; the far end
					// must see its own packet to the NAT end quoted, from the uplink address.
					reply := b.back(dst, nat)
					recv := h.mustPass(h.dp.Ingress(), reply)
					errOut := icmpErrorPacket(podEnd.Addr(), dst.Addr(), k.typ, k.code, k.rest, recv)
					got = h.mustPass(h.dp.Egress(), errOut)
					want = icmpErrorPacket(nat.Addr(), dst.Addr(), k.typ, k.code, k.rest, reply)
					if !bytes.Equal(got, want) {
						t.Fatalf("egress error not translated to the NAT flow:\ngot\n%s\nwant\n%s", describe(got), describe(want))
					}
				})
			}
		}
	}
}

// TestPassUnchanged: what is not IP, or whose IP header is unusable, goes through both programs
// untouched and opens nothing; so do the packets the NAT cannot translate on ingress (they are
// for the node's stack as they are), a node's own ICMP of a type conntrack does not track
// (neighbour discovery), and a pod's untranslatable packet to a RETURN destination.
func TestPassUnchanged(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	src4, dst4 := ap(pod4(9), 40000), ap(remote4, 80)
	arp := serializeRaw(&layers.Ethernet{SrcMAC: macA, DstMAC: macB, EthernetType: layers.EthernetTypeARP},
		&layers.ARP{AddrType: layers.LinkTypeEthernet, Protocol: layers.EthernetTypeIPv4, HwAddressSize: 6,
			ProtAddressSize: 4, Operation: 1, SourceHwAddress: macA, SourceProtAddress: []byte{10, 1, 0, 9},
			DstHwAddress: make([]byte, 6), DstProtAddress: []byte{10, 1, 0, 1}})
	tcp4 := tcpPacket(src4, dst4, tcpSYN, nil)
	udp4 := udpPacket(src4, dst4, payload)
	badVersion := append([]byte(nil), udp4...)
	badVersion[14] = 0x55
	ns := icmpQuery(netip.MustParseAddr("fe80::1"), netip.MustParseAddr("ff02::1:ff00:1"), 135, 0, make([]byte, 16))
	cases := []struct {
		name  string
		frame []byte
		ctx   skbContext
		progs string // "egress", "ingress" or "both"
	}{
		{"arp", arp, forwarded, "both"},
		{"ipv4 options beyond frame", withIHL(tcp4[:14+20], 15), forwarded, "both"},
		{"ip version 5", badVersion, forwarded, "both"},
		// Frames shorter than Ethernet plus the IP header are refused by BPF_PROG_TEST_RUN
		// itself, so truncation is exercised past the IP header.
		{"tcp header cut, ingress", tcp4[:14+20+12], forwarded, "ingress"},
		{"neighbour solicitation of the node", ns, skbContext{}, "both"},
		{"untracked ICMP from a pod, ingress", icmpQuery(remote4, pod4(9), 10, 0, nil), forwarded, "ingress"},
		{"pod's cut TCP header to a RETURN destination", tcpPacket(src4, ap(netip.MustParseAddr("10.2.0.1"), 80), tcpSYN, nil)[:14+20+12], forwarded, "egress"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h.t = t
			for _, prog := range []struct {
				name string
				p    *ebpf.Program
			}{{"egress", h.dp.Egress()}, {"ingress", h.dp.Ingress()}} {
				if c.progs != "both" && c.progs != prog.name {
					continue
				}
				ret, out := runCtx(t, prog.p, c.frame, c.ctx)
				if ret != tcNext || !bytes.Equal(out[:len(c.frame)], c.frame) {
					t.Fatalf("%s: verdict %d, changed %v", prog.name, int32(ret), !bytes.Equal(out[:len(c.frame)], c.frame))
				}
			}
		})
	}
	for _, fam := range policy.Families() {
		n := 0
		if err := h.dp.NATEntries(fam, func(NATEntry) bool { n++; return true }); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Fatalf("%s: %d NAT entries created by packets that should open nothing", fam, n)
		}
	}
	if n := h.events()[Event(masqEventEV_DROP_UNTRANSLATABLE)]; n != 0 {
		t.Fatalf("%d untranslatable drops", n)
	}
}

// TestPortExhaustion: with a tiny port range the flows beyond it are dropped and counted, and
// the flows that got ports keep working.
func TestPortExhaustion(t *testing.T) {
	for _, randomFully := range []bool{false, true} {
		t.Run(fmt.Sprintf("random-fully=%v", randomFully), func(t *testing.T) {
			p := policy.Compile(config.Default(config.Options{EnableIPv6: true}), policy.Options{
				EnableIPv6: true, RandomFully: randomFully,
				ToPorts: policy.PortRanges{{First: 5000, Last: 5001}, {First: 6000, Last: 6002}},
			})
			h := newHarness(t, p, LoadOptions{})
			for _, fam := range families {
				dst := ap(remote(fam.v6), 25)
				before := h.events()
				var mapped []tuple
				ports := map[uint16]bool{}
				for i := 0; i < 8; i++ {
					in := udpPacket(ap(pod(fam.v6, 300+i), 7000), dst, payload)
					ret, out := h.egress(in)
					if i < 5 {
						if ret != tcNext {
							t.Fatalf("%s flow %d of 5 ports: verdict %d", fam.name, i, ret)
						}
						got := tupleOf(t, out)
						if p := got.src.Port(); ports[p] || !((p >= 5000 && p <= 5001) || (p >= 6000 && p <= 6002)) {
							t.Fatalf("%s flow %d: port %d duplicate or outside 5000-5001,6000-6002", fam.name, i, p)
						}
						ports[got.src.Port()] = true
						mapped = append(mapped, got)
						continue
					}
					if ret != tcActShot {
						t.Fatalf("%s flow %d beyond the range: verdict %d, want TC_ACT_SHOT", fam.name, i, ret)
					}
				}
				after := h.events()
				if d := after[EventDropNoPort] - before[EventDropNoPort]; d != 3 {
					t.Fatalf("%s: %d drops counted, want 3", fam.name, d)
				}
				// 5 flows over 5 ports: retries are certain; each failure tried all 5.
				if d := after[EventPortRetry] - before[EventPortRetry]; d < 15 {
					t.Fatalf("%s: %d port retries counted, want at least 15", fam.name, d)
				}
				for i, m := range mapped {
					back := tupleOf(t, h.mustPass(h.dp.Ingress(), udpPacket(dst, m.src, payload)))
					if back.dst != ap(pod(fam.v6, 300+i), 7000) {
						t.Fatalf("%s: reply of flow %d arrives at %s", fam.name, i, back.dst)
					}
				}
			}
		})
	}
}

// TestRuleCounters: every packet a rule decides is counted once, with its IP length; packets
// of a masqueraded flow keep counting on the rule that created it.
func TestRuleCounters(t *testing.T) {
	cfg := config.Default(config.Options{EnableIPv6: true})
	cfg.MasqueradeCIDRs = []config.MasqueradeCIDR{{CIDR: netip.MustParsePrefix("10.9.0.0/16")}, {CIDR: netip.MustParsePrefix("2001:db8:9::/48")}}
	cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs, netip.MustParsePrefix("fd99::/16"))
	p := policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true})
	h := newHarness(t, p, LoadOptions{})

	type send struct {
		dst   netip.Addr
		sizes []int // payload sizes of the packets of one flow
	}
	sends := []send{
		{netip.MustParseAddr("10.9.1.1"), []int{0, 100, 1000}}, // masqueradeCIDRs[0]
		{netip.MustParseAddr("10.2.3.4"), []int{10, 20}},       // nonMasqueradeCIDRs: 10/8
		{netip.MustParseAddr("169.254.1.1"), []int{5}},         // link-local
		{netip.MustParseAddr("8.8.8.8"), []int{1, 2, 3, 4}},    // outbound
		{netip.MustParseAddr("8.8.4.4"), []int{300}},           // outbound
		{netip.MustParseAddr("2001:db8:9::1"), []int{7, 8}},    // masqueradeCIDRs[1]
		{netip.MustParseAddr("fe80::1"), []int{9}},             // link-local v6
		{netip.MustParseAddr("fd99::1"), []int{11, 12, 13}},    // nonMasqueradeCIDRs v6
		{netip.MustParseAddr("2600::1"), []int{500, 600}},      // outbound v6
	}
	type count struct{ packets, bytes uint64 }
	want := map[*policy.Rule]count{}
	for i, s := range sends {
		v := p.Decide(s.dst)
		src := ap(pod(s.dst.Is6(), 900+i), 5353)
		for _, size := range s.sizes {
			frame := udpPacket(src, ap(s.dst, 53), make([]byte, size))
			h.mustPass(h.dp.Egress(), frame)
			c := want[v.Rule]
			c.packets++
			c.bytes += uint64(len(frame) - 14)
			want[v.Rule] = c
		}
	}
	stats, err := h.dp.RuleStats()
	if err != nil {
		t.Fatal(err)
	}
	if len(stats) != len(p.IPv4)+len(p.IPv6) {
		t.Fatalf("%d rule counters for %d rules", len(stats), len(p.IPv4)+len(p.IPv6))
	}
	for _, s := range stats {
		var w count
		for r, c := range want {
			if r != nil && *r == s.Rule {
				w = c
			}
		}
		if s.Packets != w.packets || s.Bytes != w.bytes {
			t.Errorf("%s rule %d (%s %s): %d packets %d bytes, want %d and %d", s.Rule.Family, s.Number,
				s.Rule.Prefix, s.Rule.Action, s.Packets, s.Bytes, w.packets, w.bytes)
		}
	}
}

func withIHL(frame []byte, ihl int) []byte {
	f := append([]byte(nil), frame...)
	f[14] = 0x40 | byte(ihl)
	return f
}

// TestReturnFlowsStayOutOfTheNATTable: the replies of a flow the policy keeps (RETURN), and a
// connection opened toward a pod from a remote the policy keeps, record nothing: their packets
// need no NAT in either direction. So they neither fill the NAT table (evicting real mappings)
// nor stop counting: every egress packet of a RETURN flow counts on its rule.
func TestReturnFlowsStayOutOfTheNATTable(t *testing.T) {
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	kept := netip.MustParseAddr("10.1.2.3") // nonMasqueradeCIDRs[0]
	if v := h.p.Decide(kept); v.Action != policy.Return {
		t.Fatalf("test needs a kept remote, got %v", v)
	}
	podEnd, remoteEnd := ap(pod4(7), 41000), ap(kept, 443)
	frames := []struct {
		ingress bool
		frame   []byte
	}{
		{false, tcpPacket(podEnd, remoteEnd, tcpSYN, nil)},          // the pod connects
		{true, tcpPacket(remoteEnd, podEnd, tcpSYN|tcpACK, nil)},    // the reply
		{false, tcpPacket(podEnd, remoteEnd, tcpACK, payload)},      // the pod goes on
		{true, udpPacket(ap(kept, 5353), ap(pod4(8), 53), payload)}, // opened from a kept remote
		{false, udpPacket(ap(pod4(8), 53), ap(kept, 5353), payload)},
	}
	var egressBytes uint64
	for i, f := range frames {
		prog := h.dp.Egress()
		if f.ingress {
			prog = h.dp.Ingress()
		} else {
			egressBytes += uint64(len(f.frame) - 14) // the IP packet, as the rule counts it
		}
		if out := h.mustPass(prog, f.frame); !bytes.Equal(out, f.frame) {
			t.Fatalf("frame %d rewritten: %s", i, tupleOf(t, out))
		}
	}
	if flows := h.flowsOf(policy.IPv4); len(flows) != 0 {
		t.Errorf("NAT table holds %v, want nothing", flows)
	}
	if n := h.events()[Event(masqEventEV_INBOUND_FLOW)]; n != 0 {
		t.Errorf("%d inbound flows recorded", n)
	}
	if s := h.statsByPrefix()["10.0.0.0/8 RETURN"]; s.Packets != 3 || s.Bytes != egressBytes {
		t.Errorf("10.0.0.0/8 counted %d packets, %d bytes; want every egress packet: 3, %d", s.Packets, s.Bytes, egressBytes)
	}
}
